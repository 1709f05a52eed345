"""SwiGLU feed-forward: the dense FFN of the first blocks and the shared experts of MoE blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_lc.ops.linear import Linear


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up.  gate_up: (..., 2F) with gate first -> (..., F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """w2(silu(x W1^T) * (x W3^T)).  W1 and W3 are fused in w13: (2*hidden, dim), column-parallel
    under TP as two sections; w2: (dim, hidden), row-parallel."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = Linear(dim, 2 * hidden)
        self.w2 = Linear(hidden, dim)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x_BSD)))
