"""Where a ZeRO group's parameters live between their uses: the strategy `parallel.placement.params` chooses
(zero/strategies.py).

Every parameter of a group is a view into its bucket's `full` (size,) compute-dtype tensor (zero/layout.py's
`Bucket`). The store decides what backs those tensors and how each bucket's updated 1/N, the values this
rank's update wrote, reaches every rank:

  FlatParams      params = "replicated" (ZeRO-1, 2): one flat (P,) buffer, each bucket's `full` a slice of
                  it, always present; after the update each bucket's shard is all-gathered into it
  GatheredParams  params = "sharded_gather" (ZeRO-3): the rank keeps its (P/N,) `shard` alone; each bucket's
                  `full` has a storage of its own, allocated and all-gathered while its gather unit is in use
                  (zero/param_gather.py decides when) and freed after; buckets end where a unit does
                  (`unit_of`); the update writes the shard and gathers nothing
"""

from __future__ import annotations

import torch

from moe_lc.ops.fp8_weights import forget as forget_fp8_weights
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.memory.trace_hooks import tell
from moe_lc.parallel.zero.layout import Bucket
from moe_lc.parallel.zero.param_gather import unit_of


def resize_storage(t: torch.Tensor, nbytes: int) -> None:
    """t's storage resized to nbytes in place (0 frees it; its views stay, sized 0, until it grows back)."""
    t.untyped_storage().resize_(nbytes)
    tell("resized", t)  # the dry run's trace: no tensor was allocated


class ParamStore:
    """The parameters of one ZeRO group on this rank (module docstring). buckets: its layout; group: the ranks
    a bucket's shards are gathered from; dtype: the compute dtype."""

    gathered = False  # whether a parameter is present only around its use (ZeRO-3)
    unit_of = None  # param name -> its gather unit, where buckets must end (None: anywhere)

    def __init__(self, buckets: list[Bucket], group: Group, device: torch.device, dtype: torch.dtype):
        self.buckets, self.group = buckets, group

    def place(self, b: Bucket) -> torch.Tensor:
        """Bucket b's (size,) tensor, for its parameters' views (written once by the caller, then `settle`)."""
        raise NotImplementedError

    def settle(self, b: Bucket) -> None:
        """Bucket b's parameters hold their initial values."""

    def own(self, b: Bucket) -> torch.Tensor:
        """(size / N,) compute dtype: this rank's values of bucket b, what its all-gather sends."""
        raise NotImplementedError

    def publish(self, b: Bucket, shard: torch.Tensor):
        """Bucket b's updated shard values (cast into this rank's slice; non-blocking from pinned host memory)
        and, where parameters stay whole, the bucket's all-gather launched -> its work (None: nothing to wait)."""
        self.own(b).copy_(shard, non_blocking=True)
        return self.gather(b)

    def gather(self, b: Bucket):
        """Bucket b's parameters all-gathered from every rank's shard -> the work. Their FP8 copies are dropped:
        the gather writes their storage behind their version counters (moe_lc/ops/fp8_weights.py)."""
        forget_fp8_weights(p for p, _ in b.params)
        return comm.all_gather(b.full, self.own(b), self.group, async_op=True)

    def free(self, b: Bucket) -> None:
        """Release bucket b's gathered parameters (ZeRO-3)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its parameters")

    def tensors(self) -> list[torch.Tensor]:
        """What it holds through a step (the dry run labels it parameter memory)."""
        raise NotImplementedError

    def transient(self) -> list[torch.Tensor]:
        """Tensors whose storage comes and goes within a step (the dry run's transients)."""
        return []


class FlatParams(ParamStore):
    """ZeRO-1, 2: the group's parameters in one flat (P,) buffer, always present (module docstring)."""

    def __init__(self, buckets: list[Bucket], group: Group, device: torch.device, dtype: torch.dtype):
        super().__init__(buckets, group, device, dtype)
        self.buffer = torch.zeros(sum(b.size for b in buckets), device=device, dtype=dtype)

    def place(self, b: Bucket) -> torch.Tensor:
        return self.buffer[b.start:b.start + b.size]

    def own(self, b: Bucket) -> torch.Tensor:
        return b.own(self.buffer, self.group.rank)

    def tensors(self) -> list[torch.Tensor]:
        return [self.buffer]


class GatheredParams(ParamStore):
    """ZeRO-3: this rank's (P/N,) shard kept; a bucket's storage allocated only while gathered (module
    docstring)."""

    gathered = True
    unit_of = staticmethod(unit_of)

    def __init__(self, buckets: list[Bucket], group: Group, device: torch.device, dtype: torch.dtype):
        super().__init__(buckets, group, device, dtype)
        self.device, self.dtype = device, dtype
        self.shard = torch.empty(sum(b.shard_size for b in buckets), device=device, dtype=dtype)

    def place(self, b: Bucket) -> torch.Tensor:
        return torch.zeros(b.size, device=self.device, dtype=self.dtype)

    def settle(self, b: Bucket) -> None:
        """This rank's shard of bucket b kept, the rest freed (the whole model is never held at once)."""
        self.own(b).copy_(b.own(b.full, self.group.rank, 0))
        self.free(b)

    def own(self, b: Bucket) -> torch.Tensor:
        return b.part(self.shard)

    def publish(self, b: Bucket, shard: torch.Tensor):
        """The shard written; the next forward gathers it, unit by unit (param_gather.py)."""
        forget_fp8_weights(p for p, _ in b.params)  # (a unit gathered across the update: its copies are stale)
        self.own(b).copy_(shard, non_blocking=True)
        return None

    def gather(self, b: Bucket):
        resize_storage(b.full, b.size * b.full.element_size())
        return super().gather(b)

    def free(self, b: Bucket) -> None:
        """Bucket b's storage released (its parameters' views stay, sized 0, until gathered again), and their
        FP8 copies with it: a gathered unit's weights are quantized once per gather."""
        forget_fp8_weights(p for p, _ in b.params)
        resize_storage(b.full, 0)

    def tensors(self) -> list[torch.Tensor]:
        return [self.shard]

    def transient(self) -> list[torch.Tensor]:
        return [b.full for b in self.buckets]
