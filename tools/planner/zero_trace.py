"""What ZeRO sends per step on one rank, counted while ZeRO itself runs: the planner's ZeRO, Muon and tie traffic.

No formula of ZeRO's collectives lives in the planner. `zero_traffic(cfg, layout, schedule)` builds the rank's
optimizer as the trainer builds it (`ZeroOptimizer.from_config`: the recipe's update rule and `[parallel.placement]`,
zero/strategies.py) over the RankLayout's model (the meta device, its parameters in the compute dtype), on the
recipe's mesh at the layout's coordinates with torch's fake process group, and runs one step of it:

  gradients   every parameter's gradients arrive as the trainer's step delivers them (outside a pipeline one per
              micro-batch; under one `grad_arrivals`, the runtime's own count per chunk), micro-batch by
              micro-batch in backward order, through ZeRO's post-accumulate-grad hook: ZeRO-1's buckets launch
              their reduce-scatters once, ZeRO-2's rounds once per micro-batch
  step        `step()`: the norm's all-reduce, a tied embedding's reduced shard over pp_tie, the rule's update
              (Muon's tp all-gathers of the matrices this rank owns), every bucket published (all-gathered where
              the parameters stay whole); then `flush()`: a deferring offloaded update's gathers, which the next
              forward would run. On meta tensors (`_MetaStep`) a host read of the norm answers 1 (finite: the
              update is applied) and an in-place op skips its meta kernel, which only re-derives a known shape
  units       ZeRO-3: the placement's `ParamGather` on each chunk's own chains (the chains its `phases` marks
              through the `hold` seam, run forward and backward with identity phases): every unit gathered as
              the runtime gathers it, prefetches included, times the micro-batches through the chunk

comm.py counts every (group, op), as it does for the trainer (tests/test_plan.py, test_zero*.py, test_muon.py,
test_tied_embeddings.py and test_optimizer_offload.py hold real runs' counts to these). The optimizer is built into
the layout's model: its parameters become views into ZeRO's buffers, as in the trainer. Results are cached by what
the counts depend on (each group's parameter shapes, placements and arrivals, the chains, the mesh's sizes), so a
pipeline rank whose shapes repeat, or a layout planned again, is traced once.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lc.config import Config
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.pipeline.runtime import grad_arrivals
from moe_lc.parallel.zero.optimizer import ZeroOptimizer
from moe_lc.parallel.zero.strategies import ZeroPlacement
from .pipeline_memory import stage_forwards
from .placement_semantics import Traffic

META = torch.device("meta")


@dataclass
class ZeroTrace:
    """One rank's step of ZeRO, as counted: {(group, op): bytes} of the step (gradients, norm, update,
    publishing) and of ZeRO-3's unit gathers (over the step's micro-batches), and each chunk's unit gathers
    per micro-batch ([{unit: gathers}] by local chunk, what `ParamGather` counted)."""

    step: dict[tuple[str, str], int]
    units: dict[tuple[str, str], int] = field(default_factory=dict)
    unit_gathers: list[Counter] = field(default_factory=list)

    def traffic(self, placement: ZeroPlacement) -> list[Traffic]:
        what = f"{placement.describe()}: one step run on this layout, counted (tools/planner/zero_trace.py)"
        out = [Traffic(g, op, n, what) for (g, op), n in sorted(self.step.items()) if n]
        return out + [Traffic(g, op, n, "ZeRO-3: each unit gathered around its chains' use, run per micro-batch")
                      for (g, op), n in sorted(self.units.items()) if n]


_CACHE: dict[tuple, ZeroTrace] = {}


def zero_traffic(cfg: Config, layout, schedule) -> list[Traffic]:
    """What ZeRO sends per step on `layout`'s rank (module docstring), as planner traffic rows."""
    return trace_zero(cfg, layout, schedule).traffic(ZeroPlacement.from_config(cfg.parallel.placement))


def trace_zero(cfg: Config, layout, schedule) -> ZeroTrace:
    """One step of the rank's ZeRO, counted (module docstring); cached (`_key`). `layout`: a RankLayout of
    `cfg` (tools/planner/layout.py), `schedule`: its pipeline schedule or None."""
    model, dtype = layout.model, cfg.precision.compute_dtype
    pp_rank = layout.dims.coords()["pp"]
    micro = cfg.train.microbatches(layout.dims.dp)
    arrivals = grad_arrivals(schedule, pp_rank, model.chunks) if schedule is not None else \
        {id(p): micro for p in model.module.parameters()}
    runs = stage_forwards(schedule, pp_rank) if schedule is not None else {0: micro}
    gathered = ZeroPlacement.from_config(cfg.parallel.placement).params_gathered
    chains = [_chains(chunk) for chunk in model.chunks] if gathered else []
    key = _key(cfg, layout, arrivals, chains, runs)
    if key not in _CACHE:
        for p in model.module.parameters():  # the trainer's parameters are in the compute dtype
            p.data = p.data.to(dtype)
        with _fake_mesh(cfg, layout.dims) as dims:
            _CACHE[key] = _run(cfg, model, dims, schedule is not None, arrivals, micro, chains, runs)
    return _CACHE[key]


def forget_zero_traces() -> None:
    """Empty `trace_zero`'s cache (what a timing of the planner from scratch needs)."""
    _CACHE.clear()


