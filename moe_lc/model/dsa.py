"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA whose queries attend only to the top-k keys a
lightning indexer picks, trained in the report's two stages.

Legend: B batch, S sequence (local: a zig-zag shard under CP), D model dim, H heads (tp-local), Cq / Ckv
the query / key-value latent ranks, Dn / Dr / Dv MLA's nope, rope and value head dims, G indexer heads,
E indexer head dim, k = model.dsa.index_topk.

    indexer (transformers' DeepseekV32Indexer; names in brackets are its parameters)
      q_I = rope(wq(q_norm(c_q)))              (B, S, G, E)   [indexer.wq_b], RoPE on the first Dr dims
      k_I = rope(LayerNorm(wk(x)))             (B, S, E)      [indexer.wk, indexer.k_norm], one key per token
      w   = weights_proj(x) * G^-0.5           (B, S, G)      [indexer.weights_proj]
    (wk and weights_proj are one Linear here, `wkw` = [wk; weights_proj]: x is kept once for its W.)
      I(t, s) = sum_g w(t, g) relu(E^-0.5 q_I(t, g) . k_I(s));  S_t = top-k visible s of I(t, .)
    Its inputs are detached: no gradient reaches the main model from the indexer (report, section 2.1).
    RoPE here is the half-split layout (the main MLA's is DeepSeek's interleaved one, which the converter
    permutes away); the reference's Hadamard rotation and FP8 scoring keep dot products, so are left out,
    as transformers does.

    stage "sparse"   attention over S_t only, in MLA's absorbed ("MQA") form: q_abs = [q_nope W_UK, q_rope]
                     (B, S, H, Ckv + Dr) against the shared rows [kv_norm(c_kv), rope(k_r)], values the latent,
                     out = attention @ W_UV^T; the indexer's loss is KL(p(t, S_t) || softmax(I(t, S_t))), p the
                     attention's probabilities summed over heads and L1-normalized.
    stage "warmup"   MLA's own dense attention (every seam as for MLA); the indexer's loss is the KL over
                     every visible key. The rest of the model is frozen: learning-rate scale 0 in the
                     optimizer, the routers' biases kept (the kind's training fields, below).

The ring passes (selection, sparse attention, both losses) are moe_lc/ops/dsa_*.py; `sparse_core` is the
seam where they run: one device here, the zig-zag "cp" ring and the tp head sums under a parallel layout
(moe_lc/parallel/dsa_plan.py). Each layer's loss trains through `AttachLoss` on its output, scaled to this
micro-batch's share of the step's mean over tokens; its sums reach the step's `ForwardStats` in backward,
which runs once per micro-batch whatever is recomputed. The kind's training part (its registry entry's
`lr_scales`, `routers_frozen`, `fresh_params`) is `dsa_lr_scale`, `dsa_warmup` and `dsa_fresh_params` here;
its step metrics, `dsa_step_metrics`, are in moe_lc/parallel/dsa_plan.py.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_lc.config import ModelConfig
from moe_lc.model.mla import MLAttention
from moe_lc.model.rope import apply_rope
from moe_lc.model.saved_tensors import recompute_from
from moe_lc.model.seams import run_now
from moe_lc.ops.dsa_attention import IndexerKLSparse, SparseLatentAttention, selected_probs, split_wkv
from moe_lc.ops.dsa_ring import OneRank, RingLayout, select
from moe_lc.ops.attention import note_max_lse
from moe_lc.ops.dsa_warmup import IndexerKLDense, head_lse
from moe_lc.ops.linear import Linear


