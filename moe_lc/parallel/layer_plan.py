"""The layer plan: what every module of a rank does, decided once from the recipe and the layout, then
applied in one pass. Nothing else assigns these attributes of a built model (tests/test_layer_plan.py).

Each decision has exactly one rule, and `LayerPlan.set` refuses a second, different value for the same
attribute, so the rules can be resolved in any order and none reads what another put on a module (one
exception, said where it is: `LayerPlan.wrap`, which wraps the decision so far, runs after the others):

    decision                                  attributes it sets                rule
    tensor parallelism: TP role, local heads,  Linear.tp, .n_heads/.n_kv_heads,  parallel/tp/plan.py
      vocab-parallel embedding and loss,       .gather, .embed, .loss_fn,
      a whole-row qk norm's sum of squares     WideRMSNorm.sum_squares
    expert parallelism: local experts, the     GroupedLinear.n_experts,          parallel/ep/dispatch.py
      all-to-all token dispatcher              MoE.dispatcher
    context parallelism: the attention core    .core (zig-zag ring attention;    parallel/cp/ring.py, the
                                                 MLA's latent ring), .context      attention kind's ring
                                                 (V4's rows and entries)           (parallel/cp/v4_context.py)
    GEMM backend (FP8 or compute dtype)        Linear.gemms                      `_gemms` (kernels: ops/fp8_linear.py)
    recomputation and FP8 activation caching   .replay, .activation, .logits,    `_seams` (pieces: model/recompute.py,
                                               .attend, .out_proj                  model/fp8_cache.py)
    load counting: which runs of a router's    Router.count_loads                `_seams` (a block's replay under
      forward book its routing in the step's                                       full recomputation runs the
      ForwardStats (once per micro-batch)                                          router again)
    how a Linear keeps its input for W         Linear.keep_input                 `_keep_inputs`
    deferred weight gradient (split backward)  Linear.wgrad_store                `resolve_layer_plan`
    the step's share of the balance loss       MoE.aux_loss_scale                `_expert_plan`
    the MTP modules' embedding: the model's,   Transformer.mtp_embed             `resolve_layer_plan`
      borrowed (a pipeline stage with MTP
      and without the embedding calls it)
    the balance losses' sums over the mesh     Router.token_shards               parallel/ep/balance_plan.py
    FP8-rounded token dispatch                 the dispatcher's fp8_tokens       `_expert_plan`
    compiling (train.compile): every module's  .run_region (and the dispatcher's) `_compiled` (runners and
      regions through torch.compile, booked                                        watch: parallel/compile.py)
      to its block in the rank's CompileWatch
    QK-clip's forward guard (train.qk_clip_    .core wrapped (`LayerPlan.wrap`:  parallel/qk_guard.py
      guard): tau held inside each forward       around whichever core CP chose),
                                               DSA's .logit_guard

What the model declares about itself (the output head and router stay in the compute dtype, the
router's W is never deferred) is set by its constructors (`fp8_eligible`, `defer_wgrad`) and only read here.
Parameter shards are recorded in a `Placements` table beside the plan (moe_lc/parallel/placement.py).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from functools import partial

import torch
from torch import nn

from moe_lc.config import PrecisionConfig, RecomputeConfig
from moe_lc.config.attention_kinds import load, module_kinds
from moe_lc.model.block import Block
from moe_lc.model.ffn import SwiGLU, swiglu_then
from moe_lc.model.fp8_cache import attn_out_fp8_cached, swiglu_fp8_cached
from moe_lc.model.moe import LocalDispatcher, MoE, RoutedExperts, Router, each_forward, fp32_logits
from moe_lc.model.norm import RMSNorm
from moe_lc.model.recompute import (POLICIES, SELECTIVE_ITEMS, checkpointed, first_forward, fp32_logits_replayed,
                                    swiglu_keeping_input, swiglu_replayed)
from moe_lc.model.seams import Borrowed, run_now
from moe_lc.ops.fp8_linear import HoldFp8ForWgrad, KeepFp8ForWgrad, SharedFp8ForWgrad, fp8_gemms
from moe_lc.ops.linear import GroupedLinear, Linear, WeightGradStore
from moe_lc.parallel.compile import CompileWatch, compiled_runners
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Placements


# Every attribute a plan decides: nothing outside this file assigns them on a module after it is built
# (tests/test_layer_plan.py reads this set).
DECIDED = frozenset({"tp", "n_heads", "n_kv_heads", "gather", "embed", "loss_fn", "n_experts", "dispatcher", "core",
                     "gemms", "replay", "activation", "logits", "attend", "out_proj", "keep_input", "wgrad_store",
                     "aux_loss_scale", "select", "fp8_tokens", "sum_squares", "token_shards", "sparse_core",
                     "keep_latents", "count_loads", "mtp_embed", "run_region", "logit_guard",
                     "o_groups", "head_sum", "token_shard", "context", "replay_each_phase"})


@dataclass
class LayerPlan:
    """{module name: {attribute: value}} for one rank's model ("" is the model itself), resolved on the
    whole model before the pipeline split; it keeps names, never the model (whose other stages the
    split lets go).

    wgrad_store: the store every deferring Linear pushes its weight-gradient GEMM to under a pipeline
    schedule (its runtime decides when a B is split), None without PP. compile_watch: the rank's
    CompileWatch when its regions run compiled (train.compile), else None."""

    model: InitVar[nn.Module]
    settings: dict[str, dict[str, object]] = field(default_factory=dict)
    wgrad_store: WeightGradStore | None = None
    compile_watch: CompileWatch | None = None

    def __post_init__(self, model: nn.Module):
        self._names = {id(m): name for name, m in model.named_modules()}

    def set(self, module: nn.Module, **attrs) -> None:
        """Decide attributes of `module`; a second, different decision for one is a bug in the rules."""
        name = self._names[id(module)]
        row = self.settings.setdefault(name, {})
        for attr, value in attrs.items():
            assert attr in DECIDED, f"{attr!r} is not a layer-plan decision (add it to DECIDED)"
            old = row.get(attr, value)
            if old is not value and old != value:
                raise AssertionError(f"the layer plan decides {name or '<model>'}.{attr} twice: {old!r} and {value!r}")
            row[attr] = value

    def wrap(self, module: nn.Module, attr: str, around) -> None:
        """Decide `module.attr` as around(what it is so far): the plan's earlier decision, else the module's
        own default (QK-clip's guard around whichever core context parallelism chose)."""
        assert attr in DECIDED, f"{attr!r} is not a layer-plan decision (add it to DECIDED)"
        row = self.settings.setdefault(self._names[id(module)], {})
        row[attr] = around(row[attr] if attr in row else getattr(module, attr))

    def get(self, module: nn.Module, attr: str, default=None):
        return self.settings.get(self._names[id(module)], {}).get(attr, default)

    def apply(self, model: nn.Module) -> nn.Module:
        """Set every decided attribute on `model` (the one resolved), in one pass: the only place that does."""
        modules = dict(model.named_modules())
        for name, row in self.settings.items():
            for attr, value in row.items():
                setattr(modules[name], attr, value)
        return model

    def describe(self) -> list[str]:
        """One line per module and decision, for `--print-plan` style inspection and tests."""
        return [f"{name or '<model>'}.{attr} = {_short(value)}" for name, row in self.settings.items()
                for attr, value in row.items()]


def _short(value) -> str:
    if isinstance(value, partial):
        return f"{value.func.__name__}({', '.join(f'{k}=...' for k in value.keywords)})"
    if isinstance(value, nn.Module):  # one line, a wrapper's children included (QK-clip's guard around a core)
        return " ".join(repr(value).split())
    return getattr(value, "__name__", None) or repr(value)


@dataclass(frozen=True)
class LayerPlanOptions:
    """What the layer plan reads of a recipe, derived from it once (`from_config`) and handed down whole
    (parallel/build.py -> `parallelize` -> `resolve_layer_plan`): a new knob is one field here and the rule
    that reads it. The defaults: one fp32 device, nothing recomputed."""

    expert_dispatch: str = "flat"  # parallel.expert_dispatch: the token dispatcher under expert parallelism
    mla_ring: str = "latent"  # parallel.mla_ring: what MLA's ring moves under cp ("expanded": a kind's expanded_ring)
    cp_layout: str = "zigzag"  # parallel.cp_layout: how the micro-batch is placed on the cp ranks (a `context` seam)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)  # GEMMs, FP8 caching, FP8 dispatch
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)  # the policy and its selective items
    aux_loss_scale: float = 1.0  # each micro-batch's share of the step's loss, 1 / (micro-batches * dp)
    compiled: bool = False  # train.compile: the regions run through torch.compile (not on the meta device)
    qk_guard: float = 0.0  # tau of QK-clip's forward guard around every attention core (parallel/qk_guard.py), 0 = none
    phase_overlap: bool = False  # the pipeline interleaves two micro-batches' block phases (DualPipe(V)'s F&B)

    @classmethod
    def from_config(cls, cfg, dp: int = 1) -> LayerPlanOptions:
        """The options of recipe `cfg` (moe_lc.config.Config) on `dp` data-parallel ranks."""
        t = cfg.train
        return cls(expert_dispatch=cfg.parallel.expert_dispatch, mla_ring=cfg.parallel.mla_ring,
                   cp_layout=cfg.parallel.cp_layout,
                   precision=cfg.precision, recompute=cfg.recompute, aux_loss_scale=1.0 / (t.microbatches(dp) * dp),
                   compiled=t.compile, qk_guard=t.qk_clip if t.qk_clip_guard else 0.0,
                   phase_overlap=cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in ("dualpipe", "dualpipev"))


