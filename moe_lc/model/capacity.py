"""Expert capacity with token dropping (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al.
2021): each expert takes at most C = ceil(capacity_factor * T * K / E) of the token copies one router
call routes to it; the copies over C are dropped: they contribute 0 to the token's output (the token
keeps its residual and its other experts), and they never travel to an expert (under expert
parallelism they are left out of the all-to-all).

The token group T is what one router call sees: one micro-batch of one data-parallel rank, and under
context / sequence parallelism that rank's shard of it (B * S / (cp * tp) tokens). A layout is therefore
equal to one process whose micro-batch is that same group of tokens. The capacity is part of the layer's
function: it applies in evaluation forwards too (a decode step's few tokens rarely reach it).

Legend: T tokens, K experts per token, E routed experts. A dropped copy keeps its slot in idx (T, K)
with the phantom expert id E ("no expert"), which sorts after every real expert, so dispatchers send
the first (T*K - dropped) rows of their by-expert order and pad the way back with zero rows.
"""

from __future__ import annotations

import math

import torch


def expert_capacity(tokens: int, topk: int, n_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * tokens * topk / n_experts): copies one expert may take per router call."""
    return math.ceil(capacity_factor * tokens * topk / n_experts)


def _by_priority_then_expert(flat_K: torch.Tensor, affinity_K: torch.Tensor, policy: str) -> torch.Tensor:
    """Flat (token, slot) copies (T*K,) in expert order, inside an expert by priority: the earliest
    tokens ("position"), or the highest affinity, ties by token order ("probability")."""
    if policy == "position":
        return flat_K.argsort(stable=True)
    by_affinity = (-affinity_K).argsort(stable=True)
    return by_affinity[flat_K[by_affinity].argsort(stable=True)]


def _keep_rank(idx_TK: torch.Tensor, affinity_TK: torch.Tensor, n_experts: int, policy: str) -> torch.Tensor:
    """(T, K) int64: each copy's place in its expert's queue (0 = served first)."""
    flat = idx_TK.flatten()
    order = _by_priority_then_expert(flat, affinity_TK.flatten(), policy)
    counts_E = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts_E = counts_E.cumsum(0) - counts_E
    place = torch.arange(flat.numel(), device=flat.device) - starts_E[flat[order]]
    return torch.zeros_like(flat).scatter_(0, order, place).view_as(idx_TK)


DROP_POLICIES = ("probability", "position")  # the recipe's `DropPolicy` choices (tests/test_config.py)


@torch.no_grad()
def drop_over_capacity(idx_TK: torch.Tensor, scores_TE: torch.Tensor, capacity: int, policy: str) -> torch.Tensor:
    """Routed ids (T, K) int64 and the pre-bias affinities (T, E) -> ids (T, K) with every copy beyond its
    expert's `capacity` replaced by the phantom id E, chosen by `policy` (see `_by_priority_then_expert`).
    No gradient: which copies survive is a discrete choice, like the top-k itself."""
    E = scores_TE.shape[-1]
    assert policy in DROP_POLICIES, policy
    place_TK = _keep_rank(idx_TK, scores_TE.gather(1, idx_TK), E, policy)
    return idx_TK.masked_fill(place_TK >= capacity, E)


def dropped_copies(sent_TK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """0-dim fp32: the copies `drop_over_capacity` replaced by the phantom id (for the step's metrics)."""
    return (sent_TK == n_experts).sum().float()
