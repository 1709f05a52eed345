"""DeepSeek-V4's indexer loss: the CSA lightning indexer trained to follow the main attention over the compressed
entries, as DeepSeek-V3.2 trains its indexer over tokens (V3.2 report arXiv 2512.02556, section 2.1, sparse
stage; V4 report arXiv 2606.19348, section 2.3.1: CSA's indexer is V3.2's lightning indexer over compressed
entries, its training the same). Ours for V3.2 is moe_lc/model/dsa.py (MLA's absorbed form, its rings).

Legend: B batch, S sequence (the whole sequence: under TP + SP the V4 module gathers it), H query heads (tp-local),
d head dim, n compressed entries, k = min(index_topk, n) picked per query.

    P_h(t, s) = exp(scale q_h(t) . e_s - lse_h(t))       the attention's probability of entry s (its softmax
                                                          also holds the window and the sink: lse is the core's)
    p(t, s)   = sum_h P_h(t, s) / sum_{s' in S_t} sum_h P_h(t, s')      over the picked set S_t, no gradient
    loss      = weight * sum_t KL(p(t, .) || softmax_{s in S_t} I(t, s))   over queries that picked anything

The indexer's inputs (x and the query latent c_q) are detached (V3.2's sparse stage): the loss trains the indexer's
own parameters (its compressor, wq_b, weights_proj) and nothing else. Under TP the head sum is all-reduced over
the tp ranks (`head_sum`: k values per query), every tp rank holds the whole indexer and takes 1/tp of the loss,
so its gradients summed over "dp_cp_tp" are the single-device ones (moe_lc/parallel/v4_plan.py). Under context
parallelism a rank's queries are its own rows, its picks over the gathered entries, and its share is 1/cp of the
micro-batch's queries (the module's `context.ranks`): the cp ranks' terms sum to the single device's loss.

Memory (model.v4_attention.core = "tiled", the default): only I at the picked entries is computed with a gradient
(V4Indexer.picked_scores, moe_lc/ops/v4_index_topk.py `picked_index_scores`), checkpointed from x and c_q, and the
target from the core's lse at the picks (moe_lc/ops/v4_sparse_core.py `picked_mass`): no (B, S, n) tensor. With
"reference": the indexer's scores are checkpointed (moe_lc/model/v4_attention.py): what the loss keeps for backward is x
and c_q (kept by wa and wq_b anyway), the picks (B, S, k) int64 and the log-softmax over them (B, S, k) fp32, about
12 k bytes per token and CSA layer, not the indexer's (B, S, G, n) per-head scores (V4-Flash at 4K: 1 GiB per layer
and micro-batch); its forward runs again in backward.

The loss trains through dsa.AttachLoss on the attention's output, scaled to this micro-batch's share of the step's
mean over query tokens (the plan's `aux_loss_scale`); its sums reach the step's ForwardStats (`add_dsa`: the same
`dsa/indexer_kl` metric as V3.2's) in backward, which runs once per micro-batch whatever is recomputed.
"""

from __future__ import annotations

import torch


class OneRankHeadSum:
    """The `head_sum` seam on one device: every head is here (a tp layout all-reduces, `ranks` = tp)."""

    ranks = 1

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t


@torch.no_grad()
def picked_mass(q_BSHd: torch.Tensor, entries_Bnd: torch.Tensor, lse_BSH: torch.Tensor, picked_BSk: torch.Tensor,
                scale: float) -> torch.Tensor:
    """The attention's probability of each picked entry summed over this rank's heads (B, S, k) fp32, 0 in empty
    slots (-1). q: the core's normalized, roped queries; lse: the core's per head, over window, entries and sink."""
    logits = torch.einsum("bshd,bnd->bshn", q_BSHd.float(), entries_Bnd.float()) * scale
    mass = torch.exp(logits - lse_BSH[..., None]).sum(dim=2)  # (B, S, n)
    return mass.gather(-1, picked_BSk.clamp_min(0)) * (picked_BSk >= 0)


def scores_at(scores_BSn: torch.Tensor, picked_BSk: torch.Tensor) -> torch.Tensor:
    """The indexer's I (B, S, n) at the picked entries -> (B, S, k), -inf at -1 slots (the reference core's path; the
    tiled one computes them without the (B, S, n) matrix: V4Indexer.picked_scores)."""
    return scores_BSn.gather(-1, picked_BSk.clamp_min(0)).masked_fill(picked_BSk < 0, float("-inf"))


def kl_to_indexer(picked_scores_BSk: torch.Tensor, picked_BSk: torch.Tensor, mass_BSk: torch.Tensor):
    """KL(p || softmax(I over the picked entries)) summed over queries -> (kl_sum fp32 with grad to the scores,
    queries counted (int)). picked_scores: the indexer's I at the picked entries (B, S, k) fp32 (its softmax is over
    the picked set alone: nothing else of I is read); mass: the head-summed target (B, S, k)."""
    valid = picked_BSk >= 0
    rows = valid.any(dim=-1, keepdim=True)  # a query before the first entry picked nothing: no term
    logits = picked_scores_BSk.masked_fill(~valid, float("-inf"))
    log_q = torch.log_softmax(logits.masked_fill(~rows, 0.0), dim=-1)
    p = mass_BSk / mass_BSk.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    p = p * rows
    terms = torch.where(p > 0, p * (p.clamp_min(torch.finfo(torch.float32).tiny).log() - log_q), 0.0)
    return terms.sum(), int(rows.sum())


class BookedLoss(torch.autograd.Function):
    """Identity on the loss whose backward books its detached sums (`sink(kl_sum, count)`): once per micro-batch,
    in backward, however often a recomputing forward ran."""

    @staticmethod
    def forward(ctx, loss, kl_sum, count: float, sink):
        ctx.sums, ctx.sink = (kl_sum.detach(), count), sink
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sink is not None:
            ctx.sink(*ctx.sums)
        return grad, None, None, None


def index_loss(picked_scores_BSk, picked_BSk, mass_BSk, share: float, tp_ranks: int, stats):
    """This rank's loss term (0-dim fp32, share = weight * step share / queries of the micro-batch / tp ranks);
    picked_scores: I at the picked entries (B, S, k); stats: the step's ForwardStats or None."""
    kl, count = kl_to_indexer(picked_scores_BSk, picked_BSk, mass_BSk)
    sink = None if stats is None else \
        (lambda kl_sum, n: stats.add_dsa(kl_sum / tp_ranks, torch.zeros_like(kl_sum), n / tp_ranks))
    return BookedLoss.apply(kl * share, kl, float(count), sink)
