"""What one micro-batch keeps for backward and sends on one rank, per block kind, traced on the meta
device: the planner's activation figures (tools/planner/activation_memory.py, tools/planner/pipeline_memory.py) and its
traffic beyond ZeRO (tools/planner/layout.py `traced_traffic`) come from here.

`trace_parts(cfg, loss_mask)` builds the rank's model as the trainer builds it (`build_rank_model`:
tensor, expert and context parallelism, FP8 GEMMs, recomputation and FP8 caching from the recipe),
materialized on the meta device, standing for an H100 as in tools/dryrun.py (or for a CPU, for the
fp32 recipes: `runs_on_gpu`), and runs one piece of each kind forward under the dry run's tracer
(tools/dry_run/trace.py: shadows for routing and split sizes, balanced routing, an expert capacity
dropping by position) on meta tensors of the rank's local shapes:

    embed   the embedding phase on the trainer's inputs (`prepare_batch` of a (B, S+1) micro-batch)
    dense   one dense block, run as the model chains its phases (`Block.phases`); its input is a
            fresh tensor shaped like the embedding's output (B, S/cp, D) (S/(cp tp) under SP)
    moe     one MoE block, likewise
    ...     DeepSeek-V4: one block of each kind by attention type and router instead ("csa moe", "sliding moe
            hash": tools/planner/block_kinds.py), on mHC's widened stream (B, S, hc_mult, D); hash layers read
            the micro-batch's token ids through a balanced table (tools/dry_run/hash_routing.py)
    head    the head phase: the stream's read-out (mHC), final norm, output head, loss and the MTP modules
            (their blocks included)
    rope    the cos / sin tables (B-independent, (S/cp, rope_dim / 2) each), counted once (V4: the positions)

It counts what autograd keeps, as `activation_memory.measure_saved_bytes` does on a real forward: the
storages packed by saved-tensor hooks and the inputs held by non-reentrant checkpoints, each once (by
the first piece that keeps it) and only if it lives to the forward's end, parameters excluded. With
`backward`, each piece then runs its backward as a split schedule does, B then W: what B leaves for W
is measured, and every collective the piece called forward, backward (a recomputation's replays) and in
W is what comm.py counted on the mesh's groups, by (group, op). Bytes are per micro-batch on one rank.

Layout: a block keeps and sends what it does whatever the pipeline is, so the model is built with one
block of each kind (plus the MTP modules, which keep their kind) and no pipeline split, on the recipe's
own mesh (every group at its real size: a sum over "dp_cp_tp" spans dp and DualPipe's mirror ranks),
whose groups are torch's fake process group in this process (what the dry run uses); a recipe whose
dp is left to the world size is traced on pp = 1 and the fewest dp ranks that hold its tp x cp x ep.
A 61-layer model costs three traced blocks; results are cached per (model, micro-batch, precision,
recompute, layout).
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from moe_lc.config import Config, ModelConfig, ParallelConfig
from moe_lc.model.block import run_phases
from moe_lc.model.residual_stream import HyperConnection
from moe_lc.ops.attention import resolved_backend
from moe_lc.ops.device import GpuSpec, meta_as_gpu
from moe_lc.ops.fp8_linear import quantize_weights_now
from moe_lc.ops.linear import WeightGradStore
from moe_lc.parallel.build import build_rank_model
from moe_lc.parallel.comm import CommCounter
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.memory.trace_hooks import watch
from moe_lc.parallel.parallelize import prepare_batch
from ..dry_run.hash_routing import balance_hash_tables, trace_tokens
from ..dry_run.trace import HostLiterals, StepTracer, balanced_select, held_checkpoint_inputs, position_priority
from .block_kinds import block_kind, one_block_of_each_kind  # (the kinds' rule; imported from here by many)

PARTS = ("embed", "dense", "moe", "head", "rope")
META = torch.device("meta")


@dataclass(frozen=True)
class TracedParts:
    """One micro-batch on one rank, by part (`PARTS`, and the model's block kinds: block_kinds.py):

    saved     bytes autograd keeps from the forward to the backward
    tensors   what they are: [(bytes, "module: op dtype[shape]")], largest first (plan.py --terms)
    held      bytes a split backward's B leaves for its W that B made (`_backward`: output gradients, inputs
              B rebuilt or re-quantized); only with `backward`
    kept      bytes of the forward's a split backward's B leaves for its W (`_backward`: the inputs of the
              Linears that defer W, a subset of `saved`; the rest B frees); only with `backward`
    comm      {(group, op): bytes} this rank sends while the part runs forward, backward (recompute
              replays included) and W, as comm.py counts them, on the recipe's mesh; only with `backward`
    calls     {(group, op): collective calls} of the same, as comm.py counts them; only with `backward`
    ops       {"F" | "B" | "W": aten ops dispatched} by the part's forward, its B and its W (what a CPU
              rank pays framework overhead on, tools/step_time/model.py); B and W only with `backward`
    hidden    bytes of the tensor between two blocks (B, S/cp, D), S/(cp tp) under SP: what a pipeline
              stage sends the next one (its gradient comes back alike)
    host      bytes train.offload keeps in host memory from the forward to the backward, by part (not in
              `saved`: moe_lc/parallel/memory/offload.py)
    working   {"F" | "B": {part: bytes}}: the most a part's forward holds at once above what was live when it
              began and all it saves, and its backward (B) above what was live when it began (it frees the
              part's saved tensors as it goes): score tiles, dispatch buffers, recomputed pieces
              (`_working`); B only with `backward`
    """

    saved: dict[str, int]
    tensors: dict[str, list[tuple[int, str]]]
    held: dict[str, int]
    comm: dict[str, dict[tuple[str, str], int]]
    hidden: int
    calls: dict[str, dict[tuple[str, str], int]] = field(default_factory=dict)
    ops: dict[str, dict[str, int]] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    working: dict[str, dict[str, int]] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)

    def block(self, kind: str) -> int:
        return self.saved.get(kind, 0)


_CACHE: dict[tuple[str, bool, bool], TracedParts] = {}


def trace_parts(cfg: Config, loss_mask: bool = False, backward: bool = False, head: bool = True) -> TracedParts:
    """The traced parts of `cfg` (its precision and recompute sections as they are: callers plan
    another policy by passing a replaced config). `backward`: also run each piece's backward as a
    split schedule's B then W, measuring what B leaves for W (`TracedParts.held`) and what each piece
    sends in all (`TracedParts.comm`); not `head`: the blocks only (the head's figures read 0). Cached;
    a trace that did more serves one that asks less."""
    key = repr((cfg.model, cfg.precision, cfg.recompute, cfg.train.micro_batch, cfg.train.seq_len, cfg.train.device,
                _trace_parallel(cfg.parallel), loss_mask, cfg.train.offload,
                cfg.train.qk_clip if cfg.train.qk_clip_guard else 0.0))
    for b, h in ((True, True), (backward, True), (True, head), (backward, head)):
        if (key, b, h) in _CACHE:
            return _CACHE[(key, b, h)]
    found = _CACHE[(key, backward, head)] = _trace(cfg, loss_mask, backward, head)
    return found


def forget_traces() -> None:
    """Empty the cache of `trace_parts` (what a timing of the planner from scratch needs)."""
    _CACHE.clear()


def runs_on_gpu(cfg: Config) -> bool:
    """Whether the recipe's step runs on a GPU (the meta device then stands for an H100): train.device, and
    under "auto" its precision: 16-bit recipes are the GPU ones, fp32 the CPU ones (a GPU's fused
    attention takes no fp32 and would fall back to the reference math)."""
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and cfg.precision.recipe != "fp32")


def on_traced_device(cfg: Config, spec: GpuSpec = GpuSpec()) -> tuple[Config, contextlib.AbstractContextManager]:
    """(cfg, context) to trace `cfg`'s step on the meta device as the device it runs on: inside the context
    meta stands for an H100 (`meta_as_gpu`) where `runs_on_gpu`; else for a CPU, with the attention kernel
    "auto" takes there (the meta device alone has none, and would trace the O(S^2) reference math)."""
    if runs_on_gpu(cfg):
        return cfg, meta_as_gpu(spec)
    m = replace(cfg.model, attn_backend=resolved_backend(cfg.model.attn_backend, "cpu"))
    return cfg.replace(model=m), contextlib.nullcontext()


def _trace_parallel(p: ParallelConfig) -> ParallelConfig:
    """The layout the pieces run on: the recipe's own mesh, every group at its real size (what the
    traffic needs: a balance loss's sum over "dp_cp_tp" spans dp, and DualPipe's mirror ranks); where dp
    is left to the world size (dp = 0), the cheapest with its tp, cp and ep: pp = 1, dp = ep / gcd(ep, cp tp)."""
    if p.dp:
        return p
    return replace(p, pp=1, dp=p.ep // math.gcd(p.ep, p.cp * p.tp), pp_schedule="1f1b", pp_stage_layers=[])


@contextlib.contextmanager
def _trace_mesh(p: ParallelConfig):
    """(parallel section, ParallelDims) of `_trace_parallel(p)`, at rank 0 (pipeline rank 0: every rank of
    a layout has groups of the same sizes), its groups torch's fake process group (no process, no data)."""
    traced = _trace_parallel(p)
    world = traced.pp * traced.dp * traced.cp * traced.tp
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("tools/planner/block_trace.py traces a layout on a fake process group of its own: "
                               "call the planner outside torch.distributed")
        dist.init_process_group("meta:fake,cpu:fake", store=FakeStore(), rank=0, world_size=world)
    try:
        dims = ParallelDims.from_config(traced, world, 0, "meta")
        dims.init_groups()
        yield traced, dims
    finally:
        if world > 1:
            dist.destroy_process_group()


class _SavedCounter:
    """Claims every storage a forward keeps for backward (saved-tensor hooks, checkpoint inputs) for the
    part running now, once, skipping `skip` (parameters, the rope tables); names each by the innermost
    module running when it was saved. A claimed storage that dies is forgotten (its key may then be reused): a
    checkpoint's inputs inside another checkpoint's forward (an RMSNorm's under full recomputation, where its
    input is no phase's: mHC's collapsed stream) are claimed but not kept, as a traced step sees."""

    def __init__(self, model: torch.nn.Module, tracer: StepTracer):
        self.tracer, self.part, self.skip = tracer, "embed", {p.untyped_storage()._cdata for p in model.parameters()}
        self.owner: dict[int, tuple[str, int, str]] = {}
        self.host: dict[str, int] = {}  # part -> bytes offloaded (train.offload): each pack copies its view
        self.modules: list[str] = ["?"]
        self.handles = [h for name, mod in model.named_modules() for h in (
            mod.register_forward_pre_hook(lambda *_, n=name: self.modules.append(n or "model")),
            mod.register_forward_hook(lambda *_: self.modules.pop() and None))]  # None: keep the output
        self.streams = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, HyperConnection)]

    def pack(self, t: torch.Tensor, outside: str = "phases") -> torch.Tensor:
        """Claim t's storage; saved outside any module, it is named "<part> <outside>"."""
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            storage = t.untyped_storage()
            if storage._cdata not in self.skip and storage._cdata not in self.owner and storage.nbytes():
                entry = self.tracer.memory.live.get(id(storage))
                made = entry[3].split(" ")[0] if entry else "input"
                module = self.modules[-1] if len(self.modules) > 1 else f"{self.part} {outside}"  # e.g. MoE dispatch
                what = f"{module}: {made} {str(t.dtype)[6:]}{list(t.shape)}"
                self.owner[storage._cdata] = (self.part, storage.nbytes(), what)
                weakref.finalize(storage, self.owner.pop, storage._cdata, None)
        return t

    def book_host(self, t: torch.Tensor) -> None:
        self.host[self.part] = self.host.get(self.part, 0) + t.numel() * t.element_size()

    @contextlib.contextmanager
    def counting(self):
        for name, mod in self.streams:  # mHC's split / merge run outside forward: named as their module too
            for method in ("split", "merge"):
                setattr(mod, method, self._named(getattr(mod, method), name))
        replayed = lambda t: self.pack(t, "replay inputs")  # a checkpoint's (a block's phases under full recompute)
        with held_checkpoint_inputs(replayed), torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t), \
                watch("offloaded", self.book_host):
            yield self
        for h in self.handles:
            h.remove()
        for _, mod in self.streams:
            del mod.split, mod.merge  # (the instance attributes: the class's methods again)

    def _named(self, fn, name: str):
        def run(*args):
            self.modules.append(name)
            try:
                return fn(*args)
            finally:
                self.modules.pop()
        return run

    def by_part(self) -> tuple[dict[str, int], dict[str, list[tuple[int, str]]]]:
        saved, tensors = {}, {}
        for part, nbytes, what in self.owner.values():
            saved[part] = saved.get(part, 0) + nbytes
            tensors.setdefault(part, []).append((nbytes, what))
        return saved, {k: sorted(v, reverse=True) for k, v in tensors.items()}


