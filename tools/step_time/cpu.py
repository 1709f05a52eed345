"""The `cpu` cluster of tools/step_time/clusters.py, built from tools/bench's CPU measurements, and its prediction
of recipes/overlap_cpu.toml against that recipe's measured steps.

    python -m tools.step_time.cpu [--bench docs/results/steptime] [--measured RESULTS_JSON] [--out docs/results/steptime]

The cost model of one rank (4 gloo ranks on this 2-core machine), each term a measured input:

  compute      GEMM FLOPs (attention's core included) / the rate the recipe's own GEMMs reach
               (cpu_costs.json `gemm_flops_per_s`: every GEMM of its blocks at its micro-batch, replayed)
               + memory-bound bytes / the rate of elementwise ops at its sizes (`memory_bytes_per_s`)
               + aten ops dispatched x the framework cost of one (`op_s`: the blocks shrunk to no FLOPs,
               CPU time over ops); the ops of each part's F, B and W are counted by tools/planner/block_trace.py.
               All three are one thread's CPU time alone; a rank runs `slowdown` times slower while 4
               share the cores: shared_cpu.json (4 processes) over shared_cpu_1.json (1 process), the same
               training steps measured in one sitting, median over the two models; without the latter the
               fair share, 4 ranks / 2 cores (the committed one-process steps of docs/results/compile-cpu
               ran on a loaded machine: against them sharing would look cheaper than a fair share).
  collectives  per call: what a rank spends blocked in one EP call beyond the link and gloo's copy, with 4
               ranks computing between calls on the shared cores (gloo_collectives.json `busy_call_s`,
               mean of the all-to-all and the layout's all-gather: gloo's threads, the wake-up after the
               modelled link's sleep on a busy core, the peer the scheduler let fall behind) + the recipe's
               link latency; per byte: gloo's copy (`copy_bytes_per_s`, link off) + the modelled link
               (`parallel.link`, 0.1 GB/s, exact: link efficiency 1). Calls per step are the traced
               parts' (comm.py's count). The host's part (per call and the copy) runs on the rank's own
               critical path: DualPipe's F&B hides only the link's part (tools/step_time/model.py).
Not modelled: a peer behind for other reasons than the scheduler (routing imbalance: the pair's compute is
the same on paper), the optimizer's per-op cost and its state streamed from memory (it is timed at the
activations' cache-resident rate), the trainer's work outside the pipeline beyond the optimizer, and that a
rank blocked on the link gives its core to the others (the slowdown assumes all 4 busy).
The prediction is held to the three pipeline runs of tools/overlap_bench.py measured in the same sitting as
the benches (docs/results/steptime/overlap_measured.json; docs/results/overlap-cpu has an earlier sitting's).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/step_time/cpu.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.step_time.cpu", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from moe_lc.config import load_config
from .clusters import CLUSTERS, Cluster, resolve

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs/results/steptime"
MEASURED = ROOT / "docs/results/steptime/overlap_measured.json"  # tools/overlap_bench.py's, in the benches' sitting
RECIPE = ROOT / "recipes/overlap_cpu.toml"
RANKS = 4  # overlap_cpu's gloo ranks
RUNS = {"dualpipe": [], "dualpipe_no_overlap": ["parallel.overlap=false"], "1f1b": ["parallel.pp_schedule=1f1b"]}


def _read(path: Path) -> dict:
    """A bench's or overlap_bench's JSON; a missing or broken one is one `error:` line, exit status 2."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {path}: {exc} (tools/step_time/cpu.py's docstring names what writes it)", file=sys.stderr)
        raise SystemExit(2) from None


def slowdown(bench: Path = BENCH, cores: int = 2) -> tuple[float, str]:
    """(how much slower a rank's work runs with RANKS ranks on the cores than alone, how it was found): the
    shared bench's steps over the same steps alone where both were measured in one sitting
    (shared_cpu.json and shared_cpu_1.json), else the fair share RANKS / cores (no cost of sharing caches)."""
    shared_file, one_file = bench / "shared_cpu.json", bench / "shared_cpu_1.json"
    if not (shared_file.exists() and one_file.exists()):
        return RANKS / cores, f"{RANKS} ranks / {cores} cores (no shared_cpu_1.json)"
    shared = {r["model"]: r["eager_step_s"] for r in _read(shared_file)["results"]}
    alone = {r["model"]: r["eager_step_s"] for r in _read(one_file)["results"]}
    return statistics.median(shared[m] / alone[m] for m in shared if m in alone), "shared_cpu.json / shared_cpu_1.json"


