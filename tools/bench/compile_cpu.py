"""CPU benchmark: training tokens/s with `train.compile` on and off (moe_lc/parallel/compile.py), one process.

    python -m tools.bench.compile_cpu --out docs/results/compile-cpu      # both models, fp32 and bf16
    python -m tools.bench.compile_cpu --models debug --precisions fp32 --rounds 4 --threads 1

Models: "debug" is recipes/debug_cpu.toml as it stands (1.5M parameters: dim 128, 4 blocks, 8 routed
experts top-2 + 1 shared; 16 sequences x 128 tokens a step in 4 micro-batches); "large" the same at dim 512,
8 blocks, 8 heads of 64 (4 KV heads), dense FFN 1536, experts 384 wide (46.4M parameters, 21.3M activated).
Each runs in fp32 and in bf16 (`precision.recipe`), on one process (pp = dp = tp = ep = cp = 1).

Method: each model and precision is a fresh process with an empty inductor cache (so "compile s" is what
a first run pays; later runs read inductor's on-disk cache). In it two Trainers (compile off, on) are built
from the same recipe and fed the same fixed random batches (no data cost, as tools/bench/model_step.py
does). Each runs `--warmup` steps first (the compiled one compiles in its first step: its start-up line is
printed), then the two alternate one step each for `--rounds` rounds, in swapped order every other round,
so that load from elsewhere on a shared machine falls on both alike. Reported per pair: the fastest step
of each (tokens/s from it), the speedup as the median over rounds of the two steps' time ratio (robust to
load that changes between rounds), and the largest relative difference of their losses over the timed
steps (the two train in lockstep). Results: a table on stdout, and `results.json` / `results.md` under `--out`.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/compile_cpu.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.compile_cpu", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_lc.config import load_config
from moe_lc.model.counting import param_counts

from .common import ROOT, load_average

MODELS = {
    "debug": [],
    "large": ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=1536",
              "model.moe.ffn_dim=384"],
}
PRECISIONS = ("fp32", "bf16")
COLUMNS = ("model", "precision", "params", "eager tok/s", "compiled tok/s", "speedup", "eager step ms",
           "compiled step ms", "compile s", "graphs", "loss rel diff")  # tok/s and ms: the fastest step


class FixedBatches:
    """Stands in for the trainer's StepLoader: the same random micro-batches every step (one source)."""

    samples_consumed = 0
    dataset = None

    def __init__(self, cfg):
        t = cfg.train
        g = torch.Generator().manual_seed(0)
        self.micro = [{"tokens": torch.randint(0, 256, (t.micro_batch, t.seq_len + 1), generator=g), "loss_mask": None}
                      for _ in range(t.microbatches(1))]

    def next_step(self) -> list[dict]:
        return self.micro


def build(model: str, precision: str, compiled: bool, work: Path):
    from moe_lc.train import Trainer

    overrides = MODELS[model] + [f"precision.recipe={precision}", f"train.compile={str(compiled).lower()}",
                                 "parallel.dp=1", "train.device=cpu", "checkpoint.interval=0",
                                 f"train.threads={torch.get_num_threads()}",  # --threads, not the trainer's auto
                                 f"train.output_dir={(work / f'{model}-{precision}-{compiled}').as_posix()}"]
    cfg = load_config(ROOT / "recipes" / "debug_cpu.toml", overrides, world_size=1)
    trainer = Trainer(cfg)
    trainer.loader = FixedBatches(cfg)
    return trainer, cfg


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def timed_step(trainer) -> tuple[float, float]:
    """(seconds, loss) of one training step."""
    start = time.perf_counter()
    result = trainer.train_step()
    return time.perf_counter() - start, result.loss


