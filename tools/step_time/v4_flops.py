"""DeepSeek-V4's forward FLOPs per token, one block, by layer type and part: what the step-time model prices and
what a hand count checks (tests/test_v4_plan_1m.py).

Legend: S sequence, D model dim, H query heads, d head dim (the one shared KV head is key and value), W window,
m tokens per compressed entry (CSA 4, HCA 128), n = S // m entries, k index_topk, G / E indexer heads / head dim,
Cq query latent rank, N hc_mult (mHC's streams). 2 FLOPs per multiply-add.

    window      the sliding-window branch, every layer type: QK^T and PV over the window keys, 4 d H per key
                (2 d H each), S x W x H x d x 2 x 2 over the sequence when every query sees W keys
    sparse      CSA: the same over the k entries the indexer picked (S x k x H x d x 4)
    dense       HCA: the same over every visible entry (S/128 of them at the end of the sequence)
    indexer     CSA's lightning indexer scoring every visible entry: G heads x (2 E for q . k, 2 for the ReLU'd
                score times its head weight), S x n x G x E x 2 over the sequence in full
    projections q (D -> Cq -> H d), the shared kv (D -> d), the grouped output (H d -> G_o R -> D)
    compressor  the entries' kv and gate projections, D -> 2 c d (c = 2 series under CSA's overlapping windows)
    indexer_proj  CSA: its own compressor (D -> 4 E), its queries (Cq -> G E) and head weights (D -> G)
    mhc         two sublayers (attention, FFN) each: the map projection N D -> N (N + 2), the read-out
                sum_n pre_n h_n (2 N D) and the mix comb^T h (2 N^2 D)

Convention (tools/step_time/flop_conventions.py for the other kinds): "causal" (what MFU counts here) averages
over the S positions what a query really reads, position t seeing min(W, t + 1) window keys and (t + 1) // m
entries (CSA: min(k, that)), so the indexer scores n / 2 entries a query on average; "full" counts every query
against W keys and all n entries (CSA: min(k, n) attended, n scored). The attention parts are the ones
moe_lc/model/v4_counting.py counts (its `v4_attention_flops`: equal, part for part, tests hold them); the mHC
maps are counted by moe_lc/model/counting.py as matmul parameters only (2 N (N + 2) N D a sublayer): the
read-out and mix are listed here, not in MFU.
"""

from __future__ import annotations

from moe_lc.config import ModelConfig
from moe_lc.model.v4_counting import mean_entries, mean_window_keys, v4_attention_params

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
CONVENTIONS = ("causal", "full")
CORE_PARTS = ("window", "sparse", "dense", "indexer")  # priced as attention kernels (the rest are GEMMs)


def v4_layer_flops(m: ModelConfig, layer_type: str, seq_len: int, convention: str = "causal") -> dict[str, float]:
    """Forward FLOPs per token of one V4 block's attention and residual stream, by part (module docstring), plus
    "total". The MoE FFN is not here (moe_lc/model/counting.py's expert terms)."""
    if layer_type not in LAYER_TYPES or convention not in CONVENTIONS:
        raise ValueError(f"layer_type {layer_type!r} / convention {convention!r}: one of {LAYER_TYPES} / "
                         f"{CONVENTIONS}")
    a, H, D, S = m.v4_attention, m.n_heads, m.dim, seq_len
    rate = a.compress_rate(layer_type)
    csa = layer_type == "compressed_sparse_attention"
    causal = convention == "causal"
    per_key = 4 * a.head_dim * H
    window = mean_window_keys(a.sliding_window, S) if causal else min(a.sliding_window, S)
    seen = (mean_entries(rate, S) if causal else S // rate) if rate else 0.0  # entries a query can read
    picked = (mean_entries(rate, S, a.index_topk) if causal else min(a.index_topk, S // rate)) if csa else 0.0
    out = {"window": per_key * window, "sparse": per_key * picked,
           "dense": per_key * seen if layer_type == "heavily_compressed_attention" else 0.0,
           "indexer": seen * a.index_n_heads * (2 * a.index_head_dim + 2) if csa else 0.0}
    matmul = 2 * v4_attention_params(a, D, H, layer_type)["matmul"]
    compressor = 2 * D * 2 * (2 if csa else 1) * a.head_dim if rate else 0
    indexer_proj = 2 * (D * 4 * a.index_head_dim + a.q_lora_rank * a.index_n_heads * a.index_head_dim
                        + D * a.index_n_heads) if csa else 0
    out.update(projections=matmul - compressor - indexer_proj, compressor=compressor, indexer_proj=indexer_proj,
               mhc=mhc_flops(m))
    out["total"] = sum(out.values())
    return out


def mhc_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of a block's two mHC sublayers (0 without model.residual = "mhc")."""
    if m.residual != "mhc":
        return 0.0
    n, D = m.mhc.hc_mult, m.dim
    return 2 * (2 * n * (n + 2) * n * D + 2 * n * D + 2 * n * n * D)


def mhc_memory_bytes(m: ModelConfig, c: int) -> float:
    """Bytes per token a fused mHC moves in one block's forward (two sublayers): read the stream (c N D) for the
    fp32 norm and projection and again for the read-out, read it and write the new one at the merge (2 c N D);
    the maps themselves are N (N + 2) values. 0 without mHC. (The plain stream's residual adds are work.py's.)"""
    if m.residual != "mhc":
        return 0.0
    return 2 * 4 * c * m.mhc.hc_mult * m.dim


def v4_block_core_flops(m: ModelConfig, layer_type: str, seq_len: int, convention: str = "causal") -> float:
    """The parts priced as attention kernels (`CORE_PARTS`): window, sparse, dense and indexer."""
    f = v4_layer_flops(m, layer_type, seq_len, convention)
    return sum(f[p] for p in CORE_PARTS)


def v4_indexer_flops(m: ModelConfig, seq_len: int, layer_id: int) -> float:
    """Causal forward FLOPs per token of block `layer_id`'s indexer scores (0 for another kind or layer type): in
    moe_lc/model/counting.py's attention core, but with no backward (the step-time Work's `scores`)."""
    from moe_lc.config.attention_kinds import attention_kind

    if not attention_kind(m).per_layer or layer_id >= m.n_layers:
        return 0.0
    return v4_layer_flops(m, m.v4_attention.layer_types_for(m.n_layers)[layer_id], seq_len)["indexer"]


def model_table(m: ModelConfig, seq_len: int) -> list[dict]:
    """One row per layer type the model has: its count and its parts under both conventions (the docs' table)."""
    types = m.v4_attention.layer_types_for(m.n_layers)
    rows = []
    for t in LAYER_TYPES:
        if t in types:
            rows.append({"layer_type": t, "layers": types.count(t),
                         **{c: v4_layer_flops(m, t, seq_len, c) for c in CONVENTIONS}})
    return rows
