"""The tensor-parallel rules of the layer plan: a table from module type to how its parameters are cut
and which TP role its Linears take (the layout is described in tp/mappings.py). `tensor_parallel_plan` walks
the model and records each module type's entry: shards in the placements (which the optimizer,
checkpoints and the planner read), roles and local head counts in the layer plan (layer_plan.py).
An attention module's rule is its kind's `tp_rule` (moe_lc/config/attention_kinds.py): GQA's and MLA's
are here, DSA's in parallel/dsa_plan.py, DeepSeek-V4's in parallel/v4_plan.py.

    Attention      `gqa_rule`: wqkv column-parallel by heads (q | k | v sections; kv heads replicated
                   when K < N), wo row-parallel (its bias replicated, added after the sum); qk_norm
                   "head": RMSNorm rule; "full": weights cut like the q / k rows, the row's sum of
                   squares all-reduced
    MLAttention    `mla_rule`: latent projection wa replicated on the sequence shard ("dp_cp_tp") with
                   one gather of the latents; up-projections split by heads; wo row-parallel
    SwiGLU         w13 column-parallel ([gate | up], each half split), w2 row-parallel
    MoE            its shared-expert gate (Qwen2-MoE) replicated on the sequence shard ("dp_cp_tp"), like
                   the router; the shared experts are a SwiGLU
    RMSNorm,       replicated; their gradient covers only this rank's sequence shard ("dp_cp_tp")
    Router,
    HyperConnection, mHC's maps and read-out (moe_lc/model/residual_stream.py): per token, so on the sequence
    HyperHead      shard; their projections are a few dozen rows
    HashRouter     replicated too; its token ids cut to this rank's sequence shard (`token_shard`), as SP
                   cuts the hidden states (contiguous chunks in tp rank order)
    RoutedExperts  not tensor-parallel (expert parallelism folds over dp x cp x tp)
    MTPModule      input projection eh_proj (V4's StreamMTPModule: e_proj, h_proj) replicated on the shard
                   ("dp_cp_tp"); its norms, block and HyperHead are visited as modules of their own
    embedding      vocab-parallel rows; head column-parallel over the vocabulary with a vocab-parallel
                   cross-entropy (a tied head reads the embedding's rows: the same shards)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moe_lc.config.attention_kinds import attention_kind, load, module_kinds
from moe_lc.model.ffn import SwiGLU
from moe_lc.model.hash_router import HashRouter
from moe_lc.model.moe import MoE, RoutedExperts, Router
from moe_lc.model.mtp import MTPModule, StreamMTPModule
from moe_lc.model.norm import RMSNorm
from moe_lc.model.qk_norm import WideRMSNorm
from moe_lc.model.residual_stream import HyperConnection, HyperHead
from moe_lc.ops.linear import Linear
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Placements, Shard
from moe_lc.parallel.tp.mappings import (ColumnParallel, RowParallel, RowSquaresOverTP, SequenceGather,
                                         VocabParallelCrossEntropy, VocabParallelEmbedding, kv_share_group,
                                         replicated_rows_grad)


@dataclass
class _TP:
    dims: ParallelDims
    placements: Placements
    plan: object  # the LayerPlan being resolved (layer_plan.py, which imports this file)

    def __post_init__(self):
        self.group, self.n = self.dims["tp"], self.dims.tp
        self.column, self.row = ColumnParallel(self.group), RowParallel(self.group)

    def shard(self, param: nn.Parameter, shard: Shard) -> None:
        self.placements.shard_(param, shard, self.group)

    def linear(self, linear: Linear, shard: Shard, role) -> None:
        if linear.bias is not None and role is self.row:  # added once after the sum, on the sequence shard
            self.placements.set_group([linear.bias], "dp_cp_tp")
        elif linear.bias is not None:
            self.shard(linear.bias, Shard(shard.group, 0, shard.sections))
        self.shard(linear.weight, shard)
        self.plan.set(linear, tp=role)


def gqa_rule(attn: nn.Module, tp: _TP) -> list:
    """An Attention (moe_lc/model/attention.py): the module docstring's first row."""
    H, K, Dh, N = attn.n_heads, attn.n_kv_heads, attn.head_dim, tp.n
    kv_pieces = min(K, N)  # K < N: each kv head replicated on N/K ranks
    tp.linear(attn.wqkv, Shard("tp", 0, ((H * Dh, N), (K * Dh, kv_pieces), (K * Dh, kv_pieces))), tp.column)
    tp.linear(attn.wo, Shard("tp", 1), tp.row)
    tp.plan.set(attn, n_heads=H // N, n_kv_heads=K // kv_pieces)
    if K < N:  # the k|v rows of the weight and of the bias (Qwen2's) are replicated: sum their gradients
        for param in (p for p in (attn.wqkv.weight, attn.wqkv.bias) if p is not None):
            hook, weight = replicated_rows_grad(param, H // N * Dh, kv_share_group(tp.dims, K))
            place = tp.placements.of(param)
            place.grad_hooks, place.norm_weight = (*place.grad_hooks, hook), weight
    if isinstance(attn.q_norm, WideRMSNorm):  # "full": a slice of the row per rank, like the q / k rows
        tp.shard(attn.q_norm.weight, Shard("tp", 0))
        tp.shard(attn.k_norm.weight, Shard("tp", 0, ((K * Dh, kv_pieces),)))
        tp.plan.set(attn.q_norm, sum_squares=RowSquaresOverTP(tp.group))
        tp.plan.set(attn.k_norm, sum_squares=RowSquaresOverTP(tp.group, N // kv_pieces))
        if K < N:  # each of the N/K ranks sharing a kv head has its own heads' share of the gradient
            hook, weight = replicated_rows_grad(attn.k_norm.weight, 0, kv_share_group(tp.dims, K))
            place = tp.placements.of(attn.k_norm.weight)
            place.grad_hooks, place.norm_weight = (*place.grad_hooks, hook), weight
    return list(attn.parameters())


def mla_rule(attn: nn.Module, tp: _TP) -> list:
    """An MLAttention (moe_lc/model/mla.py): the module docstring's second row."""
    tp.placements.set_group(attn.wa.parameters(), "dp_cp_tp")
    tp.plan.set(attn, gather=SequenceGather(tp.group))
    if attn.wq_b is not None:
        tp.shard(attn.wq_b.weight, Shard("tp", 0))  # rows are head-major: (H, Dn + Dr)
    else:
        tp.linear(attn.wq, Shard("tp", 0), tp.column)  # queries straight from x gather x
    tp.shard(attn.wkv_b.weight, Shard("tp", 0))  # rows (H, Dn + Dv)
    tp.linear(attn.wo, Shard("tp", 1), tp.row)
    tp.plan.set(attn, n_heads=attn.n_heads // tp.n)
    own = [attn.wa, attn.wkv_b, attn.wo] + [m for m in (attn.wq, attn.wq_b) if m is not None]
    return [p for m in own for p in m.parameters()]  # its latent norms are visited on their own


def _swiglu(ffn: SwiGLU, tp: _TP) -> list:
    hidden = ffn.w2.weight.shape[1]
    tp.linear(ffn.w13, Shard("tp", 0, ((hidden, tp.n), (hidden, tp.n))), tp.column)
    tp.linear(ffn.w2, Shard("tp", 1), tp.row)
    return list(ffn.parameters())


def _moe(moe: MoE, tp: _TP) -> list:
    """The shared-expert gate only: the router, experts and shared SwiGLU are visited on their own."""
    if moe.shared_gate is None:
        return []
    tp.placements.set_group(moe.shared_gate.parameters(), "dp_cp_tp")
    return list(moe.shared_gate.parameters())


def _replicated(module: nn.Module, tp: _TP) -> list:
    tp.placements.set_group(module.parameters(), "dp_cp_tp")
    return list(module.parameters())


class SequenceShardOf:
    """The hash router's `token_shard` under SP: token ids (B, S) -> this tp rank's contiguous chunk (B, S / tp)."""

    def __init__(self, rank: int, ranks: int):
        self.rank, self.ranks = rank, ranks

    def __call__(self, tokens_BS):
        return tokens_BS.chunk(self.ranks, dim=1)[self.rank]

    def __repr__(self) -> str:
        return f"SequenceShardOf({self.rank}/{self.ranks})"


def _hash_router(router: HashRouter, tp: _TP) -> list:
    tp.plan.set(router, token_shard=SequenceShardOf(tp.group.rank, tp.n))
    return _replicated(router, tp)


def _mtp_projection(module: MTPModule | StreamMTPModule, tp: _TP) -> list:
    names = ("e_proj", "h_proj") if isinstance(module, StreamMTPModule) else ("eh_proj",)
    weights = [getattr(module, name).weight for name in names]
    tp.placements.set_group(weights, "dp_cp_tp")
    return weights


def gqa_kv_groups(cfg, dims: ParallelDims) -> None:
    """The groups of tp ranks sharing a kv head when model.n_kv_heads < tp (`gqa_rule` sums over them)."""
    if cfg.n_kv_heads < dims.tp:
        kv_share_group(dims, cfg.n_kv_heads)


TP_PLAN = {SwiGLU: _swiglu, RMSNorm: _replicated, Router: _replicated, HashRouter: _hash_router,
           HyperConnection: _replicated, HyperHead: _replicated,
           RoutedExperts: lambda module, tp: list(module.parameters()), MTPModule: _mtp_projection,
           StreamMTPModule: _mtp_projection, MoE: _moe}


def tensor_parallel_plan(model: nn.Module, dims: ParallelDims, placements: Placements, plan) -> None:
    """Plan a single-device Transformer's tensor parallelism over dims["tp"] with sequence parallelism:
    every shard into `placements`, every module's role into `plan` (nothing on the model changes here)."""
    assert model.cfg.n_heads % dims.tp == 0 and model.cfg.vocab_size % dims.tp == 0, "checked by the recipe's rules"
    tp = _TP(dims, placements, plan)
    groups = attention_kind(model.cfg).tp_groups
    if groups is not None:
        load(groups)(model.cfg, dims)  # every stage creates them, attention or not
    rules = {**TP_PLAN, **{module_type: load(kind.tp_rule) for module_type, kind in module_kinds().items()}}
    handled = set()
    for module in list(model.modules()):
        rule = rules.get(type(module))
        if rule is not None:
            handled |= {id(p) for p in rule(module, tp)}
    if getattr(model, "embed", None) is not None:
        tp.shard(model.embed.weight, Shard("tp", 0))
        plan.set(model, embed=VocabParallelEmbedding(model.embed.weight, tp.group))
        handled.add(id(model.embed.weight))
    if getattr(model, "head", None) is not None:
        if model.head.weight is getattr(model.embed, "weight", None):  # tied: the embedding's vocabulary shards
            plan.set(model.head, tp=tp.column)
        else:
            tp.linear(model.head, Shard("tp", 0), tp.column)
        plan.set(model, loss_fn=VocabParallelCrossEntropy(tp.group))
        handled |= {id(p) for p in model.head.parameters()}
    unknown = [n for n, p in model.named_parameters() if id(p) not in handled]
    assert not unknown, f"the tensor-parallel plan does not cover parameters {unknown}"
