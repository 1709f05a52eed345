"""Activation recomputation: trade compute for activation memory, on torch.utils.checkpoint.

Policies (`[recompute] policy`), plugged into the model's seams (moe_lc/model/seams.py: `replay`,
`activation`, `logits`, `attend`) by the layer plan (moe_lc/parallel/layer_plan.py, which holds the
rules; this file holds the pieces, and the model never imports it):
    none       every activation autograd wants is kept, but for what a fused kernel would not keep
               either: an RMSNorm keeps its compute-dtype input (not its fp32 intermediates), a SwiGLU
               its gate|up (not silu(gate)) and the router its compute-dtype input (not the fp32 copy its
               gate reads), their elementwise math replayed in backward (bit-identical)
    full       each block keeps only its input (mHC's widened stream, (B, S, N, D)); its whole forward,
               all-to-alls included, is replayed in backward, as Megatron-LM's full recomputation does
               (DualPipe(V), which interleaves two micro-batches' block phases, keeps each phase's inputs
               instead: the layer plan's `replay_each_phase`)
    selective  only cheap, memory-heavy pieces are replayed (`[recompute] selective`):
                 norm       RMSNorm's fp32 intermediates: every policy keeps only a norm's
                            compute-dtype input and replay its fp32 math in backward (a fused norm kernel
                            keeps that input and the per-row rstd); the item changes nothing and stays so
                            that recipes naming it (Megatron-LM's `layernorm` module) run unchanged
                 swiglu     the SwiGLU output: kept neither by the activation nor by the down
                            projection, recomputed from the cached gate|up (DeepSeek-V3's trick)
                 attention  RoPE and the attention core: GQA keeps the fused q|k|v projection output;
                            MLA keeps q, [k_nope | v] and the one roped key k_r
                 mla_up     MLA's latent norms, up-projections and RoPE: only the latents stay, the
                            core's q, k, v are rebuilt from them (the core itself is not replayed;
                            with "attention" too, MLA takes this path)
                 router     the fp32 copy of the router's input (its gate runs in fp32), rebuilt
                            from the compute-dtype input, which the experts keep anyway: done under
                            none and selective alike (an exact upcast), so the item changes nothing

Recomputed forwards must not count expert loads twice: under "full" a block's replay runs its router
again in backward, with the phase state (`ctx`) of the forward it replays; the router's `count_loads`
seam `first_forward` books the first run of each micro-batch's forward only (the layer plan's rule).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_lc.config.choices import RecomputeItem, RecomputePolicy, names
from moe_lc.model.ffn import swiglu, swiglu_then
from moe_lc.model.mla import attend
from moe_lc.model.rope import apply_rope
from moe_lc.model.moe import fp32_logits
from moe_lc.model.saved_tensors import recompute_from
from moe_lc.model.seams import run_now

POLICIES = names(RecomputePolicy)
SELECTIVE_ITEMS = names(RecomputeItem)


def checkpointed(fn, *args):
    """fn(*args) whose activations are recomputed in backward (non-reentrant checkpoint). Without grad:
    fn(*args)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def first_forward(ctx: dict) -> bool:
    """The router's `count_loads` seam under full recomputation: True on the first run of a micro-batch's
    MoE phases (`ctx`, the phase state a block's forward makes once and its replays reuse), False in
    the replays, so that each micro-batch's routing is booked once."""
    first = "counted" not in ctx
    ctx["counted"] = True
    return first


