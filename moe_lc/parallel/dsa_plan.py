"""DeepSeek Sparse Attention under a parallel layout: where its ring passes run and how its indexer is placed.

    context parallel  the indexer keys (E values per token) travel the zig-zag "cp" ring while each rank
                      keeps a running exact top-k for its queries; then the main attention visits the MLA
                      latent blocks (Ckv + Dr per token) and attends only the keys it selected in each,
                      LSE-merged; blocks no query selected from pass through. Backward: the same rings
                      with fp32 gradient accumulators travelling home (moe_lc/ops/dsa_*.py). Positions and
                      documents come from the micro-batch's placement (`rank_chunks`: zig-zag, or the
                      balanced one), so packed documents need no plan beyond their ids.
    tensor parallel   the main heads are split (as MLA's); the indexer is replicated on every tp rank:
                      its scores sum over all of its heads and its top-k must be the same on every rank,
                      so splitting its heads would all-reduce a (S x S) score matrix per layer, while a
                      replica costs its S^2 G E FLOPs per rank and no communication. Its per-token part
                      (wk, weights_proj) runs on the sequence shard and joins MLA's latent gather. The
                      indexer loss's target (the attention's head-summed probabilities) is all-reduced
                      over tp (`reduce_heads`: S x k values per layer in the sparse stage; per (query,
                      key) tile of the dense warm-up), and each tp rank takes 1/tp of the loss, so the
                      replicated indexer's gradients sum over "dp_cp_tp" to the single-device ones.
    each step         the indexer's KL (and the warm-up's top-k mass) over the world: `dsa_step_metrics`,
                      the kind's `step_metrics` (moe_lc/config/attention_kinds.py)
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.dsa import LocalSparseCore
from moe_lc.ops.dsa_ring import OneRank, RingLayout
from moe_lc.parallel import comm
from moe_lc.parallel.cp.ring import P2PRing, rank_chunks
from moe_lc.parallel.mesh import ParallelDims


class ParallelSparseCore(LocalSparseCore):
    """DSA's `sparse_core` under cp and / or tp (moe_lc/model/dsa.py's LocalSparseCore on one device): its call,
    the sparse attention, visits the "cp" ring."""

    def __init__(self, dims: ParallelDims):
        super().__init__()
        self.cp_group, self.tp_group = dims["cp"], dims["tp"]
        self.cp, self.tp = dims.cp, dims.tp
        self.ring = P2PRing(self.cp_group) if self.cp > 1 else OneRank()

    def layout(self, seq_local: int, docs) -> RingLayout:
        if self.cp == 1:
            return RingLayout.one_device(seq_local, docs)
        chunks = tuple(rank_chunks(r, self.cp, "zigzag", docs) for r in range(self.cp))
        return RingLayout(chunks, seq_local // 2, self.cp_group.rank, docs)

    def reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        """A head-summed tensor summed over the tp ranks' heads (in place)."""
        if self.tp > 1:
            comm.all_reduce(t, self.tp_group)
        return t

    def extra_repr(self) -> str:
        return f"cp={self.cp}, tp={self.tp}"


def dsa_layer_plan(attn: nn.Module, dims: ParallelDims | None, plan, aux_loss_scale: float, items: set) -> None:
    """The DSA kind's own decisions on every layout (its registry entry's `extra_plan`): the indexer loss's
    share of the step; under selective "mla_up" the sparse stage keeps only MLA's latents and rebuilds the
    queries and key rows in backward, as MLA's up-projections are (`keep_latents`); under cp or tp the
    sparse core that runs its ring passes there."""
    plan.set(attn, aux_loss_scale=aux_loss_scale, keep_latents="mla_up" in items)
    if dims is not None and (dims.cp > 1 or dims.tp > 1):
        plan.set(attn, sparse_core=ParallelSparseCore(dims))


def dsa_tp_rule(attn: nn.Module, tp) -> list:
    """MLA's tensor-parallel rule (heads split, latents gathered), and the indexer replicated on the sequence
    shard ("dp_cp_tp": its gradients are this rank's 1/tp share, summed with the other tp ranks')."""
    from moe_lc.parallel.tp.plan import mla_rule

    tp.placements.set_group(attn.indexer.parameters(), "dp_cp_tp")
    return mla_rule(attn, tp) + list(attn.indexer.parameters())


def dsa_step_metrics(m, stats, dims: ParallelDims, device: torch.device) -> dict:
    """The indexer this step (the kind's `step_metrics`; m: the [model] section): dsa/indexer_kl, the KL of the
    indexer's distribution from the attention's per query token and layer (over the selection in the sparse
    stage, every visible key in the warm-up); in the warm-up also dsa/topk_mass, the share of the dense
    attention's mass on the indexer's top-k (what the sparse stage would keep). From the step's
    `ForwardStats.dsa` summed over the world (tp ranks booked 1/tp each): one all-reduce of 3 fp64 (the kind's
    `step_reductions`)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    if stats.dsa is not None:
        sums += stats.dsa.to(device)
    comm.all_reduce(sums, dims["world"])
    kl, mass, count = sums.tolist()
    if count <= 0:
        return {}
    out = {"dsa/indexer_kl": kl / count}
    if m.dsa.stage == "warmup":
        out["dsa/topk_mass"] = mass / count
    return out
