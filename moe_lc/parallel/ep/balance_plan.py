"""The balance losses' rule of the layer plan: how a micro-batch's tokens are split over the mesh, and
the sums over their holders that the losses of moe_lc/model/balance_losses.py take.

    sum_over_sequences   all-reduce over "cp_tp" (the ranks of one data-parallel replica of a stage:
                         the zig-zag chunks and sequence-parallel shards of the same sequences)
    sum_over_batch       all-reduce over "dp_cp_tp" (every rank of the stage routing tokens of the
                         same micro-batch index)

Only counts travel (fp32, no gradient), once per MoE layer and training forward that computes the
loss: the sequence-wise loss sends B * E values, the global-batch loss E + 1; z-loss and capacity
send nothing (the planner counts these bytes in its traced blocks, tools/planner/block_trace.py). Under
sequence parallelism each tp rank routes its S / tp shard of every sequence (tp/plan.py: the
router is replicated on the sequence shard).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.balance_losses import TokenShards
from moe_lc.model.moe import MoE
from moe_lc.parallel import comm
from moe_lc.parallel.mesh import ParallelDims


class MeshTokenShards(TokenShards):
    """A micro-batch split over cp * tp ranks, replicated data-parallel over dp (module docstring)."""

    def __init__(self, dims: ParallelDims, sequence_group, batch_group):
        self.n = dims.cp * dims.tp
        self.sequence_group, self.batch_group = sequence_group, batch_group

    def sum_over_sequences(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.sequence_group)
        return t

    def sum_over_batch(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.batch_group)
        return t


def balance_plan(model: nn.Module, dims: ParallelDims, plan) -> None:
    """Give every router the mesh's `MeshTokenShards` when a balance loss sums over other ranks: the
    sequence-wise loss under cp or tp, the global-batch loss under dp, cp or tp. The "cp_tp" group
    is made here, on every rank alike (a collective), only when needed."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        return
    router = moes[0].router  # every MoE layer has the same [model.moe]
    sequence = moes[0].aux_loss_weight > 0 and dims.cp * dims.tp > 1
    batch = router.global_aux_loss_weight > 0 and dims.dp * dims.cp * dims.tp > 1
    if not (sequence or batch or (router.z_loss_weight > 0 and dims.cp * dims.tp > 1)):
        return
    seq_group = None
    if sequence:
        seq_group = dims.groups["cp_tp"] if "cp_tp" in dims.groups else dims.add_group("cp_tp", dims.group_ranks("cp_tp"))
    shards = MeshTokenShards(dims, seq_group, dims["dp_cp_tp"])
    for moe in moes:
        plan.set(moe.router, token_shards=shards)
