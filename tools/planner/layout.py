"""What one rank of a recipe's layout holds and sends, per mesh dim: the runtime's own layout.

Parameters are not re-described here: each pipeline rank's model is built the way the trainer builds
it (`moe_lc.parallel.build.build_rank_model`: the Transformer on the meta device, parallelize with PP,
TP (its plan table), EP, CP, FP8 and recomputation) on virtual groups of the recipe's mesh, and its
placements give every local shape and gradient group. ZeRO-1 buckets come from
`moe_lc.parallel.zero.layout.bucket_units`, the mesh from `ParallelDims`, the dispatcher's counters from
`moe_lc.parallel.ep.dispatch.counter_elems`, the ZeRO placement from `ZeroPlacement` (moe_lc/parallel/zero/
strategies.py). Exact for what the trainer runs (tests/test_plan.py compares the counted bytes and optimizer
state of real runs):

  parameters   compute dtype, one flat buffer per ZeRO group ("dp_cp" dense, "edp" experts, and
               "dp_cp_tp" for tp-replicated ones), padded per bucket to a multiple of the group size
  gradients    fp32, a full-size padded buffer per group (main grads, accumulated over micro-batches)
  optimizer    fp32 master + the state the update rule declares (moe_lc/optim; AdamW: two moments, fp32 or
               bf16 with precision.adam_moments = "bf16"), 1/N
  per step     what ZeRO sends is counted while ZeRO runs one step on this layout (tools/planner/zero_trace.py:
               reduce-scatters or rounds of the gradients, the grad norm, a tied embedding's shard over
               pp_tie, Muon's tp gathers, the parameters' all-gathers or ZeRO-3's unit gathers); the trainer's
               other small fp64/fp32 all-reduces are `trainer_traffic`: token count over dp (masked data
               only), loss (and MTP loss sums) over world, expert loads (and the dispatchers' counters) over
               dp_cp_tp

Nor is what the model sends (`traced_traffic`): tools/planner/block_trace.py runs the embedding, one block of
each kind and the head (loss and MTP modules included) forward, backward and W on the recipe's mesh (fake
process groups of its real sizes) under its precision and recompute policy, and comm.py counts every
collective it calls, recompute replays included (`TracedParts.comm`); each part's bytes are multiplied by
the micro-batches this rank runs through the stage holding it, and a pipeline sends one traced hidden
tensor per SEND_F and SEND_B, both read off the schedule's actions (tools/planner/pipeline_memory.py). No rule of
an attention kind, ring, dispatcher or balance loss is restated here: what the model code sends is what
is planned. Exact (tests/test_plan.py compares every counter of real tp, cp, ep, pp, DualPipe(V), MLA and
recomputation runs, tests/test_hybrid_cp.py hybrid cp's; tools/dryrun.py holds it to a traced step at full
size), except the expert all-to-alls (not hybrid cp's "cp_a2a", whose sizes are fixed), whose volume follows
the routing: the trace routes evenly (the dry run's `balanced_select`; an expert capacity
drops by position), so they are the balanced-routing value, marked ESTIMATE (within 10% of the measured
volume on the debug model). Hierarchical EP dispatch cannot be traced on the meta device (a `nonzero`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moe_lc.config import Config
from moe_lc.config.attention_kinds import attention_kind
from moe_lc.model.balance_losses import stat_columns
from moe_lc.parallel.build import build_rank_model, pipeline_plan
from moe_lc.optim import recipe_rule
from moe_lc.parallel.qk_clip import attention_sites, statistic_elems
from moe_lc.parallel.zero.host_step import transfer_bytes
from moe_lc.parallel.parallelize import frozen_zero_group, grad_group_of_zero, param_lr_scale, zero_group_of
from moe_lc.parallel.ep.dispatch import counter_elems
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Parallelized
from moe_lc.parallel.zero.layout import bucket_elems, bucket_units
from moe_lc.parallel.zero.strategies import ZeroPlacement
from .block_trace import TracedParts, block_kind
from .pipeline_memory import stage_forwards, stage_sends
from .placement_semantics import Traffic, ring_bytes

ESTIMATE = "estimate: balanced routing"


def zero_placement(cfg: Config) -> ZeroPlacement:
    """The recipe's ZeRO strategies (`[parallel.placement]`), as the trainer chooses them."""
    return ZeroPlacement.from_config(cfg.parallel.placement)


