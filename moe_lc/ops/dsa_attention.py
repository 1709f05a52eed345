"""DeepSeek Sparse Attention on a ring: the main attention over the indexer's selection, and the indexer's
KL loss in both of DeepSeek-V3.2's training stages.

Legend: B batch, Q this rank's query rows, T a block's rows, H main heads (tp-local), Dk = Ckv + Dr an MLA
key row (normalized latent | roped shared key), Dn / Dv MLA's nope and value head dims, G indexer heads, E
indexer head dim, k = index_topk. The ring, layout and selection are moe_lc/ops/dsa_ring.py's and
dsa_select.py's.

  sparse attention   `SparseLatentAttention`: each ring step attends the selected keys the visiting latent
                     block holds, in MLA's absorbed form (moe_lc/ops/sparse_attention.py), merged by LSE; a
                     block no query selected from is skipped (it still travels). Backward: the same ring, the
                     blocks' fp32 gradient accumulators travelling home one step behind, as in cp/ring.py's
                     ring attention; wkv_b's gradient stays here.
  sparse-stage loss  `IndexerKLSparse`: sum_t KL(p(t, S_t) || softmax(I(t, S_t))), S_t the selection, p the
                     main attention's probabilities summed over heads and L1-normalized (`selected_probs`,
                     a forward ring pass without gradient). I's values are the selection's own.
  warm-up loss       `IndexerKLDense`: the same over every visible key, p from the dense main attention
                     (its per-head LSE first: `head_lse`, one ring pass); forward one more pass over the
                     latent and indexer blocks together, backward another.

On a CPU ring of one rank (`_local_rows`) the passes take the selection's positions as the block's rows, slot
for slot (no grouping by rank), in moe_lc/ops/sparse_attention_cpu.py's forms; the sparse attention's forward
then keeps its head-summed probabilities for `selected_probs` (`Selection.probs`: under the final lse they are
the target's, so no second pass), and the loss's row-wise terms go a tile of rows at a time.

Only the indexer's tensors (q, w, k) get gradients from the loss: p is a target (the report's stop-gradient;
in the warm-up stage the main model is frozen anyway). Under tensor parallelism the main heads are split:
`reduce_heads` sums a head-summed tensor over the tp group (identity on one device), and each tp rank's
share of the (replicated) indexer loss is 1/tp of it, so the gradient sums are the single-device ones.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moe_lc.ops.attention_backends import lse_merge_weights
from moe_lc.ops.dsa_ring import ring_visit, ring_visit_grads, row_tiles, tile_rows
from moe_lc.ops import sparse_attention_cpu
from moe_lc.ops.dsa_select import Selection
from moe_lc.ops.sparse_attention import gather_rows, latent_backward, latent_forward, latent_probs

ROWS = 1024  # query rows a tile of the sparse-stage loss's row-wise terms on a CPU (no full-size temporaries)


def _local_rows(ring, positions: Tensor) -> Tensor | None:
    """On a CPU ring of one rank, the selection's positions (B, Q, k) int32 are the rows of the one block, slot for
    slot: the passes take them as they are (no grouping by rank, no full-size temporaries); None elsewhere."""
    return positions if ring.size == 1 and sparse_attention_cpu.cpu_form(positions) else None


def _slots_idx(block):
    slots, rows = block
    return slots, torch.where(slots >= 0, rows, -1)


def split_wkv(w: Tensor, n_heads: int, nope_dim: int) -> tuple[Tensor, Tensor]:
    """wkv_b's weight (H (Dn + Dv), C) -> W_UK (H, Dn, C), W_UV (H, Dv, C) (views)."""
    w = w.view(n_heads, -1, w.shape[-1])
    return w[:, :nope_dim], w[:, nope_dim:]


