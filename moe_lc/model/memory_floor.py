"""A floor under the memory one micro-batch's activations take on one rank, from the config alone.

Preflight refuses a recipe whose floor exceeds the memory a rank has (`train.seq_len = 1048576` on the
debug model), in a second, instead of letting it sit in attention for minutes. It is a LOWER bound, so
it never refuses what could fit: every term is one the model surely keeps (the planner traces what a
block keeps, tools/planner/block_trace.py; tests/test_preflight.py checks this floor stays under that
figure), at the fewest bytes any precision or FP8 caching keeps it in, and every layout divides it
as much as it could: tp divides every term (in truth only some are cut), cp the sequence, pp the blocks
(some pipeline rank holds at least ceil(n_layers / pp) of them: the cheapest ones are counted).

Legend: D model dim, H query heads, K kv heads, Dh head dim, Dv value
head dim, V vocabulary rows, F dense FFN hidden, k routed experts per token, Fe expert hidden, c bytes
of the compute dtype (fp32 4, bf16 2), S sequence length, B micro-batch sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lc.config import Config, ModelConfig
from moe_lc.config.attention_kinds import attention_kind
from moe_lc.model.counting import kind_count


def block_floor(m: ModelConfig, layer_id: int, c: int, policy: str, fp8_linear: bool = False,
                fp8_cache=(), cp: int = 1) -> int:
    """Bytes per token block `layer_id` surely keeps for backward (before any tensor parallelism).
    fp8_linear: Linear inputs may be kept in FP8 (FP8 GEMMs, caching or dispatch); fp8_cache: its items."""
    D = m.dim
    if policy == "full":
        return c * D  # one checkpoint around the block keeps its input, the residual stream (DualPipe's per-phase
        # replay keeps more: a floor counts the least)
    lin = 1 if fp8_linear else c
    act = 1 if "swiglu" in fp8_cache else c
    out = 1 if "attn_out" in fp8_cache else c
    kept = 2 * c * D + 2 * lin * D  # each norm's input; the normed inputs of attention and the FFN
    kept += out * m.n_heads * m.value_head_dim  # the attention output, wo's input
    kept += kind_count(m, attention_kind(m).saved_bytes, c, cp, layer_id=layer_id)  # GQA's q|k|v (ring: v's copy)
    if not m.is_moe_layer(layer_id):
        return kept + 2 * act * m.ffn_dim  # gate|up
    e = m.moe  # routed and shared gate|up, the sorted token copies
    return kept + 2 * act * (e.topk + e.n_shared_experts) * e.ffn_dim + lin * e.topk * D


def loss_floor(m: ModelConfig, c: int, tp: int = 1) -> float:
    """Bytes per token the output head's loss needs at once: it keeps the fp32 log-softmax (or the 16-bit
    logits, tp = 1), at least cV/tp, and in fp32 or under TP the logits exist beside it while it is made."""
    return m.vocab_size * c / tp * (2 if c == 4 or tp > 1 else 1)


def scores_floor(m: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1, cp: int = 1) -> float:
    """Bytes of attention scores a backend that materializes them holds at once: two fp32 (B, H/tp, S/cp,
    S/cp) matrices (scores and probabilities; ring attention's first step is the whole local diagonal)."""
    return 2 * 4 * micro_batch * (m.n_heads / tp) * (seq_len / cp) ** 2


@dataclass(frozen=True)
class Floor:
    """The floor of one rank's activation bytes, and its parts (for the message)."""

    total: float
    blocks: float  # kept by the blocks of the busiest rank
    n_blocks: int
    loss: float
    scores: float


def activation_floor(cfg: Config, keeps_scores: bool) -> Floor:
    """The floor of the busiest rank, one micro-batch in flight. keeps_scores: the attention backend
    materializes (S x S) scores (moe_lc.ops.attention.keeps_scores)."""
    m, t, p, prec = cfg.model, cfg.train, cfg.parallel, cfg.precision
    c = 4 if prec.recipe == "fp32" else 2
    fp8_linear = prec.recipe == "fp8" or prec.fp8_dispatch or "linear" in prec.fp8_cache
    per_token = sorted(block_floor(m, i, c, cfg.recompute.policy, fp8_linear, prec.fp8_cache, p.cp)
                       for i in range(m.n_layers))
    n = -(-m.n_layers // p.pp)
    tokens = t.micro_batch * t.seq_len / p.cp
    blocks, before_last = (sum(per_token[:j]) * tokens / p.tp for j in (n, n - 1))
    loss = loss_floor(m, c, p.tp) * tokens
    scores = scores_floor(m, t.micro_batch, t.seq_len, p.tp, p.cp) if keeps_scores else 0.0
    # the loss runs after every block's forward; the last block's scores before its own keep is complete
    total = max(blocks + loss, before_last + scores) if p.pp == 1 else max(blocks, before_last + scores, loss)
    return Floor(total, blocks, n, loss, scores)
