"""DeepSeek-V4's attention, one module for its three layer types (report arXiv 2606.19348, section 2.3;
transformers src/transformers/models/deepseek_v4/modeling_deepseek_v4.py, DeepseekV4Attention).

Legend: B batch, S sequence, D model dim, H heads, d head dim (V4-Flash: 512), Cq query latent rank, r RoPE
dims (the last r of a head), G output groups, R their rank (o_lora_rank), W window, m tokens per entry.

    [c_q | kv] = x @ wa^T                           (B, S, Cq + d)   one Linear for q_a_proj and kv_proj
    c_q        = q_norm(c_q)                        RMSNorm (weighted)
    q          = RoPE_tail(rms(wq_b(c_q) per head)) (B, S, H, d)     rms: RMSNorm without a weight
    kv         = RoPE_tail(kv_norm(kv))             (B, S, d)        one head, both key and value
    entries    = compressor(x)                      (B, S // m, d)   CSA / HCA only (v4_compressor.py)
    reads      = HCA: every causal entry; CSA: the indexer's top-k of them (v4_indexer.py)
    o          = core(q, kv, entries, reads)        (B, S, H, d)     window + entries + sink (v4_core.py)
    o          = RoPE_tail at -position (o)         the value's rotation undone: relative positions only
    y          = wo(wo_a(o grouped by G))           (B, S, G R) -> (B, S, D)

Window-only layers rotate with the "main" rope, CSA / HCA layers with the "compress" rope (v4_rope.py).
The softmax scale is d^-0.5. Positions are explicit (positions (S,) or (B, S), the sequence starting at 0:
the window, the entries' windows and their positions w m all count from the first row). Packed documents
(positions restarting in each) and context parallelism go through `attend_rows` (moe_lc/model/v4_layout.py): no
window or entry crosses a document, each document compressed on its own grid, a rank's spans read the rows before
them and every rank's entries through the `context` seam (moe_lc/parallel/cp/v4_context.py under cp).

The core (model.v4_attention.core, read in __init__ alone): "tiled" (the default), moe_lc/ops/v4_sparse_core.py's
query tiles (Triton on CUDA), which entries a query reads named without a (B, S, n) tensor (HCA: visible counts, or
[first, stop) ranges of the global entry order with packed documents / cp, `entry_ranges`; CSA: the indexer's picks
from its top-k over entry tiles), the indexer loss from I at the picks and the core's lse (no (B, S, n) tensor at
all); "reference", v4_core.sink_attention with (B, S, n) masks and the indexer's full scores.

Seams (moe_lc/model/seams.py): `core` (TiledV4Core or V4Core), `replay` around RoPE and the core, `run_region` around
RoPE, `context` (v4_layout.LocalRows; the context-parallel exchanges under cp), `out_proj` (wo, attend):
attend() returns wo_a's output (B, S, G, R), so wo is the one Linear that mixes the groups to D and
`project_now` applies unchanged. Under TP + SP (moe_lc/parallel/v4_plan.py): `gather`
(x's sequence shards gathered, identity on one device), `n_heads` and `o_groups` (this rank's), `head_sum` (the
indexer loss's target summed over the tp ranks' heads). `aux_loss_scale`: this micro-batch's share of the step.

Training, a CSA layer's indexer learns from its own KL loss to the attention over the entries it picked
(moe_lc/model/v4_index_loss.py, weight model.v4_attention.index_loss_weight; 0: the indexer is not trained).

Parameter names (ours <- transformers' `self_attn.` names): wa <- cat(q_a_proj, kv_proj) rows; q_norm <-
q_a_norm; wq_b <- q_b_proj; kv_norm <- kv_norm; wo_a (G, R, H d / G) <- o_a_proj viewed (G, R, -1); wo <-
o_b_proj; sinks <- sinks; compressor.{wkv_gate <- cat(kv_proj, gate_proj), position_bias, kv_norm} <-
compressor.*; indexer.compressor.* <- compressor.indexer.{kv_proj; gate_proj, position_bias, kv_norm};
indexer.wq_b <- compressor.indexer.q_b_proj; indexer.weights_proj <- compressor.indexer.scorer.weights_proj.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_lc.config.v4_attention import V4_LAYER_TYPES, V4AttentionConfig
from moe_lc.model.dsa import AttachLoss
from moe_lc.model.norm import RMSNorm
from moe_lc.model.seams import project_now, run_now
from moe_lc.model.v4_compressor import Compressor, visible_entries
from moe_lc.model.v4_core import TiledV4Core, V4Core
from moe_lc.model.v4_index_loss import OneRankHeadSum, index_loss, picked_mass, scores_at
from moe_lc.model.v4_indexer import V4Indexer
from moe_lc.model.v4_layout import NEVER, EntryGrid, LocalRows, halo_rows
from moe_lc.model.v4_rope import V4Rope, apply_tail_rope
from moe_lc.ops.linear import GroupedLinear, Linear
from moe_lc.ops.v4_sparse_core import picked_mass as tiled_mass


def read_mask(picked_BSk: torch.Tensor, n: int) -> torch.Tensor:
    """The reference core's reads of a CSA layer: picks (B, S, k), -1 empty -> (B, S, n) bool."""
    readable = torch.zeros(*picked_BSk.shape[:2], n + 1, dtype=torch.bool, device=picked_BSk.device)
    return readable.scatter_(-1, torch.where(picked_BSk >= 0, picked_BSk, n), True)[..., :n]


