"""Decoder-only DeepSeek-style transformer: plain single-device PyTorch.

Legend: B batch, S sequence, D model dim, V vocabulary. Blocks live in a ModuleDict keyed by their
global index, so a pipeline stage that keeps a subset of them keeps the same parameter names (and
checkpoints stay layout-independent). A stage without `embed` takes hidden states; a stage without
`head` returns hidden states. Parallelism is applied from outside (`moe_lc.parallel.parallelize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.config.attention_kinds import attention_kind, load
from moe_lc.model.block import Block, named, run_phases
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.init import cast_params_, init_weights
from moe_lc.model.moe import MoE
from moe_lc.model.mtp import mtp_loss, mtp_module
from moe_lc.model.norm import RMSNorm
from moe_lc.model.residual_stream import residual_stream
from moe_lc.model.rope import RotaryEmbedding
from moe_lc.model.seams import hold_now, run_now
from moe_lc.ops.linear import Linear
from moe_lc.ops.regions import region


@region
def token_losses(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits_t)[label_t] in fp32: logits (T, V), labels (T,) -> (T,)."""
    return F.cross_entropy(logits_TV.float(), labels_T, reduction="none")


def masked_sum(loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor | None) -> torch.Tensor:
    """sum of per-token losses (B, S) weighted by loss_mask (B, S) (None: every token counts)."""
    return (loss_BS if loss_mask_BS is None else loss_BS * loss_mask_BS.to(loss_BS.dtype)).sum()


@region
def rows_logsumexp(logits_RV: torch.Tensor) -> torch.Tensor:
    """(R, V) 16-bit logits -> (R,) fp32 log-sum-exp."""
    return torch.logsumexp(logits_RV.float(), dim=-1)


@region
def rows_loss_grad(logits_RV: torch.Tensor, labels_R: torch.Tensor, lse_R: torch.Tensor,
                   scale_R1: torch.Tensor) -> torch.Tensor:
    """d/d logits of the rows' summed cross-entropy, (softmax - onehot(label)) * scale: (R, V) in the
    logits' dtype, computed in fp32 from the 16-bit logits and their fp32 log-sum-exp (R,); scale (R, 1)."""
    p = torch.exp(logits_RV.float() - lse_R[:, None])
    p = p.scatter_add(1, labels_R[:, None], -torch.ones_like(lse_R)[:, None])
    return (p * scale_R1).to(logits_RV.dtype)


class CrossEntropySum(nn.Module):
    """Sum over valid positions of -log p(label), in fp32.  logits (B, S, V); labels (B, S) int64;
    loss_mask (B, S) or None. Summed (not averaged) so the trainer can divide by the step's token
    count, which keeps the loss identical under any split of the batch. 16-bit logits go through
    `CrossEntropy16`, which keeps them instead of an fp32 log-softmax. `token_losses` gives the
    per-token losses (B, S) fp32 that are summed (the head books them per data source). Seam
    `run_region` runs the compiled regions (moe_lc/model/seams.py)."""

    def __init__(self):
        super().__init__()
        self.run_region = run_now

    def forward(self, logits_BSV, labels_BS, loss_mask_BS=None):
        return masked_sum(self.token_losses(logits_BSV, labels_BS), loss_mask_BS)

    def token_losses(self, logits_BSV, labels_BS):
        logits_TV, labels_T = logits_BSV.flatten(0, 1), labels_BS.flatten()
        if logits_BSV.dtype in (torch.bfloat16, torch.float16):
            return CrossEntropy16.apply(logits_TV, labels_T, self.run_region).view_as(labels_BS)
        return self.run_region(token_losses, logits_TV, labels_T).view_as(labels_BS)


