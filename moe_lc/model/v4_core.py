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

This is the torch reference: autograd keeps the fp32 probabilities, (B, S, H, 2W + n + 1) per layer
(`v4_counting.reference_core_saved_bytes`); a fused kernel (flash-style, sink and LSE merge of the two
branches) keeps O(S H) instead and is what a GPU run needs (not built yet).
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


def sink_attention(q: torch.Tensor, kv: torch.Tensor, window: int, scale: float, sinks: torch.Tensor | None,
                   entries: torch.Tensor | None = None, readable: torch.Tensor | None = None,
                   return_lse: bool = False):
    """q (B, S, H, d), kv (B, S, d) roped; sinks (H,) or None; entries (B, n, d) and readable (B, S, n) bool,
    or None for a window-only layer -> out (B, S, H, d) (module docstring); with return_lse, (out, lse) where lse
    (B, S, H) fp32, detached, is the log-sum-exp of each query's logits (window, entries and sink): what the
    indexer loss reads the attention's probabilities of the entries from (moe_lc/model/v4_index_loss.py)."""
    B, S, H, d = q.shape
    W = window
    nb = -(-S // W)
    keys = window_keys(kv.float(), W)  # (B, nb, 2W, d)
    qb = F.pad(q.float(), (0, 0, 0, 0, 0, nb * W - S)).view(B, nb, W, H, d)
    s_w = torch.einsum("bnqhd,bnkd->bnqhk", qb, keys) * scale
    s_w = s_w.masked_fill(~window_mask(nb, W, q.device)[None, :, :, None, :], float("-inf"))
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
    """The `core` seam of a V4 attention module: `sink_attention` on one device."""

    def forward(self, q, kv, window: int, scale: float, sinks, entries=None, readable=None, return_lse=False):
        return sink_attention(q, kv, window, scale, sinks, entries, readable, return_lse)
