"""FP8 as a storage format: tensors sent or kept in E4M3 with their fp32 scales, not multiplied.

- On the wire (FP8 dispatch, DeepSeek-V3 section 3.3.3): `pack_fp8_rows` puts each row's 1 x 128-tile
  FP8 values and scales in one uint8 row, so one all-to-all moves both; `FP8Rounded` is the same
  rounding where no all-to-all carries the rows (ep = 1).
- In memory, for backward (FP8 activation caching, `precision.fp8_cache`): `Fp8Tiles` is a tensor kept
  as 1 x 128 tiles along its last dim and dequantized when backward reads it. (The one Linear's own
  input cache is `moe_lc.ops.fp8.wgrad_operand`: the input quantized exactly as its weight-gradient
  GEMM will quantize it, so keeping it changes no number.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lc.ops.fp8 import BLOCK, FP8_DTYPE, dequantize_rowwise_tiles, quantize_rowwise_tiles


def pack_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x (n, K) -> (n, K + 4 ceil(K/128)) uint8: each row's 1 x 128-tile FP8 values, then its fp32 scales
    (the payload of FP8 dispatch: one all-to-all moves both, and rows stay rows)."""
    x_fp8, scale = quantize_rowwise_tiles(x)
    return torch.cat([x_fp8.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def unpack_fp8_rows(packed: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``pack_fp8_rows``: (n, K + 4 ceil(K/128)) uint8 -> (n, K) ``dtype``."""
    x_fp8 = packed[:, :k].contiguous().view(FP8_DTYPE)
    scale = packed[:, k:].contiguous().view(torch.float32)
    return dequantize_rowwise_tiles(x_fp8, scale).to(dtype)


def fp8_row_bytes(k: int) -> int:
    """Bytes of one packed row of K values (``pack_fp8_rows``), and of one row of an `Fp8Tiles`."""
    return k + 4 * -(-k // BLOCK)


class FP8Rounded(torch.autograd.Function):
    """x rounded through the FP8 wire format (``pack_fp8_rows`` then unpack), in x's dtype; the gradient
    passes straight through. What FP8 dispatch does to tokens when no all-to-all carries them (ep = 1),
    so every layout computes the same numbers."""

    @staticmethod
    def forward(ctx, x):
        return unpack_fp8_rows(pack_fp8_rows(x), x.shape[-1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


@dataclass(frozen=True)
class Fp8Tiles:
    """A tensor kept in FP8 for backward: ``data`` (..., C) float8_e4m3fn and ``scale`` (..., ceil(C/128))
    fp32, 1 x 128 tiles along the last dim (power-of-two scales where ``pow2``); ``dequantize`` gives it
    back in ``dtype``. `tensors` are what an autograd function saves (so saved-tensor hooks, the memory
    tools and recomputation see them)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def quantize(cls, x: torch.Tensor, pow2: bool = False) -> Fp8Tiles:
        with torch.no_grad():
            return cls(*quantize_rowwise_tiles(x.detach(), pow2=pow2), x.dtype)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scale

    def dequantize(self) -> torch.Tensor:
        """(..., C) in ``dtype`` (exact with power-of-two scales: an FP8 value times 2^k fits any float)."""
        return dequantize_rowwise_tiles(self.data, self.scale).to(self.dtype)