class CrossEntropy16(torch.autograd.Function):
    """Per-token lse_t - logit_t[label_t] (T,) fp32 of 16-bit logits (T, V), computed `ROWS` rows at a
    time. Backward keeps the logits themselves (2 bytes an entry) and each row's fp32 log-sum-exp,
    not an fp32 log-softmax (4 bytes an entry), and no full fp32 copy of the logits ever exists: at
    DeepSeek-V3's 129K vocabulary that is 1 GiB less per 4K-token micro-batch and head, kept from the
    forward to the backward of the last pipeline stage, and ~3 GiB less working memory. run_region: the
    loss module's seam that runs the regions."""

    ROWS = 1024

    @staticmethod
    def forward(ctx, logits_TV, labels_T, run_region):
        lse_T = torch.cat([run_region(rows_logsumexp, c) for c in logits_TV.split(CrossEntropy16.ROWS)])
        ce_T = lse_T - logits_TV.gather(1, labels_T.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits_TV, labels_T, lse_T)
        ctx.run_region = run_region
        return ce_T

    @staticmethod
    def backward(ctx, grad_T):
        logits_TV, labels_T, lse_T = ctx.saved_tensors
        out = torch.empty_like(logits_TV)
        for start in range(0, len(logits_TV), CrossEntropy16.ROWS):
            rows = slice(start, start + CrossEntropy16.ROWS)
            out[rows] = ctx.run_region(rows_loss_grad, logits_TV[rows], labels_T[rows], lse_T[rows],
                                       grad_T[rows, None])
        return out, None, None


