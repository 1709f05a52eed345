"""moe_lc/ops/sparse_attention.py's absorbed sparse MLA attention on a CPU: the same functions and numbers
(to fp32 rounding), shaped for a CPU's caches.

Legend as there: B batch, Q query rows, H heads, T key rows of the block, m slots per query row, C the latent
rank, Dk = C + Dr a key row, Dn / Dv the nope and value head dims.

A fresh large temporary costs its page faults on every use on a CPU, and a batched GEMM over a few query rows
runs near the core's peak only while its operands stay in cache, so each pass goes
  per chunk of CHUNK query rows   the per-row projections, batched over the heads: q_abs = [q_nope W_UK,
                                  q_rope] (scaled), and in backward do W_UV, dq's W_UK, dW_UK, dW_UV
  per tile of ROW_PAIRS / m rows  the rows' m key rows gathered once into a reused (rows, m, Dk) buffer
                                  (index_select), then batched GEMMs over the rows: scores (H x m a row),
                                  softmax, the latent output; in backward three GEMMs of 2H rows a query
                                  row: [dp; s] = [do W_UV; q_abs] against the keys, [dq_abs; the latent
                                  output] = [ds; p] against the keys, and each key's gradient [ds; p]^T
                                  [q_abs; do W_UV], before one index_add_ into the block's (T, Dk) fp32
                                  gradient
Padding slots (-1) are masked only in tiles that have some.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ENABLED = True  # the CPU forms of DSA's passes (tests turn them off to check them against the device forms)
ROW_PAIRS = 8192  # (query row, slot) pairs a tile: its (rows, m, Dk) gathered keys are ~2.5 MiB at Dk = 80
CHUNK = 256  # query rows a chunk
_TINY = torch.finfo(torch.float32).tiny


def cpu_form(t: Tensor) -> bool:
    """Whether a pass over `t` takes its CPU form (moe_lc/ops/sparse_attention_cpu.py, dsa_select_cpu.py): CPU
    tensors with values (not the meta device of a dry run)."""
    return ENABLED and t.device.type == "cpu" and not t.is_meta


def _rows(m: int) -> int:
    return max(1, min(CHUNK, ROW_PAIRS // max(1, m)))


class _Work:
    """Buffers reused by name across tiles (a fresh large temporary costs its page faults)."""

    def __init__(self):
        self.bufs: dict[str, Tensor] = {}

    def __call__(self, name: str, *shape: int) -> Tensor:
        n = math.prod(shape)
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = self.bufs[name] = torch.empty(n)
        return buf[:n].view(shape)


def _absorbed(q: Tensor, w_uk: Tensor, scale: float, out: Tensor) -> Tensor:
    """q (n, H, Dn + Dr) -> out (n, H, C + Dr) = scale * [q_nope W_UK, q_rope] fp32."""
    Dn, C = w_uk.shape[1], w_uk.shape[2]
    out[..., :C] = torch.bmm(q[..., :Dn].float().transpose(0, 1), w_uk).transpose(0, 1)
    out[..., C:] = q[..., Dn:]
    return out.mul_(scale)


def _exp_(s: Tensor, out: Tensor | None = None) -> Tensor:
    """exp of scores at or below 0 (after the row's max or lse), 0 below -87: exp would return subnormals there,
    which a CPU computes many times slower, and which are below fp32's rounding of the sums they enter."""
    return torch.exp(torch.nn.functional.threshold_(s, -87.0, float("-inf")), out=out)


class _Gather:
    """The key rows of one batch's block kv (T, Dk) fp32 that a tile's query rows select, into a reused buffer."""

    def __init__(self, kv: Tensor, work: _Work):
        self.kv, self.work = kv, work

    def __call__(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """ids (rows, m) (-1: padding) -> (keys (rows, m, Dk), flat row ids int64, padding mask or None when no
        slot pads)."""
        pad = ids < 0
        if bool(pad.any()):
            flat = ids.flatten().clamp_min(0).long()
        else:
            flat, pad = ids.flatten().long(), None  # int64: index_add_ takes an int32 index 4x slower
        keys = self.work("keys", flat.numel(), self.kv.shape[-1])
        return torch.index_select(self.kv, 0, flat, out=keys).view(*ids.shape, -1), flat, pad


def _query_chunks(q: Tensor, kv: Tensor, w_uk: Tensor, scale: float, work: _Work):
    """Per batch row b and CHUNK of its queries from c0 (n of them): (b, c0, n, the absorbed queries (n, H, Dk) in
    a reused buffer, the row's key gatherer): the loop the forward and `latent_probs` share."""
    B, Q, H, _ = q.shape
    for b in range(B):
        gather = _Gather(kv[b].float().contiguous(), work)
        for c0 in range(0, Q, CHUNK):
            n = min(CHUNK, Q - c0)
            yield b, c0, n, _absorbed(q[b, c0:c0 + n], w_uk, scale, work("qa", n, H, kv.shape[-1])), gather


def _tile_scores(qa: Tensor, gather: _Gather, ids: Tensor, work: _Work) -> tuple[Tensor, Tensor, Tensor | None]:
    """qa (r, H, Dk), ids (r, m) -> (scores (r, H, m) in a reused buffer, -inf at padding; keys (r, m, Dk); pad)."""
    keys, _, pad = gather(ids)
    s = torch.bmm(qa, keys.transpose(1, 2), out=work("s", qa.shape[0], qa.shape[1], ids.shape[-1]))
    if pad is not None:
        s.masked_fill_(pad[:, None, :], float("-inf"))
    return s, keys, pad


def latent_forward(q: Tensor, kv: Tensor, idx: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float,
                   probs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """sparse_attention.latent_forward: q (B, Q, H, Dn + Dr), kv (B, T, Dk), idx (B, Q, m) -> out (B, Q, H, Dv)
    fp32, lse (B, H, Q) fp32. probs (B, Q, m) fp32 or None: filled with `latent_probs` under this lse (the final
    one when kv is the only block), from the same tiles."""
    B, Q, H, _ = q.shape
    C, m = w_uk.shape[-1], idx.shape[-1]
    w_uk, w_uv = w_uk.float(), w_uv.float()
    out = torch.empty(B, Q, H, w_uv.shape[1])
    lse = torch.empty(B, H, Q)
    rows, work = _rows(m), _Work()
    for b, c0, n, qa, gather in _query_chunks(q, kv, w_uk, scale, work):
        o_lat, lse_c = work("o_lat", n, H, C), work("lse", n, H)
        for t0 in range(0, n, rows):
            t1 = min(t0 + rows, n)
            s, keys, pad = _tile_scores(qa[t0:t1], gather, idx[b, c0 + t0:c0 + t1], work)
            mx = s.amax(-1, keepdim=True)
            if pad is not None:
                mx.nan_to_num_(neginf=0.0)  # a row with no key: p 0, lse -inf
            e = _exp_(s.sub_(mx), out=s)
            total = e.sum(-1)
            inv = total.clamp_min(_TINY).reciprocal_()[..., None]  # (rows, H, 1)
            torch.bmm(e, keys[..., :C], out=o_lat[t0:t1])
            o_lat[t0:t1].mul_(inv)
            if probs is not None:
                torch.bmm(inv.transpose(1, 2), e, out=probs[b, c0 + t0:c0 + t1, None])
            torch.add(mx[..., 0], total.log(), out=lse_c[t0:t1])
        out[b, c0:c0 + n] = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        lse[b, :, c0:c0 + n] = lse_c.T
    return out, lse


def latent_probs(q: Tensor, kv: Tensor, idx: Tensor, lse: Tensor, w_uk: Tensor, scale: float) -> Tensor:
    """sparse_attention.latent_probs: (B, Q, m) fp32, each slot's probability under the final lse (B, H, Q)
    summed over the heads, 0 at padding."""
    B, Q, _, _ = q.shape
    m = idx.shape[-1]
    out = torch.empty(B, Q, m)
    rows, work = _rows(m), _Work()
    for b, c0, n, qa, gather in _query_chunks(q, kv, w_uk.float(), scale, work):
        lse_c = lse[b, :, c0:c0 + n].T.nan_to_num(neginf=0.0)[..., None]
        for t0 in range(0, n, rows):
            t1 = min(t0 + rows, n)
            s, _, _ = _tile_scores(qa[t0:t1], gather, idx[b, c0 + t0:c0 + t1], work)
            torch.sum(_exp_(s.sub_(lse_c[t0:t1]), out=s), 1, out=out[b, c0 + t0:c0 + t1])
    return out


def latent_backward(dout: Tensor, q: Tensor, kv: Tensor, idx: Tensor, out: Tensor, lse: Tensor, w_uk: Tensor,
                    w_uv: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """sparse_attention.latent_backward: -> dq (B, Q, H, Dn + Dr), dkv (B, T, Dk) (rows never selected get 0),
    dW_UK (H, Dn, C), dW_UV (H, Dv, C), all fp32."""
    B, Q, H, _ = q.shape
    T, Dk = kv.shape[1], kv.shape[-1]
    Dn, C = w_uk.shape[1], w_uk.shape[2]
    m = idx.shape[-1]
    w_uk, w_uv = w_uk.float(), w_uv.float()
    dq = torch.empty(q.shape)
    dkv = torch.zeros(B, T, Dk)
    dw_uk, dw_uv = torch.zeros(w_uk.shape), torch.zeros(w_uv.shape)
    rows, work = _rows(m), _Work()
    for b in range(B):
        gather = _Gather(kv[b].float().contiguous(), work)
        for c0 in range(0, Q, CHUNK):
            n = min(CHUNK, Q - c0)
            do = dout[b, c0:c0 + n].float()
            delta = (do * out[b, c0:c0 + n].float()).sum(-1)[..., None]  # (n, H, 1), in Dv space
            Y = work("Y", n, 2 * H, Dk)  # [scale q_abs; do W_UV | 0]: the keys' gradient's right operand
            _absorbed(q[b, c0:c0 + n], w_uk, scale, Y[:, :H])
            Y[:, H:, :C] = torch.bmm(do.transpose(0, 1), w_uv).transpose(0, 1)
            Y[:, H:, C:] = 0.0
            Yr = work("Yr", n, 2 * H, Dk)  # its halves swapped: [do W_UV | 0; scale q_abs] against the keys
            Yr[:, :H], Yr[:, H:] = Y[:, H:], Y[:, :H]
            lse_c = lse[b, :, c0:c0 + n].T.nan_to_num(neginf=0.0)[..., None]
            Z = work("Z", n, 2 * H, Dk)  # [dq_abs / scale; p kv | p k_r] of every row
            for t0 in range(0, n, rows):
                t1 = min(t0 + rows, n)
                keys, flat, pad = gather(idx[b, c0 + t0:c0 + t1])
                x = torch.bmm(Yr[t0:t1], keys.transpose(1, 2), out=work("x", t1 - t0, 2 * H, m))  # [dp; s]
                ds, p = x[:, :H], x[:, H:]
                if pad is not None:
                    p.masked_fill_(pad[:, None, :], float("-inf"))
                _exp_(p.sub_(lse_c[t0:t1]), out=p)
                ds.sub_(delta[t0:t1]).mul_(p)  # x = [ds; p]
                torch.bmm(x, keys, out=Z[t0:t1])
                dkeys = torch.bmm(x.transpose(1, 2), Y[t0:t1], out=work("dkeys", t1 - t0, m, Dk))
                dkv[b].index_add_(0, flat, dkeys.view(-1, Dk))
            dq_abs, o_lat = Z[:, :H].mul_(scale), Z[:, H:, :C]
            qn = q[b, c0:c0 + n, :, :Dn].float().transpose(0, 1)  # (H, n, Dn)
            dq[b, c0:c0 + n, :, :Dn] = torch.bmm(dq_abs[..., :C].transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)
            dq[b, c0:c0 + n, :, Dn:] = dq_abs[..., C:]
            dw_uk.baddbmm_(qn.transpose(1, 2), dq_abs[..., :C].transpose(0, 1))
            dw_uv.baddbmm_(do.transpose(0, 1).transpose(1, 2), o_lat.transpose(0, 1))
    return dq, dkv, dw_uk, dw_uv


def indexer_grads(q: Tensor, w: Tensor, k: Tensor, idx: Tensor, dI: Tensor, scale: float, grad: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of the indexer's scores over each query row's slots, I(t, j) = sum_g w(t, g)
    relu(scale q(t, g) . k(idx(t, j))): q (B, Q, G, E), w (B, Q, G), k (B, T, E), idx (B, Q, m) (-1: padding,
    where dI must be 0), dI (B, Q, m) times grad (0-dim) -> dq (B, Q, G, E), dw (B, Q, G), dk (B, T, E), fp32."""
    B, Q, G, E = q.shape
    m = idx.shape[-1]
    dq, dw = torch.empty(q.shape), torch.empty(w.shape)
    dk = torch.zeros(B, k.shape[1], E)
    rows, work = _rows(m), _Work()
    for b in range(B):
        gather = _Gather(k[b].float().contiguous(), work)
        for t0 in range(0, Q, rows):
            t1 = min(t0 + rows, Q)
            r = t1 - t0
            keys, flat, _ = gather(idx[b, t0:t1])
            qt, d = q[b, t0:t1].float(), dI[b, t0:t1].float()
            ws = w[b, t0:t1].float() * (scale * grad)  # (rows, G): the factors of dI in d(scale q . k)
            logits = torch.bmm(qt, keys.transpose(1, 2), out=work("logits", r, G, m))  # q . k, unscaled
            torch.bmm(torch.clamp_min(logits, 0.0, out=work("relu", r, G, m)), d[..., None], out=dw[b, t0:t1, :, None])
            dlogit = torch.mul(d[:, None, :], ws[..., None], out=work("dlogit", r, G, m)).mul_(logits > 0)
            torch.bmm(dlogit, keys, out=dq[b, t0:t1])
            dk[b].index_add_(0, flat, torch.bmm(dlogit.transpose(1, 2), qt, out=work("dkeys", r, m, E)).view(-1, E))
    return dq, dw.mul_(scale * grad), dk
