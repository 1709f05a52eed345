"""FP8 (E4M3) quantization and scaled matmul: DeepSeek-V3 blockwise recipe plus a tensorwise baseline.

Conventions (every function here):
- FP8 is ``torch.float8_e4m3fn``: 3 mantissa bits, max 448, no inf; we saturate (clamp to +-448) before casting.
- ``scale`` is the *decoding* scale, ``x ~= x_fp8.float() * scale``, with ``scale = amax / 448`` over the group
  (an all-zero group gets scale 1; a tiny amax is floored at ``_AMAX_FLOOR``). Same convention as the
  ``scale_a`` / ``scale_b`` arguments of ``torch._scaled_mm``. Scales are float32.
- Granularities: "tile" = 1x128 along the last dim, scale (R, ceil(C/128)); "block" = 128x128, scale
  (ceil(R/128), ceil(C/128)); "tensor" = one 0-dim scale. Short last tiles/blocks are fine (no caller padding).

Why tiles run along the *contraction* dim. Every GEMM here is ``out = A @ B^T`` summing over c. If A's
scale sa[r, c//128] and B's sb[p, c//128] are constant inside each 128-chunk k of c, then
``out[r, p] = sum_k sa[r, k] * sb[p, k] * sum_{c in chunk k} qa[r, c] * qb[p, c]``: the inner sum is one FP8
tensor-core MMA and the scaled partial sums are added in FP32 on CUDA cores (DeepSeek-V3's "promotion every
128 elements of K"). A scale varying along c inside a chunk could not be pulled out of the inner sum; along
the free dims (r, p) it may vary freely. Hence (x: (M tokens, K), w: (N, K), dy: (M, N)):
- fprop  y  = x @ w^T    contracts K: x 1x128 tiles along K,   w 128x128 blocks.
- dgrad  dx = dy @ w     contracts N: dy 1x128 tiles along N,  w^T 128x128 blocks (the same blocks as w).
- wgrad  dw = dy^T @ x   contracts M: dy^T and x^T 1x128 tiles along M (tokens) -- a different quantization
  of x and dy than fprop/dgrad use, as in DeepSeek-V3.

Two ways to run a GEMM: ``fp8_*_emulated`` (quantize, dequantize to fp32 -- q * s rounds once, 2^-24 relative
--, fp32 matmul; runs anywhere; models scale granularity and E4M3 rounding, not Hopper's limited-precision
(~14-bit, per DeepSeek-V3) tensor-core accumulation inside a 128-chunk) and
``fp8_*_scaled_mm`` (``torch._scaled_mm`` where ``scaled_mm_backend`` finds one, else the emulation).
Either takes an operand that is already ``Quantized`` (``wgrad_operand``): FP8 activation caching
quantizes a Linear's input in forward exactly as its weight-gradient GEMM would in backward, and keeps that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_lc.kernels import quantize_tiles as triton_quantize_tiles, triton_available
from moe_lc.ops.device import cuda_version, gpu_capability

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_AMAX_FLOOR = 1e-12
RECIPES = ("blockwise", "tensorwise")
# recipe -> gemm -> (lhs granularity, rhs granularity); every gemm is lhs @ rhs^T (see gemm_operands).
GEMM_GRANULARITY = {
    "blockwise": {"fprop": ("tile", "block"), "dgrad": ("tile", "block"), "wgrad": ("tile", "tile")},
    "tensorwise": {g: ("tensor", "tensor") for g in ("fprop", "dgrad", "wgrad")},
}


def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """Decoding scale from amax (any shape): amax/448, floored; exactly 1 where amax == 0."""
    amax = amax.float()
    scale = amax.clamp(min=_AMAX_FLOOR) / FP8_MAX
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _to_fp8(x_scaled: torch.Tensor) -> torch.Tensor:
    """Saturating cast: values beyond +-448 (including +-inf) become +-448; NaN stays NaN."""
    return x_scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x.shape[-1] % multiple
    return F.pad(x, (0, pad)) if pad else x


def quantize_rowwise_tiles(x: torch.Tensor, tile: int = BLOCK, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize per 1 x ``tile`` group along the last dim (activations, output grads).

    x: (..., K) any float dtype. Returns x_fp8 (..., K) float8_e4m3fn and scale (..., ceil(K/tile)) float32.
    The last tile may be short (K % tile != 0); its amax is taken over the elements that exist.
    ``pow2``: scales rounded up to a power of two (DeepSeek-V3's "round scaled" factors), so x_fp8 * scale
    is exact in any float format and a later requantization in other tiles adds no error of its own.
    """
    if tile < 1:
        raise ValueError(f"tile={tile} must be >= 1")
    if x.is_cuda and x.dim() == 2 and tile == BLOCK and not pow2 and triton_available():
        return triton_quantize_tiles(x)  # one Triton pass, bit-identical; scale column-major (as F.scaled_mm takes it)
    k = x.shape[-1]
    x_tiles = _pad_last(x.float(), tile).unflatten(-1, (-1, tile))  # (..., Kt, tile)
    scale = amax_to_scale(x_tiles.abs().amax(dim=-1))  # (..., Kt)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    x_fp8 = _to_fp8(x_tiles / scale.unsqueeze(-1)).flatten(-2)[..., :k]
    return x_fp8.contiguous(), scale


