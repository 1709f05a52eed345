"""The attention registry: one table from an attention kind to everything that differs by kind.

Everything else asks this table (`attention_kind(model_cfg)`, or `kind_of_module(module)` where only a
built module is at hand) instead of comparing `model.attention` (tests/test_attention_kinds.py scans the
package, tools/ and eval/ for such comparisons). An entry names, per layer of the package:

    config    head dims (qk, v, rope) per head, the kind's [model] rules, its tensor-parallel rules,
              the selective-recompute item it owns ("mla_up")                       callables, here
    model     its module class, parameter counts, what its backward surely keeps
              (model/memory_floor.py), its decode cache (model/decode.py)           "module:name"
    parallel  its tensor-parallel rule (and the process groups that rule needs), the
              core and `attend` seams on one device and on each context-parallel ring,
              under recomputation (parallel/layer_plan.py)                          "module:name"
              QK-clip's rescaling of its query / key rows (parallel/qk_clip.py)     "module:name" (a model piece)
    convert   its Hugging Face weight pieces and the transformers family of a config  "module:name"
    training  (optional) a stage's learning-rate scales per parameter and frozen router
              biases, the tensors it adds to an init_from checkpoint, its per-step
              metrics and their all-reduces (the trainer, job/preflight.py, the planner) "module:name"

The table sits in config, the leaf every layer may import, because the recipe's rules and the config's
head dims read it too. Pieces of higher layers are "package.module:name" strings, so that importing this
file imports nothing else; the layer that reads a field resolves it with `load` when it needs it, and a
field's references only ever point at or below the layer that reads it (the model resolves model pieces,
parallel parallel or model pieces, convert convert pieces: the import arrows keep pointing one way;
tests/test_attention_kinds.py resolves every reference and checks its layer). This is Megatron-Core's
`ModuleSpec` (megatron/core/transformer/spec_utils.py) cut to what differs between kinds here.

Adding a kind: its module in one new file of moe_lc/model/ (the module class with the attributes the
layer plan sets: `core`, `replay`, `out_proj`, `wo`, and `attend` where it has one; its counts and
decode cache beside it), plus one entry below. A kind that needs its own tensor-parallel rule, ring or
HF names writes them in parallel/ and convert/ (the model never imports parallel) and names them in its
entry; so does one whose training differs (a stage that freezes parameters, adds tensors, logs metrics:
DSA's in model/dsa.py and parallel/dsa_plan.py); nothing else changes. A variant of a kind (DeepSeek
Sparse Attention: `model.attention = "mla"` with `[model.dsa] enabled = true`) is an entry with the same
`attention` and a `variant` test on the config; its module may subclass the base kind's, and its entry
may reuse the base's pieces (`dataclasses.replace(ATTENTION_KINDS["mla"], ...)`). A kind whose blocks differ
(DeepSeek-V4's layer types) names a `build` (m, layer_id) and counts per layer (`per_layer`); one that keeps its
own RoPE tables names the model's `positions` module (V4: the blocks hand it positions in place of cos / sin).
Initialization (model/init.py) goes by parameter name and module type (a module's `init_ones` / `init_zeros`).
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, replace
from typing import Callable


def load(ref: str):
    """The object "package.module:name" names, importing its module now. Call it only from a layer at or
    above the reference's (module docstring)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class CoreSeams:
    """What the layer plan plugs into a kind's module on one device, or on one context-parallel ring."""

    core: str | None = None       # the core class under cp, built as (cp group, backend); None: LocalAttention stays
    attend: str | None = None     # the module's `attend` seam; None: the module has no such seam
    attend_up: str | None = None  # the `attend` seam under the kind's selective `up_item`
    context: str | None = None    # the module's `context` seam under cp, built as (cp group, parallel.cp_layout);
    #                               None: the module has none (DeepSeek-V4's: its halo rows and gathered entries)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention kind (module docstring). `m` below is the [model] section (ModelConfig)."""

    name: str
    label: str                    # how messages name it
    attention: str                # the model.attention value it is configured under
    variant: Callable | None      # m -> bool: this variant of `attention`'s base kind is on; None for a base kind
    # config (this layer)
    head_dims: Callable           # m -> (query/key, value, rotated) dims per head
    errors: Callable              # m -> its [model] rules, one line each
    tp_errors: Callable           # (m, tp) -> what tensor parallelism cannot split
    up_item: str | None           # its selective-recompute item replaying its up-projections (RecomputeItem)
    # model ("module:name")
    module: str                   # the nn.Module class: cfg -> x (B, S, D) -> (B, S, D)
    params: str                   # m -> parameters of one module
    vector_params: str            # m -> those no matmul reads (norm weights, biases)
    saved_bytes: str              # (m, c, cp) -> bytes per token its backward surely keeps besides wo's input
    decode: str                   # its cache: shapes, prefill, step (model/decode.py `decoder`)
    # parallel ("module:name")
    tp_rule: str                  # (module, tp) -> its parameters, placed (parallel/tp/plan.py)
    tp_groups: str | None         # (m, dims) -> None: process groups its TP rule uses, made on every rank up front
    local: CoreSeams              # one device (cp = 1)
    ring: CoreSeams               # under cp
    expanded_ring: CoreSeams | None  # under cp with parallel.mla_ring = "expanded", where `ring` moves something else
    # convert ("module:name")
    hf_pieces: str                # (m, ours, theirs, interleaved) -> its weight pieces (convert/hf_names.py)
    hf_family: str                # m -> the transformers family computing exactly this model (convert/hf_config.py)
    # optional ("module:name")
    core_flops: str | None = None  # (m, seq_len) -> forward FLOPs per token of its attention core; None: causal
    #                                dense attention over S/2 keys (model/counting.py)
    qk_clip_rows: str | None = None  # (module, gamma (H,)) -> {parameter: factor per row}: QK-clip's rescaling
    #                                  (moe_lc/parallel/qk_clip.py); None: train.qk_clip is refused for the kind
    extra_plan: str | None = None  # (module, dims or None, plan, aux_loss_scale, selective recompute items) ->
    #                                decisions only this kind has, on every layout (parallel/layer_plan.py)
    # optional config (this layer; None: no such rule)
    attended_keys: Callable | None = None  # (m, seq_len) -> (keys a query attends at most, what bounds them, "" for
    #                                        the sequence), where fewer than seq_len (rules: QK-clip's tau warning)
    cp_a2a_errors: Callable | None = None  # (m, cp_a2a) -> what hybrid context parallelism cannot split (rules)
    # optional training ("module:name"; None: the neutral default, every parameter trains at train.lr and the run
    # adds nothing): what a kind's training stage changes in the trainer, its preflight and the planner
    lr_scales: str | None = None   # (m, lr) -> (parameter name -> its learning-rate scale; 0 freezes), or None
    #                                (parallel/parallelize.py `param_lr_scale`: the optimizer's, the planner's groups)
    routers_frozen: str | None = None  # m -> True: the MoE routers' load-balancing biases stay (the trainer)
    fresh_params: str | None = None  # m -> a part of the names of the tensors the run adds and initializes, which a
    #                                  checkpoint.init_from may lack (job/preflight.py), or None
    step_metrics: str | None = None  # (m, step's ForwardStats, dims, device) -> {metric: value}: the kind's own
    #                                  metrics of each step (the trainer), reduced over the mesh
    step_reductions: tuple[tuple[str, int, str], ...] = ()  # (mesh group, bytes, what): the all-reduces
    #                                  `step_metrics` issues each step (tools/planner/layout.py's trainer traffic)
    # optional model pieces of a kind whose layers differ, or whose module reads positions, not RoPE tables
    build: str | None = None       # (m, layer_id) -> the module of block layer_id; None: module(m) for every block
    per_layer: bool = False        # params, vector_params, core_flops and saved_bytes take a trailing layer_id
    positions: str | None = None   # m -> the model's `rope`: positions -> the pair every block hands the module in
    #                                place of (cos, sin); None: RotaryEmbedding of [model.rope] (model/transformer.py)
    run_errors: Callable | None = None  # (m, parallel, data, seq_len) -> layouts and data it does not run with
    cp_layouts: tuple[str, ...] = ("zigzag", "balanced")  # the parallel.cp_layout values its cp builds (rules)

    def new_module(self, m, layer_id: int):
        """Block `layer_id`'s attention module (call from the model layer or above: it imports the module)."""
        return load(self.build)(m, layer_id) if self.build is not None else load(self.module)(m)

    def seams(self, cp: int, mla_ring: str = "latent") -> CoreSeams:
        """The seams for context-parallel degree `cp` and `parallel.mla_ring`."""
        if cp == 1:
            return self.local
        return self.expanded_ring if mla_ring == "expanded" and self.expanded_ring is not None else self.ring


