"""Multi-token prediction (DeepSeek-V3): extra modules that predict tokens further ahead.

Module d (1..D) keeps the causal chain: at position i it combines the previous depth's hidden
state h^(d-1)_i (h^(0) = the main model's last hidden state) with the embedding of token t_(i+d)
and predicts t_(i+d+1):

    h^(d)_i = Block_d( W_d [RMSNorm(h^(d-1)_i) ; RMSNorm(Emb(t_(i+d)))] )
    loss_d  = CE( Head(RMSNorm_d(h^(d)_i)), t_(i+d+1) )        over positions where t_(i+d+1) exists

The embedding and output head are the main model's (shared); the objective adds
mtp_loss_weight / D * sum_d loss_d. Targets are built from the full sequence before any context-
parallel sharding (`mtp_targets`), so zig-zag shards never need their neighbours' tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.block import Block
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.norm import RMSNorm
from moe_lc.ops.linear import Linear


def mtp_targets(tokens: torch.Tensor, loss_mask: torch.Tensor | None, depth: int) -> dict:
    """Per-depth inputs and targets from full sequences. tokens: (B, S+1) = inputs + shifted labels.

    Returns {"inputs": (B, D, S) token ids t_(i+d), "labels": (B, D, S) targets t_(i+d+1),
    "mask": (B, D, S) float, 0 where the target lies beyond the sequence}; dim 2 is the sequence
    (what context parallelism shards)."""
    B, S1 = tokens.shape
    S = S1 - 1
    inputs = torch.zeros(B, depth, S, dtype=tokens.dtype, device=tokens.device)
    labels = torch.zeros_like(inputs)
    mask = torch.zeros(B, depth, S, dtype=torch.float32, device=tokens.device)
    for d in range(1, depth + 1):
        inputs[:, d - 1, : S + 1 - d] = tokens[:, d:]
        labels[:, d - 1, : S - d] = tokens[:, d + 1:]
        valid = torch.ones(B, S - d, device=tokens.device) if loss_mask is None else loss_mask[:, d:].float()
        mask[:, d - 1, : S - d] = valid
    return {"inputs": inputs, "labels": labels, "mask": mask}


class MTPModule(nn.Module):
    """One prediction depth: h (B, S, D), next-token embeddings (B, S, D) -> h' (B, S, D)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim)
        self.block = Block(cfg, layer_id)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BSD, emb_BSD, cos, sin, stats: ForwardStats | None = None, docs=None):
        x = self.eh_proj(torch.cat([self.hnorm(h_BSD), self.enorm(emb_BSD)], dim=-1))
        return self.block(x, cos, sin, stats, docs)


def mtp_loss(modules: nn.ModuleList, embed, head, loss_fn, h_BSD, targets: dict, cos, sin,
             stats: ForwardStats | None = None, docs=None) -> list[torch.Tensor]:
    """Summed CE of each depth (a list of D fp32 scalars); `embed`/`head`/`loss_fn` are the main
    model's shared modules; `stats`, `docs` as `Transformer.forward`'s."""
    losses = []
    for d, module in enumerate(modules):
        h_BSD = module(h_BSD, embed(targets["inputs"][:, d]), cos, sin, stats, docs)
        logits = head(module.norm(h_BSD))
        losses.append(loss_fn(logits, targets["labels"][:, d], targets["mask"][:, d]))
    return losses
