"""Saved-activation bytes of one micro-batch on one rank: traced from the model code, and measured.

Nothing here describes the model: each block kind's bytes come from tracing one block of that kind
forward on the meta device (tools/planner/block_trace.py), the model built as the trainer builds it for the
recipe's layout, precision, recompute policy and FP8 caching. A stage of one micro-batch keeps

    layers   the bytes of each of its blocks' kind ("dense" or "moe"; DeepSeek-V4's also by attention layer
             type and hash routing: `block_trace.block_kind`)
    embed    on the first stage: what the embedding keeps (token ids; vocab-parallel masks under TP)
    rope     the cos / sin tables the blocks keep (once per micro-batch)
    head     on the last stage: final norm, output head, loss and the MTP modules (blocks included)

Recompute policies (moe_lc/model/recompute.py) and FP8 caching (moe_lc/model/fp8_cache.py) are the
recipe's, or another policy to plan for (`stage_estimate(..., policy=)`): the traced model then runs
with that policy, so whatever the code keeps under it is what is counted. `recompute_working`, the
transient of backward re-creating one block's recomputed pieces, is what the block keeps under policy
"none" but not under the policy (`_dropped`), both traced without FP8 caching (the savings of an FP8
copy are not re-created; the FP8 "swiglu" cache replays the SwiGLU output as selective "swiglu" does).

`measure_saved_bytes` counts the same on a real forward of a CPU model (tests/test_plan.py holds the
traced figures to it, byte for byte).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable

import torch
from torch import nn

from moe_lc.model.residual_stream import HyperConnection

from moe_lc.config import Config, ModelConfig, ParallelConfig, PrecisionConfig, RecomputeConfig, TrainConfig
from moe_lc.config.choices import RecomputePolicy, names
from .block_trace import TracedParts, block_kind, trace_parts
from ..dry_run.trace import held_checkpoint_inputs

__all__ = ["CHECKED", "POLICIES", "UNCHECKED", "ActivationEstimate", "estimate", "held_checkpoint_inputs",
           "measure_saved_bytes", "policy_config", "recipe_config", "stage_estimate"]

POLICIES = names(RecomputePolicy)
CHECKED = "traced, equal to a measured forward (tests/test_plan.py)"
UNCHECKED = "traced with balanced routing or walked through the pipeline schedule (held to tools/dryrun.py)"


@dataclass
class ActivationEstimate:
    """Saved-activation bytes of one micro-batch on one rank (one pipeline stage): per block id, and
    outside the blocks; `tensors`: what each part keeps, [(bytes, what)] by part (plan.py --terms)."""

    layers: dict[int, float]
    embed: float
    rope: float
    head: float
    status: str
    tensors: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    working: Callable[[], float] = lambda: 0.0  # see `recompute_working`
    host_layers: dict[int, float] = field(default_factory=dict)  # per block id: bytes train.offload puts on the host

    def on_host(self) -> "ActivationEstimate":
        """The same micro-batch's host bytes (train.offload) as an estimate of their own, for the schedule walk."""
        return ActivationEstimate(dict(self.host_layers), 0.0, 0.0, 0.0, self.status)

    @property
    def total(self) -> float:
        return sum(self.layers.values()) + self.embed + self.rope + self.head

    @cached_property
    def recompute_working(self) -> float:
        """Transient upper bound: one block's recomputed pieces, re-created in backward (traced on demand)."""
        return self.working()


def policy_config(cfg: Config, policy: str | None = None, fp8_cache: bool = True) -> Config:
    """cfg planned under recompute `policy` (None: its own), without its FP8 cache when not `fp8_cache`."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r} must be one of {', '.join(POLICIES)}")
    out = cfg if policy is None else cfg.replace(recompute=RecomputeConfig(policy, list(cfg.recompute.selective)))
    if not fp8_cache and cfg.precision.fp8_cache:
        out = out.replace(precision=replace(cfg.precision, fp8_cache=[]))
    return out


def replay_working(cfg: Config, loss_mask: bool = False) -> dict[str, float]:
    """{block kind: bytes backward re-creates for one block} under cfg's policy (module docstring)."""
    r = cfg.recompute
    if "swiglu" in cfg.precision.fp8_cache and r.policy != "full":
        items = (list(r.selective) if r.policy == "selective" else []) + ["swiglu"]
        cfg = cfg.replace(recompute=RecomputeConfig("selective", items))
    kept = trace_parts(policy_config(cfg, fp8_cache=False), loss_mask, head=False)
    none = trace_parts(policy_config(cfg, "none", fp8_cache=False), loss_mask, head=False)
    kinds = {block_kind(cfg.model, i) for i in range(cfg.model.n_layers)}
    return {kind: float(_dropped(none.tensors.get(kind, []), kept.tensors.get(kind, []))) for kind in kinds}