# ------------------------------------------------------------------------------------- GQA's config side


def _gqa_head_dims(m) -> tuple[int, int, int]:
    return m.head_size, m.head_size, int(m.head_size * m.rope.partial_rotary_factor)  # transformers' int(...)


def _gqa_errors(m) -> list[str]:
    e = []
    if m.dsa.enabled:
        e.append("model.dsa.enabled = true needs model.attention = 'mla' (the indexer's queries come from MLA's "
                 "query latent)")
    if m.n_heads <= 0 or m.n_kv_heads <= 0 or m.dim <= 0:
        return e  # the positivity rules name them
    if m.n_heads % m.n_kv_heads:
        e.append(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if m.head_dim < 0:
        e.append(f"model.head_dim={m.head_dim} must be >= 0 (0 = dim // n_heads)")
    elif m.head_dim == 0 and m.dim % m.n_heads:
        e.append(f"model.n_heads={m.n_heads} must divide model.dim={m.dim} when head_dim = 0")
    elif m.head_size % 2:
        e.append(f"model head size {m.head_size} must be even for RoPE")
    elif 0 < m.rope.partial_rotary_factor <= 1 and (m.rope_dim < 2 or m.rope_dim % 2):
        e.append(f"model.rope.partial_rotary_factor={m.rope.partial_rotary_factor} rotates "
                 f"int({m.head_size} * {m.rope.partial_rotary_factor}) = {m.rope_dim} dims per head: "
                 "must be even and >= 2")
    return e


def _gqa_tp_errors(m, tp: int) -> list[str]:
    if m.n_kv_heads > 0 and m.n_kv_heads % tp and tp % m.n_kv_heads:
        return [f"parallel.tp={tp} and model.n_kv_heads={m.n_kv_heads}: one must divide the other"]
    return []


# ------------------------------------------------------------------------------------- MLA's config side


def _mla_head_dims(m) -> tuple[int, int, int]:
    a = m.mla
    return a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim, a.qk_rope_head_dim


def _mla_errors(m) -> list[str]:
    """[model.mla]'s own rules, and the GQA-only fields refused."""
    e = m.mla.errors()
    if m.qkv_bias:
        e.append("model.qkv_bias = true needs model.attention = 'gqa' (MLA has no q/k/v projections)")
    if m.attn_out_bias:
        e.append("model.attn_out_bias = true needs model.attention = 'gqa' (not built for MLA's wo)")
    if m.qk_norm != "none":
        e.append(f"model.qk_norm={m.qk_norm!r} needs model.attention = 'gqa' (MLA normalizes its latents)")
    if m.rope.partial_rotary_factor != 1.0:
        e.append(f"model.rope.partial_rotary_factor={m.rope.partial_rotary_factor} needs model.attention = "
                 "'gqa' (MLA sets its rotated dims with mla.qk_rope_head_dim)")
    return e


def _no_tp_errors(m, tp: int) -> list[str]:
    return []  # heads split like GQA's (parallel.tp divides model.n_heads, a rule for every kind)


# ------------------------------------------------------------------------------------- the table

_RING = "moe_lc.parallel.cp.ring:RingAttention"
_MLA_LOCAL = CoreSeams(attend="moe_lc.model.mla:attend", attend_up="moe_lc.model.recompute:mla_up_replayed")

ATTENTION_KINDS: dict[str, AttentionSpec] = {
    "gqa": AttentionSpec(
        name="gqa", label="GQA", attention="gqa", variant=None,
        head_dims=_gqa_head_dims, errors=_gqa_errors, tp_errors=_gqa_tp_errors, up_item=None,
        module="moe_lc.model.attention:Attention", params="moe_lc.model.attention:gqa_params",
        vector_params="moe_lc.model.attention:gqa_vector_params",
        saved_bytes="moe_lc.model.attention:gqa_saved_bytes", decode="moe_lc.model.attention:GQADecode",
        tp_rule="moe_lc.parallel.tp.plan:gqa_rule", tp_groups="moe_lc.parallel.tp.plan:gqa_kv_groups",
        local=CoreSeams(), ring=CoreSeams(core=_RING), expanded_ring=None,
        hf_pieces="moe_lc.convert.hf_names:gqa_pieces", hf_family="moe_lc.convert.hf_config:gqa_family",
        qk_clip_rows="moe_lc.model.attention:gqa_qk_clip_rows"),
    "mla": AttentionSpec(
        name="mla", label="MLA", attention="mla", variant=None,
        head_dims=_mla_head_dims, errors=_mla_errors, tp_errors=_no_tp_errors, up_item="mla_up",
        module="moe_lc.model.mla:MLAttention", params="moe_lc.model.mla:mla_params",
        vector_params="moe_lc.model.mla:mla_vector_params", saved_bytes="moe_lc.model.mla:mla_saved_bytes",
        decode="moe_lc.model.mla:MLADecode",
        tp_rule="moe_lc.parallel.tp.plan:mla_rule", tp_groups=None,
        local=_MLA_LOCAL,
        ring=CoreSeams(core="moe_lc.parallel.cp.latent_ring:LatentRingAttention",
                       attend="moe_lc.parallel.cp.latent_ring:latent_attend",
                       attend_up="moe_lc.parallel.cp.latent_ring:latent_attend_mla_up"),
        expanded_ring=CoreSeams(core=_RING, attend=_MLA_LOCAL.attend, attend_up=_MLA_LOCAL.attend_up),
        hf_pieces="moe_lc.convert.hf_names:mla_pieces", hf_family="moe_lc.convert.hf_config:mla_family",
        qk_clip_rows="moe_lc.model.mla:mla_qk_clip_rows"),
}


def _dsa_errors(m) -> list[str]:
    return _mla_errors(m) + m.dsa.errors(m.mla)


def _dsa_attended_keys(m, seq_len: int) -> tuple[int, str]:
    if m.dsa.stage == "sparse" and m.dsa.index_topk < seq_len:
        return m.dsa.index_topk, "model.dsa.index_topk, the sparse stage's selection"
    return seq_len, ""


def _dsa_cp_a2a_errors(m, a2a: int) -> list[str]:
    return [f"parallel.cp_a2a={a2a} with DeepSeek Sparse Attention (model.dsa.enabled) is not built: its sparse "
            "ring moves the latent, which the all-to-all cannot split by head"]


# DeepSeek Sparse Attention (DeepSeek-V3.2): MLA with a lightning indexer, on when [model.dsa] enabled. Its
# warm-up stage attends densely through MLA's own seams (core and attend, rings included); its own pieces
# are the module, counts, cache, the indexer's TP placement and the sparse core (parallel/dsa_plan.py), and
# its training part (model/dsa.py, parallel/dsa_plan.py): the indexer's learning rate and the warm-up that
# freezes everything else (routers' biases included) and adds the indexer to a dense checkpoint, and the
# indexer's KL metrics with their all-reduce of 3 fp64 sums.
ATTENTION_KINDS["dsa"] = replace(
    ATTENTION_KINDS["mla"], name="dsa", label="DSA", variant=lambda m: m.dsa.enabled, errors=_dsa_errors,
    module="moe_lc.model.dsa:DSAttention", params="moe_lc.model.dsa:dsa_params",
    vector_params="moe_lc.model.dsa:dsa_vector_params", decode="moe_lc.model.dsa:DSADecode",
    tp_rule="moe_lc.parallel.dsa_plan:dsa_tp_rule", hf_pieces="moe_lc.convert.hf_names:dsa_pieces",
    hf_family="moe_lc.convert.hf_config:dsa_family", core_flops="moe_lc.model.dsa:dsa_core_flops",
    extra_plan="moe_lc.parallel.dsa_plan:dsa_layer_plan",
    attended_keys=_dsa_attended_keys, cp_a2a_errors=_dsa_cp_a2a_errors,
    lr_scales="moe_lc.model.dsa:dsa_lr_scale", routers_frozen="moe_lc.model.dsa:dsa_warmup",
    fresh_params="moe_lc.model.dsa:dsa_fresh_params", step_metrics="moe_lc.parallel.dsa_plan:dsa_step_metrics",
    step_reductions=(("world", 24, "sparse attention's indexer-loss sums (3 fp64)"),))


def dsa_warnings(cfg, given: set[str]) -> list[str]:
    """[model.dsa] keys while DSA is off (written and not the default, or written without `enabled`); a sparse
    top-k that keeps every key; a warm-up (everything frozen but the indexers) from random weights."""
    m, d, S = cfg.model, cfg.model.dsa, cfg.train.seq_len
    if not d.enabled:
        off, default = "model.dsa.enabled" in given, type(d)()
        knobs = [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v:g}" for k, v in asdict(d).items()
                 if k != "enabled" and f"model.dsa.{k}" in given and (v != getattr(default, k) or not off)]
        if not knobs:
            return []
        verb = "it does" if len(knobs) == 1 else "they do"
        if attention_kind(replace(m, dsa=replace(d, enabled=True))).name != "dsa":
            return [f"model.dsa.{', '.join(knobs)} set, but DeepSeek Sparse Attention is off (model.dsa.enabled = "
                    f"false; it also needs model.attention = {ATTENTION_KINDS['dsa'].attention!r}, not {m.attention!r}): "
                    f"{verb} nothing"]
        return [f"model.dsa.{', '.join(knobs)} set, but DeepSeek Sparse Attention is off (model.dsa.enabled = "
                f"false): {verb} nothing, and the model trains as dense MLA with every weight training; set "
                "model.dsa.enabled = true to use them"]
    w = []
    if d.stage == "sparse" and d.index_topk >= S:
        w.append(f"model.dsa.index_topk={d.index_topk} is at or above train.seq_len={S}, the keys a query selects "
                 "from (the whole sequence, under cp too): every query keeps every key it sees, so the sparse stage "
                 "computes dense MLA's attention through the indexer and the sparse kernels, 10-30x dense MLA's time "
                 "on a CPU thread at 256-2K tokens (tools/bench/dsa_cpu.py); set index_topk below train.seq_len "
                 "(DeepSeek-V3.2: 2048 of 128K), or model.dsa.enabled = false")
    if d.stage == "warmup" and not cfg.checkpoint.init_from:
        w.append("model.dsa.stage='warmup' without checkpoint.init_from: the warm-up freezes everything but the "
                 "indexers, so they learn to imitate the attention of a randomly initialised model that never "
                 "trains; set checkpoint.init_from to the trained MLA model's checkpoint")
    return w


