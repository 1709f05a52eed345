"""DeepSeek-V4's attention core in Triton, forward and backward: the kernel form of moe_lc/ops/v4_sparse_core.py's
`sparse_sink_attention` (same signature, same numbers to fp32 rounding): the sliding window, the compressed
entries a query reads (CSA: gathered by the indexer's picks; HCA: every entry under a visible count) and a
sink logit per head in one online softmax (flash attention, Dao et al. 2022, arXiv 2205.14135), saving q, kv,
the entries, the picks / counts, out and an fp32 lse (v4_sparse_core.saved_bytes).

Legend (as the reference): B batch, S sequence, H heads, d head dim (key = value), W window, n entries, k picked
slots a query reads.

Kernels (the one KV head is shared by all H heads, so a program holds a block of BH heads of one query row):
    _forward_kernel  grid (B S, H / BH): online softmax over the window keys (t - W, t] (HAS_SEG: those in the
                     query's segment) in blocks of BN, then the entries (MODE 1: the picked slots, -1 skipped;
                     MODE 2: entries [first(t), stop(t)), a count being [0, visible(t))), then the sink (a logit
                     without a value) -> out (fp32), lse.
    _dq_kernel       grid (B S, H / BH): dq = scale sum ds k, ds = p (do . k - delta), p = exp(s - lse).
    _dkv_kernel      grid (B, S / BN): a block of BN window keys owns its gradient (no atomics): the queries
                     that see key j are t in [j, j + W), i.e. the (t, h) rows [j H, (j + W) H) of q viewed
                     (B, S H, d), walked in blocks of BR rows.
    _dentry_kernel   grid (B S, slots / BN): one query row's block of entries, its heads summed in the program,
                     then d_entries[rows] += with tl.atomic_add into fp32 (rows shared between queries; the
                     rounding order varies run to run on a GPU). HCA's n entries each take up to S of these:
                     correct, but a dedicated per-entry kernel would contend less at long S.
delta = rowsum(dout * out) and the sink's gradient -sum exp(sink - lse) delta are taken in torch. Arithmetic in
fp32; q, kv and the entries go to tl.dot in their dtype (bf16: tensor cores; fp32: input_precision "ieee").
On CPU tensors these run under TRITON_INTERPRET=1, in fp32 only (the interpreter's bf16 tl.dot is wrong);
every kernel also compiles for sm_90 at V4-Flash's shapes (bf16, d = 512: BD 512) with triton 3.9 on a machine
without a GPU (triton.compile with GPUTarget("cuda", 90, 32)), which is all that was checked of the GPU form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

BLOCK_H, BLOCK_N, BLOCK_R = 16, 32, 32  # heads per program (tl.dot needs >= 16), keys per step, (t, h) rows per step


@triton.jit
def _load_rows(base, ids, valid, stride, d, BD: tl.constexpr):
    """(len(ids), BD) rows base[ids] of width d, 0 where not valid or past d."""
    cols = tl.arange(0, BD)
    return tl.load(base + ids.to(tl.int64)[:, None] * stride + cols[None, :], mask=valid[:, None] & (cols[None, :] < d),
                   other=0.0)


@triton.jit
def _slots(e0, idx_row, first, stop, k, MODE: tl.constexpr, BN: tl.constexpr):
    """Entry rows of slots [e0, e0 + BN) of a query and which are read: MODE 1 the picks (-1 unread), MODE 2
    entries in [first, stop)."""
    s = e0 + tl.arange(0, BN)
    if MODE == 1:
        ids = tl.load(idx_row + s, mask=s < k, other=-1)
        valid = ids >= 0
    else:
        ids = s
        valid = (s >= first) & (s < stop)
    return tl.where(valid, ids, 0), valid


@triton.jit
def _online(s, m_i, l_i, acc, keys, PREC: tl.constexpr):
    """One block of (BH, BN) logits s (-inf unread) into the running max, sum and (BH, BD) accumulator."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _visible(vis_ptr, b, t, n, sv_b, sv_t, MODE: tl.constexpr):
    """A query's entry range [first, stop) (MODE 2; (0, 0) otherwise) from visible (B, S, 2)."""
    first = 0
    stop = 0
    if MODE == 2:
        row = vis_ptr + b.to(tl.int64) * sv_b + t * sv_t
        first = tl.minimum(tl.load(row), n)
        stop = tl.minimum(tl.load(row + 1), n)
    return first, stop


