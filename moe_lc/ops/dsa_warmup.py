"""The indexer's loss in DeepSeek-V3.2's dense warm-up stage, on the ring of moe_lc/ops/dsa_ring.py.

Legend as in dsa_attention.py: B batch, Q this rank's query rows, T a block's rows, H main heads (tp-local),
Dk = Ckv + Dr, G indexer heads, E indexer head dim.

The main attention stays dense (the model's own MLA path); the indexer learns to imitate it:
    L = sum_t KL(p(t, :) || softmax(I(t, :)))   over the keys t sees,
    p(t, s) = sum_h P_h(t, s) / H_total,        P_h the main attention's probabilities of head h.
p needs each head's final log-sum-exp, so `head_lse` visits the latent blocks once first. The loss then
decomposes per key block: KL_t = sum_s p log p - sum_s p I + logsumexp_s I(t, s), each sum over blocks and
the last one online; one ring pass over the latent and indexer blocks together gives it, and the share of
p's mass on the indexer's current top-k (`dsa/topk_mass`: how much of the dense attention the sparse stage
would keep). Backward visits both again: dI = softmax(I) - p, through the indexer's ReLU-weighted heads;
the indexer keys' gradients travel home with them. Every block is cut into KEY_TILE columns and tiles of
rows, so (rows, H, keys) fp32 temporaries stay bounded at any length.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moe_lc.ops.dsa_ring import RingLayout, ring_visit, ring_visit_grads, row_tiles, tile_rows
from moe_lc.ops.dsa_select import Selection, indexer_scores, visible
from moe_lc.ops.sparse_attention import absorb_queries

KEY_TILE = 1024


def _rows(q_main: Tensor, w: Tensor) -> int:
    """Query rows per tile: (rows, H, keys) scores and (rows, G, keys) indexer logits near TILE_ELEMS."""
    return tile_rows(q_main.shape[0] * max(q_main.shape[2], w.shape[2]) * KEY_TILE)


def _tile_mask(layout: RingLayout, q_pos, k_pos, q_doc, k_doc, qt, kt):
    return visible(q_pos[qt], k_pos[kt], None if q_doc is None else q_doc[:, qt],
                   None if k_doc is None else k_doc[:, kt])


def _main_scores(q: Tensor, kv: Tensor, seen: Tensor, scale: float) -> Tensor:
    """q (B,q,H,Dk) absorbed, kv (B,k,Dk), seen (B|1,q,k) -> (B,q,H,k) fp32 scaled, -inf where not seen."""
    s = torch.einsum("bqhd,bkd->bqhk", q.float(), kv.float()).mul_(scale)
    return s.masked_fill_(~seen[:, :, None, :], float("-inf"))


@torch.no_grad()
def head_lse(ring, layout: RingLayout, q: Tensor, kv: Tensor, w_uk: Tensor, scale: float) -> Tensor:
    """The dense causal (document-masked) attention's log-sum-exp per head: q (B,Q,H,Dn+Dr) roped, kv (B,T,Dk)
    this rank's latent block, w_uk (H,Dn,Ckv) (absorbed per query tile) -> (B, H, Q) fp32."""
    q_pos = layout.positions(layout.rank, q.device)
    q_doc = layout.doc_ids(q_pos)
    lse = q.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32)

    def visit(src, blocks):
        k_pos = layout.positions(src, q.device)
        k_doc = layout.doc_ids(k_pos)
        for qt in row_tiles(q.shape[1], tile_rows(q.shape[0] * q.shape[2] * KEY_TILE), q.is_meta):
            q_abs = absorb_queries(q[:, qt], w_uk)
            for kt in row_tiles(k_pos.shape[0], KEY_TILE, q.is_meta):
                if not q.is_meta and k_pos[kt].min() > q_pos[qt].max():
                    continue
                s = _main_scores(q_abs, blocks[0][:, kt], _tile_mask(layout, q_pos, k_pos, q_doc, k_doc, qt, kt),
                                 scale)
                lse[:, :, qt] = torch.logaddexp(lse[:, :, qt], torch.logsumexp(s, -1).transpose(1, 2))

    ring_visit(ring, [kv.contiguous()], visit)
    return lse


