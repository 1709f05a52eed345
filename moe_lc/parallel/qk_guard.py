"""QK-clip's forward guard (`train.qk_clip_guard = true`): tau held inside every training forward.

K2's rule (moe_lc/parallel/qk_clip.py) rescales a head's query / key weights after the step, from the
logits that step's forward saw before its update; the update itself can then carry the head past tau in
the next forward, until the clip after it trims it (one update's growth: docs/guide/optimizer-and-zero.md
measures 7.6-8.8 at tau 8 under Muon at a high learning rate). No rule that reads past batches' logits can promise the next
batch's. The guard reads the batch's own: each attention call runs, and where a sample's head has a
largest log-sum-exp (an upper bound of its largest logit, the statistic QK-clip already uses) above
tau, the call runs again with that sample's queries of that head scaled by gamma = tau / bound. Scaling
q scales every logit of the head by gamma, for every attention kind (MLA's rope and nope parts alike),
so no training forward's logit exceeds tau (to the compute dtype's rounding). K2's rescaling still sets
the weights after the step, from the first call's statistic: the guard only catches what an update adds.

Per (sample, head), not per micro-batch: a sample's logits depend on that sample alone, so the decision is
the same under any data-parallel or micro-batch split, and every layout stays equal to one process.
Under context parallelism a sample's rows are spread over the "cp" group: its bound is all-reduced
(MAX; B x H fp32 per call, recomputation's replays included, counted like every collective) so all cp
ranks scale alike and run the ring again together. What it costs: a host read per call (whether to run
again; the dry run lists it among the step's host syncs), that all-reduce, and for calls that hit a
second attention pass whose scaled queries are kept for backward (the first pass's graph is dropped). Training forwards only (`module.training`):
evaluation and decoding see the weights as they are.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from moe_lc.ops.attention import note_max_lse
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group


class LogitGuard:
    """The guard of one attention module. tau: train.qk_clip; group: the "cp" group (None without cp).
    hits: (sample, head) pairs scaled on this rank since the last `take_hits` (replays counted again);
    gamma: the last call's factors (B, H), None where nothing was scaled."""

    def __init__(self, tau: float, group: Group | None):
        self.tau, self.group = tau, group
        self.hits, self.gamma = 0, None

    def run(self, call, q: torch.Tensor):
        """call(q) -> (result, bound (B, H) fp32: each sample's and local head's largest lse over this rank's
        query rows, -inf where it has none); q (B, S, H, D). Returns the result of the call it keeps."""
        result, bound = call(q)
        self.gamma = None
        if self.group is not None and self.group.size > 1:
            bound = bound.clone()
            comm.all_reduce(bound, self.group, op=torch.distributed.ReduceOp.MAX)
        over = bound > self.tau
        if bound.is_meta:  # the planner's trace and the dry run: the all-reduce counted, no values, no second pass
            with contextlib.suppress(RuntimeError, NotImplementedError):
                int(over.sum())  # the dry run's tracer books this host read (elsewhere a meta tensor has no value)
            return result
        n = int(over.sum())  # the host read: whether to run again
        if not n:
            return result
        self.hits += n
        self.gamma = torch.where(over, self.tau / bound, torch.ones_like(bound))
        return call(self.used(q))[0]

    def used(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, S, H, D) as the last call's kept pass saw it: scaled by `gamma` where it scaled, else q."""
        return q if self.gamma is None else q * self.gamma.to(q.dtype)[:, None, :, None]

    def sparse(self, attend, holder):
        """DeepSeek Sparse Attention's sparse stage (its own kernel, no core seam): attend(q, kv) -> (out, lse
        (B, H, S)) -> a function of the same form under the guard, each call's lse noted on `holder` (QK-clip's
        statistic keeps the first call's, what the weights give); the caller reads `gamma` for the queries
        the kept call used."""
        def guarded(q, kv):
            def call(q_):
                out, lse = attend(q_, kv)
                note_max_lse(holder, lse)
                return (out, lse), lse.detach().float().amax(2)
            return self.run(call, q)
        return guarded

    def take_hits(self) -> int:
        n, self.hits = self.hits, 0
        return n


class GuardedCore(nn.Module):
    """The core seam with a guard around it: any core whose first argument is q (B, S, H, D) and which notes
    its lse through `note_max_lse` (LocalAttention, every ring). The inner core is `inner`."""

    def __init__(self, inner: nn.Module, guard: LogitGuard):
        super().__init__()
        self.inner, self.guard = inner, guard
        inner.bound_probe = True  # note_max_lse keeps each call's (B, H) bound on it

    def forward(self, q, *args, **kwargs):
        if not self.training:
            return self.inner(q, *args, **kwargs)
        return self.guard.run(lambda q_: (self.inner(q_, *args, **kwargs), self.inner.call_bound), q)

    def extra_repr(self) -> str:
        return f"qk_clip_guard tau={self.guard.tau:g}"


def inner_core(module: nn.Module) -> nn.Module:
    """The core an attention module's kernel call reaches: its `core`, or what a guard wraps."""
    core = module.core
    return core.inner if isinstance(core, GuardedCore) else core


def qk_guard_plan(model: nn.Module, dims, plan, tau: float) -> None:
    """Plan a guard on every attention module of `model` (into the layer plan): its core wrapped, and DeepSeek
    Sparse Attention's sparse stage given the same guard (`logit_guard`)."""
    from moe_lc.config.attention_kinds import module_kinds

    group = dims["cp"] if dims is not None and dims.cp > 1 else None
    for module in model.modules():
        if type(module) not in module_kinds():
            continue
        guard = LogitGuard(tau, group)
        plan.wrap(module, "core", lambda core, g=guard: GuardedCore(core, g))
        if hasattr(module, "logit_guard"):  # a kind that calls a kernel of its own besides the core (DSA)
            plan.set(module, logit_guard=guard)
