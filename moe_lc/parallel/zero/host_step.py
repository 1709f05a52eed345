"""Optimizer offloading (`parallel.placement.optimizer = "offloaded"`): ZeRO's fp32 master and the update
rule's state live in host memory and the update runs on the CPU: `HostUpdate`, the `UpdateSite` variant
(zero/update_site.py) that placement chooses (zero/strategies.py).

Per ZeRO group of a rank (zero/optimizer.py's ShardedParams, n = its shard's elements), in host memory (pinned on
a GPU machine, so the copies are asynchronous DMA):

    master, state[...]  (n,)  the rule's tensors, as on the device otherwise (checkpoints are unchanged)
    grad_host           (n,)  fp32: the reduced, clipped gradient shard, copied down each step
    param_host          (n,)  compute dtype: the updated master, cast, on its way up

The reduce-scatter's output (`grad_shard`) and the grad norm stay on the device. A step: every bucket's
gradient shard is queued for the host at once (one event each); then for each bucket: wait for its copy,
the rule's update on its slice (`ShardView.part`) on the CPU's threads, QK-clip's row factors, the cast into
`param_host`, the copy into the device's parameter buffer, and the bucket's all-gather launched, so the
CPU's update of one bucket overlaps its neighbours' copies and all-gathers. With
`parallel.placement.optimizer_overlap` (the default) the updates are owed, not run, when the step returns:
the next forward runs them in its own order (the buffer's last bucket first), each just before the first
chain that reads its parameters (`ParamReady`, the model's `hold` seam; ZeRO-3's unit gathers ask the same),
so the CPU's work on later buckets overlaps the device's forward of earlier units, whose kernels are already
queued. Same values, one step's latency hidden: unlike DeepSpeed's ZeRO-Offload, which overlaps by training
on one-step-stale parameters, no forward reads a parameter before its update. Whatever reads masters or
parameters outside a forward (checkpoints, final states, the EMA) calls `ZeroOptimizer.flush` first; a
deferred update's all-gathers are counted in the step whose forward runs them. PCIe bytes per step: 4 B down
and the compute dtype's bytes up per shard element (`transfer_bytes`, what the planner books).

Values: the rule computes on the same fp32 numbers as on the device and an elementwise rule's parts are
its whole, so on a CPU the result is bit for bit the device placement's (tests/test_optimizer_offload.py);
on a GPU the CPU's AdamW formula replaces torch's fused CUDA kernel (fp32 rounding apart). Muon runs its
Newton-Schulz on the CPU too (fp32 there: `train.muon_ns_dtype` auto), gathering TP slices on the device.
Not measured: the overlap's gain, which only a GPU shows (on a CPU the forward and the update share cores).

On the meta device (the planner's trace, the dry run) the host tensors are meta too; the update runs in
trace_hooks' `on_host`, so the trace counts what it allocates as host memory, not the device's.
"""

from __future__ import annotations

from collections import deque

import torch

from moe_lc.optim.rule import UpdateRule
from moe_lc.parallel.memory.trace_hooks import on_host
from moe_lc.parallel.zero.update_site import UpdateSite


def host_device(device: torch.device) -> torch.device:
    """Where host-memory state of parameters on `device` lives: the CPU, or meta in a trace."""
    return device if device.type == "meta" else torch.device("cpu")


def host_empty(n: int, dtype: torch.dtype, device: torch.device, fill: float | None = None) -> torch.Tensor:
    """(n,) host tensor for parameters on `device`: pinned when that is a GPU (asynchronous copies)."""
    out = torch.empty(n, dtype=dtype, device=host_device(device), pin_memory=device.type == "cuda")
    return out if fill is None else out.fill_(fill)


