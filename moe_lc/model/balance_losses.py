"""Auxiliary routing losses, each written as this rank's additive share of the step's value.

    sequence-wise balance (DeepSeek-V3)  per sequence sum_e f_e P_e, f_e = E/(K S) * copies routed to e,
                                         P_e = mean over the sequence's tokens of the normalized affinity
    global-batch balance (Qiu et al.     E * sum_e f_e P_e, f_e = copies routed to e / (K T), counted over
      2025, arXiv 2501.11873: Qwen3-MoE) the tokens of every data-parallel rank's micro-batch; P_e the
                                         mean normalized affinity over the same tokens (Switch's form)
    router z-loss (ST-MoE, Zoph et al.   mean over tokens of logsumexp(router logits)^2
      2022)

Legend: T tokens this rank routes, B sequences, S this rank's tokens of each, K experts per token,
E routed experts. A layout splits one data-parallel rank's micro-batch over n = cp * tp ranks (zig-zag
chunks, then sequence-parallel shards; the batch dim is never split there), and the data-parallel
ranks route other micro-batches. Each loss is written so that the shares of the n ranks sum to the
micro-batch's value: the counts (f, no gradient) are summed over the ranks that hold the other tokens
of the same sequences (or of the whole batch), and P is this rank's tokens' part of the mean, so its
gradient is exactly the local one and the router's gradient sum over dp x cp x tp is the single-device
gradient. `MoE.aux_loss_scale` (1 / (micro-batches * dp)) then makes the step's mean. `TokenShards`
says how the tokens are split and does those sums: one device here, the mesh's groups under a parallel
layout (moe_lc/parallel/ep/balance_plan.py). `run_region`: the router's seam that runs the compiled regions
(moe_lc/model/seams.py; the plain functions by default).
"""

from __future__ import annotations

import torch

from moe_lc.model.seams import run_now
from moe_lc.ops.regions import region


