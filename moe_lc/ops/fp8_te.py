"""Transformer Engine FP8 GEMMs behind the three-GEMM interface of `moe_lc.ops.fp8` (backend "te").

Written against TE 2.x and UNTESTED on real TE: TE needs CUDA and builds from source, and no machine this
project has run on has it installed (the lent GPU has none either). Read before writing, in
NVIDIA/TransformerEngine's test_float8_blockwise_gemm_exact.py, in its tests/pytorch (the blockwise GEMM
call this file copies the shape of), pytorch/cpp_extensions/gemm.py (`general_gemm`), pytorch/tensor/
float8_blockwise_tensor.py and float8_tensor.py (the quantizers). `tests/test_fp8_te.py` checks our
operand mapping against a stand-in on CPU, and the real path against the emulation wherever TE imports
on a GPU (it skips elsewhere).

Mapping. Every GEMM here is ``out = lhs @ rhs^T`` with the contraction dim last on both operands
(`fp8.gemm_operands`: fprop x @ w^T, dgrad dy @ (w^T)^T, wgrad dy^T @ (x^T)^T). cuBLASLt's FP8 GEMM
takes exactly that form as TE's layout "TN": ``general_gemm(A, B, layout="TN")`` returns ``B @ A^T``,
so A = rhs and B = lhs, each quantized *rowwise* (along its last dim) by the quantizer of its
granularity; no columnwise copies are needed because `fp8.gemm_operands` already transposed dgrad's weight
and wgrad's operands (a copy in bf16, which a fused TE module would avoid).

    granularity   TE quantizer
    tile          Float8BlockQuantizer(block_scaling_dim=1)     1x128 along the last dim
    block         Float8BlockQuantizer(block_scaling_dim=2)     128x128
    tensor        Float8CurrentScalingQuantizer                 current scaling (one amax per call)
    tensor+amax   Float8Quantizer(scale=448/amax)               delayed scaling from our amax history

Scales: ``force_pow_2_scales=False`` and ``amax_epsilon=0`` so that TE's decoding scale is amax/448, as
ours is (TE's own Float8BlockScaling recipe defaults to power-of-two scales, a different rounding). The
GEMM promotes partial sums to fp32 (``use_split_accumulator=True``, DeepSeek-V3's promotion).
"""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import torch

from moe_lc.ops import fp8

INSTALL_HINT = "pip install 'transformer-engine[pytorch]>=2.3' on a CUDA machine (it builds from source)"


@functools.lru_cache(maxsize=None)
def load_te() -> SimpleNamespace | None:
    """The TE pieces this backend uses, or None when TE (>= 2.3, with blockwise quantizers) is not
    importable. Tests replace this function with a stand-in."""
    try:
        import transformer_engine.pytorch as te_pt
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions import general_gemm
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
    except Exception:  # ImportError, or TE's own import-time checks (no CUDA, driver mismatch)
        return None
    try:
        from transformer_engine.pytorch.module.base import get_workspace
    except ImportError:
        get_workspace = None
    return SimpleNamespace(
        te=te_pt, TE_DType=TE_DType, general_gemm=general_gemm, get_workspace=get_workspace,
        Float8BlockQuantizer=Float8BlockQuantizer, Float8CurrentScalingQuantizer=Float8CurrentScalingQuantizer,
        Float8Quantizer=Float8Quantizer, fp8_ok=lambda: _te_says(te_pt, "is_fp8_available"),
        block_ok=lambda: _te_says(te_pt, "is_fp8_block_scaling_available"),
    )


def _te_says(te_pt, name: str) -> bool:
    """TE's own capability check: top-level in newer TE, on FP8GlobalStateManager in 2.x; it returns
    a bool or (bool, reason) depending on the version."""
    fn = getattr(te_pt, name, None)
    if fn is None:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        fn = getattr(FP8GlobalStateManager, name)
    answer = fn()
    return bool(answer[0] if isinstance(answer, tuple) else answer)


