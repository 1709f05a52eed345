"""Recipe sections: one frozen dataclass per TOML table, a one-line doc per field, and the rules that
involve only that section (`errors()`; rules tying sections together are in `rules.py`).

The [model] table and its sub-tables are in `model_sections.py`; this file holds the run's sections
([parallel], [precision], [recompute], [train], [checkpoint], [data]) and the whole `Config`.
Choices are `Literal` types from `choices.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from moe_lc.config.choices import (
    AdamMoments, CpLayout, DataSource, Device, ExpertDispatch, Fp8Backend, Fp8CacheItem, Fp8Scaling, GradPlacement,
    Logger, LrSchedule, MixtureSource, MlaRing, MuonNs, MuonNsDtype, OffloadItem, Optimizer, OptimizerPlacement,
    ParamsPlacement, PPSchedule, PrecisionRecipe, RecomputeItem, RecomputePolicy, SyntheticTask,
)
from moe_lc.config.fields import f, non_negative, positive
from moe_lc.config.model_sections import DSAConfig, MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeConfig

__all__ = ["SECTIONS", "CheckpointConfig", "Config", "DataConfig", "DSAConfig", "MLAConfig", "ModelConfig", "MoEConfig", "MTPConfig",
           "ParallelConfig", "PrecisionConfig", "RecomputeConfig", "RopeConfig", "SourceConfig", "TrainConfig"]


# --------------------------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class PlacementConfig:
    """[parallel.placement]: where each training state lives beyond ZeRO-1's defaults (the placement table of
    tools/planner/placement_semantics.py: R replicated, S sharded over the parameter's data-parallel group)."""

    grads: GradPlacement = f("replicated", "replicated: ZeRO-1's full-size fp32 main-grad buffer, reduce-scattered "
                                           "once a step; sharded: ZeRO-2, each micro-batch's gradients "
                                           "reduce-scattered as backward fills a bucket, only this rank's 1/N kept")
    params: ParamsPlacement = f("replicated", "replicated: every rank holds its parameters whole (ZeRO-1, 2); "
                                              "sharded_gather: ZeRO-3, each rank keeps 1/N and a unit (embedding, "
                                              "block, head) is all-gathered before its forward and its backward, "
                                              "one unit ahead, freed after; gradients as grads = sharded")
    optimizer: OptimizerPlacement = f("device", "device: the fp32 master and the rule's state beside the parameters; "
                                                "offloaded: both in host memory, the update on the CPU bucket by "
                                                "bucket, overlapping the copies and the all-gather")
    optimizer_overlap: bool = f(True, "offloaded: each bucket's CPU update runs when the next forward first needs "
                                      "its parameters, overlapping the device's work on earlier units (same "
                                      "values); false = every update before the step returns")


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
    expert_dispatch: ExpertDispatch = f("flat", "flat, or hierarchical (cross each node once, then fan out inside it)")
    mla_ring: MlaRing = f("latent", "MLA's ring under cp moves the KV latent (up-projected on arrival) or expanded K, V")
    cp_a2a: int = f(1, "hybrid cp: a Ulysses all-to-all over this many consecutive cp ranks (heads split), the "
                       "zig-zag ring over cp / cp_a2a of them; 1 = the ring alone, cp = all-to-all alone")
    cp_layout: CpLayout = f("zigzag", "which 2 of the 2cp chunks a cp rank holds: zigzag (r, 2cp-1-r), balanced "
                                      "(data.document_mask: per micro-batch, heaviest chunk paired with lightest), or "
                                      "contiguous (2r, 2r+1: one span per rank; DeepSeek-V4 attention only)")
    zero_bucket_mb: float = f(32.0, "ZeRO-1 gradient reduce-scatter bucket size in MiB")
    placement: PlacementConfig = f(PlacementConfig(), "[parallel.placement]")
    timeout_s: float = f(600.0, "collective timeout in seconds")
    overlap: bool = f(True, "issue all-to-alls and pipeline transfers early and wait where their result is used "
                            "(DualPipe's F&B hides one micro-batch's all-to-all behind the other's compute); "
                            "false = wait at every issue (same numbers, for comparison)")
    link: str = f("", "modelled network 'LATENCY_US:GBPS' (e.g. '50:2'): every collective takes at least latency + "
                      "bytes / bandwidth once all its ranks issued it, so overlap shows on a CPU; two levels "
                      "'intra=LATENCY_US:GBPS,inter=LATENCY_US:GBPS': bytes to other nodes (ranks_per_node) take "
                      "inter's; '' = off")

    @property
    def link_model(self) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """((latency in s, bytes per s) inside a node, the same between nodes) of `link`, None when off;
        `errors` has vetted the text."""
        if not self.link:
            return None
        levels = dict(_link_levels(self.link))
        return levels.get("intra", levels.get("")), levels.get("inter", levels.get(""))

    def errors(self) -> list[str]:
        e = []
        if self.link:
            levels = _link_levels(self.link)
            ok = levels is not None and (sorted(k for k, _ in levels) in ([""], ["inter", "intra"]))
            if not ok:
                e.append(f"parallel.link={self.link!r} must be 'LATENCY_US:GBPS' with latency >= 0 and bandwidth "
                         "> 0 (e.g. '50:2': 50 us, 2 GB/s), 'intra=LATENCY_US:GBPS,inter=LATENCY_US:GBPS' (inside "
                         "a node, between nodes), or '' (off)")
        for name in ("pp", "cp", "cp_a2a", "tp", "ep", "pp_chunks", "zero_bucket_mb", "timeout_s"):
            positive(e, f"parallel.{name}", getattr(self, name))
        for name in ("dp", "ranks_per_node"):
            non_negative(e, f"parallel.{name}", getattr(self, name))
        if self.timeout_s > 10**8:
            e.append(f"parallel.timeout_s={self.timeout_s} must be <= 1e8 (about 3 years)")
        return e


