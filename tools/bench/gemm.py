"""Benchmark part "gemm": the model's linear layers, bf16 vs FP8 (tensorwise, blockwise), wrapper vs kernel.

    python tools/bench/run.py --parts gemm [--recipe R.toml ...] [--quick] [--dry-run --out DIR]

Shapes: every distinct (K in, N out) of the Linear / GroupedLinear layers of the recipes' models
(default recipes/moe16b_128k.toml and recipes/deepseek_v3_671b.toml: hidden 7168, dense FFN 18432,
expert hidden 2048), read off a model built on the meta device, at full (not TP-sharded) widths;
the fp32 router gate (N = experts) is left out, and a routed expert's GEMM is timed as one dense
GEMM here (part grouped_gemm times the grouped form).
Tokens M = 4096, 8192, 16384. x: (M, K), w: (N, K), bf16, y = x @ w^T. Variants:

  bf16              x @ w.t()  (PlainGemms.fprop)
  fp8_tensorwise    moe_lc.ops.fp8.fp8_linear_scaled_mm(x, w, "tensorwise", out_dtype=bf16): quantizes
                    x and w (current scaling) every call, then the kernel; `backend` records what ran
                    (scaled_mm_backend: native / chunked_rowwise / emulated)
  fp8_blockwise     the same with "blockwise" (x 1x128 tiles, w 128x128 blocks; DeepSeek-V3)
  raw_tensorwise    torch._scaled_mm on operands quantized (and padded, as the wrapper pads) beforehand:
                    the kernel alone
  raw_tensorwise_fastacc  the same with use_fast_accum=True (the wrapper uses the default, False)
  raw_blockwise     torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128 scales in the
                    layouts moe_lc.ops.fp8 builds (CUDA "native" backend only)
  te_tensorwise     moe_lc.ops.fp8_te.te_gemm (fp8_backend = "te": TE quantizers + cuBLASLt through TE),
  te_blockwise      when TE is importable and reports the recipe on this GPU
  te_fp8            transformer_engine.pytorch.Linear under fp8_autocast, when TE is importable

FLOPs = 2 * M * N * K. `speedup_vs_bf16` = bf16 time / this time; `quant_ms` = wrapper - raw time
(quantization, padding and scale layout, i.e. what a fused quantize kernel could save).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from moe_lc.config import load_config
from moe_lc.model.transformer import Transformer
from moe_lc.ops import fp8, fp8_te
from moe_lc.ops.linear import GroupedLinear, Linear
from .common import ROOT, Context, Recorder, tflops, time_fn

PART = "gemm"
DEFAULT_RECIPES = ("recipes/moe16b_128k.toml", "recipes/deepseek_v3_671b.toml")
TOKENS = (4096, 8192, 16384)
DRY_OVERRIDES = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=32",
                 "model.ffn_dim=160", "model.moe.ffn_dim=32", "model.moe.n_routed_experts=4", "model.moe.n_shared_experts=1",
                 "model.moe.topk=2", "model.moe.n_groups=1", "model.moe.topk_groups=1", "model.vocab_size=512"]

COLUMNS = [("recipe", "recipe", None), ("layers", "layers", None), ("M", "M", "{:d}"), ("K", "K", "{:d}"),
           ("N", "N", "{:d}"), ("variant", "variant", None), ("backend", "backend", None), ("ms", "ms", "{:.3f}"),
           ("tflops", "TFLOP/s", "{:.1f}"), ("pct_peak", "% peak", "{:.1f}"),
           ("speedup_vs_bf16", "x bf16", "{:.2f}"), ("quant_ms", "quant ms", "{:.3f}")]


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def linear_shapes(model_cfg) -> list[dict]:
    """Distinct (K, N) of the model's Linear / per-expert GroupedLinear weights, with the layer names
    (block index dropped) and whether the layer is FP8-eligible. Built on the meta device: no memory."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    shapes: dict[tuple[int, int], dict] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (Linear, GroupedLinear)) or name.endswith("router.gate"):
            continue  # the router's gate runs in fp32 and is tiny (N = experts)
        short = ".".join(p for p in name.split(".") if not p.isdigit() and p != "layers")
        short = short.removeprefix("mtp.block.")  # an MTP block's layers have the main blocks' shapes
        key = (module.in_features, module.out_features)
        s = shapes.setdefault(key, {"K": key[0], "N": key[1], "layers": [], "fp8_eligible": False})
        if short not in s["layers"]:
            s["layers"].append(short)
        s["fp8_eligible"] |= bool(module.fp8_eligible)
    return sorted(shapes.values(), key=lambda s: (s["K"] * s["N"], s["K"]))


