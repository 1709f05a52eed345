"""DeepSeek-V3's activation quantization in one pass: x in 1x128 tiles along K, and x^T in 1x128 tiles along M.

x (M, K) bf16 / fp16 / fp32, any strides. Each program loads one 128x128 block of x once and writes
    x_fp8  (M, K)  float8_e4m3fn, scale   (M, ceil(K/128))  fp32: a scale per 1x128 tile of a row (fprop / dgrad)
    xt_fp8 (K, M)  float8_e4m3fn, scale_t (K, ceil(M/128))  fp32: a scale per 128x1 tile of x, i.e. per 1x128
                                                            tile of a row of x^T (the weight-gradient GEMM)
so a Linear's input is read once for both of its FP8 copies (DeepSeek-V3 report, section 3.3: activations
are quantized per 1x128 tile, and the weight gradient needs them along the tokens). Scales are decoding
scales (x ~= x_fp8 * scale) laid out column-major, stride (1, rows): the layout torch's blockwise FP8 GEMM
(F.scaled_mm with ScalingType.BlockWise1x128, pytorch ScaledBlas.cpp) takes without a copy.

Numbers: bit-identical to moe_lc.ops.fp8.quantize_rowwise_tiles (the torch reference): amax in fp32 over the
tile's existing elements (a short last tile is masked, not padded with data), scale = max(amax, 1e-12) / 448
correctly rounded (tl.math.div_rn; a plain `/` is approximate on NVIDIA GPUs), 1 for an all-zero tile,
x / scale correctly rounded, clamped to +-448, rounded to nearest even into E4M3.

The cast to E4M3 is done with integer arithmetic on the fp32 bits (`_e4m3_codes`) and stored as bytes:
Triton 3.9's interpreter converts fp32 -> float8e4nv with a carry bug (127.9 becomes 64, not 128) and
rounds ties away from zero, so `.to(tl.float8e4nv)` cannot be held to torch on CPU. The integer cast is the
same code on both and costs a few ALU ops in a memory-bound kernel; ``hw_cast=True`` uses the hardware
conversion instead (cvt.rn.satfinite on SM89+), for the benchmark and the GPU test to compare.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128  # DeepSeek-V3's tile: 1x128 (fixed: the scales' meaning depends on it)


@triton.jit
def _decoding_scale(amax):
    """fp32 amax -> amax / 448 (floored at 1e-12 / 448), exactly 1 where amax == 0 (fp8.amax_to_scale)."""
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, 448.0, tl.float32))
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def _e4m3_codes(y):
    """fp32 y, |y| <= 448 or NaN -> float8_e4m3fn bit patterns (uint8), round to nearest even.

    Normal range (|y| >= 2^-6): drop 20 of the 23 mantissa bits with RNE on the bit pattern (a mantissa carry
    moves into the exponent by itself), then rebias 127 -> 7 (120 << 3 = 960). Subnormals (steps of 2^-9):
    adding 2^14, whose ulp is 2^-9, makes the fp32 adder round |y| to a multiple of 2^-9 (RNE), and the low
    bits of the sum are that multiple; 8 of them is 2^-6, the first normal code, so the seam is exact."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    subnormal = (tl.abs(y) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000  # bits of 2^14
    code = tl.where(mag < 0x3C800000, subnormal, normal)  # 0x3C800000: 2^-6
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def _encode(x, scale, HW_CAST: tl.constexpr):
    """x / scale (broadcast), saturated to +-448, as E4M3 bytes; NaN stays NaN (torch's clamp keeps it)."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0, propagate_nan=tl.PropagateNan.ALL)
    if HW_CAST:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _e4m3_codes(y)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_xm, stride_xk,
                     ROWWISE: tl.constexpr, TRANSPOSED: tl.constexpr, HW_CAST: tl.constexpr, BLOCK: tl.constexpr):
    """One program per 128x128 block (pid 0 along M, pid 1 along K). Scales are column-major: scale[m, t] at
    m + t * M, scale_t[k, t] at k + t * K."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)  # M * K may pass 2^31 at 128K tokens
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols64[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)  # masked elements are 0: they change no amax
    if ROWWISE:
        scale = _decoding_scale(tl.max(tl.abs(x), axis=1))  # (BLOCK,) one per row
        tl.store(q_ptr + rows64[:, None] * K + cols64[None, :], _encode(x, scale[:, None], HW_CAST), mask=mask)
        tl.store(s_ptr + rows64 + pid_k * M, scale, mask=rows < M)
    if TRANSPOSED:
        scale_t = _decoding_scale(tl.max(tl.abs(x), axis=0))  # (BLOCK,) one per column
        codes_t = tl.trans(_encode(x, scale_t[None, :], HW_CAST))  # (BLOCK k, BLOCK m)
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        tl.store(qt_ptr + cols64[:, None] * M + rows64[None, :], codes_t, mask=mask_t)
        tl.store(st_ptr + cols64 + pid_m * K, scale_t, mask=cols < K)


def _column_major(rows: int, cols: int, device) -> torch.Tensor:
    """An fp32 (rows, cols) tensor with stride (1, rows)."""
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def _launch(x: torch.Tensor, rowwise: bool, transposed: bool, hw_cast: bool):
    if x.dim() != 2:
        raise ValueError(f"the FP8 quantize kernel takes a 2-D x (M, K); got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"the FP8 quantize kernel takes a float x; got {x.dtype}")
    M, K = x.shape
    dev = x.device
    q = torch.empty(M, K, dtype=torch.uint8, device=dev) if rowwise else None
    s = _column_major(M, triton.cdiv(K, BLOCK), dev) if rowwise else None
    qt = torch.empty(K, M, dtype=torch.uint8, device=dev) if transposed else None
    st = _column_major(K, triton.cdiv(M, BLOCK), dev) if transposed else None
    if M and K:
        grid = (triton.cdiv(M, BLOCK), triton.cdiv(K, BLOCK))
        _quantize_kernel[grid](x, q, s, qt, st, M, K, x.stride(0), x.stride(1), ROWWISE=rowwise,
                               TRANSPOSED=transposed, HW_CAST=hw_cast, BLOCK=BLOCK, num_warps=8)
    as_fp8 = (lambda t: t.view(FP8_DTYPE))
    return (as_fp8(q) if rowwise else None), s, (as_fp8(qt) if transposed else None), st


def quantize_tiles(x: torch.Tensor, hw_cast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> x_fp8 (M, K), scale (M, ceil(K/128)) column-major: fp8.quantize_rowwise_tiles(x)'s numbers."""
    q, s, _, _ = _launch(x, True, False, hw_cast)
    return q, s


def quantize_transposed_tiles(x: torch.Tensor, hw_cast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> xt_fp8 (K, M), scale_t (K, ceil(M/128)) column-major: quantize_rowwise_tiles(x.t())'s numbers,
    without the transposed copy of x."""
    _, _, qt, st = _launch(x, False, True, hw_cast)
    return qt, st


def quantize_tiles_and_transposed(x: torch.Tensor, hw_cast: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> (x_fp8 (M, K), scale (M, ceil(K/128)), xt_fp8 (K, M), scale_t (K, ceil(M/128))): both
    quantizations a Linear's input needs (fprop, and the weight gradient), x read once."""
    return _launch(x, True, True, hw_cast)