class AttachLoss(torch.autograd.Function):
    """Identity on `out` whose backward also sends d(loss) = 1 into the loss's graph: an auxiliary loss
    that trains without being threaded to the model's loss (and works per pipeline stage)."""

    @staticmethod
    def forward(ctx, out, loss):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, grad_out.new_ones((), dtype=torch.float32)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in fp32 whatever the activation dtype (the indexer's k_norm)."""

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class LightningIndexer(nn.Module):
    """The indexer's parameters and per-token projections (module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.dsa
        self.n_heads, self.head_dim, self.topk = d.index_n_heads, d.index_head_dim, d.index_topk
        self.wq = Linear(cfg.mla.q_lora_rank, self.n_heads * self.head_dim)
        self.wkw = Linear(cfg.dim, self.head_dim + self.n_heads)  # [wk; weights_proj]
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.scale = self.head_dim ** -0.5
        self.run_region = run_now

    @property
    def token_dim(self) -> int:
        """Width of the per-token part, [wk(x) | weights_proj(x)]."""
        return self.head_dim + self.n_heads

    def project_tokens(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """(B, S_x, D) -> (B, S_x, E + G) = [wk(x), weights_proj(x)]: per token, so it runs on sequence-parallel
        shards."""
        return self.wkw(x_BSD)

    def heads(self, q_lat, tok, cos, sin):
        """q_lat (B, S, Cq) normalized query latent, tok (B, S, E + G) -> q (B,S,G,E), k (B,S,E), w (B,S,G) fp32."""
        B, S, _ = tok.shape
        k, w = tok.split([self.head_dim, self.n_heads], dim=-1)
        k = self.run_region(apply_rope, self.k_norm(k).view(B, S, 1, self.head_dim), cos, sin)
        k = k.view(B, S, self.head_dim)
        return self.queries(q_lat, cos, sin), k, w.float() * self.n_heads ** -0.5

    def queries(self, q_lat, cos, sin):
        """q_lat (B, S, Cq) -> the indexer's roped queries (B, S, G, E)."""
        B, S, _ = q_lat.shape
        return self.run_region(apply_rope, self.wq(q_lat).view(B, S, self.n_heads, self.head_dim), cos, sin)


class LocalSparseCore(nn.Module):
    """Where DSA's ring passes run on one device: a ring of one rank, heads all here. Calling it is the
    sparse attention's kernel call (the `attn_core` train.offload takes, as MLA's `core`)."""

    ring, cp, tp = OneRank(), 1, 1

    def forward(self, q, kv, wkv, sel, scale: float, nope_dim: int):
        """Roped q (B, S, H, Dn + Dr), key rows kv (B, S, Ckv + Dr), wkv_b's weight, the selection -> (out
        (B, S, H, Dv), lse (B, H, S)): `SparseLatentAttention` over this core's ring."""
        return SparseLatentAttention.apply(q, kv, wkv, sel, scale, nope_dim, self.ring)

    def layout(self, seq_local: int, docs) -> RingLayout:
        return RingLayout.one_device(seq_local, docs)

    def reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        return t


class DSAttention(MLAttention):
    """x (B, S, D) -> (B, S, D): MLA with a lightning indexer (module docstring). Seams beyond MLA's:
    `sparse_core` (LocalSparseCore or the plan's ring core), `aux_loss_scale` (the micro-batch's share of
    the step, set by the layer plan) and `logit_guard` (QK-clip's forward guard on the sparse stage, or None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.indexer = LightningIndexer(cfg)
        self.stage = cfg.dsa.stage
        self.sparse_core = LocalSparseCore()
        self.aux_loss_scale = 1.0
        self.keep_latents = False  # selective "mla_up": keep only the latents; q and the key rows rebuilt
        self.logit_guard = None  # QK-clip's forward guard on the sparse stage (moe_lc/parallel/qk_guard.py)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs=None, stats=None) -> torch.Tensor:
        """stats: the step's ForwardStats (the indexer loss's sums are booked there in backward)."""
        q_src, c_kv, k_r, tok = self.dsa_latents(x_BSD)
        attend = self._warmup if self.stage == "warmup" else self._sparse
        return self.out_proj(self.wo, lambda: attend(q_src, c_kv, k_r, tok, cos, sin, docs, stats))

    def same_input_linears(self) -> list:
        """Linears that read one tensor in turn (the layer plan lets them share one FP8 copy of it)."""
        return [self.wa, self.indexer.wkw]

    def dsa_latents(self, x_BSD: torch.Tensor):
        """x -> (c_q (B, S, Cq), c_kv (B, S, Ckv), k_r (B, S, Dr) not yet roped, the indexer's per-token part
        (B, S, E + G)), all gathered together under sequence parallelism. The indexer reads x detached."""
        a = self.gather(torch.cat([self.wa(x_BSD), self.indexer.project_tokens(x_BSD.detach())], dim=-1))
        return a.split([self.q_lora_rank, self.kv_lora_rank, self.rope_dim, self.indexer.token_dim], dim=-1)

    def latents(self, x_BSD: torch.Tensor):
        """MLA's latents (its decode cache and seams read these)."""
        return self.dsa_latents(x_BSD)[:3]

    # -- pieces ----------------------------------------------------------------------------------------
    def absorbed_weights(self):
        """W_UK (H, Dn, Ckv), W_UV (H, Dv, Ckv): wkv_b's rows per (local) head."""
        return split_wkv(self.wkv_b.weight, self.n_heads, self.nope_dim)

    def latent_rows(self, c_kv, k_r, cos, sin):
        """The shared key rows [kv_norm(c_kv), rope(k_r)] (B, S, Ckv + Dr)."""
        B, S, _ = c_kv.shape
        k_r = self.run_region(apply_rope, k_r.view(B, S, 1, self.rope_dim), cos, sin).view(B, S, self.rope_dim)
        return torch.cat([self.kv_norm(c_kv), k_r], dim=-1)

    def _share(self, B: int, S: int) -> float:
        """This rank's share of the step's mean indexer loss for a micro-batch of B x S local rows."""
        core = self.sparse_core
        return self.aux_loss_scale / (B * S * core.cp * core.tp)

    def _sink(self, stats, B: int, S: int):
        if stats is None:
            return None
        tp = self.sparse_core.tp
        return lambda kl, mass: stats.add_dsa(kl / tp, mass / tp, B * S / tp)

    # -- the two stages --------------------------------------------------------------------------------
    def _sparse(self, q_src, c_kv, k_r, tok, cos, sin, docs, stats):
        core, B, S = self.sparse_core, c_kv.shape[0], c_kv.shape[1]
        train = self.training and torch.is_grad_enabled()
        with torch.no_grad():  # the indexer's input (detached: report section 2.1), so nothing kept for it
            q_lat = self.q_norm(q_src)
        q_idx, k_idx, w_idx = self.indexer.heads(q_lat, tok, cos, sin)
        sel, scores = select(core.ring, core.layout(S, docs), q_idx, w_idx, k_idx, self.indexer.scale,
                             self.indexer.topk)
        prepare = partial(self._queries_and_rows, cos=cos, sin=sin)
        if train:  # the indexer's target: the attention's probabilities, kept by its forward where it has them
            sel.probs = {}
        attend = partial(_sparse_attention, self, sel)
        guard = self.logit_guard if self.training else None
        if guard is not None:  # each call's lse noted inside, the first (what the weights give) among them
            attend = guard.sparse(attend, self)
        if train and self.keep_latents:  # the latents stay; q and the key rows are rebuilt for backward
            q, kv = checkpoint(prepare, q_src, c_kv, k_r, use_reentrant=False)
            out, lse = recompute_from((q_src, c_kv, k_r), (q, kv), prepare, lambda *qkv: self.replay(attend, *qkv))
        else:
            q, kv = prepare(q_src, c_kv, k_r)
            out, lse = self.replay(attend, q, kv)
        if guard is None:
            note_max_lse(self, lse)  # QK-clip: the logits the sparse attention saw
        else:  # the indexer's target: the distribution attention used
            q = guard.used(q)
        if train:
            p = selected_probs(core.ring, q.detach(), kv.detach(), self.wkv_b.weight.detach(), self.nope_dim, lse, sel,
                               self.softmax_scale, core.reduce_heads)
            # the loss keeps the query latent (MLA keeps it anyway), not the indexer's queries: rebuilt from it
            share, sink = self._share(B, S), self._sink(stats, B, S)
            loss = recompute_from(q_src.detach(), q_idx, self._indexer_queries_from_latent(cos, sin),
                                  lambda q: IndexerKLSparse.apply(q, w_idx, k_idx, sel, scores, p, self.indexer.scale,
                                                                  share, core.ring, sink))
            out = AttachLoss.apply(out, loss)
        return out

    def _indexer_queries_from_latent(self, cos, sin):
        """c_q -> the indexer's roped queries (B, S, G, E): q_norm, then the indexer's wq and RoPE."""
        return lambda q_src: self.indexer.queries(self.q_norm(q_src), cos, sin)

    def _queries_and_rows(self, q_src, c_kv, k_r, cos, sin):
        """(q (B, S, H, Dn + Dr) roped, the key rows (B, S, Ckv + Dr)) from the latents."""
        return self.rope_q(self.wq_b(self.q_norm(q_src)), cos, sin), self.latent_rows(c_kv, k_r, cos, sin)

    def _warmup(self, q_src, c_kv, k_r, tok, cos, sin, docs, stats):
        out = self.attend(self, q_src, c_kv, k_r, cos, sin, docs)
        if not (self.training and torch.is_grad_enabled()):
            return out
        core, B, S = self.sparse_core, c_kv.shape[0], c_kv.shape[1]
        layout = core.layout(S, docs)
        with torch.no_grad():
            q_lat = self.q_norm(q_src)
            q = self.rope_q(self.wq_b(q_lat), cos, sin)
            if self.logit_guard is not None:  # the distribution the core's call just now used
                q = self.logit_guard.used(q)
            kv = self.latent_rows(c_kv, k_r, cos, sin)
            w_uk, _ = self.absorbed_weights()
            lse = head_lse(core.ring, layout, q, kv, w_uk, self.softmax_scale)
        q_idx, k_idx, w_idx = self.indexer.heads(q_lat, tok, cos, sin)
        sel, _ = select(core.ring, layout, q_idx, w_idx, k_idx, self.indexer.scale, self.indexer.topk)
        loss, _ = IndexerKLDense.apply(q_idx, w_idx, k_idx, q, kv, w_uk, lse, layout, self.softmax_scale,
                                       self.indexer.scale, self._share(B, S), core.ring, core.reduce_heads,
                                       self.n_heads * core.tp, sel, self._sink(stats, B, S))
        return AttachLoss.apply(out, loss)


