"""The flash-attn packages behind the attention interface (moe_lc/ops/attention.py): FlashAttention-2
("flash_attn", built from source) and flash-attn-4 ("flash_attn4", the CuTe-DSL kernels, wheels only).
Both are imported lazily; neither is needed on CPU.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import Tensor

from moe_lc.ops.device import gpu_capability
from moe_lc.ops.attention_backends import (CUDA_FLASH_DTYPES, CUDA_FLASH_MAX_HEAD_DIM, REFERENCE, AttentionBackend,
                                           check_attention_inputs, fallback_reason, pad_head_dim, round_up,
                                           trim_head_dim, unit_last_stride, unpad_grads, unpad_out,
                                           warn_fallback)


# --------------------------------------------------------------------------- flash-attn package


@functools.lru_cache(maxsize=None)
def flash_attn_interface():
    """The flash_attn.flash_attn_interface module and whether it has the >= 2.7.0 API; None if absent."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    version = tuple(int(x) for x in re.findall(r"\d+", getattr(flash_attn, "__version__", "0"))[:3])
    return flash_attn_interface, version >= (2, 7, 0)


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2.x private entry points (the ones its own autograd Functions call). Untested here.

    flash-attn >= 2.7.0 (read in Dao-AILab/flash-attention flash_attn/flash_attn_interface.py, v2.7.0 and
    v2.8.3; 2.7.0 registered these as torch custom ops and changed their signatures):
      _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                          softcap, alibi_slopes, return_softmax) -> (out_padded, softmax_lse, S_dmask, rng_state)
      _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                           window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                           rng_state=None) -> softmax_d   (writes dq, dk, dv in place)
    2.6.0-2.6.3 take `window_size=(left, right)` instead and the forward returns
      (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state).
    Tensors are BSHD (our layout), fp16/bf16, one head dim (multiple of 8, <= 256), H_kv | H natively.
    """

    name = "flash_attn"

    def __init__(self) -> None:
        found = flash_attn_interface()
        if found is None:
            raise ImportError("attention backend 'flash_attn' needs the flash-attn package (>= 2.6, CUDA), "
                              "which is not importable here; use 'auto', 'flash_attn4', 'torch' or 'reference'")
        self._fa, self._new_api = found

    def _window_kwargs(self) -> dict:
        return dict(window_size_left=-1, window_size_right=-1) if self._new_api else dict(window_size=(-1, -1))

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        reason = fallback_reason(q, v, CUDA_FLASH_DTYPES) if q.is_cuda else "CPU tensors"
        if reason is not None:
            warn_fallback(self.name, reason)
            return REFERENCE.forward(q, k, v, causal, scale)
        head_dim = round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_ = (unit_last_stride(pad_head_dim(x, head_dim)) for x in (q, k, v))
        outputs = self._fa._flash_attn_forward(
            q_, k_, v_, dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0,
            alibi_slopes=None, return_softmax=False, **self._window_kwargs())
        out_padded, lse_BHQ = (outputs[0], outputs[1]) if self._new_api else (outputs[4], outputs[5])
        return unpad_out(out_padded, v.shape[-1]), lse_BHQ

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if not q.is_cuda or fallback_reason(q, v, CUDA_FLASH_DTYPES) is not None:
            return REFERENCE.backward(dout, q, k, v, out, lse, causal, scale)
        head_dim = round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_, dout_, out_ = (unit_last_stride(pad_head_dim(x, head_dim)) for x in (q, k, v, dout, out))
        dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
        self._fa._flash_attn_backward(
            dout_, q_, k_, v_, out_, lse.float().contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
            causal=causal, softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
            **self._window_kwargs())
        return unpad_grads(dq, dk, dv, q, v)

    # Packed documents: `_flash_attn_varlen_forward/backward` (same flash_attn_interface.py, same versions:
    # the dense calls' arguments plus cu_seqlens_q/k (int32, B+1) and max_seqlen_q/k; q (T_q, H, D),
    # k, v (T_k, J, D); softmax_lse (H, T_q)). causal is bottom-right aligned per sequence, which is
    # top-left for the square causal pieces we give it.

    def varlen_ok(self, q: Tensor, v: Tensor) -> bool:
        return q.is_cuda and fallback_reason(q, v, CUDA_FLASH_DTYPES) is None

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        head_dim = round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_ = (unit_last_stride(pad_head_dim(x, head_dim)) for x in (q, k, v))
        outputs = self._fa._flash_attn_varlen_forward(
            q_, k_, v_, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0,
            alibi_slopes=None, return_softmax=False, **self._window_kwargs())
        out_padded, lse_HT = (outputs[0], outputs[1]) if self._new_api else (outputs[4], outputs[5])
        return unpad_out(out_padded, v.shape[-1]), lse_HT

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        head_dim = round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_, dout_, out_ = (unit_last_stride(pad_head_dim(x, head_dim)) for x in (q, k, v, dout, out))
        dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
        self._fa._flash_attn_varlen_backward(
            dout_, q_, k_, v_, out_, lse.float().contiguous(), dq, dk, dv, cu_q, cu_k, max_q, max_k,
            dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None, **self._window_kwargs())
        return unpad_grads(dq, dk, dv, q, v)


# --------------------------------------------------------------------------- flash-attn-4 (CuTe DSL)


@functools.lru_cache(maxsize=None)
def flash_attn4_interface():
    """flash_attn.cute.interface from PyPI's flash-attn-4, or None where it does not import (it needs
    the nvidia-cutlass-dsl wheels; its kernels compile on first use for each shape class)."""
    try:
        from flash_attn.cute import interface
    except Exception:  # ImportError, or the DSL's own import-time checks (no driver, no CUDA flavour)
        return None
    return interface


def flash_attn4_device_ok(device: torch.device) -> bool:
    # its forward and backward kernels exist for SM90 (Hopper) and SM100+ (Blackwell) only
    capability = gpu_capability(device)
    return capability is not None and capability[0] >= 9


class FlashAttn4Backend(AttentionBackend):
    """flash-attn-4's private entry points, the ones its own `FlashAttnFunc` calls (read in
    Dao-AILab/flash-attention flash_attn/cute/interface.py, 4.0.0b36):

      _flash_attn_fwd(q, k, v, softmax_scale=, causal=, return_lse=True) -> (out, lse, ...)
      _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal) -> (dq, dk, dv)

    BSHD, fp16/bf16, lse (B, H, Q) float32 natural log; H_kv | H natively; D_qk and D_v may differ,
    each a multiple of 8 in 8..256 on SM90. The forward's tuple grew between betas (2 -> 5 items),
    so only its first two are read. The backward recomputes P from the lse we pass, as ring
    attention needs.
    """

    name = "flash_attn4"

    def __init__(self) -> None:
        self._fa = flash_attn4_interface()
        if self._fa is None:
            raise ImportError("attention backend 'flash_attn4' needs PyPI's flash-attn-4 (pip install flash-attn-4, "
                              "CUDA 12.9+ / 13, compute capability >= 9.0), which is not importable here; use "
                              "'auto', 'torch' or 'reference'")

    def _reason(self, q: Tensor, v: Tensor) -> str | None:
        if not flash_attn4_device_ok(q.device):
            return "CPU tensors" if not q.is_cuda else "a GPU below compute capability 9.0"
        if q.dtype not in CUDA_FLASH_DTYPES:
            return f"dtype {q.dtype} (kernel takes {CUDA_FLASH_DTYPES})"
        if max(q.shape[-1], v.shape[-1]) > CUDA_FLASH_MAX_HEAD_DIM:
            return f"head dims D_qk={q.shape[-1]}, D_v={v.shape[-1]} (kernel takes <= {CUDA_FLASH_MAX_HEAD_DIM})"
        return None

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        reason = self._reason(q, v)
        if reason is not None:
            warn_fallback(self.name, reason)
            return REFERENCE.forward(q, k, v, causal, scale)
        d_qk, d_v = round_up(q.shape[-1], 8), round_up(v.shape[-1], 8)
        q_, k_ = (pad_head_dim(x, d_qk) for x in (q, k))
        out, lse = self._fa._flash_attn_fwd(q_, k_, pad_head_dim(v, d_v), softmax_scale=scale, causal=causal,
                                            return_lse=True)[:2]
        return unpad_out(out, v.shape[-1]), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if self._reason(q, v) is not None:
            return REFERENCE.backward(dout, q, k, v, out, lse, causal, scale)
        d_qk, d_v = round_up(q.shape[-1], 8), round_up(v.shape[-1], 8)
        q_, k_ = (pad_head_dim(x, d_qk) for x in (q, k))
        v_, out_, dout_ = (pad_head_dim(x, d_v) for x in (v, out, dout))
        dq, dk, dv = self._fa._flash_attn_bwd(q_, k_, v_, out_, dout_, lse.float().contiguous(),
                                              softmax_scale=scale, causal=causal)[:3]
        return trim_head_dim(dq, q.shape[-1]), trim_head_dim(dk, q.shape[-1]), trim_head_dim(dv, v.shape[-1])

    # Packed documents: the same entry points with cu_seqlens_q/k (int32) and max_seqlen_q/k; q (T_q, H, D),
    # k, v (T_k, J, D); lse (H, T_q) (interface.py, `lse_shape` for varlen without qv).

    def varlen_ok(self, q: Tensor, v: Tensor) -> bool:
        return self._reason(q, v) is None

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        d_qk, d_v = round_up(q.shape[-1], 8), round_up(v.shape[-1], 8)
        q_, k_ = (pad_head_dim(x, d_qk) for x in (q, k))
        out, lse_HT = self._fa._flash_attn_fwd(q_, k_, pad_head_dim(v, d_v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                               max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale,
                                               causal=causal, return_lse=True)[:2]
        return unpad_out(out, v.shape[-1]), lse_HT

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        d_qk, d_v = round_up(q.shape[-1], 8), round_up(v.shape[-1], 8)
        q_, k_ = (pad_head_dim(x, d_qk) for x in (q, k))
        v_, out_, dout_ = (pad_head_dim(x, d_v) for x in (v, out, dout))
        dq, dk, dv = self._fa._flash_attn_bwd(q_, k_, v_, out_, dout_, lse.float().contiguous(), softmax_scale=scale,
                                              causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              max_seqlen_q=max_q, max_seqlen_k=max_k)[:3]
        return trim_head_dim(dq, q.shape[-1]), trim_head_dim(dk, q.shape[-1]), trim_head_dim(dv, v.shape[-1])