# ------------------------------------------------------------------------------------- DeepSeek-V4's config side


def _v4_head_dims(m) -> tuple[int, int, int]:
    a = m.v4_attention
    return a.head_dim, a.head_dim, a.rope_head_dim  # one shared head: key = value


def _v4_errors(m) -> list[str]:
    """[model.v4_attention]'s rules, and the fields of other kinds refused."""
    e = m.v4_attention.errors(m.n_heads, m.n_layers)
    for key, on in (("qkv_bias = true", m.qkv_bias), ("attn_out_bias = true", m.attn_out_bias),
                    (f"qk_norm={m.qk_norm!r}", m.qk_norm != "none"), ("dsa.enabled = true", m.dsa.enabled),
                    (f"rope.scaling={m.rope.scaling!r}", m.rope.scaling != "none")):
        if on:
            e.append(f"model.{key} is not read by model.attention = 'v4' (its norms, biases and ropes are "
                     "[model.v4_attention]'s)")
    return e


def _v4_tp_errors(m, tp: int) -> list[str]:
    """Query heads and the grouped output split, whole groups per rank (moe_lc/parallel/v4_plan.py)."""
    g = m.v4_attention.o_groups
    if g % tp:
        return [f"parallel.tp={tp} must divide model.v4_attention.o_groups={g} (each tp rank projects whole output "
                "groups)"]
    return []