def _sparse_attention(attn: DSAttention, sel, q, kv):
    """Roped q (B, S, H, Dn + Dr), key rows kv (B, S, Ckv + Dr) -> (out (B, S, H, Dv), lse (B, H, S)) over the
    selection: the piece selective recomputation ("attention") replays, keeping q, kv and the selection."""
    return attn.sparse_core(q, kv, attn.wkv_b.weight, sel, attn.softmax_scale, attn.nope_dim)


# --------------------------------------------------------------------------- training (the kind's registry entry)


def dsa_lr_scale(m: ModelConfig, lr: float):
    """name -> the learning-rate scale of that parameter under [model.dsa] (None when DSA is off): in the
    warm-up stage everything but the indexers is frozen (0); the indexers train at model.dsa.indexer_lr
    (train.lr when 0) in both stages (the kind's `lr_scales`)."""
    if not m.dsa.enabled:
        return None
    indexer = m.dsa.indexer_lr / lr if m.dsa.indexer_lr and lr else 1.0
    rest = 0.0 if dsa_warmup(m) else 1.0
    return lambda name: indexer if ".indexer." in f".{name}" else rest


def dsa_warmup(m: ModelConfig) -> bool:
    """The warm-up stage, which trains the indexers only: the routers' biases stay too (`routers_frozen`)."""
    return m.dsa.enabled and m.dsa.stage == "warmup"


