"""Long-context eval harness: `python -m eval RUN_DIR_or_CHECKPOINT ...` (see eval/run.py).

model_io.py   find the checkpoint and recipe, load the "model" entry, the forward (CP hook)
tasks.py      passkey, multi-key needle, variable tracking: seeded samples, teacher-forced scores, chance
perplexity.py sliding-window perplexity by context length, loss by token position
plots.py      depth x length heatmaps, accuracy by length, perplexity figures
run.py        the command line: runs the tasks, writes results.json and the PNGs
"""
