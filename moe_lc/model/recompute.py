"""Activation recomputation: trade compute for activation memory, on torch.utils.checkpoint.

Policies (`[recompute] policy`), applied from outside by `apply_recompute` through the model's seams
(moe_lc/model/seams.py: `replay` and `activation`; the model never imports this file):
    none       every activation autograd wants is kept
    full       each block keeps only its input; its forward is replayed in backward (a pipeline that
               runs blocks phase by phase keeps each phase's inputs instead)
    selective  only cheap, memory-heavy pieces are replayed (`[recompute] selective`):
                 norm       RMSNorm's fp32 intermediates
                 swiglu     the SwiGLU output: kept neither by the activation nor by the down
                            projection, recomputed from the cached gate|up (DeepSeek-V3's trick)
                 attention  RoPE and the attention core: GQA keeps the fused q|k|v projection output;
                            MLA keeps q, [k_nope | v] and the one roped key k_r

Recomputed forwards must not count expert loads twice: `checkpointed` switches the routers of the
replayed region off while it replays.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_lc.config.choices import RecomputeItem, RecomputePolicy, names
from moe_lc.model.attention import Attention
from moe_lc.model.block import Block
from moe_lc.model.ffn import SwiGLU, swiglu, swiglu_then
from moe_lc.model.mla import MLAttention
from moe_lc.model.moe import RoutedExperts
from moe_lc.model.norm import RMSNorm
from moe_lc.model.seams import run_now

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
    runs with `owner`'s routers muted so expert loads are counted once. Without grad: fn(*args)."""
    if not torch.is_grad_enabled():
        return fn(*args)
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
    # the storage's identity, not its data_ptr: on the meta device (the dry run) every data_ptr is 0
    storage = output.untyped_storage()._cdata

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata == storage:
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


def swiglu_replayed(down, gate_up: torch.Tensor, *args) -> torch.Tensor:
    """The `activation` seam under selective "swiglu": down(swiglu(gate_up), *args) keeping only gate_up
    for backward: the activation is checkpointed and the copy `down` would save is rebuilt from gate_up."""
    if not torch.is_grad_enabled():
        return swiglu_then(down, gate_up, *args)
    h = checkpointed(swiglu, gate_up)
    return recompute_from(gate_up, h, swiglu, down, *args)


def apply_recompute(model: nn.Module, policy: str, selective: list[str] | tuple[str, ...] = ("norm", "swiglu")) -> None:
    """Plug recomputation into the model's seams: `replay` of blocks (full), norms ("norm") and attention
    modules ("attention", GQA and MLA); `activation` of SwiGLUs and routed experts ("swiglu").
    Policy "none" puts the plain defaults back."""
    assert policy in POLICIES and set(selective) <= set(SELECTIVE_ITEMS), "checked by the recipe's rules"
    items = set(selective) if policy == "selective" else set()
    for module in model.modules():
        if isinstance(module, Block):
            module.replay = partial(checkpointed, owner=module) if policy == "full" else run_now
        elif isinstance(module, RMSNorm):
            module.replay = checkpointed if "norm" in items else run_now
        elif isinstance(module, (SwiGLU, RoutedExperts)):
            module.activation = swiglu_replayed if "swiglu" in items else swiglu_then
        elif isinstance(module, (Attention, MLAttention)):
            module.replay = checkpointed if "attention" in items else run_now
