"""Block kinds: what the planner traces one block of (tools/planner/block_trace.py) and every per-layer figure
is keyed by (a block's saved bytes, what it sends, its working sets and aten ops).

A block's kind is "dense" or "moe" (the model's own rule, `ModelConfig.is_moe_layer`) where nothing else differs
between blocks. DeepSeek-V4's blocks differ more (report arXiv 2606.19348): each layer has its own attention type
(model.v4_attention.layer_types_for: a window only, CSA with its compressor and lightning indexer, or HCA) and its
first model.moe.hash_layers MoE layers route by token id (moe_lc/model/hash_router.py); a kind then names both,
e.g. "csa moe", "sliding moe hash". V4-Flash's 43 blocks are 4 kinds: 4 traced blocks.
"""

from __future__ import annotations

from dataclasses import replace

from moe_lc.config import ModelConfig
from moe_lc.config.attention_kinds import attention_kind


def block_kind(m: ModelConfig, layer_id: int) -> str:
    """The kind of block `layer_id`: "moe" or "dense" (the model's own rule, `is_moe_layer`); where blocks differ
    beyond that, also the attention module's layer type (DeepSeek-V4: `V4_KINDS`' short names, from
    model.v4_attention.layer_types_for) and " hash" for a hash-routed MoE layer (`is_hash_layer`): e.g.
    "csa moe", "sliding moe hash"."""
    ffn = "moe" if m.is_moe_layer(layer_id) else "dense"
    layer_type = _layer_type(m, layer_id)
    return (f"{V4_KINDS[layer_type]} " if layer_type else "") + ffn + (" hash" if m.is_hash_layer(layer_id) else "")


V4_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
            "heavily_compressed_attention": "hca"}  # DeepSeek-V4's layer types, as block kinds name them


def _layer_type(m: ModelConfig, layer_id: int) -> str | None:
    """Block `layer_id`'s attention layer type where the kind's modules differ per layer (`per_layer`), else None
    (an MTP module's block, id >= n_layers, too: V4 builds none)."""
    if not attention_kind(m).per_layer or layer_id >= m.n_layers:
        return None
    return m.v4_attention.layer_types_for(m.n_layers)[layer_id]


def one_block_of_each_kind(m: ModelConfig) -> ModelConfig:
    """m with one block of each of its kinds (`block_kind`) in its main stack: one dense block (where m has any)
    and one MoE block (where m has any); its MTP modules (layer ids n_layers + d) keep the kind they have in m.
    Where blocks differ beyond dense / MoE (`_kinds_by_layer`), the first block of each kind, in m's order."""
    if _kinds_by_layer(m):
        return _first_of_each_kind(m)
    if not m.moe.n_routed_experts:
        return replace(m, n_layers=1)
    if not m.n_moe_layers:  # every main block dense: shift the first MoE id by as much as n_layers shrinks
        return replace(m, n_layers=1, moe=replace(m.moe, n_dense_layers=m.moe.n_dense_layers - m.n_layers + 1))
    dense = min(m.moe.n_dense_layers, 1)
    return replace(m, n_layers=dense + 1, moe=replace(m.moe, n_dense_layers=dense))


def _kinds_by_layer(m: ModelConfig) -> bool:
    """Whether m's blocks differ beyond dense / MoE: per-layer attention types or hash-routed MoE layers."""
    return attention_kind(m).per_layer or (m.has_moe and m.moe.hash_layers > 0)


def _first_of_each_kind(m: ModelConfig) -> ModelConfig:
    """m cut to the first block of each kind, in m's order: dense blocks come first, then the hash-routed MoE
    layers, then the learned ones (`is_moe_layer`, `is_hash_layer`), so counting each group among the kept blocks
    keeps every block's kind; per-layer attention types are listed for the kept blocks."""
    first: dict[str, int] = {}
    for i in range(m.n_layers):
        first.setdefault(block_kind(m, i), i)
    kept = sorted(first.values())
    moe = replace(m.moe, n_dense_layers=sum(not m.is_moe_layer(i) for i in kept),
                  hash_layers=sum(m.is_hash_layer(i) for i in kept))
    small = replace(m, n_layers=len(kept), moe=moe)
    if attention_kind(m).per_layer:
        types = m.v4_attention.layer_types_for(m.n_layers)
        small = replace(small, v4_attention=replace(m.v4_attention, layer_types=[types[i] for i in kept]))
    assert [block_kind(small, j) for j in range(len(kept))] == [block_kind(m, i) for i in kept]
    return small
