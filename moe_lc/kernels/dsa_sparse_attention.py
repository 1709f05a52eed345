"""Sparse MLA attention over each query's selected latent rows, absorbed ("MQA") form, forward and backward in
Triton: the kernel form of moe_lc/ops/sparse_attention.py's `latent_forward` / `latent_backward` (same
signatures, same numbers to fp32 rounding), as DeepSeek-V3.2 runs DSA (its report: "MQA mode of MLA"; the
FlashMLA sparse kernels).

Legend (as the reference): B batch, Q query rows, H heads, T key rows of the block, m selected slots per query
row, C the KV latent rank, R the rope dim, D = C + R a key row (latent | roped shared key), Dn / Dv MLA's nope
and value head dims; W_UK (H, Dn, C), W_UV (H, Dv, C).

    q_abs = [q_nope W_UK, q_rope]        (B, Q, H, D)   torch (a batched GEMM), per chunk of query rows
    kernel: o_lat, lse                   (B, Q, H, C), (B, H, Q)   softmax(scale q_abs . kv[idx]) @ kv[idx][:, :C]
    out   = o_lat W_UV^T                 (B, Q, H, Dv)  torch

Kernels (every key row of a query is shared by its H heads, so a program holds a block of heads):
    _forward_kernel  grid (B*Q, H/BH): online softmax over the m slots in blocks of BN, gathering the rows
                     by index; a -1 slot (padding, or past the causal edge) scores -inf; a row with no key
                     gets o_lat 0 and lse -inf. FIXED_LSE: p = exp(s - lse) under a given final lse (the
                     backward's recomputation of o_lat for W_UV's gradient, the reference's choice too).
    _dq_kernel       grid (B*Q, H/BH): dq_abs = scale * sum_slots ds k, ds = p (do_lat . k_C - delta).
    _dkv_kernel      grid (B*Q, m/BN): a block of one query's slots, every head summed in the program,
                     then dkv[idx] += once per (query, slot, column) with tl.atomic_add into an fp32 buffer
                     (slots of different queries hit the same rows; no ordering, so the sum's rounding order
                     varies run to run on a GPU).
delta = sum(dout * out) is taken in Dv space, as the reference does. Arithmetic in fp32; q_abs, kv and do_lat
go to tl.dot in kv's dtype (bf16 on the GPU: tensor cores; fp32: input_precision "ieee", not TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

CHUNK_ELEMS = 1 << 27  # query rows per launch keep (rows, H, D) temporaries near this many elements
BLOCK_H, BLOCK_N = 16, 32  # heads per program (tl.dot needs >= 16), slots per step


@triton.jit
def _load_heads(ptr, heads, hmask, stride_h, C, R, BC: tl.constexpr, BR: tl.constexpr):
    """(BH, BC) latent and (BH, BR) rope columns of a (H, C + R) row block; 0 outside."""
    cols, rcols = tl.arange(0, BC), tl.arange(0, BR)
    rows = ptr + heads.to(tl.int64)[:, None] * stride_h
    lat = tl.load(rows + cols[None, :], mask=hmask[:, None] & (cols[None, :] < C), other=0.0)
    rope = tl.load(rows + C + rcols[None, :], mask=hmask[:, None] & (rcols[None, :] < R), other=0.0)
    return lat, rope


@triton.jit
def _gather_keys(kv_ptr, idx_ptr, slots, m, stride_kt, C, R, BC: tl.constexpr, BR: tl.constexpr):
    """The rows idx[slots] of one batch's kv: (ids, valid, latent (BN, BC), rope (BN, BR)); -1 slots invalid."""
    ids = tl.load(idx_ptr + slots, mask=slots < m, other=-1)
    valid = ids >= 0
    ids = tl.where(valid, ids, 0).to(tl.int64)
    cols, rcols = tl.arange(0, BC), tl.arange(0, BR)
    rows = kv_ptr + ids[:, None] * stride_kt
    lat = tl.load(rows + cols[None, :], mask=valid[:, None] & (cols[None, :] < C), other=0.0)
    rope = tl.load(rows + C + rcols[None, :], mask=valid[:, None] & (rcols[None, :] < R), other=0.0)
    return ids, valid, lat, rope