@triton.jit
def _same_segment(seg_ptr, b, t_seg, j, valid, ss_b, ss_t, HAS_SEG: tl.constexpr):
    """valid, and with segments: key rows j in the segment t_seg."""
    if HAS_SEG:
        seg_j = tl.load(seg_ptr + b.to(tl.int64) * ss_b + j * ss_t, mask=valid, other=0)
        valid = valid & (seg_j == t_seg)
    return valid


@triton.jit
def _row_setup(q_ptr, idx_ptr, vis_ptr, seg_ptr, S, H, d, n, sq_b, sq_t, sq_h, si_b, si_t, sv_b, sv_t, ss_b, ss_t,
               MODE: tl.constexpr, HAS_SEG: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    """A program's query row: (b, t, heads, hmask, q (BH, BD), its idx row pointer, its entry range [first, stop),
    its segment (0 without segments))."""
    row = tl.program_id(0)
    b, t = row // S, row % S
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    q = _load_rows(q_ptr + b.to(tl.int64) * sq_b + t * sq_t, heads, hmask, sq_h, d, BD)
    idx_row = idx_ptr + b.to(tl.int64) * si_b + t * si_t
    first, stop = _visible(vis_ptr, b, t, n, sv_b, sv_t, MODE)
    t_seg = 0
    if HAS_SEG:
        t_seg = tl.load(seg_ptr + b.to(tl.int64) * ss_b + t * ss_t)
    return b, t, heads, hmask, q, idx_row, first, stop, t_seg


@triton.jit
def _forward_kernel(q_ptr, kv_ptr, ent_ptr, idx_ptr, vis_ptr, seg_ptr, sink_ptr, o_ptr, lse_ptr, scale, S, H, d, W,
                    k, n, sq_b, sq_t, sq_h, skv_b, skv_t, se_b, se_s, si_b, si_t, sv_b, sv_t, ss_b, ss_t,
                    MODE: tl.constexpr, HAS_SINK: tl.constexpr, HAS_SEG: tl.constexpr, PREC: tl.constexpr,
                    BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """-> o (B, S, H, d) fp32 contiguous, lse (B, S, H) fp32 contiguous."""
    b, t, heads, hmask, q, idx_row, first, stop, t_seg = _row_setup(
        q_ptr, idx_ptr, vis_ptr, seg_ptr, S, H, d, n, sq_b, sq_t, sq_h, si_b, si_t, sv_b, sv_t, ss_b, ss_t, MODE,
        HAS_SEG, BH, BD)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    kv_b = kv_ptr + b.to(tl.int64) * skv_b
    for j0 in range(tl.maximum(t - W + 1, 0), t + 1, BN):
        j = j0 + tl.arange(0, BN)
        valid = _same_segment(seg_ptr, b, t_seg, j, j <= t, ss_b, ss_t, HAS_SEG)
        keys = _load_rows(kv_b, tl.where(valid, j, 0), valid, skv_t, d, BD)
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(keys), input_precision=PREC) * scale, float("-inf"))
        m_i, l_i, acc = _online(s, m_i, l_i, acc, keys, PREC)
    if MODE != 0:
        ent_b = ent_ptr + b.to(tl.int64) * se_b
        for e0 in range(0 if MODE == 1 else first, k if MODE == 1 else stop, BN):
            ids, valid = _slots(e0, idx_row, first, stop, k, MODE, BN)
            keys = _load_rows(ent_b, ids, valid, se_s, d, BD)
            s = tl.where(valid[None, :], tl.dot(q, tl.trans(keys), input_precision=PREC) * scale, float("-inf"))
            m_i, l_i, acc = _online(s, m_i, l_i, acc, keys, PREC)
    if HAS_SINK:  # a logit with no value: the sum grows, the accumulator only rescales
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    out_rows = (b.to(tl.int64) * S + t) * H + heads
    cols = tl.arange(0, BD)
    cmask = hmask[:, None] & (cols[None, :] < d)
    tl.store(o_ptr + out_rows[:, None] * d + cols[None, :], acc / l_i[:, None], mask=cmask)
    tl.store(lse_ptr + out_rows, m_i + tl.log(l_i), mask=hmask)


