"""One training step on the meta device, watched op by op: the machinery behind tools/dryrun.py.

Meta tensors have shapes and dtypes but no data, so a step of a 671B model's rank costs no memory.
Three things make the trainer's own code run on them unchanged, and a fourth fast (`StepTracer`, a
TorchDispatchMode):

  shadows     small tensors (<= SHADOW_LIMIT elements) whose inputs are all known carry their real
              values on the CPU beside them: token ids, routing choices, counts, split sizes.
              Ops the meta device cannot size (nonzero, repeat_interleave without output_size)
              take their shapes from the shadow. Collectives give shadows the values they would
              have if every rank held the same data (an all-reduce sum is size x the input).
  host reads  `.item()`, `.tolist()`, `.cpu()` of a meta tensor answer from its shadow (or 1 when
              it has none: a loss, a norm) and are recorded with the line of moe_lc that asked:
              each is a device-to-host sync on a GPU.
  memory      every storage a meta op creates is counted from creation until Python frees it,
              in a category: parameters / gradients / optimizer (the ZeRO buffers, labelled
              after the build), saved activations (packed by autograd's saved-tensor hooks),
              transients (the rest). The peak is kept with its breakdown.
  kernels     an op without values that makes fresh tensors runs its meta kernel (many are Python:
              torch._refs) once per inputs' metadata and other arguments; a repeat gets new empty
              tensors of the outputs' shapes (tools/dry_run/meta_kernels.py): layers, ring steps and micro-batches repeat.

Routing needs one more stand-in: a router's top-k on data-free scores has no values, so the dry run
gives each router a balanced choice (`balanced_select`): every expert receives the same number of
token copies and each token reaches `topk_groups` groups, the load an ideal balancing achieves.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from moe_lc.parallel.pipeline.overlap import PhasedRun
from .meta_kernels import MetaKernels

aten = torch.ops.aten
SHADOW_LIMIT = 1 << 21
CATEGORIES = ("params", "grads", "optimizer", "saved", "transients", "buffers")
# NCCL's types (ncclDataType_t; torch maps bool to uint8); a collective on anything else fails on GPUs
NCCL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2}
_MOE_LC = str(Path(__file__).resolve().parents[2] / "moe_lc")
_UNINITIALIZED = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                  aten.new_empty_strided.default, aten.empty_like.default}
_HOST_SCALAR = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}


def balanced_select(scores_TE, bias_E, n_groups: int, topk_groups: int, topk: int, group_score: str = ""):
    """The router seam of a dry run -> idx (T, K). Token t takes the g = topk_groups groups
    (t*g + j) mod G, j < g, of the G groups (so successive tokens sweep the groups evenly), and in each
    the next K/g experts of that group in turn (the group's (t*g // G)-th visit): every expert gets the
    same load (when T*K is a multiple of E and G of g) and every token's experts lie in g groups."""
    T, E = scores_TE.shape
    grouped = n_groups > 1 and topk_groups < n_groups and topk % topk_groups == 0
    G, g = (n_groups, topk_groups) if grouped else (1, 1)
    per, per_visit = E // G, topk // g
    t = torch.arange(T, device=scores_TE.device).unsqueeze(1)
    k = torch.arange(topk, device=scores_TE.device).unsqueeze(0)
    group = (t * g + k % g) % G
    return group * per + ((t * g // G) * per_visit + k // g) % per


def position_priority(cfg):
    """cfg with an expert capacity's drop_policy "position": a traced router's affinities hold no values,
    so "probability" has nothing to sort by (the kept copies' counts would be lost); every policy keeps
    min(copies, capacity) of each expert, so the traced bytes and shapes are the same (only which tokens
    keep their copies differs)."""
    moe = cfg.model.moe
    if moe.capacity_factor <= 0 or moe.drop_policy == "position":
        return cfg
    return replace(cfg, model=replace(cfg.model, moe=replace(moe, drop_policy="position")))


class MemoryTracker:
    """Live bytes of meta storages by category, and the peak with its breakdown. Category "host" (the
    offloaded optimizer's state, what its CPU update allocates: `on_host`) is host memory: counted in
    `now` and `most`, never in the device's total or peak."""

    def __init__(self):
        self.category = "transients"  # what a fresh storage counts as (`on_host` switches it)
        self.live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes, category]
        self.now = Counter()
        self.total = self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.most = Counter()  # the most each category held at once
        self.top_transients: list[tuple[int, str]] = []  # (bytes, what) of the largest, near the peak
        self._described = 0

    def track(self, t: torch.Tensor, made_by: str = "") -> None:
        st = t.untyped_storage()
        key = id(st)
        entry = self.live.get(key)
        if entry is not None and entry[0]() is st:
            return
        n = st.nbytes()
        self.live[key] = [weakref.ref(st), n, self.category, f"{made_by} {str(t.dtype)[6:]}{list(t.shape)}"]
        weakref.finalize(st, self._free, key)
        self.now[self.category] += n
        if self.category == "host":
            self.most["host"] = max(self.most["host"], self.now["host"])
            return
        self.total += n
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.now)
            if self.total > 1.01 * self._described:  # what the transients are (not at every new byte)
                self._described = self.total
                self.top_transients = sorted(((e[1], e[3]) for e in self.live.values() if e[2] == "transients"),
                                             reverse=True)[:6]

    def resized(self, t: torch.Tensor) -> None:
        """t's storage was resized in place (ZeRO-3's gathered buckets, moe_lc/parallel/zero/param_gather.py)."""
        entry = self.live.get(id(t.untyped_storage()))
        if entry is None or t.device.type != "meta":
            return
        delta, entry[1] = t.untyped_storage().nbytes() - entry[1], t.untyped_storage().nbytes()
        self.now[entry[2]] += delta
        self.most[entry[2]] = max(self.most[entry[2]], self.now[entry[2]])
        if entry[2] == "host":
            return
        self.total += delta
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.now)

    def _free(self, key: int) -> None:
        _, n, cat, _ = self.live.pop(key)
        self.now[cat] -= n
        self.total -= 0 if cat == "host" else n

    @contextlib.contextmanager
    def on_host(self):
        """Within: fresh storages are host memory (moe_lc/parallel/memory/trace_hooks.py's `host_work`)."""
        before, self.category = self.category, "host"
        try:
            yield
        finally:
            self.category = before

    def label(self, t: torch.Tensor, category: str, only_from: str | None = None) -> None:
        """Move t's storage into `category` (from `only_from` only, when given)."""
        if t.device.type != "meta":
            return
        self.track(t, "?")
        entry = self.live[id(t.untyped_storage())]
        if entry[2] == category or (only_from is not None and entry[2] != only_from):
            return
        self.now[entry[2]] -= entry[1]
        self.now[category] += entry[1]
        self.total += ((entry[2] == "host") - (category == "host")) * entry[1]  # into or out of host memory
        entry[2] = category
        self.most[category] = max(self.most[category], self.now[category])

    def label_all_live(self, category: str, only_from: str = "transients") -> None:
        for entry in self.live.values():
            if entry[2] == only_from:
                self.now[only_from] -= entry[1]
                self.now[category] += entry[1]
                entry[2] = category

    def reset_peak(self) -> None:
        """Forget the peaks so far (the build's): from here on the step's."""
        self.peak, self.at_peak = self.total, dict(self.now)
        self.most = Counter(self.now)
        self._described, self.top_transients = 0, []


