"""cuDNN's fused attention (torch's SDPA cuDNN kernel) behind the attention interface: backend "cudnn".

Why a backend of its own: on an H100 (torch 2.11, cuDNN 9.19, bf16, causal, 4K-128K) the cuDNN kernel
ran forward + backward at 476-564 TFLOP/s where torch's flash kernel (FlashAttention-2, the "torch"
backend) ran at 276-332: 1.7x (tools/bench/results/nvidia-h100-80gb-hbm3-2026-11-27.md). It ships in
every CUDA build of torch, so it needs no package the way flash-attn and flash-attn-4 do.

Schemas (torch native_functions.yaml, 2.5-2.13; shapes from torch/_meta_registrations.py):
  _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p,
      is_causal, return_debug_mask, *, scale) -> (out (B, H, Q, D_v), logsumexp (B, H, Q, 1) fp32,
      cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)
  _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
      philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale)
      -> (dq, dk, dv)
The kernel takes D_qk != D_v (MLA's 192 / 128) without padding. The (B, H, S, D) views it takes are
transposes of our BSHD tensors, as for the "torch" backend; H_kv < H is expanded to H here (repeat of
k / v, the group's dk / dv summed back): this entry takes equal head counts as called here, and
whether it takes H_kv < H natively was not checked on a GPU. Causal is top-left aligned (S_q == S_k, as everywhere here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_lc.ops.attention_backends import (CUDA_FLASH_DTYPES, REFERENCE, AttentionBackend, check_attention_inputs,
                                           fallback_reason, warn_fallback)
from moe_lc.ops.device import gpu_capability, is_gpu

aten = torch.ops.aten


def cudnn_attention_ok(device: torch.device) -> bool:
    """Whether this process can call the cuDNN attention kernel on `device` (CUDA, cuDNN, sm80+)."""
    if not is_gpu(device) or not hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if device.type == "meta":  # the dry run prices the kernel it would call
        return True
    capability = gpu_capability(device)
    return torch.backends.cudnn.is_available() and capability is not None and capability >= (8, 0)


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    """(B, S, H_kv, D) -> (B, S, H_kv * groups, D), each kv head repeated for its group of q heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _sum_groups(dx: Tensor, groups: int) -> Tensor:
    """(B, S, H, D) grads of expanded kv heads -> (B, S, H / groups, D), summed over each group."""
    return dx if groups == 1 else dx.unflatten(2, (-1, groups)).sum(3)


class CudnnBackend(AttentionBackend):
    """torch's cuDNN SDPA kernel, forward and backward called directly (no autograd inside)."""

    name = "cudnn"

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        reason = fallback_reason(q, v, CUDA_FLASH_DTYPES)
        if reason is not None:
            warn_fallback(self.name, reason)
            return REFERENCE.forward(q, k, v, causal, scale)
        groups = q.shape[2] // k.shape[2]
        q_, k_, v_ = (x.transpose(1, 2) for x in (q, _expand_kv(k, groups), _expand_kv(v, groups)))
        out_BHQD, lse_BHQ1, *_ = aten._scaled_dot_product_cudnn_attention(
            q_, k_, v_, None, True, 0.0, causal, False, scale=scale)
        return out_BHQD.transpose(1, 2), lse_BHQ1.reshape(q.shape[0], q.shape[2], q.shape[1]).float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if fallback_reason(q, v, CUDA_FLASH_DTYPES) is not None:
            return REFERENCE.backward(dout, q, k, v, out, lse, causal, scale)
        groups = q.shape[2] // k.shape[2]
        q_, k_, v_, out_, dout_ = (x.transpose(1, 2) for x in
                                   (q, _expand_kv(k, groups), _expand_kv(v, groups), out, dout.to(out.dtype)))
        B, Q, H = q.shape[:3]
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout_, q_, k_, v_, out_, lse.float().reshape(B, H, Q, 1).contiguous(), no_rng, no_rng, None,
            None, None, Q, k.shape[1], 0.0, causal, scale=scale)
        return dq.transpose(1, 2), _sum_groups(dk.transpose(1, 2), groups), _sum_groups(dv.transpose(1, 2), groups)