def _v4_run_errors(m, p, data, seq_len: int) -> list[str]:
    """Its context-parallel spans (moe_lc/parallel/cp/v4_context.py): a multiple of every compress rate, at least the
    rows before a span that its window and pooling windows read; packed documents with positions restarting."""
    e, a = [], m.v4_attention
    if p.cp > 1 and p.cp_a2a <= 1 and p.cp_layout in ("zigzag", "contiguous") and seq_len % (2 * p.cp) == 0:
        span = seq_len // (2 * p.cp) * (2 if p.cp_layout == "contiguous" else 1)
        used = a.layer_types_for(m.n_layers)
        rates = sorted({a.compress_rate(t) for t in used} - {0})
        halo = max([a.sliding_window - 1] + [(2 if t == "compressed_sparse_attention" else 1) * a.compress_rate(t) - 1
                                             for t in used if a.compress_rate(t)])  # model/v4_layout.py halo_rows
        bad = [r for r in rates if span % r]
        if bad:
            e.append(f"train.seq_len={seq_len} under parallel.cp={p.cp} ({p.cp_layout}) gives spans of {span} rows: "
                     f"must be a multiple of the compress rates {bad} (each rank pools whole windows)")
        if span < halo:
            e.append(f"train.seq_len={seq_len} under parallel.cp={p.cp} ({p.cp_layout}) gives spans of {span} rows: "
                     f"must be >= {halo}, the earlier rows a span's window and pooling windows read")
    if data.document_mask != data.document_positions:
        e.append(f"data.document_mask={str(data.document_mask).lower()} and data.document_positions="
                 f"{str(data.document_positions).lower()} with model.attention = 'v4': set both (each document is "
                 "compressed on its own grid, from its own position 0)")
    return e


