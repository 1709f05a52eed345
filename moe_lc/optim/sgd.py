"""SGD with heavy-ball momentum on a ZeRO-1 shard (torch.optim.SGD's rule without dampening or Nesterov),
with decoupled weight decay like AdamW's.

State per master element: momentum_buffer (b, fp32; none when momentum = 0). One step, g the clipped
gradient:

    b = momentum b + g                   (b = g on the first step: b starts at zero)
    w = w (1 - lr wd)                    (not on the no-decay ranges)
    w = w - lr b

Elementwise, so the same under any ZeRO layout; `whole_params` asks ZeRO for whole parameters on one
owner rank (what a matrix rule such as Newton-Schulz needs), to test that layout against the default.
"""

from __future__ import annotations

import torch

from moe_lc.optim.rule import ShardView, StateSpec, UpdateRule, decay_


class SGD(UpdateRule):
    name = "sgd"
    update_bytes_per_element = 4  # the no-decay copy of the master

    def __init__(self, momentum: float = 0.9, weight_decay: float = 0.0, whole_params: bool = False):
        self.momentum, self.weight_decay, self.whole_params = momentum, weight_decay, whole_params

    @classmethod
    def from_config(cls, train, precision, model=None) -> "SGD":
        return cls(train.sgd_momentum, train.weight_decay)

    def states(self) -> tuple[StateSpec, ...]:
        return (StateSpec("momentum_buffer", torch.float32),) if self.momentum else ()

    def whole(self, name: str, shape: torch.Size) -> bool:
        return self.whole_params

    @torch.no_grad()
    def update_(self, shard: ShardView, lr: float, step: int) -> None:
        step_dir = shard.grad
        if self.momentum:
            step_dir = shard.state["momentum_buffer"].mul_(self.momentum).add_(shard.grad)
        decay_(shard.master, lr, self.weight_decay, shard.no_decay)
        shard.master.add_(step_dir, alpha=-lr)
