"""Which ZeRO: the recipe's `[parallel.placement]` as three strategies, chosen here once.

Each key of the section names one strategy of every ZeRO group (zero/optimizer.py's ShardedParams composes them):

  grads      GradSync (zero/grad_sync.py): how gradients reach this rank's reduced 1/N
               "replicated"      BucketSync   ZeRO-1's full fp32 main-grad buffer, one reduce-scatter per bucket
               "sharded"         GradRounds   ZeRO-2's rounds: reduce-scattered per micro-batch (grad_rounds.py)
  params     ParamStore (zero/param_store.py): where parameters live between their uses
               "replicated"      FlatParams      one flat buffer, all-gathered after the update
               "sharded_gather"  GatheredParams  ZeRO-3: 1/N kept, units gathered around their use (implies
                                                 grads = "sharded")
  optimizer  UpdateSite (zero/update_site.py): where master, state and the update live
               "device"          DeviceUpdate
               "offloaded"       HostUpdate   host memory, the update on the CPU (zero/host_step.py); with
                                              optimizer_overlap, deferred to the next forward

The trainer (ZeroOptimizer.from_config), the planner (tools/planner/) and the dry run (tools/dry_run/) ask a
`ZeroPlacement` and never the flags: a new variant is a class in its strategy's file and an entry below.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lc.config.sections import PlacementConfig
from moe_lc.parallel.zero.grad_rounds import GradRounds
from moe_lc.parallel.zero.grad_sync import BucketSync, GradSync
from moe_lc.parallel.zero.host_step import HostUpdate, ParamReady
from moe_lc.parallel.zero.param_gather import ParamGather
from moe_lc.parallel.zero.param_store import FlatParams, GatheredParams, ParamStore
from moe_lc.parallel.zero.update_site import DeviceUpdate, UpdateSite

GRADS: dict[str, type[GradSync]] = {"replicated": BucketSync, "sharded": GradRounds}
PARAMS: dict[str, type[ParamStore]] = {"replicated": FlatParams, "sharded_gather": GatheredParams}
OPTIMIZER: dict[str, type[UpdateSite]] = {"device": DeviceUpdate, "offloaded": HostUpdate}


@dataclass(frozen=True)
class ZeroPlacement:
    """The three strategies of every ZeRO group (module docstring); the default is ZeRO-1 on the device.
    overlap: `parallel.placement.optimizer_overlap` (a host update waits for the next forward)."""

    grads: type[GradSync] = BucketSync
    params: type[ParamStore] = FlatParams
    optimizer: type[UpdateSite] = DeviceUpdate
    overlap: bool = False

    @classmethod
    def from_config(cls, placement: PlacementConfig) -> ZeroPlacement:
        """The strategies `[parallel.placement]` names; ZeRO-3's gathered parameters shard the gradients too."""
        grads = "sharded" if PARAMS[placement.params].gathered else placement.grads
        return cls(GRADS[grads], PARAMS[placement.params], OPTIMIZER[placement.optimizer],
                   placement.optimizer_overlap)

    @property
    def stage(self) -> int:
        """The ZeRO paper's stage: 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters)."""
        return 3 if self.params.gathered else 1 if self.grads.full_buffer else 2

    @property
    def grads_sharded(self) -> bool:
        """No full-size gradient buffer: only the reduced 1/N lives through the step."""
        return not self.grads.full_buffer

    @property
    def params_gathered(self) -> bool:
        """Parameters present only around their use (ZeRO-3)."""
        return self.params.gathered

    @property
    def offloaded(self) -> bool:
        """Master and state in host memory, the update on the CPU."""
        return self.optimizer.on_host

    @property
    def deferred(self) -> bool:
        """Updates left owed when the step returns, run as the next forward needs each bucket."""
        return self.optimizer.on_host and self.overlap

    def describe(self) -> str:
        return f"ZeRO-{self.stage}" + (" + optimizer offload" if self.offloaded else "")

    def holder(self, optimizer, parallel):
        """The model's `hold` seam (moe_lc/model/seams.py) for this placement, or None: ZeRO-3's `ParamGather`
        (param_gather.py); where parameters stay whole, a deferring host update's `ParamReady` (host_step.py)."""
        if self.params.gathered:
            return ParamGather(optimizer, parallel)
        return ParamReady(optimizer) if self.deferred else None
