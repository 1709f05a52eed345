"""CPU benchmark: each rank's peak memory under ZeRO-1, ZeRO-2 and ZeRO-3 (`[parallel.placement]`), measured.

    python -m tools.bench.placement_memory --out docs/results/placement-memory \
        --placements ZeRO-1,ZeRO-2,ZeRO-3
    python -m tools.bench.placement_memory --out docs/results/placement-memory/startup --startup \
        --placements ZeRO-1,ZeRO-2,ZeRO-3 --malloc "fixed mmap threshold (128 KiB)"
    python -m tools.bench.placement_memory --out docs/results/placement-memory/offload \
        --placements "ZeRO-1,ZeRO-1 + optimizer offload,ZeRO-1 + activation offload" \
        --malloc "fixed mmap threshold (128 KiB)"

Method: for each placement, `--world` gloo processes (dp = world) train `--steps` steps of the 46M MoE
(tools/bench/compile_cpu.py's "large": dim 512, 8 blocks) from recipes/debug_cpu.toml, fp32, one thread
each, with `--bucket-mb` ZeRO buckets; each process then reports its peak resident set size (the kernel's
ru_maxrss: every byte the process touched at its peak, torch's own libraries and allocator caches
included, so only differences between placements mean much) and the planner's figures for the same
layout (tools/plan.py: parameters, gradients, optimizer, peak). Results: results.json and results.md
(a table; the planner's difference beside the measured one). On a CPU the host is the device, so the
offloading placements hold their host bytes in the same process: their rows show that RSS does not fall
while the planner's device peak does (and its host bytes grow).

Each placement runs twice: under glibc's default malloc, whose mmap threshold grows to the largest block
freed (up to 32 MiB), so after the first freed bucket-sized buffer later ones come from the heap and stay
in the process when freed (RSS then keeps what ZeRO-2 frees: it measures the allocator, not the
placement); and with MALLOC_MMAP_THRESHOLD_=131072 (a fixed threshold: every block of 128 KiB or more is
its own mapping, returned on free), where RSS follows the live tensors.

`--startup`: each rank builds its trainer and stops (the peak of start-up: the model built, sharded and
handed to ZeRO, no step), the peak a rank must survive before its first step.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/placement_memory.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.placement_memory", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import resource
import socket
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

from .common import ROOT
from .compile_cpu import MODELS

PLACEMENTS = {"ZeRO-1": [], "ZeRO-2": ["parallel.placement.grads=sharded"],
              "ZeRO-3": ["parallel.placement.params=sharded_gather"],
              # on a CPU the host is the device: what these move stays in the process (RSS), the planner's
              # device peak drops by it and its host bytes grow
              "ZeRO-1 + optimizer offload": ["parallel.placement.optimizer=offloaded"],
              "ZeRO-1 + activation offload": ['train.offload=["expert_fc1"]']}
MALLOC = {"fixed mmap threshold (128 KiB)": "131072", "glibc default": None}  # MALLOC_MMAP_THRESHOLD_
MIB = 2**20


def overrides(world: int, steps: int, bucket_mb: float, placement: list[str]) -> list[str]:
    return MODELS["large"] + [f"parallel.dp={world}", f"train.steps={steps}", "train.seq_len=128",
                              f"train.global_batch={4 * world}", "train.micro_batch=2", "train.threads=1",
                              "train.log_interval=1000", "checkpoint.save_final=false",
                              f"parallel.zero_bucket_mb={bucket_mb}"] + placement


def _worker(rank: int, world: int, port: int, sets: list[str], out: str, startup: bool = False) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_lc.config import load_config
    from moe_lc.train import Trainer, run

    cfg = load_config(ROOT / "recipes/debug_cpu.toml", sets + [f"train.output_dir={out}/run"], world_size=world)
    if startup:  # the model built, sharded and handed to ZeRO; no step
        Trainer(cfg)
    else:
        run(cfg)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_rss_mib": peak_kib / 1024}))


def measure(world: int, steps: int, bucket_mb: float, placement: list[str], mmap_threshold: str | None,
            startup: bool = False) -> dict:
    """Peak RSS of each rank (MiB) and the planner's rank-0 figures for one placement and malloc setting."""
    from moe_lc.config import load_config
    from ..planner.plan import plan

    sets = overrides(world, steps, bucket_mb, placement)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)  # the spawned workers read it as they start
    if mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = mmap_threshold
    with tempfile.TemporaryDirectory(prefix="moe_lc_mem_") as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(world, port, sets, tmp, startup), nprocs=world, start_method="spawn")
        rss = [json.loads(Path(tmp, f"rank{r}.json").read_text())["peak_rss_mib"] for r in range(world)]
    rank = plan(load_config(ROOT / "recipes/debug_cpu.toml", sets, world_size=world), world).ranks[0]
    planned = {k: rank.memory[k] / MIB for k in ("params", "grads", "optimizer")}
    planned["peak"] = rank.peak_bytes() / MIB
    planned["host"] = (sum(rank.host_memory.values()) + rank.host_activations) / MIB
    return {"placement": placement, "peak_rss_mib": rss, "planned_mib": planned}


