"""Every rule a recipe must satisfy, in one place, checked by `load_config` against the world size
before any process group or model exists. Section-local rules live on the section dataclasses
(`errors()`); this file adds the choice checks and the rules that tie sections together. Code that
applies a layout later (parallel/, pipeline/) asserts what is checked here instead of re-checking.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Literal, get_args, get_origin, get_type_hints

from moe_lc.config.attention_kinds import ATTENTION_KINDS, attention_kind, dsa_warnings
from moe_lc.config.choices import AttentionKind, names
from moe_lc.config.sections import SECTIONS, Config, DataConfig, ParallelConfig, TrainConfig


class ConfigError(ValueError):
    """A recipe that cannot run. `errors` holds every violated rule, one line each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        n = len(self.errors)
        head = f"invalid recipe ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n  - ".join([head, *self.errors]))


def choice_errors(obj, path: str) -> list[str]:
    """Literal-typed fields (and lists of them) whose value is not among the choices, recursively."""
    e = []
    hints = get_type_hints(type(obj))
    for fl in dataclasses.fields(obj):
        value, typ = getattr(obj, fl.name), hints[fl.name]
        if dataclasses.is_dataclass(value):
            e += choice_errors(value, f"{path}.{fl.name}")
            continue
        if isinstance(value, list) and value and all(dataclasses.is_dataclass(v) for v in value):  # [[tables]]
            e += [msg for k, v in enumerate(value) for msg in choice_errors(v, f"{path}.{fl.name}[{k}]")]
            continue
        item_type, items = (get_args(typ)[0], value) if get_origin(typ) is list else (typ, [value])
        if get_origin(item_type) is Literal:
            allowed = get_args(item_type)
            e += [f"{path}.{fl.name}={v!r} must be one of {', '.join(map(repr, allowed))}"
                  for v in items if v not in allowed]
    return e


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


DEGREES_RULE = "parallel degrees must be >= 1 (pp, cp, cp_a2a, tp, ep; dp >= 0)"


def layout_errors(p: ParallelConfig, world_size: int | None) -> tuple[dict[str, int], list[str]]:
    """(degrees, errors) of the mesh alone: world, ep folding, nodes. ParallelDims builds on this."""
    d, e = resolve_degrees(p, world_size)
    if min(p.pp, p.cp, p.cp_a2a, p.tp, p.ep, d["dp"]) <= 0:  # the rules below divide by them
        return d, e + [DEGREES_RULE]
    world, rpn = d["world"], d["ranks_per_node"]
    if rpn <= 0 or world % rpn and rpn % world:
        e.append(f"parallel.ranks_per_node={rpn} must divide the world size {world}")
    if (d["dp"] * p.cp * p.tp) % p.ep:
        e.append(f"parallel.ep={p.ep} must divide dp*cp*tp={d['dp'] * p.cp * p.tp} (experts are folded into those ranks)")
    if p.cp % p.cp_a2a:
        e.append(f"parallel.cp_a2a={p.cp_a2a} must divide parallel.cp={p.cp} (all-to-all groups of consecutive "
                 "cp ranks)")
    return d, e


def pipeline_stages(p: ParallelConfig) -> int:
    """Model stages of a pipeline layout (interleaved: pp_chunks per rank; DualPipeV: 2 per rank)."""
    if p.pp == 1:
        return 1
    return p.pp * {"interleaved_1f1b": p.pp_chunks, "dualpipev": 2}.get(p.pp_schedule, 1)


def schedule_shape_errors(name: str, pp: int, m: int, v: int | None = None) -> list[str]:
    """What the pipeline schedule `name` needs of pp ranks, m micro-batches and v chunks per rank (the
    schedule builders in parallel/pipeline raise these too, for direct callers such as the simulator)."""
    if pp < 1 or m < 1:
        return [f"{name} needs pp >= 1 and microbatches >= 1, got pp={pp}, microbatches={m}"]
    if name == "interleaved_1f1b":
        if v is None or v < 2:
            return [f"interleaved_1f1b needs v >= 2 chunks per rank, got v={v} (v=1 is '1f1b')"]
        return [] if m % pp == 0 else [f"interleaved_1f1b needs microbatches divisible by pp, got microbatches={m}, "
                                       f"pp={pp}"]
    if v is not None and v != 1:
        return [f"v={v} chunks per rank only applies to interleaved_1f1b, not {name}"]
    if name == "dualpipe" and (pp < 2 or pp % 2 or m % 2):
        return [f"dualpipe needs pp even and microbatches even, got pp={pp}, microbatches={m}"]
    if name in ("dualpipe", "dualpipev") and m < 2 * pp:
        return [f"{name} needs microbatches >= 2*pp, got microbatches={m}, pp={pp}"]
    return []