class TokenShards:
    """One device: a micro-batch lives whole on this rank, and the sums over its other holders are
    identities. `n`: ranks holding parts of one data-parallel rank's micro-batch (cp * tp)."""

    n = 1

    def sum_over_sequences(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks that hold other tokens of the same sequences (cp x tp), in place."""
        return t

    def sum_over_batch(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over every rank routing tokens of this micro-batch index (dp x cp x tp), in place."""
        return t


def _normalized(scores_xE: torch.Tensor) -> torch.Tensor:
    """Affinities normalized over experts (sigmoid scores; softmax ones already sum to 1)."""
    return scores_xE / scores_xE.sum(-1, keepdim=True)


def _counts(idx: torch.Tensor, n_experts: int, rows: int) -> torch.Tensor:
    """idx (rows, m) int64 -> (rows, n_experts) fp32: how often each expert occurs in each row."""
    flat = idx.reshape(rows, -1)
    return torch.zeros(rows, n_experts, device=idx.device).scatter_add_(1, flat, torch.ones(flat.shape, device=idx.device))


def sequence_aux_loss(scores_BSE: torch.Tensor, idx_BSK: torch.Tensor, n_experts: int,
                      shards: TokenShards | None = None, run_region=run_now) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss, mean over sequences: sum_e f_e * P_e where
    f_e = E/(K*S) * (tokens of the sequence routed to e), P_e = mean over tokens of normalized affinity.
    With `shards` splitting the sequences over n > 1 ranks: this rank's share (module docstring); the
    per-sequence counts are summed over the sequences' ranks, S is the whole sequence's length. The sum
    runs eagerly, between the compiled regions (a collective cannot sit inside one)."""
    B, S, K = idx_BSK.shape
    n = 1 if shards is None else shards.n
    counts_BE = _counts(idx_BSK, n_experts, B)
    if n > 1:
        counts_BE = shards.sum_over_sequences(counts_BE)
    return run_region(_sequence_balance, scores_BSE, counts_BE, K, S * n, n == 1)


@region
def _sequence_balance(scores_BSE: torch.Tensor, counts_BE: torch.Tensor, K: int, S_whole: int,
                      whole: bool) -> torch.Tensor:
    """The sequence-wise loss (or this rank's share of it) from the sequences' expert counts (B, E)."""
    f_BE = counts_BE * counts_BE.shape[-1] / (K * S_whole)
    scores_BSE = _normalized(scores_BSE)
    p_BE = scores_BSE.mean(1) if whole else scores_BSE.sum(1) / S_whole
    return (f_BE * p_BE).sum(-1).mean()


def global_aux_loss(scores_TE: torch.Tensor, idx_TK: torch.Tensor, shards: TokenShards,
                    run_region=run_now) -> torch.Tensor:
    """This rank's share of E * sum_e f_e * P_e over the tokens of every data-parallel rank's micro-batch:
    f_e from the copies per expert summed over `shards.sum_over_batch` (no gradient), P_e this rank's
    part of the mean normalized affinity of one data-parallel rank's micro-batch (T * n tokens)."""
    T, K = idx_TK.shape
    E = scores_TE.shape[-1]
    stats = torch.cat([_counts(idx_TK, E, 1)[0], torch.full((1,), float(T), device=idx_TK.device)])
    return run_region(_global_balance, scores_TE, shards.sum_over_batch(stats), K, T * shards.n)


@region
def _global_balance(scores_TE: torch.Tensor, stats_E1: torch.Tensor, K: int, tokens: int) -> torch.Tensor:
    """E * sum_e f_e P_e from the summed copies per expert and token count (E + 1,)."""
    E = scores_TE.shape[-1]
    f_E = stats_E1[:E] / (K * stats_E1[E])
    return E * (f_E * (_normalized(scores_TE).sum(0) / tokens)).sum()


def z_loss(logits_TE: torch.Tensor, shards: TokenShards, run_region=run_now) -> torch.Tensor:
    """This rank's share of the mean over one data-parallel rank's micro-batch (T * n tokens) of
    logsumexp(logits)^2: the sum over its tokens over T * n."""
    return run_region(_z_loss, logits_TE, logits_TE.shape[0] * shards.n)


@region
def _z_loss(logits_TE: torch.Tensor, tokens: int) -> torch.Tensor:
    return logits_TE.float().logsumexp(-1).square().sum() / tokens


LOSS_NAMES = ("aux_loss", "z_loss", "global_aux_loss")  # metric names moe/<name>/layer{L}, in this order


def enabled_losses(aux_loss_weight: float, z_loss_weight: float, global_aux_loss_weight: float) -> list[str]:
    """The losses switched on, in LOSS_NAMES order."""
    weights = (aux_loss_weight, z_loss_weight, global_aux_loss_weight)
    return [name for name, w in zip(LOSS_NAMES, weights) if w > 0]


def stat_columns(moe_cfg) -> int:
    """Values per MoE layer the step's metrics all-reduce carries beyond the expert loads: each enabled
    loss's summed shares, and the dropped copies when a capacity is set (`[model.moe]`: MoEConfig)."""
    losses = enabled_losses(moe_cfg.aux_loss_weight, moe_cfg.z_loss_weight, moe_cfg.global_aux_loss_weight)
    return len(losses) + int(moe_cfg.capacity_factor > 0)


def balance_loss_shares(weights: dict[str, float], logits_TE: torch.Tensor, scores_TE: torch.Tensor,
                        idx_TK: torch.Tensor, n_seqs: int, shards: TokenShards, run_region=run_now) -> torch.Tensor:
    """(n,) fp32: each enabled loss (weights[name] > 0, LOSS_NAMES order) times its weight, this rank's
    share. logits, scores: the router's fp32 logits and pre-bias affinities (T, E); idx: the routed
    (pre-drop) experts (T, K); n_seqs: B, the sequences the T tokens come from."""
    T, E = scores_TE.shape
    parts = []
    if weights["aux_loss"] > 0:
        view = (n_seqs, T // n_seqs, -1)
        parts.append(weights["aux_loss"] * sequence_aux_loss(scores_TE.view(view), idx_TK.view(view), E, shards,
                                                             run_region))
    if weights["z_loss"] > 0:
        parts.append(weights["z_loss"] * z_loss(logits_TE, shards, run_region))
    if weights["global_aux_loss"] > 0:
        parts.append(weights["global_aux_loss"] * global_aux_loss(scores_TE, idx_TK, shards, run_region))
    return torch.stack(parts)