def fit(bench: Path = BENCH) -> dict:
    """The measured inputs of the `cpu` cluster (see the module doc), one core alone and the slowdown."""
    costs, gloo = _read(bench / "cpu_costs.json"), _read(bench / "gloo_collectives.json")
    share, alone_from = slowdown(bench, costs["meta"]["cores"])
    return {"gemm_flops_per_s": costs["gemm_flops_per_s"], "memory_bytes_per_s": costs["memory_bytes_per_s"],
            "op_s": costs["op_s"], "slowdown": share, "slowdown_from": alone_from,
            "call_s": statistics.mean(gloo["busy_call_s"].values()), "idle_call_s": gloo["call_s"],
            "copy_bytes_per_s": gloo["copy_bytes_per_s"], "link": gloo["meta"]["link"]}


def cluster_from_fit(f: dict) -> Cluster:
    """One of RANKS ranks sharing the cores: one core's rates over the slowdown, its per-op cost times it;
    collectives as gloo costs them with the ranks sharing, and the recipe's modelled link."""
    s, (latency_s, link_bytes_per_s) = f["slowdown"], f["link"]  # parallel.link: (seconds, bytes/s)
    link_gbps = link_bytes_per_s / 1e9
    tflops = round(f["gemm_flops_per_s"] / s / 1e12, 6)
    return Cluster("cpu", tflops, tflops, round(f["memory_bytes_per_s"] / s / 1e9, 4), 1e3, link_gbps, link_gbps,
                   RANKS, fp32_tflops=tflops, op_us=round(f["op_s"] * s * 1e6, 3),
                   call_us=round(f["call_s"] * 1e6, 1), copy_gbps=round(f["copy_bytes_per_s"] / 1e9, 4),
                   link_latency_us=round(latency_s * 1e6, 3))


def main(argv=None) -> int:
    from ..planner.plan import plan
    from .model import predict

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default=str(BENCH), help="folder of cpu_costs.json, gloo_collectives.json, shared_cpu*.json")
    ap.add_argument("--measured", default=str(MEASURED), help="tools/overlap_bench.py's results.json to hold the "
                    "prediction to (default: the committed docs/results/overlap-cpu one)")
    ap.add_argument("--out", default="docs/results/steptime")
    args = ap.parse_args(argv)
    f = fit(Path(args.bench))
    cluster = cluster_from_fit(f)
    if Path(args.bench).resolve() == BENCH.resolve() and cluster != CLUSTERS["cpu"]:
        print(f"note: tools/step_time/clusters.py's cpu entry differs from these benches': {cluster}")
    measured = _read(Path(args.measured))
    rows = []
    for run, sets in RUNS.items():
        cfg = load_config(RECIPE, sets, world_size=RANKS)
        pred = predict(cfg, plan(cfg, RANKS, str(RECIPE)), cluster, resolve("cpu")[1])  # efficiencies 1: achieved rates, an exact link
        rows.append({"run": run, "measured_step_s": measured[run]["step_s"], "predicted": pred,
                     "error": pred["step_s"] / measured[run]["step_s"] - 1})
        k = pred["costs_s"]
        print(f"{run}: predicted {pred['step_s']:.3f} s, measured {measured[run]['step_s']:.3f} s ({rows[-1]['error']:+.1%}); "
              f"F {k['F'] * 1e3:.0f} B {k['B'] * 1e3:.0f} W {k['W'] * 1e3:.0f} F&B {k['FB'] * 1e3:.0f} ms, "
              f"ep {pred['comm_s'].get('ep', 0):.2f} s ({pred['exposed_comm_s'].get('ep', 0):.2f} exposed)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu.json"), "w") as fh:
        json.dump({"fit": f, "cluster": cluster.__dict__, "runs": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
