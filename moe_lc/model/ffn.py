"""SwiGLU feed-forward: the dense FFN of the first blocks and the shared experts of MoE blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_lc.model.recompute import checkpointed, recompute_from
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
        self.recompute = False  # selective: keep gate|up only, replay the SwiGLU output in backward

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return swiglu_then(self.w2, self.w13(x_BSD), self.recompute)


def swiglu_then(down, gate_up: torch.Tensor, recompute: bool, *args) -> torch.Tensor:
    """down(swiglu(gate_up), *args); with `recompute`, only gate_up is kept for backward: the
    activation is checkpointed and the copy `down` would save is rebuilt from gate_up."""
    if not (recompute and torch.is_grad_enabled()):
        return down(swiglu(gate_up), *args)
    h = checkpointed(swiglu, gate_up)
    return recompute_from(gate_up, h, swiglu, down, *args)
