"""RMSNorm, computed in fp32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.seams import run_now
from moe_lc.ops.regions import region


@region
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in fp32; x (..., dim), weight (dim,) -> x's shape and dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim.  x: (..., dim); weight: (dim,), replicated under TP.
    Seam `replay` runs the fp32 math, `run_region` its compiled region (see moe_lc/model/seams.py)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.replay = run_now
        self.run_region = run_now

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.replay(self._norm, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_region(rms_norm, x, self.weight, self.eps)