def mesh(cfg: Config, world: int | None = None, rank: int = 0) -> ParallelDims:
    """The recipe's mesh on `world` ranks (None: its own degrees, dp = 0 -> 1) at `rank`, with virtual
    groups (no process group: nothing can be sent)."""
    p = cfg.parallel
    world = world or p.pp * (p.dp or 1) * p.cp * p.tp
    dims = ParallelDims.from_config(p, world, rank)
    dims.init_groups(virtual=True)
    return dims


@dataclass
class RankLayout:
    """One pipeline rank: its mesh coordinates (dp = cp = tp = ep index 0: the rest are symmetric), its
    model as the trainer builds it (on the meta device; tools/planner/zero_trace.py builds ZeRO into it, as the
    trainer does) and its stages as {"layers", "first", "last"}."""

    dims: ParallelDims
    model: Parallelized
    stages: list[dict]

    def local_params(self, cfg: Config) -> dict[str, list[tuple[str, int]]]:
        """{ZeRO group: [(name, local elements)]}, in single-device order (the order ZeRO lays out); groups as
        the trainer makes them (`zero_group_of`: gradient group, split by learning-rate scale and tie group)."""
        groups: dict[str, list[tuple[str, int]]] = {}
        scale = param_lr_scale(cfg)
        for name, p, place in self.model.named_parameters():
            groups.setdefault(zero_group_of(name, place.grad_group, scale, place.tie_group)[0], []).append(
                (name, p.numel()))
        return groups

    def zero_buckets(self, cfg: Config) -> dict[str, list[int]]:
        """{ZeRO group: padded bucket sizes}, as moe_lc.parallel.zero.optimizer allocates them for the recipe's update
        rule (the parameters it wants whole are packed into per-rank bins)."""
        return {g: [size for size, _ in sizes] for g, sizes in self.zero_bucket_units(cfg).items()}

    def zero_bucket_units(self, cfg: Config) -> dict[str, list[tuple[int, str | None]]]:
        """{ZeRO group: (padded bucket size, ZeRO-3 gather unit or None)} in buffer order (`zero_buckets`)."""
        rule, whole, units = recipe_rule(cfg), {}, {}
        unit_of = zero_placement(cfg).params.unit_of  # ZeRO-3's buckets end where a gather unit does
        for name, p, place in self.model.named_parameters():
            group = zero_group_of(name, place.grad_group, param_lr_scale(cfg), place.tie_group)[0]
            whole.setdefault(group, []).append(rule.whole(name, p.shape))
            units.setdefault(group, []).append(unit_of(name) if unit_of is not None else None)
        return {g: bucket_units([k for _, k in params], bucket_elems(cfg.parallel.zero_bucket_mb),
                                self.dims[grad_group_of_zero(g)].size, whole[g],
                                units[g] if unit_of is not None else None)
                for g, params in sorted(self.local_params(cfg).items())}


def rank_layouts(cfg: Config, world: int | None = None) -> list[RankLayout]:
    """A RankLayout per pipeline rank."""
    dims0 = mesh(cfg, world)
    schedule, layers = pipeline_plan(cfg, cfg.train.microbatches(dims0.dp))
    out = []
    for pp_rank in range(dims0.pp):
        dims = mesh(cfg, dims0.world, dims0.rank_of(pp_rank, 0, 0, 0)) if pp_rank else dims0
        model = build_rank_model(cfg, dims, pipeline=(schedule, layers), materialized=False)
        if schedule is None:
            stages = [{"id": 0, "layers": list(range(cfg.model.n_layers)), "first": True, "last": True,
                       "module": model.module}]
        else:  # each chunk's stage by its blocks (DualPipe's mirror ranks run their higher stage first)
            last, stage_of = schedule.n_stages - 1, {tuple(ids): s for s, ids in enumerate(layers)}
            stages = sorted(({"id": s, "layers": layers[s], "first": s == 0, "last": s == last, "module": chunk}
                             for chunk in model.chunks for s in [stage_of[tuple(int(i) for i in chunk.layers)]]),
                            key=lambda st: st["id"])
        out.append(RankLayout(dims, model, stages))
    return out


# ---------------------------------------------------------------------------------------------
# per-step traffic beyond ZeRO's (tools/planner/zero_trace.py)