def entry_ranges(grid: EntryGrid, doc_q: torch.Tensor, pos_q: torch.Tensor) -> torch.Tensor:
    """The tiled core's reads over packed documents: doc_q, pos_q (B, s) of some query rows -> (B, s, 2) int64 [first,
    stop) of the global entry order, what EntryGrid.visible marks without its (B, s, n) mask: a document's entries are
    one run of that order (v4_layout._entry_grid appends each document's in turn, padding last), the query reads the
    run's first (p + 1) // m. A row before the sequence (document -1) reads none."""
    order = torch.where(grid.doc < 0, NEVER, grid.doc).contiguous()  # padding (-2) sorted last
    doc_q = doc_q.contiguous()
    first = torch.searchsorted(order, doc_q)
    end = torch.searchsorted(order, doc_q, right=True)
    ready = torch.div(pos_q + 1, grid.m, rounding_mode="floor")
    return torch.stack([first, torch.minimum(first + ready, end)], dim=-1)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim in fp32 (transformers' DeepseekV4UnweightedRMSNorm on q's heads)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class V4Attention(nn.Module):
    """x (B, S, D), positions (S,) or (B, S) -> (B, S, D): one V4 layer of type `layer_type`."""

    def __init__(self, dim: int, n_heads: int, cfg: V4AttentionConfig, layer_type: str):
        super().__init__()
        if layer_type not in V4_LAYER_TYPES:
            raise ValueError(f"layer_type={layer_type!r} must be one of {', '.join(map(repr, V4_LAYER_TYPES))}")
        if n_heads % cfg.o_groups:
            raise ValueError(f"model.v4_attention.o_groups={cfg.o_groups} must divide model.n_heads={n_heads}")
        self.layer_type, self.n_heads, self.head_dim = layer_type, n_heads, cfg.head_dim
        self.q_lora_rank, self.window, self.eps = cfg.q_lora_rank, cfg.sliding_window, cfg.eps
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        d = cfg.head_dim
        self.wa = Linear(dim, cfg.q_lora_rank + d)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.eps)
        self.wq_b = Linear(cfg.q_lora_rank, n_heads * d)
        self.kv_norm = RMSNorm(d, cfg.eps)
        self.wo_a = GroupedLinear(cfg.o_groups, n_heads * d // cfg.o_groups, cfg.o_lora_rank)
        self.wo = Linear(cfg.o_groups * cfg.o_lora_rank, dim)
        self.sinks = nn.Parameter(torch.zeros(n_heads, dtype=torch.float32)) if cfg.attn_sink else None
        self.init_zeros = ("sinks",)  # (init.py) a fresh sink starts at 0, as transformers' _init_weights
        rate = cfg.compress_rate(layer_type)
        self.compress_rate, self.overlap = rate, layer_type == "compressed_sparse_attention"
        self.halo = halo_rows(cfg.sliding_window, rate, self.overlap)  # earlier rows a context-parallel span reads
        self.compressor = Compressor(dim, d, rate, self.overlap, cfg.eps) if rate else None
        self.indexer = V4Indexer(dim, cfg, tiled=cfg.core == "tiled") if layer_type == "compressed_sparse_attention" \
            else None
        self.rope = V4Rope(cfg, layer_type)
        self.softmax_scale = d ** -0.5
        self.tiled = cfg.core == "tiled"  # model.v4_attention.core, read here only: the core and the selection
        self.core = TiledV4Core(picks=self.indexer is not None) if self.tiled else V4Core()
        self.gather = nn.Identity()  # the sequence all-gather of x under TP + SP
        self.context = LocalRows()  # rows and entries beyond the plain sequence: packed documents, cp (v4_layout.py)
        self.head_sum = OneRankHeadSum()
        self.aux_loss_scale = 1.0
        self.index_loss_weight = cfg.index_loss_weight
        self.replay = run_now
        self.run_region = run_now
        self.out_proj = project_now

    def forward(self, x_BSD: torch.Tensor, positions: torch.Tensor, _rope_pair_rest=None, docs=None,
                stats=None) -> torch.Tensor:
        """A block calls every kind's module as (x, cos, sin, docs, stats); this kind's model `rope` is
        v4_rope.PositionsOnly, so `positions` arrives in cos's place (and again in sin's, unread). docs: the
        micro-batch's packed documents (moe_lc/ops/documents.py, positions restarting in each) or None; stats: the
        step's ForwardStats, where a CSA layer books its indexer loss (in backward)."""
        return self.out_proj(self.wo, lambda: self.attend(x_BSD, positions, stats, docs))

    def attend(self, x_BSD: torch.Tensor, positions: torch.Tensor, stats=None, docs=None) -> torch.Tensor:
        """x (B, S, D) (its sequence shard under SP) -> wo_a's output (B, S, G, R): everything before wo."""
        x_BSD = self.gather(x_BSD)
        rows = self.context.layout(self, x_BSD, positions, docs)
        if rows is not None:
            return self.attend_rows(x_BSD, rows, stats)
        B, S, _ = x_BSD.shape
        c_q, kv = self.wa(x_BSD).split([self.q_lora_rank, self.head_dim], dim=-1)
        c_q = self.q_norm(c_q)
        q = self.wq_b(c_q).view(B, S, self.n_heads, self.head_dim)
        kv = self.kv_norm(kv)
        learn = self.learns()
        if self.tiled:
            entries, reads, picked = self.compressed_tiled(x_BSD, c_q, positions)
            # I at the picks, checkpointed: the loss keeps x and c_q (kept by wa and wq_b anyway) and the picks
            scores = checkpoint(self.indexer.picked_scores, x_BSD.detach(), c_q.detach(), positions, self.rope, picked,
                                use_reentrant=False) if learn else None
        else:  # recomputed in backward: the loss keeps x and c_q, not the indexer's (B, S, G, n) per-head scores
            scores = checkpoint(self.indexer.scores, x_BSD.detach(), c_q.detach(), positions, self.rope,
                                use_reentrant=False) if learn else None
            entries, reads, picked = self.compressed(x_BSD, c_q, positions, scores)
            scores = None if scores is None else scores_at(scores, picked)
        o, lse = self.replay(self._rope_and_core, q, kv, positions, entries, reads)
        if learn:
            o = self.with_index_loss(o, q, positions, entries, lse, picked, scores, B * S, stats)
        return self.grouped_out(o)

    def attend_rows(self, x_BSD: torch.Tensor, rows, stats=None) -> torch.Tensor:
        """`attend` over a RowLayout (moe_lc/model/v4_layout.py: packed documents, or a context-parallel rank's
        spans): every per-row step on the extended rows (each span's halo included), the entries pooled where
        their last row is and gathered in global order by the `context` seam, the core over the extended rows
        with each window inside its document, then this rank's own rows kept -> (B, S, G, R)."""
        x = self.context.extend(x_BSD, rows)  # (B, S_ext, D)
        B, S_ext, _ = x.shape
        c_q, kv = self.wa(x).split([self.q_lora_rank, self.head_dim], dim=-1)
        c_q = self.q_norm(c_q)
        own, S = rows.query, rows.query.numel()
        doc_q, pos_q = rows.doc[:, own], rows.pos[:, own]
        learn = self.learns()
        entries = reads = picked = scores = keys = None
        if self.compressor is not None:  # the gathers fly while the queries are projected
            grid = rows.grid
            entries = self.context.gather_later(self.compressor.pooled(x, self.rope, grid), grid)
            if self.indexer is not None:
                with torch.set_grad_enabled(learn):  # the indexer's inputs detached: it trains on its loss only
                    keys = self.context.gather_later(self.indexer.compressor.pooled(x.detach(), self.rope, grid), grid)
        q = self.wq_b(c_q).view(B, S_ext, self.n_heads, self.head_dim)
        kv = self.kv_norm(kv)
        if self.compressor is not None:
            entries = entries()  # (B, n, d)
            args = (x[:, own].detach(), c_q[:, own].detach(), pos_q, self.rope)
            if self.tiled:  # HCA: its document's run of entries; CSA: the top-k of that run
                seen = entry_ranges(grid, doc_q, pos_q)  # (B, S, 2)
            else:
                seen = grid.visible(doc_q, pos_q)  # (B, S, n)
            if self.indexer is None:
                mine = seen
            else:
                with torch.set_grad_enabled(learn):
                    keys = keys()
                if self.tiled:
                    picked = self.indexer.top_entries(keys.detach(), *args, seen)
                    scores = checkpoint(self.indexer.picked_scores, *args, picked, keys, use_reentrant=False) \
                        if learn else None
                else:
                    with torch.set_grad_enabled(learn):
                        scores = checkpoint(self.indexer.scores_over, keys, *args, seen, use_reentrant=False) \
                            if learn else self.indexer.scores_over(keys, *args, seen)
                    picked = self.indexer.pick_seen(scores, seen)
                    scores = scores_at(scores, picked) if learn else None
                mine = picked if self.tiled else read_mask(picked, seen.shape[-1])
            reads = mine.new_full((B, S_ext, *mine.shape[2:]), -1 if self.indexer is not None and self.tiled else 0)
            reads[:, own] = mine  # the halo rows read no entry (their outputs are dropped)
        o, lse = self.replay(self._rope_and_core, q, kv, rows.pos, entries, reads, rows.doc)
        o, lse = o[:, own], lse[:, own]
        if learn:
            o = self.with_index_loss(o, q[:, own], pos_q, entries, lse, picked, scores, B * S * self.context.ranks,
                                     stats)
        return self.grouped_out(o)

    def learns(self) -> bool:
        """Whether this call trains the CSA indexer on its loss (a CSA layer, a weight, training, with grad)."""
        return self.indexer is not None and self.index_loss_weight > 0 and self.training and torch.is_grad_enabled()

    def with_index_loss(self, o, q, positions, entries, lse, picked, picked_scores, queries: int, stats):
        """o (B, S, H, d) with the indexer loss attached (dsa.AttachLoss): the target is the attention's head-summed
        probability of each picked entry, from the core's lse; q: wq_b's heads (B, S, H, d), before their norm and RoPE;
        queries: the micro-batch's (every cp rank's)."""
        with torch.no_grad():
            q_roped = apply_tail_rope(unweighted_rms_norm(q, self.eps), *self.rope(positions))
            mass = (tiled_mass if self.tiled else picked_mass)(q_roped, entries, lse, picked, self.softmax_scale)
            mass = self.head_sum(mass)
        share = self.index_loss_weight * self.aux_loss_scale / (queries * self.head_sum.ranks)
        return AttachLoss.apply(o, index_loss(picked_scores, picked, mass, share, self.head_sum.ranks, stats))

    def compressed(self, x_BSD, c_q, positions, scores=None):
        """The reference core's reads: (entries (B, n, d), readable (B, S, n) bool, the indexer's picks (B, S, k) or
        None), or (None, None, None) for a window-only layer. scores: the indexer's I (B, S, n) when training computed
        them already."""
        if self.compressor is None:
            return None, None, None
        B = x_BSD.shape[0]
        entries = self.compressor(x_BSD, self.rope)
        n = entries.shape[1]
        if self.indexer is None:  # HCA: every entry whose tokens are all in the past
            ready = visible_entries(positions, self.compressor.rate)
            ready = ready.expand(B, -1) if ready.dim() == 1 else ready
            return entries, torch.arange(n, device=x_BSD.device) < ready[..., None], None
        picked = self.indexer(x_BSD, c_q, positions, self.rope) if scores is None else \
            self.indexer.pick(scores, positions)  # (B, S, k), -1: an empty slot
        return entries, read_mask(picked, n), picked

    def compressed_tiled(self, x_BSD, c_q, positions):
        """The tiled core's reads, no (B, S, n) tensor: (entries (B, n, d), HCA's visible counts (B, S) int64 or CSA's
        picks (B, S, k) int64, the picks or None), or (None, None, None) for a window-only layer."""
        if self.compressor is None:
            return None, None, None
        entries = self.compressor(x_BSD, self.rope)
        if self.indexer is None:  # HCA: every entry whose tokens are all in the past
            ready = visible_entries(positions, self.compressor.rate).clamp_max(entries.shape[1])
            return entries, ready.expand(x_BSD.shape[0], -1) if ready.dim() == 1 else ready, None
        picked = self.indexer(x_BSD, c_q, positions, self.rope)  # (B, S, k), -1: an empty slot
        return entries, picked, picked

    def _rope_and_core(self, q, kv, positions, entries, reads, segments=None) -> torch.Tensor:
        """Normalized q (B, S, H, d) before RoPE, kv (B, S, d) normalized -> (core output (B, S, H, d), its
        value rotation undone (RoPE at -position); the core's lse (B, S, H) fp32, detached). reads: which entries a
        query reads, in the core's form (V4Core: a (B, S, n) mask; TiledV4Core: picks, counts or ranges); segments
        (B, S): the window's documents, or None."""
        B, S = kv.shape[:2]
        cos, sin = self.rope(positions)
        q = self.run_region(apply_tail_rope, unweighted_rms_norm(q, self.eps), cos, sin)
        kv = self.run_region(apply_tail_rope, kv.view(B, S, 1, self.head_dim), cos, sin).view(B, S, self.head_dim)
        o, lse = self.core(q, kv, self.window, self.softmax_scale, self.sinks, entries, reads, segments)
        return self.run_region(apply_tail_rope, o, cos, -sin), lse

    def grouped_out(self, o_BSHd: torch.Tensor) -> torch.Tensor:
        """(B, S, H, d) -> (B, S, G, R): group g's H d / G channels through its own (R, H d / G) block."""
        B, S = o_BSHd.shape[:2]
        G = self.o_groups
        rows = o_BSHd.reshape(B * S, G, -1).transpose(0, 1).reshape(G * B * S, -1)  # group-major rows
        counts = torch.full((G,), B * S, dtype=torch.int64, device=o_BSHd.device)
        return self.wo_a(rows, counts).view(G, B, S, self.o_lora_rank).permute(1, 2, 0, 3)


def v4_attention_for(m, layer_id: int) -> V4Attention:
    """Block `layer_id`'s module (the "v4" kind's `build`): its type from model.v4_attention.layer_types."""
    return V4Attention(m.dim, m.n_heads, m.v4_attention, m.v4_attention.layer_types_for(m.n_layers)[layer_id])


