"""Attention backends that return the log-sum-exp ("Attention returns LSE", DESIGN.md).

Legend (flash-attn's native "BSHD" layout; shape suffixes on names follow it):
  B batch, Q query length (S_q), K key length (S_k), H query heads, J key/value heads (H_kv),
  G = H // J query heads per kv head (query head h reads kv head h // G), D head dim
  (D_qk for q and k, D_v for v; they may differ, e.g. DeepSeek MLA: 192 and 128).
  q: (B, Q, H, D_qk)   k: (B, K, J, D_qk)   v: (B, K, J, D_v)
  out: (B, Q, H, D_v) in q.dtype     lse: (B, H, Q) float32, natural log, of the *scaled* scores:
  lse[b, h, i] = log sum_j exp(scale * q_i . k_j) over unmasked j.
  causal=True needs Q == K and is top-left aligned (query i sees keys j <= i); causal=False: no mask.

Every backend has `forward(q, k, v, causal, scale) -> (out, lse)` and
`backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`. The backward recomputes the
probabilities from the `lse` and `out` it is *given*, so ring attention (parallel/context.py) can run
forward on key blocks, merge the partials by LSE, and then call backward per block with the merged
(out, lse): the per-block gradients then sum to the exact full gradients (tests check this).

Backends (config `model.attn_backend`): "reference" (float32 torch math, any device), "torch"
(aten's fused flash kernels: CPU `_scaled_dot_product_flash_attention_for_cpu`, CUDA
`_scaled_dot_product_flash_attention`), "flash_attn" (the flash-attn 2.6+ package, CUDA only,
built from source), "flash_attn4" (PyPI's `flash-attn-4`, the CuTe-DSL FlashAttention, wheels only,
Hopper and Blackwell: compute capability >= 9.0) and "auto": the first usable of `AUTO_ORDER`.
FlashAttention-2 and the torch kernel want one head dim for q, k and v: the smaller of D_qk / D_v is
zero-padded (zero columns of q and k leave the scores unchanged; zero columns of v give zero output
columns) and the results are sliced back; flash-attn-4 takes D_qk != D_v (e.g. MLA's 192 / 128) as
is. Inputs a fused kernel cannot take (fp32 on CUDA, a head dim above 256) go to the reference math
with a warning.
"""

from __future__ import annotations

import functools
import re
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from moe_lc.config.choices import AttnBackend, names

aten = torch.ops.aten

BACKEND_NAMES = names(AttnBackend)  # the recipe's choices: "auto" plus every class of _BACKEND_CLASSES
# "auto" takes the first of these that is usable on the device: fastest first by the published
# figures (flash-attn-4 on Hopper/Blackwell ahead of FlashAttention-2, which torch's own CUDA kernel
# also is). Not yet measured here: tools/bench's attention part times every backend against each other.
AUTO_ORDER = ("flash_attn4", "flash_attn", "torch", "reference")
_CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_CUDA_FLASH_MAX_HEAD_DIM = 256


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


def _pad_head_dim(x: Tensor, head_dim: int) -> Tensor:
    """Zero-pad the last dim to `head_dim`; no copy when it already fits."""
    return x if x.shape[-1] == head_dim else F.pad(x, (0, head_dim - x.shape[-1]))


def _trim_head_dim(x: Tensor, head_dim: int) -> Tensor:
    """Undo _pad_head_dim (a view; free when nothing was padded)."""
    return x if x.shape[-1] == head_dim else x.narrow(-1, 0, head_dim)


def _unit_last_stride(x: Tensor) -> Tensor:
    # CUDA flash kernels take any row/head strides but need a unit stride in the head dim.
    return x if x.stride(-1) == 1 else x.contiguous()


def _round_up(x: int, multiple: int) -> int:
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


_REFERENCE = ReferenceBackend()


def _fallback_reason(q: Tensor, v: Tensor, dtypes: tuple[torch.dtype, ...] | None) -> str | None:
    """Why a CUDA flash kernel cannot take these inputs (None when it can)."""
    if dtypes is not None and q.dtype not in dtypes:
        return f"dtype {q.dtype} (kernel takes {dtypes})"
    if _round_up(max(q.shape[-1], v.shape[-1]), 8) > _CUDA_FLASH_MAX_HEAD_DIM:
        return f"head dims D_qk={q.shape[-1]}, D_v={v.shape[-1]} (kernel takes <= {_CUDA_FLASH_MAX_HEAD_DIM})"
    return None


def _warn_fallback(backend: str, reason: str) -> None:
    warnings.warn(f"attention backend {backend!r} cannot take {reason}; using the reference math "
                  "(O(S^2) memory)", RuntimeWarning, stacklevel=4)


# --------------------------------------------------------------------------- torch (aten)


