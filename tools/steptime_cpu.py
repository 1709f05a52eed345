"""The `cpu` cluster of tools/clusters.py, fitted from tools/bench's CPU measurements, and its prediction
of recipes/overlap_cpu.toml against that recipe's measured steps.

    python -m tools.steptime_cpu [--out docs/results/steptime]

The fit: tools/bench/compile_cpu.py timed one training step of two models on one core of this machine
in fp32, eager (docs/results/compile-cpu/results.json: "debug" and "large"). Each step's time is
FLOP-equivalents / R + memory-bound bytes / BW, both counted as tools/steptime.py counts them (its F + B
per micro-batch, efficiencies 1: the rates are achieved ones); two steps, two unknowns, solved exactly.
One rank of recipes/overlap_cpu.toml gets cores / ranks of those rates (4 gloo ranks on the 2 cores),
and its collectives the recipe's modelled link (`parallel.link`, 0.1 GB/s; the default link efficiency
stays). The prediction is held to the three measured pipeline runs of docs/results/overlap-cpu.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/steptime_cpu.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.steptime_cpu", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
from pathlib import Path

from moe_lc.config import load_config
from .bench.compile_cpu import MODELS
from .clusters import CLUSTERS, EFFICIENCY, Cluster, resolve
from .steptime import seconds, stage_work

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs/results/compile-cpu/results.json"
MEASURED = ROOT / "docs/results/overlap-cpu/results.json"
RECIPE = ROOT / "recipes/overlap_cpu.toml"
RANKS = 4  # overlap_cpu's gloo ranks
ACHIEVED = {"gemm": 1.0, "gemm_fp8": 1.0, "grouped_gemm": 1.0, "grouped_gemm_fp8": 1.0, "attention": 1.0, "memory": 1.0}
RUNS = {"dualpipe": [], "dualpipe_no_overlap": ["parallel.overlap=false"], "1f1b": ["parallel.pp_schedule=1f1b"]}


def _step_terms(cfg) -> tuple[float, float]:
    """(FLOP-equivalents, bytes) of one single-process step as tools/steptime.py times it."""
    per_flop = Cluster("unit", 1e-12, 1e-12, 1e30, 1.0, 1.0, 1.0, 1, fp32_tflops=1e-12)  # 1 FLOP/s, free memory
    per_byte = Cluster("unit", 1e30, 1e30, 1e-9, 1.0, 1.0, 1.0, 1, fp32_tflops=1e30)  # 1 B/s, free FLOPs
    work, eff = stage_work(cfg, list(range(cfg.model.n_layers)), True, True), {**EFFICIENCY, **ACHIEVED}
    m = cfg.train.microbatches(1)
    a, b = seconds(cfg, work, per_flop, eff), seconds(cfg, work, per_byte, eff)
    return m * (a.F + a.B), m * (b.F + b.B)


def fit(bench: Path = BENCH) -> dict:
    """{"flops_per_s", "bytes_per_s", "cores"} of one core, from the bench's fp32 eager steps."""
    data = json.loads(bench.read_text())
    rows = []
    for r in (r for r in data["results"] if r["precision"] == "fp32"):
        cfg = load_config(ROOT / "recipes/debug_cpu.toml", MODELS[r["model"]] + ["precision.recipe=fp32"], world_size=1)
        rows.append((*_step_terms(cfg), r["eager_step_s"]))
    (a1, b1, t1), (a2, b2, t2) = rows
    det = a1 * b2 - a2 * b1
    x, y = (t1 * b2 - t2 * b1) / det, (a1 * t2 - a2 * t1) / det
    assert x > 0 and y > 0, (x, y)
    return {"flops_per_s": 1 / x, "bytes_per_s": 1 / y, "cores": data["meta"]["cores"]}


def cluster_from_fit(f: dict) -> Cluster:
    """One of RANKS ranks sharing the cores: cores / RANKS of each rate; links at overlap_cpu's 0.1 GB/s."""
    share = f["cores"] / RANKS
    tflops = f["flops_per_s"] * share / 1e12
    return Cluster("cpu", tflops, tflops, f["bytes_per_s"] * share / 1e9, 1e3, 0.1, 0.1, RANKS, fp32_tflops=tflops)


def main(argv=None) -> int:
    from .plan import plan
    from .steptime import predict

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/steptime")
    args = ap.parse_args(argv)
    f = fit()
    cluster, eff = resolve("cpu")
    measured = json.loads(MEASURED.read_text())
    rows = []
    for run, sets in RUNS.items():
        cfg = load_config(RECIPE, sets, world_size=RANKS)
        pred = predict(cfg, plan(cfg, RANKS, str(RECIPE)), cluster, {**eff, **ACHIEVED})
        rows.append({"run": run, "measured_step_s": measured[run]["step_s"], "predicted": pred,
                     "error": pred["step_s"] / measured[run]["step_s"] - 1})
        print(f"{run}: predicted {pred['step_s']:.3f} s, measured {measured[run]['step_s']:.3f} s "
              f"({rows[-1]['error']:+.1%})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu.json"), "w") as fh:
        json.dump({"fit": f, "cluster": CLUSTERS["cpu"].__dict__, "runs": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