def _v4_cp_a2a_errors(m, a2a: int) -> list[str]:
    return [f"parallel.cp_a2a={a2a} with model.attention = 'v4' is not built: its context parallelism gathers the "
            "compressed entries (one shared KV head, nothing to split by head); use parallel.cp_a2a = 1"]


# DeepSeek-V4 (report arXiv 2606.19348 section 2.3): one module class for the three layer types, block i's type from
# [model.v4_attention] layer_types (`build`), so its counts are per layer; it reads positions and keeps its own RoPE
# tables (main / compress), so the model's `rope` hands it the positions. Its TP rule splits query heads and output
# groups, replicating the shared KV head, compressors and indexer (parallel/v4_plan.py, which also plans the CSA
# indexer loss's share and head sum; its metric is DSA's); under cp no ring: its `context` seam exchanges the rows
# before each span and all-gathers the compressed entries (parallel/cp/v4_context.py), zig-zag or contiguous; packed
# documents stay inside each document (model/v4_layout.py); its decode cache keeps each layer's input
# (model/v4_decode.py).
ATTENTION_KINDS["v4"] = AttentionSpec(
    name="v4", label="DeepSeek-V4 attention", attention="v4", variant=None,
    head_dims=_v4_head_dims, errors=_v4_errors, tp_errors=_v4_tp_errors, up_item=None,
    module="moe_lc.model.v4_attention:V4Attention", params="moe_lc.model.v4_counting:v4_params",
    vector_params="moe_lc.model.v4_counting:v4_vector_params", saved_bytes="moe_lc.model.v4_counting:v4_saved_bytes",
    decode="moe_lc.model.v4_decode:V4Decode",
    tp_rule="moe_lc.parallel.v4_plan:v4_tp_rule", tp_groups=None, local=CoreSeams(),
    ring=CoreSeams(context="moe_lc.parallel.cp.v4_context:V4ContextRows"), cp_layouts=("zigzag", "contiguous"),
    cp_a2a_errors=_v4_cp_a2a_errors,
    expanded_ring=None, hf_pieces="moe_lc.convert.hf_v4:v4_attention_pieces",
    hf_family="moe_lc.convert.hf_v4:v4_family", core_flops="moe_lc.model.v4_counting:v4_core_flops",
    build="moe_lc.model.v4_attention:v4_attention_for", per_layer=True,
    positions="moe_lc.model.v4_rope:PositionsOnly", run_errors=_v4_run_errors,
    extra_plan="moe_lc.parallel.v4_plan:v4_layer_plan", step_metrics="moe_lc.parallel.dsa_plan:dsa_step_metrics",
    step_reductions=(("world", 24, "the CSA indexer-loss sums (3 fp64, DSA's)"),))


def attention_kind(m) -> AttentionSpec:
    """The kind of the [model] section `m`: the variant of `m.attention` whose test holds, else its base kind."""
    kinds = [k for k in ATTENTION_KINDS.values() if k.attention == m.attention]
    if not kinds:
        names = sorted({k.attention for k in ATTENTION_KINDS.values()})
        raise ValueError(f"model.attention={m.attention!r} must be one of {', '.join(map(repr, names))}")
    on = [k for k in kinds if k.variant is not None and k.variant(m)]
    assert len(on) <= 1, f"variants {[k.name for k in on]} of model.attention={m.attention!r} are all on"
    return on[0] if on else next(k for k in kinds if k.variant is None)


def module_kinds() -> dict[type, AttentionSpec]:
    """{module class: its kind} of every kind; imports their model files (callers: the model and above)."""
    return {load(k.module): k for k in ATTENTION_KINDS.values()}


def kind_of_module(module) -> AttentionSpec | None:
    """The kind whose module class `module` is (exactly: a variant's subclass is its own kind), else None."""
    return module_kinds().get(type(module))
