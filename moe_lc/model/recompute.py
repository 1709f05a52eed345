"""Activation recomputation: trade compute for activation memory, on torch.utils.checkpoint.

Policies (`[recompute] policy`, applied from outside by `apply_recompute`):
    none       every activation autograd wants is kept
    full       each block keeps only its input; its forward is replayed in backward (a pipeline that
               runs blocks phase by phase keeps each phase's inputs instead)
    selective  only cheap, memory-heavy pieces are replayed (`[recompute] selective`):
                 norm       RMSNorm's fp32 intermediates
                 swiglu     the SwiGLU output: kept neither by the activation nor by the down
                            projection, recomputed from the cached gate|up (DeepSeek-V3's trick)
                 attention  RoPE and the attention core: only the fused q|k|v projection output is kept

Recomputed forwards must not count expert loads twice: `checkpointed` switches the routers of the
replayed region off while it replays.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_lc.config.choices import RecomputeItem, RecomputePolicy, names

POLICIES = names(RecomputePolicy)
SELECTIVE_ITEMS = names(RecomputeItem)


@contextmanager
def _routers_muted(module: nn.Module | None):
    routers = [m for m in module.modules() if hasattr(m, "count_loads")] if module is not None else []
    saved = [r.count_loads for r in routers]
    for r in routers:
        r.count_loads = False
    try:
        yield
    finally:
        for r, flag in zip(routers, saved):
            r.count_loads = flag


def checkpointed(fn, *args, owner: nn.Module | None = None):
    """fn(*args) whose activations are recomputed in backward (non-reentrant checkpoint). The replay
    runs with `owner`'s routers muted so expert loads are counted once."""
    calls = [0]

    def run(*a):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        with _routers_muted(owner):
            return fn(*a)

    return checkpoint(run, *args, use_reentrant=False)


def recompute_from(source: torch.Tensor, output: torch.Tensor, remake, consumer, *args):
    """consumer(output, *args), where any copy of `output` the consumer's autograd saves is dropped
    and rebuilt as remake(source) in backward (saved-tensor hooks). `output` must be remake(source)."""
    ptr = output.untyped_storage().data_ptr()

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr:
            return ("recompute", t.shape, t.stride(), t.storage_offset())
        return t

    def unpack(packed):
        if isinstance(packed, tuple) and packed and packed[0] == "recompute":
            _, shape, stride, offset = packed
            with torch.no_grad():
                return remake(source).as_strided(shape, stride, offset)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(output, *args)


def apply_recompute(model: nn.Module, policy: str, selective: list[str] | tuple[str, ...] = ("norm", "swiglu")) -> None:
    """Set the recompute switches the model's modules read (blocks, norms, SwiGLUs, attention)."""
    from moe_lc.model.attention import Attention
    from moe_lc.model.ffn import SwiGLU
    from moe_lc.model.moe import RoutedExperts
    from moe_lc.model.norm import RMSNorm
    from moe_lc.model.transformer import Block

    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r} must be one of {POLICIES}")
    bad = [item for item in selective if item not in SELECTIVE_ITEMS]
    if bad:
        raise ValueError(f"recompute.selective items {bad} must be among {SELECTIVE_ITEMS}")
    items = set(selective) if policy == "selective" else set()
    for module in model.modules():
        if isinstance(module, Block):
            module.recompute_block = policy == "full"
        elif isinstance(module, RMSNorm):
            module.recompute = "norm" in items
        elif isinstance(module, (SwiGLU, RoutedExperts)):
            module.recompute = "swiglu" in items
        elif isinstance(module, Attention):
            module.recompute_core = "attention" in items
