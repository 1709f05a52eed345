"""Recipe sections: one frozen dataclass per TOML table, a one-line doc per field, and the rules that
involve only that section (`errors()`; rules tying sections together are in `rules.py`).

[model] holds the shape every block shares; its components read their own sub-tables:
[model.moe] (router and experts), [model.rope] (RoPE / YaRN), [model.mla] (latent attention) and
[model.mtp] (multi-token prediction). Choices are `Literal` types from `choices.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from moe_lc.config.choices import (
    AdamMoments, AttentionKind, AttnBackend, DataSource, Device, ExpertDispatch, Fp8Backend, Fp8CacheItem, Fp8Scaling,
    GroupScore, Logger, LrSchedule, MlaRing, PPSchedule, PrecisionRecipe, RecomputeItem, RecomputePolicy, RopeScaling,
    ScoreFunc, SyntheticTask,
)


def f(default: Any, doc: str):
    """A dataclass field with a default and a one-line doc (shown by `--print-config --docs`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def positive(e: list[str], path: str, value) -> None:
    if not value > 0:
        e.append(f"{path}={value!r} must be > 0")


def non_negative(e: list[str], path: str, value) -> None:
    if not value >= 0:
        e.append(f"{path}={value!r} must be >= 0")


# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class MoEConfig:
    """[model.moe]: shared + fine-grained routed experts, group-limited routing, load balancing."""

    n_dense_layers: int = f(1, "the first n_dense_layers blocks use the dense SwiGLU (model.ffn_dim), the rest MoE")
    n_routed_experts: int = f(8, "fine-grained routed experts per MoE layer (0 = a dense model)")
    n_shared_experts: int = f(1, "always-active shared experts per MoE layer")
    ffn_dim: int = f(128, "hidden width of each routed (and shared) expert")
    topk: int = f(2, "routed experts per token")
    n_groups: int = f(4, "expert groups (map to nodes under EP); divides n_routed_experts")
    topk_groups: int = f(2, "groups a token may use (node-limited routing); <= n_groups")
    score_func: ScoreFunc = f("sigmoid", "router affinity")
    group_score: GroupScore = f("top2_sum", "a group's score: the sum of its top-2 affinities (DeepSeek-V3) or its best one (V2)")
    norm_topk_prob: bool = f(True, "renormalize the top-k affinities to sum to 1 (DeepSeek-V3; V2 does not)")
    routed_scaling_factor: float = f(1.0, "gate weights are the (normalized) top-k affinities times this")
    bias_update_speed: float = f(1e-3, "aux-loss-free balancing: bias step per optimizer step (0 = off)")
    aux_loss_weight: float = f(0.0, "weight of the sequence-wise balance loss (0 = off)")
    weighted_swiglu: bool = f(False, "gate weights multiply each expert's SwiGLU output before its down projection "
                                     "(the same function; combine then only sums and saves no expert outputs)")

    def errors(self, n_layers: int) -> list[str]:
        e, p = [], "model.moe"
        if not 0 <= self.n_dense_layers <= n_layers:
            e.append(f"{p}.n_dense_layers={self.n_dense_layers} must lie in [0, model.n_layers={n_layers}]")
        non_negative(e, f"{p}.n_routed_experts", self.n_routed_experts)
        non_negative(e, f"{p}.n_shared_experts", self.n_shared_experts)
        non_negative(e, f"{p}.bias_update_speed", self.bias_update_speed)
        non_negative(e, f"{p}.aux_loss_weight", self.aux_loss_weight)
        positive(e, f"{p}.routed_scaling_factor", self.routed_scaling_factor)
        if self.n_routed_experts <= 0 or self.n_dense_layers >= n_layers:
            return e
        positive(e, f"{p}.ffn_dim", self.ffn_dim)
        E = self.n_routed_experts
        if not 1 <= self.topk <= E:
            e.append(f"{p}.topk={self.topk} must lie in [1, n_routed_experts={E}]")
        if self.n_groups < 1 or E % self.n_groups:
            e.append(f"{p}.n_groups={self.n_groups} must divide {p}.n_routed_experts={E}")
        elif not 1 <= self.topk_groups <= self.n_groups:
            e.append(f"{p}.topk_groups={self.topk_groups} must lie in [1, n_groups={self.n_groups}]")
        elif self.topk > self.topk_groups * (E // self.n_groups):
            e.append(f"{p}.topk={self.topk} exceeds the experts in topk_groups={self.topk_groups} groups of "
                     f"{E // self.n_groups}")
        elif self.n_groups > 1 and E // self.n_groups < 2 and self.group_score == "top2_sum":
            e.append(f"{p}.n_groups={self.n_groups}: each group needs >= 2 experts (group score = top-2 sum)")
        return e


@dataclass(frozen=True)
class RopeConfig:
    """[model.rope]: rotary position embedding and its YaRN extension."""

    theta: float = f(10000.0, "RoPE base b (theta_i = b^(-2i/d))")
    scaling: RopeScaling = f("none", "long-context extension of the frequencies")
    factor: float = f(1.0, "YaRN scale factor s (e.g. 32 for 4K -> 128K)")
    original_seq_len: int = f(4096, "YaRN: context length L the model was pre-trained at")
    beta_fast: float = f(32.0, "YaRN: dims with more than beta_fast rotations in L keep theta_i")
    beta_slow: float = f(1.0, "YaRN: dims with fewer than beta_slow rotations in L use theta_i/s")
    truncate: bool = f(True, "YaRN: round the correction range to whole dims (floor / ceil), as the official code")
    mscale: float = f(1.0, "YaRN: cos/sin factor m(s, mscale) / m(s, mscale_all_dim), m(s, x) = 0.1 x ln(s) + 1")
    mscale_all_dim: float = f(0.0, "YaRN: 0 = cos/sin factor m(s, 1); MLA multiplies its softmax scale by m(s, this)^2")

    def errors(self) -> list[str]:
        e = []
        positive(e, "model.rope.theta", self.theta)
        if self.scaling == "yarn":
            if self.factor < 1:
                e.append(f"model.rope.factor={self.factor} must be >= 1 with rope.scaling = 'yarn'")
            if not self.beta_fast > self.beta_slow:
                e.append(f"model.rope.beta_fast={self.beta_fast} must exceed rope.beta_slow={self.beta_slow}")
            positive(e, "model.rope.original_seq_len", self.original_seq_len)
        return e


@dataclass(frozen=True)
class MLAConfig:
    """[model.mla]: multi-head latent attention (DeepSeek-V2/V3), read when model.attention = 'mla'."""

    q_lora_rank: int = f(0, "query latent rank (0 = project queries straight from x)")
    kv_lora_rank: int = f(0, "key/value latent rank")
    qk_nope_head_dim: int = f(0, "per-head query/key dims without RoPE")
    qk_rope_head_dim: int = f(0, "decoupled RoPE dims (one rotated key shared by all heads)")
    v_head_dim: int = f(0, "per-head value dim")

    def errors(self) -> list[str]:
        e = []
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            positive(e, f"model.mla.{name}", getattr(self, name))
        non_negative(e, "model.mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            e.append(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        return e


@dataclass(frozen=True)
class MTPConfig:
    """[model.mtp]: multi-token prediction (DeepSeek-V3)."""

    depth: int = f(0, "prediction modules (0 = off); module d predicts token t+1+d")
    loss_weight: float = f(0.3, "weight lambda of the MTP loss: lambda / depth * sum of module losses")

    def errors(self) -> list[str]:
        e = []
        non_negative(e, "model.mtp.depth", self.depth)
        non_negative(e, "model.mtp.loss_weight", self.loss_weight)
        return e


@dataclass(frozen=True)
class ModelConfig:
    """[model]: shape of the decoder-only MoE transformer (DeepSeek-style)."""

    vocab_size: int = f(512, "embedding rows; >= the tokenizer's vocabulary (padded for TP)")
    dim: int = f(128, "model width (hidden size)")
    n_layers: int = f(4, "transformer blocks")
    n_heads: int = f(4, "query heads")
    n_kv_heads: int = f(2, "key/value heads (grouped-query attention); divides n_heads")
    head_dim: int = f(0, "per-head width; 0 means dim // n_heads")
    ffn_dim: int = f(512, "hidden width of the dense SwiGLU FFN (the first moe.n_dense_layers blocks)")
    norm_eps: float = f(1e-6, "RMSNorm epsilon")
    init_std: float = f(0.02, "std of the normal init of weights (output projections scaled by depth)")
    attention: AttentionKind = f("gqa", "grouped-query, or multi-head latent attention ([model.mla])")
    attn_backend: AttnBackend = f("auto", "attention kernel; auto = the fastest usable on the device")
    qkv_bias: bool = f(False, "biases on the q, k, v projections (Qwen2); GQA only")
    moe: MoEConfig = f(MoEConfig(), "[model.moe]")
    rope: RopeConfig = f(RopeConfig(), "[model.rope]")
    mla: MLAConfig = f(MLAConfig(), "[model.mla]")
    mtp: MTPConfig = f(MTPConfig(), "[model.mtp]")

    @property
    def head_size(self) -> int:
        return self.head_dim or (self.dim // self.n_heads if self.n_heads > 0 else 0)

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head (MLA: nope + rope dims)."""
        return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def value_head_dim(self) -> int:
        return self.mla.v_head_dim if self.attention == "mla" else self.head_size

    @property
    def rope_dim(self) -> int:
        """Rotated dims per head (MLA rotates only its decoupled part)."""
        return self.mla.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def has_moe(self) -> bool:
        return self.moe.n_routed_experts > 0 and self.moe.n_dense_layers < self.n_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe.n_routed_experts > 0 and layer_id >= self.moe.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return max(self.n_layers - self.moe.n_dense_layers, 0) if self.moe.n_routed_experts else 0

    def errors(self) -> list[str]:
        e = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "init_std"):
            positive(e, f"model.{name}", getattr(self, name))
        if self.attention == "mla":
            e += self.mla.errors()
            if self.qkv_bias:
                e.append("model.qkv_bias = true needs model.attention = 'gqa' (MLA has no q/k/v projections)")
        elif self.n_heads > 0 and self.n_kv_heads > 0 and self.dim > 0:
            if self.n_heads % self.n_kv_heads:
                e.append(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
            if self.head_dim < 0:
                e.append(f"model.head_dim={self.head_dim} must be >= 0 (0 = dim // n_heads)")
            elif self.head_dim == 0 and self.dim % self.n_heads:
                e.append(f"model.n_heads={self.n_heads} must divide model.dim={self.dim} when head_dim = 0")
            elif self.head_size % 2:
                e.append(f"model head size {self.head_size} must be even for RoPE")
        return e + self.moe.errors(self.n_layers) + self.rope.errors() + self.mtp.errors()


# --------------------------------------------------------------------------------------------- the rest


@dataclass(frozen=True)
class ParallelConfig:
    """[parallel]: degrees of the parallel dimensions; world = pp * dp * cp * tp, ep folded into dp*cp*tp."""

    pp: int = f(1, "pipeline stages (ranks along the pipeline)")
    dp: int = f(0, "data-parallel degree; 0 = the rest of the world (world / (pp*cp*tp))")
    cp: int = f(1, "context-parallel degree (zig-zag ring attention over the sequence)")
    tp: int = f(1, "tensor-parallel degree (Megatron column/row with sequence parallelism)")
    ep: int = f(1, "expert-parallel degree; divides dp*cp*tp (experts sharded, tokens all-to-all)")
    ranks_per_node: int = f(0, "ranks per node; 0 = torchrun's LOCAL_WORLD_SIZE (set lower to simulate nodes)")
    pp_schedule: PPSchedule = f("1f1b", "pipeline schedule")
    pp_chunks: int = f(2, "model chunks per rank for interleaved_1f1b")
    pp_stage_layers: list[int] = f([], "blocks per pipeline stage (empty = balanced by estimated cost)")
    microbatches: int = f(0, "micro-batches per step per pipeline; 0 = global_batch / (micro_batch * dp)")
    expert_dispatch: ExpertDispatch = f("flat", "flat, or hierarchical (cross each node once, then fan out inside it)")
    mla_ring: MlaRing = f("latent", "MLA's ring under cp moves the KV latent (up-projected on arrival) or expanded K, V")
    zero_bucket_mb: float = f(32.0, "ZeRO-1 gradient reduce-scatter bucket size in MiB")
    timeout_s: float = f(600.0, "collective timeout in seconds")
    overlap: bool = f(True, "issue all-to-alls and pipeline transfers early and wait where their result is used "
                            "(DualPipe's F&B hides one micro-batch's all-to-all behind the other's compute); "
                            "false = wait at every issue (same numbers, for comparison)")
    link: str = f("", "modelled network 'LATENCY_US:GBPS' (e.g. '50:2'): every collective takes at least latency + "
                      "bytes / bandwidth once all its ranks issued it, so overlap shows on a CPU; '' = off")

    @property
    def link_model(self) -> tuple[float, float] | None:
        """(latency in s, bytes per s) of `link`, None when off; `errors` has vetted the text."""
        latency_us, _, gbps = self.link.partition(":")
        return (float(latency_us) * 1e-6, float(gbps) * 1e9) if self.link else None

    def errors(self) -> list[str]:
        e = []
        if self.link:
            latency_us, sep, gbps = self.link.partition(":")
            try:
                ok = sep and float(latency_us) >= 0 and 0 < float(gbps) < float("inf")
            except ValueError:
                ok = False
            if not ok:
                e.append(f"parallel.link={self.link!r} must be 'LATENCY_US:GBPS' with latency >= 0 and bandwidth "
                         "> 0 (e.g. '50:2': 50 us, 2 GB/s), or '' (off)")
        for name in ("pp", "cp", "tp", "ep", "pp_chunks", "zero_bucket_mb", "timeout_s"):
            positive(e, f"parallel.{name}", getattr(self, name))
        for name in ("dp", "ranks_per_node", "microbatches"):
            non_negative(e, f"parallel.{name}", getattr(self, name))
        if self.timeout_s > 10**8:
            e.append(f"parallel.timeout_s={self.timeout_s} must be <= 1e8 (about 3 years)")
        return e


@dataclass(frozen=True)
class PrecisionConfig:
    """[precision]: compute precision; master weights, gradients and Adam states are the optimizer's (fp32)."""

    recipe: PrecisionRecipe = f("fp32", "fp8 = fp8 GEMMs in the one Linear, bf16 elsewhere")
    fp8_scaling: Fp8Scaling = f("blockwise", "fp8 flavour: blockwise is DeepSeek's 1x128 / 128x128")
    fp8_backend: Fp8Backend = f("auto", "fp8 GEMMs: auto = te, else torch._scaled_mm, where they run, else emulate")
    adam_moments: AdamMoments = f("fp32", "dtype of Adam moments (DeepSeek-V3 keeps them in bf16)")
    fp8_dispatch: bool = f(False, "tokens enter the experts FP8-rounded (1x128 tiles) and cross the EP all-to-all "
                                  "in FP8 (DeepSeek-V3); combine and gradients stay in the compute dtype")
    fp8_cache: list[Fp8CacheItem] = f([], "activations kept for backward in FP8 (DeepSeek-V3 3.3.3): linear = FP8 "
                                          "Linears' inputs as their wgrad quantizes them (exact), swiglu = SwiGLU "
                                          "inputs, output recomputed, attn_out = the attention output (wo's input)")

    @property
    def compute_dtype(self):
        import torch

        return torch.float32 if self.recipe == "fp32" else torch.bfloat16

    def errors(self) -> list[str]:
        e = []
        if "linear" in self.fp8_cache and (self.recipe != "fp8" or self.fp8_scaling == "delayed"):
            e.append(f"precision.fp8_cache item 'linear' keeps FP8 GEMM inputs as their weight gradient quantizes "
                     f"them: it needs precision.recipe='fp8' with fp8_scaling 'blockwise' or 'tensorwise' (got "
                     f"recipe={self.recipe!r}, fp8_scaling={self.fp8_scaling!r}; delayed scaling quantizes at GEMM time)")
        return e


@dataclass(frozen=True)
class RecomputeConfig:
    """[recompute]: activation recomputation (trade compute for activation memory)."""

    policy: RecomputePolicy = f("none", "full recomputes whole blocks, selective the items below")
    selective: list[RecomputeItem] = f(["norm", "swiglu"], "what `selective` recomputes (mla_up: MLA up-projections)")

    def errors(self) -> list[str]:
        return []


@dataclass(frozen=True)
class TrainConfig:
    """[train]: the optimization loop."""

    steps: int = f(200, "optimizer steps")
    seed: int = f(0, "seeds init and data order; same seed -> same losses under any layout")
    lr: float = f(3e-3, "peak learning rate")
    min_lr_ratio: float = f(0.1, "final LR as a fraction of lr (cosine / wsd)")
    warmup_steps: int = f(20, "linear warmup steps")
    lr_schedule: LrSchedule = f("cosine", "cosine, warmup-stable-decay, or constant after warmup")
    wsd_decay_fraction: float = f(0.2, "wsd: fraction of steps spent in the final decay")
    weight_decay: float = f(0.1, "AdamW decoupled weight decay (not applied to norms, biases, embeddings)")
    beta1: float = f(0.9, "AdamW beta1")
    beta2: float = f(0.95, "AdamW beta2")
    eps: float = f(1e-8, "AdamW epsilon")
    grad_clip: float = f(1.0, "global grad-norm clip; 0 = off")
    ema_decay: float = f(0.0, "EMA of the fp32 parameters, kept in CPU memory (each rank its ZeRO shard) and "
                              "updated after every step in the background (DeepSeek-V3 3.2.3); 0 = off")
    global_batch: int = f(16, "sequences per optimizer step, all data-parallel ranks together")
    micro_batch: int = f(8, "sequences per forward/backward on one data-parallel rank")
    seq_len: int = f(128, "tokens per sequence")
    output_dir: str = f("runs/debug", "metrics.jsonl, tb/, config.toml and checkpoints go here")
    log_interval: int = f(10, "console progress line every N steps (metrics.jsonl gets every step)")
    device: Device = f("auto", "auto = cuda where torch sees a GPU")
    threads: int = f(0, "torch CPU threads per process; 0 = torch's default")
    peak_tflops: float = f(0.0, "peak FLOP/s per device for MFU, in TFLOP/s; 0 = look up the GPU")
    max_nonfinite_steps: int = f(3, "skip up to N steps with a non-finite loss or grad norm, then stop")
    trace_step: int = f(0, "record step N's timeline (compute phases, every collective's issue / done / wait) in "
                           "<output_dir>/timeline/rank<R>.json, drawn by tools/timeline.py; 0 = off")
    overwrite: bool = f(False, "a new run may replace an earlier run in output_dir (clears its metrics, tb/, "
                               "config.toml, run.json and checkpoints under output_dir); false = refuse")
    loggers: list[Logger] = f(["tensorboard"], "where per-step scalars go besides metrics.jsonl (wandb: "
                                               "pip install -e '.[wandb]')")
    wandb_project: str = f("moe_lc", "Weights & Biases project (loggers = wandb)")
    wandb_mode: Literal["online", "offline"] = f("online", "Weights & Biases mode; the WANDB_MODE variable wins")

    def microbatches(self, dp: int) -> int:  # per step on each data-parallel rank (= per pipeline)
        return self.global_batch // (self.micro_batch * dp)

    def errors(self) -> list[str]:
        e = []
        for name in ("steps", "global_batch", "micro_batch", "seq_len", "log_interval", "lr"):
            positive(e, f"train.{name}", getattr(self, name))
        for name in ("warmup_steps", "weight_decay", "grad_clip", "threads", "peak_tflops", "max_nonfinite_steps",
                     "trace_step", "eps", "seed"):
            non_negative(e, f"train.{name}", getattr(self, name))
        if not 0 <= self.min_lr_ratio <= 1:
            e.append(f"train.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if not 0 < self.wsd_decay_fraction <= 1:
            e.append(f"train.wsd_decay_fraction={self.wsd_decay_fraction} must lie in (0, 1]")
        for name in ("beta1", "beta2", "ema_decay"):
            if not 0 <= getattr(self, name) < 1:
                e.append(f"train.{name}={getattr(self, name)} must lie in [0, 1)")
        if self.micro_batch > 0 and self.global_batch % self.micro_batch:
            e.append(f"train.micro_batch={self.micro_batch} must divide train.global_batch={self.global_batch}")
        if not self.output_dir.strip():
            e.append("train.output_dir is empty")
        return e


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: distributed checkpoints (torch.distributed.checkpoint), committed atomically."""

    dir: str = f("", "checkpoint root; empty = <output_dir>/checkpoints")
    interval: int = f(0, "save every N steps; 0 = none during training (save_final still saves at the end)")
    resume: bool = f(False, "continue from the newest complete checkpoint in dir, if any")
    keep: int = f(3, "keep the newest K checkpoints; 0 = keep all")
    save_final: bool = f(True, "save once more after the last step, so eval and to-hf find the weights; "
                               "false = only every `interval`")
    async_save: bool = f(False, "write checkpoints in the background (a snapshot is taken first)")
    init_from: str = f("", "start from these weights only (a checkpoint, its root, or a from-hf directory); "
                           "fresh optimizer, step and data; a resumable checkpoint in dir wins")

    def errors(self) -> list[str]:
        e = []
        for name in ("interval", "keep"):
            non_negative(e, f"checkpoint.{name}", getattr(self, name))
        return e


@dataclass(frozen=True)
class DataConfig:
    """[data]: training data: real text, token files, synthetic long-context tasks, or a mixture."""

    source: DataSource = f("stdlib", "stdlib: Python sources on this machine; tokens: a token file")
    path: str = f("", "token-file prefix for source = tokens (see tools/prepare_data.py)")
    tokenizer: str = f("byte", "byte | a HuggingFace tokenizer.json | a directory holding one (a model's)")
    synthetic_tasks: list[SyntheticTask] = f(["passkey"], "synthetic long-context tasks mixed in")
    synthetic_weight: float = f(0.0, "fraction of samples drawn from synthetic_tasks, mixed into source (< 1)")
    needle_keys: int = f(4, "multikey_needle: needles per sample (the queried one and its distractors)")
    val_fraction: float = f(0.02, "fraction of stdlib files held out for validation")

    @property
    def has_loss_mask(self) -> bool:
        """Samples carry a loss mask (synthetic tasks score only their answers)."""
        return self.source == "synthetic" or self.synthetic_weight > 0

    def errors(self) -> list[str]:
        e = []
        if self.source == "tokens" and not self.path:
            e.append("data.path is empty: source = 'tokens' needs the token-file prefix")
        if not 0 <= self.synthetic_weight < 1:
            e.append(f"data.synthetic_weight={self.synthetic_weight} must lie in [0, 1) "
                     "(source = 'synthetic' trains on synthetic tasks only)")
        if self.needle_keys < 1:
            e.append(f"data.needle_keys={self.needle_keys} must be >= 1")
        if not 0 < self.val_fraction < 1:
            e.append(f"data.val_fraction={self.val_fraction} must lie in (0, 1)")
        return e


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "recompute": RecomputeConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
}


@dataclass(frozen=True)
class Config:
    """A whole recipe. Components receive only their section, never this object."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)