def _dropped(none: list[tuple[int, str]], kept: list[tuple[int, str]]) -> int:
    """Bytes of the tensors a block keeps under policy "none" but not under the policy: what its backward
    re-creates. Tensors are matched by what they are (saving module, op, dtype) and their storage's bytes
    (a view's shape depends on which op saved it first); the replays' inputs, which only the policy
    keeps, re-create nothing. A replay's inputs named by no module ("<part> replay inputs") match as the
    part's phases' tensors ("<part> phases")."""
    def key(nbytes: int, what: str) -> tuple[str, int]:
        return what.split("[")[0].replace(" replay inputs: ", " phases: ", 1), nbytes

    left = Counter(key(nbytes, what) for nbytes, what in kept)
    total = 0
    for nbytes, what in none:
        if left[key(nbytes, what)]:
            left[key(nbytes, what)] -= 1
        else:
            total += nbytes
    return total


def stage_estimate(cfg: Config, layers=None, first_stage: bool = True, last_stage: bool = True,
                   loss_mask: bool | None = None, policy: str | None = None) -> ActivationEstimate:
    """The saved bytes of one micro-batch through the blocks `layers` (default all) of cfg's model on
    one rank of cfg's layout, with the embedding (`first_stage`) and head (`last_stage`); under recompute
    `policy` (None: the recipe's). loss_mask: the data carry a loss mask (None: cfg.data says)."""
    cfg = policy_config(cfg, policy)
    mask = cfg.data.has_loss_mask if loss_mask is None else loss_mask
    traced: TracedParts = trace_parts(cfg, mask)
    m = cfg.model
    layers = range(m.n_layers) if layers is None else layers
    kinds = {block_kind(m, i) for i in layers}
    per_layer = {i: float(traced.block(block_kind(m, i))) for i in layers}
    parts = [p for p, keep in (("embed", first_stage), ("rope", True), *((k, True) for k in sorted(kinds)),
                               ("head", last_stage)) if keep]
    return ActivationEstimate(per_layer, float(traced.saved["embed"]) if first_stage else 0.0,
                              float(traced.saved["rope"]), float(traced.saved["head"]) if last_stage else 0.0,
                              CHECKED, {p: traced.tensors.get(p, []) for p in parts},
                              lambda: max((replay_working(cfg, mask)[k] for k in kinds), default=0.0),
                              {i: float(traced.host.get(block_kind(m, i), 0)) for i in layers})


def recipe_config(m: ModelConfig, micro_batch: int, seq_len: int, compute_bytes: int, *, policy: str = "none",
                  selective=("norm", "swiglu"), tp: int = 1, cp: int = 1, fp8_cache=()) -> Config:
    """A config for `m` alone: fp32 (compute_bytes 4), bf16, or fp8 GEMMs where the FP8 cache holds
    Linear inputs ("linear"; emulated GEMMs, as on a CPU: what is kept does not depend on the kernel)."""
    recipe = "fp32" if compute_bytes == 4 else "fp8" if "linear" in fp8_cache else "bf16"
    return Config(model=m, parallel=ParallelConfig(dp=1, tp=tp, cp=cp),
                  precision=PrecisionConfig(recipe=recipe, fp8_backend="emulate", fp8_cache=list(fp8_cache)),
                  recompute=RecomputeConfig(policy, list(selective)),
                  train=TrainConfig(micro_batch=micro_batch, seq_len=seq_len, global_batch=micro_batch))