class _KeepingInputs(torch.autograd.Function):
    """fn(*tensors) keeping only its input tensors, through autograd's saved tensors (so offload, FP8
    caching, recomputation and the memory tools see them as they see any saved tensor), and running fn
    again in backward for its gradients: the same ops on the same values, so the same bits. fn takes no
    parameter (their gradients would not reach them)."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        return fn(*tensors)

    @staticmethod
    def backward(ctx, grad):
        tensors = [t.detach().requires_grad_(need) if t is not None else None
                   for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        wanted = [t for t in tensors if t is not None and t.requires_grad]
        with torch.enable_grad():
            out = ctx.fn(*tensors)
        found = iter(torch.autograd.grad(out, wanted, grad))
        return (None, *(next(found) if t is not None and t.requires_grad else None for t in tensors))


def swiglu_keeping_input(down, gate_up: torch.Tensor, *args, weight: torch.Tensor | None = None,
                         run_region=run_now) -> torch.Tensor:
    """The `activation` seam without recomputation: down(swiglu(gate_up, weight), *args) where the
    activation keeps only gate_up (and the gate weights), as a fused SwiGLU kernel does: silu(gate) is
    made again in backward instead of kept beside gate and up (1/3 of the activation's bytes). The down
    projection keeps its input as ever. A compiled region (train.compile) keeps what its compiler's
    partition keeps, which is gate_up too."""
    if not torch.is_grad_enabled() or run_region is not run_now:
        return swiglu_then(down, gate_up, *args, weight=weight, run_region=run_region)
    h = _KeepingInputs.apply(lambda g, w: run_region(swiglu, g, w), gate_up, weight)
    return down(h, *args)


def swiglu_replayed(down, gate_up: torch.Tensor, *args, weight: torch.Tensor | None = None,
                    run_region=run_now) -> torch.Tensor:
    """The `activation` seam under selective "swiglu": down(swiglu(gate_up, weight), *args) keeping only
    gate_up (and the gate weights) for backward: the activation is checkpointed and the copy `down` would
    save is rebuilt from them."""
    if not torch.is_grad_enabled():
        return swiglu_then(down, gate_up, *args, weight=weight, run_region=run_region)
    if weight is None:
        h = checkpointed(run_region, swiglu, gate_up)
        return recompute_from(gate_up, h, lambda g: run_region(swiglu, g), down, *args)
    h = checkpointed(run_region, swiglu, gate_up, weight)
    return recompute_from((gate_up, weight), (h,), lambda g, w: (run_region(swiglu, g, w),), down, *args)


def mla_up_replayed(mla: nn.Module, q_src, c_kv, k_r, cos, sin, docs=None) -> torch.Tensor:
    """The `attend` seam of an MLAttention (the "mla" kind's, moe_lc/config/attention_kinds.py) on one device
    or on the expanded ring, under selective "mla_up" (DeepSeek-V3 3.2.2: recompute RMSNorm and the MLA
    up-projections in backward): only the latents (c_q or q, c_kv, k_r) stay for backward; the
    latent norms, up-projections and RoPE are checkpointed, and the core's saved q, k, v are rebuilt
    from the latents when its backward needs them. The core's output and LSE are kept (its forward is
    not repeated); the up-projections run twice in backward (once per consumer)."""
    if not torch.is_grad_enabled():
        return attend(mla, q_src, c_kv, k_r, cos, sin, docs)

    def qkv(q_src, c_kv, k_r):
        B, S, _ = c_kv.shape
        q, kv = mla.up_project(q_src, c_kv)
        return mla.rope_qkv(q, kv, mla.run_region(apply_rope, k_r.view(B, S, 1, mla.rope_dim), cos, sin), cos, sin)

    q, k, v = checkpoint(qkv, q_src, c_kv, k_r, use_reentrant=False)
    return recompute_from((q_src, c_kv, k_r), (q, k, v), qkv, mla.core, mla.softmax_scale, docs)


def fp32_logits_replayed(gate, x_TD: torch.Tensor) -> torch.Tensor:
    """The router's `logits` seam but under full recomputation: gate(x.float()) whose saved fp32 copy of x is
    dropped and rebuilt from x (an exact upcast) when the gate's backward needs it."""
    if not torch.is_grad_enabled() or x_TD.dtype == torch.float32:
        return fp32_logits(gate, x_TD)
    return recompute_from(x_TD, x_TD.float(), lambda t: t.float(), gate)