def _call_site() -> str:
    """The innermost moe_lc line on the stack (what asked for a host read)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_MOE_LC):
            return f"{path[len(_MOE_LC) - len('moe_lc'):]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "<outside moe_lc>"


def _meta_tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor) and x.device.type == "meta"]


class StepTracer(TorchDispatchMode):
    """Shadows, host reads and memory of meta ops (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.shadows = WeakTensorKeyDictionary()
        self.memory = MemoryTracker()
        self.host_reads: Counter = Counter()  # call site -> count
        self.problems: list[str] = []  # what would fail on GPUs (dtypes NCCL lacks)
        self.ops = 0

    # -- helpers -------------------------------------------------------------------------------
    def _to_shadow(self, x):
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            return self.shadows[x]
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def _host_value(self, t: torch.Tensor) -> torch.Tensor:
        """t's CPU value: its shadow, else ones (a loss or a norm reads as 1: finite, steps go on)."""
        shadow = self.shadows.get(t)
        return shadow.clone() if shadow is not None else torch.ones(t.shape, dtype=t.dtype)

    # -- the dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func.namespace == "c10d":
            return self._collective(func, args, kwargs)
        if func in _HOST_SCALAR and _meta_tensors(args):
            self.host_reads[_call_site()] += 1
            return func(*tree_map(lambda x: self._host_value(x) if isinstance(x, torch.Tensor) else x, args))
        if func in (aten._to_copy.default, aten.copy_.default) and self._leaves_meta(func, args, kwargs):
            blocking = not (kwargs.get("non_blocking") or (func is aten.copy_.default and len(args) > 2 and args[2]))
            if blocking:  # a non-blocking copy (into pinned memory) does not wait for the device
                self.host_reads[_call_site()] += 1
            if func is aten.copy_.default:
                return args[0].copy_(self._host_value(args[1]))
            return self._host_value(args[0]).to(kwargs.get("dtype") or args[0].dtype)

        inputs = _meta_tensors((args, kwargs))
        known = all(t in self.shadows for t in inputs)
        if not known:  # no values to carry: the outputs' metadata is all there is (`MetaKernels`)
            return self._unknown_values(func, args, kwargs)
        try:
            out, failed = func(*args, **kwargs), None
        except (NotImplementedError, RuntimeError) as exc:  # a shape that depends on data
            out, failed = None, exc
        outs = _meta_tensors(out)
        if failed is None and not outs:
            return out
        if known and (failed is not None or all(t.numel() <= SHADOW_LIMIT for t in outs)):
            cpu_out = func(*tree_map(self._to_shadow, args), **tree_map(self._to_shadow, kwargs))
            if func in _UNINITIALIZED:  # known to be anything: zeros, not garbage that reads as NaN
                cpu_out.zero_()
            if failed is not None:
                out = tree_map(lambda c: torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device="meta")
                               if isinstance(c, torch.Tensor) else c, cpu_out)
            meta_leaves, _ = tree_flatten(out)
            for m, c in zip(meta_leaves, tree_flatten(cpu_out)[0]):
                if isinstance(m, torch.Tensor) and m.device.type == "meta":
                    if m.dtype != c.dtype or m.shape != c.shape:
                        raise AssertionError(f"dry trace: {func} gives {m.dtype}{tuple(m.shape)} on meta but "
                                             f"{c.dtype}{tuple(c.shape)} on the CPU")
                    self.shadows[m] = c
            outs = _meta_tensors(out)
        elif failed is not None:
            raise failed
        for t in outs:
            self.memory.track(t, func.__name__)
        return out

    def _unknown_values(self, func, args, kwargs):
        """An op on tensors of which some carry no values: run it on meta (its outputs' metadata from
        `MetaKernels` when it makes fresh tensors it was seen making before); what it writes loses its shadow."""
        out = MetaKernels.made(func, args, kwargs)
        if func._schema.is_mutable:  # written with unknown values: its shadow is stale
            for arg, value in zip(func._schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                    self.shadows.pop(value, None)
        for t in _meta_tensors(out):
            self.memory.track(t, func.__name__)
        return out

    @staticmethod
    def _leaves_meta(func, args, kwargs) -> bool:
        if func is aten.copy_.default:
            return args[0].device.type != "meta" and args[1].device.type == "meta"
        device = kwargs.get("device")
        return args[0].device.type == "meta" and device is not None and torch.device(device).type != "meta"

    # -- collectives ----------------------------------------------------------------------------
    def _collective(self, func, args, kwargs):
        """Run the fake collective; give its outputs the shadows of a world where every rank holds the
        same data; record dtypes NCCL lacks."""
        name = func._schema.name.split("::")[-1]
        for t in _meta_tensors(args):
            if t.dtype not in NCCL_DTYPES:
                self.problems.append(f"{name} of a {t.dtype} tensor: NCCL has no such type ({_call_site()})")
        out = func(*args, **kwargs)
        pg = next((a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
        pg = torch.distributed.ProcessGroup.unbox(pg) if pg is not None else None
        size, rank = (pg.size(), pg.rank()) if pg is not None else (1, 0)
        get = self.shadows.get
        if name == "allreduce_":
            # taken as a sum: the only all-reduces of known values in moe_lc are sums (token counts,
            # loads); the op of a ScriptObject ReduceOp is not readable from Python
            for t in args[0]:
                if get(t) is not None:
                    get(t).mul_(size)
        elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            out_t, in_t = args[0], args[1]
            if get(in_t) is not None and get(out_t) is not None:
                get(out_t).copy_(get(in_t).repeat(size, *([1] * (in_t.dim() - 1))).view_as(get(out_t)))
            else:
                self.shadows.pop(out_t, None)
        elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            out_t, in_t = args[0], args[1]
            if get(in_t) is not None and get(out_t) is not None:
                get(out_t).copy_(get(in_t).view(size, -1)[rank].view_as(get(out_t)) * size)
            else:
                self.shadows.pop(out_t, None)
        elif name == "alltoall_base_":
            out_t, in_t, out_splits, in_splits = args[0], args[1], args[3], args[4]
            same = len(set(out_splits)) <= 1 and len(set(in_splits)) <= 1
            if get(in_t) is not None and get(out_t) is not None and same:
                mine = get(in_t).view(size, -1)[rank]  # every peer sends me what I send myself
                get(out_t).copy_(mine.repeat(size).view_as(get(out_t)))
            else:
                self.shadows.pop(out_t, None)
        elif name in ("recv_", "recv_any_source_"):
            for t in args[0]:
                self.shadows.pop(t, None)
        return out


class HostLiterals(TorchFunctionMode):
    """`torch.tensor(data, device=meta)` builds its value without dispatching an op (so no shadow):
    build it on the CPU and move it, which the StepTracer sees as a copy of known values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device).type == "meta":
            return func(*args, **{**kwargs, "device": "cpu"}).to("meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def held_checkpoint_inputs(callback: Callable[[torch.Tensor], None]):
    """Inside: callback(t) for every tensor input of a non-reentrant checkpoint (recomputation), which
    keeps its inputs in a closure rather than through saved-tensor hooks (whose own hooks also hide
    what runs inside it). Whatever counts saved activations uses it (`SavedActivations`,
    tools/planner/block_trace.py, tools/planner/activation_memory.py)."""
    generator = getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None)
    if generator is None:
        yield
        return

    def held(fn, *args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                callback(a)
        return generator(fn, *args, **kwargs)

    torch_checkpoint._checkpoint_without_reentrant_generator = held
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = generator


class SavedActivations:
    """What a backward will read, labelled as saved activations: tensors packed by autograd's
    saved-tensor hooks, the inputs a non-reentrant checkpoint (recomputation) keeps in its closure
    instead (`held_checkpoint_inputs`), and under a pipeline the output of each
    forward phase, kept until the next phase has run (then released unless a phase saved it) and the
    chunk's output until its backward (moe_lc/parallel/pipeline/overlap.py)."""

    def __init__(self, memory: MemoryTracker):
        self.memory = memory

    def pack(self, t: torch.Tensor):
        self.memory.label(t, "saved", only_from="transients")
        return t

    @contextlib.contextmanager
    def hooks(self):
        forward_phase = PhasedRun.forward_phase

        def phase_outputs_held(run):  # see the docstring
            left_flying = forward_phase(run)
            for t in run.outputs[-1]:
                if isinstance(t, torch.Tensor):
                    self.pack(t)
            return left_flying

        PhasedRun.forward_phase = phase_outputs_held
        try:
            with held_checkpoint_inputs(self.pack), torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            PhasedRun.forward_phase = forward_phase
