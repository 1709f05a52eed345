"""Query/key normalization before RoPE (`model.qk_norm`), GQA only.

Legend: B batch, S sequence, H query heads, K kv heads, Dh head dim; under TP, H and K are this rank's.

    "head"  RMSNorm over each head's Dh dims, one weight (Dh,) shared by every q head (q_norm) and one
            by every k head (k_norm): Qwen3 / Qwen3-MoE and GLM-4.5 (transformers `Qwen3Attention`,
            `Glm4MoeAttention` with use_qk_norm): q_norm(q_proj(x).view(..., Dh)), then RoPE.
    "full"  RMSNorm over the whole projection output: q (B, S, H*Dh) with weight (H*Dh,), k (B, S, K*Dh)
            with weight (K*Dh,): OLMoE (transformers `OlmoeAttention`: q_norm(q_proj(x)) before the
            reshape into heads, then RoPE).

Both use model.norm_eps (transformers passes rms_norm_eps to these norms too). "head" is an ordinary
`RMSNorm` (replicated under TP; each tp rank's gradient covers its own heads, summed over "dp_cp_tp").
"full" is `WideRMSNorm`: under TP each rank holds a slice of the row, so its seam `sum_squares` turns
this rank's per-row sum of squares into the whole row's (an all-reduce over tp, set by the TP plan).
"""

from __future__ import annotations

import torch

from moe_lc.model.norm import RMSNorm
from moe_lc.ops.regions import region


@region
def row_sum_squares(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., 1) fp32 sum of squares over the last dim."""
    return x.float().pow(2).sum(-1, keepdim=True)


@region
def scale_rows(x: torch.Tensor, sum_squares: torch.Tensor, width: int, weight: torch.Tensor,
               eps: float) -> torch.Tensor:
    """x / sqrt(sum_squares / width + eps) * weight in fp32; x (..., d), sum_squares (..., 1) fp32 of the
    whole row (width elements), weight (d,) -> x's shape and dtype."""
    y = x.float() * torch.rsqrt(sum_squares / width + eps)
    return (y * weight.float()).to(x.dtype)


def this_rank_only(sum_squares: torch.Tensor) -> torch.Tensor:
    """The default `sum_squares` seam: the row is whole on this device."""
    return sum_squares


class WideRMSNorm(RMSNorm):
    """RMSNorm over a whole projection output that tensor parallelism may cut into slices.
    x: (..., d_local); weight: (d_local,), a slice of (width,) under TP; `width` is the full row.
    Seam `sum_squares`: (..., 1) this rank's sum of squares -> the whole row's (identity on one device)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__(width, eps)
        self.width = width
        self.sum_squares = this_rank_only

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        sum_squares = self.sum_squares(self.run_region(row_sum_squares, x))
        return self.run_region(scale_rows, x, sum_squares, self.width, self.weight, self.eps)


def qk_norms(kind: str, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
    """(q_norm, k_norm) modules for model.qk_norm = kind, or (None, None) for "none"."""
    if kind == "none":
        return None, None
    if kind == "head":
        return RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
    assert kind == "full", kind  # the recipe's choices
    return WideRMSNorm(n_heads * head_dim, eps), WideRMSNorm(n_kv_heads * head_dim, eps)
