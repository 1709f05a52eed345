"""Hybrid context parallelism on a modelled two-level link: ring alone vs cp_a2a = 2 vs 4, measured and predicted.

    python -m tools.bench.hybrid_cp_cpu --out docs/results/hybrid-cp-cpu [--seq-len 4096] [--steps 4]
                                        [--link intra=5:1,inter=50:0.1]

Four gloo ranks on this machine as 2 nodes x 2 (`parallel.ranks_per_node = 2`), cp 4, the debug MoE model,
`parallel.link = "intra=5:1,inter=50:0.1"` (5 us and 1 GB/s inside a node, 50 us and 0.1 GB/s between them;
`--link` another: the case the hybrid exists for is a slow ring between nodes). Each A in (1, 2, 4) trains
`--steps` steps under torchrun; per run the mean over the steps after the first of the step time and of the
CP groups' link time and exposed time ("cp" for the ring alone; "cp_a2a" + "cp_ring" for the hybrid), from
the trainer's metrics.jsonl. Beside each, tools/step_time/model.py's prediction on the `cpu` cluster
(tools/step_time/cpu.py's fitted rates for one of 4 ranks on this machine) with its links set to the modelled
ones (NVLink = the intra bandwidth inside a node of 2, the network = the inter one, link efficiency 1;
latency is not modelled there). Writes results.json and results.md (a --link other than the default:
results-<inter GB/s>.json / .md).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/hybrid_cp_cpu.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.hybrid_cp_cpu", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from .common import ROOT

RECIPE = ROOT / "recipes/debug_cpu.toml"
LINK = "intra=5:1,inter=50:0.1"
A_VALUES = (1, 2, 4)
CP_GROUPS = ("cp", "cp_a2a", "cp_ring")


def cluster_sets(link: str) -> list[str]:
    """The `cpu` cluster's links set to the modelled ones: nodes of 2, NVLink = intra, network = inter."""
    from moe_lc.config import ParallelConfig

    (_, intra), (_, inter) = ParallelConfig(link=link).link_model
    return ["cluster.gpus_per_node=2", f"cluster.nvlink_gbps={intra / 1e9:g}", f"cluster.net_gbps={inter / 1e9:g}",
            "eff.link=1"]


def recipe_sets(a2a: int, seq_len: int, steps: int, link: str) -> list[str]:
    return ["parallel.cp=4", f"parallel.cp_a2a={a2a}", "parallel.dp=1", "parallel.ranks_per_node=2",
            f"parallel.link={link}", f"train.seq_len={seq_len}", "train.global_batch=4", "train.micro_batch=1",
            f"train.steps={steps}", "train.warmup_steps=1", "train.log_interval=1", "train.threads=1"]


def command(sets: list[str], out_dir: Path) -> list[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
            "moe_lc.train", str(RECIPE.relative_to(ROOT))]
    for s in sets + [f"train.output_dir={out_dir}", "train.overwrite=true"]:
        args += ["--set", s]
    return args


def measured(run_dir: Path) -> dict:
    """Mean over the steps after the first: step time, CP link time and exposed time (seconds)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    def mean(key: str) -> float:
        return statistics.mean(sum(r.get(f"comm/{g}/{key}", 0.0) for g in CP_GROUPS) for r in rows)

    return {"step_s": statistics.mean(r["step_time"] for r in rows), "cp_time_s": mean("time_s"),
            "cp_exposed_s": mean("exposed_s"), "steps": len(rows)}


def predicted(sets: list[str], link: str) -> dict:
    from moe_lc.config import load_config
    from ..step_time.clusters import resolve
    from ..planner.plan import plan
    from ..step_time.model import predict

    cfg = load_config(RECIPE, sets, world_size=4)
    cluster, eff = resolve("cpu", cluster_sets(link))
    pred = predict(cfg, plan(cfg, 4, str(RECIPE)), cluster, eff)  # the cpu entry's efficiencies are 1
    cp = {g: s for g, s in pred["exposed_comm_s"].items() if g in CP_GROUPS}
    return {"step_s": pred["step_s"], "cp_exposed_s": sum(cp.values()),
            "cp_time_s": sum(s for g, s in pred["comm_s"].items() if g in CP_GROUPS)}


def render(rows: list[dict], seq_len: int, link: str) -> str:
    best_m = min(rows, key=lambda r: r["measured"]["step_s"])["a2a"]
    best_p = min(rows, key=lambda r: r["predicted"]["step_s"])["a2a"]
    out = [f"debug MoE model, cp 4 on 4 gloo ranks as 2 nodes x 2, link `{link}`, seq_len {seq_len}, "
           "4 micro-batches of 1 per step; mean over the steps after the first. Predicted: tools/step_time/model.py on the `cpu` cluster "
           f"({', '.join(cluster_sets(link))}).", "",
           "| layout | step s measured | CP link s (exposed) measured | step s predicted | CP link s (exposed) predicted |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        name = "ring alone (A = 1)" if r["a2a"] == 1 else f"A = {r['a2a']}"
        out.append(f"| {name} | {m['step_s']:.3f} | {m['cp_time_s']:.3f} ({m['cp_exposed_s']:.3f}) | "
                   f"{p['step_s']:.3f} | {p['cp_time_s']:.3f} ({p['cp_exposed_s']:.3f}) |")
    out += ["", f"Fastest measured: A = {best_m}; fastest predicted: A = {best_p}.", "", "Commands:", ""]
    out += ["    " + " ".join(r["command"]) for r in rows]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/hybrid-cp-cpu")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--link", default=LINK)
    args = ap.parse_args(argv)
    out = Path(args.out)
    stem = "results" if args.link == LINK else f"results-{cluster_sets(args.link)[2].split('=')[1]}"
    rows = []
    for a2a in A_VALUES:
        sets = recipe_sets(a2a, args.seq_len, args.steps, args.link)
        run_dir = out / "runs" / stem / f"a{a2a}"
        cmd = command(sets, run_dir)
        subprocess.run(cmd, cwd=ROOT, check=True)
        rows.append({"a2a": a2a, "command": ["python"] + cmd[1:], "measured": measured(run_dir),
                     "predicted": predicted(sets, args.link)})
        print(f"A={a2a}: {rows[-1]['measured']} predicted {rows[-1]['predicted']}", file=sys.stderr)
    (out / f"{stem}.json").write_text(json.dumps({"seq_len": args.seq_len, "link": args.link, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(render(rows, args.seq_len, args.link))
    print(render(rows, args.seq_len, args.link))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