@triton.jit
def _scores(q_lat, q_rope, k_lat, k_rope, valid, scale, PREC: tl.constexpr):
    """(BH, BN) scale * q_abs . k, -inf at invalid slots."""
    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
    s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PREC)
    return tl.where(valid[None, :], s * scale, float("-inf"))


@triton.jit
def _forward_kernel(q_ptr, kv_ptr, idx_ptr, lse_in_ptr, o_ptr, lse_ptr, scale, Q, H, m, C, R,
                    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_ib, stride_it,
                    FIXED_LSE: tl.constexpr, PREC: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                    BC: tl.constexpr, BR: tl.constexpr):
    """q (B, Q, H, D), kv (B, T, D), idx (B, Q, m) -> o_lat (B, Q, H, C) fp32 contiguous, lse (B, H, Q) fp32."""
    row = tl.program_id(0)
    b, t = row // Q, row % Q
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    q_lat, q_rope = _load_heads(q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt, heads, hmask, stride_qh, C, R,
                                BC, BR)
    kv_b = kv_ptr + b.to(tl.int64) * stride_kb
    idx_row = idx_ptr + b.to(tl.int64) * stride_ib + t * stride_it
    if FIXED_LSE:  # -inf (a row with no key): every p is exp(-inf) = 0 whatever stands in
        m_i = tl.load(lse_in_ptr + (b * H + heads) * Q + t, mask=hmask, other=0.0)
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
    else:
        m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BC], tl.float32)
    for n0 in range(0, m, BN):
        _, valid, k_lat, k_rope = _gather_keys(kv_b, idx_row, n0 + tl.arange(0, BN), m, stride_kt, C, R, BC, BR)
        s = _scores(q_lat, q_rope, k_lat, k_rope, valid, scale, PREC)
        if FIXED_LSE:
            p = tl.exp(s - m_i[:, None])
        else:  # online softmax; a max still -inf (no key yet) is taken as 0 so that no -inf - -inf appears
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            m_i = m_new
        acc += tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PREC)
    cols = tl.arange(0, BC)
    if not FIXED_LSE:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        acc = acc / l_safe[:, None]
        lse = tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf"))
        tl.store(lse_ptr + (b * H + heads) * Q + t, lse, mask=hmask)
    o_rows = o_ptr + (row.to(tl.int64) * H + heads)[:, None] * C
    tl.store(o_rows + cols[None, :], acc, mask=hmask[:, None] & (cols[None, :] < C))


