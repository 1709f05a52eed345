"""Recipes: TOML -> frozen dataclasses, `extends`, `--set` overrides, validation.

A recipe is a TOML file with one table per section below. `extends = "base.toml"` (relative to the
file) merges the base first, so ablation variants only state what differs. `--set train.lr=1e-3`
overrides any key with type checking. Every problem is collected and reported at once, each naming
its field, its value and the rule, before any process group or model exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A recipe that cannot run. `errors` holds every violated rule, one line each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        n = len(self.errors)
        head = f"invalid recipe ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n  - ".join([head, *self.errors]))


def f(default: Any, doc: str):
    """A dataclass field with a default and a one-line doc (shown by `--print-config --docs`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only MoE transformer (DeepSeek-style)."""

    vocab_size: int = f(512, "embedding rows; >= the tokenizer's vocabulary (padded for TP)")
    dim: int = f(128, "model width (hidden size)")
    n_layers: int = f(4, "transformer blocks")
    n_heads: int = f(4, "query heads")
    n_kv_heads: int = f(2, "key/value heads (grouped-query attention); divides n_heads")
    head_dim: int = f(0, "per-head width; 0 means dim // n_heads")
    ffn_dim: int = f(512, "hidden width of the dense SwiGLU FFN (first n_dense_layers blocks)")
    norm_eps: float = f(1e-6, "RMSNorm epsilon")
    init_std: float = f(0.02, "std of the normal init of weights (output projections scaled by depth)")
    attn_backend: str = f("auto", "attention kernel: auto | flash_attn4 | flash_attn | torch | reference")
    rope_theta: float = f(10000.0, "RoPE base b (theta_i = b^(-2i/d))")
    rope_scaling: str = f("none", "none | yarn (long-context extension)")
    rope_factor: float = f(1.0, "YaRN scale factor s (e.g. 32 for 4K -> 128K)")
    rope_original_seq_len: int = f(4096, "YaRN: context length L the model was pre-trained at")
    rope_beta_fast: float = f(32.0, "YaRN: dims with more than beta_fast rotations in L keep theta_i")
    rope_beta_slow: float = f(1.0, "YaRN: dims with fewer than beta_slow rotations in L use theta_i/s")
    rope_mscale: float = f(0.1, "YaRN attention temperature: mscale = rope_mscale*ln(s) + 1")
    attention: str = f("gqa", "gqa (grouped-query) | mla (multi-head latent attention, DeepSeek-V2/V3)")
    q_lora_rank: int = f(0, "MLA: query latent rank (0 = project queries straight from x)")
    kv_lora_rank: int = f(0, "MLA: key/value latent rank")
    qk_nope_head_dim: int = f(0, "MLA: per-head query/key dims without RoPE")
    qk_rope_head_dim: int = f(0, "MLA: decoupled RoPE dims (one rotated key shared by all heads)")
    v_head_dim: int = f(0, "MLA: per-head value dim")
    mtp_depth: int = f(0, "multi-token prediction modules (0 = off); module d predicts token t+1+d")
    mtp_loss_weight: float = f(0.3, "weight lambda of the MTP loss: lambda / depth * sum of module losses")
    n_dense_layers: int = f(1, "the first n_dense_layers blocks use a dense SwiGLU FFN, the rest MoE")
    n_routed_experts: int = f(8, "fine-grained routed experts per MoE layer")
    n_shared_experts: int = f(1, "always-active shared experts per MoE layer")
    moe_ffn_dim: int = f(128, "hidden width of each routed (and shared) expert")
    topk: int = f(2, "routed experts per token")
    n_groups: int = f(4, "expert groups (map to nodes under EP); divides n_routed_experts")
    topk_groups: int = f(2, "groups a token may use (node-limited routing); <= n_groups")
    score_func: str = f("sigmoid", "router affinity: sigmoid | softmax")
    routed_scaling_factor: float = f(1.0, "gate weights are normalized top-k affinities times this")
    bias_update_speed: float = f(1e-3, "aux-loss-free balancing: bias step per optimizer step (0 = off)")
    aux_loss_weight: float = f(0.0, "weight of the sequence-wise balance loss (0 = off)")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head (MLA: nope + rope dims)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_size

    @property
    def rope_dim(self) -> int:
        """Rotated dims per head (MLA rotates only its decoupled part)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def n_moe_layers(self) -> int:
        return max(self.n_layers - self.n_dense_layers, 0) if self.n_routed_experts else 0

    def errors(self) -> list[str]:
        e = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            _positive(e, "model", name, getattr(self, name))
        _positive(e, "model", "norm_eps", self.norm_eps)
        _positive(e, "model", "init_std", self.init_std)
        _positive(e, "model", "rope_theta", self.rope_theta)
        _choice(e, "model", "attention", self.attention, ("gqa", "mla"))
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _positive(e, "model", name, getattr(self, name))
            if self.q_lora_rank < 0:
                e.append(f"model.q_lora_rank={self.q_lora_rank} must be >= 0")
            if self.qk_rope_head_dim % 2:
                e.append(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        else:
            if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
                e.append(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
            if self.head_dim < 0:
                e.append(f"model.head_dim={self.head_dim} must be >= 0 (0 = dim // n_heads)")
            elif self.head_dim == 0 and self.n_heads > 0 and self.dim % self.n_heads:
                e.append(f"model.n_heads={self.n_heads} must divide model.dim={self.dim} when head_dim = 0")
            elif self.head_size % 2:
                e.append(f"model head size {self.head_size} must be even for RoPE")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            e.append("model.mtp_depth and model.mtp_loss_weight must be >= 0")
        _choice(e, "model", "attn_backend", self.attn_backend, ("auto", "flash_attn4", "flash_attn", "torch", "reference"))
        _choice(e, "model", "rope_scaling", self.rope_scaling, ("none", "yarn"))
        _choice(e, "model", "score_func", self.score_func, ("sigmoid", "softmax"))
        if self.rope_scaling == "yarn":
            if self.rope_factor < 1:
                e.append(f"model.rope_factor={self.rope_factor} must be >= 1 with rope_scaling = 'yarn'")
            if not self.rope_beta_fast > self.rope_beta_slow:
                e.append(f"model.rope_beta_fast={self.rope_beta_fast} must exceed rope_beta_slow={self.rope_beta_slow}")
            _positive(e, "model", "rope_original_seq_len", self.rope_original_seq_len)
        if not 0 <= self.n_dense_layers <= self.n_layers:
            e.append(f"model.n_dense_layers={self.n_dense_layers} must lie in [0, n_layers={self.n_layers}]")
        if self.n_routed_experts < 0 or self.n_shared_experts < 0:
            e.append("model.n_routed_experts and model.n_shared_experts must be >= 0")
        if self.n_routed_experts > 0 and self.n_dense_layers < self.n_layers:
            _positive(e, "model", "moe_ffn_dim", self.moe_ffn_dim)
            if not 1 <= self.topk <= self.n_routed_experts:
                e.append(f"model.topk={self.topk} must lie in [1, n_routed_experts={self.n_routed_experts}]")
            if self.n_groups < 1 or self.n_routed_experts % self.n_groups:
                e.append(f"model.n_groups={self.n_groups} must divide model.n_routed_experts={self.n_routed_experts}")
            elif not 1 <= self.topk_groups <= self.n_groups:
                e.append(f"model.topk_groups={self.topk_groups} must lie in [1, n_groups={self.n_groups}]")
            elif self.topk > self.topk_groups * (self.n_routed_experts // self.n_groups):
                e.append(f"model.topk={self.topk} exceeds the experts in topk_groups={self.topk_groups} groups "
                         f"of {self.n_routed_experts // self.n_groups}")
            elif self.n_groups > 1 and self.n_routed_experts // self.n_groups < 2:
                e.append(f"model.n_groups={self.n_groups}: each group needs >= 2 experts (group score = top-2 sum)")
        if self.bias_update_speed < 0 or self.aux_loss_weight < 0:
            e.append("model.bias_update_speed and model.aux_loss_weight must be >= 0")
        return e


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the parallel dimensions; world = pp * dp * cp * tp, ep folded into dp*cp*tp."""

    pp: int = f(1, "pipeline stages (ranks along the pipeline)")
    dp: int = f(0, "data-parallel degree; 0 = the rest of the world (world / (pp*cp*tp))")
    cp: int = f(1, "context-parallel degree (zig-zag ring attention over the sequence)")
    tp: int = f(1, "tensor-parallel degree (Megatron column/row with sequence parallelism)")
    ep: int = f(1, "expert-parallel degree; divides dp*cp*tp (experts sharded, tokens all-to-all)")
    ranks_per_node: int = f(0, "ranks per node; 0 = torchrun's LOCAL_WORLD_SIZE (set lower to simulate nodes)")
    pp_schedule: str = f("1f1b", "gpipe | 1f1b | interleaved_1f1b | zbh1 | dualpipe | dualpipev")
    pp_chunks: int = f(2, "model chunks per rank for interleaved_1f1b")
    pp_stage_layers: list[int] = f([], "blocks per pipeline stage (empty = balanced by estimated cost)")
    microbatches: int = f(0, "micro-batches per step per pipeline; 0 = global_batch / (micro_batch * dp)")
    expert_dispatch: str = f("flat", "flat | hierarchical (cross each node once, then fan out inside it)")
    zero_bucket_mb: float = f(32.0, "ZeRO-1 gradient reduce-scatter bucket size in MiB")
    timeout_s: float = f(600.0, "collective timeout in seconds")

    def errors(self) -> list[str]:
        e = []
        for name in ("pp", "cp", "tp", "ep", "pp_chunks"):
            _positive(e, "parallel", name, getattr(self, name))
        for name in ("dp", "ranks_per_node", "microbatches"):
            if getattr(self, name) < 0:
                e.append(f"parallel.{name}={getattr(self, name)} must be >= 0")
        _positive(e, "parallel", "zero_bucket_mb", self.zero_bucket_mb)
        _positive(e, "parallel", "timeout_s", self.timeout_s)
        _choice(e, "parallel", "pp_schedule", self.pp_schedule,
                ("gpipe", "1f1b", "interleaved_1f1b", "zbh1", "dualpipe", "dualpipev"))
        _choice(e, "parallel", "expert_dispatch", self.expert_dispatch, ("flat", "hierarchical"))
        return e


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision; master weights, gradients and Adam states are always held by the optimizer."""

    recipe: str = f("fp32", "fp32 | bf16 | fp8 (fp8 GEMMs in the one Linear, bf16 elsewhere)")
    fp8_scaling: str = f("blockwise", "fp8 flavour: blockwise (DeepSeek 1x128 / 128x128) | tensorwise | delayed")
    fp8_backend: str = f("auto", "fp8 GEMMs: auto (te, else torch._scaled_mm, where they run) | te | scaled_mm | emulate")
    adam_moments: str = f("fp32", "dtype of Adam moments: fp32 | bf16 (DeepSeek-V3 keeps them in bf16)")

    @property
    def compute_dtype(self):
        import torch

        return torch.float32 if self.recipe == "fp32" else torch.bfloat16

    def errors(self) -> list[str]:
        e = []
        _choice(e, "precision", "recipe", self.recipe, ("fp32", "bf16", "fp8"))
        _choice(e, "precision", "fp8_scaling", self.fp8_scaling, ("blockwise", "tensorwise", "delayed"))
        _choice(e, "precision", "fp8_backend", self.fp8_backend, ("auto", "emulate", "scaled_mm", "te"))
        _choice(e, "precision", "adam_moments", self.adam_moments, ("fp32", "bf16"))
        return e


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation (trade compute for activation memory)."""

    policy: str = f("none", "none | selective | full (whole block)")
    selective: list[str] = f(["norm", "swiglu"], "what `selective` recomputes: norm, swiglu, attention")

    def errors(self) -> list[str]:
        e = []
        _choice(e, "recompute", "policy", self.policy, ("none", "selective", "full"))
        for item in self.selective:
            _choice(e, "recompute", "selective", item, ("norm", "swiglu", "attention"))
        return e


@dataclass(frozen=True)
class TrainConfig:
    """Optimization loop."""

    steps: int = f(200, "optimizer steps")
    seed: int = f(0, "seeds init and data order; same seed -> same losses under any layout")
    lr: float = f(3e-3, "peak learning rate")
    min_lr_ratio: float = f(0.1, "final LR as a fraction of lr (cosine / wsd)")
    warmup_steps: int = f(20, "linear warmup steps")
    lr_schedule: str = f("cosine", "cosine | wsd (warmup-stable-decay) | constant")
    wsd_decay_fraction: float = f(0.2, "wsd: fraction of steps spent in the final decay")
    weight_decay: float = f(0.1, "AdamW decoupled weight decay (not applied to norms, biases, embeddings)")
    beta1: float = f(0.9, "AdamW beta1")
    beta2: float = f(0.95, "AdamW beta2")
    eps: float = f(1e-8, "AdamW epsilon")
    grad_clip: float = f(1.0, "global grad-norm clip; 0 = off")
    global_batch: int = f(16, "sequences per optimizer step, all data-parallel ranks together")
    micro_batch: int = f(8, "sequences per forward/backward on one data-parallel rank")
    seq_len: int = f(128, "tokens per sequence")
    output_dir: str = f("runs/debug", "metrics.jsonl, tb/, config.toml and checkpoints go here")
    log_interval: int = f(10, "console progress line every N steps (metrics.jsonl gets every step)")
    device: str = f("auto", "auto | cpu | cuda")
    threads: int = f(0, "torch CPU threads per process; 0 = torch's default")
    peak_tflops: float = f(0.0, "peak FLOP/s per device for MFU, in TFLOP/s; 0 = look up the GPU")
    max_nonfinite_steps: int = f(3, "skip up to N steps with a non-finite loss or grad norm, then stop")

    def errors(self) -> list[str]:
        e = []
        for name in ("steps", "global_batch", "micro_batch", "seq_len", "log_interval"):
            _positive(e, "train", name, getattr(self, name))
        _positive(e, "train", "lr", self.lr)
        for name in ("warmup_steps", "weight_decay", "grad_clip", "threads", "peak_tflops", "max_nonfinite_steps"):
            if getattr(self, name) < 0:
                e.append(f"train.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            e.append(f"train.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if not 0 < self.wsd_decay_fraction <= 1:
            e.append(f"train.wsd_decay_fraction={self.wsd_decay_fraction} must lie in (0, 1]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                e.append(f"train.{name}={getattr(self, name)} must lie in [0, 1)")
        _choice(e, "train", "lr_schedule", self.lr_schedule, ("cosine", "wsd", "constant"))
        _choice(e, "train", "device", self.device, ("auto", "cpu", "cuda"))
        if self.micro_batch > 0 and self.global_batch % self.micro_batch:
            e.append(f"train.micro_batch={self.micro_batch} must divide train.global_batch={self.global_batch}")
        return e


@dataclass(frozen=True)
class CheckpointConfig:
    """Distributed checkpoints (torch.distributed.checkpoint), committed atomically."""

    dir: str = f("", "checkpoint root; empty = <output_dir>/checkpoints")
    interval: int = f(0, "save every N steps (and at the end); 0 = never")
    resume: bool = f(False, "continue from the newest complete checkpoint in dir, if any")
    keep: int = f(3, "keep the newest K checkpoints; 0 = keep all")
    async_save: bool = f(False, "write checkpoints in the background (a snapshot is taken first)")

    def errors(self) -> list[str]:
        e = []
        for name in ("interval", "keep"):
            if getattr(self, name) < 0:
                e.append(f"checkpoint.{name}={getattr(self, name)} must be >= 0")
        return e


@dataclass(frozen=True)
class DataConfig:
    """Training data: real text, token files, synthetic long-context tasks, or a mixture."""

    source: str = f("stdlib", "stdlib (Python sources on this machine) | tokens (a token file) | synthetic")
    path: str = f("", "token-file prefix for source = tokens (see tools/prepare_data.py)")
    tokenizer: str = f("byte", "byte | path to a HuggingFace tokenizer.json")
    synthetic_tasks: list[str] = f(["passkey"], "kinds mixed in: passkey, multikey_needle, variable_tracking, associative_recall")
    synthetic_weight: float = f(0.0, "fraction of samples drawn from synthetic_tasks, mixed into source (< 1)")
    val_fraction: float = f(0.02, "fraction of stdlib files held out for validation")

    def errors(self) -> list[str]:
        e = []
        _choice(e, "data", "source", self.source, ("stdlib", "tokens", "synthetic"))
        if self.source == "tokens" and not self.path:
            e.append("data.path is empty: source = 'tokens' needs the token-file prefix")
        if not 0 <= self.synthetic_weight < 1:
            e.append(f"data.synthetic_weight={self.synthetic_weight} must lie in [0, 1) "
                     "(source = 'synthetic' trains on synthetic tasks only)")
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


# ---------------------------------------------------------------------------------------------
# validation helpers


def _positive(errors: list[str], section: str, name: str, value) -> None:
    if not value > 0:
        errors.append(f"{section}.{name}={value!r} must be > 0")


def _choice(errors: list[str], section: str, name: str, value, choices) -> None:
    if value not in choices:
        errors.append(f"{section}.{name}={value!r} must be one of {', '.join(map(repr, choices))}")


def _field_docs(cls) -> dict[str, str]:
    return {fl.name: fl.metadata.get("doc", "") for fl in dataclasses.fields(cls)}


def resolve_degrees(p: ParallelConfig, world_size: int | None) -> tuple[dict[str, int], list[str]]:
    """Degrees with dp = 0 resolved against the world; returns (degrees, errors)."""
    fixed = p.pp * p.cp * p.tp
    dp, e = p.dp, []
    if world_size is None:
        dp = dp or 1
        world_size = fixed * dp
    elif dp == 0:
        if fixed <= 0 or world_size % fixed:
            e.append(f"parallel.pp*cp*tp={fixed} must divide the world size {world_size} (dp = 0 takes the rest)")
        dp = max(world_size // max(fixed, 1), 1)
    elif fixed * dp != world_size:
        e.append(f"parallel.pp*dp*cp*tp={fixed * dp} must equal the world size {world_size} "
                 f"(pp={p.pp}, dp={dp}, cp={p.cp}, tp={p.tp}; set dp = 0 to take the rest)")
    rpn = p.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    degrees = dict(world=world_size, pp=p.pp, dp=dp, cp=p.cp, tp=p.tp, ep=p.ep, ranks_per_node=rpn)
    return degrees, e


def pipeline_stages(p: ParallelConfig) -> int:
    """Model stages of a pipeline layout (interleaved: pp_chunks per rank; DualPipeV: 2 per rank)."""
    if p.pp == 1:
        return 1
    return p.pp * {"interleaved_1f1b": p.pp_chunks, "dualpipev": 2}.get(p.pp_schedule, 1)


def cross_section_errors(cfg: Config, world_size: int | None = None) -> list[str]:
    """Rules that tie sections together (the one place for them). `world_size` None = the recipe's own."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    d, e = resolve_degrees(p, world_size)
    world, dp, rpn = d["world"], d["dp"], d["ranks_per_node"]
    if min(p.pp, p.cp, p.tp, p.ep, dp) <= 0:
        return e  # section errors already name the bad degree
    if rpn <= 0 or world % rpn and rpn % world:
        e.append(f"parallel.ranks_per_node={rpn} must divide the world size {world}")
    if (dp * p.cp * p.tp) % p.ep:
        e.append(f"parallel.ep={p.ep} must divide dp*cp*tp={dp * p.cp * p.tp} (experts are folded into those ranks)")
    moe = m.n_routed_experts > 0 and m.n_dense_layers < m.n_layers
    if moe and m.n_routed_experts % p.ep:
        e.append(f"parallel.ep={p.ep} must divide model.n_routed_experts={m.n_routed_experts}")
    if not moe and p.ep > 1:
        e.append(f"parallel.ep={p.ep} needs MoE layers (model has none)")
    if moe and p.ep > rpn:  # EP crosses nodes: each expert group must live inside one node
        if p.ep % rpn:
            e.append(f"parallel.ep={p.ep} must be a multiple of ranks_per_node={rpn} when it spans nodes")
        elif m.n_groups % (p.ep // rpn):
            e.append(f"model.n_groups={m.n_groups} must be a multiple of the {p.ep // rpn} nodes that "
                     f"parallel.ep={p.ep} spans (groups map to nodes for node-limited routing)")
    if p.tp > 1:
        if m.n_heads % p.tp:
            e.append(f"parallel.tp={p.tp} must divide model.n_heads={m.n_heads}")
        if m.attention == "gqa" and m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
            e.append(f"parallel.tp={p.tp} and model.n_kv_heads={m.n_kv_heads}: one must divide the other")
        for name in ("vocab_size", "ffn_dim") + (("moe_ffn_dim",) if moe else ()):
            if getattr(m, name) % p.tp:
                e.append(f"parallel.tp={p.tp} must divide model.{name}={getattr(m, name)}")
    seq_shards = p.tp * (2 * p.cp if p.cp > 1 else 1)
    if t.seq_len % seq_shards:
        e.append(f"train.seq_len={t.seq_len} must be divisible by {seq_shards} (tp * 2*cp: sequence shards)")
    per_step = t.micro_batch * dp
    if t.global_batch % per_step:
        e.append(f"train.global_batch={t.global_batch} must be divisible by micro_batch*dp={per_step} "
                 f"(micro_batch={t.micro_batch}, dp={dp})")
    elif p.microbatches and p.microbatches != t.global_batch // per_step:
        e.append(f"parallel.microbatches={p.microbatches} must equal global_batch/(micro_batch*dp)="
                 f"{t.global_batch // per_step} (or 0 to derive it)")
    stages = pipeline_stages(p)
    if p.pp > 1 and m.n_layers < stages:
        e.append(f"model.n_layers={m.n_layers} is fewer than the {stages} pipeline stages of "
                 f"parallel.pp={p.pp} with pp_schedule={p.pp_schedule!r}")
    if p.pp_stage_layers and (len(p.pp_stage_layers) != stages or sum(p.pp_stage_layers) != m.n_layers
                              or min(p.pp_stage_layers) < 1):
        e.append(f"parallel.pp_stage_layers={p.pp_stage_layers} must list {stages} positive block counts "
                 f"summing to model.n_layers={m.n_layers}")
    if m.mtp_depth and p.pp > 1 and p.pp_schedule not in ("dualpipe", "dualpipev"):
        e.append(f"model.mtp_depth={m.mtp_depth} with parallel.pp={p.pp} needs pp_schedule 'dualpipe' or "
                 f"'dualpipev' (the MTP modules share the embedding, which must sit on the last stage's rank)")
    if m.vocab_size < 259 and cfg.data.tokenizer == "byte":
        e.append(f"model.vocab_size={m.vocab_size} must be >= 259 for the byte tokenizer")
    if cfg.data.source == "synthetic" or cfg.data.synthetic_weight > 0:
        if t.seq_len < 64:
            e.append(f"train.seq_len={t.seq_len} must be >= 64 for synthetic long-context tasks")
    return e


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise ConfigError listing every violated rule (section rules, then cross-section rules)."""
    errors = [err for name in SECTIONS for err in getattr(cfg, name).errors()]
    errors += cross_section_errors(cfg, world_size)
    if errors:
        raise ConfigError(errors)
    return cfg


# ---------------------------------------------------------------------------------------------
# loading: TOML files with `extends`, then `--set` overrides, then typed dataclasses


def read_recipe(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict:
    """The recipe's raw tables with `extends` chains merged (base first, then this file)."""
    path = Path(path)
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ConfigError([f"extends cycle: {chain}"])
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"recipe file not found: {path}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: malformed TOML: {exc}"]) from None
    base = raw.pop("extends", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError([f"{path}: extends={base!r} must be a path string"])
    merged = read_recipe(path.parent / base, (*_seen, path.resolve()))
    return _deep_merge(merged, raw)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(raw: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """Apply `section.key=value` strings; values parse as TOML (bare words count as strings)."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    errors = []
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            errors.append(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. train.lr=1e-3")
            continue
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()  # a bare word such as `bf16` or `runs/x`
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            errors.append(f"--set {item!r}: {section!r} is not a section")
            continue
        raw[section][name] = value
    return raw, errors


def build_config(raw: dict) -> Config:
    """Typed, frozen Config from raw tables; unknown sections/keys and wrong types are errors."""
    errors, sections = [], {}
    for section, table in raw.items():
        if section not in SECTIONS:
            errors.append(f"unknown section [{section}]{_did_you_mean(section, SECTIONS)}")
        elif not isinstance(table, dict):
            errors.append(f"[{section}] must be a table, got {type(table).__name__}")
    for section, cls in SECTIONS.items():
        table = raw.get(section, {})
        if not isinstance(table, dict):
            continue
        hints = get_type_hints(cls)
        kwargs = {}
        for key, value in table.items():
            if key not in hints:
                errors.append(f"unknown key {section}.{key}{_did_you_mean(key, hints)}")
                continue
            ok, coerced = _coerce(value, hints[key])
            if ok:
                kwargs[key] = coerced
            else:
                errors.append(f"{section}.{key}={value!r} must be {_type_name(hints[key])}, got {type(value).__name__}")
        sections[section] = cls(**kwargs)
    if errors:
        raise ConfigError(errors)
    return Config(**sections)


def load_config(path: str | os.PathLike, overrides: list[str] = (), world_size: int | None = None,
                check: bool = True) -> Config:
    """Recipe file + overrides -> validated Config (ConfigError lists every problem)."""
    raw, errors = apply_overrides(read_recipe(path), list(overrides))
    if errors:
        raise ConfigError(errors)
    cfg = build_config(raw)
    return validate(cfg, world_size) if check else cfg


def _coerce(value, typ) -> tuple[bool, Any]:
    if typ is bool:
        return isinstance(value, bool), value
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if typ is str:
        return isinstance(value, str), value
    if get_origin(typ) is list:
        (item,) = get_args(typ)
        if isinstance(value, str):  # `--set data.synthetic_tasks=passkey,multikey_needle`
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            return False, value
        items = [_coerce(v, item) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    return False, value


def _type_name(typ) -> str:
    if get_origin(typ) is list:
        return f"a list of {_type_name(get_args(typ)[0])}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(typ, str(typ))


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------
# printing


def to_toml(cfg: Config, docs: bool = False) -> str:
    """The resolved recipe as TOML (written to every run directory; `--print-config` shows it)."""
    lines = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        doc = _field_docs(type(obj))
        lines.append(f"[{section}]")
        for fl in dataclasses.fields(obj):
            value = _toml_value(getattr(obj, fl.name))
            comment = f"  # {doc[fl.name]}" if docs and doc[fl.name] else ""
            lines.append(f"{fl.name} = {value}{comment}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)