class SparseLatentAttention(torch.autograd.Function):
    """(q (B,Q,H,Dn+Dr) roped, kv (B,T,Ckv+Dr), wkv (H (Dn+Dv), Ckv) wkv_b's weight, sel, scale, nope_dim, ring)
    -> out (B,Q,H,Dv) q.dtype, lse (B,H,Q) fp32: MLA over each query's selected keys, in the absorbed form
    (moe_lc/ops/sparse_attention.py), visiting every ring rank's latent block."""

    @staticmethod
    def forward(ctx, q, kv, wkv, sel: Selection, scale: float, nope_dim: int, ring):
        B, Q, H, _ = q.shape
        w_uk, w_uv = split_wkv(wkv, H, nope_dim)
        idx = _local_rows(ring, sel.positions)
        if idx is not None:
            probs = torch.empty(idx.shape) if sel.probs is not None else None
            out, lse = sparse_attention_cpu.latent_forward(q, kv, idx, w_uk, w_uv, scale, probs)
            if probs is not None:  # for selected_probs: under this lse, the final one
                sel.probs.update(lse=lse, p=probs)
        else:
            out = q.new_zeros(B, Q, H, w_uv.shape[1], dtype=torch.float32)
            lse = q.new_full((B, H, Q), float("-inf"), dtype=torch.float32)
            groups = sel.groups()

            def visit(src, blocks):
                block = groups.block(src)
                if block is None:
                    return
                part_out, part_lse = latent_forward(q, blocks[0], _slots_idx(block)[1], w_uk, w_uv, scale)
                new_lse, old_w, new_w = lse_merge_weights(lse, part_lse)
                out.mul_(old_w.transpose(1, 2)[..., None]).add_(part_out * new_w.transpose(1, 2)[..., None])
                lse.copy_(new_lse)

            ring_visit(ring, [kv.contiguous()], visit)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, wkv, out, lse, sel.positions)
        ctx.sel, ctx.scale, ctx.nope_dim, ctx.ring = sel.with_positions(None), scale, nope_dim, ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, kv, wkv, out, lse, positions = ctx.saved_tensors
        w_uk, w_uv = split_wkv(wkv, q.shape[2], ctx.nope_dim)
        idx = _local_rows(ctx.ring, positions)
        if idx is not None:
            dq, dkv, dw_uk, dw_uv = latent_backward(dout, q, kv, idx, out, lse, w_uk, w_uv, ctx.scale)
        else:
            dq = torch.zeros_like(q, dtype=torch.float32)
            dw_uk, dw_uv = torch.zeros_like(w_uk, dtype=torch.float32), torch.zeros_like(w_uv, dtype=torch.float32)
            groups = ctx.sel.with_positions(positions).groups()

            def visit(src, blocks):
                block = groups.block(src)
                if block is None:
                    return None
                dq_b, dkv_b, duk, duv = latent_backward(dout, q, blocks[0], _slots_idx(block)[1], out, lse, w_uk,
                                                        w_uv, ctx.scale)
                dq.add_(dq_b), dw_uk.add_(duk), dw_uv.add_(duv)
                return [dkv_b]

            (dkv,) = ring_visit_grads(ctx.ring, [kv.contiguous()], visit, 1)
        dwkv = torch.cat([dw_uk, dw_uv], dim=1).view_as(wkv)
        return dq.to(q.dtype), dkv.to(kv.dtype), dwkv.to(wkv.dtype), None, None, None, None


@torch.no_grad()
def selected_probs(ring, q: Tensor, kv: Tensor, wkv: Tensor, nope_dim: int, lse: Tensor, sel: Selection,
                   scale: float, reduce_heads) -> Tensor:
    """p (B, Q, k) fp32: the main attention's probability of each selected key (final lse (B, H, Q)), summed
    over every head (`reduce_heads`) and L1-normalized over the selection; 0 at empty slots. Where the sparse
    attention's forward kept them for this lse (`Selection.probs`), its head sums are taken as they are."""
    w_uk, _ = split_wkv(wkv, q.shape[2], nope_dim)
    idx = _local_rows(ring, sel.positions)
    if idx is not None:
        kept, sel.probs = sel.probs, None  # taken once: a recomputation's forward keeps none
        if kept and kept["lse"].shape == lse.shape and kept["lse"].data_ptr() == lse.data_ptr():
            p = kept["p"]  # the forward's, under this very lse
        else:
            p = latent_probs(q, kv, idx, lse, w_uk, scale)
        p = reduce_heads(p)
        for r in row_tiles(p.shape[1], ROWS):  # in place, a tile at a time
            p[:, r] /= p[:, r].sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return p
    p = torch.zeros(sel.positions.shape, dtype=torch.float32, device=q.device)
    groups = sel.groups()

    def visit(src, blocks):
        block = groups.block(src)
        if block is not None:
            slots, idx = _slots_idx(block)
            p.scatter_add_(-1, slots.clamp_min(0), latent_probs(q, blocks[0], idx, lse, w_uk, scale))

    ring_visit(ring, [kv.contiguous()], visit)
    p = reduce_heads(p)
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def _kl_rows(p: Tensor, log_q: Tensor) -> Tensor:
    """sum over the last dim of p (log p - log q), with 0 log 0 = 0."""
    return torch.where(p > 0, p * (p.clamp_min(1e-38).log() - log_q), torch.zeros_like(p)).sum(-1)


