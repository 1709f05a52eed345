"""Dry run: one training step of a recipe at its real world size, traced rank by rank on one CPU.

    python tools/dryrun.py RECIPE [--set KEY=VALUE ...] [--ranks first,last|all-roles|N,M,...]
        [--microbatches auto|all] [--json]

"Will this layout fit, and what will it send?" For each traced rank, in this one process: torch's
fake process-group backend at the recipe's world size and that rank, the trainer built exactly as
`python -m moe_lc.train` builds it (parallelize, materialize, ZeRO-1) but on the meta device standing
for an H100 (no data, no memory; see moe_lc/ops/device.py), then one `Trainer.train_step`: every
micro-batch through the recipe's pipeline schedule, its recompute policy and precision recipe,
the ZeRO-1 update. tools/dry_run/trace.py watches every op: memory by category and its peak, the
collectives (counted by comm.py as in a real run), host syncs and dtypes NCCL lacks. Each figure
is printed beside the planner's (tools/plan.py) with the difference in percent.

Ranks: "first,last" (default) traces the first and the last pipeline rank (with DualPipe rank 0
holds both ends of the model) and the pipeline rank the planner expects to peak highest; "all-roles" every pipeline rank (under DualPipe one of each mirror
pair r, pp-1-r, which hold the same stages); or global ranks "0,5". Every rank of
one pipeline rank holds experts and the same shapes (data, context, tensor and expert ranks are
symmetric), so one rank per pipeline position covers every role. Data is not read: micro-batches
are token ids on the meta device, routing is balanced (tools/dry_run/trace.py).

Micro-batches: under a pipeline, the fewest whose schedule passes every state the whole step's does
(tools/dry_run/microbatches.py: DualPipe with pp 16 peaks at 32 of 120), so the peak is the step's; the note
printed first says what that leaves out. `--microbatches all` traces every one.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/dryrun.py` from a checkout: run as tools.dryrun
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.dryrun", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import sys

from moe_lc.config import load_config
from .dry_run.microbatches import fewest_microbatches, with_microbatches
from .dry_run.rank_trace import compare, global_ranks, microbatch_note, pick_ranks, render, trace_rank
from .planner.plan import plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/dryrun.py", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    ap.add_argument("--ranks", default="first,last", help="first,last (+ the planner's highest) | all-roles | global ranks, e.g. 0,5")
    ap.add_argument("--microbatches", choices=("auto", "all"), default="auto",
                    help="micro-batches per pipeline to trace: auto, the fewest whose schedule peaks as the whole "
                         "step's does (tools/dry_run/microbatches.py), or all of the recipe's")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.set)
        p = cfg.parallel
        world = p.pp * (p.dp or 1) * p.cp * p.tp
        if args.ranks not in ("first,last", "all-roles"):
            global_ranks(args.ranks, world)  # before the planner's minute
    except ValueError as exc:  # ConfigError too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    whole = cfg.train.microbatches(p.dp or 1)
    traced = fewest_microbatches(cfg, whole) if args.microbatches == "auto" else whole
    cfg = with_microbatches(cfg, p.dp or 1, traced)
    note = microbatch_note(cfg, whole, traced)
    if note and not args.json:
        print(note, flush=True)
    the_plan = plan(cfg, world, args.recipe)
    results = []
    ranks = pick_ranks(args.ranks, cfg, world, the_plan)
    for i, rank in enumerate(ranks):  # progress on stderr, also under --json (stdout stays one document)
        print(f"[{i + 1}/{len(ranks)}] tracing rank {rank} of {world} ...", file=sys.stderr, flush=True)
        report = trace_rank(cfg, world, rank)
        rank_plan = the_plan.ranks[report["coords"]["pp"]]
        cmp = compare(report, rank_plan)
        report.update(planner_peak_bytes=rank_plan.peak_bytes(), planner_transients=rank_plan.transients,
                      comparison=cmp)
        results.append(report)
        if not args.json:
            print(render(report, cmp), flush=True)
    if args.json:
        print(json.dumps({"recipe": args.recipe, "world": world, "microbatches": {"step": whole, "traced": traced},
                          "note": note, "ranks": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