@functools.lru_cache(maxsize=None)
def unsupported_reason(device, recipe: str) -> str | None:
    """Why backend "te" cannot run ``recipe`` on ``device`` (None when it can); asked of TE once per
    device and recipe, since every GEMM of `auto` asks."""
    fp8.check_recipe(recipe)
    device = torch.device(device)
    te = load_te()
    if te is None:
        return f"Transformer Engine is not importable here ({INSTALL_HINT})"
    if device.type != "cuda":
        return f"Transformer Engine runs on CUDA devices only, not {device.type}"
    ok = te.block_ok() if recipe == "blockwise" else te.fp8_ok()
    return None if ok else f"Transformer Engine reports no {recipe} FP8 GEMM on this GPU"


def _quantizer(te, granularity: str, amax, device):
    dtype = te.TE_DType[fp8.FP8_DTYPE]
    if granularity in ("tile", "block"):
        return te.Float8BlockQuantizer(dtype, rowwise=True, columnwise=False, amax_epsilon=0.0,
                                       force_pow_2_scales=False, block_scaling_dim=1 if granularity == "tile" else 2)
    if amax is None:
        return te.Float8CurrentScalingQuantizer(dtype, device, rowwise=True, columnwise=False,
                                                force_pow_2_scales=False, amax_epsilon=0.0)
    # delayed: our history's amax gives TE's encoding scale (the inverse of our decoding scale)
    decode = fp8.amax_to_scale(torch.as_tensor(amax, dtype=torch.float32, device=device).reshape(1))
    return te.Float8Quantizer(1.0 / decode, torch.zeros(1, dtype=torch.float32, device=device), dtype,
                              rowwise=True, columnwise=False)


@functools.lru_cache(maxsize=None)
def _takes_workspace(general_gemm) -> bool:
    return "workspace" in inspect.signature(general_gemm).parameters  # dropped in newer TE


def te_gemm(gemm: str, first, second, recipe: str, lhs_amax=None, rhs_amax=None,
            out_dtype=torch.float32) -> torch.Tensor:
    """One of fprop / dgrad / wgrad (same arguments and shapes as `fp8.fp8_*_scaled_mm`) on TE kernels.
    Raises ValueError with the reason when TE cannot run it here."""
    reason = unsupported_reason(first.device, recipe)
    if reason is not None:
        raise ValueError(f"fp8 backend 'te': {reason}")
    te = load_te()
    lhs, rhs = fp8.gemm_operands(gemm, first, second)
    g_lhs, g_rhs = fp8.GEMM_GRANULARITY[recipe][gemm]
    n_rows, n_cols = lhs.shape[0], rhs.shape[0]
    with torch.no_grad():
        # cuBLASLt FP8 wants every dim a multiple of 16 (TE pads expert tokens for this, Fp8Padding); zero
        # rows and columns change no amax and add nothing to a sum, so padding is exact. wgrad contracts
        # over an expert's tokens, which come in any count.
        lhs, rhs = fp8.pad_rows_cols(lhs, 16, 16), fp8.pad_rows_cols(rhs, 16, 16)
        q_lhs = _quantizer(te, g_lhs, lhs_amax, lhs.device)(lhs.contiguous())
        q_rhs = _quantizer(te, g_rhs, rhs_amax, rhs.device)(rhs.contiguous())
        kwargs = {"out_dtype": out_dtype, "layout": "TN", "use_split_accumulator": True}
        if _takes_workspace(te.general_gemm):
            kwargs["workspace"] = (te.get_workspace() if te.get_workspace is not None
                                   else torch.empty(0, dtype=torch.uint8, device=lhs.device))
        out = te.general_gemm(q_rhs, q_lhs, **kwargs)[0][:n_rows, :n_cols]  # B @ A^T = lhs @ rhs^T: (R, P)
    return fp8.unflatten_gemm_out(out, gemm, first)
