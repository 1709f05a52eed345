"""Grouped GEMM for experts: one matmul per expert over its contiguous slice of sorted tokens.

Legend: T tokens (sorted by expert), E experts, K contraction dim, N output dim.
`counts[e]` tokens belong to expert e and lie in rows [sum(counts[:e]), sum(counts[:e+1])).

Backends: `torch._grouped_mm` (one kernel; CPU fp32/bf16 and CUDA bf16 on Hopper) where it works,
else a loop over experts (never over tokens). The choice is made per call from device, dtype and
layout: the kernel (pytorch aten/src/ATen/native/GroupedMMUtils.h, check_valid_strides_and_return_
transposed) wants a 16-byte-aligned data_ptr, one of the last two strides 1 and the other a multiple
of 16 bytes. A weight viewed out of ZeRO's flat buffer can start anywhere, so a misaligned operand
takes the loop (with one warning saying why) instead of failing inside the kernel.

Host syncs: the loop needs the counts on the host; the grouped kernel takes the offsets on the
device and syncs nothing. `host_sizes(counts)` is the one way to ask for the host copy: a dispatcher
that already brought the counts to the host registers that copy (`known_sizes`), and otherwise the
first ask syncs once and every later GEMM on the same counts tensor (forward, backward, W) reuses it.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from moe_lc.ops.device import is_gpu

_GROUPED_MM = hasattr(torch, "_grouped_mm")
_warned: set[str] = set()


def misalignment(t: torch.Tensor) -> str | None:
    """Why torch._grouped_mm would refuse t's layout (None when it takes it)."""
    if t.data_ptr() % 16:
        return f"data_ptr {t.data_ptr():#x} is not 16-byte aligned"
    rows, cols = t.stride()[-2:]
    if not ((cols == 1 and rows * t.element_size() % 16 == 0) or (rows == 1 and cols * t.element_size() % 16 == 0)):
        return f"strides {tuple(t.stride())} are neither row- nor column-major with 16-byte rows"
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) * t.element_size() % 16:
        return f"expert stride {t.stride(0)} is not a multiple of 16 bytes"
    return None


def use_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `grouped_mm` / `grouped_mm_wgrad` run torch._grouped_mm on operands a and b (device, dtype
    and layout allow it); False: the loop over experts (a GPU warns once per reason)."""
    if not _GROUPED_MM or a.dtype != b.dtype:
        return False
    if a.device.type == "cpu":
        supported = a.dtype in (torch.float32, torch.bfloat16)
    else:
        supported = a.dtype == torch.bfloat16  # the CUDA kernel (Hopper) is bf16-only
    if not supported:
        return False
    reason = misalignment(a) or misalignment(b)
    if reason is not None:
        if reason not in _warned and is_gpu(a.device):
            _warned.add(reason)
            warnings.warn(f"grouped GEMM falls back to a loop over experts: {reason}", RuntimeWarning, stacklevel=3)
        return False
    return True


_HOST_SIZES = WeakTensorKeyDictionary()  # counts tensor -> its values as a host list


def known_sizes(counts: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Register `sizes` (host ints) as the values of the device tensor `counts`; returns counts."""
    _HOST_SIZES[counts] = list(sizes)
    return counts


def host_sizes(counts: torch.Tensor) -> list[int]:
    """counts as host ints: the registered copy, else one `.tolist()` (a device-to-host sync on a GPU)
    remembered for the next GEMM on the same tensor."""
    sizes = _HOST_SIZES.get(counts)
    if sizes is None:
        sizes = _HOST_SIZES[counts] = counts.tolist()
    return sizes


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0).to(torch.int32)


def grouped_mm(x_TK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e].  x: (T, K), w: (E, K, N) (any strides), -> (T, N)."""
    if use_grouped_mm(x_TK, w_EKN):
        return torch._grouped_mm(x_TK, w_EKN, offs=_offsets(counts_E))
    return torch.cat([p @ w for p, w in zip(x_TK.split(host_sizes(counts_E)), w_EKN)])


def grouped_mm_wgrad(a_TM: torch.Tensor, b_TN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """g[e] = a[rows of e]^T @ b[rows of e] (weight gradients).  a: (T, M), b: (T, N) -> (E, M, N)."""
    if use_grouped_mm(a_TM, b_TN) and a_TM.shape[0] > 0:
        return torch._grouped_mm(a_TM.t(), b_TN, offs=_offsets(counts_E))
    sizes = host_sizes(counts_E)
    return torch.stack([a.t() @ b for a, b in zip(a_TM.split(sizes), b_TN.split(sizes))])
