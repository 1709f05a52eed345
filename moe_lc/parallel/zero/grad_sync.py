"""How a ZeRO group's gradients reach this rank's reduced shard: the strategy `parallel.placement.grads` chooses
(zero/strategies.py), and ZeRO-1's variant, per-step buckets.

A `GradSync` receives every gradient a parameter of its group gets (`add`, from the parameter's
post-accumulate-grad hook, `ShardedParams.on_grad`) and leaves the group's sum, this rank's 1/N of each
bucket, in `shard` ((P/N,) fp32, `ShardedParams.grad_shard`) by the end of `finish`. Two variants:

  BucketSync   grads = "replicated" (ZeRO-1, here): a full-size fp32 main-grad buffer (P,) accumulates every
               micro-batch's gradients; a bucket's reduce-scatter is launched asynchronously when its last
               gradient of the step arrives (the count `begin_step` expects), overlapping the rest of backward.
               It reduces in place, into the bucket's own 1/N of the buffer (as Megatron-LM's distributed
               optimizer does), so `shard` has no storage through forward and backward: `finish` allocates it
               and copies the reduced slices in, `zero_grad` frees it again. The (P/N,) fp32 shard then
               costs memory only at the optimizer step, when the activations are gone.
  GradRounds   grads = "sharded" (ZeRO-2, zero/grad_rounds.py): no full buffer; each micro-batch's gradients
               are reduce-scattered round by round as backward fills a bucket

A frozen group (learning-rate scale 0) drops its gradients before they reach the sync (ShardedParams).
"""

from __future__ import annotations

import torch

from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.zero.layout import Bucket
from moe_lc.parallel.zero.param_store import resize_storage


class GradSync:
    """A ZeRO group's gradient synchronization (module docstring). buckets: the group's layout; group: the
    ranks its gradients are summed over; shard: (P/N,) fp32, where the reduced sums land."""

    full_buffer = False  # whether it holds a full-size (P,) gradient buffer (the planner's placement table)

    def __init__(self, buckets: list[Bucket], group: Group, shard: torch.Tensor):
        self.buckets, self.group, self.shard = buckets, group, shard

    def begin_step(self, expected: list[int]) -> None:
        """Expect `expected[i]` gradient arrivals in bucket i this step."""

    def add(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """One gradient of parameter p (of this group) arrived."""
        raise NotImplementedError

    def finish(self) -> None:
        """Every gradient of the step is in: the reduced sums complete in `shard` when it returns."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Clear what it accumulated, `shard` included."""
        self.shard.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """What it holds through a step besides `shard` (the dry run labels it gradient memory)."""
        return []


class BucketSync(GradSync):
    """ZeRO-1: a full-size fp32 main-grad buffer, one reduce-scatter per bucket per step (module docstring)."""

    full_buffer = True

    def __init__(self, buckets: list[Bucket], group: Group, shard: torch.Tensor):
        super().__init__(buckets, group, shard)
        numel = sum(b.size for b in buckets)
        self.buffer = torch.zeros(numel, device=shard.device, dtype=torch.float32)  # (P,) the main grads
        self.slot = {id(p): (self.buffer[off:off + p.numel()].view_as(p), b.index)  # -> (main-grad view, bucket)
                     for b in buckets for p, off in b.params}
        self.arrived = [0] * len(buckets)
        self.expected = [0] * len(buckets)
        self.works: list = [None] * len(buckets)  # each bucket's reduce-scatter in flight
        self.launched = [False] * len(buckets)
        self.sync = False  # inside a step (`begin_step` .. `finish`): a full bucket is launched
        self.shard_bytes = shard.untyped_storage().nbytes()
        resize_storage(shard, 0)  # allocated by `finish`, at the optimizer step

    def begin_step(self, expected: list[int]) -> None:
        self.sync, self.expected = True, list(expected)
        self.arrived, self.launched, self.works = [0] * len(expected), [False] * len(expected), [None] * len(expected)

    def add(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        main_grad, index = self.slot[id(p)]
        main_grad.add_(grad)
        self.arrived[index] += 1
        if self.sync and self.arrived[index] == self.expected[index]:
            self._launch(self.buckets[index])

    def _own(self, b: Bucket) -> torch.Tensor:
        """(shard_size,) this rank's 1/N of bucket b in the buffer: where its reduce-scatter lands."""
        at = b.start + self.group.rank * b.shard_size
        return self.buffer[at:at + b.shard_size]

    def _launch(self, b: Bucket) -> None:
        full = self.buffer[b.start:b.start + b.size]
        self.works[b.index] = comm.reduce_scatter(self._own(b), full, self.group, async_op=True)
        self.launched[b.index] = True

    def finish(self) -> None:
        """Launch the buckets whose gradients never all arrived (unused parameters), wait for every one, copy
        each bucket's reduced 1/N into `shard` (allocated now)."""
        for b in self.buckets:
            if not self.launched[b.index]:
                self._launch(b)
        for i, work in enumerate(self.works):
            if work is not None:
                work.wait()
            self.launched[i], self.works[i] = False, None
        self.sync = False
        resize_storage(self.shard, self.shard_bytes)
        for b in self.buckets:
            b.part(self.shard).copy_(self._own(b))

    def zero_grad(self) -> None:
        self.buffer.zero_()
        resize_storage(self.shard, 0)

    def tensors(self) -> list[torch.Tensor]:
        return [self.buffer]