def _kl_terms(scores: Tensor, p: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """The sparse-stage loss's terms per query row: (dI = softmax(I) - p, 0 at empty slots; KL_t) fp32."""
    log_q = torch.log_softmax(scores, dim=-1)  # -inf at empty slots, where p = 0
    return (log_q.exp() - p).masked_fill_(~valid, 0.0), _kl_rows(p, log_q)


def _indexer_grads(q: Tensor, w: Tensor, keys: Tensor, dI: Tensor, scale: float):
    """Backward of I = sum_g w * relu(scale q . k) over gathered keys: q (B,q,G,E), w (B,q,G), keys (B,q,m,E),
    dI (B,q,m) -> dq (B,q,G,E), dw (B,q,G), dkeys (B,q,m,E), all fp32."""
    logits = torch.einsum("bqge,bqme->bqgm", q.float(), keys).mul_(scale)
    dw = torch.einsum("bqm,bqgm->bqg", dI, logits.relu())
    dlogit = (dI[:, :, None, :] * w.float()[..., None]).mul_(logits > 0).mul_(scale)
    return (torch.einsum("bqgm,bqme->bqge", dlogit, keys), dw,
            torch.einsum("bqgm,bqge->bqme", dlogit, q.float()))


class IndexerKLSparse(torch.autograd.Function):
    """(q (B,Q,G,E), w (B,Q,G), k (B,T,E), sel, scores (B,Q,k) the selection's, p (B,Q,k), scale, share, ring,
    sink) -> share * sum_t KL_t (0-dim fp32) over the selected keys; the loss of DeepSeek-V3.2's sparse training
    stage. sink(kl_sum, 0): called with the unscaled sum in backward (once per micro-batch, whatever is
    recomputed), or None."""

    @staticmethod
    def forward(ctx, q, w, k, sel: Selection, scores: Tensor, p: Tensor, scale: float, share: float, ring, sink=None):
        if _local_rows(ring, sel.positions) is not None:  # a tile of rows at a time: no full-size temporaries
            dI = torch.empty(p.shape, dtype=q.dtype)
            kl = torch.empty(p.shape[:2])
            for r in row_tiles(p.shape[1], ROWS):
                dI[:, r], kl[:, r] = _kl_terms(scores[:, r], p[:, r], sel.positions[:, r] >= 0)
        else:
            dI, kl = _kl_terms(scores, p, sel.valid)
            dI = dI.to(q.dtype)  # kept in the compute dtype
        ctx.save_for_backward(q, w, k, dI, sel.positions)
        ctx.sel, ctx.scale, ctx.share, ctx.ring, ctx.sink = sel.with_positions(None), scale, share, ring, sink
        ctx.kl = kl.double().sum()
        return (ctx.kl * share).float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, w, k, dI, positions = ctx.saved_tensors
        g = grad.float() * ctx.share
        idx = _local_rows(ctx.ring, positions)
        if idx is not None:
            dq, dw, dk = sparse_attention_cpu.indexer_grads(q, w, k, idx, dI, ctx.scale, g)
            if ctx.sink is not None:
                ctx.sink(ctx.kl, torch.zeros_like(ctx.kl))
            return dq.to(q.dtype), dw.to(w.dtype), dk.to(k.dtype), None, None, None, None, None, None, None
        dI = dI.float() * g
        dq, dw = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(w, dtype=torch.float32)
        B, T, E = k.shape
        groups = ctx.sel.with_positions(positions).groups()

        def visit(src, blocks):
            block = groups.block(src)
            if block is None:
                return None
            slots, idx = _slots_idx(block)
            dk = torch.zeros(B * T, E, dtype=torch.float32, device=k.device)
            base = torch.arange(B, device=k.device)[:, None, None] * T
            rows = tile_rows(B * slots.shape[-1] * max(q.shape[2], E))  # (rows, G, m) logits, (rows, m, E) keys
            for r in row_tiles(q.shape[1], rows, q.is_meta):
                ids = idx[:, r].clamp_min(0)
                d = torch.gather(dI[:, r], -1, slots[:, r].clamp_min(0)).masked_fill_(slots[:, r] < 0, 0.0)
                dq_t, dw_t, dkeys = _indexer_grads(q[:, r], w[:, r], gather_rows(blocks[0], ids), d, ctx.scale)
                dq[:, r] += dq_t
                dw[:, r] += dw_t
                dk.index_add_(0, (ids + base).flatten(), dkeys.reshape(-1, E))
            return [dk.view(B, T, E)]

        (dk,) = ring_visit_grads(ctx.ring, [k.contiguous()], visit, 1)
        if ctx.sink is not None:
            ctx.sink(ctx.kl, torch.zeros_like(ctx.kl))
        return dq.to(q.dtype), dw.to(w.dtype), dk.to(k.dtype), None, None, None, None, None, None, None
