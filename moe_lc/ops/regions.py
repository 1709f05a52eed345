"""Compiled regions: the model's pure compute pieces, which `train.compile` runs through torch.compile.

A region is a function of tensors and constants only: no collective, no seam, no module, no Python
state and no side effect. So dynamo traces each whole (`fullgraph=True`: a graph break inside one is an
error, not a silent fallback), and one compiled graph serves every block that calls the region with
the same shapes and dtypes. What lies between regions runs eagerly, exactly as without compile: the
one Linear's GEMMs with their tensor-parallel collectives, FP8 recipes and deferred weight gradients,
the attention core and the ring, the token dispatcher's all-to-alls, and the recomputation and FP8
caching seams, which therefore keep their semantics (a checkpoint replays a region by calling it again;
saved-tensor hooks see what the region's compiled autograd node saves).

A module runs its regions through its `run_region` seam, `module.run_region(region, *args)`
(moe_lc/model/seams.py): `run_now` by default, the plain function, as calling the region itself does.
Under `train.compile` the layer plan gives the modules of a rank's model its compiled runner
(moe_lc/parallel/compile.py), so a model is compiled or not as a whole, decided once with the rest of
its plan, and nothing else in the process (eval, a second model, the tests around it) is affected.
Nothing here holds state. Shapes: every graph is specialized to its shapes, except the dims a region
declares `dynamic` (dims that vary from step to step, like the rows an expert-parallel rank receives),
which the runner marks unbacked: one graph for every size, 0 and 1 included, so they never recompile.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


class Region:
    """fn, marked as a compiled region; calling it calls fn. dynamic: {argument name: dims} whose sizes vary
    between calls (negative dims count from the end; all but the last with ..., e.g. rows of (..., K))."""

    def __init__(self, fn: Callable, dynamic: dict[str, tuple] | None = None):
        functools.update_wrapper(self, fn)
        self.fn, self.dynamic = fn, dynamic or {}
        self._argnames = fn.__code__.co_varnames[:fn.__code__.co_argcount]

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        """Mark the `dynamic` dims of this call's tensors unbacked (before a compiled graph runs on them)."""
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
