"""ZeRO-3 (`parallel.placement.params = "sharded_gather"`): each rank keeps 1/N of the parameters; a unit's
parameters are all-gathered before its forward and again before its backward, one unit ahead, and freed after.

Rajbhandari et al. 2020, ZeRO stage 3 (P_os+g+p); PyTorch FSDP (Zhao et al. 2023) gathers the same way. A
unit is a set of ZeRO buckets: the embedding, each block ("layers.<i>"), and the output side (final norm,
head, MTP modules) together, by `unit_of`. ZeroOptimizer lays its buckets so that none spans two units and
gives each bucket a storage of its own (zero/param_store.py's `GatheredParams`); this file decides when those
storages hold parameters.

When: the model marks, through its `hold` seam (moe_lc/model/seams.py), each chain of phases that reads a
module's parameters (the embedding's phase, a block's phases, the head's). `ParamGather.hold` wraps it:
   forward   before the first phase: its units gathered (waited for) and the next unit of the chunk
             prefetched (its all-gather launched); after the last phase: released.
   backward  an autograd node on the last phase's outputs gathers them again before the chain's backward
             (and prefetches the unit whose backward comes next); one on the first phase's inputs releases
             them once those inputs' gradients are computed, after every node of the chain that reads a
             parameter. The embedding's backward reads no parameter: it is not gathered again.
Units are counted (`refs`): a unit that two micro-batches use at once (a pipeline's interleaved forward and
backward) is gathered once and freed when the last lets go. `sweep` (after each step's backward) frees what
a chain left held: a chain whose inputs need no gradient never fires its releasing node.

A deferred weight gradient (a split backward's W pass) reads activations, not parameters: units are released
after B. A gather first settles what an offloaded optimizer still owes those shards (its deferred updates,
zero/host_step.py). Traffic per step: each unit's buckets x (N-1)/N, twice per micro-batch (forward,
backward; the embedding once, and twice more where the head's chain reads it: a tied head, MTP), plus ZeRO-2's
reduce-scatter rounds, and no all-gather after the update: for one
micro-batch the ZeRO paper's 3 psi against ZeRO-1's 2 psi (the planner counts it by running this on the model's
chains: tools/planner/zero_trace.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from moe_lc.model.block import named


def install_holds(optimizer, parallel):
    """The model's `hold` seam for the optimizer's placement (`ZeroPlacement.holder`): ZeRO-3's `ParamGather`
    (returned), or where the parameters stay whole and an offloaded optimizer defers its updates, `ParamReady`
    (zero/host_step.py); None."""
    holder = optimizer.placement.holder(optimizer, parallel)
    for chunk in parallel.chunks if holder is not None else ():
        for module in chunk.modules():
            if hasattr(module, "hold"):
                module.hold = holder.hold
    return holder if isinstance(holder, ParamGather) else None


def unit_of(name: str) -> str:
    """The gather unit of a parameter, by its single-device name: "embed", "layers.<i>", or "head" (the
    final norm, output head and MTP modules, which the head's phase runs together)."""
    first, _, rest = name.partition(".")
    if first == "layers":
        return "layers." + rest.partition(".")[0]
    return "embed" if first == "embed" else "head"


class _Unit:
    def __init__(self, key: str):
        self.key = key
        self.buckets: list = []  # (ShardedParams, bucket), over every ZeRO group
        self.refs = 0  # holders: chains in forward or backward, and an outstanding prefetch
        self.prefetched = False  # one of the refs is a prefetch the next acquire takes over
        self.works: list = []  # the all-gathers in flight
        self.gathered = False

    def elements(self) -> int:
        return sum(b.size for _, b in self.buckets)


class ParamGather:
    """When each unit of a ZeRO-3 optimizer's parameters is gathered (module docstring). optimizer: a
    ZeroOptimizer whose parameters are gathered (`GatheredParams`); parallel: its model (`Parallelized`), whose
    chunks give the forward order prefetching follows. Its `hold` is the seam of the chunks and their blocks
    (`install_holds`)."""

    def __init__(self, optimizer, parallel):
        self.units: dict[str, _Unit] = {}
        for s in optimizer.shards:
            for b in s.buckets:
                self.units.setdefault(b.unit, _Unit(b.unit)).buckets.append((s, b))
        self._unit_of_param = {id(p): unit_of(n) for n, p, _ in parallel.named_parameters()}
        self.next, self.prev, seen = {}, {}, set()
        for chunk in parallel.chunks:  # forward order of each chunk's units, each unit in one chunk
            keys = [k for k in dict.fromkeys(self._unit_of_param.get(id(p)) for p in chunk.parameters())
                    if k in self.units and k not in seen]
            seen.update(keys)
            self.next.update(zip(keys, keys[1:]))
            self.prev.update(zip(keys[1:], keys))
        self.regathered: set[str] = set()  # units whose own chain gathers them again for its backward
        self.by_unit: Counter = Counter()  # unit key -> gathers (0 -> 1 holder) since construction (the planner)

    @property
    def gathers(self) -> int:
        """Units gathered since construction (tests)."""
        return sum(self.by_unit.values())

    # -- counting holders -------------------------------------------------------------------------------
    def _ref(self, u: _Unit) -> None:
        if u.refs == 0 and not u.gathered:
            for s, b in u.buckets:  # an offloaded optimizer's deferred update of these shards, first
                s.update_site.ready(b)
            u.works = [s.param_store.gather(b) for s, b in u.buckets]
            u.gathered = True
            self.by_unit[u.key] += 1
        u.refs += 1

    def acquire(self, units) -> None:
        """Hold `units` (gathered, waited for)."""
        for u in units:
            if u.prefetched:
                u.prefetched = False  # its prefetch's ref becomes ours
            else:
                self._ref(u)
        for u in units:
            self._wait(u)

    def prefetch(self, key: str | None) -> None:
        """Launch unit `key`'s gather ahead of its use (the next acquire of it takes this hold over)."""
        u = self.units.get(key)
        if u is not None and not u.prefetched:
            u.prefetched = True
            self._ref(u)

    def release(self, units) -> None:
        for u in units:
            u.refs -= 1
            if u.refs == 0:
                self._free(u)

    @staticmethod
    def _wait(u: _Unit) -> None:
        for w in u.works:
            if w is not None:
                w.wait()
        u.works = []

    def _free(self, u: _Unit) -> None:
        self._wait(u)
        for s, b in u.buckets:
            s.param_store.free(b)
        u.gathered = False

    def sweep(self) -> int:
        """Free every unit still gathered (unused prefetches, chains whose releasing node never ran) -> how
        many were; called once a step's backward is done, before the update writes the shards."""
        held = 0
        for u in self.units.values():
            if u.gathered:
                held += 1
                u.refs, u.prefetched = 0, False
                self._free(u)
        return held

    @contextlib.contextmanager
    def gathered(self):
        """Every unit gathered within (checkpoints, final-state gathering, a check of the parameters). What is
        written into the parameters within is lost at exit: the shards stay the truth."""
        units = list(self.units.values())
        self.acquire(units)
        try:
            yield
        finally:
            self.release(units)

    # -- the seam -----------------------------------------------------------------------------------------
    def hold(self, chain: list, modules, backward: bool = True) -> list:
        """The `hold` seam: `chain` (phases, each a function of a tuple of tensors returning one) wrapped so
        that the parameters of `modules` are gathered while it runs forward, and again (backward=True) while
        its backward runs; the first module's unit leads the prefetch."""
        keys = list(dict.fromkeys(self._unit_of_param[id(p)] for m in modules if m is not None
                                  for p in m.parameters() if id(p) in self._unit_of_param))
        units = [self.units[k] for k in keys if k in self.units]
        if not units or not chain:
            return chain
        lead = keys[0]
        if backward:
            self.regathered.add(lead)

        def finish(out):
            if backward and torch.is_grad_enabled():
                out = _through(_GatherForBackward, self, units, lead, out)
            self.release(units)
            return out

        def first(*state, phase=chain[0]):
            self.acquire(units)
            self.prefetch(self.next.get(lead))
            if torch.is_grad_enabled():
                state = _through(_ReleaseAfterBackward, self, units, lead, state)
            out = phase(*state)
            return finish(out) if len(chain) == 1 else out

        def last(*state, phase=chain[-1]):
            return finish(phase(*state))

        if len(chain) == 1:
            return [named(first, chain[0].__name__)]
        return [named(first, chain[0].__name__), *chain[1:-1], named(last, chain[-1].__name__)]


def _through(boundary, gather: ParamGather, units, lead: str, state: tuple) -> tuple:
    """state with its tensors that need a gradient passed through `boundary`, one autograd node."""
    at = [i for i, t in enumerate(state) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at:
        return state
    out = list(state)
    for i, t in zip(at, boundary.apply(gather, units, lead, *(state[i] for i in at))):
        out[i] = t
    return tuple(out)


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on a chain's inputs; its backward (the chain's backward done) releases the chain's units."""

    @staticmethod
    def forward(ctx, gather, units, lead, *tensors):
        ctx.gather, ctx.units = gather, units
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gather.release(ctx.units)
        return (None, None, None, *grads)


class _GatherForBackward(torch.autograd.Function):
    """Identity on a chain's outputs; its backward (before the chain's) gathers the chain's units and
    prefetches the unit whose backward comes next."""

    @staticmethod
    def forward(ctx, gather, units, lead, *tensors):
        ctx.gather, ctx.units, ctx.lead = gather, units, lead
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        gather = ctx.gather
        gather.acquire(ctx.units)
        previous = gather.prev.get(ctx.lead)
        if previous in gather.regathered:
            gather.prefetch(previous)
        return (None, None, None, *grads)