def _expert_rules(cfg: Config, d: dict) -> list[str]:
    m, p, e = cfg.model, cfg.parallel, []
    E, rpn = m.moe.n_routed_experts, d["ranks_per_node"]
    if m.has_moe and E % p.ep:
        e.append(f"parallel.ep={p.ep} must divide model.moe.n_routed_experts={E}")
    if not m.has_moe and p.ep > 1:
        e.append(f"parallel.ep={p.ep} needs MoE layers (model has none)")
    if m.has_moe and p.ep > rpn > 0:  # EP crosses nodes: each expert group must live inside one node
        if p.ep % rpn:
            e.append(f"parallel.ep={p.ep} must be a multiple of ranks_per_node={rpn} when it spans nodes")
        elif m.moe.n_groups % (p.ep // rpn):
            e.append(f"model.moe.n_groups={m.moe.n_groups} must be a multiple of the {p.ep // rpn} nodes that "
                     f"parallel.ep={p.ep} spans (groups map to nodes for node-limited routing)")
    r = cfg.recompute
    if r.policy == "selective" and m.attention in names(AttentionKind):
        e += _up_item_errors(r.selective, m)
    if cfg.precision.fp8_dispatch and p.expert_dispatch != "flat":
        e.append(f"precision.fp8_dispatch with parallel.expert_dispatch={p.expert_dispatch!r} is not built: FP8 "
                 "tokens cross the flat dispatcher's all-to-all only")
    if m.moe.weighted_swiglu and p.expert_dispatch != "flat":
        e.append(f"model.moe.weighted_swiglu with parallel.expert_dispatch={p.expert_dispatch!r} is not built: the "
                 "gate weights travel with the rows through the flat dispatcher only")
    if cfg.train.offload and r.policy == "full":
        e.append(f"train.offload={cfg.train.offload} with recompute.policy='full': full recomputation keeps only each "
                 "block's input, so there is nothing to offload")
    if "attn_core" in cfg.train.offload and r.policy == "selective" and "attention" in r.selective:
        e.append("train.offload item 'attn_core' with recompute.selective item 'attention': the core is replayed in "
                 "backward, so it keeps nothing to offload; choose one")
    if "experts" in cfg.train.offload and ((r.policy == "selective" and "swiglu" in r.selective)
                                           or "swiglu" in cfg.precision.fp8_cache):
        e.append("train.offload item 'experts' with the SwiGLU replayed or cached (recompute.selective 'swiglu', "
                 "precision.fp8_cache 'swiglu'): that replay keeps gate|up on the device, so the host copy frees "
                 "nothing (measured on an H100: 1.03 GiB copied, 0 freed at 32K); offload 'expert_fc1' instead")
    if cfg.train.offload and cfg.train.compile:
        e.append("train.offload with train.compile is not built: the offload hooks wrap eager modules")
    if p.placement.params == "sharded_gather" and cfg.train.compile:
        e.append("parallel.placement.params = 'sharded_gather' with train.compile is not built: compiled regions are "
                 "traced on parameters whose storage ZeRO-3 frees and reallocates between uses")
    if cfg.train.offload and not m.has_moe and set(cfg.train.offload) - {"attn_core"}:
        e.append(f"train.offload items {sorted(set(cfg.train.offload) - {'attn_core'})} need MoE layers (model has none)")
    if cfg.precision.fp8_cache and r.policy == "full":
        e.append(f"precision.fp8_cache={cfg.precision.fp8_cache} with recompute.policy='full': full recomputation "
                 "keeps only each block's input, so there is nothing to cache")
    if cfg.precision.fp8_dispatch and not m.has_moe:
        e.append("precision.fp8_dispatch needs MoE layers (model has none)")
    if m.has_moe and m.moe.capacity_factor > 0 and p.expert_dispatch != "flat":
        e.append(f"model.moe.capacity_factor={m.moe.capacity_factor} with parallel.expert_dispatch="
                 f"{p.expert_dispatch!r} is not built: dropped copies are left out of the flat dispatcher only")
    if m.has_moe and m.moe.global_aux_loss_weight > 0 and p.pp > 1 and p.pp_schedule == "dualpipe":
        e.append(f"model.moe.global_aux_loss_weight={m.moe.global_aux_loss_weight} with parallel.pp_schedule="
                 "'dualpipe' is not built: its mirror ranks run a stage's micro-batches at other times, and the "
                 "counts are summed over the ranks routing the same micro-batch in step")
    return e


def _up_item_errors(selective: list[str], m) -> list[str]:
    """A selective-recompute item that replays some attention kind's up-projections ("mla_up") needs that kind."""
    owners = {k.up_item: k for k in ATTENTION_KINDS.values() if k.up_item is not None and k.variant is None}
    mine = attention_kind(m).up_item
    return [f"recompute.selective item {item!r} recomputes {owners[item].label}'s up-projections; "
            f"model.attention={m.attention!r}" for item in selective if item in owners and item != mine]


def tensor_parallel_errors(cfg: Config) -> list[str]:
    """What TP (with sequence parallelism) cannot split."""
    m, tp, e = cfg.model, cfg.parallel.tp, []
    if tp == 1:
        return e
    if m.n_heads % tp:
        e.append(f"parallel.tp={tp} must divide model.n_heads={m.n_heads}")
    if m.attention in names(AttentionKind):  # else the choice rule names it
        e += attention_kind(m).tp_errors(m, tp)
    sizes = [("model.vocab_size", m.vocab_size), ("model.ffn_dim", m.ffn_dim)]
    sizes += [("model.moe.ffn_dim", m.moe.ffn_dim)] if m.has_moe else []
    if m.has_moe and m.moe.shared_ffn_dim:
        sizes.append(("model.moe.shared_ffn_dim", m.moe.shared_ffn_dim))
    e += [f"parallel.tp={tp} must divide {name}={value}" for name, value in sizes if value % tp]
    return e


def hybrid_cp_errors(cfg: Config) -> list[str]:
    """What the all-to-all of hybrid context parallelism (parallel.cp_a2a > 1, parallel/cp/ulysses.py) cannot
    split: the tp-local query heads among the A ranks (GQA's kv heads are repeated when fewer), what the
    attention kind says (`cp_a2a_errors`: DSA's sparse ring), and a per-micro-batch chunk placement."""
    m, p, e = cfg.model, cfg.parallel, []
    A = p.cp_a2a
    if A <= 1 or p.cp % A or m.n_heads % p.tp:
        return e  # the layout and tp rules name those
    if (m.n_heads // p.tp) % A:
        e.append(f"parallel.cp_a2a={A} must divide the query heads per tp rank, model.n_heads / parallel.tp = "
                 f"{m.n_heads} / {p.tp} = {m.n_heads // p.tp} (the all-to-all splits heads)")
    kind = attention_kind(m) if m.attention in names(AttentionKind) else None  # else the choice rule names it
    if kind is not None and kind.cp_a2a_errors is not None:  # DSA's sparse ring moves the latent
        e += kind.cp_a2a_errors(m, A)
    if p.cp_layout != "zigzag":
        e.append(f"parallel.cp_layout={p.cp_layout!r} with parallel.cp_a2a={A} is not built: the hybrid placement "
                 "is fixed (parallel/cp/ulysses.py)")
    return e


def _batch_and_pipeline_rules(cfg: Config, d: dict) -> list[str]:
    m, p, t, e = cfg.model, cfg.parallel, cfg.train, []
    seq_shards = p.tp * (2 * p.cp if p.cp > 1 else 1)
    if t.seq_len % seq_shards:
        e.append(f"train.seq_len={t.seq_len} must be divisible by {seq_shards} (tp * 2*cp: sequence shards)")
    per_step = t.micro_batch * d["dp"]
    n_micro = t.microbatches(d["dp"]) if per_step > 0 else 0
    if per_step > 0 and t.global_batch % per_step:
        e.append(f"train.global_batch={t.global_batch} must be divisible by micro_batch*dp={per_step} "
                 f"(micro_batch={t.micro_batch}, dp={d['dp']})")
    if p.pp > 1 and per_step > 0 and t.global_batch % per_step == 0:
        chunks = p.pp_chunks if p.pp_schedule == "interleaved_1f1b" else None
        e += [f"parallel.pp_schedule={p.pp_schedule!r} with pp={p.pp} and {n_micro} micro-batches: "
              f"{err}" for err in schedule_shape_errors(p.pp_schedule, p.pp, n_micro, chunks)]
    stages = pipeline_stages(p)
    if p.pp > 1 and m.n_layers < stages:
        e.append(f"model.n_layers={m.n_layers} is fewer than the {stages} pipeline stages of "
                 f"parallel.pp={p.pp} with pp_schedule={p.pp_schedule!r}")
    if p.pp_stage_layers and (len(p.pp_stage_layers) != stages or sum(p.pp_stage_layers) != m.n_layers
                              or min(p.pp_stage_layers) < 1):
        e.append(f"parallel.pp_stage_layers={p.pp_stage_layers} must list {stages} positive block counts "
                 f"summing to model.n_layers={m.n_layers}")
    if m.mtp.depth and p.pp > 1 and p.pp_schedule not in ("dualpipe", "dualpipev"):
        e.append(f"model.mtp.depth={m.mtp.depth} with parallel.pp={p.pp} needs pp_schedule 'dualpipe' or "
                 f"'dualpipev' (the MTP modules share the embedding, which must sit on the last stage's rank)")
    return e


def cross_section_errors(cfg: Config, world_size: int | None = None) -> list[str]:
    """Rules that tie sections together. `world_size` None = the recipe's own."""
    d, e = layout_errors(cfg.parallel, world_size)
    if DEGREES_RULE in e:
        return e[:-1]  # the section rules already name the bad degree
    e += _expert_rules(cfg, d) + tensor_parallel_errors(cfg) + hybrid_cp_errors(cfg) + _batch_and_pipeline_rules(cfg, d)
    m, data, t = cfg.model, cfg.data, cfg.train
    if m.attention in names(AttentionKind) and attention_kind(m).run_errors is not None:  # V4: its cp spans, documents
        e += attention_kind(m).run_errors(m, cfg.parallel, data, t.seq_len)
    if m.attention in names(AttentionKind) and cfg.parallel.cp > 1 and \
            cfg.parallel.cp_layout not in attention_kind(m).cp_layouts:
        kind = attention_kind(m)
        e.append(f"parallel.cp_layout={cfg.parallel.cp_layout!r} with {kind.label} is not built: its context "
                 f"parallelism places the sequence as {' or '.join(map(repr, kind.cp_layouts))} (the zig-zag ring "
                 "assumes two chunks per rank)")
    if m.vocab_size < 259 and data.tokenizer == "byte":
        e.append(f"model.vocab_size={m.vocab_size} must be >= 259 for the byte tokenizer")
    if data.has_loss_mask and t.seq_len < 64:
        e.append(f"train.seq_len={t.seq_len} must be >= 64 for synthetic long-context tasks")
    if t.qk_clip and m.qk_norm != "none":
        e.append(f"train.qk_clip={t.qk_clip:g} scales query / key weights, which model.qk_norm={m.qk_norm!r} "
                 "normalizes away: use one or the other")
    if cfg.parallel.cp_layout == "balanced" and not data.document_mask:
        e.append("parallel.cp_layout = 'balanced' pairs chunks by their attention work inside packed documents: "
                 "it needs data.document_mask = true (zig-zag is already balanced without it)")
    return e


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise ConfigError listing every violated rule (choices, section rules, cross-section rules)."""
    errors = [err for name in SECTIONS for err in choice_errors(getattr(cfg, name), name)]
    errors += [err for name in SECTIONS for err in getattr(cfg, name).errors()]
    errors += cross_section_errors(cfg, world_size)
    if errors:
        raise ConfigError(errors)
    return cfg


def recipe_warnings(cfg: Config, given: set[str] = frozenset(), env=os.environ) -> list[str]:
    """Legal settings that are likely mistakes, one line each (the run goes on). `given`: the dotted keys
    the recipe and its --set overrides wrote, so a default (or a printed config repeating one) never warns;
    `env`: this process's environment (how it was launched)."""
    d, t, rope, w = cfg.data, cfg.train, cfg.model.rope, []
    if ("data.synthetic_tasks" in given and d.synthetic_tasks != DataConfig().synthetic_tasks
            and d.synthetic_weight == 0 and d.source != "synthetic"):
        w.append(f"data.synthetic_tasks={d.synthetic_tasks} is set, but data.synthetic_weight = 0 with "
                 f"data.source={d.source!r}: the tasks are never drawn (set synthetic_weight > 0)")
    reach = rope.original_seq_len * rope.factor
    if rope.scaling in ("yarn", "llama3") and t.seq_len > reach:
        name = "YaRN" if rope.scaling == "yarn" else "Llama 3 RoPE scaling"
        w.append(f"train.seq_len={t.seq_len} is beyond what {name} is scaled for: model.rope.original_seq_len x "
                 f"factor = {rope.original_seq_len} x {rope.factor:g} = {reach:g}; positions past it extrapolate "
                 f"(raise model.rope.factor to {t.seq_len / rope.original_seq_len:g})")
    if "precision.adam_moments" in given and cfg.precision.adam_moments != "fp32" and t.optimizer != "adamw":
        w.append(f"precision.adam_moments={cfg.precision.adam_moments!r} sets AdamW's moments; train.optimizer="
                 f"{t.optimizer!r} keeps its state in fp32")
    if "train.sgd_momentum" in given and t.sgd_momentum != TrainConfig().sgd_momentum and t.optimizer != "sgd":
        w.append(f"train.sgd_momentum={t.sgd_momentum:g} is set, but train.optimizer={t.optimizer!r} does not read it")
    if "train.muon_momentum" in given and t.muon_momentum != TrainConfig().muon_momentum and t.optimizer != "muon":
        w.append(f"train.muon_momentum={t.muon_momentum:g} is set, but train.optimizer={t.optimizer!r} does not read it")
    if "train.muon_ns_dtype" in given and t.muon_ns_dtype != "auto" and t.optimizer != "muon":
        w.append(f"train.muon_ns_dtype={t.muon_ns_dtype!r} is set, but train.optimizer={t.optimizer!r} does not read it")
    for key in ("muon_ns", "muon_update_rms"):
        if f"train.{key}" in given and getattr(t, key) != getattr(TrainConfig(), key) and t.optimizer != "muon":
            w.append(f"train.{key}={getattr(t, key)!r} is set, but train.optimizer={t.optimizer!r} does not read it")
    if "train.muon_exact_rms" in given and t.muon_exact_rms and t.optimizer != "muon":
        w.append(f"train.muon_exact_rms = true is set, but train.optimizer={t.optimizer!r} does not read it")
    if (cfg.parallel.placement.optimizer == "offloaded" and t.threads == 0 and t.device != "cpu"
            and _torchrun_one_thread(env)):
        w.append("parallel.placement.optimizer = 'offloaded' runs the update on this process's torch CPU threads, and "
                 "torchrun set OMP_NUM_THREADS=1 for it (one thread): set train.threads to the host cores each rank "
                 "may use")
    if ("parallel.placement.optimizer_overlap" in given and not cfg.parallel.placement.optimizer_overlap
            and cfg.parallel.placement.optimizer != "offloaded"):
        w.append("parallel.placement.optimizer_overlap = false is set, but parallel.placement.optimizer = 'device' "
                 "does not read it (it defers an offloaded optimizer's CPU updates into the next forward)")
    if t.warmup_steps > t.steps:
        w.append(f"train.warmup_steps={t.warmup_steps} exceeds train.steps={t.steps}: the run ends inside the "
                 f"warmup and never trains at train.lr={t.lr:g}")
    return w + _moe_warnings(cfg) + _document_warnings(d) + dsa_warnings(cfg, given) + _qk_clip_warnings(cfg)


def _torchrun_one_thread(env) -> bool:
    """torchrun started this process with OMP_NUM_THREADS=1 (it sets that where it starts several processes
    on a machine and the variable is unset): train.threads = 0 then takes 1 thread (moe_lc/cpu_threads.py),
    where one process started without torchrun takes its idle cores."""
    return "TORCHELASTIC_RUN_ID" in env and env.get("OMP_NUM_THREADS", "").strip() == "1"


def _qk_clip_warnings(cfg: Config) -> list[str]:
    """A tau that a fresh model's heads exceed already. QK-clip's statistic, a head's largest log-sum-exp
    (moe_lc/parallel/qk_clip.py), is ln(n) for a query attending evenly over n keys (logits near 0): every head
    is clipped from the first step, and the clip, scaling logits toward 0, keeps the statistic near ln(n)."""
    t = cfg.train
    if t.qk_clip <= 0 or cfg.model.attention not in names(AttentionKind):
        return []
    kind = attention_kind(cfg.model)  # the keys a query attends (DSA's sparse stage: its selection)
    n, bound = kind.attended_keys(cfg.model, t.seq_len) if kind.attended_keys is not None else (t.seq_len, "")
    if not 0 < t.qk_clip < math.log(n):
        return []
    keys = f"{n} keys" + (f" ({bound})" if n < t.seq_len else "")
    return [f"train.qk_clip={t.qk_clip:g} is below ln({n}) = {math.log(n):.2f}: QK-clip bounds a head's largest "
            f"logit by its largest log-sum-exp, which is {math.log(n):.2f} already for a query attending evenly "
            f"over its {keys}, so every head is clipped every step and its attention flattened toward uniform; "
            "set tau well above it (Kimi K2 trains with 100)"]


CAPACITY_DROP_WARN = 0.1  # warn when balanced routing already drops this share of the routed copies


def _moe_warnings(cfg: Config) -> list[str]:
    """Balancing knobs on a model without experts; a capacity so small that even perfectly balanced
    routing drops more than CAPACITY_DROP_WARN of the copies (the run's console shows the share dropped)."""
    m, moe = cfg.model, cfg.model.moe
    knobs = [f"{name}={getattr(moe, name):g}" for name in ("aux_loss_weight", "z_loss_weight", "global_aux_loss_weight",
                                                           "capacity_factor") if getattr(moe, name) > 0]
    if not m.has_moe:
        why = "n_routed_experts = 0" if moe.n_routed_experts <= 0 else f"n_dense_layers = n_layers = {m.n_layers}"
        return [f"model.moe.{', '.join(knobs)} set, but the model has no MoE layers (model.moe.{why}): "
                f"{'it does' if len(knobs) == 1 else 'they do'} nothing"] if knobs else []
    if moe.capacity_factor <= 0:
        return []
    p, t = cfg.parallel, cfg.train
    tokens = t.micro_batch * t.seq_len // max(p.cp * p.tp, 1)  # what one router call sees
    per_expert = tokens * moe.topk / moe.n_routed_experts  # each expert's copies under balanced routing
    capacity = math.ceil(moe.capacity_factor * per_expert)
    dropped = 1 - capacity / per_expert
    if dropped < CAPACITY_DROP_WARN:
        return []
    return [f"model.moe.capacity_factor={moe.capacity_factor:g} drops at least {dropped:.1%} of the routed copies "
            f"even with perfectly balanced routing: capacity ceil({moe.capacity_factor:g} x {tokens} tokens per router "
            f"call x topk {moe.topk} / {moe.n_routed_experts} experts) = {capacity} per expert, against the "
            f"{per_expert:g} each gets; 1.0-1.25 drops a few percent (0 = no capacity)"]


def _document_warnings(d: DataConfig) -> list[str]:
    """Document masking / positions over the synthetic source alone: every sample is one document."""
    keys = [k for k in ("document_mask", "document_positions") if getattr(d, k)]
    if not keys or d.source != "synthetic" or d.sources:
        return []
    return [f"data.{' and data.'.join(keys)} = true with data.source='synthetic': every synthetic sample is one "
            f"document, so {'it changes' if len(keys) == 1 else 'they change'} nothing (packed corpora hold many: "
            f"data.source tokens or stdlib, [[data.sources]])"]