def resolve_layer_plan(model: nn.Module, dims: ParallelDims | None = None, options: LayerPlanOptions | None = None,
                       placements: Placements | None = None, *, device: torch.device | None = None,
                       pipelined: bool = False, route=None) -> LayerPlan:
    """The plan for `model` (the whole single-device model, before any pipeline split) on this rank.

    dims: the layout (None: one device); options: what the plan reads of the recipe (None: the defaults);
    placements: where parameter shards are recorded (a fresh table when None); pipelined: a pipeline schedule
    runs it (deferring Linears get `plan.wgrad_store`); route: a router `select` replacing the learned one (the
    dry run's balanced routing); device: where FP8 kernels will run (checked up front), and where nothing is
    compiled when it is the meta device (the dry run's tensors have nothing to compile)."""
    plan, placements = LayerPlan(model), placements if placements is not None else Placements()
    o = options if options is not None else LayerPlanOptions()
    cp = dims.cp if dims is not None else 1
    if dims is not None and dims.tp > 1:
        from moe_lc.parallel.tp.plan import tensor_parallel_plan

        tensor_parallel_plan(model, dims, placements, plan)
    if getattr(model, "mtp", None) is not None and model.embed is not None:  # the embedding TP decided, if it did
        plan.set(model, mtp_embed=Borrowed(plan.get(model, "embed", model.embed)))
    _expert_plan(model, dims, placements, plan, o, route)
    _context_plan(model, dims, plan, o.mla_ring, o.cp_layout)
    items = set(o.recompute.selective) if o.recompute.policy == "selective" else set()
    for module in model.modules():  # what only some attention kinds decide (DSA's sparse core, loss share, replays)
        kind = module_kinds().get(type(module))
        if kind is not None and kind.extra_plan is not None:
            load(kind.extra_plan)(module, dims, plan, o.aux_loss_scale, items)
    if o.qk_guard:
        from moe_lc.parallel.qk_guard import qk_guard_plan

        qk_guard_plan(model, dims, plan, o.qk_guard)
    cache, gemms = set(o.precision.fp8_cache), _gemms(model, o.precision, device)
    for linear, g in gemms.items():
        plan.set(linear, gemms=g)
    _seams(model, plan, o.recompute, cache, cp, o.mla_ring, o.phase_overlap)
    if "linear" in cache:
        _keep_inputs(model, plan, gemms, o.recompute, cache)
    if pipelined:
        plan.wgrad_store = WeightGradStore()
        for m in model.modules():
            if isinstance(m, (Linear, GroupedLinear)) and m.defer_wgrad:
                plan.set(m, wgrad_store=plan.wgrad_store)
    if o.compiled and (device is None or device.type != "meta"):
        plan.compile_watch = _compiled(model, plan)
    return plan


