"""Counts of DeepSeek-V4's attention from the config alone (moe_lc/model/counting.py's conventions): parameters,
forward FLOPs per token, and the bytes its core keeps for backward.

Legend: D model dim, H heads, d head dim, Cq query latent rank, G / R output groups / rank, W window, m tokens
per entry (c = 2 series with CSA's overlap, else 1), n = S // m entries, G_I / E indexer heads / head dim,
k = index_topk. FLOPs: 2 per weight per token for a matmul (the compressor and indexer projections run on
every token); the core 4 d per head per key a query reads (q . k and p v, key = value), over the keys a
query really reads, averaged over the S positions (causal: position t sees min(W, t + 1) window keys,
(t + 1) // m entries, CSA min(k, those)); the indexer scores every entry a query sees, 2 E + 2 per head
and entry. Norms, RoPE, the gated pooling and the softmax are not counted (as counting.py).

What backward keeps (`reference_core_saved_bytes`, the torch reference core of v4_core.py, per batch row):
its fp32 probabilities S H (2W + n + 1), fp32 copies of the window's queries and keys (padded to whole
windows, the keys twice: once per einsum), the window mask, and with entries the fp32 queries, entries
and the readable mask. The rest of the module keeps what its Linears and norms keep (x once for wa, the
compressor and the indexer's weights_proj; wq_b's, wo_a's (a group-major copy) and wo's inputs; the norms'
fp32 inputs). The tiled core (model.v4_attention.core = "tiled", the default) keeps q, kv, its output, an fp32 LSE
per head, the entries and which of them each query reads (`tiled_core_saved_bytes`); the indexer keeps its picks
(shared with the core) and, training, its loss's (B, S, k) log-softmax. The "v4" attention kind's
counts per block (`v4_params`, ...) read these with the block's layer type.
"""

from __future__ import annotations

from moe_lc.config.v4_attention import V4AttentionConfig


def v4_attention_params(cfg: V4AttentionConfig, dim: int, n_heads: int, layer_type: str) -> dict[str, int]:
    """Parameters of one module by part: `matmul` (read by a GEMM per token), `vector` (norm weights, sinks,
    position biases), `total`."""
    d, H = cfg.head_dim, n_heads
    matmul = dim * (cfg.q_lora_rank + d) + cfg.q_lora_rank * H * d + H * d * cfg.o_lora_rank \
        + cfg.o_groups * cfg.o_lora_rank * dim
    vector = cfg.q_lora_rank + d + (H if cfg.attn_sink else 0)
    m = cfg.compress_rate(layer_type)
    if m:
        c = 2 if layer_type == "compressed_sparse_attention" else 1
        matmul += dim * 2 * c * d
        vector += m * c * d + d
    if layer_type == "compressed_sparse_attention":
        E, G = cfg.index_head_dim, cfg.index_n_heads
        matmul += dim * 4 * E + cfg.q_lora_rank * G * E + dim * G
        vector += m * 2 * E + E
    return {"matmul": matmul, "vector": vector, "total": matmul + vector}


def mean_window_keys(window: int, seq_len: int) -> float:
    """Window keys per query, averaged over positions 0 .. S-1: sum of min(W, t + 1) / S."""
    full = max(seq_len - window, 0)
    ramp = min(window, seq_len)
    return (ramp * (ramp + 1) / 2 + full * window) / seq_len


