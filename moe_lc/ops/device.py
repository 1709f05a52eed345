"""What a device's tensors run on: the one place kernels are chosen by device.

Every kernel choice in moe_lc (attention backend, FP8 GEMM path, grouped GEMM dtype rules) asks
`is_gpu` / `gpu_capability` / `cuda_version` here instead of torch.cuda directly. That lets the dry
run (tools/dryrun.py) trace a training step on the meta device -- shapes and bytes, no data, no GPU
-- along the code paths a GPU would take: inside `meta_as_gpu(spec)`, meta tensors answer as a CUDA
device of the spec's compute capability and CUDA version. (Fake *CUDA* tensors need a CUDA build of
torch: on a CPU-only build some kernels abort looking for CUDA's device guard.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuSpec:
    """The GPU meta tensors stand for in a dry run."""

    name: str = "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] = (9, 0)
    cuda: tuple[int, int] = (12, 9)
    memory_bytes: int = 80 * 10**9


_META_AS: GpuSpec | None = None


@contextlib.contextmanager
def meta_as_gpu(spec: GpuSpec = GpuSpec()):
    """Inside: tensors on the meta device take the GPU code paths of `spec`."""
    global _META_AS
    before, _META_AS = _META_AS, spec
    try:
        yield spec
    finally:
        _META_AS = before


def meta_gpu() -> GpuSpec | None:
    """The GpuSpec meta tensors stand for right now (None outside `meta_as_gpu`)."""
    return _META_AS


def is_gpu(device: torch.device | str) -> bool:
    """True for CUDA devices (and for meta inside `meta_as_gpu`)."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "meta" and _META_AS is not None)


def gpu_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) compute capability of the GPU behind `device`; None off GPU (and on ROCm)."""
    device = torch.device(device)
    if device.type == "meta":
        return _META_AS.capability if _META_AS is not None else None
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def cuda_version(device: torch.device | str) -> tuple[int, ...]:
    """The CUDA toolkit torch was built with, as the GPU behind `device` sees it ((0, 0) for none)."""
    if torch.device(device).type == "meta" and _META_AS is not None:
        return _META_AS.cuda
    return tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
