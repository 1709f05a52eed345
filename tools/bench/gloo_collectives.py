"""CPU benchmark: what one gloo collective costs a rank of a CPU recipe, through moe_lc.parallel.comm (its
completion watcher and modelled link included), with 4 ranks sharing the machine as overlap_cpu's do.

    python -m tools.bench.gloo_collectives --out docs/results/steptime     # ~40 s
    python -m tools.bench.gloo_collectives --procs 2 --calls 50

`--procs` processes (default 4, one thread each) in pairs (ranks 2i, 2i+1: one EP group of 2 each, every
pair busy at once), each timing blocking calls of comm.py's collectives on its pair:

  all_to_all   rows of D fp32 (the recipe's model dim), `rows` to the peer and `rows` kept, for rows in
               1, the recipe's balanced dispatch (micro_batch x seq x topk / ep per peer) and 4x it
  all_gather   the dispatch layout: one int64 per routed expert (what `AllToAllDispatcher._gather` sends)

Per op and size the wall time of one call: the median over `--calls` calls on each rank, then over ranks.
  idle   back to back, link off (gloo alone) and on (the recipe's `parallel.link`): a least-squares line
         over the link-off sizes gives `call_s` (per call: Python, gloo's threads, the watcher's wake-up)
         and `copy_bytes_per_s` (gloo's own transfer through the loopback); `link_check_s`: link-on calls
         minus (link off + the link's latency + bytes / bandwidth), the wake-up after the link's sleep.
  busy   link on, every rank computing BETWEEN_GEMMS GEMMs before each call (as the recipe's ranks
         compute between EP calls), the call's blocked time only: `busy_call_s`, per op, what a call costs
         beyond the link and the copy when the cores are busy: gloo, the wake-up on a busy core, and the
         peer the scheduler had not yet run to the call (what tools/step_time/cpu.py takes per call).
Both ranks of a pair do the same work here: a peer behind for other reasons (the recipe's routing sends
unequal rows) is not measured.
Results: gloo_collectives.json.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/gloo_collectives.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.gloo_collectives", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_lc.config import load_config
from moe_lc.parallel import comm
from moe_lc.parallel.comm_timing import Link
from .common import ROOT, load_average, write_json
from .compile_cpu import cpu_name

OUT_NAME = "gloo_collectives.json"
# GEMMs between two calls in the busy runs: overlap_cpu computes ~1e11 FLOPs per rank and step (32 micro-batches
# through F and B of 5 blocks) between 720 EP calls, ~1.4e8 per call = 8 GEMMs of (128, 256) x (256, 256)
BETWEEN_GEMMS = 8
DEFAULT_RECIPE = "recipes/overlap_cpu.toml"


def recipe_shapes(recipe: str) -> dict:
    """The recipe's model dim, its balanced dispatch rows per peer, experts and modelled link."""
    cfg = load_config(ROOT / recipe, [], world_size=4)
    m, t = cfg.model, cfg.train
    rows = t.micro_batch * t.seq_len * m.moe.topk // cfg.parallel.ep
    intra, _ = cfg.parallel.link_model  # overlap_cpu's link has one level (inter = intra)
    return {"dim": m.dim, "rows": rows, "experts": m.moe.n_routed_experts, "link": list(intra)}


def _time_calls(fn, calls: int, between=None) -> float:
    """Wall seconds of one call of fn(), the median over `calls` (robust to a neighbour's burst on a shared
    machine), each after `between()` where given (the compute between two calls, not timed: the call's time
    is what the rank spends blocked in it)."""
    fn()  # warm-up (and lines the pair up)
    spent = []
    for _ in range(calls):
        if between is not None:
            between()
        start = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)


