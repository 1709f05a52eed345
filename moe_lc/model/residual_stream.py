"""The residual stream, a choice made once (model.residual, `residual_stream(cfg)`): what a block's sublayers
(attention, FFN) read from the stream and how their outputs go back into it, how the stream starts from the
embedding and how the output head reads it.

    plain  h + f(norm(h)); the stream is the hidden state (B, S, D)
    mhc    DeepSeek-V4's manifold-constrained hyper-connections (arXiv 2606.19348 section 2.2; transformers'
           DeepseekV4HyperConnection / DeepseekV4HyperHead in
           src/transformers/models/deepseek_v4/modeling_deepseek_v4.py): the stream is N = hc_mult copies
           (B, S, N, D), the embedding repeated N times. Around each sublayer, from the RMS-normalized
           flattened stream x = rms(h (B, S, N*D)) (no weight) and one projection W (N(N+2), N*D):
               pre  = sigmoid(a_pre  x W_pre  + b_pre) + eps             (N,)   the sublayer reads sum_n pre_n h_n
               post = 2 sigmoid(a_post x W_post + b_post)                (N,)
               comb = SK(softmax(a_comb x W_comb + b_comb) + eps)        (N, N) rows of the softmax over the last
                                                                                axis, SK: Sinkhorn-Knopp
               h'_k = post_k f + sum_j comb_jk h_j
           SK divides by column sums once, then sinkhorn_iters - 1 times by row sums and by column sums (each
           sum + eps): doubly stochastic up to its convergence, so the mix of the N copies neither grows nor
           shrinks them. All of it in fp32. The head collapses the streams by its own `pre` (HyperHead).

A sublayer's residual is `split(h) -> (x, *carried)` (x the sublayer's input (B, S, D); carried: what merge
needs) and `merge(h, out, *carried) -> h'`: the carried tensors flow through a block's phase tuples (an MoE
block's dispatch, experts and combine phases), where a phased run cuts the graph.

Saved for backward per token and sublayer (mHC, N = hc_mult, stream dtype of b bytes), measured with saved-tensor
hooks at D = 256, N = 4: the stream h itself (b N D; the previous merge's output, kept by collapse and mix), an
fp32 copy of it (4 N D, the norm's input; none when b = 4), the normalized fp32 x the projection keeps (4 N D),
the sublayer's output (b D) and the maps with Sinkhorn-Knopp's intermediates (~(2 sinkhorn_iters + 3) N^2 fp32:
2.7 KB at N = 4, 20 iterations). bf16 at V4-Flash's D = 4096: ~8 N D + 2 N D + 2 D = 172 KB a sublayer, against
Megatron's 34 D = 139 KB for a whole dense block: recomputing the norm and projection in backward (keeping h
only) is the obvious next step.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.ops.linear import Linear


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / RMS(x) over the last dim, no weight (transformers' DeepseekV4UnweightedRMSNorm); x fp32."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """(..., N, N) positive -> near doubly stochastic: a column normalization, then iters - 1 row-and-column
    rounds (DeepSeek-V4's order; transformers' DeepseekV4HyperConnection)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def collapse(weights_BSN: torch.Tensor, h_BSND: torch.Tensor) -> torch.Tensor:
    """sum_n w_n h_n (B, S, D) in h's dtype, the product in fp32 as transformers computes it."""
    return (weights_BSN.unsqueeze(-1) * h_BSND).sum(dim=2).to(h_BSND.dtype)


def _projection(n_out: int, n_in: int) -> Linear:
    """The maps' projection W: fp32 compute from an fp32 input (as the router's gate), never FP8, not deferred
    (a GEMM of a few dozen rows)."""
    w = Linear(n_in, n_out)
    w.fp8_eligible = w.defer_wgrad = False
    return w


