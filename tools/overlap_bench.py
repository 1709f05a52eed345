"""How much communication hides behind compute, measured on this machine under a modelled link.

    python tools/overlap_bench.py [--recipe recipes/overlap_cpu.toml] [--out docs/results/overlap-cpu]
                                  [--steps 8] [--set KEY=VALUE ...]

Runs the recipe (4 gloo ranks: pp 2 DualPipe x ep 2 x dp 2 with `parallel.link`) as it is, with
`parallel.overlap = false`, with 1F1B on the same layout, and a ring context-parallel layout (cp 2 x
ep 2, no pipeline), each through torchrun. For every run it reads metrics.jsonl (steps after the
first) and the traced step's timeline, and writes OUT/results.json, OUT/results.md (the table the
docs/guide/overlap.md shows) and OUT/<run>.png (tools/timeline.py's drawing of the traced step).

hidden = 1 - exposed_s / time_s per mesh group and op (moe_lc/parallel/comm_timing.py): time_s runs
from a collective's issue to its completion on the modelled link, exposed_s is the part the rank
spent blocked waiting for it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/overlap_bench.py` from a checkout: run as tools.overlap_bench
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.overlap_bench", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from moe_lc.job.out_path import out_dir
from .ablate import command
from .extend import shown
from .timeline import draw, summary

ROOT = Path(__file__).resolve().parents[1]  # the checkout, or the folder pip installed the packages into
RUNS = {  # name -> (what it shows, extra --set)
    "dualpipe": ("DualPipe, overlap on", []),
    "dualpipe_no_overlap": ("DualPipe, parallel.overlap = false", ["parallel.overlap=false"]),
    "1f1b": ("1F1B, same layout", ["parallel.pp_schedule=1f1b"]),
    "ring_cp": ("ring CP: cp 2 x ep 2, no pipeline", ["parallel.pp=1", "parallel.cp=2", "parallel.pp_schedule=1f1b",
                                                      "train.global_batch=16", "train.micro_batch=2",
                                                      "train.seq_len=512"]),
}
SHOWN = ("ep/all_to_all", "ep/all_gather", "pp/recv", "pp/send", "cp/recv", "cp/send", "dp_cp/reduce_scatter",
         "edp/reduce_scatter", "dp_cp/all_gather")


def run_one(name: str, recipe: str, out: Path, sets: list[str], steps: int) -> dict:
    run_dir = out / "runs" / name
    cmd = command(recipe, [f"train.output_dir={run_dir}", "train.overwrite=true", f"train.steps={steps}",
                           *RUNS[name][1], *sets], nproc=4)
    print(f"[{name}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as fh:
        # in the working folder, as moe-train: a --set's relative paths resolve there; the children import
        # the packages this tool runs from (the checkout, or the installed ones)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)).returncode
    if code != 0:
        raise RuntimeError(f"{name}: exit status {code}; see {log}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    result = {"what": RUNS[name][0], "command": shown(cmd),
              "wall_s": time.perf_counter() - start, "steps_averaged": len(rows),
              "step_s": sum(r["step_time"] for r in rows) / len(rows), "losses": [r["loss"] for r in rows]}
    for key in SHOWN:
        t = sum(r.get(f"comm/{key}_time_s", 0.0) for r in rows)
        e = sum(r.get(f"comm/{key}_exposed_s", 0.0) for r in rows)
        if t > 0:
            result[key] = {"time_s": t / len(rows), "exposed_s": e / len(rows), "hidden": 1 - e / t}
    result["traced"] = summary(run_dir)
    draw(run_dir, out / f"{name}.png")
    return result


def markdown(results: dict, recipe: str, link: str) -> str:
    lines = [f"Recipe `{recipe}` (link `{link}`), 4 gloo ranks on this machine; per step, averaged over the "
             "steps after the first. hidden = 1 - exposed / time.", "",
             "| run | step s | EP all-to-all s (hidden) | EP layout all-gather s (hidden) | PP recv s (hidden) | "
             "CP ring s (hidden) | ZeRO reduce-scatter s (hidden) | pipeline: simulated vs measured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(r, *keys):
        parts = [r[k] for k in keys if k in r]
        if not parts:
            return "-"
        t, e = sum(p["time_s"] for p in parts), sum(p["exposed_s"] for p in parts)
        return f"{t:.3f} ({1 - e / t:.0%})"

    for name, r in results.items():
        traced = r["traced"]
        sim = (f"{traced['simulated_s']:.2f} vs {traced['pipeline_s']:.2f} s ({traced['simulated_error']:+.1%})"
               if "simulated_s" in traced else "-")
        lines.append(f"| {r['what']} | {r['step_s']:.3f} | {cell(r, 'ep/all_to_all')} | {cell(r, 'ep/all_gather')} | "
                     f"{cell(r, 'pp/recv')} | {cell(r, 'cp/recv', 'cp/send')} | "
                     f"{cell(r, 'dp_cp/reduce_scatter', 'edp/reduce_scatter')} | {sim} |")
    lines += ["", "Commands:", ""] + [f"    {r['command']}" for r in results.values()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/overlap_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=None, help="default: the checkout's recipes/overlap_cpu.toml")
    ap.add_argument("--out", default="runs/overlap_bench", help="results folder (docs/results/overlap-cpu to commit)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"subset of {','.join(RUNS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    args = ap.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    bad = [n for n in names if n not in RUNS]
    if bad or args.steps < 3:
        print(f"error: {'--runs ' + ','.join(bad) + ' unknown (' + ','.join(RUNS) + ')' if bad else '--steps must be >= 3 (the recipe traces step 3; step 1 is left out of the averages)'}",
              file=sys.stderr)
        return 2
    from moe_lc.config import ConfigError, load_config

    recipe = str(Path(args.recipe or ROOT / "recipes" / "overlap_cpu.toml").resolve())
    if args.recipe is None and not Path(recipe).is_file():
        print("error: --recipe: the default, recipes/overlap_cpu.toml, ships with the moe_lc checkout, not the "
              "installed package; give --recipe PATH", file=sys.stderr)
        return 2
    try:
        link = load_config(recipe, args.set, world_size=4).parallel.link
        out = out_dir("--out", args.out).resolve()
    except ValueError as exc:  # ConfigError, OutPathError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = {name: run_one(name, recipe, out, args.set, args.steps) for name in names}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results, shown([recipe]), link))
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
