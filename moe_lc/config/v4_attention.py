"""[model.v4_attention]: DeepSeek-V4's attention (report arXiv 2606.19348, section 2.3; transformers
src/transformers/models/deepseek_v4/configuration_deepseek_v4.py), one frozen section for its three layer types.

Every layer is shared-KV multi-query attention (one head_dim-wide KV head is both key and value) with a
query latent, RMSNorm on q (per head, unweighted) and on the KV entry, RoPE on the last rope_head_dim dims
(pairs of adjacent channels) and at position -i on the output, a learned sink logit per head, a grouped
low-rank output projection, and a sliding window of `sliding_window` tokens. A layer's type adds:

    sliding_attention             the window only; RoPE base rope_theta, no scaling
    compressed_sparse_attention   CSA: one KV entry per csa_compress_rate tokens, pooled over overlapping windows
                                  of twice that by a learned softmax gate + position bias; a lightning indexer
                                  (index_n_heads x index_head_dim) keeps the top index_topk entries per query
    heavily_compressed_attention  HCA: one entry per hca_compress_rate tokens, no overlap, every entry attended

CSA and HCA layers rotate everything (queries, the window's keys, the entries, the indexer) with the
"compress" base compress_rope_theta and YaRN (yarn_factor > 1; transformers forces its cos/sin factor to 1).

Defaults are DeepSeek-V4-Flash's (transformers' DeepseekV4Config defaults; its YaRN, factor 16 over
max_position_embeddings 1,048,576, i.e. an original length of 65,536, is the value the transformers
configuration file names for the compress layers). `layer_types` empty means the V4 pattern for
model.n_layers: two window-only layers, then CSA and HCA alternating (`layer_types_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from moe_lc.config.fields import f, positive

V4LayerType = Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
V4_LAYER_TYPES: tuple[str, ...] = get_args(V4LayerType)
V4CoreKind = Literal["tiled", "reference"]  # a Literal: config/rules.py checks the value
COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")


@dataclass(frozen=True)
class V4AttentionConfig:
    """[model.v4_attention]: DeepSeek-V4's sliding / compressed sparse / heavily compressed attention."""

    head_dim: int = f(512, "width of every query head and of the one shared key = value head")
    q_lora_rank: int = f(1024, "query latent rank: x -> q_a (this wide) -> RMSNorm -> heads")
    rope_head_dim: int = f(64, "RoPE on the last this-many dims of each head (adjacent-channel pairs)")
    o_groups: int = f(8, "grouped output projection: heads in this many groups, each projected on its own")
    o_lora_rank: int = f(1024, "grouped output projection: each group's intermediate width")
    sliding_window: int = f(128, "tokens a query sees in its window branch, itself included")
    csa_compress_rate: int = f(4, "CSA: tokens pooled into one KV entry (windows of twice this overlap)")
    hca_compress_rate: int = f(128, "HCA: tokens pooled into one KV entry (no overlap)")
    index_n_heads: int = f(64, "CSA lightning indexer: query heads")
    index_head_dim: int = f(128, "CSA lightning indexer: head width (RoPE on its last rope_head_dim dims)")
    index_topk: int = f(512, "CSA: compressed entries each query keeps (all it sees when fewer)")
    rope_theta: float = f(10000.0, "RoPE base of window-only layers (the 'main' rope, never scaled)")
    compress_rope_theta: float = f(160000.0, "RoPE base of CSA / HCA layers (the 'compress' rope)")
    yarn_factor: float = f(16.0, "YaRN factor of the compress rope (1 = no scaling)")
    yarn_original_seq_len: int = f(65536, "YaRN: the compress rope's original context length")
    yarn_beta_fast: float = f(32.0, "YaRN: dims with more than this many rotations keep their frequency")
    yarn_beta_slow: float = f(1.0, "YaRN: dims with fewer than this many rotations are interpolated")
    index_loss_weight: float = f(1.0, "CSA: weight of the indexer's KL loss to the attention over the entries it "
                                      "picked (V3.2's sparse stage; its input detached, so it trains the indexer only; "
                                      "0: the indexer does not train)")
    attn_sink: bool = f(True, "a learned sink logit per head in every softmax (false: an ablation)")
    eps: float = f(1e-6, "RMSNorm epsilon of q, the KV entry and the compressors")
    core: V4CoreKind = f("tiled", "'tiled': the core in query tiles saving O(S H) (moe_lc/ops/v4_sparse_core.py; "
                                  "Triton on CUDA) and the indexer's top-k over entry tiles, no (B, S, n) tensor; "
                                  "'reference': the torch reference (moe_lc/model/v4_core.py), (B, S, n) masks and "
                                  "the full scores")
    layer_types: list[V4LayerType] = f([], "attention type per layer; empty = 2 window-only layers, then CSA / "
                                           "HCA alternating")
    mtp_layer_type: V4LayerType = f("sliding_attention", "attention type of the MTP modules' blocks (model.mtp.depth; "
                                                         "DeepSeek's config: compress_ratios[n_layers], 0 = window "
                                                         "only in V4-Flash's)")

    def compress_rate(self, layer_type: str) -> int:
        """Tokens per compressed entry of a layer type (0: window only)."""
        return {"compressed_sparse_attention": self.csa_compress_rate,
                "heavily_compressed_attention": self.hca_compress_rate}.get(layer_type, 0)

    def layer_types_for(self, n_layers: int) -> list[str]:
        """The type of each of n_layers layers: `layer_types` when given, else V4's default pattern."""
        if self.layer_types:
            return list(self.layer_types)
        rest = [COMPRESSED[i % 2] for i in range(max(n_layers - 2, 0))]
        return (["sliding_attention"] * min(n_layers, 2) + rest)[:n_layers]

    def errors(self, n_heads: int, n_layers: int) -> list[str]:
        """Every rule broken, one line each; n_heads, n_layers: model.n_heads, model.n_layers."""
        e, p = [], "model.v4_attention"
        for name in ("head_dim", "q_lora_rank", "rope_head_dim", "o_groups", "o_lora_rank", "sliding_window",
                     "csa_compress_rate", "hca_compress_rate", "index_n_heads", "index_head_dim", "index_topk",
                     "rope_theta", "compress_rope_theta", "yarn_original_seq_len", "eps"):
            positive(e, f"{p}.{name}", getattr(self, name))
        if self.index_loss_weight < 0:
            e.append(f"{p}.index_loss_weight={self.index_loss_weight} must be >= 0")
        if e:
            return e
        if self.rope_head_dim % 2:
            e.append(f"{p}.rope_head_dim={self.rope_head_dim} must be even (RoPE rotates pairs)")
        for name in ("head_dim", "index_head_dim"):
            if self.rope_head_dim > getattr(self, name):
                e.append(f"{p}.rope_head_dim={self.rope_head_dim} must be <= {p}.{name}={getattr(self, name)}")
        if n_heads % self.o_groups:
            e.append(f"{p}.o_groups={self.o_groups} must divide model.n_heads={n_heads} (whole heads per group)")
        if self.yarn_factor < 1:
            e.append(f"{p}.yarn_factor={self.yarn_factor} must be >= 1 (1 = no scaling)")
        elif self.yarn_factor > 1 and not self.yarn_beta_fast > self.yarn_beta_slow:
            e.append(f"{p}.yarn_beta_fast={self.yarn_beta_fast} must exceed yarn_beta_slow={self.yarn_beta_slow}")
        bad = [t for t in self.layer_types if t not in V4_LAYER_TYPES]
        if bad:
            e.append(f"{p}.layer_types has {bad}: each must be one of {', '.join(map(repr, V4_LAYER_TYPES))}")
        if self.mtp_layer_type not in V4_LAYER_TYPES:
            e.append(f"{p}.mtp_layer_type={self.mtp_layer_type!r} must be one of "
                     f"{', '.join(map(repr, V4_LAYER_TYPES))}")
        if self.layer_types and len(self.layer_types) != n_layers:
            e.append(f"{p}.layer_types has {len(self.layer_types)} entries: must be model.n_layers={n_layers} "
                     "(or empty for the default pattern)")
        return e
