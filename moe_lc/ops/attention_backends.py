"""Attention backends on one device: the interface, the reference math and torch's fused kernels.

Layouts, the forward/backward contract and the backend list are in moe_lc/ops/attention.py (the
public entry); the flash-attn packages' backends are in moe_lc/ops/flash_attention.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_lc.ops.device import is_gpu

aten = torch.ops.aten

CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)
CUDA_FLASH_MAX_HEAD_DIM = 256


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """Raise ValueError unless q, k, v follow the layout in the module docstring."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, S, H, D); got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    (B, Q, H, D_qk), (B_k, K, J, D_k), (B_v, K_v, J_v, _) = q.shape, k.shape, v.shape
    if not (B == B_k == B_v) or K != K_v or J != J_v or D_qk != D_k:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "need equal batch, equal k/v length and heads, and equal q/k head dim")
    if J == 0 or H % J != 0:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads H_kv={J}")
    if causal and Q != K:
        raise ValueError(f"causal=True needs S_q == S_k (top-left aligned mask); got S_q={Q}, S_k={K}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def pad_head_dim(x: Tensor, head_dim: int) -> Tensor:
    """Zero-pad the last dim to `head_dim`; no copy when it already fits."""
    return x if x.shape[-1] == head_dim else F.pad(x, (0, head_dim - x.shape[-1]))


def trim_head_dim(x: Tensor, head_dim: int) -> Tensor:
    """Undo pad_head_dim (a view; free when nothing was padded)."""
    return x if x.shape[-1] == head_dim else x.narrow(-1, 0, head_dim)


def unpad_out(out: Tensor, d_v: int) -> Tensor:
    """A kernel's output at the head dim D_v in a storage of its own. A padded output is copied once
    here, so the padded buffer is freed: what autograd saves for backward (which pads it again) and
    what the output projection reads as a view is D_v wide, not max(D_qk, D_v) plus a copy."""
    return out if out.shape[-1] == d_v else trim_head_dim(out, d_v).contiguous()


def unit_last_stride(x: Tensor) -> Tensor:
    # CUDA flash kernels take any row/head strides but need a unit stride in the head dim.
    return x if x.stride(-1) == 1 else x.contiguous()


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


class AttentionBackend:
    """Interface; see the module docstring for layouts. Backends hold no state."""

    name = "abstract"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """-> out (B, Q, H, D_v) in q.dtype, lse (B, H, Q) float32."""
        raise NotImplementedError

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """dout like out, lse (B, H, Q) -> (dq, dk, dv) with the shapes and dtypes of q, k, v."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # Packed documents (moe_lc/ops/documents.py): attention over `Piece`s only. A backend with a varlen
    # kernel defines `varlen_forward` / `varlen_backward` (packed (T, H, D) tensors, int32 cu_seqlens,
    # lse (H, T_q)) and `varlen_ok(q, v)`; the rest run one call per piece. Either way the parts are
    # merged by LSE, so a query row may be reached by several pieces (a document over two key chunks).
    varlen_forward = varlen_backward = None

    def varlen_ok(self, q: Tensor, v: Tensor) -> bool:
        return self.varlen_forward is not None

    def forward_pieces(self, q: Tensor, k: Tensor, v: Tensor, pieces, scale: float) -> tuple[Tensor, Tensor]:
        """-> out (B, Q, H, D_v), lse (B, H, Q), both float32 (float64 for float64 inputs), over the pieces'
        rectangles only; a row no piece reaches is (0, -inf)."""
        B, Q, H = q.shape[:3]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros((B * Q, H, v.shape[-1]), dtype=acc)
        lse = q.new_full((B * Q, H), float("-inf"), dtype=acc)
        if self.varlen_ok(q, v):
            for wave in piece_waves(pieces):
                q_idx, k_idx, cu_q, cu_k, max_q, max_k, causal = pack_pieces(wave, Q, k.shape[1], q.device)
                part_out, part_lse = self.varlen_forward(q.flatten(0, 1)[q_idx], k.flatten(0, 1)[k_idx],
                                                         v.flatten(0, 1)[k_idx], cu_q, cu_k, max_q, max_k, causal, scale)
                merge_rows_(out, lse, q_idx, part_out, part_lse.t())
        else:
            for p in pieces:
                part_out, part_lse = self.forward(q[p.row:p.row + 1, p.q], k[p.row:p.row + 1, p.k],
                                                  v[p.row:p.row + 1, p.k], p.causal, scale)
                rows = torch.arange(p.q.start, p.q.stop, device=q.device) + p.row * Q
                merge_rows_(out, lse, rows, part_out[0], part_lse[0].t())
        return out.view(B, Q, H, -1), lse.view(B, Q, H).permute(0, 2, 1).contiguous()

    def backward_pieces(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pieces,
                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of forward_pieces given the merged (out, lse) -> (dq, dk, dv) float32 (float64 for float64
        inputs), shapes of q, k, v."""
        acc = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        if self.varlen_ok(q, v):
            B, Q, H = q.shape[:3]
            lse_rows = lse.permute(0, 2, 1).reshape(B * Q, H)
            for wave in piece_waves(pieces):
                q_idx, k_idx, cu_q, cu_k, max_q, max_k, causal = pack_pieces(wave, Q, k.shape[1], q.device)
                rows = [t.flatten(0, 1)[q_idx] for t in (dout, q, out)]
                cols = [t.flatten(0, 1)[k_idx] for t in (k, v)]
                dq_p, dk_p, dv_p = self.varlen_backward(rows[0], rows[1], *cols, rows[2], lse_rows[q_idx].t().contiguous(),
                                                        cu_q, cu_k, max_q, max_k, causal, scale)
                dq.view(-1, *q.shape[2:]).index_add_(0, q_idx, dq_p.to(acc))
                dk.view(-1, *k.shape[2:]).index_add_(0, k_idx, dk_p.to(acc))
                dv.view(-1, *v.shape[2:]).index_add_(0, k_idx, dv_p.to(acc))
            return dq, dk, dv
        for p in pieces:
            at_q, at_k = (slice(p.row, p.row + 1), p.q), (slice(p.row, p.row + 1), p.k)
            dq_p, dk_p, dv_p = self.backward(dout[at_q], q[at_q], k[at_k], v[at_k], out[at_q],
                                             lse[p.row:p.row + 1, :, p.q].contiguous(), p.causal, scale)
            dq[at_q] += dq_p.to(acc)
            dk[at_k] += dk_p.to(acc)
            dv[at_k] += dv_p.to(acc)
        return dq, dk, dv


def piece_waves(pieces) -> list[list]:
    """Pieces grouped for varlen calls: one causal flag per group and no query row twice in one (the
    rows two pieces share, a document seen over two key chunks, always start at the same row)."""
    waves: dict[tuple, list] = {}
    seen: dict[tuple, int] = {}
    for p in pieces:
        key = (p.row, p.q.start, p.causal)
        n = seen[key] = seen.get(key, -1) + 1
        waves.setdefault((p.causal, n), []).append(p)
    return list(waves.values())


def pack_pieces(pieces, Q: int, K: int, device) -> tuple:
    """Flat row indices into (B*Q) queries and (B*K) keys, int32 cu_seqlens, max lengths and the causal
    flag of one wave of pieces: what a varlen kernel takes."""
    q_idx = torch.cat([torch.arange(p.q.start, p.q.stop) + p.row * Q for p in pieces])
    k_idx = torch.cat([torch.arange(p.k.start, p.k.stop) + p.row * K for p in pieces])
    n_q = [p.q.stop - p.q.start for p in pieces]
    n_k = [p.k.stop - p.k.start for p in pieces]
    cu_q = torch.tensor([0] + n_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + n_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (q_idx.to(device), k_idx.to(device), cu_q.to(device), cu_k.to(device), max(n_q), max(n_k),
            pieces[0].causal)


def lse_merge_weights(acc_lse: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Online softmax: the merged log-sum-exp of two partial attentions over disjoint keys, and the
    weights of each side's output in the merged one (same shapes as the inputs). Rows neither side
    reached (lse -inf on both) get lse -inf and weights 0."""
    new_lse = torch.logaddexp(acc_lse, part_lse)
    base = torch.where(new_lse == float("-inf"), 0.0, new_lse)  # exp(-inf - -inf) would be nan
    return new_lse, torch.exp(acc_lse - base), torch.exp(part_lse - base)


def merge_rows_(out_TH: Tensor, lse_TH: Tensor, rows: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """Online softmax in fp32 over flat rows: fold part (n, H, D_v), part_lse (n, H) into out (T, H, D_v),
    lse (T, H) at the distinct row indices `rows` (n,). Rows neither side reached stay (0, -inf)."""
    part_out, part_lse = part_out.to(out_TH.dtype), part_lse.to(lse_TH.dtype)
    new_lse, old_w, new_w = lse_merge_weights(lse_TH[rows], part_lse)
    merged = out_TH[rows] * old_w.unsqueeze(-1) + part_out * new_w.unsqueeze(-1)
    out_TH[rows] = merged
    lse_TH[rows] = new_lse


# --------------------------------------------------------------------------- reference


class ReferenceBackend(AttentionBackend):
    """Plain torch math in float32 (float64 stays float64), grouped over kv heads without copies."""

    name = "reference"

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """-> scaled masked scores (B, J, G, Q, K), q as (B, Q, J, G, D), k as (B, K, J, D)."""
        compute_dtype = torch.promote_types(q.dtype, torch.float32)
        J = k.shape[2]
        q_BQJGD = q.to(compute_dtype).unflatten(2, (J, q.shape[2] // J))
        k_BKJD = k.to(compute_dtype)
        scores_BJGQK = torch.einsum("bqjgd,bkjd->bjgqk", q_BQJGD, k_BKJD) * scale
        if causal:
            Q, K = scores_BJGQK.shape[-2:]
            future_QK = torch.ones(Q, K, dtype=torch.bool, device=q.device).triu_(1)
            scores_BJGQK = scores_BJGQK.masked_fill(future_QK, float("-inf"))
        return scores_BJGQK, q_BQJGD, k_BKJD

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        scores_BJGQK, _, _ = self._scores(q, k, causal, scale)
        lse_BJGQ = torch.logsumexp(scores_BJGQK, dim=-1)
        probs_BJGQK = torch.exp(scores_BJGQK - lse_BJGQ.unsqueeze(-1))
        out_BQJGD = torch.einsum("bjgqk,bkjd->bqjgd", probs_BJGQK, v.to(probs_BJGQK.dtype))
        return out_BQJGD.flatten(2, 3).to(q.dtype), lse_BJGQ.flatten(1, 2).float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        scores_BJGQK, q_BQJGD, k_BKJD = self._scores(q, k, causal, scale)
        J, G = scores_BJGQK.shape[1:3]
        dt = scores_BJGQK.dtype
        # Probabilities from the lse we are given (the merged one under ring attention).
        lse_BJGQ = lse.to(dt).unflatten(1, (J, G))
        probs_BJGQK = torch.exp(scores_BJGQK - lse_BJGQ.unsqueeze(-1))
        dout_BQJGD = dout.to(dt).unflatten(2, (J, G))
        v_BKJD = v.to(dt)
        dprobs_BJGQK = torch.einsum("bqjgd,bkjd->bjgqk", dout_BQJGD, v_BKJD)
        delta_BJGQ = (dout_BQJGD * out.to(dt).unflatten(2, (J, G))).sum(-1).permute(0, 2, 3, 1)
        dscores_BJGQK = probs_BJGQK * (dprobs_BJGQK - delta_BJGQ.unsqueeze(-1))
        dq = torch.einsum("bjgqk,bkjd->bqjgd", dscores_BJGQK, k_BKJD).flatten(2, 3) * scale
        dk = torch.einsum("bjgqk,bqjgd->bkjd", dscores_BJGQK, q_BQJGD) * scale
        dv = torch.einsum("bjgqk,bqjgd->bkjd", probs_BJGQK, dout_BQJGD)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = ReferenceBackend()


def fallback_reason(q: Tensor, v: Tensor, dtypes: tuple[torch.dtype, ...] | None) -> str | None:
    """Why a CUDA flash kernel cannot take these inputs (None when it can)."""
    if dtypes is not None and q.dtype not in dtypes:
        return f"dtype {q.dtype} (kernel takes {dtypes})"
    if round_up(max(q.shape[-1], v.shape[-1]), 8) > CUDA_FLASH_MAX_HEAD_DIM:
        return f"head dims D_qk={q.shape[-1]}, D_v={v.shape[-1]} (kernel takes <= {CUDA_FLASH_MAX_HEAD_DIM})"
    return None


def warn_fallback(backend: str, reason: str) -> None:
    warnings.warn(f"attention backend {backend!r} cannot take {reason}; using the reference math "
                  "(O(S^2) memory)", RuntimeWarning, stacklevel=4)


# --------------------------------------------------------------------------- torch (aten)


class TorchBackend(AttentionBackend):
    """aten's fused flash kernels; the (B, H, S, D) views they take are transposes of BSHD."""

    name = "torch"

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if is_gpu(q.device):
            return self._cuda_forward(q, k, v, causal, scale)
        head_dim = max(q.shape[-1], v.shape[-1])
        q_, k_, v_ = (pad_head_dim(x, head_dim).transpose(1, 2) for x in (q, k, v))
        out_BHQD, lse_BHQ = aten._scaled_dot_product_flash_attention_for_cpu(
            q_, k_, v_, 0.0, causal, attn_mask=None, scale=scale)
        # lse is float32 for fp32/bf16/fp16 (float() is then a no-op) and float64 for fp64 inputs.
        return unpad_out(out_BHQD.transpose(1, 2), v.shape[-1]), lse_BHQ.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if is_gpu(q.device):
            return self._cuda_backward(dout, q, k, v, out, lse, causal, scale)
        head_dim = max(q.shape[-1], v.shape[-1])
        q_, k_, v_, dout_, out_ = (pad_head_dim(x, head_dim).transpose(1, 2) for x in (q, k, v, dout, out))
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernel's accumulator
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout_, q_, k_, v_, out_, lse.to(lse_dtype), 0.0, causal, attn_mask=None, scale=scale)
        return unpad_grads(dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), q, v)

    # CUDA: schemas as of torch 2.5-2.13 (native_functions.yaml); untested on this CPU-only machine.
    #   _scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0.,
    #     bool is_causal=False, bool return_debug_mask=False, *, float? scale=None)
    #     -> (output, logsumexp, cum_seq_q, cum_seq_k, SymInt max_q, SymInt max_k, rng_state, unused, debug_attn_mask)
    #   _scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
    #     Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k,
    #     float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, *, float? scale=None)
    # Dense (non-nested) inputs give cum_seq_q/k = None, and with dropout_p = 0 the philox tensors are
    # never read (flash_api.cpp mha_bwd), so the backward needs nothing from the forward but (out, lse).
    # The kernel (flash_api.cpp mha_fwd/mha_bwd) takes H_kv < H natively and sums dk/dv over groups.

    def _cuda_forward(self, q, k, v, causal, scale):
        reason = fallback_reason(q, v, CUDA_FLASH_DTYPES)
        if reason is not None:
            warn_fallback(self.name, reason)
            return REFERENCE.forward(q, k, v, causal, scale)
        head_dim = round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_ = (unit_last_stride(pad_head_dim(x, head_dim)).transpose(1, 2) for x in (q, k, v))
        out_BHQD, lse_BHQ, *_ = aten._scaled_dot_product_flash_attention(
            q_, k_, v_, 0.0, causal, False, scale=scale)
        return unpad_out(out_BHQD.transpose(1, 2), v.shape[-1]), lse_BHQ

    def _cuda_backward(self, dout, q, k, v, out, lse, causal, scale):
        if fallback_reason(q, v, CUDA_FLASH_DTYPES) is not None:
            return REFERENCE.backward(dout, q, k, v, out, lse, causal, scale)
        head_dim = round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_, dout_, out_ = (unit_last_stride(pad_head_dim(x, head_dim)).transpose(1, 2)
                                   for x in (q, k, v, dout, out))
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout_, q_, k_, v_, out_, lse.float().contiguous(), None, None, q.shape[1], k.shape[1],
            0.0, causal, no_rng, no_rng, scale=scale)
        return unpad_grads(dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), q, v)


def unpad_grads(dq: Tensor, dk: Tensor, dv: Tensor, q: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Slice padded (B, S, H, D) grads back to the head dims of q/k and v (views, no copies)."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    return trim_head_dim(dq, d_qk), trim_head_dim(dk, d_qk), trim_head_dim(dv, d_v)
