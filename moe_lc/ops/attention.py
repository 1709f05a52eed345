"""Attention backends that return the log-sum-exp of the scores beside the output, as FlashAttention's
kernels keep it for their backward (Dao et al. 2022, arXiv:2205.14135): ring attention merges partial
results by it (parallel/cp/ring.py).

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
probabilities from the `lse` and `out` it is *given*, so ring attention (parallel/cp/ring.py) can run
forward on key blocks, merge the partials by LSE, and then call backward per block with the merged
(out, lse): the per-block gradients then sum to the exact full gradients (tests check this).

Backends (config `model.attn_backend`; implemented in attention_backends.py and flash_attention.py):
"reference" (float32 torch math, any device), "torch"
(aten's fused flash kernels: CPU `_scaled_dot_product_flash_attention_for_cpu`, CUDA
`_scaled_dot_product_flash_attention`), "cudnn" (aten's cuDNN kernel, CUDA only: cudnn_attention.py),
"flash_attn" (the flash-attn 2.6+ package, CUDA only,
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

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moe_lc.config.choices import AttnBackend, names
from moe_lc.ops.device import gpu_capability, is_gpu, meta_gpu
from moe_lc.ops.attention_backends import (CUDA_FLASH_DTYPES, CUDA_FLASH_MAX_HEAD_DIM, REFERENCE, AttentionBackend,
                                           ReferenceBackend, TorchBackend, check_attention_inputs, round_up)
from moe_lc.ops.cudnn_attention import CudnnBackend, cudnn_attention_ok
from moe_lc.ops.flash_attention import (FlashAttn4Backend, FlashAttnBackend, flash_attn4_device_ok,
                                        flash_attn4_interface, flash_attn_interface)

aten = torch.ops.aten
__all__ = ["AUTO_ORDER", "BACKEND_NAMES", "AttentionBackend", "ReferenceBackend", "TorchBackend", "CudnnBackend",
           "FlashAttnBackend", "FlashAttn4Backend", "attention", "attention_with_lse", "available_backends",
           "check_attention_inputs", "get_backend", "keeps_scores", "resolved_backend", "unusable_reason"]

BACKEND_NAMES = names(AttnBackend)  # the recipe's choices: "auto" plus every class of _BACKEND_CLASSES
# "auto" takes the first of these that is usable on the device, fastest first. Measured on an H100
# (tools/bench/results/nvidia-h100-80gb-hbm3-2026-11-27.md, causal bf16 fwd+bwd, 4K-128K): cuDNN
# 476-564 TFLOP/s, torch's flash kernel (FlashAttention-2, as the flash-attn package) 276-332.
# flash-attn-4 leads by its published Hopper figures; not yet measured here.
AUTO_ORDER = ("flash_attn4", "cudnn", "flash_attn", "torch", "reference")


# --------------------------------------------------------------------------- selection


def _torch_flash_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu")
    if device.type == "meta":  # the dry run: the CUDA kernel's meta function
        return is_gpu(device)
    if device.type == "cuda":
        probe = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        return torch.cuda.is_available() and probe()
    return False


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Concrete backend names usable on `device` in this process (never includes "auto")."""
    device = torch.device(device)
    names = ["reference"]
    if _torch_flash_available(device):
        names.append("torch")
    if cudnn_attention_ok(device):
        names.append("cudnn")
    if is_gpu(device) and flash_attn_interface() is not None:
        names.append("flash_attn")
    if flash_attn4_device_ok(device) and flash_attn4_interface() is not None:
        names.append("flash_attn4")
    return names


_BACKEND_CLASSES = {"reference": ReferenceBackend, "torch": TorchBackend, "cudnn": CudnnBackend,
                    "flash_attn": FlashAttnBackend, "flash_attn4": FlashAttn4Backend}


@functools.lru_cache(maxsize=None)
def _backend_for(name: str, device: torch.device, meta_gpu) -> AttentionBackend:
    if name == "auto":
        usable = available_backends(device)
        name = next(n for n in AUTO_ORDER if n in usable)
    return REFERENCE if name == "reference" else _BACKEND_CLASSES[name]()


def resolved_backend(name: str, device: torch.device | str = "cpu") -> str:
    """The concrete backend `name` stands for on `device` ("auto": the first usable of AUTO_ORDER)."""
    return next(n for n in AUTO_ORDER if n in available_backends(device)) if name == "auto" else name