def mean_entries(rate: int, seq_len: int, cap: int | None = None) -> float:
    """Entries a query reads, averaged over positions: sum of min(cap, (t + 1) // m) / S (cap None: no cap)."""
    total = 0
    for e in range(1, seq_len // rate + 1):  # positions t with (t + 1) // m == e: t + 1 in [e m, (e + 1) m)
        count = min((e + 1) * rate - 1, seq_len) - e * rate + 1
        total += (e if cap is None else min(cap, e)) * count
    return total / seq_len


def v4_attention_flops(cfg: V4AttentionConfig, dim: int, n_heads: int, layer_type: str, seq_len: int) -> dict:
    """Forward FLOPs per token of one module, by part: `matmul`, `core` (window + entries), `indexer` (its
    scores), `total`. Training is 3x (the indexer's scores run once: they take no gradient)."""
    H, d, m = n_heads, cfg.head_dim, cfg.compress_rate(layer_type)
    keys = mean_window_keys(cfg.sliding_window, seq_len)
    indexer = 0.0
    if layer_type == "heavily_compressed_attention":
        keys += mean_entries(m, seq_len)
    elif layer_type == "compressed_sparse_attention":
        keys += mean_entries(m, seq_len, cfg.index_topk)
        indexer = mean_entries(m, seq_len) * cfg.index_n_heads * (2 * cfg.index_head_dim + 2)
    matmul = 2 * v4_attention_params(cfg, dim, n_heads, layer_type)["matmul"]
    core = 4 * d * H * keys
    return {"matmul": matmul, "core": core, "indexer": indexer, "total": matmul + core + indexer}


def reference_core_saved_bytes(cfg: V4AttentionConfig, n_heads: int, layer_type: str, seq_len: int) -> float:
    """Bytes per token v4_core.sink_attention keeps for backward, one batch row (module docstring)."""
    H, d, W, S = n_heads, cfg.head_dim, cfg.sliding_window, seq_len
    m = cfg.compress_rate(layer_type)
    n = S // m if m else 0
    padded = -(-S // W) * W
    total = 4 * padded * H * d + 2 * 4 * 2 * padded * d + 2 * W * padded  # window q, keys (x2), mask
    total += 4 * S * H * (2 * W + n + (1 if cfg.attn_sink else 0))  # the probabilities
    if m:
        total += 4 * S * H * d + 4 * n * d + S * n  # queries, entries, readable mask
    return total / S


def tiled_core_saved_bytes(cfg: V4AttentionConfig, n_heads: int, layer_type: str, seq_len: int, c: int,
                           segments: bool = False) -> float:
    """Bytes per token, one batch row, the tiled core keeps for backward (model.v4_attention.core = "tiled":
    moe_lc/ops/v4_sparse_core.py `saved_bytes`, less the sinks, a parameter): q and its output (H d each) and the
    token's kv (d) in the compute dtype (c bytes), an fp32 lse per head, the entries' share (n d c / S), and which
    entries a query reads: CSA's picks (8 min(k, n) bytes, int64; the indexer loss keeps the same tensor), HCA's
    visible count (8; with segments a [first, stop) range, 16); segments (packed documents, context parallelism): an
    int64 document id per row (8)."""
    H, d, S = n_heads, cfg.head_dim, seq_len
    m = cfg.compress_rate(layer_type)
    n = S // m if m else 0
    total = c * (2 * H * d + d) + 4 * H + (8 if segments else 0)
    if layer_type == "compressed_sparse_attention":
        total += c * n * d / S + 8 * min(cfg.index_topk, n)
    elif m:
        total += c * n * d / S + (16 if segments else 8)
    return total


# ------------------------------------------------------------------- the "v4" kind's counts (attention_kinds.py)
# m: the [model] section (ModelConfig); layer_id: the block, whose type is model.v4_attention.layer_types_for's.


def _layer_type(m, layer_id: int) -> str:
    return m.v4_attention.layer_types_for(m.n_layers)[layer_id]


def v4_params(m, layer_id: int) -> int:
    """Parameters of block `layer_id`'s module."""
    return v4_attention_params(m.v4_attention, m.dim, m.n_heads, _layer_type(m, layer_id))["total"]


def v4_vector_params(m, layer_id: int) -> int:
    """Those no matmul reads (norm weights, sinks, position biases)."""
    return v4_attention_params(m.v4_attention, m.dim, m.n_heads, _layer_type(m, layer_id))["vector"]


def v4_core_flops(m, seq_len: int, layer_id: int) -> float:
    """Forward FLOPs per token of block `layer_id`'s core and indexer scores (the counting convention's "core":
    everything but the projections, which the parameter counts cover)."""
    f = v4_attention_flops(m.v4_attention, m.dim, m.n_heads, _layer_type(m, layer_id), seq_len)
    return f["core"] + f["indexer"]


def v4_saved_bytes(m, c: int, cp: int, layer_id: int) -> float:
    """Bytes per token block `layer_id`'s module surely keeps besides what memory_floor.block_floor counts for
    every kind (wa's input, and n_heads * head_dim: here the core's output, wo_a's input): what the tiled core keeps
    beyond its output (`tiled_core_saved_bytes` without segments, at a length whose entries a CSA query's top-k
    fills: S >= index_topk m; HCA's visible counts left out, one row of them may serve the whole batch), the query
    latent (wq_b's input, Cq) and wo's input (G R), in the compute dtype (c bytes). A lower bound: the torch
    reference core keeps far more (`reference_core_saved_bytes`)."""
    a = m.v4_attention
    layer_type = _layer_type(m, layer_id)
    rate = a.compress_rate(layer_type)
    full = (a.index_topk + 1) * rate if layer_type == "compressed_sparse_attention" else max(rate, 1)
    core = tiled_core_saved_bytes(a, m.n_heads, layer_type, full, c) - c * m.n_heads * a.head_dim
    if layer_type == "heavily_compressed_attention":
        core -= 8
    return core + c * (a.q_lora_rank + a.o_groups * a.o_lora_rank)
