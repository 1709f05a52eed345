"""Parameter and FLOP counts from the config alone (no model is built; the 671B shape is free).

Tests check these against a model built on the meta device, so they cannot drift from the code.
"""

from __future__ import annotations

from moe_lc.config import ModelConfig


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, plus `total` and `activated` (routed experts counted K/E; everything
    else, embedding included, counted fully as DeepSeek's "activated" figure does)."""
    D, Dh, L = cfg.dim, cfg.head_size, cfg.n_layers
    attn = D * (cfg.n_heads + 2 * cfg.n_kv_heads) * Dh + cfg.n_heads * Dh * D
    n_moe = cfg.n_moe_layers
    n_dense = L - n_moe
    counts = {
        "embedding": cfg.vocab_size * D,
        "attention": L * attn,
        "norms": L * 2 * D + D,
        "dense_ffn": n_dense * 3 * D * cfg.ffn_dim,
        "router": n_moe * cfg.n_routed_experts * D,
        "shared_experts": n_moe * 3 * D * cfg.moe_ffn_dim * cfg.n_shared_experts,
        "routed_experts": n_moe * 3 * D * cfg.moe_ffn_dim * cfg.n_routed_experts,
        "head": cfg.vocab_size * D,
    }
    counts["total"] = sum(counts.values())
    routed_active = n_moe * 3 * D * cfg.moe_ffn_dim * cfg.topk
    counts["activated"] = counts["total"] - counts["routed_experts"] + routed_active
    return counts


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward = 3x forward), the numerator of MFU.

    Matmuls: 2 FLOPs per activated weight per token forward (the embedding is a lookup, not a
    matmul). Causal attention core: a query at position i sees i+1 keys, S/2 on average:
    QK^T costs 2*(S/2)*Dh and PV 2*(S/2)*Dh per head per token.
    """
    c = param_counts(cfg)
    matmul_params = c["activated"] - c["embedding"] - c["norms"]
    attn_core = cfg.n_layers * cfg.n_heads * (seq_len / 2) * 2 * (2 * cfg.head_size)
    return 3 * (2 * matmul_params + attn_core)