class HostUpdate(UpdateSite):
    """One ShardedParams group's master, state and staging in host memory and its bucket-by-bucket step (module
    docstring). deferred: `step_` only queues the gradients' copies; each bucket's update runs when `ready`
    asks for it (the next forward, `ParamReady` or ZeRO-3's gathers) or at `flush`."""

    on_host = True

    def __init__(self, shard, rule: UpdateRule, deferred: bool = False):
        super().__init__(shard, rule, deferred)
        self.shard, self.deferred = shard, deferred
        device, n = shard.device, shard.grad_shard.numel()
        self.master = host_empty(n, torch.float32, device)
        self.state = {spec.name: host_empty(n, spec.dtype, device, fill=spec.init) for spec in rule.states()}
        self.grad_host = host_empty(n, torch.float32, device, fill=0.0)
        self.param_host = host_empty(n, shard.param_dtype, device)
        self.sent = {"d2h": 0, "h2d": 0}  # bytes copied each way since construction (tests, the planner)
        self.pending: deque = deque()  # (bucket index, its copy's event), in forward order, not yet updated
        self.works: dict[int, object] = {}  # bucket index -> its publish's all-gather, not yet waited for
        self.update = None  # (rule, lr, step, row_scales) of the step in progress

    @property
    def grad(self) -> torch.Tensor:
        """What the rule reads: the clipped gradient shard's host copy."""
        return self.grad_host

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.grad_host, self.param_host))

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"host": [self.master, *self.state.values(), self.grad_host, self.param_host]}

    @torch.no_grad()
    def step_(self, rule, lr: float, step: int, row_scales: dict | None) -> None:
        """The step of a group whose reduced gradient shard is clipped (ShardedParams.step_): every bucket's
        copy down queued, then the updates (now, or bucket by bucket as the next forward needs them)."""
        s = self.shard
        self.flush()
        landed = []
        for b in s.buckets:
            part = slice(b.shard_start, b.shard_start + b.shard_size)
            self.grad_host[part].copy_(s.grad_shard[part], non_blocking=True)
            landed.append(_event_after_copy(s.grad_shard))
            self.sent["d2h"] += b.shard_size * 4
        # the buffer runs in backward order: the next forward reaches its last bucket first
        self.pending = deque(reversed(list(enumerate(landed))))
        self.update = (rule, lr, step, row_scales)
        if not self.deferred:
            self.flush()

    def _update(self, index: int, event) -> None:
        """Bucket `index`'s update on the host, cast, copied up, its all-gather launched."""
        s, (rule, lr, step, row_scales) = self.shard, self.update
        b = s.buckets[index]
        if event is not None:
            event.synchronize()
        lo, hi = b.shard_start, b.shard_start + b.shard_size
        with on_host():
            rule.update_(s.view.part(lo, hi), lr, step)
            if row_scales:
                s.scale_bucket_rows_(b, row_scales)
            self.param_host[lo:hi].copy_(s.master[lo:hi])
        self.works[index] = s.param_store.publish(b, self.param_host[lo:hi])
        self.sent["h2d"] += b.shard_size * self.param_host.element_size()

    @torch.no_grad()
    def ready(self, b) -> None:
        """Bucket b updated and its parameters in place: the pending updates up to it run (in forward order,
        so a forward's early units wait for no later bucket) and its all-gather is waited for."""
        index = b.index
        if any(i == index for i, _ in self.pending):
            while index not in self.works:
                self._update(*self.pending.popleft())
        work = self.works.pop(index, None)
        if work is not None:
            work.wait()

    @torch.no_grad()
    def flush(self) -> None:
        """Every pending update done and every all-gather waited for."""
        while self.pending:
            self._update(*self.pending.popleft())
        for work in self.works.values():
            if work is not None:
                work.wait()
        self.works.clear()


class ParamReady:
    """The `hold` seam (moe_lc/model/seams.py) of a model whose offloaded optimizer defers its updates
    (`parallel.placement.optimizer_overlap`) and whose parameters stay whole (ZeRO-1, 2): before a chain's
    forward, the buckets holding its parameters are updated and gathered (`HostUpdate.ready`); their
    all-gathers and the CPU's updates of later buckets overlap the device's work on earlier units. ZeRO-3's
    gathers ask for the same before each unit (param_gather.py)."""

    def __init__(self, optimizer):
        self.where = {id(p): (s, b) for s in optimizer.shards for b in s.buckets for p, _ in b.params}

    def hold(self, chain: list, modules, backward: bool = True) -> list:
        needed = list({id(b): (s, b) for m in modules if m is not None for p in m.parameters()
                       if id(p) in self.where for s, b in [self.where[id(p)]]}.values())
        if not needed or not chain:
            return chain

        def first(*state, phase=chain[0]):
            for s, b in needed:
                s.update_site.ready(b)
            return phase(*state)

        first.__name__ = chain[0].__name__
        return [first, *chain[1:]]


def _event_after_copy(device_tensor: torch.Tensor):
    """A CUDA event recorded after the copy just queued on the current stream (None off CUDA: copies there
    are synchronous)."""
    if not device_tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def transfer_bytes(shard_elems: int, compute_bytes: int) -> dict[str, int]:
    """PCIe bytes per step of a group's offloaded optimizer: its fp32 gradient shard down, the updated
    parameters up in the compute dtype."""
    return {"d2h": 4 * shard_elems, "h2d": compute_bytes * shard_elems}
