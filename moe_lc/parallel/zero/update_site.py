"""Where a ZeRO group's optimizer update runs: the strategy `parallel.placement.optimizer` chooses
(zero/strategies.py), and its device variant.

An `UpdateSite` holds this rank's shard of the group's fp32 `master` weights and of the update rule's `state`
((P/N,) each, as the rule declares them: moe_lc/optim/rule.py), names the gradient tensor the rule reads
(`grad`), and runs a step once the reduced gradient shard is clipped (`ShardedParams.step_`):

  DeviceUpdate  optimizer = "device" (here): master and state beside the parameters; the rule updates the
                whole shard, QK-clip scales its rows, and every bucket is published (`ParamStore.publish`)
  HostUpdate    optimizer = "offloaded" (zero/host_step.py): master and state in host memory, the update on
                the CPU bucket by bucket, overlapping the copies and the all-gathers; with
                `parallel.placement.optimizer_overlap` owed until the next forward needs each bucket
"""

from __future__ import annotations

import torch

from moe_lc.optim.rule import UpdateRule


class UpdateSite:
    """One ZeRO group's update (module docstring). owner: its ShardedParams (buckets, grad_shard, view,
    param_store); deferred: updates may wait for the next forward (`ready`), where the site supports it."""

    on_host = False  # master and state in host memory (the planner's placement table: O)

    def __init__(self, owner, rule: UpdateRule, deferred: bool = False):
        self.owner = owner
        self.master: torch.Tensor  # (P/N,) fp32
        self.state: dict[str, torch.Tensor]  # {spec.name: (P/N,) spec.dtype}

    @property
    def grad(self) -> torch.Tensor:
        """The (P/N,) fp32 gradients the rule reads: the reduced, clipped shard."""
        return self.owner.grad_shard

    def step_(self, rule: UpdateRule, lr: float, step: int, row_scales: dict | None) -> None:
        """The rule's step on the master shard, QK-clip's `row_scales`, every bucket published."""
        raise NotImplementedError

    def ready(self, b) -> None:
        """Bucket b's parameters updated and in place (what a deferred update still owes them)."""

    def flush(self) -> None:
        """Every update still owed done (before anything reads the masters or the parameters outside a forward)."""

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """What it holds, by the dry run's memory category ("optimizer": device memory; "host")."""
        return {"optimizer": [self.master, *self.state.values()]}


class DeviceUpdate(UpdateSite):
    """optimizer = "device": master, state and the update beside the parameters (module docstring)."""

    def __init__(self, owner, rule: UpdateRule, deferred: bool = False):
        super().__init__(owner, rule, deferred)
        n, device = owner.grad_shard.numel(), owner.grad_shard.device
        self.master = torch.empty(n, device=device, dtype=torch.float32)
        self.state = {spec.name: torch.full((n,), spec.init, device=device, dtype=spec.dtype)
                      for spec in rule.states()}

    def step_(self, rule: UpdateRule, lr: float, step: int, row_scales: dict | None) -> None:
        s = self.owner
        rule.update_(s.view, lr, step)
        for b in s.buckets if row_scales else ():
            s.scale_bucket_rows_(b, row_scales)
        s.gather_params()
