"""Work of one micro-batch through a pipeline stage on one rank, by kind, from the model's counts.

Each block's forward per token (moe_lc/model/counting.py's terms): FLOPs of the GEMMs (attention projections,
dense FFN and shared experts; the router and the output head kept in 16 bits under FP8), of the routed
experts' grouped GEMMs and of the causal attention core, and the bytes of the memory-bound work a fused
implementation moves (two RMSNorms, SwiGLU, two residual adds, the MoE permutation in and out, the loss), plus
what the recompute policy replays in backward; times the tokens one rank computes per micro-batch
(micro_batch x seq_len / (cp x tp)). DeepSeek-V4's blocks add mHC (its maps' GEMMs, kept in fp32, and the bytes of
its widened stream: tools/step_time/v4_flops.py) and split the indexer's scores from the core (`scores`: attention
kernels with no backward, their gradient being the indexer loss's over the picked entries alone).

Two users: the memory-bound bytes are the "fused" implementation's (tools/step_time/compute.py: Megatron's
and Transformer Engine's fused norms, SwiGLU, RoPE, permutation and cross-entropy move about these bytes), and
`flop_seconds` prices the whole Work at one achieved rate per kind, what the `cpu` cluster (measured rates,
tools/step_time/cpu.py) uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lc.config import Config
from moe_lc.config.attention_kinds import attention_kind
from moe_lc.model.counting import attention_core_flops, attention_params, attention_vector_params, \
    shared_expert_params
from .clusters import Cluster
from .v4_flops import mhc_flops, mhc_memory_bytes, v4_indexer_flops

ATTENTION_BWD = 2.5  # flash attention's backward recomputes the scores: 2.5x the forward FLOPs (FlashAttention-2 paper)
LOSS_BYTES = 12  # per vocabulary entry per token beside the logits: fp32 copy, log-softmax write and read


@dataclass
class Work:
    """One micro-batch's forward through some layers on one rank: FLOPs by kind, memory-bound bytes,
    and what the recompute policy replays in backward."""

    gemm: float = 0.0  # in the recipe's GEMM precision (fp8 under precision.recipe = "fp8")
    gemm_bf16: float = 0.0  # kept in 16 bits under FP8 (router, output head)
    grouped: float = 0.0  # routed experts
    attention: float = 0.0  # the attention core, forward
    memory: float = 0.0  # bytes
    recomputed: "Work | None" = None
    scores: float = 0.0  # attention-kernel FLOPs with no backward: V4's indexer scores (they take no gradient)

    def __add__(self, o: "Work") -> "Work":
        rep = (self.recomputed or Work()) + (o.recomputed or Work()) if (self.recomputed or o.recomputed) else None
        return Work(self.gemm + o.gemm, self.gemm_bf16 + o.gemm_bf16, self.grouped + o.grouped,
                    self.attention + o.attention, self.memory + o.memory, rep, self.scores + o.scores)

    def scaled(self, k: float) -> "Work":
        return Work(self.gemm * k, self.gemm_bf16 * k, self.grouped * k, self.attention * k, self.memory * k,
                    self.recomputed.scaled(k) if self.recomputed else None, self.scores * k)


def block_work(cfg: Config, layer_id: int) -> Work:
    """Forward work per token of block `layer_id` (before any split over ranks)."""
    m, c = cfg.model, act_bytes(cfg)
    D, seq = m.dim, cfg.train.seq_len
    attn = 2 * (attention_params(m, layer_id) - attention_vector_params(m, layer_id))  # (V4: this block's type)
    core = attention_core_flops(m, seq, layer_id)
    scores = v4_indexer_flops(m, seq, layer_id)  # (0 but for V4's CSA layers: in `core`, forward only)
    core -= scores
    if m.is_moe_layer(layer_id):
        e = m.moe
        hidden, permute = e.topk * e.ffn_dim + e.shared_hidden, 4 * e.topk * D  # dispatch in and out, read + write
        w = Work(gemm=attn + 2 * shared_expert_params(m), gemm_bf16=2 * e.n_routed_experts * D,
                 grouped=2 * 3 * D * e.ffn_dim * e.topk, attention=core)
    else:
        hidden, permute = m.ffn_dim, 0
        w = Work(gemm=attn + 2 * 3 * D * m.ffn_dim, attention=core)
    norms, swiglu = 4 * D, 3 * hidden  # two RMSNorms read + write; SwiGLU reads gate and up, writes one
    w.memory = c * (norms + 6 * D + swiglu + permute)  # + two residual adds (read 2, write 1)
    w.memory += mhc_memory_bytes(m, c)  # DeepSeek-V4's widened stream (0 under the plain one)
    w.scores = scores
    w.gemm_bf16 += mhc_flops(m)  # its maps, kept in fp32 (moe_lc/model/residual_stream.py)
    w.recomputed = _replay(cfg, w, norms * c, swiglu * c)
    return w


def _replay(cfg: Config, w: Work, norm_bytes: float, swiglu_bytes: float) -> Work | None:
    """What backward recomputes of one block's forward under the recompute policy."""
    policy, items, m = cfg.recompute.policy, cfg.recompute.selective, cfg.model
    if policy == "full":
        return Work(w.gemm, w.gemm_bf16, w.grouped, w.attention, w.memory, scores=w.scores)
    if policy != "selective":
        return None
    r = Work(memory=norm_bytes * ("norm" in items) + swiglu_bytes * ("swiglu" in items))
    if "attention" in items:
        r.attention = w.attention
    if attention_kind(m).up_item in items:  # MLA's (and DSA's) up-projections from the q and kv latents
        ml = m.mla
        r.gemm = 2 * m.n_heads * (ml.q_lora_rank * m.qk_head_dim * (ml.q_lora_rank > 0)
                                  + ml.kv_lora_rank * (ml.qk_nope_head_dim + ml.v_head_dim))
    return r


