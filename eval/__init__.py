"""Long-context eval harness: `python -m eval RUN_DIR_or_CHECKPOINT ...` (see eval/run.py).

model_io.py   find the checkpoint and recipe, load the "model" entry, the forward (CP hook)
tasks.py      passkey, multi-key needle, variable tracking: seeded samples, teacher-forced scores, chance
ruler.py      RULER's 13 tasks by name (niah_*, vt; ruler_lists.py: cwe, fwe; ruler_qa.py: qa_1, qa_2);
              ruler_sample.py: a prompt + reference answer of exactly `length` tokens; words.py: keys, values
haystack.py   real-text haystacks: the stdlib's docstrings by default, --haystack text or token file
ruler_run.py  RULER's scoring: string match over a greedy generation (KV cache), teacher-forced exact beside
summary.py    the summary table per run (task x length, RULER's average), in results.json and summary.png
perplexity.py sliding-window perplexity by context length, loss by token position
plots.py      depth x length heatmaps, accuracy by length, perplexity figures, the summary table
lm_eval.py    lm-evaluation-harness bridge: `python -m eval.lm_eval run --model moe_lc ...` ([eval] extra),
              its arguments checked first; lm_eval_model.py: the checkpoint behind lm_eval's LM interface
inputs.py     the command line's values checked before anything loads: one `error:` line per mistake
outputs.py    the output folder: an earlier eval's results are refused or (--overwrite) replaced whole
run.py        the command line: runs the tasks, writes results.json and the PNGs
"""
