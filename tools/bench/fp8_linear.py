"""Benchmark part "fp8_linear": the model's Linear, forward + backward, bf16 against FP8 (DeepSeek's blockwise
recipe), at DeepSeek-V3's projection and expert shapes with M = 8192 tokens.

    python tools/bench/run.py --parts fp8_linear [--quick] [--dry-run --out DIR]

Each FP8-eligible (K in, N out) of recipes/deepseek_v3_671b.toml's model (tools/bench/gemm.py `linear_shapes`;
an expert's GEMM as one Linear of its shape) runs as `moe_lc.ops.linear.Linear` with its GEMMs chosen by the
layer plan under precision "bf16" and "fp8" (what training runs: the activation's quantization, the FP8 GEMMs
of forward, input gradient and weight gradient, and the weight's FP8 copy from `precision.fp8_weight_cache`,
quantized at the first call and reused by every timed call as by a step's micro-batches after its first:
moe_lc/ops/fp8_weights.py), and "fp8_uncached" (`precision.fp8_weight_cache = false`: the weight quantized
at every fprop and dgrad, as before the cache). Entries: M, K, N, variant ("bf16" / "fp8" / "fp8_uncached"),
fwd_bwd_ms, tflops (3 GEMMs: 6 M K N FLOPs). tools/bench/ratios.py takes the lowest bf16 / FP8 (cached) time
ratio over the shapes (issue #64: >= 1.3).

Each FP8 row also times the activation quantization alone, x (M, K) -> x and x^T in 1x128 FP8 tiles (what the
Linear's input needs for fprop and for the weight gradient): quant_torch_ms (moe_lc.ops.fp8's torch ops, two
passes), quant_triton_ms (moe_lc/kernels/fp8_quantize.py, one pass: what moe_lc.ops.fp8 runs on CUDA),
quant_triton_hw_ms (the same with the hardware E4M3 cast). The Triton ones run on CUDA, or on a CPU under
TRITON_INTERPRET=1 (the tests' dry run).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from moe_lc.config import load_config
from moe_lc.ops.linear import Linear
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from .common import ROOT, Context, Recorder, Timing, free_memory, time_fn, tflops
from .gemm import linear_shapes

PART = "fp8_linear"
RECIPE = "recipes/deepseek_v3_671b.toml"
TOKENS = 8192
DRY = ["model.dim=256", "model.n_heads=2", "model.mla.q_lora_rank=128", "model.mla.kv_lora_rank=128",
       "model.mla.qk_nope_head_dim=128", "model.mla.qk_rope_head_dim=64", "model.mla.v_head_dim=128",
       "model.moe.ffn_dim=256", "model.ffn_dim=512", "model.moe.n_routed_experts=4", "model.moe.n_groups=1",
       "model.moe.topk_groups=1", "model.moe.topk=2", "model.n_layers=2", "model.moe.n_dense_layers=1",
       "model.vocab_size=512", "model.mtp.depth=0"]

COLUMNS = [("M", "M", "{:d}"), ("K", "K", "{:d}"), ("N", "N", "{:d}"), ("layers", "layers", None),
           ("variant", "variant", None), ("fwd_bwd_ms", "fwd+bwd ms", "{:.3f}"), ("tflops", "TFLOP/s", "{:.0f}"),
           ("quant_torch_ms", "quantize torch ms", "{:.3f}"), ("quant_triton_ms", "triton ms", "{:.3f}"),
           ("quant_triton_hw_ms", "triton hw-cast ms", "{:.3f}")]


# variant -> the recipe's precision overrides
VARIANTS = {"bf16": ["precision.recipe=bf16"], "fp8": ["precision.recipe=fp8", "precision.fp8_weight_cache=true"],
            "fp8_uncached": ["precision.recipe=fp8", "precision.fp8_weight_cache=false"]}


def linear_for(ctx: Context, k: int, n: int, variant: str, dtype: torch.dtype) -> nn.Module:
    """A Linear (k -> n) on the device with the GEMMs the layer plan gives it under the precision of `variant`."""
    holder = nn.Sequential(Linear(k, n))
    torch.nn.init.normal_(holder[0].weight, std=k ** -0.5)
    holder = holder.to(device=ctx.device, dtype=dtype)
    precision = load_config(ROOT / RECIPE, VARIANTS[variant], check=False).precision
    apply_layer_plan(holder, options=LayerPlanOptions(precision=precision), device=ctx.device)
    return holder


def run(ctx: Context, rec: Recorder) -> None:
    cfg = load_config(ROOT / RECIPE, DRY if ctx.dry_run else [], check=False)
    shapes = [s for s in linear_shapes(cfg.model) if s["fp8_eligible"]][:3 if ctx.dry_run else None]
    m = 256 if ctx.dry_run else TOKENS
    # on the CPU the FP8 path is an fp32 emulation: fp32 there, bf16 on the GPU
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    for s in shapes:
        for variant in VARIANTS:
            params = {"M": m, "K": s["K"], "N": s["N"], "layers": ",".join(s["layers"]), "variant": variant}
            rec.measure(params, lambda: _measure(ctx, m, s["K"], s["N"], variant, dtype), _line)
            free_memory(ctx.device)


def _quantizers(ctx: Context) -> dict:
    """column -> x (M, K) -> its FP8 tiles along K and along M (x^T)."""
    from moe_lc.ops import fp8

    # a 3-D x takes fp8's torch ops on any device (its CUDA dispatch to the kernel takes 2-D)
    out = {"quant_torch_ms": lambda x: (fp8.quantize_rowwise_tiles(x[None]), fp8.quantize_rowwise_tiles(x.t()[None]))}
    if ctx.cuda or os.environ.get("TRITON_INTERPRET") == "1":
        from moe_lc.kernels import fp8_quantize

        out["quant_triton_ms"] = fp8_quantize.quantize_tiles_and_transposed
        out["quant_triton_hw_ms"] = lambda x: fp8_quantize.quantize_tiles_and_transposed(x, hw_cast=True)
    return out


def _quantize_times(ctx: Context, x: torch.Tensor, timing: Timing) -> dict:
    return {col: time_fn(lambda: fn(x), ctx.device, timing)["s"] * 1e3 for col, fn in _quantizers(ctx).items()}


def _measure(ctx: Context, m: int, k: int, n: int, variant: str, dtype: torch.dtype) -> dict:
    layer = linear_for(ctx, k, n, variant, dtype)
    g = torch.Generator(device=ctx.device).manual_seed(k * 7 + n)
    x = torch.randn(m, k, generator=g, device=ctx.device, dtype=dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g, device=ctx.device, dtype=dtype)

    def fwd_bwd():
        layer(x).backward(dy)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    timing = Timing(warmup=0, iters=1, min_iters=1, max_s=0.0) if ctx.dry_run else Timing(2, 10, 5, 1.0)
    t = time_fn(fwd_bwd, ctx.device, timing)
    quant = _quantize_times(ctx, x.detach(), timing) if variant == "fp8" else {}  # (the same for both FP8 rows)
    return {"fwd_bwd_ms": t["s"] * 1e3, "iters": t["n"], "tflops": tflops(6.0 * m * k * n, t["s"]), **quant}


def _line(e: dict) -> str:
    return f"fwd+bwd {e['fwd_bwd_ms']:.3f} ms, {e['tflops']:.0f} TFLOP/s"
