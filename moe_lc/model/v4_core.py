"""DeepSeek-V4's attention core: one softmax per query over its sliding window, the compressed entries it
may read, and a learned sink logit per head (transformers src/transformers/models/deepseek_v4/
modeling_deepseek_v4.py, `eager_attention_forward` with `sinks`; the report arXiv 2606.19348, section 2.3).

Legend: B batch, S sequence, H heads, d head dim (key = value: one shared KV head), W sliding window,
n compressed entries, nb = ceil(S / W) query blocks.

    logits(t) = [ scale q_t . kv_j  for j in (t - W, t] | scale q_t . e_s  for readable s | sink_h ]
    out_t     = softmax(logits(t)) over those, sink dropped, times [kv_j | e_s]            (B, S, H, d)

The window is computed blockwise: the queries of block b see keys of blocks b-1 and b only (2W columns
of which at most W are visible), so the window branch costs S * 2W per head, never S^2. The compressed
branch is dense over the n entries with a (B, S, n) mask (HCA: causality; CSA: the indexer's top-k, which
are causal). Scores and the softmax run in fp32; the output takes q's dtype.

This is the torch reference (model.v4_attention.core = "reference"): autograd keeps the fp32 probabilities,
(B, S, H, 2W + n + 1) per layer (`v4_counting.reference_core_saved_bytes`). The default core ("tiled",
`TiledV4Core`) is moe_lc/ops/v4_sparse_core.py's: query tiles, the entries named by index or range, the
probabilities recomputed in backward, O(S H) saved (`v4_counting.tiled_core_saved_bytes`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def window_mask(n_blocks: int, W: int, device) -> torch.Tensor:
    """(nb, W, 2W) bool: query i of block b sees column c (key (b-1) W + c) when it is one of the W keys
    ending at the query, and exists (block 0 has no previous block)."""
    qi = torch.arange(W, device=device)[:, None]
    col = torch.arange(2 * W, device=device)[None, :]
    seen = (col > qi) & (col <= qi + W)
    first = seen & (col >= W)
    return torch.stack([first] + [seen] * (n_blocks - 1)) if n_blocks > 1 else first[None]


def window_keys(kv_BSd: torch.Tensor, W: int) -> torch.Tensor:
    """kv (B, S, d) -> (B, nb, 2W, d): each query block's previous and own key block (zeros before 0 and
    past S; those columns are masked)."""
    B, S, d = kv_BSd.shape
    nb = -(-S // W)
    blocks = F.pad(kv_BSd, (0, 0, 0, nb * W - S)).view(B, nb, W, d)
    prev = torch.cat([torch.zeros_like(blocks[:, :1]), blocks[:, :-1]], dim=1)
    return torch.cat([prev, blocks], dim=2)


def window_segments(seg_BS: torch.Tensor, W: int) -> torch.Tensor:
    """seg (B, S) int64 -> (B, nb, W, 2W) bool: query i of block b and key column c lie in the same segment
    (a packed document; -1 rows before a context-parallel span's sequence start). Padding never matches."""
    B, S = seg_BS.shape
    nb = -(-S // W)
    blocks = F.pad(seg_BS, (0, nb * W - S), value=-3).view(B, nb, W)
    prev = torch.cat([torch.full_like(blocks[:, :1], -4), blocks[:, :-1]], dim=1)
    return blocks[..., :, None] == torch.cat([prev, blocks], dim=2)[..., None, :]


def sink_attention(q: torch.Tensor, kv: torch.Tensor, window: int, scale: float, sinks: torch.Tensor | None,
                   entries: torch.Tensor | None = None, readable: torch.Tensor | None = None,
                   return_lse: bool = False, segments: torch.Tensor | None = None):
    """q (B, S, H, d), kv (B, S, d) roped; sinks (H,) or None; entries (B, n, d) and readable (B, S, n) bool,
    or None for a window-only layer -> out (B, S, H, d) (module docstring); with return_lse, (out, lse) where lse
    (B, S, H) fp32, detached, is the log-sum-exp of each query's logits (window, entries and sink): what the
    indexer loss reads the attention's probabilities of the entries from (moe_lc/model/v4_index_loss.py).
    segments (B, S) int64 or None: a window key is read only in its query's segment (packed documents, and the rows
    a context-parallel rank holds: moe_lc/model/v4_layout.py); None: one segment."""
    B, S, H, d = q.shape
    W = window
    nb = -(-S // W)
    keys = window_keys(kv.float(), W)  # (B, nb, 2W, d)
    qb = F.pad(q.float(), (0, 0, 0, 0, 0, nb * W - S)).view(B, nb, W, H, d)
    s_w = torch.einsum("bnqhd,bnkd->bnqhk", qb, keys) * scale
    seen = window_mask(nb, W, q.device)[None]
    if segments is not None:
        seen = seen & window_segments(segments, W)
    s_w = s_w.masked_fill(~seen[:, :, :, None, :], float("-inf"))
    parts = [s_w.view(B, nb * W, H, 2 * W)[:, :S]]
    if entries is not None:
        s_c = torch.einsum("bshd,bnd->bshn", q.float(), entries.float()) * scale
        parts.append(s_c.masked_fill(~readable[:, :, None, :], float("-inf")))
    if sinks is not None:
        parts.append(sinks.float().view(1, 1, H, 1).expand(B, S, H, 1))
    logits = torch.cat(parts, dim=-1)
    p = logits.softmax(dim=-1)
    p_w = F.pad(p[..., :2 * W], (0, 0, 0, 0, 0, nb * W - S)).view(B, nb, W, H, 2 * W)
    out = torch.einsum("bnqhk,bnkd->bnqhd", p_w, keys).reshape(B, nb * W, H, d)[:, :S]
    if entries is not None:
        n = entries.shape[1]
        out = out + torch.einsum("bshn,bnd->bshd", p[..., 2 * W:2 * W + n], entries.float())
    if return_lse:
        return out.to(q.dtype), logits.detach().logsumexp(dim=-1)
    return out.to(q.dtype)


class V4Core(nn.Module):
    """The `core` seam of a V4 attention module, model.v4_attention.core = "reference": `sink_attention`, which
    entries a query reads given as a (B, S, n) bool mask `reads`."""

    def forward(self, q, kv, window: int, scale: float, sinks, entries=None, reads=None, segments=None):
        """-> (out (B, S, H, d), lse (B, S, H) fp32 detached) (`sink_attention`)."""
        return sink_attention(q, kv, window, scale, sinks, entries, reads, return_lse=True, segments=segments)


class TiledV4Core(nn.Module):
    """The `core` seam, model.v4_attention.core = "tiled": moe_lc/ops/v4_sparse_core.py `sparse_sink_attention`
    (its Triton form, moe_lc/kernels/v4_sparse_attention.py, on CUDA tensors), saving O(S H). `reads` names the
    entries without a (B, S, n) tensor: a CSA layer's (`picks`) the indexer's picks (B, S, k) int64, -1 empty;
    an HCA layer's the visible counts (B, S) or the (B, S, 2) [first, stop) ranges of packed documents."""

    def __init__(self, picks: bool):
        super().__init__()
        self.picks = picks

    def forward(self, q, kv, window: int, scale: float, sinks, entries=None, reads=None, segments=None):
        """-> (out (B, S, H, d), lse (B, S, H) fp32 detached), as V4Core's."""
        from moe_lc.ops.v4_sparse_core import sparse_sink_attention

        which = {} if entries is None else {"picked": reads} if self.picks else {"visible": reads}
        if q.device.type == "cuda":  # inputs built by V4Attention: the kernel's entry, without the torch form's checks
            from moe_lc.kernels.v4_sparse_attention import sparse_sink_attention as kernel

            return kernel(q, kv, window, scale, sinks, entries, segments=segments, **which)
        return sparse_sink_attention(q, kv, window, scale, sinks, entries, segments=segments, **which)

    def extra_repr(self) -> str:
        return f"reads={'picked' if self.picks else 'visible'}"
