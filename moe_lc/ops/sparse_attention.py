"""Sparse attention over gathered keys, MQA form: every query row attends to its own list of key rows of
one block, and all heads share each key row (MLA with its key up-projection absorbed into the queries, the
way DeepSeek runs DSA: the V3.2 report's "MQA mode of MLA").

Legend: B batch, Q query rows, H heads, T key rows of the block, m keys per query row, Dk key dim (MLA:
Ckv + Dr, the normalized latent and the roped shared key), Dv value dim (MLA: Ckv: a key row's first Dv
values are its value).

    idx (B, Q, m) int64: rows of the block each query attends to; -1 marks a padding slot.
    scores (B, Q, H, m) = scale * q . kv[idx];  out = softmax(scores) @ kv[idx][..., :Dv];  lse per (B, H, Q)

A query row with no key gets out 0 and lse -inf, so partial results over several blocks merge by their
LSE like ring attention's. The backward recomputes each tile from (out, lse), as flash attention does,
and scatters the key rows' gradients back with index_add_. Work runs in tiles of query rows so that the
gathered (rows, m, Dk) keys and (rows, H, m) scores stay near TILE_ELEMS elements; arithmetic in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

TILE_ELEMS = 1 << 23


def _tile_rows(B: int, m: int, H: int, Dk: int) -> int:
    return max(1, TILE_ELEMS // max(1, B * m * max(H, Dk)))


def _gather(kv: Tensor, idx: Tensor) -> Tensor:
    """kv (B, T, Dk), idx (B, q, m) (>= 0) -> (B, q, m, Dk) fp32."""
    B, T, Dk = kv.shape
    flat = (idx + torch.arange(B, device=idx.device)[:, None, None] * T).flatten()
    return kv.reshape(B * T, Dk).index_select(0, flat).view(*idx.shape, Dk).float()


def _scores(q: Tensor, keys: Tensor, pad: Tensor, scale: float) -> Tensor:
    """q (B, q, H, Dk), keys (B, q, m, Dk), pad (B, q, m) bool -> (B, q, H, m) fp32, -inf at padding."""
    s = torch.einsum("bqhd,bqmd->bqhm", q.float(), keys).mul_(scale)
    return s.masked_fill_(pad[:, :, None, :], float("-inf"))


def sparse_forward(q: Tensor, kv: Tensor, idx: Tensor, scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """q (B, Q, H, Dk), kv (B, T, Dk), idx (B, Q, m) -> out (B, Q, H, Dv) fp32, lse (B, H, Q) fp32."""
    B, Q, H, Dk = q.shape
    out = q.new_zeros(B, Q, H, d_v, dtype=torch.float32)
    lse = q.new_full((B, H, Q), float("-inf"), dtype=torch.float32)
    pad = idx < 0
    rows = _tile_rows(B, idx.shape[-1], H, Dk)
    for lo in range(0, Q, rows):
        r = slice(lo, lo + rows)
        keys = _gather(kv, idx[:, r].clamp_min(0))
        s = _scores(q[:, r], keys, pad[:, r], scale)
        l = torch.logsumexp(s, dim=-1)  # (B, q, H); -inf for a row with no key
        p = torch.exp(s - l.nan_to_num(neginf=0.0)[..., None])  # 0 at padding
        out[:, r] = torch.einsum("bqhm,bqmd->bqhd", p, keys[..., :d_v])
        lse[:, :, r] = l.transpose(1, 2)
    return out, lse


def probabilities(q: Tensor, kv: Tensor, idx: Tensor, lse: Tensor, scale: float) -> Tensor:
    """The attention probabilities of each (query, head, slot) under final lse (B, H, Q), summed over the
    heads: (B, Q, m) fp32 (0 at padding). The DSA indexer's target in the sparse stage."""
    B, Q, H, Dk = q.shape
    out = q.new_zeros(B, Q, idx.shape[-1], dtype=torch.float32)
    pad = idx < 0
    rows = _tile_rows(B, idx.shape[-1], H, Dk)
    for lo in range(0, Q, rows):
        r = slice(lo, lo + rows)
        s = _scores(q[:, r], _gather(kv, idx[:, r].clamp_min(0)), pad[:, r], scale)
        l = lse[:, :, r].transpose(1, 2).nan_to_num(neginf=0.0)[..., None]
        out[:, r] = torch.exp(s - l).sum(2)
    return out


def sparse_backward(dout: Tensor, q: Tensor, kv: Tensor, idx: Tensor, out: Tensor, lse: Tensor, scale: float,
                    d_v: int) -> tuple[Tensor, Tensor]:
    """Gradients of `sparse_forward` given the final out (B, Q, H, Dv) and lse (B, H, Q) of every block
    merged: -> dq (B, Q, H, Dk) fp32, dkv (B, T, Dk) fp32 (rows never selected get 0)."""
    B, Q, H, Dk = q.shape
    T = kv.shape[1]
    dq = torch.zeros(B, Q, H, Dk, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(B * T, Dk, dtype=torch.float32, device=q.device)
    delta = (dout.float() * out.float()).sum(-1)  # (B, Q, H)
    pad = idx < 0
    rows = _tile_rows(B, idx.shape[-1], H, Dk)
    base = torch.arange(B, device=idx.device)[:, None, None] * T
    for lo in range(0, Q, rows):
        r = slice(lo, lo + rows)
        ids = idx[:, r].clamp_min(0)
        keys = _gather(kv, ids)
        s = _scores(q[:, r], keys, pad[:, r], scale)
        p = torch.exp(s - lse[:, :, r].transpose(1, 2).nan_to_num(neginf=0.0)[..., None])
        do = dout[:, r].float()
        dp = torch.einsum("bqhd,bqmd->bqhm", do, keys[..., :d_v])
        ds = p * (dp - delta[:, r, :, None])
        dq[:, r] = torch.einsum("bqhm,bqmd->bqhd", ds, keys).mul_(scale)
        dkeys = torch.einsum("bqhm,bqhd->bqmd", ds, q[:, r].float()).mul_(scale)
        dkeys[..., :d_v] += torch.einsum("bqhm,bqhd->bqmd", p, do)
        dkeys.masked_fill_(pad[:, r, :, None], 0.0)
        dkv.index_add_(0, (ids + base).flatten(), dkeys.reshape(-1, Dk))
    return dq, dkv.view(B, T, Dk)