def act_bytes(cfg: Config) -> int:
    return 4 if cfg.precision.recipe == "fp32" else 2


def part_work(cfg: Config, part: str, layer_id: int = 0) -> Work:
    """Forward work per token of one part: "embed" (the lookup), a block ("dense" / "moe": `block_work` of
    `layer_id`), or "head" (the output head and loss, and each MTP module: a 2D -> D projection, one block like
    the last, its own head pass)."""
    m, c, D = cfg.model, act_bytes(cfg), cfg.model.dim
    if part == "embed":
        return Work(memory=2 * D * c)
    if part != "head":
        return block_work(cfg, layer_id)
    head = Work(gemm_bf16=2 * m.vocab_size * D, memory=m.vocab_size * (c + LOSS_BYTES))
    w = head
    for _ in range(m.mtp.depth):
        w = w + Work(gemm=2 * 2 * D * D) + block_work(cfg, m.n_layers - 1) + head
    return w


def tokens_per_rank(cfg: Config) -> float:
    """Tokens one rank computes per micro-batch: micro_batch x seq_len / (cp x tp)."""
    p, t = cfg.parallel, cfg.train
    return t.micro_batch * t.seq_len / (p.cp * p.tp)


def stage_work(cfg: Config, layers: list[int], first: bool, last: bool) -> Work:
    """One micro-batch through a stage on one rank: per-token work x micro_batch x seq_len / (cp x tp)."""
    w = part_work(cfg, "embed") if first else Work()
    for i in layers:
        w = w + block_work(cfg, i)
    if last:
        w = w + part_work(cfg, "head")
    return w.scaled(tokens_per_rank(cfg))


@dataclass
class Seconds:
    """A Work's time: forward, full backward (replay included), and the weight-gradient part."""

    F: float
    B: float
    W: float
    attention_F: float
    attention_B: float


def flop_seconds(cfg: Config, w: Work, cluster: Cluster, eff: dict[str, float]) -> Seconds:
    """The Work's time at one achieved rate per kind: the cluster's peak x `eff[kind]` (the `cpu` cluster's path)."""
    fp8, fp32 = cfg.precision.recipe == "fp8", cfg.precision.recipe == "fp32"
    fp8_gemm = f"gemm_fp8_{'tensorwise' if cfg.precision.fp8_scaling == 'tensorwise' else 'blockwise'}"
    wide = cluster.peak_tflops("fp32" if fp32 else "bf16") * 1e12
    gemm_peak = cluster.peak_tflops("fp8") * 1e12 if fp8 else wide

    def parts(x: Work) -> tuple[float, float, float]:  # (GEMMs, attention, memory) seconds
        g = (x.gemm / (gemm_peak * eff[fp8_gemm if fp8 else "gemm"]) + x.gemm_bf16 / (wide * eff["gemm"])
             + x.grouped / (gemm_peak * eff["grouped_gemm_fp8" if fp8 else "grouped_gemm"]))
        return g, x.attention / (wide * eff["attention_fwd"]), x.memory / (cluster.hbm_gbps * 1e9 * eff["memory"])

    g, a, mem = parts(w)
    s = w.scores / (wide * eff["attention_fwd"])  # forward only (and again in a replay)
    replay = sum(parts(w.recomputed)) + w.recomputed.scores / (wide * eff["attention_fwd"]) if w.recomputed else 0.0
    return Seconds(g + a + s + mem, 2 * g + ATTENTION_BWD * a + 2 * mem + replay, g, a + s, ATTENTION_BWD * a)