@triton.jit
def _probs_and_ds(q_lat, q_rope, do_lat, lse, delta, hmask, k_lat, k_rope, valid, scale, PREC: tl.constexpr):
    """p = exp(s - lse) (0 at invalid slots and padded heads) and ds = p (do_lat . k_C - delta), both (BH, BN)."""
    s = _scores(q_lat, q_rope, k_lat, k_rope, valid, scale, PREC)
    p = tl.where(hmask[:, None], tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do_lat, tl.trans(k_lat), input_precision=PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _load_row_stats(lse_ptr, delta_ptr, b, t, heads, hmask, Q, H):
    """lse (BH,) with -inf (a row with no key) as 0, and delta (BH,), of query row t."""
    lse = tl.load(lse_ptr + (b * H + heads) * Q + t, mask=hmask, other=0.0)
    delta = tl.load(delta_ptr + (b * Q + t) * H + heads, mask=hmask, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse), delta


@triton.jit
def _dq_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, scale, Q, H, m, C, R,
               stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_ib, stride_it,
               PREC: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """do_lat (B, Q, H, C) contiguous, lse (B, H, Q), delta (B, Q, H) -> dq_abs (B, Q, H, C + R) fp32 contiguous."""
    row = tl.program_id(0)
    b, t = row // Q, row % Q
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    q_lat, q_rope = _load_heads(q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt, heads, hmask, stride_qh, C, R,
                                BC, BR)
    do_lat, _ = _load_heads(do_ptr + row.to(tl.int64) * H * C, heads, hmask, C, C, 0, BC, BR)
    lse, delta = _load_row_stats(lse_ptr, delta_ptr, b, t, heads, hmask, Q, H)
    kv_b = kv_ptr + b.to(tl.int64) * stride_kb
    idx_row = idx_ptr + b.to(tl.int64) * stride_ib + t * stride_it
    dq_lat = tl.zeros([BH, BC], tl.float32)
    dq_rope = tl.zeros([BH, BR], tl.float32)
    for n0 in range(0, m, BN):
        _, valid, k_lat, k_rope = _gather_keys(kv_b, idx_row, n0 + tl.arange(0, BN), m, stride_kt, C, R, BC, BR)
        _, ds = _probs_and_ds(q_lat, q_rope, do_lat, lse, delta, hmask, k_lat, k_rope, valid, scale, PREC)
        ds = (ds * scale).to(k_lat.dtype)
        dq_lat += tl.dot(ds, k_lat, input_precision=PREC)
        dq_rope += tl.dot(ds, k_rope, input_precision=PREC)
    cols, rcols = tl.arange(0, BC), tl.arange(0, BR)
    dq_rows = dq_ptr + (row.to(tl.int64) * H + heads)[:, None] * (C + R)
    tl.store(dq_rows + cols[None, :], dq_lat, mask=hmask[:, None] & (cols[None, :] < C))
    tl.store(dq_rows + C + rcols[None, :], dq_rope, mask=hmask[:, None] & (rcols[None, :] < R))


@triton.jit
def _dkv_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr, scale, Q, H, m, T, C, R,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_ib, stride_it,
                PREC: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """dkv (B, T, C + R) fp32 contiguous += the gradient of one query row's block of BN slots, heads summed."""
    row = tl.program_id(0)
    b, t = row // Q, row % Q
    idx_row = idx_ptr + b.to(tl.int64) * stride_ib + t * stride_it
    ids, valid, k_lat, k_rope = _gather_keys(kv_ptr + b.to(tl.int64) * stride_kb, idx_row,
                                             tl.program_id(1) * BN + tl.arange(0, BN), m, stride_kt, C, R, BC, BR)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt
    dk_lat = tl.zeros([BN, BC], tl.float32)
    dk_rope = tl.zeros([BN, BR], tl.float32)
    for h0 in range(0, H, BH):
        heads = h0 + tl.arange(0, BH)
        hmask = heads < H
        q_lat, q_rope = _load_heads(q_row, heads, hmask, stride_qh, C, R, BC, BR)
        do_lat, _ = _load_heads(do_ptr + row.to(tl.int64) * H * C, heads, hmask, C, C, 0, BC, BR)
        lse, delta = _load_row_stats(lse_ptr, delta_ptr, b, t, heads, hmask, Q, H)
        p, ds = _probs_and_ds(q_lat, q_rope, do_lat, lse, delta, hmask, k_lat, k_rope, valid, scale, PREC)
        ds_t = tl.trans(ds * scale).to(q_lat.dtype)  # (BN, BH)
        dk_lat += tl.dot(ds_t, q_lat, input_precision=PREC)
        dk_lat += tl.dot(tl.trans(p).to(do_lat.dtype), do_lat, input_precision=PREC)
        dk_rope += tl.dot(ds_t, q_rope, input_precision=PREC)
    cols, rcols = tl.arange(0, BC), tl.arange(0, BR)
    dk_rows = dkv_ptr + (b.to(tl.int64) * T + ids)[:, None] * (C + R)
    tl.atomic_add(dk_rows + cols[None, :], dk_lat, mask=valid[:, None] & (cols[None, :] < C), sem="relaxed")
    tl.atomic_add(dk_rows + C + rcols[None, :], dk_rope, mask=valid[:, None] & (rcols[None, :] < R), sem="relaxed")


def _meta(kv: Tensor, C: int) -> dict:
    """Block sizes and the dot precision: powers of two, >= 16 (tl.dot); fp32 operands exact (no TF32)."""
    R = kv.shape[-1] - C
    return dict(PREC="ieee" if kv.dtype == torch.float32 else "tf32", BH=BLOCK_H, BN=BLOCK_N,
                BC=max(16, triton.next_power_of_2(C)), BR=max(16, triton.next_power_of_2(max(R, 1))),
                num_warps=8 if C > 128 else 4)


def _strides(q_abs: Tensor, kv: Tensor, idx: Tensor) -> tuple:
    return (q_abs.stride(0), q_abs.stride(1), q_abs.stride(2), kv.stride(0), kv.stride(1), idx.stride(0),
            idx.stride(1))


def _compute_dtype(kv: Tensor) -> torch.dtype:
    return kv.dtype if kv.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _attend(q_abs: Tensor, kv: Tensor, idx: Tensor, C: int, scale: float, lse: Tensor | None = None):
    """q_abs (B, q, H, D), kv (B, T, D), idx (B, q, m) -> o_lat (B, q, H, C) fp32 and lse (B, H, q) fp32. With
    ``lse`` (B, H, q) given: o_lat = exp(s - lse) @ k_C under it, and that lse back."""
    B, Qc, H, _ = q_abs.shape
    o_lat = torch.empty(B, Qc, H, C, dtype=torch.float32, device=q_abs.device)
    lse_out = torch.empty(B, H, Qc, dtype=torch.float32, device=q_abs.device) if lse is None else lse
    meta = _meta(kv, C)
    if B * Qc and H:
        grid = (B * Qc, triton.cdiv(H, meta["BH"]))
        _forward_kernel[grid](q_abs, kv, idx, lse_out, o_lat, lse_out, scale, Qc, H, idx.shape[-1], C,
                              kv.shape[-1] - C, *_strides(q_abs, kv, idx), FIXED_LSE=lse is not None, **meta)
    return o_lat, lse_out


def _row_chunks(Q: int, H: int, D: int) -> list[slice]:
    rows = max(1, CHUNK_ELEMS // max(1, H * D))
    return [slice(lo, min(lo + rows, Q)) for lo in range(0, Q, rows)]


def _absorbed(q: Tensor, w_uk: Tensor, dtype: torch.dtype) -> Tensor:
    """q (B, q, H, Dn + R) -> q_abs (B, q, H, C + R) contiguous in ``dtype``: [q_nope W_UK, q_rope] in fp32 first."""
    Dn = w_uk.shape[1]
    q_lat = torch.einsum("bqhn,hnc->bqhc", q[..., :Dn].float(), w_uk.float())
    return torch.cat([q_lat, q[..., Dn:].float()], -1).to(dtype).contiguous()


def _check(q: Tensor, kv: Tensor, idx: Tensor, w_uk: Tensor) -> Tensor:
    """kv with a unit last stride; ValueError on shapes the kernels cannot take."""
    B, Q, H, _ = q.shape
    if kv.dim() != 3 or kv.shape[0] != B or idx.shape[:2] != (B, Q) or w_uk.shape[0] != H or \
            kv.shape[-1] - w_uk.shape[-1] != q.shape[-1] - w_uk.shape[1]:
        raise ValueError(f"sparse attention needs q (B, Q, H, Dn + R), kv (B, T, C + R), idx (B, Q, m), "
                         f"w_uk (H, Dn, C); got {tuple(q.shape)}, {tuple(kv.shape)}, {tuple(idx.shape)}, "
                         f"{tuple(w_uk.shape)}")
    return kv if kv.stride(-1) == 1 else kv.contiguous()


def latent_forward(q: Tensor, kv: Tensor, idx: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float
                   ) -> tuple[Tensor, Tensor]:
    """moe_lc.ops.sparse_attention.latent_forward on the Triton kernel: q (B, Q, H, Dn + R), kv (B, T, C + R),
    idx (B, Q, m) (-1: no key) -> out (B, Q, H, Dv) fp32, lse (B, H, Q) fp32."""
    kv = _check(q, kv, idx, w_uk)
    B, Q, H, _ = q.shape
    C = w_uk.shape[-1]
    out = q.new_empty(B, Q, H, w_uv.shape[1], dtype=torch.float32)
    lse = q.new_empty(B, H, Q, dtype=torch.float32)
    for r in _row_chunks(Q, H, kv.shape[-1]):
        o_lat, lse[:, :, r] = _attend(_absorbed(q[:, r], w_uk, _compute_dtype(kv)), kv, idx[:, r], C, scale)
        out[:, r] = torch.einsum("bqhc,hvc->bqhv", o_lat, w_uv.float())
    return out, lse


def latent_backward(dout: Tensor, q: Tensor, kv: Tensor, idx: Tensor, out: Tensor, lse: Tensor, w_uk: Tensor,
                    w_uv: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """moe_lc.ops.sparse_attention.latent_backward on the Triton kernels, given the final out (B, Q, H, Dv) and
    lse (B, H, Q): -> dq (B, Q, H, Dn + R), dkv (B, T, C + R) (unselected rows 0), dW_UK, dW_UV, all fp32."""
    kv = _check(q, kv, idx, w_uk)
    B, Q, H, _ = q.shape
    T, D = kv.shape[1], kv.shape[-1]
    Dn, C = w_uk.shape[1], w_uk.shape[2]
    dtype = _compute_dtype(kv)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(B, T, D, dtype=torch.float32, device=q.device)
    dw_uk, dw_uv = torch.zeros_like(w_uk, dtype=torch.float32), torch.zeros_like(w_uv, dtype=torch.float32)
    delta = (dout.float() * out.float()).sum(-1)  # (B, Q, H), in Dv space as the reference
    for r in _row_chunks(Q, H, D):
        q_abs, idx_r, lse_r, delta_r = _absorbed(q[:, r], w_uk, dtype), idx[:, r], lse[:, :, r].contiguous(), \
            delta[:, r].contiguous()
        o_lat, _ = _attend(q_abs, kv, idx_r, C, scale, lse_r)
        do = dout[:, r].float()
        dw_uv += torch.einsum("bqhv,bqhc->hvc", do, o_lat)
        do_lat = torch.einsum("bqhv,hvc->bqhc", do, w_uv.float()).to(dtype).contiguous()
        dq_abs = _backward_kernels(q_abs, kv, idx_r, do_lat, lse_r, delta_r, dkv, C, scale)
        dq[:, r, :, :Dn] = torch.einsum("bqhc,hnc->bqhn", dq_abs[..., :C], w_uk.float())
        dq[:, r, :, Dn:] = dq_abs[..., C:]
        dw_uk += torch.einsum("bqhn,bqhc->hnc", q[:, r, :, :Dn].float(), dq_abs[..., :C])
    return dq, dkv, dw_uk, dw_uv


def _backward_kernels(q_abs, kv, idx, do_lat, lse, delta, dkv, C: int, scale: float) -> Tensor:
    """dq_abs (B, q, H, D) fp32 returned; dkv (B, T, D) fp32 accumulated in place (atomics)."""
    B, Qc, H, D = q_abs.shape
    dq_abs = torch.empty(B, Qc, H, D, dtype=torch.float32, device=q_abs.device)
    meta, m = _meta(kv, C), idx.shape[-1]
    if B * Qc and H and m:
        args = (scale, Qc, H, m)
        _dq_kernel[(B * Qc, triton.cdiv(H, meta["BH"]))](q_abs, kv, idx, do_lat, lse, delta, dq_abs, *args, C, D - C,
                                                         *_strides(q_abs, kv, idx), **meta)
        _dkv_kernel[(B * Qc, triton.cdiv(m, meta["BN"]))](q_abs, kv, idx, do_lat, lse, delta, dkv, *args, kv.shape[1],
                                                          C, D - C, *_strides(q_abs, kv, idx), **meta)
    else:
        dq_abs.zero_()
    return dq_abs


class SparseLatentAttentionCore(torch.autograd.Function):
    """(q (B, Q, H, Dn + R), kv (B, T, C + R), idx (B, Q, m), w_uk (H, Dn, C), w_uv (H, Dv, C), scale) ->
    out (B, Q, H, Dv) fp32, lse (B, H, Q) fp32: `latent_forward` with `latent_backward` as its gradient (q, kv,
    w_uk, w_uv), each input's gradient in its dtype. One block, no ring (moe_lc.ops.dsa_attention adds that)."""

    @staticmethod
    def forward(ctx, q, kv, idx, w_uk, w_uv, scale: float):
        out, lse = latent_forward(q, kv, idx, w_uk, w_uv, scale)
        ctx.save_for_backward(q, kv, idx, w_uk, w_uv, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, kv, idx, w_uk, w_uv, out, lse = ctx.saved_tensors
        dq, dkv, dw_uk, dw_uv = latent_backward(dout, q, kv, idx, out, lse, w_uk, w_uv, ctx.scale)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, dw_uk.to(w_uk.dtype), dw_uv.to(w_uv.dtype), None


def sparse_latent_attention(q: Tensor, kv: Tensor, idx: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float
                            ) -> tuple[Tensor, Tensor]:
    """Differentiable `latent_forward` (see SparseLatentAttentionCore)."""
    return SparseLatentAttentionCore.apply(q, kv, idx, w_uk, w_uv, scale)