def _trace(cfg: Config, loss_mask: bool, backward: bool, head: bool) -> TracedParts:
    cfg = position_priority(cfg)
    cfg, device = on_traced_device(cfg)
    m = one_block_of_each_kind(cfg.model)
    with _trace_mesh(cfg.parallel) as (parallel, dims), warnings.catch_warnings(), device:
        warnings.simplefilter("ignore")  # the build's and kernels' notes are the trainer's to give
        small = cfg.replace(model=m, parallel=parallel)
        # (built outside the tracer: no shadows of parameters)
        built = build_rank_model(small, dims, META, pipeline=(None, None), materialized=True,
                                 route=balanced_select, defer_wgrad=backward)
        with StepTracer() as tracer, HostLiterals():
            # the weights' FP8 copies made first, as after a step's first micro-batch: live before any part runs,
            # they are the planner's "fp8 weight cache" row (tools/planner/fp8_weights.py), no part's working set
            quantize_weights_now(built.module, small.precision.compute_dtype)
            return _trace_pieces(built.module, built.wgrad_store, m, cfg.train, dims, loss_mask, head, tracer)


def _trace_pieces(model: torch.nn.Module, store: WeightGradStore | None, m: ModelConfig, t, dims: ParallelDims,
                  loss_mask: bool, head: bool, tracer: StepTracer) -> TracedParts:
    """The embedding, one block of each kind and the head forward, each block and the head on a fresh
    input (B, S', D) shaped like the embedding's output, counting what each keeps; with a `store` (the
    split backward's), then each one's backward as B, measuring what it leaves for W, and its W, counting
    what each part sends in all."""
    tokens = trace_tokens(m, (t.micro_batch, t.seq_len + 1), META)  # ids a hash layer reads (hash_routing.py)
    balance_hash_tables(model, tracer)
    mask = torch.ones(t.micro_batch, t.seq_len, device=META) if loss_mask else None
    batch = prepare_batch(tokens, mask, dims, m.mtp.depth)
    tables = []  # cos, sin (V4: positions, twice): made once per micro-batch, read by every block
    hook = model.rope.register_forward_hook(lambda mod, args, out: tables.extend(out))
    chain = model.phases(batch["positions"], batch["labels"], batch["loss_mask"], batch["mtp"], tokens=batch["inputs"])
    hook.remove()
    counter = _SavedCounter(model, tracer)
    counter.skip |= {x.untyped_storage()._cdata for x in tables}
    comm: dict[str, dict[tuple[str, str], int]] = {}
    calls: dict[str, dict[tuple[str, str], int]] = {}
    ops: dict[str, dict[str, int]] = {}

    def sent(part: str):
        return _sent(dims.counter, comm.setdefault(part, {}), calls.setdefault(part, {}))

    working: dict[str, dict[str, int]] = {"F": {}, "B": {}}
    with counter.counting():
        with sent("embed"), _ops(tracer, ops, "embed", "F"), _working(tracer, working, "embed", "F"):
            h = chain[0](batch["inputs"])[0]
        outputs = [("embed", batch["inputs"], h)]
        for i, block in model.layers.items():
            kind = counter.part = block_kind(m, int(i))
            x = torch.empty_like(h).requires_grad_()
            with sent(kind), _ops(tracer, ops, kind, "F"), _working(tracer, working, kind, "F"):
                outputs.append((kind, x, run_phases(block.phases(*tables, tokens=batch["inputs"]), x)))
        if head:
            counter.part = "head"
            x = torch.empty_like(h).requires_grad_()
            with sent("head"), _ops(tracer, ops, "head", "F"), _working(tracer, working, "head", "F"):
                outputs.append(("head", x, chain[-1](x)[0]))
    held, kept = {}, {}
    saved, tensors = counter.by_part()  # what the forwards keep; each backward may now free it, as in a step
    if store is not None:
        for part, x, y in outputs:
            with sent(part):
                held[part], kept[part] = _backward(model, tracer, store, x, y, ops.setdefault(part, {}), working,
                                                   part)
    working["F"] = {part: max(0, n - saved.get(part, 0)) for part, n in working["F"].items()}
    rope = {x.untyped_storage()._cdata: (x.untyped_storage().nbytes(), f"rope: {str(x.dtype)[6:]}{list(x.shape)}")
            for x in tables}
    saved["rope"], tensors["rope"] = sum(n for n, _ in rope.values()), sorted(rope.values(), reverse=True)
    backward = store is not None
    kinds = [block_kind(m, int(i)) for i in model.layers]
    return TracedParts({k: saved.get(k, 0) for k in (*PARTS, *kinds)}, tensors, held, comm if backward else {},
                       h.numel() * h.element_size(), calls if backward else {}, ops,
                       dict(counter.host), working, kept)


