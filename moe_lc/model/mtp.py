"""Multi-token prediction (DeepSeek-V3): extra modules that predict tokens further ahead.

Module d (1..D) keeps the causal chain: at position i it combines the previous depth's hidden
state h^(d-1)_i (h^(0) = the main model's last hidden state) with the embedding of token t_(i+d)
and predicts t_(i+d+1):

    h^(d)_i = Block_d( W_d [RMSNorm(h^(d-1)_i) ; RMSNorm(Emb(t_(i+d)))] )
    loss_d  = CE( Head(RMSNorm_d(h^(d)_i)), t_(i+d+1) )        over positions where t_(i+d+1) exists

The embedding and output head are the main model's (shared); the objective adds
mtp_loss_weight / D * sum_d loss_d. Targets are built from the full sequence before any context-
parallel sharding (`mtp_targets`), so zig-zag shards never need their neighbours' tokens.

With mHC (model.residual = "mhc", DeepSeek-V4) a module works on the widened stream (B, S, N, D), as DeepSeek's
own V4 inference code does (`MTPBlock` in inference/model.py of the deepseek-ai/DeepSeek-V4-Flash release):

    h^(d) = Block_d( e_proj(enorm(Emb(t_(i+d)))) broadcast over the N copies + h_proj(hnorm(h^(d-1))) )   (B, S, N, D)
    loss_d = CE( Head(norm_d(HyperHead_d(h^(d)))), t_(i+d+1) )

h^(0) is the main model's stream before its HyperHead (not the collapsed hidden state); hnorm and h_proj act on
each copy; e_proj, h_proj (D, D) are the two halves of V3's eh_proj (checkpoint names mtp.0.e_proj / h_proj);
each depth has its own HyperHead (hc_head_fn / base / scale) and output norm, the embedding and head are the main
model's. The block is a whole V4 block (mHC around attention and MoE), layer id n_layers + d - 1, so its MoE is
learned-routed (DeepSeek hash-routes ids below n_hash_layers only; ModelConfig.is_hash_layer) and its attention
type is [model.v4_attention] mtp_layer_type (DeepSeek's config lists it as compress_ratios[n_layers], 0 = window
only in V4-Flash's; transformers drops that entry). DeepSeek ships one depth; for d > 1 the source is silent and
the next depth reads this depth's stream h^(d) before its HyperHead (the same rule as depth 1).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.block import Block
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.norm import RMSNorm
from moe_lc.model.residual_stream import residual_stream
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


def block_config(cfg: ModelConfig, depth: int | None = None) -> ModelConfig:
    """The [model] section the MTP blocks are built from: [model.v4_attention] layer_types lists the blocks' type
    (mtp_layer_type) after the n_layers main ones, for `depth` blocks (default model.mtp.depth), so block
    n_layers + d finds its type as the main blocks find theirs (only V4 attention reads that section)."""
    a = cfg.v4_attention
    types = a.layer_types_for(cfg.n_layers) + [a.mtp_layer_type] * (cfg.mtp.depth if depth is None else depth)
    return replace(cfg, v4_attention=replace(a, layer_types=types))


class MTPModule(nn.Module):
    """One prediction depth (DeepSeek-V3): h (B, S, D), next-token embeddings (B, S, D) -> h' (B, S, D)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim)
        self.block = Block(block_config(cfg), layer_id)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BSD, emb_BSD, cos, sin, stats: ForwardStats | None = None, docs=None):
        x = self.eh_proj(torch.cat([self.hnorm(h_BSD), self.enorm(emb_BSD)], dim=-1))
        return self.block(x, cos, sin, stats, docs)

    def read_out(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """What the shared output head reads: norm_d(h) (B, S, D)."""
        return self.norm(h_BSD)


class StreamMTPModule(nn.Module):
    """One prediction depth on mHC's stream (DeepSeek-V4, module docstring): h (B, S, N, D), next-token embeddings
    (B, S, D) -> h' (B, S, N, D). e_proj, h_proj: (D, D); stream_head: this depth's HyperHead."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.e_proj = Linear(cfg.dim, cfg.dim)
        self.h_proj = Linear(cfg.dim, cfg.dim)
        self.block = Block(block_config(cfg), layer_id)
        self.stream_head = residual_stream(cfg).head(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BSND, emb_BSD, cos, sin, stats: ForwardStats | None = None, docs=None):
        x = self.e_proj(self.enorm(emb_BSD)).unsqueeze(2) + self.h_proj(self.hnorm(h_BSND))
        return self.block(x, cos, sin, stats, docs)

    def read_out(self, h_BSND: torch.Tensor) -> torch.Tensor:
        """What the shared output head reads: norm_d(HyperHead_d(h)) (B, S, D)."""
        return self.norm(self.stream_head(h_BSND))


MTP_MODULES = {"plain": MTPModule, "mhc": StreamMTPModule}  # by model.residual


def mtp_module(cfg: ModelConfig, layer_id: int) -> nn.Module:
    """Prediction depth layer_id - n_layers + 1 for the recipe's residual stream."""
    return MTP_MODULES[cfg.residual](cfg, layer_id)


def mtp_loss(modules: nn.ModuleList, embed, head, loss_fn, h, targets: dict, cos, sin,
             stats: ForwardStats | None = None, docs=None) -> list[torch.Tensor]:
    """Summed CE of each depth (a list of D fp32 scalars); `embed`/`head`/`loss_fn` are the main
    model's shared modules; h: the main model's last stream (B, S, D), or (B, S, N, D) with mHC, before
    any read-out; `stats`, `docs` as `Transformer.forward`'s."""
    losses = []
    for d, module in enumerate(modules):
        h = module(h, embed(targets["inputs"][:, d]), cos, sin, stats, docs)
        logits = head(module.read_out(h))
        losses.append(loss_fn(logits, targets["labels"][:, d], targets["mask"][:, d]))
    return losses