@triton.jit
def _dq_kernel(q_ptr, kv_ptr, ent_ptr, idx_ptr, vis_ptr, seg_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, scale, S, H, d,
               W, k, n, sq_b, sq_t, sq_h, skv_b, skv_t, se_b, se_s, si_b, si_t, sv_b, sv_t, ss_b, ss_t,
               MODE: tl.constexpr, HAS_SEG: tl.constexpr, PREC: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
               BD: tl.constexpr):
    """do (B, S, H, d), lse and delta (B, S, H), all contiguous -> dq (B, S, H, d) fp32 contiguous."""
    b, t, heads, hmask, q, idx_row, first, stop, t_seg = _row_setup(
        q_ptr, idx_ptr, vis_ptr, seg_ptr, S, H, d, n, sq_b, sq_t, sq_h, si_b, si_t, sv_b, sv_t, ss_b, ss_t, MODE,
        HAS_SEG, BH, BD)
    rows = (b.to(tl.int64) * S + t) * H + heads
    do = _load_rows(do_ptr, rows, hmask, d, d, BD)
    lse = tl.load(lse_ptr + rows, mask=hmask, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=hmask, other=0.0)
    dq = tl.zeros([BH, BD], tl.float32)
    kv_b = kv_ptr + b.to(tl.int64) * skv_b
    for j0 in range(tl.maximum(t - W + 1, 0), t + 1, BN):
        j = j0 + tl.arange(0, BN)
        valid = _same_segment(seg_ptr, b, t_seg, j, j <= t, ss_b, ss_t, HAS_SEG)
        keys = _load_rows(kv_b, tl.where(valid, j, 0), valid, skv_t, d, BD)
        p = tl.where(valid[None, :], tl.exp(tl.dot(q, tl.trans(keys), input_precision=PREC) * scale - lse[:, None]), 0.)
        ds = p * (tl.dot(do, tl.trans(keys), input_precision=PREC) - delta[:, None])
        dq += tl.dot(ds.to(keys.dtype), keys, input_precision=PREC)
    if MODE != 0:
        ent_b = ent_ptr + b.to(tl.int64) * se_b
        for e0 in range(0 if MODE == 1 else first, k if MODE == 1 else stop, BN):
            ids, valid = _slots(e0, idx_row, first, stop, k, MODE, BN)
            keys = _load_rows(ent_b, ids, valid, se_s, d, BD)
            s = tl.dot(q, tl.trans(keys), input_precision=PREC) * scale
            p = tl.where(valid[None, :], tl.exp(s - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(keys), input_precision=PREC) - delta[:, None])
            dq += tl.dot(ds.to(keys.dtype), keys, input_precision=PREC)
    cols = tl.arange(0, BD)
    tl.store(dq_ptr + rows[:, None] * d + cols[None, :], dq * scale, mask=hmask[:, None] & (cols[None, :] < d))


@triton.jit
def _dkv_kernel(q_ptr, kv_ptr, seg_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr, scale, S, H, d, W, skv_b, skv_t, ss_b,
                ss_t, HAS_SEG: tl.constexpr, PREC: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                BD: tl.constexpr):
    """q, do (B, S, H, d), lse, delta (B, S, H), contiguous -> dkv (B, S, d) fp32 contiguous, BN keys a program."""
    b = tl.program_id(0)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    jmask = j < S
    keys = _load_rows(kv_ptr + b.to(tl.int64) * skv_b, tl.where(jmask, j, 0), jmask, skv_t, d, BD)
    dk = tl.zeros([BN, BD], tl.float32)
    j_seg = tl.zeros([BN], tl.int64)
    if HAS_SEG:
        j_seg = tl.load(seg_ptr + b.to(tl.int64) * ss_b + j * ss_t, mask=jmask, other=0).to(tl.int64)
    j0 = tl.program_id(1) * BN
    base = b.to(tl.int64) * S * H
    for r0 in range(j0 * H, tl.minimum(j0 + BN + W - 1, S) * H, BR):
        r = r0 + tl.arange(0, BR)
        t = r // H
        rmask = t < S
        qr = _load_rows(q_ptr + base * d, r, rmask, d, d, BD)
        dor = _load_rows(do_ptr + base * d, r, rmask, d, d, BD)
        lse = tl.load(lse_ptr + base + r, mask=rmask, other=0.0)
        delta = tl.load(delta_ptr + base + r, mask=rmask, other=0.0)
        seen = rmask[:, None] & jmask[None, :] & (j[None, :] <= t[:, None]) & (t[:, None] < j[None, :] + W)
        if HAS_SEG:
            t_seg = tl.load(seg_ptr + b.to(tl.int64) * ss_b + t * ss_t, mask=rmask, other=0).to(tl.int64)
            seen = seen & (t_seg[:, None] == j_seg[None, :])
        s = tl.dot(qr, tl.trans(keys), input_precision=PREC) * scale  # (BR, BN)
        p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(dor, tl.trans(keys), input_precision=PREC) - delta[:, None])
        dk += tl.dot(tl.trans(ds * scale).to(qr.dtype), qr, input_precision=PREC)
        dk += tl.dot(tl.trans(p).to(dor.dtype), dor, input_precision=PREC)
    cols = tl.arange(0, BD)
    out = dkv_ptr + (b.to(tl.int64) * S + j)[:, None] * d + cols[None, :]
    tl.store(out, dk, mask=jmask[:, None] & (cols[None, :] < d))


