"""Activation offloading on a GPU: one MoE block's device memory, host bytes and time with each
`train.offload` choice, against the planner, and the gradients against keeping everything.

    python -m tools.bench.offload_gpu [--recipe recipes/moe16b_128k.toml] [--seqs 32768,65536] [--out DIR]
    python -m tools.bench.offload_gpu --dry-run --out /tmp/offload     # tiny shapes on the CPU

The block is the recipe's first MoE block as tools/bench/layer.py builds it (bf16, the recipe's recompute
policy, whole on one GPU, batch 1), with moe_lc/parallel/memory/offload.py's hooks installed on it for each
choice in turn. Per choice and length:

  saved      device bytes allocated after the forward minus before it, less the output (what the block
             keeps on the device for backward); planned: the planner's trace of the same block with the
             same choice (tools/activation_memory.stage_estimate: device bytes and host bytes)
  host       the offload's host bytes after the forward (pinned memory), planned beside it
  peak       the highest device allocation during forward + backward above the inputs
  fwd+bwd    median time of forward + backward (the copies run on their own stream; what does not hide
             behind compute shows here)
  exact      the input's and every parameter's gradient equal, bit for bit, to the first run that keeps
             everything on the device; grad diff, the largest relative difference of one (a second run
             keeping everything gives the bar: CUDA's scatter-add atomics are not deterministic)

Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from moe_lc.config import load_config
from moe_lc.parallel.memory.offload import ActivationOffload

from ..planner.activation_memory import stage_estimate
from .common import ROOT, sync
from .layer import DRY_MODEL, first_moe_block

# "none" twice: the second says how far two identical runs' gradients differ (CUDA's atomics in scatter-add
# and some backward kernels are not deterministic), the bar the offloaded runs are read against
CHOICES = ([], [], ["expert_fc1"], ["attn_core"], ["attn_core", "expert_fc1"])
ONE_RANK = ["parallel.pp=1", "parallel.dp=1", "parallel.cp=1", "parallel.tp=1", "parallel.ep=1",
            "train.micro_batch=1", "train.global_batch=1"]
GIB = 2 ** 30


def _cfg(recipe: str, seq: int, items: list[str], dry: bool):
    offload = "train.offload=[" + ", ".join(f'"{i}"' for i in items) + "]"
    extra = DRY_MODEL + ["train.device=cpu", "precision.recipe=fp32"] if dry else []
    return load_config(ROOT / recipe, extra + ONE_RANK + [f"train.seq_len={seq}", offload], check=False)


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measure(recipe: str, seq: int, device: torch.device, dry: bool, iters: int) -> list[dict]:
    cfg = _cfg(recipe, seq, [], dry)
    m = cfg.model
    dtype = torch.float32 if dry else torch.bfloat16
    block, rope = first_moe_block(cfg, device, dtype)
    layer = block.layer_id
    g = torch.Generator(device=device).manual_seed(seq)
    x = torch.randn(1, seq, m.dim, generator=g, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(1, seq, m.dim, generator=g, device=device, dtype=dtype)
    cos, sin = rope(torch.arange(seq, device=device))
    reference, rows = None, []
    for items in CHOICES:
        offload = ActivationOffload(block, items, device) if items else None
        plan = stage_estimate(_cfg(recipe, seq, items, dry), [layer], first_stage=False, last_stage=False)
        row = {"seq": seq, "offload": "+".join(items) or "none",
               "planned_saved_gib": plan.layers[layer] / GIB, "planned_host_gib": plan.host_layers.get(layer, 0) / GIB}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        base = _allocated(device)
        y = block(x, cos, sin)
        sync(device)
        row["saved_gib"] = (_allocated(device) - base - y.numel() * y.element_size()) / GIB
        row["host_gib"] = (offload.host_bytes if offload else 0) / GIB
        y.backward(dy)
        sync(device)
        if device.type == "cuda":
            row["peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
        grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
        del y
        if reference is None:
            reference = grads
        row["exact"] = all(torch.equal(a, b) for a, b in zip(grads, reference))
        row["grad_rel_diff"] = max(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                                   for a, b in zip(grads, reference))
        times = []
        for _ in range(iters + 1):
            x.grad = None
            block.zero_grad(set_to_none=True)
            sync(device)
            t0 = time.perf_counter()
            block(x, cos, sin).backward(dy)
            sync(device)
            times.append(time.perf_counter() - t0)
        row["fwd_bwd_ms"] = sorted(times[1:])[len(times[1:]) // 2] * 1e3
        x.grad = None
        block.zero_grad(set_to_none=True)
        if offload is not None:
            offload.remove()
        rows.append(row)
        print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def markdown(rows: list[dict], facts: dict) -> str:
    head = ("| S | offload | saved GiB | planned | host GiB | planned host | peak GiB | fwd+bwd ms | exact | grad diff |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['seq']} | {r['offload']} | {r['saved_gib']:.3f} | {r['planned_saved_gib']:.3f} | "
                   f"{r['host_gib']:.3f} | {r['planned_host_gib']:.3f} | {r.get('peak_gib', float('nan')):.2f} | "
                   f"{r['fwd_bwd_ms']:.1f} | {r['exact']} | {r['grad_rel_diff']:.1e} |\n" for r in rows)
    return f"# Activation offloading, one MoE block\n\n{json.dumps(facts)}\n\n" + head + body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/moe16b_128k.toml")
    ap.add_argument("--seqs", default=None, help="lengths (default 32768,65536; dry run 2048,4096)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: proves the sequence runs")
    ap.add_argument("--out", type=Path, default=Path("runs/offload_gpu"))
    a = ap.parse_args(argv)
    device = torch.device("cpu" if a.dry_run else "cuda")
    seqs = [int(s) for s in (a.seqs or ("2048,4096" if a.dry_run else "32768,65536")).split(",")]
    facts = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
             "torch": torch.__version__, "recipe": a.recipe, "dry_run": a.dry_run}
    rows = []
    for seq in seqs:
        rows += measure(a.recipe, seq, device, a.dry_run, a.iters)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps({"facts": facts, "rows": rows}, indent=1))
    (a.out / "results.md").write_text(markdown(rows, facts))
    print(f"wrote {a.out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