def apply_layer_plan(model: nn.Module, dims: ParallelDims | None = None, options: LayerPlanOptions | None = None,
                     **kwargs) -> LayerPlan:
    """Resolve `model`'s plan (`resolve_layer_plan`'s arguments) and apply it; returns the plan."""
    plan = resolve_layer_plan(model, dims, options, **kwargs)
    plan.apply(model)
    return plan


def _expert_plan(model: nn.Module, dims: ParallelDims | None, placements: Placements, plan: LayerPlan,
                 o: LayerPlanOptions, route) -> None:
    """Routed experts' gradients over "edp"; under ep > 1 the local experts and all-to-all dispatcher, else a
    local dispatcher where FP8 dispatch needs one; each MoE layer's loss share and router `select`; the
    balance losses' sums over the mesh."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for experts in (m for m in model.modules() if isinstance(m, RoutedExperts)):
        placements.set_group(experts.parameters(), "edp")
    if dims is not None and dims.ep > 1 and moes:
        from moe_lc.parallel.ep.dispatch import expert_parallel_plan

        expert_parallel_plan(model, dims, o.expert_dispatch, placements, plan)
    elif o.precision.fp8_dispatch:
        for moe in moes:
            plan.set(moe, dispatcher=LocalDispatcher())
    for moe in moes:
        if o.precision.fp8_dispatch:
            plan.get(moe, "dispatcher").fp8_tokens = True  # the plan's own, fresh dispatcher object
        plan.set(moe, aux_loss_scale=o.aux_loss_scale)
        if route is not None:
            plan.set(moe.router, select=route)
    if dims is not None and moes:
        from moe_lc.parallel.ep.balance_plan import balance_plan

        balance_plan(model, dims, plan)


def _context_plan(model: nn.Module, dims: ParallelDims | None, plan: LayerPlan, mla_ring: str,
                  cp_layout: str = "zigzag") -> None:
    """Under cp > 1 each attention module's ring core: its kind's ring for `mla_ring`, with an all-to-all inside
    under hybrid cp (parallel.cp_a2a > 1; a kind's latent ring keeps its own core); a kind's `context` seam (V4's
    exchanges, built as (cp group, cp_layout))."""
    cp = dims.cp if dims is not None else 1
    if cp > 1:
        for module in model.modules():
            kind = module_kinds().get(type(module))
            if kind is not None and kind.seams(cp, mla_ring).context is not None:
                plan.set(module, context=load(kind.seams(cp, mla_ring).context)(dims["cp"], cp_layout))
    rings = {module_type: kind.seams(cp, mla_ring).core for module_type, kind in module_kinds().items()}
    if cp > 1 and dims.cp_a2a > 1:  # hybrid cp: an all-to-all inside the ring (a kind's latent ring: its own core)
        from moe_lc.parallel.cp.ulysses import hybrid_context_parallel_plan

        latent = tuple(t for t, kind in module_kinds().items()
                       if kind.expanded_ring is not None and mla_ring != "expanded")
        hybrid_context_parallel_plan(model, dims, plan, latent)
    elif cp > 1:
        from moe_lc.parallel.cp.ring import context_parallel_plan

        context_parallel_plan(model, dims, plan, {t: load(core) for t, core in rings.items() if core is not None})


def _compiled(model: nn.Module, plan: LayerPlan) -> CompileWatch:
    """train.compile: every module with a `run_region` seam, and every MoE layer's dispatcher (the plan's
    own: a local one unless another rule gave the layer one), runs its regions compiled, booked to the
    module's block (moe_lc/parallel/compile.py). Returns the rank's CompileWatch."""
    watch = CompileWatch()
    names = [name for name, m in model.named_modules() if hasattr(m, "run_region") or isinstance(m, MoE)]
    runners = compiled_runners(names, watch)
    for name, module in model.named_modules():
        if hasattr(module, "run_region"):
            plan.set(module, run_region=runners[name])
        if isinstance(module, MoE):
            if plan.get(module, "dispatcher") is None:
                plan.set(module, dispatcher=LocalDispatcher())
            plan.get(module, "dispatcher").run_region = runners[name]
    return watch


def _gemms(model: nn.Module, precision: PrecisionConfig, device) -> dict[nn.Module, object]:
    """{Linear: its FP8 GEMMs} for every FP8-eligible Linear under precision.recipe = "fp8"."""
    if precision.recipe != "fp8":
        return {}
    eligible = [m for m in model.modules() if isinstance(m, (Linear, GroupedLinear)) and m.fp8_eligible]
    return dict(zip(eligible, fp8_gemms(len(eligible), precision.fp8_scaling, precision.fp8_backend, device,
                                        precision.fp8_weight_cache)))


def _seams(model: nn.Module, plan: LayerPlan, recompute: RecomputeConfig, cache: set[str], cp: int,
           mla_ring: str, phase_overlap: bool = False) -> None:
    """Recomputation (policy, selective items) and FP8 activation caching (`cache` items) at the model's
    seams (moe_lc/model/seams.py). A SwiGLU's output is kept by neither when "swiglu" is cached in FP8
    (that copy replaces the selective replay's compute-dtype one). An attention module takes its kind's
    `attend` seam for this cp degree and ring (MLA's latent ring under context parallelism,
    parallel/cp/latent_ring.py: moe_lc/config/attention_kinds.py), its replaying one under the kind's
    selective item ("mla_up", which keeps the latents and does not replay the core). Under "full" a block is
    replayed whole from its input (Megatron-LM's full recomputation), but where the pipeline interleaves its
    phases with another micro-batch's (`phase_overlap`), which needs each phase replayed apart."""
    policy, items = recompute.policy, set(recompute.selective) if recompute.policy == "selective" else set()
    assert policy in POLICIES and items <= set(SELECTIVE_ITEMS), "checked by the recipe's rules"
    kinds = module_kinds()
    for module in model.modules():
        kind = kinds.get(type(module))
        if isinstance(module, Block):
            plan.set(module, replay=checkpointed if policy == "full" else run_now,
                     replay_each_phase=policy != "full" or phase_overlap)
        elif isinstance(module, RMSNorm):  # keeps its compute-dtype input only, under every policy
            plan.set(module, replay=checkpointed)
        elif isinstance(module, Router):  # a block's replay runs its router again: the first run books
            plan.set(module, logits=fp32_logits if policy == "full" else fp32_logits_replayed,
                     count_loads=first_forward if policy == "full" else each_forward)
        elif isinstance(module, (SwiGLU, RoutedExperts)):
            plan.set(module, activation=swiglu_fp8_cached if "swiglu" in cache else
                     swiglu_replayed if "swiglu" in items else swiglu_then if policy == "full" else swiglu_keeping_input)
        elif kind is not None:
            up = kind.up_item is not None and kind.up_item in items  # keeps the latents, no core replay
            plan.set(module, replay=checkpointed if "attention" in items and not up else run_now)
            seams = kind.seams(cp, mla_ring)
            if seams.attend is not None:
                plan.set(module, attend=load(seams.attend_up if up else seams.attend))
            if "attn_out" in cache:
                plan.set(module, out_proj=attn_out_fp8_cached)


def _keep_inputs(model: nn.Module, plan: LayerPlan, fp8_linears: dict, recompute: RecomputeConfig,
                 cache: set[str]) -> None:
    """FP8 cache item "linear" ({FP8 Linear: its GEMMs}): every FP8 Linear keeps its input for W as its GEMM
    quantizes it, except where
    another part keeps that input in the compute dtype anyway (an FP8 copy would only add bytes; such a
    Linear still holds a deferred W's operands in FP8): attention's wo (the core keeps its output), a down
    projection whose input is recomputed, the shared experts' up projection while the router's replay
    keeps their common input. Linears that read one tensor in turn (`same_input_linears` of a module) share
    one FP8 copy under stateless scaling."""
    items = set(recompute.selective) if recompute.policy == "selective" else set()
    swiglu_rebuilt = "swiglu" in items or "swiglu" in cache
    elsewhere, attention = set(), tuple(module_kinds())
    for module in model.modules():
        if type(module) in attention:
            elsewhere.add(module.wo)
        elif isinstance(module, (SwiGLU, RoutedExperts)) and swiglu_rebuilt:
            elsewhere.add(module.w2)
        elif isinstance(module, MoE) and module.shared is not None and recompute.policy != "full":  # router replay
            elsewhere.add(module.shared.w13)
    shared = {}  # Linears an attention module says read one input (`same_input_linears`): one FP8 copy
    for module in model.modules():
        group = [m for m in getattr(module, "same_input_linears", lambda: [])() if m in fp8_linears]
        if len(group) > 1 and all(fp8_linears[m].history is None for m in group):  # stateless scaling
            keep = SharedFp8ForWgrad()
            shared.update((linear, keep) for linear in group)
    for linear in fp8_linears:
        plan.set(linear, keep_input=HoldFp8ForWgrad() if linear in elsewhere else shared.get(linear, KeepFp8ForWgrad()))