@triton.jit
def _dentry_kernel(q_ptr, ent_ptr, idx_ptr, vis_ptr, do_ptr, lse_ptr, delta_ptr, dent_ptr, scale, S, H, d, k, n,
                   sq_b, sq_t, sq_h, se_b, se_s, si_b, si_t, sv_b, sv_t,
                   MODE: tl.constexpr, PREC: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """d_entries (B, n, d) fp32 contiguous += one query row's block of BN slots, its heads summed."""
    row = tl.program_id(0)
    b, t = row // S, row % S
    first, stop = _visible(vis_ptr, b, t, n, sv_b, sv_t, MODE)
    ids, valid = _slots(tl.program_id(1) * BN, idx_ptr + b.to(tl.int64) * si_b + t * si_t, first, stop, k, MODE, BN)
    keys = _load_rows(ent_ptr + b.to(tl.int64) * se_b, ids, valid, se_s, d, BD)
    dk = tl.zeros([BN, BD], tl.float32)
    q_row = q_ptr + b.to(tl.int64) * sq_b + t * sq_t
    for h0 in range(0, H, BH):
        heads = h0 + tl.arange(0, BH)
        hmask = heads < H
        rows = (b.to(tl.int64) * S + t) * H + heads
        q = _load_rows(q_row, heads, hmask, sq_h, d, BD)
        do = _load_rows(do_ptr, rows, hmask, d, d, BD)
        lse = tl.load(lse_ptr + rows, mask=hmask, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=hmask, other=0.0)
        s = tl.dot(q, tl.trans(keys), input_precision=PREC) * scale
        p = tl.where(hmask[:, None] & valid[None, :], tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(keys), input_precision=PREC) - delta[:, None])
        dk += tl.dot(tl.trans(ds * scale).to(q.dtype), q, input_precision=PREC)
        dk += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
    cols = tl.arange(0, BD)
    out = dent_ptr + (b.to(tl.int64) * n + ids)[:, None] * d + cols[None, :]
    tl.atomic_add(out, dk, mask=valid[:, None] & (cols[None, :] < d), sem="relaxed")


def _prepare(q, kv, entries, picked, visible, segments):
    """Contiguous inputs in one compute dtype, the mode, the index tensors (dummies where absent; visible as
    (B, S, 2) ranges), segments (a dummy where absent), k and n."""
    dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    q, kv = q.to(dtype).contiguous(), kv.to(dtype).contiguous()
    mode = 0 if entries is None else 1 if picked is not None else 2
    ent = kv[:, :1] if entries is None else entries.to(dtype).contiguous()
    idx = picked.contiguous() if picked is not None else kv.new_full((q.shape[0], q.shape[1], 1), -1, dtype=torch.int64)
    if visible is None:
        vis = kv.new_zeros(q.shape[0], q.shape[1], 2, dtype=torch.int64)
    else:
        vis = visible if visible.dim() == 3 else torch.stack([torch.zeros_like(visible), visible], -1)
        vis = vis.to(torch.int64).contiguous()
    seg = segments.contiguous() if segments is not None else vis[..., 0]
    k = idx.shape[-1] if mode == 1 else 0
    n = 0 if entries is None else entries.shape[1]
    return q, kv, ent, idx, vis, seg, mode, k, n


def _common(q, kv, ent, idx, vis, seg) -> tuple:
    """The strides every row kernel takes."""
    return (q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), ent.stride(0), ent.stride(1),
            idx.stride(0), idx.stride(1), vis.stride(0), vis.stride(1), seg.stride(0), seg.stride(1))


def _meta(q: Tensor) -> dict:
    d = q.shape[-1]
    return dict(PREC="ieee" if q.dtype == torch.float32 else "tf32", BD=max(16, triton.next_power_of_2(d)),
                num_warps=8 if d > 128 else 4)