def table(results: dict) -> str:
    rows = ["| malloc | placement | peak RSS per rank, MiB (max of ranks) | planner: params MiB | planner: grads MiB "
            "| planner: device peak MiB | planner: host MiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    diffs = []
    for malloc, placements in results["runs"].items():
        for name, r in placements.items():
            rows.append(f"| {malloc} | {name} | {max(r['peak_rss_mib']):,.1f} | {r['planned_mib']['params']:,.1f} | "
                        f"{r['planned_mib']['grads']:,.1f} | {r['planned_mib']['peak']:,.1f} | "
                        f"{r['planned_mib'].get('host', 0):,.1f} |")
        one = placements["ZeRO-1"]
        for name, other in placements.items():
            if name != "ZeRO-1":
                measured = max(one["peak_rss_mib"]) - max(other["peak_rss_mib"])
                planned = one["planned_mib"]["peak"] - other["planned_mib"]["peak"]
                diffs.append(f"{malloc}: ZeRO-1 minus {name} peak RSS {measured:,.1f} MiB measured, {planned:,.1f} "
                             "planned.")
    return "\n".join(rows + [""] + diffs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="gloo ranks, all data-parallel")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=8.0, help="parallel.zero_bucket_mb")
    ap.add_argument("--startup", action="store_true", help="build each rank's trainer only (start-up's peak: "
                    "the model built, sharded and handed to ZeRO), no step; the planner's columns stay a step's")
    ap.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help="which of: " + ", ".join(PLACEMENTS))
    ap.add_argument("--malloc", default=",".join(MALLOC), help="which of: " + ", ".join(MALLOC))
    args = ap.parse_args(argv)
    chosen = args.placements.split(",")
    unknown = sorted(set(chosen) - set(PLACEMENTS)) + sorted(set(args.malloc.split(",")) - set(MALLOC))
    if unknown or "ZeRO-1" not in chosen:
        ap.error(f"unknown {unknown}; --placements must include ZeRO-1 (the baseline)" if unknown else
                 "--placements must include ZeRO-1 (the baseline)")
    results = {"model": "46M MoE (compile_cpu 'large')", "world": args.world, "steps": 0 if args.startup else args.steps,
               "bucket_mb": args.bucket_mb, "runs": {}}
    for malloc, threshold in ((m, MALLOC[m]) for m in args.malloc.split(",")):
        for name, placement in ((n, PLACEMENTS[n]) for n in chosen):
            print(f"{malloc}, {name}: {args.world} ranks x {results['steps']} steps ...", flush=True)
            results["runs"].setdefault(malloc, {})[name] = measure(args.world, args.steps, args.bucket_mb, placement,
                                                                   threshold, args.startup)
    text = table(results)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "results.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