def dsa_fresh_params(m: ModelConfig) -> str | None:
    """What the warm-up adds to a dense MLA checkpoint (`fresh_params`): the indexers, which init_from lacks."""
    return ".indexer." if dsa_warmup(m) else None


# --------------------------------------------------------------------------- counts from the config alone


def dsa_params(m: ModelConfig) -> int:
    """One module: MLA's, plus the indexer's wq (Cq x G E), wk (D x E), k_norm (2 E), weights_proj (D x G)."""
    from moe_lc.model.mla import mla_params

    d = m.dsa
    G, E = d.index_n_heads, d.index_head_dim
    return mla_params(m) + m.mla.q_lora_rank * G * E + m.dim * E + 2 * E + m.dim * G


def dsa_vector_params(m: ModelConfig) -> int:
    """No matmul reads: MLA's latent norm weights and the indexer's LayerNorm weight and bias."""
    from moe_lc.model.mla import mla_vector_params

    return mla_vector_params(m) + 2 * m.dsa.index_head_dim


def dsa_core_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the attention core (model FLOPs, as the decompressed form counts them):
    the indexer scores every earlier key, 2 G (E + 1) per pair over S/2 pairs on average (its S^2 term); the
    main attention sees min(k, t + 1) keys at position t (the warm-up stage: all t + 1), 2 H (Dqk + Dv) each."""
    d, S = m.dsa, seq_len
    k = S / 2 if d.stage == "warmup" else (d.index_topk * (S - d.index_topk) + d.index_topk * (d.index_topk + 1) / 2) / S \
        if S > d.index_topk else (S + 1) / 2
    indexer = (S / 2) * 2 * d.index_n_heads * (d.index_head_dim + 1)
    return indexer + m.n_heads * k * 2 * (m.qk_head_dim + m.value_head_dim)


# --------------------------------------------------------------------------- decode cache


class DSADecode:
    """DSA's cache (moe_lc/model/decode.py): MLA's latent cache (`MLADecode`: c = kv_norm(c_kv), the roped
    shared key k_r) plus the indexer key of every token, k_idx (B, T, E): Ckv + Dr + E values per token. A
    step scores the cached indexer keys for its new tokens, keeps each one's top-k and attends those in the
    absorbed form (the warm-up stage decodes densely, as MLA)."""

    @staticmethod
    def shapes(attn: DSAttention) -> dict[str, tuple[int, ...]]:
        from moe_lc.model.mla import MLADecode

        return {**MLADecode.shapes(attn), "k_idx": (attn.indexer.head_dim,)}

    @staticmethod
    def prefill(attn: DSAttention, x_BSD, cos, sin):
        """The prompt through the module's forward (the rings under CP) -> (out, {"c", "k_r", "k_idx"})."""
        from moe_lc.model.mla import MLADecode

        q_src, c_kv, k_r, tok = attn.dsa_latents(x_BSD)
        c, k_r_roped = MLADecode.cached(attn, c_kv, k_r, cos, sin)
        _, k_idx, _ = attn.indexer.heads(attn.q_norm(q_src), tok, cos, sin)
        attend = attn._warmup if attn.stage == "warmup" else attn._sparse
        out = attn.out_proj(attn.wo, lambda: attend(q_src, c_kv, k_r, tok, cos, sin, None, None))
        return out, {"c": c, "k_r": k_r_roped, "k_idx": k_idx}

    @staticmethod
    def step(attn: DSAttention, x_BnD, cos, sin, cache, start: int) -> torch.Tensor:
        """n new tokens at positions start .. start+n-1 against the cache, which they are written into."""
        from moe_lc.model.mla import MLADecode, cached_mla_attention
        from moe_lc.ops.dsa_select import indexer_scores, key_positions, merge_topk, tile_topk, visible
        from moe_lc.ops.sparse_attention import latent_forward

        q_src, c_kv, k_r, tok = attn.dsa_latents(x_BnD)
        c, k_r_roped = MLADecode.cached(attn, c_kv, k_r, cos, sin)
        q_lat = attn.q_norm(q_src)
        q_idx, k_idx, w_idx = attn.indexer.heads(q_lat, tok, cos, sin)
        cache.write(start, c=c, k_r=k_r_roped, k_idx=k_idx)
        n, T = x_BnD.shape[1], start + x_BnD.shape[1]
        held = cache.read(T)
        q = attn.rope_q(attn.wq_b(q_lat), cos, sin)
        if attn.stage == "warmup":
            return attn.out_proj(attn.wo, lambda: cached_mla_attention(attn, q, held["c"], held["k_r"]))
        k_pos = torch.arange(T, device=x_BnD.device)
        seen = visible(torch.arange(start, T, device=x_BnD.device), k_pos)
        scores = indexer_scores(q_idx, w_idx, held["k_idx"], attn.indexer.scale)
        keys = merge_topk(None, tile_topk(scores, k_pos, seen, attn.indexer.topk), attn.indexer.topk)
        kv = torch.cat([held["c"], held["k_r"]], dim=-1)
        out, _ = latent_forward(q, kv, key_positions(keys), *attn.absorbed_weights(), attn.softmax_scale)
        return attn.out_proj(attn.wo, lambda: out.to(x_BnD.dtype))
