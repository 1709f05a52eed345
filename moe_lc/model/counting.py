"""Parameter and FLOP counts from the config alone (no model is built; the 671B shape is free).

Tests check these against a model built on the meta device, so they cannot drift from the code.
"""

from __future__ import annotations

from dataclasses import replace

from moe_lc.config import ModelConfig
from moe_lc.config.attention_kinds import attention_kind, load


def kind_count(cfg: ModelConfig, ref: str, *args, layer_id: int | None = None):
    """The attention kind's count `ref` ("module:name") of block `layer_id`'s module. A kind whose layers differ
    (`per_layer`: DeepSeek-V4's types) counts each block; None then means the mean over the model's blocks (a
    float: n_layers times it is the model's sum). Every other kind's modules are alike: layer_id is not read."""
    fn = load(ref)
    if not attention_kind(cfg).per_layer:
        return fn(cfg, *args)
    if layer_id is not None:
        return fn(cfg, *args, layer_id)
    return sum(fn(cfg, *args, i) for i in range(cfg.n_layers)) / cfg.n_layers


def attention_vector_params(cfg: ModelConfig, layer_id: int | None = None) -> int:
    """Parameters of one attention module that no matmul reads (GQA's q/k norm weights and biases, MLA's
    latent norm weights): the attention kind's count (moe_lc/config/attention_kinds.py; `kind_count`)."""
    return kind_count(cfg, attention_kind(cfg).vector_params, layer_id=layer_id)


def attention_params(cfg: ModelConfig, layer_id: int | None = None) -> int:
    """Parameters of one attention module, `attention_vector_params` included: the attention kind's count."""
    return kind_count(cfg, attention_kind(cfg).params, layer_id=layer_id)


def model_attention_params(cfg: ModelConfig, vector: bool = False) -> int:
    """All n_layers attention modules' parameters (only those no matmul reads, with `vector`), summed exactly."""
    count = attention_vector_params if vector else attention_params
    return sum(count(cfg, i) for i in range(cfg.n_layers)) if attention_kind(cfg).per_layer \
        else cfg.n_layers * count(cfg)


def attention_core_flops(cfg: ModelConfig, seq_len: int, layer_id: int | None = None) -> float:
    """Forward FLOPs per token of one causal attention core: a query sees S/2 keys on average,
    QK^T costs 2 * (S/2) * Dqk and PV 2 * (S/2) * Dv per head; a kind with its own count (DSA's top-k
    attention and indexer, V4's window and entries per layer type) gives it (moe_lc/config/attention_kinds.py)."""
    own = attention_kind(cfg).core_flops
    if own is not None:
        return kind_count(cfg, own, seq_len, layer_id=layer_id)
    return dense_core_flops(cfg, seq_len)


def dense_core_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Causal dense attention's forward FLOPs per token (`attention_core_flops`' default)."""
    return cfg.n_heads * (seq_len / 2) * 2 * (cfg.qk_head_dim + cfg.value_head_dim)


def attention_score_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per attention score element (one query x one key, all heads): QK^T and PV."""
    return cfg.n_heads * 2 * (cfg.qk_head_dim + cfg.value_head_dim)


def train_flops_with_documents(cfg: ModelConfig, seq_len: int, tokens: float, score_elements: float) -> float:
    """Model FLOPs of a step whose attention stays inside packed documents: `train_flops_per_token`'s
    causal attention term replaced by the score elements the step really computed per layer (summed over
    every rank; `Documents.call_work`)."""
    causal = tokens * attention_core_flops(cfg, seq_len)
    return train_flops_per_token(cfg, seq_len) * tokens + 3 * cfg.n_layers * (
        attention_score_flops(cfg) * score_elements - causal)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, plus `total` and `activated`: per token, routed experts count K/E of
    theirs and the embedding table nothing (a lookup reads one row); this is DeepSeek's convention,
    which reproduces their published pairs: V2 236B / 21B, V2-Lite 15.7B / 2.4B, V3 671B / 37B
    (tests/test_model.py). The MTP modules (`mtp`) are counted apart, as DeepSeek reports 671B + MTP. A tied
    embedding (model.tie_embeddings) is one table: `head` counts 0 and `activated` counts the table once,
    as the head's matmul."""
    D, L = cfg.dim, cfg.n_layers
    n_moe = cfg.n_moe_layers
    n_dense = L - n_moe
    counts = {
        "embedding": cfg.vocab_size * D,
        "attention": model_attention_params(cfg),
        "norms": L * 2 * D + D,
        "dense_ffn": n_dense * 3 * D * cfg.ffn_dim,
        "router": n_moe * cfg.moe.n_routed_experts * D,
        "shared_experts": n_moe * shared_expert_params(cfg),
        "routed_experts": n_moe * 3 * D * cfg.moe.ffn_dim * cfg.moe.n_routed_experts,
        "head": 0 if cfg.tie_embeddings else cfg.vocab_size * D,  # tied: the embedding's table, counted once
        "residual_stream": sum(residual_stream_params(cfg)),
    }
    counts["total"] = sum(counts.values())
    routed_active = n_moe * 3 * D * cfg.moe.ffn_dim * cfg.moe.topk
    lookup = 0 if cfg.tie_embeddings else counts["embedding"]  # a tied table is also the head's matmul
    counts["activated"] = counts["total"] - lookup - counts["routed_experts"] + routed_active
    counts["mtp"] = cfg.mtp.depth * mtp_module_params(cfg)
    return counts