@contextlib.contextmanager
def _working(tracer: StepTracer, into: dict[str, dict[str, int]], part: str, phase: str):
    """Raise into[phase][part] to the most live bytes inside above the level before it (a forward's, "F",
    includes what it has saved by then: `_trace_pieces` takes the part's saved bytes off)."""
    mem = tracer.memory
    start = mem.total
    mem.reset_peak()
    yield
    into[phase][part] = max(into[phase].get(part, 0), mem.peak - start)


@contextlib.contextmanager
def _sent(counter: CommCounter, into: dict[tuple[str, str], int], calls_into: dict[tuple[str, str], int]):
    """Add to `into` what this rank sends inside, {(group, op): bytes} as comm.py counts it (an op called
    with nothing to send keeps its key, as in the trainer's metrics), and to `calls_into` its calls."""
    calls, sent = dict(counter.calls), dict(counter.bytes)
    yield
    for key, n in counter.calls.items():
        if n > calls.get(key, 0):
            into[key] = into.get(key, 0) + counter.bytes[key] - sent.get(key, 0)
            calls_into[key] = calls_into.get(key, 0) + n - calls.get(key, 0)


@contextlib.contextmanager
def _ops(tracer: StepTracer, into: dict[str, dict[str, int]], part: str, phase: str):
    """Add the aten ops dispatched inside to into[part][phase]."""
    before = tracer.ops
    yield
    into.setdefault(part, {})[phase] = into.get(part, {}).get(phase, 0) + tracer.ops - before


