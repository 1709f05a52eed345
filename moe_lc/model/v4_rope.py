"""DeepSeek-V4's RoPE: adjacent-channel pairs on the *last* r dims of a head, one table per layer type.

Pairs (x[2j], x[2j+1]) of the trailing r = 2 * cos.shape[-1] channels rotate by angle position * theta_j;
the leading channels pass through (transformers src/transformers/models/deepseek_v4/modeling_deepseek_v4.py,
`apply_rotary_pos_emb`: `repeat_interleave(2)` of the half-size cos/sin and an interleaved `rotate_half`).
This differs from moe_lc/model/rope.py's `apply_rope` (half-split pairs on the first dims), so V4's
checkpoints load without permuting any row. RoPE at position -i (the attention output) is the same call
with -sin.

Tables (`V4Rope`): window-only layers use base rope_theta unscaled (transformers' "main"); CSA / HCA layers,
their compressors and the indexer use compress_rope_theta with YaRN frequencies and *no* cos/sin factor
(transformers sets attention_factor = 1.0 for them). Frequencies are rope.py's `rope_inv_freq`, which follows
transformers' `_compute_yarn_parameters` (truncated correction range).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.model.rope import rope_inv_freq


def apply_tail_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, d); cos, sin (S, r/2) or (B, S, r/2) -> x with its last r dims rotated pairwise, in fp32
    math, x's dtype out."""
    r = 2 * cos.shape[-1]
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None, :], sin[:, :, None, :])
    tail = x[..., -r:].float().unflatten(-1, (-1, 2))
    x1, x2 = tail[..., 0], tail[..., 1]
    rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


class V4Rope(nn.Module):
    """cos/sin of one layer type's rope.  forward(positions (S,) or (B, S)) -> cos, sin (..., r/2) fp32."""

    def __init__(self, cfg: V4AttentionConfig, layer_type: str):
        super().__init__()
        if layer_type == "sliding_attention":
            self.args = (cfg.rope_head_dim, cfg.rope_theta)
        else:
            self.args = (cfg.rope_head_dim, cfg.compress_rope_theta, "yarn" if cfg.yarn_factor > 1 else "none",
                         cfg.yarn_factor, cfg.yarn_original_seq_len, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        self.register_buffer("inv_freq", rope_inv_freq(*self.args), persistent=False)

    def init_buffers(self) -> None:
        """Recompute the table in place (after the model was built on the meta device)."""
        self.inv_freq = rope_inv_freq(*self.args).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        return angles.cos(), angles.sin()


class PositionsOnly(nn.Module):
    """The model's `rope` for the "v4" kind (moe_lc/config/attention_kinds.py `positions`): every V4 module keeps
    its own tables (main or compress, by its layer type), so the pair a block hands it in place of (cos, sin) is
    (positions, positions); the module reads the first (a pair of tensors still, for whoever hooks the model's
    tables: the planner's trace skips them as shared by every block)."""

    def __init__(self, m=None):
        super().__init__()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return positions, positions