def _raw_operands(x, w, recipe: str):
    """Quantized, padded operands exactly as the wrapper's native kernels take them (kernel-only timing)."""
    return fp8.scaled_mm_operands(x, w, *fp8.GEMM_GRANULARITY[recipe]["fprop"])


def variants(ctx: Context, x, w) -> list[tuple[str, str, object]]:
    """[(variant, backend, make)]: make() prepares operands (untimed) and returns the call to time;
    a make of None is skipped, its backend string saying why."""
    out_dtype, F = torch.bfloat16, torch.nn.functional
    out = [("bf16", "torch.matmul", lambda: lambda: x @ w.t())]
    for recipe in ("tensorwise", "blockwise"):
        out.append((f"fp8_{recipe}", fp8.scaled_mm_backend(ctx.device, recipe),
                    lambda r=recipe: lambda: fp8.fp8_linear_scaled_mm(x, w, r, out_dtype=out_dtype)))

    def raw_tensorwise(fast_accum: bool):
        xq, xs, wq, ws = _raw_operands(x, w, "tensorwise")
        kwargs = {"use_fast_accum": True} if fast_accum else {}
        return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype, **kwargs)

    def raw_blockwise():
        xq, xs, wq, ws = _raw_operands(x, w, "blockwise")
        return lambda: F.scaled_mm(xq, wq.t(), xs, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128,
                                   output_dtype=out_dtype)

    tw = fp8.scaled_mm_backend(ctx.device, "tensorwise")
    if tw == "native":
        out.append(("raw_tensorwise", "torch._scaled_mm", lambda: raw_tensorwise(False)))
        if ctx.cuda:
            out.append(("raw_tensorwise_fastacc", "torch._scaled_mm", lambda: raw_tensorwise(True)))
    else:
        out.append(("raw_tensorwise", f"tensorwise backend is {tw!r}: no kernel to time alone", None))
    bw = fp8.scaled_mm_backend(ctx.device, "blockwise")
    if bw == "native" and ctx.cuda:
        out.append(("raw_blockwise", "F.scaled_mm", raw_blockwise))
    else:
        out.append(("raw_blockwise", f"blockwise backend is {bw!r}: no single blockwise kernel to time alone", None))
    for recipe in ("tensorwise", "blockwise"):
        reason = fp8_te.unsupported_reason(ctx.device, recipe)
        out.append((f"te_{recipe}", reason or "moe_lc.ops.fp8_te", None if reason else
                    (lambda r=recipe: lambda: fp8_te.te_gemm("fprop", x, w, r, out_dtype=out_dtype))))
    if ctx.cuda and _te_version() is not None:
        out.append(("te_fp8", f"transformer_engine {_te_version()}", lambda: _te_call(x, w)))
    return out


def _te_version() -> str | None:
    try:
        import transformer_engine.pytorch as te
    except Exception:  # noqa: BLE001 - absent or broken: not measured
        return None
    return str(getattr(te, "__version__", "present"))