def unusable_reason(name: str, device: torch.device | str = "cpu") -> str | None:
    """Why backend `name` cannot run on `device` in this process (None when it can). Preflight asks this
    before any process group, so a recipe naming a kernel this machine lacks stops with one line, not
    with the ImportError of the first forward (or a silent fall-back to the O(S^2) reference math)."""
    device, why = torch.device(device), []
    if name == "torch" and not _torch_flash_available(device):
        why.append("this torch has no fused flash kernel for " + ("CPU" if device.type == "cpu" else device.type))
    if name in ("cudnn", "flash_attn", "flash_attn4") and not is_gpu(device):
        why.append(f"it runs on CUDA only, and train.device resolves to {device.type}")
    elif name == "flash_attn4" and not flash_attn4_device_ok(device):
        major, minor = gpu_capability(device) or (0, 0)
        why.append(f"it needs compute capability >= 9.0 (Hopper, Blackwell); this GPU is {major}.{minor}")
    if name == "flash_attn" and flash_attn_interface() is None:
        why.append("the flash-attn package (>= 2.6, CUDA, built from source) is not importable here")
    if name == "flash_attn4" and flash_attn4_interface() is None:
        why.append("PyPI's flash-attn-4 (pip install flash-attn-4, CUDA 12.9+) is not importable here")
    return "; ".join(why) or None


def keeps_scores(name: str, device: torch.device | str, dtype: torch.dtype, d_qk: int, d_v: int) -> bool:
    """Whether backend `name` materializes the (S_q x S_k) scores for such inputs on `device`: the reference
    math does, and so do the CUDA kernels' fall-backs to it (`fallback_reason`). Preflight's memory floor."""
    name = resolved_backend(name, device)
    if name == "reference" or not is_gpu(device):
        return name == "reference"  # on CPU the torch kernel is blocked (flash_attn* are refused there)
    return dtype not in CUDA_FLASH_DTYPES or round_up(max(d_qk, d_v), 8) > CUDA_FLASH_MAX_HEAD_DIM


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name` ("auto": the first of AUTO_ORDER usable on `device`)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; valid names: {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return _backend_for(name, device, meta_gpu())


# --------------------------------------------------------------------------- autograd entry points


class _AttentionFunction(torch.autograd.Function):
    """out, lse = backend.forward(...); backward calls backend.backward with the saved (q, k, v, out, lse).
    With `pieces` (packed documents): backend.forward_pieces / backward_pieces instead, causal unused."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, backend: AttentionBackend, pieces=None):
        if pieces is None:
            out, lse = backend.forward(q, k, v, causal, scale)
        else:
            out, lse = backend.forward_pieces(q, k, v, pieces, scale)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.backend, ctx.pieces = causal, scale, backend, pieces
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.pieces is None:
            dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        else:
            grads = ctx.backend.backward_pieces(dout, q, k, v, out, lse, ctx.pieces, ctx.scale)
            dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None, None


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None,
                       backend: AttentionBackend | str = "auto", pieces=None) -> tuple[Tensor, Tensor]:
    """Differentiable in q, k, v through `out`; lse (B, H, Q) float32 carries no gradient.

    scale defaults to 1/sqrt(D_qk). backend: a name (resolved for q's device) or a backend object.
    pieces: attend only inside these rectangles (`Documents.pieces`, moe_lc/ops/documents.py; packed
    documents), instead of the causal / full mask.
    """
    if isinstance(backend, str):
        backend = get_backend(backend, q.device)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return _AttentionFunction.apply(q, k, v, causal, scale, backend, pieces)


def note_max_lse(holder, lse_BHS: Tensor) -> None:
    """QK-clip's probes (moe_lc/parallel/qk_clip.py, qk_guard.py): when `holder.max_lse_probe` is set, keep
    holder.max_lse (H,) fp32, the per-head max of lse over every call since the probe was last reset; when
    `holder.bound_probe` is set, holder.call_bound (B, H), this call's per-sample max. A row's lse bounds
    its largest scaled score from above (by at most log of the keys it sees), and ring attention's merged
    lse is the full row's, so the bound is the same under any context-parallel layout."""
    probe, bound = getattr(holder, "max_lse_probe", False), getattr(holder, "bound_probe", False)
    if not (probe or bound):
        return
    per_sample = lse_BHS.detach().float().amax(dim=2)
    if bound:
        holder.call_bound = per_sample
    if probe:
        seen = per_sample.amax(0)
        holder.max_lse = seen if holder.max_lse is None else torch.maximum(holder.max_lse, seen)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None,
              backend: AttentionBackend | str = "auto", pieces=None) -> Tensor:
    """softmax(scale * q k^T [causal mask]) v per head: (B, Q, H, D_qk) x ... -> (B, Q, H, D_v)."""
    return attention_with_lse(q, k, v, causal, scale, backend, pieces)[0]
