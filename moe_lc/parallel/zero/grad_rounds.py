"""ZeRO-2's gradients: reduce-scattered in rounds as backward produces them, only this rank's 1/N kept.

`parallel.placement.grads = "sharded"` (Rajbhandari et al. 2020, ZeRO stage 2: P_os+g): the `GradSync` variant
(zero/grad_sync.py) that ZeRO-2 and ZeRO-3 choose (zero/strategies.py). ZeRO-1 (`BucketSync`) accumulates every
micro-batch's gradients in a full-size fp32 buffer (P,) and reduce-scatters each bucket once, after the step's
last micro-batch; here no such buffer exists. A bucket's
gradients go into a staging buffer of the bucket's size, opened at its round's first arrival; when as many
gradients have arrived as the bucket has parameters (one micro-batch's worth, in whatever order a pipeline
schedule delivers them), the round is reduce-scattered asynchronously and its output added into the
rank's reduced shard (`grad_shard`, (P/N,) fp32) once it lands. A round stays in flight while backward
goes on (overlapping the next bucket's gradients), until the group launches one more than `inflight` (1)
or launches its last bucket (the end of the group's backward for a micro-batch, so nothing waits through the
next forward): then it is waited for, folded in, and its staging freed. So a group holds the round being
filled and at most one in flight: the live gradient bytes are the shard plus about two buckets, not P.
`finish` launches every open round (a bucket some of whose parameters got no gradient) and folds
everything in.

What it costs: a bucket is reduce-scattered once per round (each micro-batch), not once per step: M
micro-batches move M x ZeRO-1's reduce-scatter bytes (the ZeRO paper's 2 psi per step assumes one
micro-batch; the planner counts them by running this, tools/planner/zero_trace.py). The sum's order changes
with M > 1 (each micro-batch's reduction, then their sum, instead of the sum, then its reduction): equal to ZeRO-1 to
fp32 rounding (about 1e-7 relative), and bit for bit with one micro-batch.
"""

from __future__ import annotations

from collections import deque

import torch

from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.zero.grad_sync import GradSync
from moe_lc.parallel.zero.layout import Bucket


class GradRounds(GradSync):
    """The staging, rounds and folding of one ZeRO group's gradients (module docstring); `GradSync`'s
    arguments, and `inflight`: rounds left in flight while the next bucket fills."""

    def __init__(self, buckets: list[Bucket], group: Group, shard: torch.Tensor, inflight: int = 1):
        super().__init__(buckets, group, shard)
        self.inflight = inflight
        # id(param) -> (bucket index, offset in the bucket): where its gradients are staged
        self.offsets = {id(p): (b.index, off - b.start) for b in buckets for p, off in b.params}
        self.staging: dict[int, torch.Tensor] = {}  # bucket index -> its open round's (size,) fp32 sums
        self.count: dict[int, int] = {}  # bucket index -> arrivals in its open round
        self.pending: deque = deque()  # (work, out (shard size,), staging, bucket), oldest first
        self.launched = 0  # rounds reduce-scattered since the last `finish` (tests, the planner's check)

    def add(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """One gradient of p arrived: into its bucket's open round; close the round when it is full."""
        index, at = self.offsets[id(p)]
        b = self.buckets[index]
        staging = self.staging.get(index)
        if staging is None:
            staging = self.staging[index] = torch.zeros(b.size, device=grad.device, dtype=torch.float32)
            self.count[index] = 0
        staging[at:at + p.numel()].view_as(p).add_(grad)
        self.count[index] += 1
        if self.count[index] == len(b.params):
            self._launch(index)

    def _launch(self, index: int) -> None:
        b, staging = self.buckets[index], self.staging.pop(index)
        out = torch.empty(b.shard_size, device=staging.device, dtype=torch.float32)
        work = comm.reduce_scatter(out, staging, self.group, async_op=True)
        self.pending.append((work, out, staging, b))
        self.launched += 1
        # beyond `inflight`, or the bucket backward fills last (the buffer runs in backward order): fold now,
        # so no staging waits through the next micro-batch's forward
        last = index == len(self.buckets) - 1
        while len(self.pending) > (0 if last else self.inflight):
            self._fold(*self.pending.popleft())

    def _fold(self, work, out: torch.Tensor, staging: torch.Tensor, b) -> None:
        if work is not None:
            work.wait()
        b.part(self.shard).add_(out)  # staging is freed with this frame

    def finish(self) -> int:  # (GradSync.finish)
        """Launch every open round, fold every round in; -> rounds this step (and start counting anew)."""
        for index in sorted(self.staging):
            self._launch(index)
        while self.pending:
            self._fold(*self.pending.popleft())
        launched, self.launched = self.launched, 0
        return launched

    def live_bytes(self) -> int:
        """Staging bytes held now (open rounds and rounds in flight)."""
        held = list(self.staging.values()) + [s for _, _, s, _ in self.pending]
        return sum(t.numel() * t.element_size() for t in held)
