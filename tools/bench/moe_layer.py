"""Benchmark part "moe_layer": a DeepSeek-V3-shaped MoE layer on one GPU, forward + backward, bf16 against FP8.

    python tools/bench/run.py --parts moe_layer [--quick] [--dry-run --out DIR]

recipes/deepseek_v3_671b.toml's MoE (hidden 7168, expert FFN 2048, one shared expert, sigmoid routing, top-8)
with the experts one rank holds: 32 local experts in 8 groups (V3's 256 over an EP of 8), 8,192 tokens, so
each expert gets about 2,048 rows. The router, the local dispatch (permute / unpermute), the grouped expert
GEMMs and the shared expert, with the GEMMs the layer plan gives them under precision "bf16" and "fp8"
(DeepSeek's blockwise recipe; the router's gate stays in fp32). Entries: tokens, experts, variant,
fwd_bwd_ms; tools/bench/ratios.py reads bf16 / FP8 (issue #64: >= 1.15).
"""

from __future__ import annotations

import torch

from moe_lc.config import load_config
from moe_lc.model.init import init_weights
from moe_lc.model.moe import MoE
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from .common import ROOT, Context, Recorder, Timing, free_memory, time_fn

PART = "moe_layer"
RECIPE = "recipes/deepseek_v3_671b.toml"
TOKENS = 8192
LOCAL = ["model.moe.n_routed_experts=32", "model.moe.n_groups=8", "model.moe.topk_groups=4"]
DRY = ["model.dim=256", "model.moe.ffn_dim=128", "model.moe.n_routed_experts=8", "model.moe.n_groups=4",
       "model.moe.topk_groups=2", "model.moe.topk=2"]

COLUMNS = [("tokens", "tokens", "{:d}"), ("experts", "experts", "{:d}"), ("variant", "variant", None),
           ("fwd_bwd_ms", "fwd+bwd ms", "{:.2f}")]


def moe_for(ctx: Context, recipe: str, dtype: torch.dtype) -> tuple[MoE, int]:
    """(the MoE layer on the device under precision `recipe`, its dim)."""
    cfg = load_config(ROOT / RECIPE, (DRY if ctx.dry_run else LOCAL) + [f"precision.recipe={recipe}"], check=False)
    moe = MoE(cfg.model)
    with torch.no_grad():
        init_weights(moe, 0, 0.02, cfg.model.n_layers)
    moe = moe.to(device=ctx.device, dtype=dtype)
    moe.router.to(torch.float32)  # the gate runs in fp32, as in the model
    apply_layer_plan(moe, options=LayerPlanOptions(precision=cfg.precision), device=ctx.device)
    return moe.train(), cfg.model.dim


def run(ctx: Context, rec: Recorder) -> None:
    dtype = torch.bfloat16 if ctx.cuda else torch.float32  # the CPU's FP8 is an fp32 emulation
    for variant in ("bf16", "fp8"):
        moe, dim = moe_for(ctx, variant, dtype)
        for tokens in [64, 128] if ctx.dry_run else [TOKENS]:
            params = {"tokens": tokens, "experts": moe.n_experts, "variant": variant}
            rec.measure(params, lambda: _measure(ctx, moe, dim, tokens, dtype), _line)
        del moe
        free_memory(ctx.device)


def _measure(ctx: Context, moe: MoE, dim: int, tokens: int, dtype: torch.dtype) -> dict:
    g = torch.Generator(device=ctx.device).manual_seed(tokens)
    x = torch.randn(1, tokens, dim, generator=g, device=ctx.device, dtype=dtype).requires_grad_()
    dy = torch.randn(1, tokens, dim, generator=g, device=ctx.device, dtype=dtype)

    def fwd_bwd():
        moe(x).backward(dy)
        x.grad = None
        moe.zero_grad(set_to_none=True)

    timing = Timing(warmup=0, iters=1, min_iters=1, max_s=0.0) if ctx.dry_run else Timing(2, 10, 5, 2.0)
    t = time_fn(fwd_bwd, ctx.device, timing)
    return {"fwd_bwd_ms": t["s"] * 1e3, "iters": t["n"]}


def _line(e: dict) -> str:
    return f"fwd+bwd {e['fwd_bwd_ms']:.2f} ms"
