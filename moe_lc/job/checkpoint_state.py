"""Reshardable checkpoint state: every tensor is saved as boxes of the full (single-device) tensor.

A rank holds pieces of each full tensor: its tensor/expert-parallel slice of a parameter (from the
parameter's placement), and its ZeRO-1 slice of the flat optimizer buffers (a contiguous flat range
that crosses parameter and row boundaries, or whole parameters where the update rule asks for them):
the fp32 master and each state tensor the rule declares (moe_lc/optim/rule.py). Both are described as rectangular boxes in the full
tensor's coordinates and handed to torch.distributed.checkpoint (DCP) as `Chunks`: DCP saves each
box once (identical boxes of replicas are deduplicated) and, at load, reads whatever saved boxes
overlap the boxes the *current* layout asks for. So a checkpoint saved under one layout (pp, dp, tp,
cp, ep, ZeRO group sizes) loads under any other, numerically, and without ever gathering a full
tensor on one rank. The boxes are views of the live buffers: a load writes straight into the
parameters and optimizer shards.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Parallelized, Shard
from moe_lc.parallel.zero.optimizer import ZeroOptimizer

Box = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the full tensor, the piece)


class Chunks(torch.Tensor):
    """A full tensor of `global_shape` of which this rank holds `boxes` (DCP's checkpointable
    protocol; the object itself has no storage and supports no other op)."""

    @staticmethod
    def __new__(cls, global_shape, boxes: list[Box], dtype: torch.dtype):
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=dtype)
        r._boxes = [(torch.Size(off), t) for off, t in boxes]
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"Chunks is a checkpoint container and supports no {func}")

    def __repr__(self) -> str:
        return f"Chunks(shape={tuple(self.shape)}, boxes={[(tuple(o), tuple(t.shape)) for o, t in self._boxes]})"

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                                                      properties=props, size=self.shape))
                for off, t in self._boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self._boxes:
            if off == index.offset:
                return t
        raise ValueError(f"no box at {index.offset} in {self!r}")

    def cloned(self) -> "Chunks":
        """A snapshot (for asynchronous saves: training may overwrite the live buffers meanwhile)."""
        return Chunks(self.shape, [(off, t.detach().clone()) for off, t in self._boxes], self.dtype)


# -- geometry -------------------------------------------------------------------------------------

def _place(offsets: list[int], sizes: list[int], placement: list[Shard], dims: ParallelDims,
           local_extent: int) -> list[tuple]:
    """Map a box of the local tensor into full coordinates, split where it crosses a section.
    Returns (full offsets, sizes, skip along the shard dim within the box) per piece."""
    if not placement:
        return [(tuple(offsets), tuple(sizes), 0)]
    if len(placement) > 1:
        raise NotImplementedError("checkpointing a parameter sharded twice is not supported")
    shard = placement[0]
    group, d = dims[shard.group], shard.dim
    sections = shard.sections or ((local_extent * group.size, group.size),)
    out, local_start, full_start = [], 0, 0
    for length, pieces in sections:
        piece = length // pieces
        index = group.rank * pieces // group.size
        lo, hi = max(offsets[d], local_start), min(offsets[d] + sizes[d], local_start + piece)
        if lo < hi:
            off, size = list(offsets), list(sizes)
            off[d] = full_start + index * piece + (lo - local_start)
            size[d] = hi - lo
            out.append((tuple(off), tuple(size), lo - offsets[d]))
        local_start += piece
        full_start += length
    return out


def tensor_boxes(local: torch.Tensor, placement: list[Shard], dims: ParallelDims) -> list[Box]:
    """The whole local tensor as boxes of the full tensor (views of `local`)."""
    return _boxes_of(local, [0] * local.dim(), list(local.shape), local, placement, dims)


def _boxes_of(data, offsets, sizes, local, placement, dims) -> list[Box]:
    """`data` (shaped `sizes`) sits at `offsets` in `local`: split and place it into full coordinates."""
    if not placement:
        return [(tuple(offsets), data)]
    d = placement[0].dim
    return [(full_off, data.narrow(d, skip, size[d]))
            for full_off, size, skip in _place(offsets, sizes, placement, dims, local.shape[d])]


def flat_range_boxes(shape: list[int], a: int, b: int) -> list[tuple[list[int], list[int], int]]:
    """Flat range [a, b) of a row-major tensor of `shape` as boxes (offsets, sizes, flat start), each
    contiguous in memory (full trailing dims): a partial row, whole rows, a partial row, recursively."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [([a], [b - a], a)]
    inner = math.prod(shape[1:])
    out = []
    head_end = min(b, -(-a // inner) * inner)
    if a % inner:  # partial first row
        row = a // inner
        for off, size, start in flat_range_boxes(shape[1:], a - row * inner, head_end - row * inner):
            out.append(([row] + off, [1] + size, start + row * inner))
        a = head_end
    if a < b and b - a >= inner:  # whole rows
        rows = (b - a) // inner
        out.append(([a // inner] + [0] * (len(shape) - 1), [rows] + list(shape[1:]), a))
        a += rows * inner
    if a < b:  # partial last row
        row = a // inner
        for off, size, start in flat_range_boxes(shape[1:], 0, b - row * inner):
            out.append(([row] + off, [1] + size, start + row * inner))
    return out


# -- model and optimizer state ------------------------------------------------------------------

def model_state(result: Parallelized, dims: ParallelDims) -> dict:
    """{name: Chunks} for parameters (by their placement), plain tensors for persistent buffers."""
    out = {}
    for name, value in result.module.state_dict(keep_vars=True).items():
        place = result.placements.get(name)
        if place is None:
            out[name] = value.detach()
            continue
        out[name] = Chunks(place.full_shape(value.shape, dims.groups), tensor_boxes(value.data, place.shards, dims),
                           value.dtype)
    return out


def optimizer_state(opt: ZeroOptimizer, result: Parallelized, dims: ParallelDims) -> dict:
    """{"step": n, "rule": name, "params": {name: {"master" | <the rule's state names> [| "ema"]: Chunks}}}:
    each rank's ZeRO-1 slices, as boxes of the full parameters. The state names are the ones the rule
    declares (`UpdateRule.states`: AdamW's exp_avg and exp_avg_sq, as in every earlier checkpoint)."""
    names = {id(p): (n, place) for n, p, place in result.named_parameters()}
    states: dict[str, dict] = {}
    if opt.ema is not None:
        opt.ema.wait()
    for i, shard in enumerate(opt.shards):
        bufs = [("master", shard.master), *shard.state.items()]
        if opt.ema is not None:  # the CPU EMA shard, boxed like the master it mirrors
            bufs.append(("ema", opt.ema.shards[i]))
        for key, buf in bufs:
            for p, boxes in _zero_boxes(shard, buf, dims, names).items():
                name, place = names[id(p)]
                states.setdefault(name, {})[key] = Chunks(place.full_shape(p.shape, dims.groups), boxes, buf.dtype)
    # parameters whose ZeRO slice on this rank is empty still need an entry on some rank: DCP only
    # needs every box on one rank, and every element of every parameter is owned by one ZeRO rank.
    return {"step": opt.step_count, "rule": opt.rule.name, "params": states}


def rule_resume_error(path, keys: set[str], saved_rule: str | None, opt: ZeroOptimizer) -> str | None:
    """Why the checkpoint at `path` (its `keys`; `saved_rule` its optim.rule, None in checkpoints written
    before rules were named: AdamW's) cannot resume this run's rule; None if it can."""
    saved_rule = saved_rule or "adamw"
    if saved_rule != opt.rule.name:
        return (f"{path} holds the optimizer state of train.optimizer={saved_rule!r}, not {opt.rule.name!r}: "
                f"resume with train.optimizer={saved_rule!r}, or start from its weights (checkpoint.init_from)")
    saved = {k.rsplit(".", 1)[-1] for k in keys if k.startswith("optim.params.")}
    missing = [s.name for s in opt.rule.states() if s.name not in saved]
    if missing:
        return (f"{path} holds no {', '.join(missing)} for train.optimizer={saved_rule!r} (saved with other "
                "settings of the rule); start from its weights (checkpoint.init_from)")
    return None


def _zero_boxes(shard, buf: torch.Tensor, dims: ParallelDims, names: dict) -> dict:
    """{param: [boxes]} of this rank's slice of a (P/N,) optimizer buffer."""
    out: dict = {}
    for b in shard.buckets:
        own_lo = b.start + shard.group.rank * b.shard_size
        own_hi = own_lo + b.shard_size
        shard_base = b.shard_start - own_lo  # flat buffer index -> index in `buf`
        for p, off in b.params:
            lo, hi = max(off, own_lo), min(off + p.numel(), own_hi)
            if lo >= hi:
                continue
            shards = names[id(p)][1].shards
            for l_off, l_size, flat_start in flat_range_boxes(list(p.shape), lo - off, hi - off):
                start = shard_base + off + flat_start
                data = buf[start:start + math.prod(l_size)].view(l_size)
                out.setdefault(p, []).extend(_boxes_of(data, l_off, l_size, p, shards, dims))
    return out