class TorchBackend(AttentionBackend):
    """aten's fused flash kernels; the (B, H, S, D) views they take are transposes of BSHD."""

    name = "torch"

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if q.is_cuda:
            return self._cuda_forward(q, k, v, causal, scale)
        head_dim = max(q.shape[-1], v.shape[-1])
        q_, k_, v_ = (_pad_head_dim(x, head_dim).transpose(1, 2) for x in (q, k, v))
        out_BHQD, lse_BHQ = aten._scaled_dot_product_flash_attention_for_cpu(
            q_, k_, v_, 0.0, causal, attn_mask=None, scale=scale)
        # lse is float32 for fp32/bf16/fp16 (float() is then a no-op) and float64 for fp64 inputs.
        return _trim_head_dim(out_BHQD.transpose(1, 2), v.shape[-1]), lse_BHQ.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if q.is_cuda:
            return self._cuda_backward(dout, q, k, v, out, lse, causal, scale)
        head_dim = max(q.shape[-1], v.shape[-1])
        q_, k_, v_, dout_, out_ = (_pad_head_dim(x, head_dim).transpose(1, 2) for x in (q, k, v, dout, out))
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernel's accumulator
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout_, q_, k_, v_, out_, lse.to(lse_dtype), 0.0, causal, attn_mask=None, scale=scale)
        return _unpad_grads(dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), q, v)

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
        reason = _fallback_reason(q, v, _CUDA_FLASH_DTYPES)
        if reason is not None:
            _warn_fallback(self.name, reason)
            return _REFERENCE.forward(q, k, v, causal, scale)
        head_dim = _round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_ = (_unit_last_stride(_pad_head_dim(x, head_dim)).transpose(1, 2) for x in (q, k, v))
        out_BHQD, lse_BHQ, *_ = aten._scaled_dot_product_flash_attention(
            q_, k_, v_, 0.0, causal, False, scale=scale)
        return _trim_head_dim(out_BHQD.transpose(1, 2), v.shape[-1]), lse_BHQ

    def _cuda_backward(self, dout, q, k, v, out, lse, causal, scale):
        if _fallback_reason(q, v, _CUDA_FLASH_DTYPES) is not None:
            return _REFERENCE.backward(dout, q, k, v, out, lse, causal, scale)
        head_dim = _round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_, dout_, out_ = (_unit_last_stride(_pad_head_dim(x, head_dim)).transpose(1, 2)
                                   for x in (q, k, v, dout, out))
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout_, q_, k_, v_, out_, lse.float().contiguous(), None, None, q.shape[1], k.shape[1],
            0.0, causal, no_rng, no_rng, scale=scale)
        return _unpad_grads(dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), q, v)


