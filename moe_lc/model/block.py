"""One transformer block (pre-norm attention + FFN or MoE), and its forward as a chain of phases.

Legend: B batch, S sequence (local), D model dim, h the residual stream ((B, S, D), or (B, S, N, D) with mHC:
moe_lc/model/residual_stream.py). Used by the main model and by each MTP module.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.config.attention_kinds import attention_kind
from moe_lc.model.ffn import SwiGLU
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.hash_router import router_for
from moe_lc.model.moe import MoE
from moe_lc.model.norm import RMSNorm
from moe_lc.model.residual_stream import residual_stream
from moe_lc.model.seams import hold_now, run_now, through


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)); attn is the attention kind's module, ffn dense
    SwiGLU or MoE (its router the layer's kind: hash_router.router_for). How each sublayer reads the stream
    and writes back to it is the residual stream's (`attn_res`, `ffn_res`: residual_stream.py).
    Seam `replay` runs the whole block, or each of its phases; `hold` marks its phases as the chain that
    reads its parameters (moe_lc/model/seams.py); `forward` leaves holding to its caller (an MTP module).
    `replay_each_phase` (a layer-plan decision): whether `phases` replays each phase apart (each keeps its own
    inputs: what DualPipe's F&B needs, which interleaves two micro-batches' phases) or the whole block as one
    phase (it keeps only the block's input, as Megatron-LM's full recomputation does)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = attention_kind(cfg).new_module(cfg, layer_id)  # the kind's (moe_lc/config/attention_kinds.py)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(cfg, router_for(cfg, layer_id)) if cfg.is_moe_layer(layer_id) else SwiGLU(cfg.dim, cfg.ffn_dim)
        stream = residual_stream(cfg)
        self.attn_res, self.ffn_res = stream.sublayer(cfg), stream.sublayer(cfg)
        self.replay = run_now
        self.replay_each_phase = True
        self.hold = hold_now

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                stats: ForwardStats | None = None, docs=None, tokens=None) -> torch.Tensor:
        phases = self._phases(cos, sin, stats, docs, tokens)  # made once: a replay reruns them with this forward's state
        return self.replay(lambda x: run_phases(phases, x), x_BSD)

    def phases(self, cos: torch.Tensor, sin: torch.Tensor, stats: ForwardStats | None = None, docs=None,
               tokens=None) -> list:
        """The block as a chain of phases, each taking and returning a tuple of tensors:
        [attention, ffn] for a dense block, [attention, dispatch, experts, combine] for an MoE block.
        A pipeline interleaves two micro-batches at these boundaries (DualPipe's F&B). Under full recomputation
        (the `replay` seam) each phase keeps only its inputs, or, without `replay_each_phase`, the chain is one
        phase, the whole block replayed from its input alone (the rows its all-to-alls moved are moved again in
        the replay). `stats`: the step's `ForwardStats`, where an MoE block books its routing and records its
        aux loss. `docs`: the micro-batch's packed documents (moe_lc/ops/documents.py) when attention stays
        inside each, else None. `tokens`: the micro-batch's token ids (B, S), which a hash-routed MoE layer
        reads, or None."""
        phases = self._phases(cos, sin, stats, docs, tokens)
        if not self.replay_each_phase:  # made once: the replay reruns them with this forward's state
            return self.hold([named(lambda h: (self.replay(lambda x: run_phases(phases, x), h),), "block")], (self,))
        return self.hold([named(lambda *state, fn=fn: self.replay(fn, *state), fn.__name__) for fn in phases],
                         (self,))

    def _phases(self, cos: torch.Tensor, sin: torch.Tensor, stats: ForwardStats | None = None, docs=None,
                tokens=None) -> list:
        attn_res, ffn_res = self.attn_res, self.ffn_res

        def attention(h):
            x, *carried = attn_res.split(h)
            return (attn_res.merge(h, self.attn(self.attn_norm(x), cos, sin, docs, stats), *carried),)

        def ffn(h):
            x, *carried = ffn_res.split(h)
            return (ffn_res.merge(h, self.ffn(self.ffn_norm(x)), *carried),)

        if not isinstance(self.ffn, MoE):
            return [attention, ffn]
        moe, ctx, n = self.ffn, {}, ffn_res.carried  # the residual's carried tensors ride behind h

        def dispatch(h):
            x, *carried = ffn_res.split(h)
            return (h, *carried, *moe.dispatch_phase(ctx, self.ffn_norm(x), stats, tokens))

        def experts(h, *state):
            return (h, *state[:n], *moe.expert_phase(ctx, *state[n:]))

        def combine(h, *state):
            return (ffn_res.merge(h, moe.combine_phase(ctx, *state[n:], stats=stats), *state[:n]),)

        return [attention, dispatch, experts, combine]


def named(fn, name: str):
    """fn, called `name` (what timelines and traces show for a phase)."""
    fn.__name__ = name
    return fn


def run_phases(phases: list, x):
    """Run a chain of phases (each maps a tuple of tensors to the next) from the single input x; rows a
    phase hands on as a `Transfer` arrive before the next phase starts."""
    state = (x,)
    for phase in phases:
        state = through(phase(*state))
    return state[0]
