"""The compile plan (`train.compile = true`): the model's compute regions run through torch.compile, and
what compiling costs and breaks is counted.

What is compiled. The regions (moe_lc/ops/regions.py) are the pure compute chains of a block and of the
loss head: RMSNorm's fp32 math, RoPE, SwiGLU, the router after its gate (affinities, group-limited top-k,
gate weights, expert counts), the sequence-wise balance loss, the local dispatcher's sort by expert and
its inverse with the weighted sum over k (also the all-to-all dispatcher's combine), and the fp32
cross-entropy. Each is compiled whole (`fullgraph`) the first time it runs with new shapes, and the
graph is shared by every block that calls it with those shapes: block 0 compiles, blocks 1.. mostly
reuse (the start-up line says how long each block took).

How. Compiling is a decision of the layer plan (moe_lc/parallel/layer_plan.py): every module that runs a
region does so through its `run_region` seam, and under train.compile the plan gives each one the
`CompiledRegions` of its scope (its block, "block 3" or "mtp 0", else "head"); one runner per scope,
all sharing the rank's graphs and its `CompileWatch`. Nothing is patched after the plan and no module
global holds state: the watch installs its dynamo callbacks and settings while a region call (or the
trainer's step, `CompileWatch.watching`) runs and removes them after.

What is not, and why the graphs break nowhere. Everything between regions runs eagerly: the one Linear
(its GEMMs, the TP role's all-gather / reduce-scatter, FP8 quantization and scaled GEMMs, the deferred
weight gradient a split backward queues), the attention core and the ring (counted P2P transfers), the
dispatcher's all-to-alls and layout all-gather, the `Transfer`s between phases, and the recomputation
and FP8 caching seams (checkpoint, saved-tensor hooks). Dynamo never traces them, so a region never
contains a collective or per-instance state and never breaks: there is no place for one. A region is
called from eager code, so a checkpoint replays it by calling it again and saved-tensor hooks see what
its compiled autograd node saves: recomputation and FP8 caching keep their semantics.

No recompiles after the first step: graphs are specialized to the shapes of the first step (a layout's
shapes never change after it); the rows an expert-parallel rank receives, which do, are dynamic dims of
SwiGLU (`Region.dynamic`). Counted with dynamo's own records (`CompileWatch`): graph breaks
(`counters["graph_break"]`), recompiles (compilations dynamo made for a guard failure, with their
reasons), graphs, and compile seconds per scope (dynamo's compile-start / compile-end callbacks).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import torch

from moe_lc.ops.regions import Region
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group

COMPILATION_RECORDS = 100_000  # dynamo keeps its last 64 compilation records by default; we count them all
# A region meets a few shapes (e.g. SwiGLU: the dense FFN, the shared and the routed experts) and a few
# autograd modes (forward, a checkpoint's replay, a no-grad rebuild from saved tensors): dynamo's default
# of 8 graphs per function is too few, and past the limit it would run the region eagerly in silence.
RECOMPILE_LIMIT = 64
# Inductor's C++ kernels run a loop on several threads from 512 elements a thread on; ATen's eager kernels,
# which the regions replace, from 32768 (at::internal::GRAIN_SIZE). On a busy CPU (a core taken by another
# process) each parallel region waits for a descheduled thread: at 512 the debug MoE's compiled step took
# 10x the eager one on 2 threads. Compiled kernels go parallel where eager ones would.
PARALLEL_GRAIN = 32768


def _dynamo_utils():
    """torch._dynamo's counters, imported when a run compiles: importing dynamo costs every process ~0.4 s
    (each `moe-train`, each rank), most of which never compile."""
    from torch._dynamo import utils

    return utils


class CompileWatch:
    """Compile seconds per scope (a block, "head", or "other") and dynamo's counts, for one rank.

    While a region call runs (`CompiledRegions`), its scope is the current one and whatever dynamo compiles
    is booked to it (backward graphs are compiled with their forward, `force_non_lazy_backward_lowering`,
    so they land in the same scope). The dynamo settings and callbacks the watch needs are on while any
    scope is entered, and only then: a step inside `watching()` turns them on once for all its calls."""

    def __init__(self):
        _dynamo_utils().set_compilation_metrics_limit(COMPILATION_RECORDS)
        self.seconds: dict[str, float] = defaultdict(float)
        self.order: list[str] = []  # scopes in the order their compile time was first booked
        self._stack: list[str] = []
        self._settings: ExitStack | None = None
        self._started: float | None = None
        self._scope_at_start = "other"
        self._first_record = len(_dynamo_utils().get_compilation_metrics())
        self._first_step_records: int | None = None  # records made by the end of the first step
        self._breaks0 = self._graph_breaks_total()
        self._graphs0 = _dynamo_utils().counters["stats"]["unique_graphs"]

    # -- scopes -----------------------------------------------------------------------------------
    def enter(self, scope: str) -> None:
        """`scope` is the current scope until the matching `exit` (the first entered turns the settings on)."""
        if not self._stack:
            self._settings = self._on()
        self._stack.append(scope)

    def exit(self) -> None:
        self._stack.pop()
        if not self._stack:
            self._settings.close()
            self._settings = None

    @contextmanager
    def watching(self):
        """Inside (a training step): the settings on throughout, compiles outside a region booked to "other"."""
        self.enter("other")
        try:
            yield
        finally:
            self.exit()

    def _on(self) -> ExitStack:
        """dynamo's settings for regions and this watch's compile callbacks, until the stack is closed."""
        on = ExitStack()
        on.enter_context(torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True))
        on.enter_context(torch._inductor.config.patch({"cpp.min_chunk_size": PARALLEL_GRAIN}))
        # backward graphs compiled with their forward, in the region's scope
        on.enter_context(torch._functorch.config.patch(force_non_lazy_backward_lowering=True))
        from torch._dynamo.callback import callback_handler as handler
        handler.register_start_callback(self.on_start)
        handler.register_end_callback(self.on_end)
        on.callback(_remove_callbacks, handler, self.on_start, self.on_end)
        return on

    def on_start(self, _args) -> None:
        self._started, self._scope_at_start = time.perf_counter(), self._stack[-1] if self._stack else "other"

    def on_end(self, _args) -> None:
        if self._started is None:
            return
        scope = self._scope_at_start
        if scope not in self.seconds:
            self.order.append(scope)
        self.seconds[scope] += time.perf_counter() - self._started
        self._started = None

    # -- counts -----------------------------------------------------------------------------------
    @staticmethod
    def _graph_breaks_total() -> int:
        return sum(_dynamo_utils().counters["graph_break"].values())

    def records(self) -> list:
        """dynamo's compilation records since this watch began (one per frame it compiled)."""
        return list(_dynamo_utils().get_compilation_metrics())[self._first_record:]

    def counts(self) -> dict[str, float]:
        """{"compile/graph_breaks", "compile/recompiles", "compile/graphs", "compile/time_s"} so far."""
        recompiles = sum(r.recompile_reason is not None for r in self.records())
        return {"compile/graph_breaks": self._graph_breaks_total() - self._breaks0,
                "compile/recompiles": recompiles,
                "compile/graphs": _dynamo_utils().counters["stats"]["unique_graphs"] - self._graphs0,
                "compile/time_s": sum(self.seconds.values())}

    def after_step(self, first: bool, last: bool, world: Group, log) -> dict[str, float]:
        """After a training step: at this process's first and the run's last step, the counts as metrics
        (the maximum over the ranks of `world`: one all-reduce) and, through `log`, after the first
        step the start-up line (this rank's), after the last any recompile made after the first."""
        if not (first or last):
            return {}
        counts = self.counts()
        values = torch.tensor(list(counts.values()), dtype=torch.float64, device=world.device_type or "cpu")
        comm.all_reduce(values, world, op=torch.distributed.ReduceOp.MAX)
        if first:
            self._first_step_records = len(self.records())
            log(self.summary())
        elif last:
            for reason in self.recompile_reasons(after_first_step=True):
                log(f"compile: recompiled after the first step: {reason}")
        return dict(zip(counts, values.tolist()))

    def recompile_reasons(self, after_first_step: bool = False) -> list[str]:
        """"region: dynamo's reason" of every recompile (after the first step only: what should not be)."""
        records = self.records()[self._first_step_records or 0:] if after_first_step else self.records()
        return [f"{r.co_name}: {r.recompile_reason}" for r in records if r.recompile_reason is not None]

    def summary(self) -> str:
        """The start-up line: compile seconds per block, graphs, breaks, recompiles."""
        c = self.counts()
        per_scope = ", ".join(f"{s} {self.seconds[s]:.1f} s" for s in self.order) or "nothing compiled"
        return (f"compile: {c['compile/time_s']:.1f} s for {c['compile/graphs']} graphs ({per_scope}; a block not "
                f"listed reused earlier graphs) | graph breaks {c['compile/graph_breaks']}, recompiles "
                f"{c['compile/recompiles']} (regions meeting further shapes)")