def dequantize_rowwise_tiles(x_fp8: torch.Tensor, scale: torch.Tensor, tile: int = BLOCK) -> torch.Tensor:
    """Inverse of ``quantize_rowwise_tiles``: (..., K) fp8 and (..., ceil(K/tile)) -> (..., K) float32."""
    return x_fp8.float() * scale.repeat_interleave(tile, dim=-1)[..., :x_fp8.shape[-1]]


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize per ``block`` x ``block`` square (weights).

    w: (N, K) any float dtype. Returns w_fp8 (N, K) float8_e4m3fn and scale (ceil(N/block), ceil(K/block))
    float32. Edge blocks may be short in either dim. ``quantize_blocks(w.t())`` gives the transposed
    fp8 values and scales of ``quantize_blocks(w)``: fprop and dgrad share one quantized weight.
    """
    if w.dim() != 2 or block < 1:
        raise ValueError(f"quantize_blocks needs a 2-D weight and block >= 1; got {tuple(w.shape)}, block={block}")
    n, k = w.shape
    w_pad = _pad_last(_pad_last(w.float(), block).t(), block).t()  # (Np, Kp), zeros do not change amax
    w_blocks = w_pad.unflatten(0, (-1, block)).unflatten(-1, (-1, block))  # (Nb, block, Kb, block)
    scale = amax_to_scale(w_blocks.abs().amax(dim=(1, 3)))  # (Nb, Kb)
    w_fp8 = _to_fp8(w_blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:n, :k]
    return w_fp8.contiguous(), scale


def dequantize_blocks(w_fp8: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of ``quantize_blocks``: (N, K) fp8 and (ceil(N/block), ceil(K/block)) -> (N, K) float32."""
    n, k = w_fp8.shape
    scale_full = scale.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return w_fp8.float() * scale_full


