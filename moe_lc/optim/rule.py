"""What an update rule is: the math of one optimizer step on a ZeRO-1 shard, apart from the buffers.

ZeRO-1 (moe_lc/parallel/zero/optimizer.py) owns the layout: buckets, the reduce-scatter of gradients and the
all-gather of parameters, the global grad-norm and clipping, and the fp32 master shard. A rule owns the
update and declares the state it keeps beside the master (`states()`): names, dtypes, bytes per element
and initial values. That declaration is the one source of a rule's state for the buffers ZeRO allocates,
the checkpoint keys (optim.params.<param>.<state name>), the planner's optimizer bytes (tools/plan.py)
and the tensors the dry run labels (tools/dryrun.py).

Every state tensor is sharded like the master: (n,) elements of this rank's 1/N slice of each bucket,
n = the sum of bucket sizes / N over the group (dense parameters over dp x cp, experts over edp).
A rule may ask for some parameters whole on one owner rank (`whole(name, shape)`): ZeRO then packs
those into bins, one per rank, inside each bucket, so the rule sees each such parameter with its shape
(what Newton-Schulz needs); otherwise buckets cut parameters at any element offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar

import torch


@dataclass(frozen=True)
class StateSpec:
    """One state tensor a rule keeps per element of the master shard."""

    name: str  # its checkpoint key under optim.params.<param>
    dtype: torch.dtype
    init: float = 0.0  # every element's value before the first step

    @property
    def bytes_per_element(self) -> int:
        return self.dtype.itemsize

    @property
    def dtype_name(self) -> str:  # "fp32", "bf16" (the planner's placement table)
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))


@dataclass(frozen=True)
class OwnedParam:
    """A parameter's elements on this rank: shard elements [lo, hi) hold the parameter's flat elements
    [start, start + hi - lo) (row-major); `whole` when the rank holds all of them."""

    name: str
    shape: torch.Size  # the local parameter's shape (this rank's TP / EP slice)
    lo: int
    hi: int
    start: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.hi - self.lo == self.shape.numel()


@dataclass
class ShardView:
    """What a rule updates on one ZeRO-1 group of one rank: views of ZeRO's shard tensors, each (n,).

    master    fp32 master weights (updated in place)
    grad      fp32 gradients, summed over the group and clipped (the rule may overwrite them)
    state     {spec.name: tensor} for each of the rule's `states()`, dtype as declared
    no_decay  (lo, hi) ranges of the shard that weight decay leaves alone (norms, biases, embeddings)
    params    the parameters with elements on this rank, in bucket order
    to_full   (whole owned parameter, a tensor of its local shape) -> the full matrix tensor: gathered over
              the tensor-parallel shards that cut its last two dims (collective over that group: every
              owner of the parameter's other slices calls it in the same order); identity without such
    to_local  (whole owned parameter, a full tensor) -> this rank's slice (to_full's inverse)
    """

    master: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    no_decay: list[tuple[int, int]]
    params: list[OwnedParam] = field(default_factory=list)
    to_full: Callable[[OwnedParam, torch.Tensor], torch.Tensor] = lambda o, t: t
    to_local: Callable[[OwnedParam, torch.Tensor], torch.Tensor] = lambda o, t: t

    def part(self, lo: int, hi: int) -> "ShardView":
        """The view of shard elements [lo, hi) (one bucket's 1/N slice: no parameter's elements on this rank
        cross its ends), with the no-decay ranges and parameters inside it shifted to start at 0. An
        elementwise rule updates the parts exactly as it updates the whole (the offloaded optimizer steps
        bucket by bucket, moe_lc/parallel/zero/host_step.py)."""
        inside = [o for o in self.params if lo <= o.lo and o.hi <= hi]
        return ShardView(self.master[lo:hi], self.grad[lo:hi], {k: v[lo:hi] for k, v in self.state.items()},
                         [(a - lo, b - lo) for a, b in self.no_decay if lo <= a and b <= hi],
                         [replace(o, lo=o.lo - lo, hi=o.hi - lo) for o in inside], self.to_full, self.to_local)


class UpdateRule:
    """Base of the update rules (moe_lc/optim/adamw.py, sgd.py, muon.py); `moe_lc.optim.RULES` names them."""

    name: ClassVar[str]
    update_bytes_per_element: int = 0  # bytes of temporaries `update_` allocates per shard element, at most

    @classmethod
    def from_config(cls, train, precision, model=None) -> "UpdateRule":
        """The rule with the recipe's hyperparameters ([train], [precision] for state dtypes, [model] for
        the shapes of fused weights where the rule needs them; None: unknown)."""
        raise NotImplementedError

    def states(self) -> tuple[StateSpec, ...]:
        """The tensors kept beside the master, in checkpoint and planner order."""
        return ()

    def whole(self, name: str, shape: torch.Size) -> bool:
        """Whether parameter `name` must sit whole on one owner rank (default: any element offset)."""
        return False

    def update_(self, shard: ShardView, lr: float, step: int) -> None:
        """One step on this rank's shard; `step` counts applied steps from 1."""
        raise NotImplementedError


def decay_(master: torch.Tensor, lr: float, weight_decay: float, no_decay: list[tuple[int, int]]) -> None:
    """Decoupled weight decay (Loshchilov & Hutter, arXiv:1711.05101): master *= 1 - lr * wd, except the
    no-decay ranges. 4 bytes per element of temporaries when there are such ranges."""
    if not weight_decay:
        return
    keep = master.clone() if no_decay else None
    master.mul_(1 - lr * weight_decay)
    for lo, hi in no_decay:
        master[lo:hi] = keep[lo:hi]