def residual_stream_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul, vector) parameters of mHC's maps (model.residual = "mhc", model/residual_stream.py): per sublayer
    fn (N(N+2), N D), bias (N(N+2),), scale (3,), two a block; the head's fn (N, N D), bias (N,), scale (1,).
    (0, 0) for the plain stream."""
    if cfg.residual != "mhc":
        return 0, 0
    n, D, L = cfg.mhc.hc_mult, cfg.dim, cfg.n_layers
    rows = n * (n + 2)
    return 2 * L * rows * n * D + n * n * D, 2 * L * (rows + 3) + n + 1


def shared_expert_params(cfg: ModelConfig) -> int:
    """One MoE layer's shared SwiGLU (moe.shared_hidden wide) and its gate (moe.shared_expert_gate)."""
    return 3 * cfg.dim * cfg.moe.shared_hidden + cfg.dim * cfg.moe.shared_expert_gate


def mtp_module_params(cfg: ModelConfig) -> int:
    """One MTP module (model/mtp.py): two input norms, the input projection (V3's 2D -> D eh_proj, or with mHC
    e_proj and h_proj, the same 2 D^2), one block (MoE when the model has experts; a per-layer attention kind counts
    block id n_layers, V4's of type v4_attention.mtp_layer_type), its output norm and, with mHC, the block's two
    sublayer maps and its own HyperHead; the embedding and output head are shared with the main model."""
    from moe_lc.model.mtp import block_config  # (model/mtp.py imports the model's modules)

    D = cfg.dim
    if cfg.moe.n_routed_experts and cfg.moe.n_dense_layers < cfg.n_layers:
        ffn = 3 * D * cfg.moe.ffn_dim * cfg.moe.n_routed_experts + shared_expert_params(cfg) + cfg.moe.n_routed_experts * D
    else:
        ffn = 3 * D * cfg.ffn_dim
    per_layer = attention_kind(cfg).per_layer
    attn = attention_params(block_config(cfg, depth=1), cfg.n_layers) if per_layer else attention_params(cfg)
    one_layer = replace(cfg, n_layers=1)  # residual_stream_params: two sublayers' maps and a head's
    return 2 * D + 2 * D * D + attn + 2 * D + ffn + D + sum(residual_stream_params(one_layer))


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward = 3x forward), the numerator of MFU.

    Matmuls: 2 FLOPs per activated weight per token forward (the embedding is a lookup, not a
    matmul). Causal attention core: a query at position i sees i+1 keys, S/2 on average:
    QK^T costs 2*(S/2)*Dh and PV 2*(S/2)*Dh per head per token.
    """
    c = param_counts(cfg)
    matmul_params = c["activated"] - c["norms"] - model_attention_params(cfg, vector=True) \
        - residual_stream_params(cfg)[1]
    return 3 * (2 * matmul_params + cfg.n_layers * attention_core_flops(cfg, seq_len))


def block_train_flops_per_token(cfg: ModelConfig, layer_id: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token of block `layer_id` (3x forward): its activated matmul
    weights (attention projections; dense SwiGLU, or router + shared + top-k routed experts) and its
    causal attention core. What pipeline stages are balanced by."""
    D = cfg.dim
    attn = attention_params(cfg, layer_id) - attention_vector_params(cfg, layer_id)  # norms, biases: no matmul
    if cfg.is_moe_layer(layer_id):
        m = cfg.moe
        ffn = 3 * D * m.ffn_dim * m.topk + shared_expert_params(cfg) + m.n_routed_experts * D
    else:
        ffn = 3 * D * cfg.ffn_dim
    return 3 * (2 * (attn + ffn) + attention_core_flops(cfg, seq_len, layer_id))