def estimate(m: ModelConfig, micro_batch: int, seq_len: int, compute_bytes: int, *, policy: str = "none",
             selective=("norm", "swiglu"), tp: int = 1, sequence_parallel: bool = True, cp: int = 1,
             loss_mask: bool = False, layers=None, first_stage: bool = True,
             last_stage: bool = True, fp8_cache=()) -> ActivationEstimate:
    """`stage_estimate` of model `m` alone (`recipe_config`): micro_batch sequences of seq_len tokens (the
    full sequence; cp divides it), on tp x cp ranks (tensor parallelism runs with sequence parallelism:
    the only way moe_lc runs it), under `policy` and the precision.fp8_cache items `fp8_cache`."""
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r} must be one of {', '.join(POLICIES)}")
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp={cp}")
    if not sequence_parallel and tp > 1:
        raise ValueError("tensor parallelism without sequence parallelism is not a layout moe_lc runs")
    cfg = recipe_config(m, micro_batch, seq_len, compute_bytes, policy=policy, selective=selective, tp=tp, cp=cp,
                        fp8_cache=fp8_cache)
    return stage_estimate(cfg, layers, first_stage, last_stage, loss_mask)


# ---------------------------------------------------------------------------------------------
# measurement


def measure_saved_bytes(model: nn.Module, forward: Callable[[], object]) -> dict[str, int]:
    """Run `forward()` (which calls `model`) under saved-tensor hooks and count the unique storage
    bytes autograd keeps, parameters excluded, plus the inputs held by non-reentrant checkpoints
    (recomputation). Each storage is attributed to the part that saved it first: "layer<i>"
    (model.layers[i], mHC's maps around its sublayers included), "rope" (the cos/sin tables), "embed" (before the
    first block), "head" (the stream's read-out, final norm, head and loss); a checkpointed call's inputs are
    claimed by the part whose module it runs first. A storage that dies before the forward ends was not kept
    (a checkpoint's inputs inside another's forward). Returns {part: bytes}."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owner: dict[int, tuple[str, int]] = {}
    where = ["embed"]

    pending: list[torch.Tensor] = []  # checkpoint inputs, claimed by the first module the checkpoint runs

    def enter(part: str):
        def hook(*args):
            where[0] = part
            while pending:
                claim(pending.pop(), part)
        return hook

    # Every module of block i marks "layer<i>" when it runs, so the tagging does not depend on how the
    # model sequences its blocks (plain calls or pipeline phases).
    parts = [(f"layer{name}", blk) for name, blk in model.layers.items()]
    heads = ("stream_head", "norm", "head", "loss_fn")
    parts += [("head", mod) for mod in (getattr(model, name, None) for name in heads) if mod is not None]
    handles = [sub.register_forward_pre_hook(enter(part)) for part, mod in parts for sub in mod.modules()]
    streams = [(part, sub) for part, mod in parts for sub in mod.modules() if isinstance(sub, HyperConnection)]
    for part, sub in streams:  # mHC's split / merge run outside forward: they mark their block too
        for method in ("split", "merge"):
            setattr(sub, method, _marking(getattr(sub, method), enter(part)))

    def claim(t: torch.Tensor, part: str) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in params and storage.data_ptr() not in owner:
            owner[storage.data_ptr()] = (part, storage.nbytes())
            weakref.finalize(storage, owner.pop, storage.data_ptr(), None)

    def claim_rope(module, args, out) -> None:
        for t in out:
            claim(t, "rope")

    if getattr(model, "rope", None) is not None:
        handles.append(model.rope.register_forward_hook(claim_rope))

    def pack(t: torch.Tensor) -> torch.Tensor:
        # the checkpoint saves its own inputs (under our hook) before it runs: leave those to `enter`
        if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in pending):
            claim(t, where[0])
        return t

    try:
        with held_checkpoint_inputs(pending.append), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()  # (held while counting: its graph keeps what is saved)
        for t in pending:
            claim(t, where[0])
        totals: dict[str, int] = {}
        for part, nbytes in owner.values():
            totals[part] = totals.get(part, 0) + nbytes
        del out
    finally:
        for h in handles:
            h.remove()
        for _, sub in streams:
            del sub.split, sub.merge  # (the instance attributes: the class's methods again)
    return totals


def _marking(fn, mark):
    """fn, calling mark() before it runs."""
    def run(*args):
        mark()
        return fn(*args)
    return run