def _rank(rank: int, procs: int, store: str, shapes: dict, calls: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=procs)
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(procs // 2)]
    me = [2 * (rank // 2), 2 * (rank // 2) + 1]
    group = comm.Group("ep", me, me.index(rank), pairs[rank // 2], device_type="cpu")
    D, E = shapes["dim"], shapes["experts"]
    rows_list = sorted({1, shapes["rows"], 4 * shapes["rows"]})
    result = {}
    for link in (None, Link(*shapes["link"])):
        group.counter.link = link
        key = "on" if link else "off"
        for rows in rows_list:
            x, y = torch.randn(2 * rows, D), torch.empty(2 * rows, D)
            result[f"all_to_all {rows} {key}"] = _time_calls(
                lambda: comm.all_to_all(y, x, [rows, rows], [rows, rows], group), calls)
        vec, gathered = torch.zeros(E, dtype=torch.int64), torch.empty(2 * E, dtype=torch.int64)
        result[f"all_gather {E} {key}"] = _time_calls(lambda: comm.all_gather(gathered, vec, group), calls)
    # busy: every rank computes BETWEEN_GEMMS (rows, D) x (D, D) GEMMs before each call, link on
    a, w = torch.randn(shapes["rows"], D), torch.randn(D, D)

    def compute():
        for _ in range(BETWEEN_GEMMS):
            torch.mm(a, w)

    rows = shapes["rows"]
    x, y = torch.randn(2 * rows, D), torch.empty(2 * rows, D)
    result[f"busy all_to_all {rows}"] = _time_calls(lambda: comm.all_to_all(y, x, [rows, rows], [rows, rows], group),
                                                    calls, compute)
    result[f"busy all_gather {E}"] = _time_calls(lambda: comm.all_gather(gathered, vec, group), calls, compute)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points."""
    n, sx, sy = len(points), sum(p[0] for p in points), sum(p[1] for p in points)
    sxx, sxy = sum(p[0] ** 2 for p in points), sum(p[0] * p[1] for p in points)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - slope * sx) / n, slope


def summarize(per_rank: list[dict], shapes: dict) -> dict:
    """Medians over ranks, the per-call line of the link-off calls, and the link check."""
    times = {k: statistics.median(r[k] for r in per_rank) for k in per_rank[0]}
    row_bytes = 4 * shapes["dim"]
    points = [(int(k.split()[1]) * row_bytes, t) for k, t in times.items() if k.endswith(" off") and not k.startswith("busy")]
    points.append((8 * shapes["experts"], times[f"all_gather {shapes['experts']} off"]))
    call_s, per_byte = fit_line(points)
    link = Link(*shapes["link"])
    nbytes = {"all_to_all": shapes["rows"] * row_bytes, "all_gather": 8 * shapes["experts"]}
    check = {k: t - times[k[:-3] + " off"] - link.seconds(int(k.split()[1]) * (row_bytes if k.startswith("all_to_all") else 8))
             for k, t in times.items() if k.endswith(" on")}
    busy = {op: times[f"busy {op} {n // (row_bytes if op == 'all_to_all' else 8)}"] - link.seconds(n) - n * per_byte
            for op, n in nbytes.items()}
    return {"call_s": call_s, "copy_bytes_per_s": 1 / per_byte if per_byte > 0 else float("inf"),
            "busy_call_s": busy, "times_s": times, "link_check_s": check}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.gloo_collectives", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"a CPU recipe with expert parallelism (default {DEFAULT_RECIPE})")
    ap.add_argument("--procs", type=int, default=4, help="processes, in pairs (default 4: overlap_cpu's ranks)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per op and size (default 200)")
    ap.add_argument("--out", default=None, help=f"write {OUT_NAME} here")
    args = ap.parse_args(argv)
    if args.procs < 2 or args.procs % 2 or args.calls < 1:
        ap.error("--procs must be an even number >= 2 and --calls >= 1")
    shapes = recipe_shapes(args.recipe)
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "procs": args.procs, "calls": args.calls, "recipe": args.recipe,
            "torch": torch.__version__, "load_before": load_average(), **shapes}
    with tempfile.TemporaryDirectory(prefix="moe_lc_gloo_") as work:
        mp.start_processes(_rank, args=(args.procs, f"{work}/store", shapes, args.calls, work), nprocs=args.procs,
                           start_method="spawn")
        per_rank = [json.loads(Path(work, f"{r}.json").read_text()) for r in range(args.procs)]
    meta["load_after"] = load_average()
    out = summarize(per_rank, shapes)
    for k, t in out["times_s"].items():
        print(f"{k:>24}: {t * 1e6:8.0f} us")
    print(f"per call {out['call_s'] * 1e6:.0f} us + bytes / {out['copy_bytes_per_s'] / 1e9:.2f} GB/s (link off); "
          "link on minus (off + link): " + ", ".join(f"{k} {v * 1e6:+.0f} us" for k, v in out["link_check_s"].items()))
    print("per call between busy ranks, beyond the link and the copy: "
          + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in out["busy_call_s"].items()))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out) / OUT_NAME, {"meta": meta, **out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
