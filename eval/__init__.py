"""Long-context eval harness: `python -m eval RUN_DIR_or_CHECKPOINT ...` (see eval/run.py).

model_io.py   find the checkpoint and recipe, load the "model" entry, the forward (CP hook)
tasks.py      passkey, multi-key needle, variable tracking: seeded samples, teacher-forced scores, chance
perplexity.py sliding-window perplexity by context length, loss by token position
plots.py      depth x length heatmaps, accuracy by length, perplexity figures
inputs.py     the command line's values checked before anything loads: one `error:` line per mistake
outputs.py    the output folder: an earlier eval's results are refused or (--overwrite) replaced whole
run.py        the command line: runs the tasks, writes results.json and the PNGs
"""
