"""DeepSeek-V4's KV compressors: every m tokens pooled into one entry by a learned softmax gate (report arXiv
2606.19348, sections 2.3.1-2.3.2; transformers src/transformers/models/deepseek_v4/modeling_deepseek_v4.py,
DeepseekV4HCACompressor / DeepseekV4CSACompressor, and the indexer's own compressor in DeepseekV4Indexer).

Legend: B batch, S sequence, D model dim, d the entry width (head_dim; index_head_dim for the indexer's),
m tokens per entry, n = S // m entries (a trailing partial window makes none), c = 2 with overlap, else 1.

    [kv | z] = x @ wkv_gate^T                         (B, S, 2 c d)   one Linear for kv_proj and gate_proj
    z       += position_bias[t mod m]                  (m, c d) learned, per slot of a window
    no overlap (HCA):  entry w = sum over window w's m slots of softmax_slots(z) * kv           per channel
    overlap (CSA):     each token gives two series, kv = [Ca | Cb] (d each); entry w pools 2m slots: window
                       w-1's Ca then window w's Cb (window 0: its Cb only), stride m, width 2m
    entry            = RoPE_tail(RMSNorm(pooled), position w * m)       (B, n, d), the compress rope

Entry w holds tokens up to (w + 1) m - 1, so a query at position t may read it only when
w < (t + 1) // m (`visible_entries`, transformers' `causal_threshold`): nothing from the future.
Packed documents and context parallelism (`pooled`, moe_lc/model/v4_layout.py): the same pooling over windows
given by their last row in extended rows (each document on its own grid, window w-1's Ca only inside the document),
roped at each entry's own position.
The gate's softmax runs in fp32 (transformers' `dtype=torch.float32`), the weights cast back to kv's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.norm import RMSNorm
from moe_lc.model.seams import run_now
from moe_lc.model.v4_rope import apply_tail_rope
from moe_lc.ops.linear import Linear


def gated_pool(kv: torch.Tensor, gate: torch.Tensor, m: int, overlap: bool) -> torch.Tensor:
    """kv, gate (B, n, m, c d), gate with its position bias -> pooled (B, n, d) (module docstring)."""
    if overlap:
        d = kv.shape[-1] // 2
        (kv_a, kv_b), (z_a, z_b) = kv.split(d, dim=-1), gate.split(d, dim=-1)
        # window w's first m slots are window w-1's Ca; window 0 has none: zero kv, -inf gate (weight 0)
        kv_prev = torch.cat([torch.zeros_like(kv_a[:, :1]), kv_a[:, :-1]], dim=1)
        z_prev = torch.cat([torch.full_like(z_a[:, :1], float("-inf")), z_a[:, :-1]], dim=1)
        kv, gate = torch.cat([kv_prev, kv_b], dim=2), torch.cat([z_prev, z_b], dim=2)
    weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=2)


def visible_entries(positions: torch.Tensor, m: int) -> torch.Tensor:
    """positions (S,) or (B, S) -> entries each query may read, (S,) or (B, S): (t + 1) // m."""
    return torch.div(positions + 1, m, rounding_mode="floor")


class Compressor(nn.Module):
    """x (B, S, D) -> compressed entries (B, S // m, d), roped at their first token's position.
    Parameters (transformers' names in brackets): wkv_gate (2 c d, D) [kv_proj; gate_proj],
    position_bias (m, c d) fp32 [position_bias], kv_norm (d,) [kv_norm]."""

    def __init__(self, dim: int, entry_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.entry_dim, self.rate, self.overlap = entry_dim, rate, overlap
        width = (2 if overlap else 1) * entry_dim
        self.wkv_gate = Linear(dim, 2 * width)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.init_zeros = ("position_bias",)  # (init.py) starts at 0, as transformers' _init_weights
        self.kv_norm = RMSNorm(entry_dim, eps)
        self.run_region = run_now

    def forward(self, x_BSD: torch.Tensor, rope) -> torch.Tensor:
        """rope: the layer's V4Rope (positions -> cos, sin); entries sit at positions 0, m, 2m, ..."""
        B, S, _ = x_BSD.shape
        m, n = self.rate, S // self.rate
        if n == 0:
            return x_BSD.new_zeros(B, 0, self.entry_dim)
        usable = x_BSD[:, :n * m]  # the partial window at the end makes no entry (yet)
        kv, gate = self.wkv_gate(usable).view(B, n, m, -1).chunk(2, dim=-1)
        # the bias is fp32: the gate is promoted to fp32 here, as transformers adds them
        pooled = gated_pool(kv, gate + self.position_bias, m, self.overlap)
        cos, sin = rope(torch.arange(n, device=x_BSD.device) * m)
        entries = self.kv_norm(pooled).view(B, n, 1, self.entry_dim)
        return self.run_region(apply_tail_rope, entries, cos, sin).view(B, n, self.entry_dim)

    def pooled(self, x_BSD: torch.Tensor, rope, grid) -> torch.Tensor:
        """x (B, S_ext, D) extended rows, grid: moe_lc/model/v4_layout.py's EntryGrid -> the entries this rank
        pools (B, n_own, d) (padding slots hold finite values no query reads)."""
        B, m, d = x_BSD.shape[0], self.rate, self.entry_dim
        n_own = grid.last.shape[1]
        if n_own == 0:
            return x_BSD.new_zeros(B, 0, d)
        rows = self.wkv_gate(x_BSD)  # (B, S_ext, 2 c d)
        C = rows.shape[-1]

        def window(last):  # (B, n_own) last rows -> (B, n_own, m, C): that window's rows, biased gate
            idx = (last[..., None] - (m - 1) + torch.arange(m, device=last.device)).clamp_min(0)
            kv, gate = rows.gather(1, idx.view(B, -1, 1).expand(-1, -1, C)).view(B, n_own, m, C).chunk(2, dim=-1)
            return kv, gate + self.position_bias

        kv, gate = window(grid.last)
        if self.overlap:  # window w-1's Ca slots, then window w's Cb (w = 0: no earlier window, weight 0)
            kv_p, gate_p = window(grid.last - m)
            gate_p = gate_p.masked_fill(~grid.has_prev[..., None, None], float("-inf"))
            kv = torch.cat([kv_p[..., :d], kv[..., d:]], dim=2)
            gate = torch.cat([gate_p[..., :d], gate[..., d:]], dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        pooled = (kv * weights).sum(dim=2)
        cos, sin = rope(grid.pos)
        entries = self.kv_norm(pooled).view(B, n_own, 1, d)
        return self.run_region(apply_tail_rope, entries, cos, sin).view(B, n_own, d)

    def extra_repr(self) -> str:
        return f"rate={self.rate}, entry_dim={self.entry_dim}, overlap={self.overlap}"
