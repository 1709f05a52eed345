"""Compiled regions: the model's pure compute pieces, which `train.compile` runs through torch.compile.

A region is a function of tensors and constants only: no collective, no seam, no module, no Python
state and no side effect. So dynamo traces each whole (`fullgraph=True`: a graph break inside one is an
error, not a silent fallback), and one compiled graph serves every block that calls the region with
the same shapes and dtypes. What lies between regions runs eagerly, exactly as without compile: the
one Linear's GEMMs with their tensor-parallel collectives, FP8 recipes and deferred weight gradients,
the attention core and the ring, the token dispatcher's all-to-alls, and the recomputation and FP8
caching seams, which therefore keep their semantics (a checkpoint replays a region by calling it again;
saved-tensor hooks see what the region's compiled autograd node saves).

Regions are off by default (every call is the plain function); inside `with compiled_regions():` they
run compiled (the trainer's step does so for `train.compile = true`, moe_lc/parallel/compile.py), so
nothing else in the process (eval, a second model, the tests around it) is affected. Shapes: every
graph is specialized to its shapes, except the dims a region declares `dynamic` (dims that vary from step to
step, like the rows an expert-parallel rank receives), which are compiled unbacked: one graph for
every size, 0 and 1 included, so they never recompile.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable

import torch

_on = False


class Region:
    """fn, compiled on first use while regions are on. dynamic: {argument name: dims} whose sizes vary
    between calls (negative dims count from the end; all but the last with ..., e.g. rows of (..., K))."""

    def __init__(self, fn: Callable, dynamic: dict[str, tuple] | None = None):
        functools.update_wrapper(self, fn)
        self.fn, self.dynamic = fn, dynamic or {}
        self.compiled = None
        self._argnames = fn.__code__.co_varnames[:fn.__code__.co_argcount]

    def __call__(self, *args, **kwargs):
        if not _on or torch.compiler.is_compiling():  # off, or inside another region's trace: inlined
            return self.fn(*args, **kwargs)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
        if self.dynamic:
            self._mark(args, kwargs)
        return self.compiled(*args, **kwargs)

    def _mark(self, args, kwargs) -> None:
        for name, dims in self.dynamic.items():
            i = self._argnames.index(name)
            t = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(t, torch.Tensor):
                for d in (range(t.dim() - 1) if dims == (...,) else dims):
                    torch._dynamo.decorators.mark_unbacked(t, d % t.dim())


def region(fn: Callable | None = None, *, dynamic: dict[str, tuple] | None = None):
    """Decorator: fn is a compiled region (see the module docstring); `dynamic` as `Region`'s."""
    if fn is None:
        return lambda f: region(f, dynamic=dynamic)
    return Region(fn, dynamic)


# A region meets a few shapes (e.g. SwiGLU: the dense FFN, the shared and the routed experts) and a few
# autograd modes (forward, a checkpoint's replay, a no-grad rebuild from saved tensors): dynamo's default
# of 8 graphs per function is too few, and past the limit it would run the region eagerly in silence.
RECOMPILE_LIMIT = 64
# Inductor's C++ kernels run a loop on several threads from 512 elements a thread on; ATen's eager kernels,
# which the regions replace, from 32768 (at::internal::GRAIN_SIZE). On a busy CPU (a core taken by another
# process) each parallel region waits for a descheduled thread: at 512 the debug MoE's compiled step took
# 10x the eager one on 2 threads. Compiled kernels go parallel where eager ones would.
PARALLEL_GRAIN = 32768


@contextmanager
def compiled_regions(on: bool = True):
    """Inside: every region runs compiled (on) or plain (off); a region needing more graphs than
    `RECOMPILE_LIMIT` is an error, not a silent eager fallback."""
    global _on
    old, _on = _on, on
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True), \
                torch._inductor.config.patch({"cpp.min_chunk_size": PARALLEL_GRAIN}):
            yield
    finally:
        _on = old


def regions_on() -> bool:
    """Whether regions run compiled here."""
    return _on
