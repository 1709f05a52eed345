"""Memory and communication planner: per-rank bytes of every training state and traffic per mesh dim.

    python tools/plan.py RECIPE [--set KEY=VALUE ...] [--world N] [--policy none|selective|full]
                         [--terms] [--saved] [--json] [--cluster NAME [--bench FILE] [--search]]

Parameters come from each pipeline rank's model built as the trainer builds it, on the meta device
(no memory; tools/planner/layout.py). Activations and traffic come from running the model code: the
embedding, one block of each kind and the head, forward and backward on the meta device on fake
process groups of the recipe's mesh (tools/planner/block_trace.py), give the bytes each keeps for backward
(tools/planner/activation_memory.py) and the bytes comm.py counts it sending, recompute replays included; the
rank's pipeline schedule gives how often each runs, what is in flight at once and the stage sends
(tools/planner/pipeline_memory.py). ZeRO-1's collectives come from its bucket sizes, the trainer's own
all-reduces once a step from `plan_layout.trainer_traffic`. The tool prints the placement table (where
each state lives on each dim), memory per rank by state, the transient working sets and the peak, saved
activations under each recompute policy and the bytes this rank sends per optimizer step, keyed like
the trainer's metrics ("comm/<group>/<op>_bytes"). tools/dryrun.py holds all of it to one traced
training step at the recipe's real size. With --cluster, also the predicted step time, tokens/s/GPU
and MFU on that cluster (tools/step_time/model.py; `--set cluster.KEY=V` / `eff.KEY=V` override its figures);
with --search, the layouts of the world size that fit, ranked by it (tools/step_time/search.py).
Runs from the repo root without installing.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/plan.py` from a checkout: run as tools.plan
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.plan", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import sys

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # (before torch) the traces' fake process groups warn per group

from moe_lc.config import Config, ConfigError, load_config
from .planner.activation_memory import POLICIES
from .planner.layout import mesh
from .planner import saved_table
from .planner.plan import plan, render
from .step_time import model as steptime, search as steptime_search
from .step_time.clusters import CLUSTERS, ClusterError, resolve, split_sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/plan.py", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    ap.add_argument("--world", type=int, default=None, help="world size (default: the recipe's degrees, dp=0 -> 1)")
    ap.add_argument("--policy", choices=POLICIES, help="recompute policy to plan for (default: the recipe's)")
    ap.add_argument("--terms", action="store_true", help="list every saved tensor of each block kind, as traced")
    ap.add_argument("--saved", action="store_true", help="only what each block kind keeps for backward, per token, "
                                                         "against Megatron-LM's 34 h / t, term by term")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--cluster", help=f"predict step time and MFU on this cluster ({', '.join(CLUSTERS)})")
    ap.add_argument("--bench", help="with --cluster: a JSON file {\"efficiency\": {KEY: value}} of kernel-rate "
                                    "overrides, or a GPU run's tools/bench/run.py results to refit the rates to")
    ap.add_argument("--search", action="store_true", help="with --cluster: rank the layouts of --world that fit memory")
    ap.add_argument("--impl", choices=steptime.IMPLEMENTATIONS, default="fused",
                    help="with --cluster: whose kernels (tools/step_time/compute.py): fused (Megatron / Transformer "
                         "Engine class, the default), fused_a2a_overlap (and the EP all-to-all overlapped in 1F1B), "
                         "eager (this repo's trainer as it runs today)")
    args = ap.parse_args(argv)
    if args.world is not None and args.world < 1:  # else a rule about ranks_per_node dividing it reports it
        print(f"error: --world must be a positive integer, got {args.world}", file=sys.stderr)
        return 2
    sets, cluster_sets = split_sets(args.set)
    sets += [f"recompute.policy={args.policy}"] if args.policy else []
    try:
        if (cluster_sets or args.bench or args.search or args.impl != "fused") and not args.cluster:
            raise ClusterError("--set cluster./eff. keys, --bench, --impl and --search need --cluster NAME")
        cluster = resolve(args.cluster, cluster_sets, args.bench) if args.cluster else None
        cfg = load_config(args.recipe, sets, world_size=None if args.search else args.world)  # search: its own layouts
    except (ConfigError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.search:
        return _search(args, sets, cfg, cluster)
    if args.saved:
        tables = saved_table.saved_tables(cfg)
        print(json.dumps(saved_table.to_json(tables), indent=1) if args.json else
              "\n".join(saved_table.render(tables, cfg)))
        return 0
    p = plan(cfg, args.world, args.recipe)
    predicted = steptime.predict(cfg, p, *cluster, impl=args.impl) if cluster else None
    if args.json:
        print(json.dumps({**p.to_json(), **({"predicted": predicted} if predicted else {})}, indent=1))
    else:
        print(render(p, cfg, args.terms) + (f"\n{steptime.render(predicted)}" if predicted else ""))
    return 0


def _search(args, sets: list[str], cfg: Config, cluster) -> int:
    """--search: the ranking; exit status 2 with one `error:` line when no layout fits (what binds, what to
    change), 130 when stopped by Ctrl-C (the ranking of the layouts planned until then)."""
    found = steptime_search.search(args.recipe, sets, args.world or mesh(cfg).world, *cluster, plan, impl=args.impl)
    if args.json:
        print(json.dumps({"search": found}, indent=1))
    elif found["ranked"] or found["interrupted"]:
        print(steptime_search.render(found))
    if found["interrupted"]:
        return 130
    if not found["ranked"]:
        print(f"error: {steptime_search.nothing_fits(found, cfg)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