def _link_levels(text: str) -> list[tuple[str, tuple[float, float]]] | None:
    """[(level name or "", (latency s, bytes per s))] of a parallel.link text, None when malformed."""
    out = []
    for part in text.split(","):
        name, _, spec = part.strip().rpartition("=")
        latency_us, sep, gbps = spec.partition(":")
        try:
            if not sep or not (float(latency_us) >= 0 and 0 < float(gbps) < float("inf")):
                return None
        except ValueError:
            return None
        out.append((name.strip(), (float(latency_us) * 1e-6, float(gbps) * 1e9)))
    return out


@dataclass(frozen=True)
class PrecisionConfig:
    """[precision]: compute precision; master weights, gradients and Adam states are the optimizer's (fp32)."""

    recipe: PrecisionRecipe = f("fp32", "fp8 = fp8 GEMMs in the one Linear, bf16 elsewhere")
    fp8_scaling: Fp8Scaling = f("blockwise", "fp8 flavour: blockwise is DeepSeek's 1x128 / 128x128")
    fp8_backend: Fp8Backend = f("auto", "fp8 GEMMs: auto = te, else torch._scaled_mm, where they run, else emulate")
    adam_moments: AdamMoments = f("fp32", "dtype of Adam moments (DeepSeek-V3 keeps them in bf16)")
    fp8_dispatch: bool = f(False, "tokens enter the experts FP8-rounded (1x128 tiles) and cross the EP all-to-all "
                                  "in FP8 (DeepSeek-V3); combine and gradients stay in the compute dtype")
    fp8_weight_cache: bool = f(True, "fp8: each FP8 weight quantized once per optimizer step and kept (1 byte an "
                                     "element + scales) instead of at every GEMM; the same numbers (not under "
                                     "delayed scaling or the te backend)")
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
    optimizer: Optimizer = f("adamw", "update rule on ZeRO-1's fp32 master shards (moe_lc/optim/); sgd reads "
                                      "sgd_momentum; muon (Moonlight's: Newton-Schulz on hidden matrices, AdamW "
                                      "with beta1/beta2/eps on the rest) reads muon_momentum")
    weight_decay: float = f(0.1, "decoupled weight decay of either rule (not applied to norms, biases, embeddings)")
    beta1: float = f(0.9, "adamw: beta1, the first moment's decay")
    beta2: float = f(0.95, "adamw: beta2, the second moment's decay")
    eps: float = f(1e-8, "adamw: epsilon added to the denominator")
    sgd_momentum: float = f(0.9, "sgd: heavy-ball momentum (torch.optim.SGD's, no dampening); 0 = plain SGD, no state")
    muon_momentum: float = f(0.95, "muon: Nesterov momentum of the hidden matrices (Moonlight's 0.95)")
    muon_exact_rms: bool = f(False, "muon: scale each orthogonalized update to exactly muon_update_rms x lr RMS "
                                    "(divide by its own RMS); false = Moonlight's rms sqrt(max(A, B)), which "
                                    "assumes an orthogonal output (Newton-Schulz's 5 steps leave 0.85-0.90 of it)")
    muon_ns: MuonNs = f("moonlight", "muon: Newton-Schulz iterations: 'moonlight' = 5 of (3.4445, -4.7750, 2.0315); "
                                     "'v4' = DeepSeek-V4's hybrid, 8 of those then 2 of (2, -1.5, 0.5), which land "
                                     "the singular values on 1")
    muon_update_rms: float = f(0.2, "muon: the update's RMS per unit lr, matched to AdamW's (Moonlight 0.2, "
                                    "DeepSeek-V4 0.18)")
    muon_ns_dtype: MuonNsDtype = f("auto", "muon: dtype of the Newton-Schulz matmuls; auto = bf16 on CUDA (as "
                                           "Muon's and Moonlight's code: fp32 is compute-bound there, 1.14 s per "
                                           "step for a 1.7B MoE on an H100) and fp32 elsewhere")
    qk_clip: float = f(0.0, "QK-clip (Kimi K2's MuonClip) threshold tau: after each step, heads whose max "
                            "attention logit (bounded by the max log-sum-exp) exceeded tau get their q / k "
                            "weights scaled down to reach tau; 0 = off; any optimizer")
    qk_clip_guard: bool = f(False, "with train.qk_clip: also hold tau inside every training forward, where a "
                                   "step's update carried a head past it (that sample's queries of the head "
                                   "scaled, the call run again): no logit over tau at the cost of a host read "
                                   "per attention call and a second pass where one hits")
    grad_clip: float = f(1.0, "global grad-norm clip; 0 = off")
    ema_decay: float = f(0.0, "EMA of the fp32 parameters, kept in CPU memory (each rank its ZeRO shard) and "
                              "updated after every step in the background (DeepSeek-V3 3.2.3); 0 = off")
    global_batch: int = f(16, "sequences per optimizer step, all data-parallel ranks together")
    micro_batch: int = f(8, "sequences per forward/backward on one data-parallel rank")
    seq_len: int = f(128, "tokens per sequence")
    output_dir: str = f("runs/debug", "metrics.jsonl, tb/, config.toml and checkpoints go here")
    log_interval: int = f(10, "console progress line every N steps (metrics.jsonl gets every step)")
    device: Device = f("auto", "auto = cuda where torch sees a GPU")
    threads: int = f(0, "torch CPU threads per process; 0 = auto: OMP_NUM_THREADS if set, else this process's idle "
                            "cores (moe_lc/cpu_threads.py); the start-up line says which and why")
    offload: list[OffloadItem] = f([], "activations kept in host memory from forward to backward "
                                       "(moe_lc/parallel/memory/offload.py): attn_core = what the attention core "
                                       "keeps; expert_fc1 = the routed experts' up-projection input; experts "
                                       "= everything the routed experts keep")
    compile: bool = f(False, "torch.compile the compute regions of each block and the loss head "
                             "(moe_lc/parallel/compile.py)")
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
        for name in ("steps", "global_batch", "micro_batch", "seq_len", "log_interval", "lr", "muon_update_rms"):
            positive(e, f"train.{name}", getattr(self, name))
        for name in ("warmup_steps", "weight_decay", "grad_clip", "threads", "peak_tflops", "max_nonfinite_steps",
                     "trace_step", "eps", "seed", "qk_clip"):
            non_negative(e, f"train.{name}", getattr(self, name))
        if self.qk_clip_guard and not self.qk_clip:
            e.append("train.qk_clip_guard holds train.qk_clip's tau in the forward: set train.qk_clip = tau too")
        if not 0 <= self.min_lr_ratio <= 1:
            e.append(f"train.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if not 0 < self.wsd_decay_fraction <= 1:
            e.append(f"train.wsd_decay_fraction={self.wsd_decay_fraction} must lie in (0, 1]")
        for name in ("beta1", "beta2", "ema_decay", "sgd_momentum", "muon_momentum"):
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


STDLIB_METADATA = ("path", "dir")  # what each stdlib document keeps (moe_lc/data/corpus.py)


@dataclass(frozen=True)
class SourceConfig:
    """One [[data.sources]] table: a corpus, its share of the samples, and how its documents are chosen
    and packed (moe_lc/data/document_select.py)."""

    name: str = f("", "name in the metrics and the mixture report; default: the path's last part, or 'stdlib'")
    source: MixtureSource = f("tokens", "tokens: token files at path; stdlib: this machine's Python sources")
    path: str = f("", "tokens: a token-file prefix (tools/prepare_data.py --out) or a glob of prefixes")
    weight: float = f(1.0, "share of the samples (weights are normalized over the sources)")
    concat_by: str = f("", "join the documents sharing this metadata field's value into one (ProLong's per-"
                            "repository code; stdlib documents keep 'path' and 'dir', their package)")
    min_doc_tokens: int = f(0, "keep documents (after joining) of at least this many tokens; 0 = all")
    max_doc_tokens: int = f(0, "keep documents of at most this many tokens; 0 = no bound")
    upsample_min_tokens: int = f(0, "documents of at least this many tokens are repeated upsample_factor times")
    upsample_factor: int = f(1, "copies of each long document per pass over the source (1 = none)")

    @property
    def label(self) -> str:
        """The name metrics use: `name`, else the path's last part, else 'stdlib'."""
        return self.name or ("stdlib" if self.source == "stdlib" else self.path.rstrip("/").rpartition("/")[2])

    def errors(self, where: str) -> list[str]:
        e = []
        if self.source == "tokens" and not self.path:
            e.append(f"{where}.path is empty: a tokens source needs a token-file prefix or glob")
        if self.source == "stdlib" and self.path:
            e.append(f"{where}.path={self.path!r} is set, but a stdlib source reads this machine's Python "
                     "sources (remove path, or set source = 'tokens')")
        if self.source == "stdlib" and self.concat_by and self.concat_by not in STDLIB_METADATA:
            e.append(f"{where}.concat_by={self.concat_by!r}: stdlib documents keep only {', '.join(STDLIB_METADATA)}")
        if not self.weight > 0:
            e.append(f"{where}.weight={self.weight} must be > 0 (leave the table out to draw nothing from it)")
        for name in ("min_doc_tokens", "max_doc_tokens", "upsample_min_tokens"):
            non_negative(e, f"{where}.{name}", getattr(self, name))
        if self.max_doc_tokens and self.max_doc_tokens < self.min_doc_tokens:
            e.append(f"{where}.max_doc_tokens={self.max_doc_tokens} is below min_doc_tokens={self.min_doc_tokens}")
        positive(e, f"{where}.upsample_factor", self.upsample_factor)
        if self.upsample_factor > 1 and self.upsample_min_tokens == 0:
            e.append(f"{where}.upsample_factor={self.upsample_factor} repeats every document (upsample_min_tokens "
                     "= 0), which changes nothing: set upsample_min_tokens to the length that counts as long")
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
    document_mask: bool = f(False, "attention stays inside each packed document (exact under CP; no padding)")
    document_positions: bool = f(False, "RoPE positions restart at 0 at each packed document")
    sources: list[SourceConfig] = f([], "a mixture: one [[data.sources]] table per corpus (name, source, path, "
                                        "weight, concat_by, min_doc_tokens, max_doc_tokens, upsample_min_tokens, "
                                        "upsample_factor); replaces source/path; synthetic_weight mixes on top")

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
        if self.sources and (self.source != "stdlib" or self.path):
            e.append(f"data.sources lists the corpora: data.source={self.source!r} and data.path={self.path!r} "
                     "describe a single one (leave them out with [[data.sources]])")
        labels: dict[str, int] = {}
        for k, src in enumerate(self.sources):
            e += src.errors(f"data.sources[{k}]")
            if src.label in labels:
                e.append(f"data.sources[{labels[src.label]}] and data.sources[{k}] are both named {src.label!r}: "
                         "give each a distinct name")
            labels.setdefault(src.label, k)
        if self.sources and self.synthetic_weight > 0 and "synthetic" in labels:
            e.append("a data.sources entry is named 'synthetic', the name of the synthetic tasks' share: rename it")
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