def _te_call(x, w):
    """Transformer Engine FP8 Linear (delayed scaling), forward only, with w copied in."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    layer = te.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=torch.bfloat16, device=x.device)
    with torch.no_grad():
        layer.weight.copy_(w)
    recipe = DelayedScaling()

    def fn():
        with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            return layer(x)
    return fn


def grid(ctx: Context) -> tuple[list[tuple[str, list[str]]], list[int]]:
    """([(recipe path, overrides)], token counts M)."""
    if ctx.dry_run:
        return [(ctx.recipes[0] if ctx.recipes else DEFAULT_RECIPES[0], DRY_OVERRIDES)], [64, 128]
    recipes = ctx.recipes or list(DEFAULT_RECIPES)
    return [(r, []) for r in recipes], [8192] if ctx.quick else list(TOKENS)


def _line(e: dict) -> str:
    extra = f" x{e['speedup_vs_bf16']:.2f} vs bf16" if e.get("speedup_vs_bf16") else ""
    return f"{e['ms']:.3f} ms {e['tflops']:.1f} TFLOP/s{extra} [{e['backend']}]"


def run(ctx: Context, rec: Recorder) -> None:
    recipes, tokens = grid(ctx)
    for path, overrides in recipes:
        name = Path(path).stem
        cfg = load_config(ROOT / path if not Path(path).is_absolute() else path, overrides, check=False)
        shapes = linear_shapes(cfg.model)
        rec.note(f"{name}: {len(shapes)} distinct linear shapes: "
                 + ", ".join(f"{s['K']}x{s['N']}" for s in shapes))
        for s in shapes:
            for m in tokens:
                _measure_shape(ctx, rec, name, s, m)


def _randn(shape, seed: int, device, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) * scale


def _measure_shape(ctx: Context, rec: Recorder, recipe: str, s: dict, m: int) -> None:
    k, n = s["K"], s["N"]
    base = {"recipe": recipe, "layers": ",".join(s["layers"]), "M": m, "K": k, "N": n}
    try:
        x = _randn((m, k), m + k, ctx.device)
        w = _randn((n, k), k * 31 + n, ctx.device, k ** -0.5)
        impls = variants(ctx, x, w)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM allocating operands
        rec.fail({**base, "variant": "inputs"}, exc)
        return
    flops = gemm_flops(m, n, k)
    done: dict[str, dict] = {}
    for variant, backend, make in impls:
        params = {**base, "variant": variant}
        if make is None:
            rec.skip(params, backend)
            continue
        peak_key = "bf16" if variant == "bf16" else "fp8"

        def measure(make=make, backend=backend, peak_key=peak_key, variant=variant):
            t = time_fn(make(), ctx.device, ctx.timing)
            tf = tflops(flops, t["s"])
            result = {"backend": backend, "ms": t["s"] * 1e3, "tflops": tf, "iters": t["n"], "flops": flops,
                      "pct_peak": 100 * tf / ctx.peak[peak_key] if ctx.peak else None}
            bf16 = done.get("bf16")
            if variant != "bf16" and bf16 and bf16["status"] == "ok":
                result["speedup_vs_bf16"] = bf16["ms"] / result["ms"]
            return result

        entry = done[variant] = rec.measure(params, measure, _line)
        if variant != "bf16" and not s["fp8_eligible"]:
            entry["note"] = "the model keeps this layer in bf16"
        if variant in ("raw_tensorwise", "raw_blockwise") and entry["status"] == "ok":
            wrapper = done.get(variant.replace("raw_", "fp8_"))
            if wrapper and wrapper["status"] == "ok":
                wrapper["quant_ms"] = wrapper["ms"] - entry["ms"]
                wrapper["kernel_share"] = entry["ms"] / wrapper["ms"]
    del x, w, impls


def extra_markdown(entries: list[dict]) -> list[str]:
    """Geometric-mean FP8/bf16 speedups per variant (FP8-eligible shapes, all M)."""
    lines = []
    by_variant: dict[str, list[float]] = {}
    for e in entries:
        if e.get("status") == "ok" and e.get("speedup_vs_bf16") and "note" not in e:
            by_variant.setdefault(e["variant"], []).append(e["speedup_vs_bf16"])
    for variant, xs in sorted(by_variant.items()):
        gm = math.exp(sum(math.log(x) for x in xs) / len(xs))
        lines.append(f"- {variant}: geometric-mean speedup over bf16 x{gm:.2f} ({len(xs)} shapes x M)")
    return (["FP8 vs bf16 (FP8-eligible layers; published anchor, Transformer Engine's blockwise FP8 GEMM on H200: "
             "1.40x with quantization, ~1.9x kernel only):", ""] + lines) if lines else []
