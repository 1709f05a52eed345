"""Grouped GEMM for experts: one matmul per expert over its contiguous slice of sorted tokens.

Legend: T tokens (sorted by expert), E experts, K contraction dim, N output dim.
`counts[e]` tokens belong to expert e and lie in rows [sum(counts[:e]), sum(counts[:e+1])).

Backends: `torch._grouped_mm` (one kernel; CPU fp32/bf16 and CUDA bf16 on Hopper) where it works,
else a loop over experts (never over tokens). The choice is made per call from device and dtype.
"""

from __future__ import annotations

import torch

_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _aligned(t: torch.Tensor) -> bool:
    """The kernel wants every non-unit stride to be a multiple of 16 bytes."""
    return all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride())


def _use_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not _GROUPED_MM or a.dtype != b.dtype or not (_aligned(a) and _aligned(b)):
        return False
    if a.device.type == "cpu":
        return a.dtype in (torch.float32, torch.bfloat16)
    return a.dtype == torch.bfloat16  # the CUDA kernel (Hopper) is bf16-only


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0).to(torch.int32)


def grouped_mm(x_TK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e].  x: (T, K), w: (E, K, N) (any strides), -> (T, N)."""
    if _use_grouped_mm(x_TK, w_EKN):
        return torch._grouped_mm(x_TK, w_EKN, offs=_offsets(counts_E))
    return torch.cat([p @ w for p, w in zip(x_TK.split(counts_E.tolist()), w_EKN)])


def grouped_mm_wgrad(a_TM: torch.Tensor, b_TN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """g[e] = a[rows of e]^T @ b[rows of e] (weight gradients).  a: (T, M), b: (T, N) -> (E, M, N)."""
    if _use_grouped_mm(a_TM, b_TN) and a_TM.shape[0] > 0:
        return torch._grouped_mm(a_TM.t(), b_TN, offs=_offsets(counts_E))
    sizes = counts_E.tolist()
    return torch.stack([a.t() @ b for a, b in zip(a_TM.split(sizes), b_TN.split(sizes))])
