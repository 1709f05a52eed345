"""Rotary position embedding with YaRN long-context scaling.

theta_i = b^(-2i/d), wavelength lambda_i = 2*pi/theta_i; YaRN with factor s and original length L:
r_i = L / lambda_i (rotations of dim pair i within L); gamma_i = 0 if r_i < beta_slow, 1 if
r_i > beta_fast, linear between; theta'_i = (1 - gamma_i) * theta_i / s + gamma_i * theta_i.
High-frequency pairs (many rotations) keep their frequency, low-frequency pairs are interpolated.
The attention temperature mscale = coef * ln(s) + 1 multiplies the softmax scale twice (q and k).
Positions are explicit so that zig-zag context-parallel shards rotate by their true positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                  original_seq_len: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """Angular frequency per rotated pair, (head_dim // 2,) float64."""
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    inv_freq = theta ** (-i / head_dim)
    if scaling == "none" or factor == 1.0:
        return inv_freq
    if scaling != "yarn":
        raise ValueError(f"rope scaling {scaling!r} must be 'none' or 'yarn'")
    rotations = original_seq_len * inv_freq / (2 * math.pi)  # r_i = L / lambda_i
    gamma = ((rotations - beta_slow) / (beta_fast - beta_slow)).clamp(0.0, 1.0)
    return (1 - gamma) * inv_freq / factor + gamma * inv_freq


def yarn_mscale(factor: float, coef: float = 0.1) -> float:
    """YaRN attention temperature; 1 without scaling."""
    return 1.0 if factor <= 1.0 else coef * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions.  forward(positions (S,)) -> cos, sin: (S, rot_dim // 2) fp32."""

    def __init__(self, rot_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                 original_seq_len: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0):
        super().__init__()
        self.args = (rot_dim, theta, scaling, factor, original_seq_len, beta_fast, beta_slow)
        self.register_buffer("inv_freq", rope_inv_freq(*self.args), persistent=False)

    def init_buffers(self) -> None:
        """Recompute the table in place (after the model was built on the meta device)."""
        self.inv_freq = rope_inv_freq(*self.args).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., j], x[..., j + d/2]).  x: (B, S, H, d); cos, sin: (S, d/2). Same dtype out."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)