class _Tile:
    """What both passes compute on one (query tile, key tile) of a visiting block: p and I, masked."""

    def __init__(self, ctx, blocks, q_pos, k_pos, q_doc, k_doc, qt, kt, qm):
        """qm: the query tile's absorbed main queries (B, q, H, Dk)."""
        seen = _tile_mask(ctx.layout, q_pos, k_pos, q_doc, k_doc, qt, kt)
        qI, w, lse = ctx.inputs[0][:, qt], ctx.inputs[1][:, qt], ctx.lse[:, :, qt]
        s = _main_scores(qm, blocks[1][:, kt], seen, ctx.scale_main)
        P = torch.exp(s - lse.transpose(1, 2).nan_to_num(neginf=0.0)[..., None])
        self.p = ctx.reduce_heads(P.sum(2)) / ctx.n_heads  # (B, q, k)
        self.I = indexer_scores(qI, w, blocks[0][:, kt], ctx.scale_index).masked_fill_(~seen, float("-inf"))
        self.seen = seen.expand_as(self.I)


class IndexerKLDense(torch.autograd.Function):
    """(q_idx (B,Q,G,E), w (B,Q,G), k_idx (B,T,E); q_main (B,Q,H,Dn+Dr) roped, kv (B,T,Dk), w_uk (H,Dn,Ckv),
    lse (B,H,Q) no gradient;
    layout, scales, share, ring, reduce_heads, n_heads (H over every tp rank), sel: the indexer's top-k or
    None, sink) -> (share * sum_t KL_t 0-dim fp32, stats (2,) fp64 [sum_t KL_t, sum_t p-mass on the top-k]).
    sink(*stats) is called in backward (once per micro-batch, whatever is recomputed), if given."""

    @staticmethod
    def forward(ctx, q_idx, w, k_idx, q_main, kv, w_uk, lse, layout, scale_main, scale_index, share, ring,
                reduce_heads, n_heads, sel: Selection | None, sink=None):
        ctx.inputs, ctx.q_main, ctx.kv, ctx.w_uk, ctx.lse = (q_idx, w), q_main, kv.contiguous(), w_uk, lse
        ctx.layout, ctx.ring = layout, ring
        ctx.scale_main, ctx.scale_index, ctx.share, ctx.reduce_heads, ctx.n_heads = (scale_main, scale_index, share,
                                                                                     reduce_heads, n_heads)
        B, Q = q_idx.shape[:2]
        meta = q_idx.is_meta
        q_pos = layout.positions(layout.rank, q_idx.device)
        q_doc = layout.doc_ids(q_pos)
        plogp, pI, mass = (torch.zeros(B, Q, dtype=torch.float64, device=q_idx.device) for _ in range(3))
        lse_idx = torch.full((B, Q), float("-inf"), dtype=torch.float32, device=q_idx.device)

        groups = sel.groups() if sel is not None else None

        def visit(src, blocks):
            k_pos = layout.positions(src, q_idx.device)
            k_doc = layout.doc_ids(k_pos)
            chosen = groups.block(src) if groups is not None else None
            for qt in row_tiles(Q, _rows(q_main, w), meta):
                qm = absorb_queries(q_main[:, qt], w_uk)
                for kt in row_tiles(k_pos.shape[0], KEY_TILE, meta):
                    if not meta and k_pos[kt].min() > q_pos[qt].max():
                        continue
                    t = _Tile(ctx, blocks, q_pos, k_pos, q_doc, k_doc, qt, kt, qm)
                    plogp[:, qt] += torch.where(t.p > 0, t.p * t.p.clamp_min(1e-38).log(), 0.0).sum(-1).double()
                    pI[:, qt] += torch.where(t.seen, t.p * t.I, 0.0).sum(-1).double()
                    lse_idx[:, qt] = torch.logaddexp(lse_idx[:, qt], torch.logsumexp(t.I, -1))
                    if chosen is not None:
                        mass[:, qt] += (t.p * _chosen_mask(chosen, qt, kt, t.p.shape)).sum(-1).double()

        ring_visit(ring, [k_idx.contiguous(), ctx.kv], visit)
        kl = plogp - pI + lse_idx.double()
        # all through save_for_backward, so saved-tensor hooks (the planner's count, train.offload) see them
        ctx.save_for_backward(q_idx, w, k_idx, q_main, ctx.kv, w_uk, lse, lse_idx)
        del ctx.q_main, ctx.kv, ctx.w_uk, ctx.lse
        stats = torch.stack([kl.sum(), mass.sum()])
        ctx.mark_non_differentiable(stats)
        ctx.stats, ctx.sink = stats, sink
        return (kl.sum() * share).float(), stats

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _dstats):
        q_idx, w, k_idx, ctx.q_main, ctx.kv, ctx.w_uk, ctx.lse, ctx.lse_idx = ctx.saved_tensors
        ctx.inputs = (q_idx, w)
        layout, scale = ctx.layout, ctx.scale_index
        meta = q_idx.is_meta
        q_pos = layout.positions(layout.rank, q_idx.device)
        q_doc = layout.doc_ids(q_pos)
        dq, dw = torch.zeros_like(q_idx, dtype=torch.float32), torch.zeros_like(w, dtype=torch.float32)
        g = grad.float() * ctx.share

        def visit(src, blocks):
            k_pos = layout.positions(src, q_idx.device)
            k_doc = layout.doc_ids(k_pos)
            dk = torch.zeros_like(blocks[0], dtype=torch.float32)
            for qt in row_tiles(q_idx.shape[1], _rows(ctx.q_main, w), meta):
                qm = absorb_queries(ctx.q_main[:, qt], ctx.w_uk)
                for kt in row_tiles(k_pos.shape[0], KEY_TILE, meta):
                    if not meta and k_pos[kt].min() > q_pos[qt].max():
                        continue
                    t = _Tile(ctx, blocks, q_pos, k_pos, q_doc, k_doc, qt, kt, qm)
                    soft = torch.exp(t.I - ctx.lse_idx[:, qt, None])  # 0 where not seen
                    dI = (soft - t.p).masked_fill_(~t.seen, 0.0) * g
                    logits = torch.einsum("bqge,bke->bqgk", q_idx[:, qt].float(), blocks[0][:, kt].float()).mul_(scale)
                    dw[:, qt] += torch.einsum("bqk,bqgk->bqg", dI, logits.relu())
                    dlogit = (dI[:, :, None, :] * w[:, qt].float()[..., None]).mul_(logits > 0).mul_(scale)
                    dq[:, qt] += torch.einsum("bqgk,bke->bqge", dlogit, blocks[0][:, kt].float())
                    dk[:, kt] += torch.einsum("bqgk,bqge->bke", dlogit, q_idx[:, qt].float())
            return [dk]

        (dk,) = ring_visit_grads(ctx.ring, [k_idx.contiguous(), ctx.kv], visit, 1)
        if ctx.sink is not None:
            ctx.sink(*ctx.stats)
        return (dq.to(q_idx.dtype), dw.to(w.dtype), dk.to(k_idx.dtype)) + (None,) * 13


def _chosen_mask(chosen, qt: slice, kt: slice, shape) -> Tensor:
    """(B, q, k) float: 1 where the query's top-k holds the tile's key (chosen = Selection.block(src))."""
    _, rows = chosen
    slots = chosen[0][:, qt]
    r = rows[:, qt]
    inside = (slots >= 0) & (r >= kt.start) & (r < kt.stop)
    out = torch.zeros(shape, dtype=torch.float32, device=r.device)
    return out.scatter_add_(-1, torch.where(inside, r - kt.start, 0), inside.float()).clamp_max_(1.0)
