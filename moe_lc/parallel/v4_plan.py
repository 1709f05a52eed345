"""DeepSeek-V4's attention under a parallel layout: its tensor-parallel rule and what only this kind decides.

Legend: B batch, S sequence, s = S / tp its shard, D model dim, H query heads, d head dim, G output groups
(o_groups), R their rank (o_lora_rank), Cq query latent rank, tp the tensor-parallel degree.

    tensor parallel + SP   x arrives as its sequence shard (B, s, D) and is all-gathered once (`gather`): the
                           window, the compressors' pooling windows and the indexer all read whole sequences.
                           Then, on every tp rank:
      wa (D -> Cq + d)     replicated ("dp_cp_tp"): q's latent and the one shared KV head, which is key and value
                           of every query head, so it is not split; each rank's gradient is its heads' share
      wq_b, sinks          split by query heads (H / tp per rank), as column-parallel rows of the gathered latent
      wo_a                 split by output groups (G / tp per rank; o_groups % tp == 0): group g reads heads
                           g H / G .. (g + 1) H / G - 1, so a rank's groups read exactly its heads
      wo (G R -> D)        row-parallel: its input is this rank's groups, the sum reduce-scattered to (B, s, D)
      compressor           replicated ("dp_cp_tp"): its entries are the shared KV head's, read by every head
      indexer              replicated ("dp_cp_tp"), as DSA's (moe_lc/parallel/dsa_plan.py): the top-k sums the
                           scores over all of its heads and must be the same on every rank, so splitting its heads
                           would all-reduce a (B, S, S / m) score tensor per layer; a replica costs its FLOPs on
                           every rank and no communication. Its loss's target (the attention's probabilities of
                           the picked entries summed over heads) is all-reduced over tp (`head_sum`, B S k fp32
                           per CSA layer), and each rank takes 1/tp of the loss, so the replicas' gradients
                           summed over "dp_cp_tp" are the single-device ones.
    Gathering x costs D values per token; running wa and the compressors on the shard and gathering their outputs
    instead would move about as much at V4-Flash's shapes (Cq + d + 4 d + 4 E + G = 4,160 > D = 4,096) but not repeat
    their GEMMs on every tp rank: the obvious next step where those GEMMs show in a profile.
    each layout            the indexer loss's share of the step (`aux_loss_scale`); its metric is DSA's
                           (`dsa_step_metrics`: dsa/indexer_kl).
    context parallel       not here: the kind's `context` seam (moe_lc/parallel/cp/v4_context.py, planned by
                           layer_plan.py's `_context_plan`) moves the rows before each span and gathers the entries;
                           every parameter above keeps its group ("dp_cp_tp" sums the cp ranks' gradients too).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Shard
from moe_lc.parallel.tp.mappings import SequenceGather


class TPHeadSum:
    """The `head_sum` seam under TP: a head-summed tensor summed over the tp ranks' heads (in place)."""

    def __init__(self, group: Group, ranks: int):
        self.group, self.ranks = group, ranks

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.group)
        return t

    def __repr__(self) -> str:
        return f"TPHeadSum(tp={self.ranks})"


def v4_layer_plan(attn: nn.Module, dims: ParallelDims | None, plan, aux_loss_scale: float, items: set) -> None:
    """The kind's own decisions on every layout (its registry entry's `extra_plan`): the indexer loss's share of
    the step, and under tp the sum of its target over the tp ranks' heads."""
    plan.set(attn, aux_loss_scale=aux_loss_scale)
    if dims is not None and dims.tp > 1:
        plan.set(attn, head_sum=TPHeadSum(dims["tp"], dims.tp))


def v4_tp_rule(attn: nn.Module, tp) -> list:
    """A V4Attention (moe_lc/model/v4_attention.py) under tp (module docstring). Its RMSNorms (q_norm, kv_norm and
    the compressors') are visited on their own (replicated, "dp_cp_tp")."""
    n = tp.n
    replicated = [attn.wa.weight]
    for comp in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None):
        if comp is not None:
            replicated += [comp.wkv_gate.weight, comp.position_bias]
    if attn.indexer is not None:
        replicated += [attn.indexer.wq_b.weight, attn.indexer.weights_proj.weight]
    tp.placements.set_group(replicated, "dp_cp_tp")
    tp.shard(attn.wq_b.weight, Shard("tp", 0))  # rows head-major (H, d)
    if attn.sinks is not None:
        tp.shard(attn.sinks, Shard("tp", 0))
    tp.shard(attn.wo_a.weight, Shard("tp", 0))  # (G, R, H d / G): whole groups
    tp.linear(attn.wo, Shard("tp", 1), tp.row)
    tp.plan.set(attn, gather=SequenceGather(tp.group), n_heads=attn.n_heads // n, o_groups=attn.o_groups // n)
    return replicated + [attn.wq_b.weight, attn.wo_a.weight, *attn.wo.parameters()] + \
        ([attn.sinks] if attn.sinks is not None else [])
