"""Benchmark part "layer": one MoE block of a recipe, forward + backward at 32K and 128K tokens on one GPU,
its memory against the planner's saved-activation formula.

    python tools/bench/run.py --parts layer [--recipe recipes/moe16b_128k.toml] [--quick] [--dry-run --out DIR]

The block is the recipe's first MoE block (`Block(cfg.model, n_dense_layers)`: attention with the
recipe's backend, RMSNorms, router, 64 local experts, shared experts), whole on this GPU (tp = cp =
ep = 1), bf16 parameters and activations, the recipe's recompute policy, batch 1, RoPE/YaRN tables
for the length. Measured with torch.cuda memory counters:

  saved      bytes allocated after the forward minus before it, less the output: what the block
             keeps for backward. Planner: tools.planner.activation_memory.estimate(...).layers[layer]
             (the formula tools/plan.py prints); `saved_vs_planner` = measured / planned.
  peak       the highest allocation during forward + backward above the inputs: saved activations
             plus the transients (the recomputed pieces, attention's backward buffers, the experts'
             gradient GEMM operands). `peak_vs_saved_plan` = peak / planned saved bytes: what a
             planner that counts only saved activations misses at this length.
  times      forward and forward + backward (median of a few calls).
"""

from __future__ import annotations

import torch

from ..planner.activation_memory import estimate
from moe_lc.config import load_config
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from moe_lc.model.rope import RotaryEmbedding
from moe_lc.model.block import Block
from moe_lc.model.init import init_weights
from .common import ROOT, Context, Recorder, Timing, free_memory, sync, time_fn

PART = "layer"
DEFAULT_RECIPE = "recipes/moe16b_128k.toml"
SEQS = (32768, 131072)
DRY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=32",
             "model.ffn_dim=128", "model.moe.ffn_dim=32", "model.moe.n_routed_experts=4", "model.moe.n_shared_experts=1",
             "model.moe.topk=2", "model.moe.n_groups=1", "model.moe.topk_groups=1", "model.vocab_size=512"]

COLUMNS = [("seq", "S", "{:d}"), ("policy", "recompute", None), ("fwd_ms", "fwd ms", "{:.1f}"),
           ("fwd_bwd_ms", "fwd+bwd ms", "{:.1f}"), ("saved_gib", "saved GiB", "{:.2f}"),
           ("planned_saved_gib", "planned GiB", "{:.2f}"), ("saved_vs_planner", "saved/plan", "{:.3f}"),
           ("peak_gib", "peak GiB", "{:.2f}"), ("peak_vs_saved_plan", "peak/plan", "{:.2f}")]


def first_moe_block(cfg, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """(block, rope): cfg's first MoE block (block 0 in a model without MoE layers), initialized, on
    `device` in `dtype`, with cfg's recompute seams, and the RoPE tables' module."""
    m = cfg.model
    block = Block(m, m.moe.n_dense_layers if m.moe.n_routed_experts else 0)
    with torch.no_grad():
        init_weights(block, 0, 0.02, m.n_layers)
    block = block.to(device=device, dtype=dtype)
    apply_layer_plan(block, options=LayerPlanOptions(recompute=cfg.recompute))
    return block, RotaryEmbedding.from_config(m.rope, m.rope_dim).to(device)


def build(ctx: Context):
    """(block, rope, model cfg, recompute cfg) on the device, bf16."""
    recipe = ctx.recipes[0] if ctx.recipes else DEFAULT_RECIPE
    cfg = load_config(ROOT / recipe, DRY_MODEL if ctx.dry_run else [], check=False)
    block, rope = first_moe_block(cfg, ctx.device)
    return block, rope, cfg.model, cfg.recompute


def run(ctx: Context, rec: Recorder) -> None:
    block, rope, m, recompute = build(ctx)
    seqs = [64, 128, 256] if ctx.dry_run else ([131072] if ctx.quick else list(SEQS))
    for seq in seqs:
        params = {"seq": seq, "policy": recompute.policy}
        rec.measure(params, lambda: _measure(ctx, block, rope, m, recompute, seq), _line)
        free_memory(ctx.device)


def _measure(ctx: Context, block, rope, m, recompute, seq: int) -> dict:
    device = ctx.device
    g = torch.Generator(device=device).manual_seed(seq)
    x = torch.randn(1, seq, m.dim, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(1, seq, m.dim, generator=g, device=device, dtype=torch.bfloat16)
    cos, sin = rope(torch.arange(seq, device=device))
    plan = estimate(m, 1, seq, 2, policy=recompute.policy, selective=tuple(recompute.selective),
                    layers=[block.layer_id])
    out = {"layer": block.layer_id, "planned_saved_gib": plan.layers[block.layer_id] / 2**30,
           "planned_recompute_working_gib": plan.recompute_working / 2**30}
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        y = block(x, cos, sin)
        sync(device)
        saved = torch.cuda.memory_allocated(device) - base - y.numel() * y.element_size()
        y.backward(dy)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del y
        x.grad = None
        block.zero_grad(set_to_none=True)
        out.update(saved_gib=saved / 2**30, peak_gib=peak / 2**30,
                   saved_vs_planner=saved / plan.layers[block.layer_id],
                   peak_vs_saved_plan=peak / plan.layers[block.layer_id])
    timing = Timing(warmup=1, iters=3, min_iters=1 if ctx.dry_run else 2, max_s=30.0)

    def fwd():
        with torch.no_grad():
            block(x, cos, sin)

    def fwd_bwd():
        block(x, cos, sin).backward(dy)
        x.grad = None
        block.zero_grad(set_to_none=True)

    out["fwd_ms"] = time_fn(fwd, device, timing)["s"] * 1e3
    out["fwd_bwd_ms"] = time_fn(fwd_bwd, device, timing)["s"] * 1e3
    return out


def _line(e: dict) -> str:
    mem = (f" | saved {e['saved_gib']:.2f} GiB vs planned {e['planned_saved_gib']:.2f} (x{e['saved_vs_planner']:.3f})"
           f" | peak {e['peak_gib']:.2f} GiB" if "saved_gib" in e else "")
    return f"fwd {e['fwd_ms']:.1f} ms, fwd+bwd {e['fwd_bwd_ms']:.1f} ms{mem}"