def _backward(model: torch.nn.Module, tracer: StepTracer, store: WeightGradStore, x: torch.Tensor,
              y: torch.Tensor, ops: dict[str, int], working: dict[str, dict[str, int]], part: str) -> tuple[int, int]:
    """y's backward as a split schedule runs it, B (`store` deferring) then W -> (held, kept): the bytes B
    leaves for W that B made (what it created that is still alive after it, other than parameters and the
    gradients of them and of x: output gradients, inputs B rebuilt or re-quantized) and the rest of what W
    frees, the forward's tensors the queued W closures hold (the Linears' inputs). W runs after (its
    collectives, e.g. a replicated kv head's gradient rows, count)."""
    before = list(tracer.memory.live.values())  # held, so that no entry's id is reused
    known = {id(e) for e in before}
    start = tracer.ops
    with store.deferring(), _working(tracer, working, part, "B"):
        y.backward(torch.empty_like(y))
    ops["B"] = tracer.ops - start
    params = list(model.parameters())  # (their storages, first seen by the tracer when an op aliases one)
    other = {t.untyped_storage()._cdata for t in (*params, *(p.grad for p in params), x.grad) if t is not None}
    new = [e for e in tracer.memory.live.values() if id(e) not in known]
    held = sum(e[1] for e in new if e[0]() is not None and e[0]()._cdata not in other)
    waiting = _live_bytes(tracer, params)
    start = tracer.ops
    WeightGradStore.run(store.take())  # (the queue, and what its closures hold, is freed on return)
    ops["W"] = tracer.ops - start
    freed = waiting - _live_bytes(tracer, params)
    for p in params:
        p.grad = None
    return held, max(0, freed - held)


def _live_bytes(tracer: StepTracer, params: list) -> int:
    """Bytes the tracer sees alive, less the parameters and their gradients (which W adds to)."""
    skip = {t.untyped_storage()._cdata for p in params for t in (p, p.grad) if t is not None}
    return sum(e[1] for e in tracer.memory.live.values() if e[0]() is not None and e[0]()._cdata not in skip)
