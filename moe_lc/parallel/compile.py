"""The compile plan (`train.compile = true`): the model's compute regions run through torch.compile, and
what compiling costs and breaks is counted.

What is compiled. The regions (moe_lc/ops/regions.py) are the pure compute chains of a block and of the
loss head: RMSNorm's fp32 math, RoPE, SwiGLU, the router after its gate (affinities, group-limited top-k,
gate weights, expert counts), the sequence-wise balance loss, the local dispatcher's sort by expert and
its inverse with the weighted sum over k (also the all-to-all dispatcher's combine), and the fp32
cross-entropy. Each is compiled whole (`fullgraph`) the first time it runs with new shapes, and the
graph is shared by every block that calls it with those shapes: block 0 compiles, blocks 1.. mostly
reuse (the start-up line says how long each block took).

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
reasons), graphs, and compile seconds per block (dynamo's compile-start / compile-end callbacks).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch._dynamo import callback as dynamo_callback
from torch._dynamo import utils as dynamo_utils

from moe_lc.model.block import Block
from moe_lc.model.transformer import Transformer
from moe_lc.ops import regions
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.placement import Parallelized

COMPILATION_RECORDS = 100_000  # dynamo keeps its last 64 compilation records by default; we count them all


class CompileWatch:
    """Compile seconds per scope (a block, "head", or "other") and dynamo's counts, for one rank.

    Scopes come from the blocks' phase lists and the heads' output functions, wrapped so that whatever
    dynamo compiles while one runs is booked to it (backward graphs are compiled with their forward,
    `force_non_lazy_backward_lowering`, so they land in the same scope)."""

    def __init__(self):
        dynamo_utils.set_compilation_metrics_limit(COMPILATION_RECORDS)
        self.seconds: dict[str, float] = defaultdict(float)
        self.order: list[str] = []  # scopes in the order their compile time was first booked
        self._stack: list[str] = []
        self._started: float | None = None
        self._scope_at_start = "other"
        self._first_record = len(dynamo_utils.get_compilation_metrics())
        self._first_step_records: int | None = None  # records made by the end of the first step
        self._breaks0 = self._graph_breaks_total()
        self._graphs0 = dynamo_utils.counters["stats"]["unique_graphs"]

    # -- scopes -----------------------------------------------------------------------------------
    def scoped(self, fn, scope: str):
        """fn, with `scope` the current scope while it runs (keeps fn's name: timelines show it)."""

        def run(*args, **kwargs):
            self._stack.append(scope)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()

        run.__name__ = getattr(fn, "__name__", scope)
        return run

    def scoped_phases(self, phases, scope: str):
        """A block's `_phases`, returning its phase functions scoped."""

        def run(*args, **kwargs):
            return [self.scoped(fn, scope) for fn in phases(*args, **kwargs)]

        return run

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
        return sum(dynamo_utils.counters["graph_break"].values())

    def records(self) -> list:
        """dynamo's compilation records since this watch began (one per frame it compiled)."""
        return list(dynamo_utils.get_compilation_metrics())[self._first_record:]

    def counts(self) -> dict[str, float]:
        """{"compile/graph_breaks", "compile/recompiles", "compile/graphs", "compile/time_s"} so far."""
        recompiles = sum(r.recompile_reason is not None for r in self.records())
        return {"compile/graph_breaks": self._graph_breaks_total() - self._breaks0,
                "compile/recompiles": recompiles,
                "compile/graphs": dynamo_utils.counters["stats"]["unique_graphs"] - self._graphs0,
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


_WATCH: CompileWatch | None = None  # the watch of the step running now: dynamo's callbacks are process-wide


def _on_start(args) -> None:
    if _WATCH is not None:
        _WATCH.on_start(args)


def _on_end(args) -> None:
    if _WATCH is not None:
        _WATCH.on_end(args)


def _install_callbacks() -> None:
    """Ours among dynamo's compile callbacks (once; again after a `torch._dynamo.reset()`, which clears them)."""
    handler = dynamo_callback.callback_handler
    if _on_start not in handler.start_callbacks:
        handler.register_start_callback(_on_start)
        handler.register_end_callback(_on_end)


@contextmanager
def running(watch: CompileWatch | None):
    """Inside: the compiled regions on, and what dynamo compiles booked to `watch` (a training step);
    nothing changes for None (train.compile = false)."""
    global _WATCH
    _install_callbacks()
    outer, _WATCH = _WATCH, watch if watch is not None else _WATCH
    try:  # backward graphs compiled with their forward, in the block's scope
        with regions.compiled_regions(watch is not None or regions.regions_on()), \
                torch._functorch.config.patch(force_non_lazy_backward_lowering=watch is not None):
            yield
    finally:
        _WATCH = outer


def apply_compile(result: Parallelized) -> CompileWatch:
    """The compile plan of a rank's model, applied after `parallelize` (to the blocks and pipeline chunks as
    the rank runs them): scopes for compile seconds, dynamo's settings. Returns the rank's `CompileWatch`;
    steps run compiled inside `running(watch)`."""
    watch = CompileWatch()
    for name, module in result.module.named_modules():
        if isinstance(module, Block):
            module._phases = watch.scoped_phases(module._phases, _scope_name(name))
    for chunk in {id(c): c for c in [result.module, *result.chunks]}.values():
        if isinstance(chunk, Transformer) and chunk.head is not None:
            chunk._output = watch.scoped(chunk._output, "head")
    return watch


def _scope_name(module_name: str) -> str:
    """layers.3 -> "block 3", mtp.0.block -> "mtp 0"."""
    parts = module_name.split(".")
    return f"block {parts[1]}" if parts[0] == "layers" else f"mtp {parts[1]}"
