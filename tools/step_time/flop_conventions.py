"""Model FLOPs counted two ways: the attention core causal (what MFU uses here) and in full (no mask).

Causal (moe_lc/model/counting.py `train_flops_per_token`, the numerator of every MFU this tool prints): a
query at position t sees t + 1 keys, S/2 on average, so one head's QK^T and PV cost 2 (S/2) (Dqk + Dv) per
token forward. Full: every query against all S keys, twice the dense core. Published TFLOP/s use either, and
at 128K the core is most of the model's FLOPs, so the convention moves a comparison by tens of percent:
  - Megatron-LM, megatron/training/training.py `num_floating_point_operations`: in full until 2025-03-06
    (the attention term (1 + g/n + S/h) x (n d / h) of arXiv 2104.04473's appendix), causal since commit
    8873b55 ("Fixes in number of floating-point operation estimates", its `/ 2  # causal mask`).
  - Meta's Llama 3 report: in full, as issue #65 reads its TFLOP/s.
DSA (model.dsa, sparse stage): the sparse core attends index_topk = k keys per query either way; causally the
first k positions see only t + 1 (moe_lc/model/dsa.py `dsa_core_flops`), in full every query sees min(k, S).
Its lightning indexer scores every earlier key causally (S/2 on average) and all S keys in full. The warm-up
stage attends densely: its core as dense attention, its indexer as in the sparse stage.
DeepSeek-V4 (per layer type: the window, CSA's picked entries and its indexer, HCA's dense entries, and the
projections, compressors and mHC beside them): tools/step_time/v4_flops.py, under the same two conventions.
"""

from __future__ import annotations

from moe_lc.config import ModelConfig
from moe_lc.config.attention_kinds import attention_kind
from moe_lc.model.counting import attention_core_flops, attention_score_flops, train_flops_per_token

MFU_CONVENTION = ("MFU counts attention causally (a query sees S/2 keys, as Megatron-LM's training.py since "
                  "2025-03); Megatron-LM before it and Meta's Llama 3 report count it in full (S keys)")


def full_attention_core_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one attention core with no causal mask: every query against all S keys
    (dense kinds), or DSA's indexer over all S keys plus its sparse core over min(index_topk, S). A kind with
    its own causal count but no full one here is refused rather than guessed at."""
    kind = attention_kind(m)
    if kind.core_flops is None:  # dense attention (GQA, MLA): the causal count is exactly S/2 keys
        return attention_score_flops(m) * seq_len
    if m.dsa.enabled:  # DSA's kind (moe_lc/config/attention_kinds.py: the MLA variant with [model.dsa] on)
        d = m.dsa
        indexer = seq_len * 2 * d.index_n_heads * (d.index_head_dim + 1)
        keys = seq_len if d.stage == "warmup" else min(d.index_topk, seq_len)
        return indexer + attention_score_flops(m) * keys
    if kind.per_layer:  # DeepSeek-V4, the one kind whose layers differ: its layers' mean (`_v4_full_core_flops`)
        types = m.v4_attention.layer_types_for(m.n_layers)
        return sum(_v4_full_core_flops(m, seq_len, t) for t in types) / m.n_layers
    raise ValueError(f"attention kind {kind.name!r} has its own causal FLOP count but no full one "
                     "(tools/step_time/flop_conventions.py)")


def _v4_full_core_flops(m: ModelConfig, seq_len: int, layer_type: str) -> float:
    """One V4 layer's core and indexer with no causal mask, in moe_lc/model/v4_counting.py's units (4 d per head
    per key, key = value; the indexer 2 E + 2 per head and entry): every query reads its whole window and all
    S/m entries (CSA: index_topk of them, its indexer scoring all S/m)."""
    a = m.v4_attention
    rate = a.compress_rate(layer_type)
    n = seq_len // rate if rate else 0
    csa = layer_type == "compressed_sparse_attention"
    keys = min(a.sliding_window, seq_len) + (min(a.index_topk, n) if csa else n)
    indexer = n * a.index_n_heads * (2 * a.index_head_dim + 2) if csa else 0
    return 4 * a.head_dim * m.n_heads * keys + indexer


def train_flops_per_token_both(m: ModelConfig, seq_len: int) -> dict[str, float]:
    """Model FLOPs per trained token (forward + backward = 3x forward), {"causal": ..., "full": ...}: the
    same matmuls, the attention core of each of the n_layers blocks counted causally or in full."""
    causal = train_flops_per_token(m, seq_len)
    extra = 3 * m.n_layers * (full_attention_core_flops(m, seq_len) - attention_core_flops(m, seq_len))
    return {"causal": causal, "full": causal + extra}


def model_flops_keys(m: ModelConfig, seq_len: int, tokens_per_s_per_gpu: float) -> dict:
    """The prediction's model-FLOP keys under both conventions, and the one MFU uses (`mfu_attention`)."""
    per_token = train_flops_per_token_both(m, seq_len)
    out: dict = {"mfu_attention": "causal"}
    for convention, flops in per_token.items():
        out[f"model_flops_per_token_{convention}"] = flops
        out[f"model_tflops_per_gpu_{convention}"] = flops * tokens_per_s_per_gpu / 1e12
    return out


def render_flops(pred: dict) -> list[str]:
    """Text lines of both conventions' TFLOP/s per GPU and which one MFU counts."""
    causal, full = pred["model_tflops_per_gpu_causal"], pred["model_tflops_per_gpu_full"]
    return [f"  model TFLOP/s/GPU: {causal:.0f} attention causal | {full:.0f} attention in full "
            f"({full / causal - 1:+.0%}); {MFU_CONVENTION}"]