def _unpad_grads(dq: Tensor, dk: Tensor, dv: Tensor, q: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Slice padded (B, S, H, D) grads back to the head dims of q/k and v (views, no copies)."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    return _trim_head_dim(dq, d_qk), _trim_head_dim(dk, d_qk), _trim_head_dim(dv, d_v)


# --------------------------------------------------------------------------- flash-attn package


@functools.lru_cache(maxsize=None)
def _flash_attn_interface():
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
        found = _flash_attn_interface()
        if found is None:
            raise ImportError("attention backend 'flash_attn' needs the flash-attn package (>= 2.6, CUDA), "
                              "which is not importable here; use 'auto', 'flash_attn4', 'torch' or 'reference'")
        self._fa, self._new_api = found

    def _window_kwargs(self) -> dict:
        return dict(window_size_left=-1, window_size_right=-1) if self._new_api else dict(window_size=(-1, -1))

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        reason = _fallback_reason(q, v, _CUDA_FLASH_DTYPES) if q.is_cuda else "CPU tensors"
        if reason is not None:
            _warn_fallback(self.name, reason)
            return _REFERENCE.forward(q, k, v, causal, scale)
        head_dim = _round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_ = (_unit_last_stride(_pad_head_dim(x, head_dim)) for x in (q, k, v))
        outputs = self._fa._flash_attn_forward(
            q_, k_, v_, dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=0.0,
            alibi_slopes=None, return_softmax=False, **self._window_kwargs())
        out_padded, lse_BHQ = (outputs[0], outputs[1]) if self._new_api else (outputs[4], outputs[5])
        return _trim_head_dim(out_padded, v.shape[-1]), lse_BHQ

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if not q.is_cuda or _fallback_reason(q, v, _CUDA_FLASH_DTYPES) is not None:
            return _REFERENCE.backward(dout, q, k, v, out, lse, causal, scale)
        head_dim = _round_up(max(q.shape[-1], v.shape[-1]), 8)
        q_, k_, v_, dout_, out_ = (_unit_last_stride(_pad_head_dim(x, head_dim)) for x in (q, k, v, dout, out))
        dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
        self._fa._flash_attn_backward(
            dout_, q_, k_, v_, out_, lse.float().contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
            causal=causal, softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
            **self._window_kwargs())
        return _unpad_grads(dq, dk, dv, q, v)


# --------------------------------------------------------------------------- flash-attn-4 (CuTe DSL)


@functools.lru_cache(maxsize=None)
def _flash_attn4_interface():
    """flash_attn.cute.interface from PyPI's flash-attn-4, or None where it does not import (it needs
    the nvidia-cutlass-dsl wheels; its kernels compile on first use for each shape class)."""
    try:
        from flash_attn.cute import interface
    except Exception:  # ImportError, or the DSL's own import-time checks (no driver, no CUDA flavour)
        return None
    return interface


def _flash_attn4_device_ok(device: torch.device) -> bool:
    # its forward and backward kernels exist for SM90 (Hopper) and SM100+ (Blackwell) only
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


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
        self._fa = _flash_attn4_interface()
        if self._fa is None:
            raise ImportError("attention backend 'flash_attn4' needs PyPI's flash-attn-4 (pip install flash-attn-4, "
                              "CUDA 12.9+ / 13, compute capability >= 9.0), which is not importable here; use "
                              "'auto', 'torch' or 'reference'")

    def _reason(self, q: Tensor, v: Tensor) -> str | None:
        if not _flash_attn4_device_ok(q.device):
            return "CPU tensors" if not q.is_cuda else "a GPU below compute capability 9.0"
        if q.dtype not in _CUDA_FLASH_DTYPES:
            return f"dtype {q.dtype} (kernel takes {_CUDA_FLASH_DTYPES})"
        if max(q.shape[-1], v.shape[-1]) > _CUDA_FLASH_MAX_HEAD_DIM:
            return f"head dims D_qk={q.shape[-1]}, D_v={v.shape[-1]} (kernel takes <= {_CUDA_FLASH_MAX_HEAD_DIM})"
        return None

    def forward(self, q, k, v, causal, scale):
        check_attention_inputs(q, k, v, causal)
        reason = self._reason(q, v)
        if reason is not None:
            _warn_fallback(self.name, reason)
            return _REFERENCE.forward(q, k, v, causal, scale)
        d_qk, d_v = _round_up(q.shape[-1], 8), _round_up(v.shape[-1], 8)
        q_, k_ = (_pad_head_dim(x, d_qk) for x in (q, k))
        out, lse = self._fa._flash_attn_fwd(q_, k_, _pad_head_dim(v, d_v), softmax_scale=scale, causal=causal,
                                            return_lse=True)[:2]
        return _trim_head_dim(out, v.shape[-1]), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_attention_inputs(q, k, v, causal)
        if self._reason(q, v) is not None:
            return _REFERENCE.backward(dout, q, k, v, out, lse, causal, scale)
        d_qk, d_v = _round_up(q.shape[-1], 8), _round_up(v.shape[-1], 8)
        q_, k_ = (_pad_head_dim(x, d_qk) for x in (q, k))
        v_, out_, dout_ = (_pad_head_dim(x, d_v) for x in (v, out, dout))
        dq, dk, dv = self._fa._flash_attn_bwd(q_, k_, v_, out_, dout_, lse.float().contiguous(),
                                              softmax_scale=scale, causal=causal)[:3]
        return _trim_head_dim(dq, q.shape[-1]), _trim_head_dim(dk, q.shape[-1]), _trim_head_dim(dv, v.shape[-1])


# --------------------------------------------------------------------------- selection


def _torch_flash_available(device_type: str) -> bool:
    if device_type == "cpu":
        return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu")
    if device_type == "cuda":
        probe = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        return torch.cuda.is_available() and probe()
    return False


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Concrete backend names usable on `device` in this process (never includes "auto")."""
    device_type = torch.device(device).type
    names = ["reference"]
    if _torch_flash_available(device_type):
        names.append("torch")
    if device_type == "cuda" and _flash_attn_interface() is not None:
        names.append("flash_attn")
    if device_type == "cuda" and _flash_attn4_device_ok(torch.device(device)) and _flash_attn4_interface() is not None:
        names.append("flash_attn4")
    return names


_BACKEND_CLASSES = {"reference": ReferenceBackend, "torch": TorchBackend, "flash_attn": FlashAttnBackend,
                    "flash_attn4": FlashAttn4Backend}


@functools.lru_cache(maxsize=None)
def _backend_for(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        usable = available_backends(device)
        name = next(n for n in AUTO_ORDER if n in usable)
    return _REFERENCE if name == "reference" else _BACKEND_CLASSES[name]()


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name` ("auto": the first of AUTO_ORDER usable on `device`)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; valid names: {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return _backend_for(name, device)


# --------------------------------------------------------------------------- autograd entry points


class _AttentionFunction(torch.autograd.Function):
    """out, lse = backend.forward(...); backward calls backend.backward with the saved (q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, backend: AttentionBackend):
        out, lse = backend.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None,
                       backend: AttentionBackend | str = "auto") -> tuple[Tensor, Tensor]:
    """Differentiable in q, k, v through `out`; lse (B, H, Q) float32 carries no gradient.

    scale defaults to 1/sqrt(D_qk). backend: a name (resolved for q's device) or a backend object.
    """
    if isinstance(backend, str):
        backend = get_backend(backend, q.device)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return _AttentionFunction.apply(q, k, v, causal, scale, backend)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None,
              backend: AttentionBackend | str = "auto") -> Tensor:
    """softmax(scale * q k^T [causal mask]) v per head: (B, Q, H, D_qk) x ... -> (B, Q, H, D_v)."""
    return attention_with_lse(q, k, v, causal, scale, backend)[0]
