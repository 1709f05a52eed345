"""CPU benchmark: one eager training step per process while N one-thread processes share the machine.

    python -m tools.bench.shared_cpu --out docs/results/steptime      # N = 4 (overlap_cpu's gloo ranks)
    python -m tools.bench.shared_cpu --procs 1 --out docs/results/steptime   # one process alone: shared_cpu_1.json

Why: tools/step_time/cpu.py predicts recipes/overlap_cpu.toml, whose 4 gloo ranks share this machine's 2
cores. Rates measured by one process alone and divided by ranks / cores leave out what sharing costs
(caches, memory bandwidth and the scheduler split four ways); these are measured the way a rank runs.

Method: for each model of tools/bench/compile_cpu.py ("debug", "large"), fp32, eager, N processes start
together, each builds the trainer (compile_cpu.build, fixed random batches: no data cost), runs one
warm-up step and `--steps` timed steps; a process reports its fastest step. The model's figure is the
median over the N processes. Results: results.json beside a one-line table per model on stdout.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/shared_cpu.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.shared_cpu", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .common import ROOT, load_average
from .compile_cpu import MODELS, build, cpu_name, timed_step

OUT_NAME = "shared_cpu.json"


def one_process(model: str, steps: int, work: Path) -> dict:
    """This process's fastest eager fp32 step of `model` (one thread)."""
    trainer, cfg = build(model, "fp32", False, work)
    timed_step(trainer)  # warm-up: allocator, first-touch
    times = [timed_step(trainer)[0] for _ in range(steps)]
    return {"model": model, "step_s": min(times), "steps_s": times,
            "tokens_per_step": cfg.train.global_batch * cfg.train.seq_len}


def measure(model: str, procs: int, steps: int) -> dict:
    """`procs` processes of `one_process` started together -> the median of their fastest steps."""
    with tempfile.TemporaryDirectory(prefix="moe_lc_shared_cpu_") as work:
        argv = [sys.executable, "-m", "tools.bench.shared_cpu", "--child", model, "--steps", str(steps)]
        children = [subprocess.Popen(argv + ["--work", f"{work}/{i}"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
                    for i in range(procs)]
        rows = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in children]
        if any(c.returncode for c in children):
            raise SystemExit(f"a {model} process failed")
    return {"model": model, "precision": "fp32", "procs": procs, "eager_step_s": statistics.median(r["step_s"] for r in rows),
            "per_process_step_s": [r["step_s"] for r in rows], "tokens_per_step": rows[0]["tokens_per_step"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.shared_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4, help="processes sharing the machine (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per process (default 4)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--out", default=None, help=f"write {OUT_NAME} here (shared_cpu_1.json for --procs 1: the steps alone)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.procs < 1 or args.steps < 1 or not models or set(models) - set(MODELS):
        ap.error(f"--procs and --steps must be >= 1, --models a subset of {','.join(MODELS)}")
    torch.set_num_threads(1)
    if args.child:  # one of `measure`'s processes: its result as the last line on stdout
        print(json.dumps(one_process(args.child, args.steps, Path(args.work))))
        return 0
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "procs": args.procs, "threads_per_proc": 1,
            "steps": args.steps, "torch": torch.__version__,
            "load_before": load_average()}
    results = []
    for model in models:
        results.append(measure(model, args.procs, args.steps))
        r = results[-1]
        print(f"{model}: {args.procs} processes, fastest step median {r['eager_step_s']:.3f} s "
              f"(each: {', '.join(f'{t:.3f}' for t in r['per_process_step_s'])})", flush=True)
    meta["load_after"] = load_average()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "shared_cpu_1.json" if args.procs == 1 else OUT_NAME
        (out / name).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
