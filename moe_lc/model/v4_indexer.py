"""DeepSeek-V4's lightning indexer: which compressed entries each query of a CSA layer reads (report arXiv
2606.19348, section 2.3.1, eqs. 13-17; transformers src/transformers/models/deepseek_v4/modeling_deepseek_v4.py,
DeepseekV4Indexer and DeepseekV4IndexerScorer).

Legend: B batch, S sequence, D model dim, Cq query latent rank, G indexer heads, E indexer head dim,
n compressed entries (S // m), k = index_topk.

    K_I   = its own overlapping compressor at width E over the same windows       (B, n, E)  (v4_compressor.py)
    q_I   = RoPE_tail(wq_b(c_q))                  (B, S, G, E)  c_q the attention's normalized query latent
    w     = weights_proj(x) * G^-0.5              (B, S, G)
    I(t, s) = sum_g w(t, g) * relu(E^-0.5 q_I(t, g) . K_I(s))                   (B, S, n), fp32
    selected(t) = the k visible entries (s < (t + 1) // m) of highest I, ties to the earlier entry

With model.v4_attention.core = "tiled" (`tiled`) the top-k runs over tiles of entries (moe_lc/ops/v4_index_topk.py
`tiled_index_topk`: no (B, S, n) scores) and the indexer loss reads I at the picked entries only (`picked_scores`:
q_I, w and the keys recomputed, the scores at the picks differentiable); "reference" scores every entry (`scores`).
The top-k order is moe_lc/ops/dsa_select.py's (score, then earlier position), so a tie never depends on
the kernel (torch.topk returns tied entries in no fixed order). Queries that see fewer than k entries keep
all they see. Selection is an integer choice: no gradient reaches the indexer through the attention (as in
transformers); it trains on its own KL loss to the attention (moe_lc/model/v4_index_loss.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.model.seams import run_now
from moe_lc.model.v4_compressor import Compressor, visible_entries
from moe_lc.model.v4_rope import apply_tail_rope
from moe_lc.ops.dsa_select import indexer_scores, key_positions, order_keys
from moe_lc.ops.linear import Linear
from moe_lc.ops.v4_index_topk import picked_index_scores, tiled_index_topk


class V4Indexer(nn.Module):
    """Parameters (transformers' names under `compressor.indexer.` in brackets): compressor [kv_proj; gate_proj,
    position_bias, kv_norm], wq_b (G E, Cq) [q_b_proj], weights_proj (G, D) [scorer.weights_proj]."""

    def __init__(self, dim: int, cfg: V4AttentionConfig, tiled: bool = False):
        super().__init__()
        self.tiled = tiled  # V4Attention's reading of model.v4_attention.core
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rate = cfg.csa_compress_rate
        self.compressor = Compressor(dim, self.head_dim, self.rate, overlap=True, eps=cfg.eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(dim, self.n_heads)
        self.scale = self.head_dim ** -0.5
        self.run_region = run_now

    def scores(self, x_BSD, c_q, positions, rope) -> torch.Tensor:
        """I (B, S, n) fp32, -inf where the entry is not visible yet."""
        keys = self.compressor(x_BSD, rope)  # (B, n, E)
        return self.scores_over(keys, x_BSD, c_q, positions, rope, self.seen(positions, keys.shape[1], x_BSD.shape[0]))

    def scores_over(self, keys_BnE, x_BSD, c_q, positions, rope, seen_BSn) -> torch.Tensor:
        """I (B, S, n) fp32 of the queries of rows x, c_q at `positions` over given keys (B, n, E), -inf where
        `seen` is False (packed documents and context parallelism: the keys gathered in global order)."""
        q, w = self.query(x_BSD, c_q, positions, rope)
        return indexer_scores(q, w, keys_BnE, self.scale).masked_fill(~seen_BSn, float("-inf"))

    def query(self, x_BSD, c_q, positions, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q_I (B, S, G, E) roped, w (B, S, G) fp32 with G^-0.5 folded in (the module docstring's)."""
        B, S, _ = x_BSD.shape
        q = self.wq_b(c_q).view(B, S, self.n_heads, self.head_dim)
        q = self.run_region(apply_tail_rope, q, *rope(positions))
        return q, self.weights_proj(x_BSD).float() * self.n_heads ** -0.5

    @torch.no_grad()
    def top_entries(self, keys_BnE, x_BSD, c_q, positions, rope, visible) -> torch.Tensor:
        """The tiled top-k: visible (B, S) counts (entries s < visible(t)) or (B, S, 2) [first, stop) ranges of the
        global entry order -> picked (B, S, min(k, n)) int64, -1 past what a query sees (as `pick_seen`)."""
        q, w = self.query(x_BSD, c_q, positions, rope)
        return tiled_index_topk(q, w, keys_BnE, self.scale, visible, self.topk)[0]

    def picked_scores(self, x_BSD, c_q, positions, rope, picked_BSk, keys_BnE=None) -> torch.Tensor:
        """I at the picked entries (B, S, k) fp32, -inf at -1 slots, differentiable in the indexer's parameters (what
        the indexer loss trains through, moe_lc/model/v4_index_loss.py); keys None: this indexer's compressor over x
        (the whole sequence from position 0), else the keys gathered in global order."""
        keys = self.compressor(x_BSD, rope) if keys_BnE is None else keys_BnE
        q, w = self.query(x_BSD, c_q, positions, rope)
        return picked_index_scores(q, w, keys, picked_BSk, self.scale)

    def visible(self, positions, n: int, B: int) -> torch.Tensor:
        """(B, S) int64: the entries s < visible(t) the query at positions[t] sees (at most n)."""
        ready = visible_entries(positions, self.rate).clamp_max(n)
        return ready.expand(B, -1) if ready.dim() == 1 else ready

    def seen(self, positions, n: int, B: int) -> torch.Tensor:
        """(B, S, n) bool: entry s is visible to the query at positions[t]."""
        ready = visible_entries(positions, self.rate)
        ready = ready.expand(B, -1) if ready.dim() == 1 else ready
        return torch.arange(n, device=ready.device) < ready[..., None]

    @torch.no_grad()
    def forward(self, x_BSD, c_q, positions, rope) -> torch.Tensor:
        """-> selected entries (B, S, min(k, n)) int64, in top-k order, -1 in slots beyond what a query sees."""
        if self.tiled:
            keys = self.compressor(x_BSD, rope)
            visible = self.visible(positions, keys.shape[1], x_BSD.shape[0])
            return self.top_entries(keys, x_BSD, c_q, positions, rope, visible)
        return self.pick(self.scores(x_BSD, c_q, positions, rope), positions)

    @torch.no_grad()
    def pick(self, scores, positions) -> torch.Tensor:
        """Scores I (B, S, n) -> the selected entries (B, S, min(k, n)), as `forward` (training keeps the scores:
        the indexer loss reads them, moe_lc/model/v4_index_loss.py)."""
        return self.pick_seen(scores, self.seen(positions, scores.shape[-1], scores.shape[0]))

    @torch.no_grad()
    def pick_seen(self, scores, seen_BSn) -> torch.Tensor:
        """`pick` given which entries each query sees (B, S, n) bool: ties to the earlier entry (global order)."""
        n = scores.shape[-1]
        k = min(self.topk, n)
        if k == 0:
            return scores.new_zeros(*scores.shape[:2], 0, dtype=torch.int64)
        keys = order_keys(scores, torch.arange(n, device=scores.device), seen_BSn)
        return key_positions(keys.topk(k, dim=-1, sorted=True).values)