class PlainResidual:
    """h + f(h): the sublayer reads the stream itself (no parameters; not a module)."""

    carried = 0

    def split(self, h_BSD: torch.Tensor) -> tuple[torch.Tensor]:
        return (h_BSD,)

    def merge(self, h_BSD: torch.Tensor, out_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD + out_BSD


class HyperConnection(nn.Module):
    """One sublayer's mHC (module docstring). fn: Linear (N(N+2), N*D), rows [pre | post | comb]; bias: (N(N+2),)
    the static maps b; scale: (3,) the gating factors a of pre, post and comb. Replicated under TP (the sequence
    shard's maps, like the router's gate)."""

    carried = 2  # post (B, S, N), comb (B, S, N, N)
    init_ones = ("scale",)  # (init.py) fn ~ Normal(0, init_std), bias 0, scale 1: transformers' _init_weights
    no_weight_decay = ("scale",)  # a gain (parallelize.no_weight_decay_names), its bias too by name

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = self.n = cfg.mhc.hc_mult
        self.iters, self.eps, self.norm_eps = cfg.mhc.sinkhorn_iters, cfg.mhc.eps, cfg.norm_eps
        self.fn = _projection((2 + n) * n, n * cfg.dim)
        self.bias = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def maps(self, h_BSND: torch.Tensor):
        """-> pre (B, S, N), post (B, S, N), comb (B, S, N, N), fp32."""
        n = self.n
        mixes = self.fn(rms(h_BSND.flatten(2).float(), self.norm_eps))
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.bias.float().split([n, n, n * n])
        a_pre, a_post, a_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * a_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * a_post + post_b)
        comb = torch.softmax((comb_w * a_comb).unflatten(-1, (n, n)) + comb_b.view(n, n), dim=-1) + self.eps
        return pre, post, sinkhorn(comb, self.iters, self.eps)

    def split(self, h_BSND: torch.Tensor):
        """-> the sublayer's input (B, S, D) and the carried post (B, S, N), comb (B, S, N, N) fp32."""
        pre, post, comb = self.maps(h_BSND)
        return collapse(pre, h_BSND), post, comb

    def merge(self, h_BSND: torch.Tensor, out_BSD: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """h'_k = post_k out + sum_j comb_jk h_j: (B, S, N, D) in h's dtype."""
        dtype = h_BSND.dtype
        return post.to(dtype).unsqueeze(-1) * out_BSD.unsqueeze(-2) + comb.to(dtype).mT @ h_BSND


class HyperHead(nn.Module):
    """mHC's read-out before the final norm: sum_n pre_n h_n with pre = sigmoid(a x W + b) + eps, x the
    normalized flattened stream. fn: Linear (N, N*D), bias (N,), scale (1,)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.mhc.hc_mult
        self.eps, self.norm_eps = cfg.mhc.eps, cfg.norm_eps
        self.init_ones = self.no_weight_decay = ("scale",)
        self.fn = _projection(n, n * cfg.dim)
        self.bias = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, h_BSND: torch.Tensor) -> torch.Tensor:
        mixes = self.fn(rms(h_BSND.flatten(2).float(), self.norm_eps))
        pre = torch.sigmoid(mixes * self.scale.float() + self.bias.float()) + self.eps
        return collapse(pre, h_BSND)


class PlainStream:
    """model.residual = 'plain'."""

    @staticmethod
    def sublayer(cfg: ModelConfig):
        return PlainResidual()

    @staticmethod
    def head(cfg: ModelConfig) -> nn.Module | None:
        return None

    @staticmethod
    def widen(cfg: ModelConfig, e_BSD: torch.Tensor) -> torch.Tensor:
        return e_BSD


class MHCStream:
    """model.residual = 'mhc'."""

    sublayer = HyperConnection
    head = HyperHead

    @staticmethod
    def widen(cfg: ModelConfig, e_BSD: torch.Tensor) -> torch.Tensor:
        """The embedding as hc_mult copies: (B, S, D) -> (B, S, N, D)."""
        return e_BSD.unsqueeze(2).expand(-1, -1, cfg.mhc.hc_mult, -1).contiguous()


RESIDUAL_STREAMS = {"plain": PlainStream, "mhc": MHCStream}  # keys: config.choices.ResidualStream


def residual_stream(cfg: ModelConfig):
    """The recipe's residual stream: `.sublayer(cfg)` per attention / FFN, `.head(cfg)` (None: the head reads
    the stream as is), `.widen(cfg, embedding)`."""
    return RESIDUAL_STREAMS[cfg.residual]


def stream_dims(cfg: ModelConfig) -> tuple[int, ...]:
    """The trailing dims of the stream between blocks (a pipeline's activations): (D,) or (N, D)."""
    return (cfg.mhc.hc_mult, cfg.dim) if cfg.residual == "mhc" else (cfg.dim,)
