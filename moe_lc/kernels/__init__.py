"""Triton kernels, each beside the torch reference it is held to (house style: a kernel per file).

    fp8_quantize.py          DeepSeek-V3 activation quantization, 1x128 tiles of x and of x^T in one pass
                             (reference: moe_lc.ops.fp8.quantize_rowwise_tiles)
    dsa_sparse_attention.py  sparse MLA attention over each query's selected latent rows, absorbed form,
                             forward and backward (reference: moe_lc.ops.sparse_attention)

This package is a leaf: it imports torch and triton only, so moe_lc.ops may dispatch to it. Importing the
package does not import triton (CPU machines need not have it); import a kernel module to get its kernels.
Under ``TRITON_INTERPRET=1`` (set before a kernel module is imported) the kernels run on CPU tensors, which
is how tests/test_triton_kernels.py checks them without a GPU.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True where triton imports (it ships with torch's CUDA wheels on Linux); asked once per process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_tiles(x):
    """``fp8_quantize.quantize_tiles``, imported on first use (it imports triton): moe_lc.ops.fp8's CUDA path."""
    from moe_lc.kernels.fp8_quantize import quantize_tiles as kernel

    return kernel(x)