def sink_forward(q, kv, window, scale, sinks, entries=None, picked=None, visible=None, segments=None
                 ) -> tuple[Tensor, Tensor]:
    """As v4_sparse_core.sparse_sink_attention's forward: -> out (B, S, H, d) in q's dtype, lse (B, S, H) fp32."""
    B, S, H, d = q.shape
    qc, kvc, ent, idx, vis, seg, mode, k, n = _prepare(q, kv, entries, picked, visible, segments)
    out = torch.empty(B, S, H, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    sink = sinks.float().contiguous() if sinks is not None else lse.new_zeros(1)
    if B * S and H:
        meta = _meta(qc)
        grid = (B * S, triton.cdiv(H, BLOCK_H))
        _forward_kernel[grid](qc, kvc, ent, idx, vis, seg, sink, out, lse, scale, S, H, d, window, k, n,
                              *_common(qc, kvc, ent, idx, vis, seg), MODE=mode, HAS_SINK=sinks is not None,
                              HAS_SEG=segments is not None, BH=BLOCK_H, BN=BLOCK_N, **meta)
    return out.to(q.dtype), lse


def sink_backward(dout, q, kv, window, scale, sinks, entries, picked, visible, segments, out, lse):
    """-> dq (B, S, H, d), dkv (B, S, d), d_entries (B, n, d) | None, d_sinks (H,) | None, all fp32."""
    B, S, H, d = q.shape
    qc, kvc, ent, idx, vis, seg, mode, k, n = _prepare(q, kv, entries, picked, visible, segments)
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, S, H): rowsum(dO * O)
    do, lse = dout.to(qc.dtype).contiguous(), lse.contiguous()
    dq = torch.zeros(B, S, H, d, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(B, S, d, dtype=torch.float32, device=q.device)
    dent = None if entries is None else torch.zeros(B, n, d, dtype=torch.float32, device=q.device)
    dsink = None if sinks is None else -(torch.exp(sinks.float() - lse) * delta).sum((0, 1))
    if B * S and H:
        meta, strides, has_seg = _meta(qc), _common(qc, kvc, ent, idx, vis, seg), segments is not None
        _dq_kernel[(B * S, triton.cdiv(H, BLOCK_H))](qc, kvc, ent, idx, vis, seg, do, lse, delta, dq, scale, S, H, d,
                                                     window, k, n, *strides, MODE=mode, HAS_SEG=has_seg, BH=BLOCK_H,
                                                     BN=BLOCK_N, **meta)
        _dkv_kernel[(B, triton.cdiv(S, BLOCK_N))](qc, kvc, seg, do, lse, delta, dkv, scale, S, H, d, window,
                                                  kvc.stride(0), kvc.stride(1), seg.stride(0), seg.stride(1),
                                                  HAS_SEG=has_seg, BN=BLOCK_N, BR=BLOCK_R, **meta)
        slots = k if mode == 1 else n
        if mode and slots:
            _dentry_kernel[(B * S, triton.cdiv(slots, BLOCK_N))](
                qc, ent, idx, vis, do, lse, delta, dent, scale, S, H, d, k, n, qc.stride(0), qc.stride(1),
                qc.stride(2), ent.stride(0), ent.stride(1), idx.stride(0), idx.stride(1), vis.stride(0), vis.stride(1),
                MODE=mode, BH=BLOCK_H, BN=BLOCK_N, **meta)
    return dq, dkv, dent, dsink


class SparseSinkAttentionKernel(torch.autograd.Function):
    """`sparse_sink_attention` on the kernels: saves what the torch form saves (v4_sparse_core.saved_bytes)."""

    @staticmethod
    def forward(ctx, q, kv, sinks, entries, picked, visible, segments, window: int, scale: float):
        out, lse = sink_forward(q, kv, window, scale, sinks, entries, picked, visible, segments)
        ctx.save_for_backward(q, kv, sinks, entries, picked, visible, segments, out, lse)
        ctx.args = (window, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, kv, sinks, entries, picked, visible, segments, out, lse = ctx.saved_tensors
        dq, dkv, dent, dsink = sink_backward(dout, q, kv, *ctx.args, sinks, entries, picked, visible, segments, out,
                                             lse)
        return (dq.to(q.dtype), dkv.to(kv.dtype), None if sinks is None else dsink.to(sinks.dtype),
                None if entries is None else dent.to(entries.dtype), None, None, None, None, None)


def sparse_sink_attention(q: Tensor, kv: Tensor, window: int, scale: float, sinks: Tensor | None,
                          entries: Tensor | None = None, picked: Tensor | None = None,
                          visible: Tensor | None = None, *, segments: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """moe_lc.ops.v4_sparse_core.sparse_sink_attention on the Triton kernels (its argument checks are the caller's:
    go through that function's checks first where inputs are not known good)."""
    if entries is not None and (picked is None) == (visible is None):
        raise ValueError("sparse_sink_attention: with entries, pass exactly one of picked (B, S, k) and visible (B, S)")
    return SparseSinkAttentionKernel.apply(q, kv, sinks, entries, picked, visible, segments, window, scale)