class Transformer(nn.Module):
    """tokens (B, S) -> loss sum (with labels) or logits (B, S, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.stream = residual_stream(cfg)  # the residual stream's start (widen) and read-out (stream_head)
        self.stream_head = self.stream.head(cfg)  # None: the head reads the stream as is
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = Linear(cfg.dim, cfg.vocab_size)
        self.head.fp8_eligible = False  # DeepSeek keeps the output head in bf16
        self.takes_tokens = True  # False on a pipeline stage after the first (it keeps a tied `embed` for its name)
        if cfg.tie_embeddings:  # one (V, D) parameter, named embed.weight; the state dict holds no head.weight
            self.tie_head_()
            self.register_state_dict_post_hook(_drop_tied_head)
            self.register_load_state_dict_post_hook(_tied_head_not_missing)
        self.loss_fn = CrossEntropySum()
        self.mtp = nn.ModuleList([mtp_module(cfg, cfg.n_layers + d) for d in range(cfg.mtp.depth)]) if cfg.mtp.depth else None
        self.mtp_loss_weight = cfg.mtp.loss_weight
        self.mtp_embed = None  # seam: the Borrowed embedding MTP uses on a stage without one (moe_lc/model/seams.py)
        positions = attention_kind(cfg).positions  # a kind with its own tables (V4) is handed positions instead
        self.rope = load(positions)(cfg) if positions else RotaryEmbedding.from_config(cfg.rope, cfg.rope_dim)
        self.hold = hold_now  # seam: the chains that read parameters (ZeRO-3 gathers around them)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                mtp: dict | None = None, stats: ForwardStats | None = None, docs=None,
                sources: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """inputs: tokens (B, S) int64 when this stage has `embed`, else hidden (B, S', D).
        positions: (S,) int64, the sequence positions attention sees (default arange(S); zig-zag
        shards under CP pass theirs), or (B, S) when each row has its own (positions restarting at
        each packed document). mtp: `mtp.mtp_targets` for multi-token prediction. stats: the
        step's `ForwardStats`, which this forward adds its MTP losses and MoE aux losses to. docs:
        the packed documents attention stays inside (moe_lc/ops/documents.py), or None. sources:
        (B,) int64, each row's data source, whose loss the head books in `stats` (None: not booked). tokens:
        the token ids (B, S) hash-routed MoE layers read (default: inputs, when they are tokens). Returns
        hidden (B, S', D) without `head`, else logits (B, S, V) when labels is None, else the fp32
        loss summed over valid tokens (plus the weighted MTP losses when mtp is given)."""
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        if tokens is None and not inputs.is_floating_point():
            tokens = inputs
        return run_phases(self.phases(positions, labels, loss_mask, mtp, stats, docs, sources, tokens), inputs)

    def phases(self, positions: torch.Tensor, labels=None, loss_mask=None, mtp: dict | None = None,
               stats: ForwardStats | None = None, docs=None, sources: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None) -> list:
        """This model's (or pipeline stage's) forward as a chain of phases: embedding (widened into the
        residual stream), every block's phases (Block.phases), then the stream's read-out, output head, loss
        and the MTP modules. tokens: the micro-batch's token ids (B, S) for hash-routed MoE layers, or None."""
        cos, sin = self.rope(positions)
        embeds = self.embed is not None and self.takes_tokens
        # the embedding's backward reads no parameter: its hold needs no gathering for backward
        widen, cfg = self.stream.widen, self.cfg
        chain = self.hold([named(lambda ids: (widen(cfg, self.embed(ids)),), "embed")], (self.embed,),
                          backward=False) if embeds else []
        for block in self.layers.values():
            chain += block.phases(cos, sin, stats, docs, tokens)
        if self.head is not None:
            mtp_embed = self.embed if self.embed is not None else getattr(self.mtp_embed, "module", None)
            reads = (self.stream_head, self.norm, self.head, self.mtp, mtp_embed if self.mtp is not None else None)
            chain += self.hold([named(lambda h: (self._output(h, labels, loss_mask, mtp, cos, sin, stats, docs,
                                                              sources),), "head")], reads)
        return chain

    def _output(self, h, labels, loss_mask, mtp, cos, sin, stats, docs, sources):
        # the MTP modules read the stream h itself (mHC's N copies, as DeepSeek-V4's MTP block does), not its read-out
        x = self.stream_head(h) if self.stream_head is not None else h
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        token_loss = self.loss_fn.token_losses(logits, labels)
        loss = masked_sum(token_loss, loss_mask)
        if stats is not None and sources is not None:
            stats.add_source_losses(token_loss.detach(), loss_mask, sources)
        if self.mtp is not None and mtp is not None:
            embed = self.embed if self.embed is not None else self.mtp_embed
            losses = mtp_loss(self.mtp, embed, self.head, self.loss_fn, h, mtp, cos, sin, stats, docs)
            if stats is not None:
                stats.add_mtp_losses(losses)
            loss = loss + self.mtp_loss_weight / len(losses) * sum(losses)
        return loss

    def tie_head_(self) -> None:
        """model.tie_embeddings: the output head reads the embedding's (V, D) parameter (again: moving a model
        off the meta device gives each module a new Parameter object). A no-op without either of them."""
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.weight

    def moe_layers(self) -> dict[str, MoE]:
        """MoE FFNs by block name ("3", ..., and "mtp0" for the MTP modules' blocks)."""
        out = {name: b.ffn for name, b in self.layers.items() if isinstance(b.ffn, MoE)}
        for d, module in enumerate(self.mtp or []):
            if isinstance(module.block.ffn, MoE):
                out[f"mtp{d}"] = module.block.ffn
        return out


def _drop_tied_head(model, state_dict, prefix, local_metadata) -> None:
    """State-dict hook of a tied model: the head's weight is embed.weight, saved once under that name."""
    if model.head is not None and model.embed is not None and model.head.weight is model.embed.weight:
        state_dict.pop(prefix + "head.weight", None)


def _tied_head_not_missing(model, incompatible_keys) -> None:
    """Load hook of a tied model: loading embed.weight loaded the head's weight too."""
    if "head.weight" in incompatible_keys.missing_keys and model.head is not None and model.embed is not None \
            and model.head.weight is model.embed.weight:
        incompatible_keys.missing_keys.remove("head.weight")


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """A fully initialized single-device model; parameters in `dtype`, buffers keep their own dtypes."""
    model = Transformer(cfg)
    init_weights(model, seed, cfg.init_std, cfg.n_layers)
    cast_params_(model, dtype)
    return model.to(device)


def state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full shapes of the model's checkpointed tensors (parameters and persistent buffers), built on meta."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