def quantize_tensorwise(x: torch.Tensor, amax: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one scale for the whole tensor.

    x: any shape, any float dtype. ``amax=None`` is *current* scaling (x's own amax); passing an amax (e.g.
    ``DelayedScaling.scale_amax()``) is *delayed* scaling. Values with |x| > amax saturate to +-448
    (dequantize to +-amax): never inf, and NaN only from NaN inputs. Returns x_fp8 (x's shape) and a 0-dim
    float32 scale.
    """
    if amax is None:  # (an empty x, e.g. an expert without tokens, has amax 0: scale 1)
        amax = x.detach().abs().amax() if x.numel() else 0.0
    scale = amax_to_scale(torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(()))
    return _to_fp8(x.float() / scale), scale


def dequantize_tensorwise(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_tensorwise``: fp8 (any shape) and 0-dim scale -> float32."""
    return x_fp8.float() * scale


class DelayedScaling:
    """Amax history for tensorwise *delayed* scaling (Transformer Engine's recipe), one per tensor role.

    Step t quantizes with the max of the amaxes recorded at the previous ``history_len`` steps, then records
    its own amax: ``state.quantize(x)`` does both. Before any update, ``scale_amax()`` is None and
    ``quantize`` falls back to current scaling. If x outgrows the history, |x| > amax saturates to +-448
    (dequantizes to +-amax); it never produces inf or NaN. Amaxes are kept as a device tensor (no host sync).
    A non-finite amax (an overflowed step) is recorded as the current history max, so it cannot poison scales.
    """

    def __init__(self, history_len: int = 16):
        if history_len < 1:
            raise ValueError(f"history_len={history_len} must be >= 1")
        self.history_len = history_len
        self.amax_history: torch.Tensor | None = None  # (history_len,) float32, ring buffer
        self.num_updates = 0

    def update(self, amax: torch.Tensor | float) -> None:
        """Record one step's amax (a scalar >= 0; inf/NaN count as the history max); keep the last few."""
        amax_t = torch.as_tensor(amax, dtype=torch.float32).detach().reshape(())
        if self.amax_history is None:
            self.amax_history = torch.zeros(self.history_len, dtype=torch.float32, device=amax_t.device)
        amax_t = amax_t.to(self.amax_history.device)
        amax_t = torch.where(torch.isfinite(amax_t), amax_t, self.amax_history.max())
        self.amax_history[self.num_updates % self.history_len] = amax_t
        self.num_updates += 1

    def scale_amax(self) -> torch.Tensor | None:
        """Max over the recorded history (0-dim float32), or None before the first update."""
        return None if self.amax_history is None else self.amax_history.max()  # unfilled slots are 0, amaxes >= 0

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize x with the history's amax (current scaling on the first call), then record x's amax."""
        x_fp8, scale = quantize_tensorwise(x, amax=self.scale_amax())
        self.update(x.detach().abs().amax())
        return x_fp8, scale


# ----------------------------------------------------------------------------------------------------
# GEMMs. Each is lhs (R, C) @ rhs (P, C)^T -> (R, P), contracting C; see gemm_operands for the mapping.


@dataclass(frozen=True)
class Quantized:
    """A GEMM operand already quantized the way the GEMM here would quantize it: ``data`` fp8 (R, C) and
    ``scale`` of ``granularity`` ("tile": (R, ceil(C/128)); "block": (ceil(R/128), ceil(C/128)); "tensor":
    0-dim), in the (lhs or rhs) layout of ``gemm_operands``. Every GEMM path takes it in place of the tensor
    it came from and computes the same numbers: FP8 activation caching keeps these for the weight gradient
    instead of the tensor, the FP8 weight cache (moe_lc/ops/fp8_weights.py) fprop's and dgrad's weight."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self) -> torch.Tensor:
        return _dequantize(self.data, self.scale, self.granularity)


def check_recipe(recipe: str) -> None:
    """ValueError unless ``recipe`` is one of ``RECIPES``."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe={recipe!r} must be one of {RECIPES}")


def _quantize(t: torch.Tensor | Quantized, granularity: str, amax) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(t, Quantized):
        if t.granularity != granularity or amax is not None:
            raise ValueError(f"a {t.granularity}-quantized operand where the GEMM quantizes by {granularity}")
        return t.data, t.scale
    if granularity == "tensor":
        return quantize_tensorwise(t, amax)
    if amax is not None:
        raise ValueError("an explicit amax (delayed scaling) applies to the tensorwise recipe only")
    return quantize_rowwise_tiles(t) if granularity == "tile" else quantize_blocks(t)


def _dequantize(t_fp8: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    fn = {"tensor": dequantize_tensorwise, "tile": dequantize_rowwise_tiles, "block": dequantize_blocks}
    return fn[granularity](t_fp8, scale)


def gemm_operands(gemm: str, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map (x, w) / (dy, w) / (dy, x) to (lhs, rhs) with out = lhs @ rhs^T; leading dims are flattened.

    fprop: lhs x (M, K), rhs w (N, K). dgrad: lhs dy (M, N), rhs w^T (K, N). wgrad: lhs dy^T (N, M),
    rhs x^T (K, M). So the last dim of lhs and rhs is always the contraction dim (where tiles run).
    """
    if gemm == "fprop":
        x, w = first, second
        if len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"fprop needs x (..., K) and w (N, K); got {tuple(x.shape)} and {tuple(w.shape)}")
        return x.reshape(-1, x.shape[-1]), w
    if gemm == "dgrad":  # a Quantized w comes as its rhs w^T (K, N) already (the FP8 weight cache's)
        dy, w = first, second
        n = w.shape[1] if isinstance(w, Quantized) else w.shape[0]
        if len(w.shape) != 2 or dy.shape[-1] != n:
            raise ValueError(f"dgrad needs dy (..., N) and w (N, K); got {tuple(dy.shape)} and {tuple(w.shape)}")
        return dy.reshape(-1, dy.shape[-1]), w if isinstance(w, Quantized) else w.t()
    dy, x = first, second  # either may come as its Quantized lhs / rhs, (N, M) / (K, M), see wgrad_operand
    lhs = dy if isinstance(dy, Quantized) else dy.reshape(-1, dy.shape[-1]).t()
    rhs = x if isinstance(x, Quantized) else x.reshape(-1, x.shape[-1]).t()
    if lhs.shape[1] != rhs.shape[1]:
        shapes = f"{tuple(dy.shape)} and {tuple(x.shape)}"
        raise ValueError(f"wgrad needs dy (..., N) and x (..., K) over the same tokens; got {shapes}")
    return lhs, rhs


def wgrad_granularity(recipe: str) -> str:
    """How the wgrad GEMM of ``recipe`` quantizes its operands ("tile" or "tensor"; dy and x alike)."""
    check_recipe(recipe)
    return GEMM_GRANULARITY[recipe]["wgrad"][1]


def wgrad_operand(t: torch.Tensor, recipe: str) -> Quantized:
    """dy (M, N) or x (M, K) quantized now exactly as the wgrad GEMM of ``recipe`` will quantize it: its
    transpose in 1 x 128 tiles along the M tokens (blockwise), or one current scale (tensorwise)."""
    granularity = wgrad_granularity(recipe)
    return Quantized(*_quantize(t.reshape(-1, t.shape[-1]).t(), granularity, None), granularity)


def fp8_gemm_emulated(gemm: str, first, second, recipe: str, lhs_amax=None, rhs_amax=None) -> torch.Tensor:
    """``gemm`` "fprop" (x, w), "dgrad" (dy, w) or "wgrad" (dy, x) emulated, as ``fp8_linear_emulated`` and
    friends (shapes, float32 output); ``lhs_amax`` / ``rhs_amax``: the first / second operand's."""
    check_recipe(recipe)
    lhs, rhs = gemm_operands(gemm, first, second)
    g_lhs, g_rhs = GEMM_GRANULARITY[recipe][gemm]
    lhs_deq = _dequantize(*_quantize(lhs, g_lhs, lhs_amax), g_lhs)
    rhs_deq = _dequantize(*_quantize(rhs, g_rhs, rhs_amax), g_rhs)
    return unflatten_gemm_out(lhs_deq @ rhs_deq.t(), gemm, first)


def unflatten_gemm_out(out: torch.Tensor, gemm: str, first: torch.Tensor) -> torch.Tensor:
    """A GEMM's (R, P) output in the first operand's leading dims: fprop (..., N), dgrad (..., K); wgrad as is."""
    return out if gemm == "wgrad" else out.reshape(*first.shape[:-1], out.shape[-1])


def fp8_linear_emulated(x, w, recipe, *, x_amax=None, w_amax=None) -> torch.Tensor:
    """fprop y = Q(x) @ Q(w)^T (quantize, dequantize to fp32, fp32 matmul): x (..., K), w (N, K) -> y (..., N) fp32.
    "blockwise": x 1x128 tiles along K, w 128x128 blocks; "tensorwise": one scale each (amaxes: delayed scaling)."""
    return fp8_gemm_emulated("fprop", x, w, recipe, x_amax, w_amax)


def fp8_dgrad_emulated(dy, w, recipe, *, dy_amax=None, w_amax=None) -> torch.Tensor:
    """dgrad dx = Q(dy) @ Q(w), emulated: dy (..., N), w (N, K) -> dx (..., K) fp32; dy 1x128 tiles along N."""
    return fp8_gemm_emulated("dgrad", dy, w, recipe, dy_amax, w_amax)


def fp8_wgrad_emulated(dy, x, recipe, *, dy_amax=None, x_amax=None) -> torch.Tensor:
    """wgrad dw = Q(dy)^T @ Q(x), emulated: dy (..., N), x (..., K) -> dw (N, K) fp32. "blockwise": dy^T (N, M)
    and x^T (K, M) in 1x128 tiles along the tokens M (the contraction), not along N / K as in fprop and dgrad."""
    return fp8_gemm_emulated("wgrad", dy, x, recipe, dy_amax, x_amax)


# ----------------------------------------------------------------------------------------------------
# Real kernels via torch._scaled_mm / torch.nn.functional.scaled_mm.


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_accepts(rowwise: bool) -> bool:
    """Probe once whether this build's CPU ``torch._scaled_mm`` takes fp8 with tensorwise / rowwise scales."""
    a = b = torch.ones(16, 32).to(FP8_DTYPE)
    s_a, s_b = (torch.ones(16, 1), torch.ones(1, 16)) if rowwise else (torch.tensor(1.0), torch.tensor(1.0))
    try:
        torch._scaled_mm(a, b.t(), scale_a=s_a, scale_b=s_b, out_dtype=torch.float32)
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


def scaled_mm_backend(device, recipe: str) -> str:
    """How ``fp8_*_scaled_mm`` runs ``recipe`` on ``device``: "native", "chunked_rowwise" or "emulated".

    - cpu, tensorwise: "native" (torch._scaled_mm with 0-dim scales; verified on torch 2.13 CPU).
    - cpu, blockwise: CPU _scaled_mm rejects 1x128 / 128x128 scales but takes rowwise ones, so we run one
      rowwise _scaled_mm per 128-chunk of the contraction dim and add in fp32 ("chunked_rowwise"): the
      promotion scheme itself, slow but real kernels.
    - cuda (not ROCm): tensorwise "native" on compute capability >= 8.9. blockwise "native" only on SM90
      (Hopper) with cuBLAS >= 12.9 and ``torch.nn.functional.scaled_mm`` (torch >= 2.10); pytorch
      ``_check_deepseek_support`` rejects other archs. UNTESTED here (no GPU in CI).
    - anything else: "emulated".
    """
    check_recipe(recipe)
    device = torch.device(device)
    if device.type == "cpu":
        if recipe == "tensorwise":
            return "native" if _cpu_scaled_mm_accepts(rowwise=False) else "emulated"
        return "chunked_rowwise" if _cpu_scaled_mm_accepts(rowwise=True) else "emulated"
    capability = gpu_capability(device)
    if capability is None:
        return "emulated"
    if recipe == "tensorwise":
        return "native" if capability >= (8, 9) else "emulated"
    has_v2 = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
    return "native" if capability[0] == 9 and has_v2 and cuda_version(device) >= (12, 9) else "emulated"


def scaled_mm_support(device, recipe: str) -> bool:
    """True if ``fp8_*_scaled_mm`` runs ``recipe`` on ``device`` through torch._scaled_mm kernels,
    False if it falls back to the quantize-dequantize emulation (see ``scaled_mm_backend``)."""
    return scaled_mm_backend(device, recipe) != "emulated"


def pad_rows_cols(t: torch.Tensor | Quantized, row_multiple: int, col_multiple: int) -> torch.Tensor | Quantized:
    """Zero-pad a 2-D tensor; zeros change no amax and add nothing to a product, so padding is exact. A
    Quantized operand is padded as its tensor would quantize: zero codes, and scale 1 for all-zero rows (tiles);
    128 x 128 blocks padded to multiples of 128 keep their scales (the zeros fall inside the edge blocks)."""
    pad = (0, -t.shape[1] % col_multiple, 0, -t.shape[0] % row_multiple)
    if not isinstance(t, Quantized):
        return F.pad(t, pad)
    if not any(pad):
        return t
    data = F.pad(t.data.view(torch.uint8), pad).view(FP8_DTYPE)  # code 0 is 0.0
    assert t.granularity != "block" or row_multiple % BLOCK == 0 == col_multiple % BLOCK, "blocks pad whole only"
    scale = t.scale if t.granularity != "tile" else F.pad(t.scale, (0, 0, 0, pad[3]), value=1.0)
    return Quantized(data, scale, t.granularity)


def _chunked_rowwise_gemm(lhs, rhs, g_lhs, g_rhs, lhs_amax, rhs_amax) -> torch.Tensor:
    """CPU blockwise: sum over 128-chunks k of _scaled_mm(lhs_k, rhs_k^T, sa[:, k], sb[:, k]) in fp32."""
    lhs_fp8, lhs_scale = _quantize(lhs, g_lhs, lhs_amax)  # (R, C), (R, Ct)
    rhs_fp8, rhs_scale = _quantize(rhs, g_rhs, rhs_amax)  # (P, C), (P, Ct) or (Pb, Ct)
    n_rows, n_cols = lhs.shape[0], rhs.shape[0]
    if g_rhs == "block":  # expand block scales to one per rhs row: (P, Ct)
        rhs_scale = rhs_scale.repeat_interleave(BLOCK, dim=0)[:n_cols]
    out = torch.zeros(n_rows, n_cols, dtype=torch.float32, device=lhs.device)
    for k, start in enumerate(range(0, lhs.shape[1], BLOCK)):
        chunk = slice(start, start + BLOCK)
        out += torch._scaled_mm(lhs_fp8[:, chunk], rhs_fp8[:, chunk].t(), scale_a=lhs_scale[:, k : k + 1].contiguous(),
                                scale_b=rhs_scale[:, k][None, :].contiguous(), out_dtype=torch.float32)
    return out


def _cuda_blockwise_scale(scale: torch.Tensor, granularity: str, is_rhs: bool) -> torch.Tensor:
    """Scale layouts for F.scaled_mm (pytorch ScaledBlas.cpp, _scaled_block1x128_block128x128 and friends).

    1x128 (lhs (R, Ct) or rhs (P, Ct)): same shape, column-major (stride (1, R)).
    128x128 rhs (Pb, Ct): shape (L4, Pb) with stride (1, L4), L4 = Ct rounded up to 4, zero-padded.
    """
    if granularity == "tile":
        return scale.t().contiguous().t()
    assert is_rhs, "blockwise recipes put 128x128 blocks on the rhs only"
    return _pad_last(scale, 4).contiguous().t()


def scaled_mm_operands(lhs, rhs, g_lhs: str, g_rhs: str, lhs_amax=None, rhs_amax=None) -> tuple:
    """lhs (R, C), rhs (P, C) quantized as torch's FP8 kernels on their device take them -> (lhs fp8, lhs scale,
    rhs fp8, rhs scale). Off the CPU (SM90 cuBLASLt, or meta standing for it) zero-padded to dims % 16 (tensorwise)
    or % 128 (blockwise contraction / rhs dims, as pytorch's tests do), blockwise scales laid out for F.scaled_mm."""
    on_gpu = lhs.device.type != "cpu"
    multiple = 16 if g_lhs == "tensor" else BLOCK
    # each padded copy is quantized at once and dropped: one alive at a time
    lhs_fp8, lhs_scale = _quantize(pad_rows_cols(lhs, 16, multiple) if on_gpu else lhs, g_lhs, lhs_amax)
    rhs_fp8, rhs_scale = _quantize(pad_rows_cols(rhs, multiple, multiple) if on_gpu else rhs, g_rhs, rhs_amax)
    if on_gpu and g_lhs != "tensor":
        lhs_scale = _cuda_blockwise_scale(lhs_scale, g_lhs, is_rhs=False)
        rhs_scale = _cuda_blockwise_scale(rhs_scale, g_rhs, is_rhs=True)
    return lhs_fp8, lhs_scale, rhs_fp8, rhs_scale


def _native_gemm(lhs, rhs, g_lhs, g_rhs, lhs_amax, rhs_amax, out_dtype) -> torch.Tensor:
    """One torch._scaled_mm (tensorwise) or F.scaled_mm (blockwise, CUDA only; UNTESTED without a GPU)."""
    n_rows, n_cols = lhs.shape[0], rhs.shape[0]
    lhs_fp8, lhs_scale, rhs_fp8, rhs_scale = scaled_mm_operands(lhs, rhs, g_lhs, g_rhs, lhs_amax, rhs_amax)
    if g_lhs == "tensor":
        out = torch._scaled_mm(lhs_fp8, rhs_fp8.t(), scale_a=lhs_scale, scale_b=rhs_scale, out_dtype=out_dtype)
    else:
        recipe_enum = {"tile": F.ScalingType.BlockWise1x128, "block": F.ScalingType.BlockWise128x128}
        out = F.scaled_mm(lhs_fp8, rhs_fp8.t(), lhs_scale, recipe_enum[g_lhs], rhs_scale, recipe_enum[g_rhs],
                          output_dtype=out_dtype)
    if out.shape == (n_rows, n_cols):
        return out
    # a copy, not a view: wherever the output is saved for backward, a view would keep the padded buffer
    return out[:n_rows, :n_cols].clone(memory_format=torch.contiguous_format)


def fp8_gemm_scaled_mm(gemm: str, first, second, recipe: str, lhs_amax=None, rhs_amax=None,
                       out_dtype=torch.float32) -> torch.Tensor:
    """``fp8_gemm_emulated`` on real kernels where ``scaled_mm_backend`` finds them, in ``out_dtype``."""
    backend = scaled_mm_backend(first.device, recipe)
    if backend == "emulated":
        return fp8_gemm_emulated(gemm, first, second, recipe, lhs_amax, rhs_amax).to(out_dtype)
    lhs, rhs = gemm_operands(gemm, first, second)
    g_lhs, g_rhs = GEMM_GRANULARITY[recipe][gemm]
    if backend == "chunked_rowwise":
        out = _chunked_rowwise_gemm(lhs, rhs, g_lhs, g_rhs, lhs_amax, rhs_amax).to(out_dtype)
    else:
        out = _native_gemm(lhs, rhs, g_lhs, g_rhs, lhs_amax, rhs_amax, out_dtype)
    return unflatten_gemm_out(out, gemm, first)


def fp8_linear_scaled_mm(x, w, recipe, *, x_amax=None, w_amax=None, out_dtype=torch.float32) -> torch.Tensor:
    """fprop y = x @ w^T like ``fp8_linear_emulated``, y (..., N) in ``out_dtype``, on real kernels where available."""
    return fp8_gemm_scaled_mm("fprop", x, w, recipe, x_amax, w_amax, out_dtype)


def fp8_dgrad_scaled_mm(dy, w, recipe, *, dy_amax=None, w_amax=None, out_dtype=torch.float32) -> torch.Tensor:
    """dgrad dx = dy @ w like ``fp8_dgrad_emulated``, on real kernels where available."""
    return fp8_gemm_scaled_mm("dgrad", dy, w, recipe, dy_amax, w_amax, out_dtype)


def fp8_wgrad_scaled_mm(dy, x, recipe, *, dy_amax=None, x_amax=None, out_dtype=torch.float32) -> torch.Tensor:
    """wgrad dw = dy^T @ x like ``fp8_wgrad_emulated``, on real kernels where available."""
    return fp8_gemm_scaled_mm("wgrad", dy, x, recipe, dy_amax, x_amax, out_dtype)