def trainer_traffic(cfg: Config, dims: ParallelDims, stages: list[dict]) -> list[Traffic]:
    """The small all-reduces `moe_lc.train` issues once a step beside ZeRO's (exact; none on a group of one rank)."""
    m, n_moe = cfg.model, sum(len(st["module"].moe_layers()) for st in stages)
    E, extra = m.moe.n_routed_experts, stat_columns(m.moe)  # per MoE layer: its loads and balance columns,
    ep = dims.ep > 1  # under EP in fp64 with the dispatcher's counters
    per_moe = 8 * (counter_elems(E, dims["ep"].n_nodes()) + extra) if ep else 4 * (E + extra)
    rows = [("dp", 8 if cfg.data.has_loss_mask else 0, "step token count (fp64)"),
            ("world", 8 * m.mtp.depth, f"MTP loss sums ({m.mtp.depth} fp64)"),
            ("world", 8, "loss sum (fp64)"),
            ("world", 4, "stop-signal flag (int32)"),
            *attention_kind(m).step_reductions,  # the attention kind's step metrics (DSA's indexer-loss sums)
            ("dp_cp_tp", n_moe * per_moe, f"expert loads{' and counters' if ep else ''} of {n_moe} MoE layers")]
    if cfg.train.qk_clip:  # moe_lc/parallel/qk_clip.py: per local head of each attention module, then per layer
        n_attn = sum(len(attention_sites(st["module"])) for st in stages)
        heads = sum(statistic_elems(st["module"]) for st in stages)
        rows += [("dp_cp", 4 * heads, f"QK-clip: max lse per head of {n_attn} layers"),
                 ("world", 4 * (m.n_layers + m.mtp.depth), "QK-clip: max lse per layer (the metric)")]
    out = [Traffic(g, "all_reduce", ring_bytes("all_reduce", n, dims[g].size), what) for g, n, what in rows]
    return [t for t in out if t.bytes]


def traced_traffic(cfg: Config, layout: RankLayout, traced: TracedParts, schedule) -> list[Traffic]:
    """What the model sends: each part's traced bytes (`TracedParts.comm`: forward, backward, recompute
    replays, W) times the micro-batches this rank runs through the stage holding it, and the pipeline's
    stage sends, one traced hidden tensor each (`stage_forwards`, `stage_sends`: the schedule's actions)."""
    rank, m = layout.dims.coords()["pp"], cfg.model
    runs = stage_forwards(schedule, rank) if schedule else {0: cfg.train.microbatches(layout.dims.dp)}
    sent, met = Counter(), {}  # (group, op) -> bytes; -> {part: runs of it}
    for st in layout.stages:
        for part in ["embed"] * st["first"] + [block_kind(m, i) for i in st["layers"]] + ["head"] * st["last"]:
            for key, n in traced.comm[part].items():
                sent[key] += runs[st["id"]] * n
                met.setdefault(key, Counter())[part] += runs[st["id"]]
    out = [Traffic(g, op, n, "traced: " + ", ".join(f"{k} x {part}" for part, k in met[(g, op)].items()),
                   ESTIMATE if op == "all_to_all" and g != "cp_a2a" else "exact")  # hybrid cp's: fixed sizes
           for (g, op), n in sorted(sent.items())]
    if schedule:
        out.append(Traffic("pp", "send", stage_sends(schedule, rank) * traced.hidden, "stage activations / gradients"))
    return out


def host_transfers(cfg: Config, layout: RankLayout, buckets: dict[str, list[int]], compute_bytes: int) -> dict[str, int]:
    """The offloaded optimizer's PCIe bytes per step (optimizer_offload.transfer_bytes): each moving group's
    gradient shard down, its parameters up in `compute_bytes` per element; {} with the optimizer on the device."""
    if not zero_placement(cfg).offloaded:
        return {}
    out = {"d2h": 0, "h2d": 0}
    for g, sizes in buckets.items():
        if not frozen_zero_group(g):
            for way, n in transfer_bytes(sum(sizes) // layout.dims[grad_group_of_zero(g)].size,
                                         compute_bytes).items():
                out[way] += n
    return out


def gathered_unit_bytes(cfg: Config, schedule, buckets_by_unit: dict, c: int) -> float:
    """ZeRO-3's gathered parameters at the peak (plan.py's "gathered units" transient), an upper bound: the
    running chain's units and the one prefetched are at most the two largest chains' (the head's reads the
    embedding's too where tied or with MTP), four under a schedule that runs one micro-batch's forward
    beside another's backward (DualPipe, DualPipeV); elements over every group (`RankLayout.zero_bucket_units`)
    at c bytes."""
    sizes: Counter = Counter()
    for buckets in buckets_by_unit.values():
        for size, unit in buckets:
            sizes[unit] += size
    if "head" in sizes and (cfg.model.tie_embeddings or cfg.model.mtp.depth):
        sizes["head"] += sizes["embed"]
    held = 4 if schedule is not None and cfg.parallel.pp_schedule in ("dualpipe", "dualpipev") else 2
    return c * sum(sorted(sizes.values(), reverse=True)[:held])