def measure(model: str, precision: str, rounds: int, warmup: int, work: Path) -> dict:
    """Both trainers of one model and precision, in this process (see the module docstring)."""
    eager, cfg = build(model, precision, False, work)
    compiled, _ = build(model, precision, True, work)
    for step in range(warmup):
        timed_step(eager)
        timed_step(compiled)
        if step == 0:
            print(f"  {compiled.compile_watch.summary()}", file=sys.stderr, flush=True)
    times, losses = {False: [], True: []}, {False: [], True: []}
    for i in range(rounds):
        for which, trainer in ((False, eager), (True, compiled))[::1 if i % 2 == 0 else -1]:
            seconds, loss = timed_step(trainer)
            times[which].append(seconds)
            losses[which].append(loss)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    best = {k: min(v) for k, v in times.items()}
    counts = compiled.compile_watch.counts()
    c = param_counts(cfg.model)
    return {"model": model, "precision": precision, "params_m": c["total"] / 1e6, "activated_m": c["activated"] / 1e6,
            "tokens_per_step": tokens, "eager_step_s": best[False], "compiled_step_s": best[True],
            "eager_tokens_per_s": tokens / best[False], "compiled_tokens_per_s": tokens / best[True],
            "speedup": statistics.median(e / c for e, c in zip(times[False], times[True])),
            "eager_steps_s": times[False], "compiled_steps_s": times[True],
            "compile_s": counts["compile/time_s"], "graphs": counts["compile/graphs"],
            "graph_breaks": counts["compile/graph_breaks"], "recompiles": counts["compile/recompiles"],
            "loss_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(losses[False], losses[True]))}


def measure_in_fresh_process(model: str, precision: str, args) -> dict:
    """`measure` in a new Python process with its own empty inductor cache; its JSON result."""
    with tempfile.TemporaryDirectory(prefix="moe_lc_compile_bench_") as work:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(work) / "inductor")}
        argv = [sys.executable, "-m", "tools.bench.compile_cpu", "--pair", model, precision, "--rounds", str(args.rounds),
                "--warmup", str(args.warmup), "--threads", str(args.threads), "--work", work]
        proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(r: dict) -> list[str]:
    return [r["model"], r["precision"], f"{r['params_m']:.1f}M ({r['activated_m']:.1f}M act.)",
            f"{r['eager_tokens_per_s']:,.0f}", f"{r['compiled_tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x",
            f"{1e3 * r['eager_step_s']:.0f}", f"{1e3 * r['compiled_step_s']:.0f}", f"{r['compile_s']:.1f}",
            f"{r['graphs']:.0f}", f"{r['loss_rel_diff']:.1e}"]


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"CPU: {meta['cpu']} ({meta['cores']} cores), {meta['threads']} torch thread(s), torch {meta['torch']}, "
             f"{meta['rounds']} alternating timed steps each after {meta['warmup']} warm-up step(s) (tok/s and "
             f"step ms: the fastest step; speedup: the median per-round ratio), "
             f"load average before {meta['load_before']}, after {meta['load_after']}.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.compile_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated subset of fp32,bf16")
    ap.add_argument("--rounds", type=int, default=6, help="timed steps of each trainer, alternating (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each first; the first compiles (2)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads (default: all)")
    ap.add_argument("--out", default=None, help="write results.json and results.md here")
    ap.add_argument("--pair", nargs=2, metavar=("MODEL", "PRECISION"), help=argparse.SUPPRESS)  # one fresh process's
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.precisions = [p for p in args.precisions.split(",") if p]
    bad = [m for m in args.models if m not in MODELS] + [p for p in args.precisions if p not in PRECISIONS]
    if bad or args.rounds < 1 or args.warmup < 1 or args.threads < 1:
        ap.error(f"unknown model / precision {bad}, or --rounds / --warmup / --threads below 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.pair:  # the child process of `measure_in_fresh_process`: its result as the last line on stdout
        print(json.dumps(measure(*args.pair, args.rounds, args.warmup, Path(args.work))))
        return 0
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
            "torch": torch.__version__, "rounds": args.rounds, "warmup": args.warmup,
            "load_before": load_average(), "argv": sys.argv[1:] if argv is None else argv}
    results = []
    for model in args.models:
        for precision in args.precisions:
            print(f"{model} {precision}:", flush=True)
            results.append(measure_in_fresh_process(model, precision, args))
            print("  " + " | ".join(f"{c} {v}" for c, v in zip(COLUMNS[3:], row(results[-1])[3:])), flush=True)
    meta["load_after"] = load_average()
    text = markdown(results, meta)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        (out / "results.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
