"""Hash routing (Roller et al. 2021, "Hash Layers For Large Sparse Models"), as DeepSeek-V4 uses it for its first
MoE layers (arXiv 2606.19348 section 2.1; transformers' DeepseekV4HashRouter in
src/transformers/models/deepseek_v4/modeling_deepseek_v4.py): the experts a token goes to are a fixed function
of its token id, row tid2eid[token id] of a (V, K) table, not of its hidden state. The gate still scores every
expert, and the chosen experts' scores, normalized and scaled as a learned router's, weigh their outputs, so
the gate trains; the selection has nothing to balance (no bias update), and its loads are booked as any layer's.

The table. DeepSeek ships the tables in its checkpoints and has not said how it built them. Training from
scratch, each hash layer here draws its own: every token id gets K distinct experts uniformly at random
(seeded by model.moe.hash_seed and the layer, so every rank and every run of a recipe builds the same one),
frozen (a persistent buffer: checkpointed, never trained). Uniform over token ids is not uniform over tokens:
expert loads follow the corpus's token frequencies, which a frequency-aware table would even out (Su's
speculation, kexue.fm post 11750); a checkpoint's (or a converted V4's) tables replace the drawn ones.

Legend: T tokens (B*S flattened), E routed experts, K experts per token, V vocabulary.
"""

from __future__ import annotations

import zlib

import torch

from moe_lc.config import ModelConfig
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.moe import Router, score_and_route

TABLE_ROWS = 8192  # vocabulary rows drawn at once: an (8192, E) fp32 draw, not (V, E)


def hash_table(vocab_size: int, n_experts: int, topk: int, seed: int, layer_id: int) -> torch.Tensor:
    """(V, K) int64: each token id's K distinct experts, the top-K of a seeded uniform draw over the E experts
    (a uniformly random K-subset, in random order). The same on every device and rank: drawn on the CPU."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:tid2eid:{layer_id}".encode()))
    rows = [torch.rand(min(TABLE_ROWS, vocab_size - lo), n_experts, generator=g).topk(topk, dim=-1).indices
            for lo in range(0, vocab_size, TABLE_ROWS)]
    return torch.cat(rows)


def one_token_shard(tokens_BS: torch.Tensor) -> torch.Tensor:
    """The hash router's default `token_shard` seam: the MoE layer sees every token of the micro-batch."""
    return tokens_BS


class HashRouter(Router):
    """A Router whose selection is tid2eid[token id] (module docstring). Buffer `tid2eid` (V, K) int64,
    persistent; `expert_bias` stays zero (bias_update_speed 0). Seam `token_shard`: (B, S) token ids -> the
    ids of the tokens this layer's hidden states hold, in their order (`one_token_shard` by default; a
    sequence-parallel layout swaps in its shard)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg)
        self.bias_update_speed = 0.0  # the table chooses: nothing for the bias to steer
        self.vocab_size, self.seed, self.layer_id = cfg.vocab_size, cfg.moe.hash_seed, layer_id
        device = torch.get_default_device()
        table = torch.empty(cfg.vocab_size, self.topk, dtype=torch.int64, device=device) \
            if device.type == "meta" else self._draw()
        self.register_buffer("tid2eid", table)
        self.token_shard = one_token_shard

    def _draw(self) -> torch.Tensor:
        return hash_table(self.vocab_size, self.n_experts, self.topk, self.seed, self.layer_id)

    def init_buffers(self) -> None:
        """The balancing bias zeroed and the table drawn (after the model was built on the meta device)."""
        super().init_buffers()
        self.tid2eid.copy_(self._draw())

    def route_and_score(self, x_TD: torch.Tensor, stats: ForwardStats | None = None, tokens=None):
        """As Router's, the experts read from the table. tokens: (B, S) int64 ids of the micro-batch (the MoE
        layer's input tokens, before `token_shard`)."""
        if tokens is None:
            raise ValueError(f"layer {self.layer_id} routes by token id (model.moe.hash_layers) but was given no "
                             "token ids: pass tokens to the model's phases")
        idx_TK = self.tid2eid[self.token_shard(tokens).reshape(-1)]
        assert idx_TK.shape[0] == x_TD.shape[0], f"{idx_TK.shape[0]} token ids for {x_TD.shape[0]} hidden rows"
        logits_TE = self.logits(self.gate, x_TD)
        idx_TK, weights_TK, scores_TE, counts_E = self.run_region(
            score_and_route, logits_TE, self.expert_bias, lambda *_: idx_TK, self.score_func, 1, 1, self.topk,
            self.group_score, self.norm_topk_prob, self.scaling)
        if stats is not None:
            stats.add_routing(self, loads=counts_E.float())
        return idx_TK, weights_TK, scores_TE, logits_TE


def router_for(cfg: ModelConfig, layer_id: int) -> Router:
    """The router kind of block `layer_id`'s MoE layer: a hash router for the first model.moe.hash_layers MoE
    layers, else the learned one."""
    return HashRouter(cfg, layer_id) if cfg.is_hash_layer(layer_id) else Router(cfg)
