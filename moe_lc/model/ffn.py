"""SwiGLU feed-forward: the dense FFN of the first blocks and the shared experts of MoE blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_lc.model.seams import run_now
from moe_lc.ops.linear import Linear
from moe_lc.ops.regions import region


@region(dynamic={"gate_up": (...,), "weight": (0,)})  # an expert-parallel rank's rows vary per step
def swiglu(gate_up: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up [* weight].  gate_up: (..., 2F) with gate first -> (..., F); weight: (...,) fp32,
    a routed row's gate weight (model.moe.weighted_swiglu), cast to gate_up's dtype as combine casts it."""
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return h if weight is None else h * weight.to(h.dtype).unsqueeze(-1)


def swiglu_then(down, gate_up: torch.Tensor, *args, weight: torch.Tensor | None = None,
                run_region=run_now) -> torch.Tensor:
    """The default `activation` seam: down(swiglu(gate_up, weight), *args), swiglu through the module's
    `run_region`."""
    return down(run_region(swiglu, gate_up, weight), *args)


class ClampGateUp(torch.autograd.Function):
    """DeepSeek-V4's clamped SwiGLU inputs (model.moe.swiglu_limit = L): gate_up (..., 2F), gate first ->
    [min(gate, L) | clamp(up, -L, L)]. Backward keeps only the clamped output, which the activation keeps
    anyway (one tensor, no second copy): the gradient passes where the output lies strictly inside the bounds
    (torch.clamp's would also pass it where an input equals a bound exactly)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.cat([gate.clamp(max=limit), up.clamp(-limit, limit)], dim=-1)
        ctx.save_for_backward(out)
        ctx.limit = limit
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        gate, up = out.chunk(2, dim=-1)
        inside = torch.cat([gate < ctx.limit, up.abs() < ctx.limit], dim=-1)
        return grad * inside, None


def clamp_gate_up(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up clamped as ClampGateUp says, or itself when limit is 0 (off)."""
    return ClampGateUp.apply(gate_up, limit) if limit > 0 else gate_up


class SwiGLU(nn.Module):
    """w2(silu(x W1^T) * (x W3^T)).  W1 and W3 are fused in w13: (2*hidden, dim), column-parallel
    under TP as two sections; w2: (dim, hidden), row-parallel. Seams `activation`, `run_region`
    (moe_lc/model/seams.py). limit: DeepSeek-V4's clamp of gate and up (clamp_gate_up; 0 = off)."""

    def __init__(self, dim: int, hidden: int, limit: float = 0.0):
        super().__init__()
        self.w13 = Linear(dim, 2 * hidden)
        self.w2 = Linear(hidden, dim)
        self.limit = limit
        self.activation = swiglu_then
        self.run_region = run_now

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.activation(self.w2, clamp_gate_up(self.w13(x_BSD), self.limit), run_region=self.run_region)