def _remove_callbacks(handler, on_start, on_end) -> None:
    if on_start in handler.start_callbacks:  # (a torch._dynamo.reset() inside would have cleared them)
        handler.remove_start_callback(on_start)
    if on_end in handler.end_callbacks:
        handler.remove_end_callback(on_end)


class CompiledRegions:
    """The `run_region` seam under train.compile: (region, *args) -> the region's graph run on args, compiled
    (`fullgraph`, shapes static but the region's `dynamic` dims) the first time a shape needs it, with what
    dynamo compiles then booked to `scope` of `watch`. graphs: {Region: its torch.compile'd function}, one
    table per rank's plan, shared by the runners of all its scopes."""

    def __init__(self, watch: CompileWatch, scope: str, graphs: dict):
        self.watch, self.scope, self.graphs = watch, scope, graphs

    def __call__(self, region: Region, *args, **kwargs):
        graph = self.graphs.get(region)
        if graph is None:
            graph = self.graphs[region] = torch.compile(region.fn, fullgraph=True, dynamic=False)
        region.mark_dynamic(args, kwargs)
        self.watch.enter(self.scope)
        try:
            return graph(*args, **kwargs)
        finally:
            self.watch.exit()

    def __repr__(self) -> str:
        return f"compiled({self.scope})"


def compiled_runners(module_names, watch: CompileWatch) -> dict[str, CompiledRegions]:
    """{module name: its scope's CompiledRegions} for the names of a model's modules: one runner per scope,
    one graph table and `watch` for all."""
    graphs, by_scope = {}, {}
    return {name: by_scope.setdefault(scope_name(name), CompiledRegions(watch, scope_name(name), graphs))
            for name in module_names}


def scope_name(module_name: str) -> str:
    """layers.3.attn -> "block 3", mtp.0.block.ffn -> "mtp 0", anything else (final norm, loss) -> "head"."""
    parts = module_name.split(".")
    if len(parts) > 1 and parts[0] in ("layers", "mtp"):
        return f"block {parts[1]}" if parts[0] == "layers" else f"mtp {parts[1]}"
    return "head"
