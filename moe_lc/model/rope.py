"""Rotary position embedding with YaRN long-context scaling, as the official YaRN code computes it.

theta_i = b^(-2i/d) for rotated pair i (d rotated dims). YaRN with factor s and original length L
(Peng et al. 2023, the reference implementation jquesnelle/yarn, which DeepSeek, transformers
`_compute_yarn_parameters` and torchtitan copy): the correction dims

    dim(r) = d * ln(L / (2 pi r)) / (2 ln b)        the pair index that turns r times within L
    low, high = floor(dim(beta_fast)), ceil(dim(beta_slow))   (clamped to [0, d-1]; not rounded if
                                                                rope.truncate = false)

bound a ramp that is linear over the pair *index*: gamma_i = clamp((i - low) / (high - low), 0, 1),
and theta'_i = theta_i / s * gamma_i + theta_i * (1 - gamma_i): pairs below `low` (fast, many
rotations) keep their frequency, pairs above `high` are interpolated by s. (A ramp linear in the
rotation count r itself, which this file used before, changes 25 of the 64 frequencies of a 4K ->
128K model by up to 75%, and a checkpoint extended elsewhere would not load as trained.)

Attention temperature, transformers' convention: cos and sin are multiplied by
    m(s, rope.mscale) / m(s, rope.mscale_all_dim)   when both are set, else m(s, 1),
with m(s, x) = 0.1 x ln(s) + 1 (1 for s <= 1); DeepSeek's MLA also multiplies its softmax scale by
m(s, rope.mscale_all_dim)^2 (mla.py). Positions are explicit so that zig-zag context-parallel shards
rotate by their true positions.

Llama 3.1's scaling (`rope.scaling = "llama3"`, transformers `_compute_llama3_parameters`): with
wavelength w_i = 2 pi / theta_i, L = original_seq_len, a = low_freq_factor, c = high_freq_factor,
theta'_i = theta_i for w_i < L / c, theta_i / s for w_i > L / a, and between them
(1 - g) theta_i / s + g theta_i with g = (L / w_i - a) / (c - a); no attention factor.

Partial rotary (`rope.partial_rotary_factor`, GLM-4.5): only the first rot_dim = int(head_dim * factor)
dims of a head are rotated, as pairs (j, j + rot_dim/2) (transformers' rotate_half on `q[..., :rot_dim]`);
the rest pass through.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_lc.ops.regions import region


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """m(s, x) = 0.1 x ln(s) + 1, and 1 without scaling (DeepSeek's `yarn_get_mscale`)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_range(dim: int, theta: float, original_seq_len: int, beta_fast: float, beta_slow: float,
                          truncate: bool = True) -> tuple[float, float]:
    """(low, high) pair indices of YaRN's ramp (see the module docstring)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, original_seq_len: int, low_freq_factor: float,
                    high_freq_factor: float) -> torch.Tensor:
    """Llama 3.1's frequencies from the unscaled ones (see the module docstring), in the order and
    dtype of transformers' `_compute_llama3_parameters`."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_seq_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original_seq_len / high_freq_factor) * ~(wavelen > original_seq_len / low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(rot_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                  original_seq_len: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                  truncate: bool = True, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0) -> torch.Tensor:
    """Angular frequency per rotated pair, (rot_dim // 2,) float32 (the official code's dtype)."""
    pos_freqs = theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    inv_freq = 1.0 / pos_freqs
    if scaling == "none" or factor == 1.0:
        return inv_freq
    if scaling == "llama3":
        return llama3_inv_freq(inv_freq, factor, original_seq_len, low_freq_factor, high_freq_factor)
    assert scaling == "yarn", scaling  # the recipe's choices
    low, high = yarn_correction_range(rot_dim, theta, original_seq_len, beta_fast, beta_slow, truncate)
    if low == high:
        high += 0.001  # the reference code's guard against a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: interpolated by the factor
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The cos/sin factor (transformers' `attention_factor` when the config does not give one)."""
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions.  forward(positions (S,)) -> cos, sin: (S, rot_dim // 2) fp32,
    both multiplied by the YaRN attention factor."""

    def __init__(self, rot_dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                 original_seq_len: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 truncate: bool = True, mscale: float = 1.0, mscale_all_dim: float = 0.0,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0):
        super().__init__()
        self.args = (rot_dim, theta, scaling, factor, original_seq_len, beta_fast, beta_slow, truncate,
                     low_freq_factor, high_freq_factor)
        scaled = scaling == "yarn" and factor != 1.0
        self.attention_factor = yarn_attention_factor(factor, mscale, mscale_all_dim) if scaled else 1.0
        self.register_buffer("inv_freq", rope_inv_freq(*self.args), persistent=False)

    @classmethod
    def from_config(cls, rope, rot_dim: int) -> "RotaryEmbedding":
        """From a [model.rope] section (moe_lc.config.RopeConfig)."""
        return cls(rot_dim, rope.theta, rope.scaling, rope.factor, rope.original_seq_len, rope.beta_fast,
                   rope.beta_slow, rope.truncate, rope.mscale, rope.mscale_all_dim, rope.low_freq_factor,
                   rope.high_freq_factor)

    def init_buffers(self) -> None:
        """Recompute the table in place (after the model was built on the meta device)."""
        self.inv_freq = rope_inv_freq(*self.args).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (S,) or (B, S) (per row under `data.document_positions`) -> cos, sin (..., rot_dim / 2)."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


@region
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., j], x[..., j + r/2]) of the first r = 2 * cos.shape[-1] dims, pass the rest
    (partial rotary).  x: (B, S, H, d); cos, sin: (S, r/2), or (B, S, r/2) when each row has its own
    positions. Same dtype out."""
    rot = 2 * cos.shape[-1]
    x1, x2 = (x if rot == x.shape[-1] else x[..., :rot]).float().chunk(2, dim=-1)
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None, :], sin[:, :, None, :])
    rotated = [x1 * c - x2 * s, x1 * s + x2 * c]
    return torch.cat(rotated if rot == x.shape[-1] else [*rotated, x[..., rot:].float()], dim=-1).to(x.dtype)
