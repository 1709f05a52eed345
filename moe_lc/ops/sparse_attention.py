"""Sparse MLA attention over gathered keys, in the absorbed ("MQA") form: every query row attends to its own
list of key rows of one block, all heads share each key row, and MLA's up-projections are folded into the
queries and the output (the way DeepSeek runs DSA: the V3.2 report's "MQA mode of MLA").

Legend: B batch, Q query rows, H heads, T key rows of the block, m keys per query row, Dn / Dr the nope and
rope dims of a query head, C the KV latent rank (Ckv), Dk = C + Dr a key row (the normalized latent | the roped
shared key), Dv the value head dim; W_UK (H, Dn, C) and W_UV (H, Dv, C) are wkv_b's rows per head.

    idx (B, Q, m) int64: rows of the block each query attends to; -1 marks a padding slot.
    q_abs  = [q_nope W_UK, q_rope]                   (B, Q, H, Dk)   per query tile, never whole
    scores = scale * q_abs . kv[idx]                 (B, Q, H, m)
    out    = (softmax(scores) @ kv[idx][..., :C]) W_UV^T   (B, Q, H, Dv), lse (B, H, Q)

So what is kept for backward is the decompressed q (Dn + Dr per head) and out (Dv per head), not the absorbed
ones (C + Dr and C per head: DeepSeek-V3 576 + 512 against 192 + 128). Partial outputs over several blocks are
merged by their LSE (linear in the latent output, so merging after W_UV is the same). A query row with no key
gets out 0 and lse -inf. The backward recomputes each tile from (out, lse), as flash attention does; the
latent output it needs for W_UV's gradient is recomputed per tile, and D = sum(dout * out) is taken in the
Dv space (it equals the latent space's). Tiles of query rows keep the gathered (rows, m, Dk) keys and the
(rows, H, m) scores near TILE_ELEMS elements; arithmetic in fp32. On a CPU each function hands over to its
form in moe_lc/ops/sparse_attention_cpu.py (the same numbers to fp32 rounding, in tiles that fit a CPU's
caches); idx may be int32 there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_lc.ops import sparse_attention_cpu

TILE_ELEMS = 1 << 23


def _tiles(Q: int, B: int, m: int, H: int, Dk: int, meta: bool = False) -> list[slice]:
    """Query-row tiles whose (rows, m, Dk) gathered keys and (rows, H, m) scores stay near TILE_ELEMS; on the
    meta device (a dry run) the first alone (its working memory is every tile's)."""
    rows = max(1, TILE_ELEMS // max(1, B * m * max(H, Dk)))
    tiles = [slice(lo, min(lo + rows, Q)) for lo in range(0, Q, rows)]
    return tiles[:1] if meta else tiles


def gather_rows(kv: Tensor, idx: Tensor) -> Tensor:
    """kv (B, T, D), idx (B, q, m) (>= 0) -> (B, q, m, D) fp32."""
    B, T, D = kv.shape
    flat = (idx + torch.arange(B, device=idx.device)[:, None, None] * T).flatten()
    return kv.reshape(B * T, D).index_select(0, flat).view(*idx.shape, D).float()


def absorb_queries(q: Tensor, w_uk: Tensor) -> Tensor:
    """q (B, q, H, Dn + Dr) -> q_abs (B, q, H, C + Dr) fp32."""
    Dn = w_uk.shape[1]
    return torch.cat([torch.einsum("bqhn,hnc->bqhc", q[..., :Dn].float(), w_uk.float()), q[..., Dn:].float()], -1)


def _probs(q_abs: Tensor, keys: Tensor, pad: Tensor, lse: Tensor | None, scale: float):
    """-> (p (B, q, H, m) fp32, lse (B, q, H)): softmax of the scores, under `lse` (B, q, H) when given."""
    s = torch.einsum("bqhd,bqmd->bqhm", q_abs, keys).mul_(scale).masked_fill_(pad[:, :, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no key
    return torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None]), lse  # 0 at padding


def latent_forward(q: Tensor, kv: Tensor, idx: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float
                   ) -> tuple[Tensor, Tensor]:
    """q (B, Q, H, Dn + Dr), kv (B, T, Dk), idx (B, Q, m) -> out (B, Q, H, Dv) fp32, lse (B, H, Q) fp32."""
    if sparse_attention_cpu.cpu_form(q):  # the same numbers, shaped for a CPU
        return sparse_attention_cpu.latent_forward(q, kv, idx, w_uk, w_uv, scale)
    B, Q, H, _ = q.shape
    C = w_uk.shape[-1]
    out = q.new_zeros(B, Q, H, w_uv.shape[1], dtype=torch.float32)
    lse = q.new_full((B, H, Q), float("-inf"), dtype=torch.float32)
    pad = idx < 0
    for r in _tiles(Q, B, idx.shape[-1], H, kv.shape[-1], q.is_meta):
        keys = gather_rows(kv, idx[:, r].clamp_min(0))
        p, l = _probs(absorb_queries(q[:, r], w_uk), keys, pad[:, r], None, scale)
        out[:, r] = torch.einsum("bqhc,hvc->bqhv", torch.einsum("bqhm,bqmc->bqhc", p, keys[..., :C]), w_uv.float())
        lse[:, :, r] = l.transpose(1, 2)
    return out, lse


def latent_probs(q: Tensor, kv: Tensor, idx: Tensor, lse: Tensor, w_uk: Tensor, scale: float) -> Tensor:
    """The attention probabilities of each (query, slot) under the final lse (B, H, Q), summed over the heads:
    (B, Q, m) fp32, 0 at padding (the DSA indexer's target in the sparse stage)."""
    if sparse_attention_cpu.cpu_form(q):  # the same numbers, shaped for a CPU
        return sparse_attention_cpu.latent_probs(q, kv, idx, lse, w_uk, scale)
    B, Q, H, _ = q.shape
    out = q.new_zeros(B, Q, idx.shape[-1], dtype=torch.float32)
    pad = idx < 0
    for r in _tiles(Q, B, idx.shape[-1], H, kv.shape[-1], q.is_meta):
        p, _ = _probs(absorb_queries(q[:, r], w_uk), gather_rows(kv, idx[:, r].clamp_min(0)), pad[:, r],
                      lse[:, :, r].transpose(1, 2), scale)
        out[:, r] = p.sum(2)
    return out


def latent_backward(dout: Tensor, q: Tensor, kv: Tensor, idx: Tensor, out: Tensor, lse: Tensor, w_uk: Tensor,
                    w_uv: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `latent_forward` given the final out (B, Q, H, Dv) and lse (B, H, Q) of every block merged:
    -> dq (B, Q, H, Dn + Dr), dkv (B, T, Dk) (rows never selected get 0), dW_UK (H, Dn, C), dW_UV (H, Dv, C),
    all fp32."""
    if sparse_attention_cpu.cpu_form(q):  # the same numbers, shaped for a CPU
        return sparse_attention_cpu.latent_backward(dout, q, kv, idx, out, lse, w_uk, w_uv, scale)
    B, Q, H, _ = q.shape
    T, Dk = kv.shape[1], kv.shape[-1]
    Dn, C = w_uk.shape[1], w_uk.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(B * T, Dk, dtype=torch.float32, device=q.device)
    dw_uk, dw_uv = torch.zeros_like(w_uk, dtype=torch.float32), torch.zeros_like(w_uv, dtype=torch.float32)
    delta = (dout.float() * out.float()).sum(-1)  # (B, Q, H): sum(dout_latent * out_latent), in Dv space
    pad = idx < 0
    base = torch.arange(B, device=idx.device)[:, None, None] * T
    for r in _tiles(Q, B, idx.shape[-1], H, Dk, q.is_meta):
        ids = idx[:, r].clamp_min(0)
        keys = gather_rows(kv, ids)
        q_abs = absorb_queries(q[:, r], w_uk)
        p, _ = _probs(q_abs, keys, pad[:, r], lse[:, :, r].transpose(1, 2), scale)
        do = dout[:, r].float()
        do_lat = torch.einsum("bqhv,hvc->bqhc", do, w_uv.float())
        dw_uv += torch.einsum("bqhv,bqhc->hvc", do, torch.einsum("bqhm,bqmc->bqhc", p, keys[..., :C]))
        ds = p * (torch.einsum("bqhc,bqmc->bqhm", do_lat, keys[..., :C]) - delta[:, r, :, None])
        dq_abs = torch.einsum("bqhm,bqmd->bqhd", ds, keys).mul_(scale)
        dq[:, r, :, :Dn] = torch.einsum("bqhc,hnc->bqhn", dq_abs[..., :C], w_uk.float())
        dq[:, r, :, Dn:] = dq_abs[..., C:]
        dw_uk += torch.einsum("bqhn,bqhc->hnc", q[:, r, :, :Dn].float(), dq_abs[..., :C])
        dkeys = torch.einsum("bqhm,bqhd->bqmd", ds, q_abs).mul_(scale)
        dkeys[..., :C] += torch.einsum("bqhm,bqhc->bqmc", p, do_lat)
        dkeys.masked_fill_(pad[:, r, :, None], 0.0)
        dkv.index_add_(0, (ids + base).flatten(), dkeys.reshape(-1, Dk))
    return dq, dkv.view(B, T, Dk), dw_uk, dw_uv