@contextlib.contextmanager
def _fake_mesh(cfg: Config, layout_dims: ParallelDims):
    """The recipe's mesh at the layout's rank, its groups torch's fake process group (no process, no data)."""
    world, rank = layout_dims.world, layout_dims.rank
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("tools/planner/zero_trace.py runs ZeRO on a fake process group of its own: call the "
                               "planner outside torch.distributed")
        dist.init_process_group("meta:fake,cpu:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = ParallelDims.from_config(replace(cfg.parallel, dp=layout_dims.dp), world, rank, "meta")
        dims.init_groups()
        for name, group in layout_dims.groups.items():  # those the build added (a tied embedding's pp_tie)
            if name not in dims.groups:
                dims.add_group(name, [group.ranks])
        yield dims
    finally:
        if world > 1:
            dist.destroy_process_group()


def _run(cfg: Config, model, dims: ParallelDims, pipelined: bool, arrivals: dict[int, int], micro: int,
         chains: list, runs: dict[int, int]) -> ZeroTrace:
    """Build the optimizer, deliver the step's gradients, step, and (ZeRO-3) run each chunk's chains."""
    no_ema = cfg.replace(train=replace(cfg.train, ema_decay=0.0))  # the CPU average sends nothing
    opt = ZeroOptimizer.from_config(no_ema, model, dims)
    hook = {id(p): s for s in opt.shards for b in s.buckets for p, _ in b.params}
    order = [p for p in reversed(list(model.module.parameters())) if id(p) in hook]  # backward's order
    grads = {id(p): torch.empty_like(p) for p in order}
    dims.counter.reset()
    with _MetaStep():
        opt.begin_step(arrivals if pipelined else micro)
        for m in range(max(arrivals.values(), default=0)):
            for p in order:
                if arrivals.get(id(p), 0) > m:
                    p.grad = grads[id(p)]
                    hook[id(p)].on_grad(p)
        opt.step(lr=1.0)
        opt.flush()
    out = ZeroTrace(dict(dims.counter.bytes))
    gather = opt.placement.holder(opt, model) if opt.placement.params_gathered else None
    for chunk, stage, marked in zip(model.chunks, model.stage_ids, chains) if gather is not None else ():
        before, counted = Counter(dims.counter.bytes), Counter(gather.by_unit)
        _run_chains(gather, chunk, marked)
        for key, n in dims.counter.bytes.items():
            out.units[key] = out.units.get(key, 0) + (n - before[key]) * runs[stage]
        out.unit_gathers.append(Counter(gather.by_unit) - counted)
    return out


class _MetaStep(TorchDispatchMode):
    """ZeRO's step on meta tensors, as fast as it goes: a host read (the grad norm's `.item()`) answers 1, as the
    dry run's tracer does (tools/dry_run/trace.py), and an in-place op that changes values only (not a view's
    shape: `Tag.inplace_view`) returns its input without running its meta kernel."""

    skips: dict = {}  # op -> whether it is such an in-place op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            skip = self.skips.get(func)
            if skip is None:
                skip = self.skips[func] = torch.Tag.inplace in func.tags and torch.Tag.inplace_view not in func.tags
            if skip:
                return args[0]
            if func is torch.ops.aten._local_scalar_dense.default:
                return 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def _chains(chunk) -> list[tuple[tuple, bool]]:
    """The chains of phases `chunk`'s forward marks through its `hold` seam (moe_lc/model/seams.py), in
    forward order: [(the modules whose parameters it reads, whether its backward reads them again)]."""
    marked, holders = [], [m for m in chunk.modules() if hasattr(m, "hold")]
    seams = [m.hold for m in holders]

    def record(chain, modules, backward=True):
        marked.append((tuple(m for m in modules if m is not None), backward))
        return chain

    for m in holders:
        m.hold = record
    try:
        chunk.phases(torch.zeros(1, dtype=torch.int64, device=META))
    finally:
        for m, seam in zip(holders, seams):
            m.hold = seam
    return marked


def _run_chains(gather, chunk, chains: list[tuple[tuple, bool]]) -> None:
    """One micro-batch through `chunk`'s chains, forward then backward, each wrapped by `gather.hold` as the
    trainer's seam wraps it, its phases identities on a scalar (a first stage's input, token ids, needs no
    gradient), then the step's `sweep`."""
    leaf = torch.zeros((), requires_grad=True)

    def phase(h):
        return (h + leaf,)

    state = (torch.zeros((), requires_grad=not (chunk.embed is not None and chunk.takes_tokens)),)
    for modules, backward in chains:
        for wrapped in gather.hold([phase], modules, backward):
            state = wrapped(*state)
    state[0].backward()
    gather.sweep()


def _key(cfg: Config, layout, arrivals: dict[int, int], chains: list, runs: dict[int, int]) -> tuple:
    """What a rank's ZeRO counts depend on: the recipe's ZeRO options and update rule, the mesh's sizes, every
    parameter's shape, placement and arrivals in order (names only as gather units and the rule's choices see
    them), and the chains by position."""
    p = cfg.parallel
    dims = layout.dims
    model = layout.model
    index = {id(q): i for i, (_, q, _) in enumerate(model.named_parameters())}
    params = tuple((_unit_pattern(name), tuple(q.shape), repr(place), arrivals.get(id(q), 0))
                   for name, q, place in model.named_parameters())
    marked = tuple(tuple((tuple(sorted(index[id(q)] for m in mods for q in m.parameters() if id(q) in index)),
                          back) for mods, back in chunk) for chunk in chains)
    # each group's size, and this rank's place in it (which matrices a rule owns) but along the pipeline
    sizes = tuple(sorted((name, g.size, g.rank if name not in ("pp", "pp_tie", "world") else -1)
                         for name, g in dims.groups.items()))
    return (repr(p.placement), p.zero_bucket_mb, repr(cfg.precision), repr(cfg.train), repr(cfg.model), sizes,
            params, marked, tuple(runs[stage] for stage in model.stage_ids))


def _unit_pattern(name: str) -> str:
    """A parameter's name with its block index dropped: ranks whose blocks differ only in their ids trace alike."""
    first, _, rest = name.partition(".")
    return f"layers.*.{rest.partition('.')[2]}" if first == "layers" else name
