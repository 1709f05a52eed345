"""RMSNorm, computed in fp32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.recompute import checkpointed


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim.  x: (..., dim); weight: (dim,), replicated under TP."""

    def __init__(self, dim: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.recompute = False  # selective recomputation: replay the fp32 math in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpointed(self._norm, x)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)
