"""The memory and communication planner's model: per-rank bytes of every training state and traffic per mesh dim.

`plan(cfg, world)` -> a `Plan` (one `RankPlan` per pipeline rank), `render` its table; the command line is
tools/plan.py.
Parameters come from each pipeline rank's model built as the trainer builds it, on the meta device
(no memory; tools/planner/layout.py). Activations and traffic come from running the model code: the
embedding, one block of each kind and the head, forward and backward on the meta device on fake
process groups of the recipe's mesh (tools/planner/block_trace.py), give the bytes each keeps for backward
(tools/planner/activation_memory.py) and the bytes comm.py counts it sending, recompute replays included; the
rank's pipeline schedule gives how often each runs, what is in flight at once and the stage sends
(tools/planner/pipeline_memory.py). ZeRO's collectives come from running ZeRO's own step on the layout
(tools/planner/zero_trace.py), the trainer's other all-reduces once a step from `layout.trainer_traffic`. The
tool prints the placement table (where each state lives on each dim), memory per rank by state, the transient
working sets and the peak, saved activations under each recompute policy and the bytes this rank sends per
optimizer step, keyed like the trainer's metrics ("comm/<group>/<op>_bytes"). tools/dryrun.py holds all of it
to one traced training step at the recipe's real size. With --cluster, also the predicted step time, tokens/s/GPU
and MFU on that cluster (tools/step_time/model.py; `--set cluster.KEY=V` / `eff.KEY=V` override its figures);
with --search, the layouts of the world size that fit, ranked by it (tools/step_time/search.py).
Runs from the repo root without installing.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # (before torch) the traces' fake process groups warn per group

from .activation_memory import CHECKED, POLICIES, UNCHECKED, stage_estimate
from .block_trace import trace_parts
from moe_lc.config import Config
from moe_lc.model.counting import param_counts
from moe_lc.model.transformer import CrossEntropy16
from moe_lc.optim import build_rule
from moe_lc.parallel.parallelize import frozen_zero_group, grad_group_of_zero, tie_group_of_zero
from moe_lc.parallel.tp.mappings import VOCAB_CE_ROWS
from moe_lc.parallel.zero.optimizer import GRAD_NORM_BYTES_PER_ELEMENT, GRAD_NORM_CHUNK
from .placement_semantics import (MODES, StatePlacement, Traffic, host_memory_by_state, memory_by_state,
                                  model_shard_dims, zero_memory)
from .pipeline_memory import (phase_count, pipeline_schedule, rank_saved_peak, schedule_peak,
                              stage_sizes, wgrad_held_bytes, working_spikes)
from .layout import (RankLayout, gathered_unit_bytes, host_transfers, rank_layouts, traced_traffic, trainer_traffic,
                     zero_placement)
from .zero_trace import zero_traffic
from .fp8_weights import cache_rows, gathered_cache_bytes

__all__ = ["Plan", "RankPlan", "plan", "zero_memory"]

PARTS = {"dp_cp": "dense", "dp_cp_tp": "tp-replicated", "edp": "experts"}
FROZEN = " (frozen)"  # a ZeRO group of learning-rate scale 0 (zero/optimizer.py: no reduce-scatter, no all-gather)
TIED = " (tied embedding)"  # the first and last stages' copies: their reduced shard summed over pp_tie
DIM_ORDER = ("pp", "dp", "cp", "tp", "ep", "dp_cp", "dp_cp_tp", "edp", "host")  # host: O (offloaded) rows


@dataclass
class RankPlan:
    """One pipeline rank (every rank when pp = 1: the other dims are symmetric)."""

    pp_rank: int
    layers: list[int]
    table: list[StatePlacement]
    activations: dict[str, float]  # saved bytes by recompute policy
    activation_status: dict[str, str]
    traffic: list[Traffic]
    buckets: dict[str, list[int]]  # ZeRO group -> padded bucket sizes (elements)
    transients: dict[str, float] = field(default_factory=dict)  # working sets by name (`_transients`)
    host_activations: float = 0.0  # train.offload's bytes in host memory at their peak (not in `memory`)
    host_transfers: dict[str, int] = field(default_factory=dict)  # offloaded optimizer: PCIe bytes per step, d2h / h2d

    @property
    def memory(self) -> dict[str, float]:
        return memory_by_state(self.table)

    @property
    def host_memory(self) -> dict[str, float]:
        """Host bytes of the offloaded states (parallel.placement.optimizer), by state; not in `memory`."""
        return host_memory_by_state(self.table)

    @property
    def total_bytes(self) -> float:
        return sum(self.memory.values())

    def peak_bytes(self) -> float:
        """Peak memory of a training step: the states that live through it (parameters, gradients,
        optimizer, FP8 weight copies) plus the larger of the forward/backward peak (saved activations at their most and
        the working set of that moment) and the optimizer step's working set (activations freed)."""
        mem, t = self.memory, self.transients
        static = mem["params"] + mem["grads"] + mem["optimizer"] + mem["fp8 weight cache"]
        return static + max(mem["activations"] + t.get("step", 0.0), t.get("optimizer step", 0.0))

    def comm_per_step(self) -> dict[str, float]:
        """{"comm/<group>/<op>_bytes": bytes this rank sends per step}, as metrics.jsonl keys them."""
        out: dict[str, float] = {}
        for t in self.traffic:
            out[t.key] = out.get(t.key, 0) + t.bytes
        return out

    def optimizer_state_bytes(self) -> float:
        return self.memory["optimizer"]


@dataclass
class Plan:
    recipe: str
    degrees: dict[str, int]  # world, pp, dp, cp, tp, ep, edp and whether DualPipe mirrors ranks
    policy: str
    ranks: list[RankPlan]
    notes: list[str] = field(default_factory=list)

    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total_bytes)

    def to_json(self) -> dict:
        return {"recipe": self.recipe, "degrees": self.degrees,
                "policy": self.policy, "notes": self.notes,
                "ranks": [{"pp_rank": r.pp_rank, "layers": r.layers, "memory_bytes": r.memory,
                           "total_bytes": r.total_bytes, "peak_bytes": r.peak_bytes(), "transients": r.transients,
                           "host_activation_bytes": r.host_activations, "host_memory_bytes": r.host_memory,
                           "host_transfer_bytes": r.host_transfers,
                           "activations_by_policy": r.activations,
                           "activation_status": r.activation_status, "comm_per_step": r.comm_per_step(),
                           "traffic": [asdict(t) for t in r.traffic], "zero_buckets": r.buckets,
                           "placement": [asdict(p) for p in r.table]} for r in self.ranks]}


def compute_bytes(cfg: Config) -> int:
    return 4 if cfg.precision.recipe == "fp32" else 2


def _optimizer_row(rule) -> tuple[int, str, str]:
    """(bytes per element, dtype, note) of the optimizer row: ZeRO's fp32 master and the state the update
    rule declares."""
    specs = rule.states()
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.dtype_name] = counts.get(spec.dtype_name, 0) + 1
    dtype = "fp32 master" + "".join(f" + {k} {name}" for name, k in counts.items())
    note = f"{rule.name}: " + (", ".join(spec.name for spec in specs) if specs else "no state beside the master")
    return 4 + sum(spec.bytes_per_element for spec in specs), dtype, note


def _zero_rows(cfg: Config, layout: RankLayout) -> tuple[list[StatePlacement], dict[str, list[int]]]:
    """Params, grads and optimizer rows of each ZeRO group, padded exactly as zero/optimizer.py lays them out; the
    optimizer's bytes are the master's and what the update rule declares (moe_lc/optim)."""
    c, dims = compute_bytes(cfg), layout.dims
    opt_bytes, opt_dtype, opt_note = _optimizer_row(build_rule(cfg.train, cfg.precision, cfg.model))
    pdtype = "fp32" if c == 4 else "bf16"
    z = zero_placement(cfg)
    offloaded = z.offloaded
    rows, buckets = [], layout.zero_buckets(cfg)
    for zero_group, params in sorted(layout.local_params(cfg).items()):
        _, _, lr_scale = zero_group.partition("*")  # a group of its own learning rate: "<group>*<scale>"
        group, tied = grad_group_of_zero(zero_group), tie_group_of_zero(zero_group) is not None  # a tied embedding
        n = dims[group].size
        local = sum(buckets[zero_group])
        model_dims, scale = model_shard_dims(dims, group, tied)
        part = PARTS[group] + (FROZEN if lr_scale == "0" else f" (lr x {lr_scale})" if lr_scale else "") + \
            (TIED if tied else "")
        numel = local * scale
        pad = local - sum(k for _, k in params)
        note = f"{len(buckets[zero_group])} bucket(s) padded to a multiple of {n} (+{pad} elements)"
        if z.params_gathered:  # ZeRO-3: 1/N kept, each unit gathered around its use (param_gather.py)
            rows.append(StatePlacement("params", part, numel, c, pdtype, {**model_dims, group: (n, "SG")},
                                       note + "; ZeRO-3: 1/N kept, units gathered around their use"))
        else:
            rows.append(StatePlacement("params", part, numel, c, pdtype, {**model_dims, group: (n, "R")}, note))
        if z.grads_sharded:  # ZeRO-2: the shard alone (its rounds' staging: transients)
            rows.append(StatePlacement("grads", part, numel, 4, "fp32", {**model_dims, group: (n, "S")},
                                       "ZeRO-2: this rank's reduced 1/N, reduce-scattered each micro-batch"))
        else:  # ZeRO-1: the reduced 1/N lands in the buffer; its (P/N,) copy lives at the step (transients)
            rows.append(StatePlacement("grads", part, numel, 4, "fp32", {**model_dims, group: (n, "R")},
                                       "full-size main-grad buffer, reduce-scattered in place per bucket"))
        host = {"host": (1, "O")} if offloaded else {}  # parallel.placement.optimizer: master and state on the host
        rows.append(StatePlacement("optimizer", part, numel, opt_bytes, opt_dtype, {**model_dims, group: (n, "S"), **host},
                                   opt_note + (", in host memory" if offloaded else "")))
        if offloaded:  # moe_lc/parallel/zero/host_step.py's staging, each way
            rows += [StatePlacement("grads", f"{part} host staging", numel, 4, "fp32",
                                    {**model_dims, group: (n, "S"), **host}, "the clipped shard, copied down each step"),
                     StatePlacement("params", f"{part} host staging", numel, c, pdtype,
                                    {**model_dims, group: (n, "S"), **host}, "the updated master, cast, on its way up")]
    return rows, buckets


def _estimates(cfg: Config, stages: list[dict], policy: str) -> list:
    """The saved activations of one micro-batch through each of this rank's stages under `policy`."""
    return [stage_estimate(cfg, st["layers"], st["first"], st["last"], policy=policy) for st in stages]


def _activations(cfg: Config, deg, stages: list[dict], pp_rank: int, schedule,
                 estimates: dict[str, list]) -> tuple[dict, dict]:
    """Saved bytes of this rank at its peak under each policy: its micro-batches through its stages in
    the order of the pipeline schedule (`schedule_peak`)."""
    by_policy, status = {}, {}
    for policy, per_stage in estimates.items():
        by_policy[policy] = rank_saved_peak(schedule, pp_rank, stages, per_stage)
        # EP's expert rows follow the routing (traced balanced); PP's peak is the schedule walk's: both
        # are held to a traced step by the dry run (tools/dryrun.py)
        checked = all(e.status == CHECKED for e in per_stage) and deg.ep == 1 and schedule is None
        status[policy] = CHECKED if checked else UNCHECKED
    return by_policy, status


def _transients(cfg: Config, deg, stages: list[dict], buckets: dict[str, list[int]], pp_rank: int, schedule,
                per_stage: list, buckets_by_unit: dict, fp8_copies: float = 0.0) -> dict[str, float]:
    """Working sets that live only for a moment but add to the peak (the dry run, tools/dryrun.py,
    showed them and checks these figures):

      recompute replay   one block's recomputed pieces, re-created in backward (traced: the tensors a
                         block keeps under policy "none" but not under the policy)
      loss head          on the last stage, the logits of the local sequence (B, S/cp, V/tp) in the
                         compute dtype for the main head and each MTP head, and the loss's fp32 copy and
                         fp32 log-softmax of one of them; with 16-bit logits and no TP (the loss keeps
                         the logits, CrossEntropy16) one head's logits gradient and fp32 row chunks; under
                         TP (the vocab-parallel loss keeps the logits too) its fp32 row blocks
      parts' working     the most one part (embedding, block, head) holds at once while it runs, above
                         what it saves, where it occurs in its stage (`working_spikes`: traced; the
                         indexer's score tiles, a reference attention's scores, dispatch buffers)
      step               at the forward/backward peak, above the most saved activations: without a
                         pipeline the largest of one replay, the loss head (which runs when its own
                         saved terms are not saved yet) and the parts' working sets; under one what
                         `schedule_peak` finds with these at the end of each forward (the head's) and
                         the start of each backward (a replay), and the output gradients a split
                         backward leaves for its W (`wgrad_held_bytes`; ZB-H1, DualPipe)
      gradient rounds    ZeRO-2 (parallel.placement.grads = "sharded"): each group's round being filled (a
                         bucket, fp32) and a reduced output (1/N of one); added to "step"
      gathered units     ZeRO-3 (parallel.placement.params = "sharded_gather"): the units whose parameters are
                         gathered at once: the one running and the one prefetched, twice that under a
                         schedule that runs one micro-batch's forward beside another's backward (DualPipe,
                         DualPipeV): an estimate by the largest unit; added to "step"; with the FP8 weight
                         cache, their weights' FP8 copies ("gathered fp8 copies", `fp8_copies`) too
      offload fetch      train.offload: backward copies a module call's offloaded tensors back (and the
                         call's before it, prefetched): at most one block's host bytes; added to "step"
      optimizer step     per ZeRO shard, processed one after another: the grad norm's fp32 squares and
                         weights of one chunk (8 B x at most 2^22 elements, zero/optimizer.py `grad_sq_sum`),
                         or the update rule's temporaries as it declares them
                         (AdamW: sqrt and denominator, the no-decay copy of the master, and fp32 copies
                         of bf16 moments); with ZeRO-1, every group's reduced gradient shard too ((P/N,)
                         fp32, copied out of the main-grad buffer when the step begins, freed after it)
    """
    out = {"recompute replay": max(e.recompute_working for e in per_stage)}
    head = 0.0
    if any(st["last"] for st in stages):
        head = out["loss head"] = _loss_head(cfg, deg)
        if deg.pp == 1:  # the head's own saved terms are not saved yet when it runs
            head -= max(e.head for e in per_stage)
    # each part's own working set, traced (score tiles, dispatch buffers), where it occurs in its stage
    walks = {st["id"]: working_spikes(cfg, st) for st in stages}
    out["parts' working"] = max(max(w) for w in walks.values())
    if schedule is not None:
        out["step"] = _pipeline_step(cfg, stages, per_stage, pp_rank, schedule, walks, out)
    else:
        out["step"] = max(out["recompute replay"], head, *walks[stages[0]["id"]])
    z = zero_placement(cfg)
    if z.params_gathered:  # ZeRO-3: the units gathered at once (param_gather.py)
        out["gathered units"] = gathered_unit_bytes(cfg, schedule, buckets_by_unit, compute_bytes(cfg))
        out["step"] += out["gathered units"]
        if fp8_copies:  # their weights' FP8 copies, made once per gather (tools/planner/fp8_weights.py)
            out["gathered fp8 copies"] = fp8_copies
            out["step"] += fp8_copies
    if z.grads_sharded:  # ZeRO-2's staging (grad_rounds.py): per group, the round being filled (a bucket) and a
        # reduced output; at backward's start, the peak, none is in flight (the last bucket's launch folded them)
        out["gradient rounds"] = sum(4 * max(b) * (1 + 1 / deg[grad_group_of_zero(g)].size)
                                     for g, b in buckets.items() if b and not frozen_zero_group(g))
        out["step"] += out["gradient rounds"]
    if cfg.train.offload:
        out["offload fetch"] = max((b for e in per_stage for b in e.host_layers.values()), default=0.0)
        out["step"] += out["offload fetch"]
    rule = build_rule(cfg.train, cfg.precision, cfg.model)
    # the rule's temporaries are host memory when the optimizer is offloaded (per bucket, on the CPU)
    shards = {g: sum(b) // deg[grad_group_of_zero(g)].size for g, b in buckets.items()}
    largest = max(shards.values())
    out["optimizer step"] = max(GRAD_NORM_BYTES_PER_ELEMENT * min(GRAD_NORM_CHUNK, largest),
                                (0 if z.offloaded else rule.update_bytes_per_element) * largest)
    if not z.grads_sharded:  # ZeRO-1's shards (zero/grad_sync.py `BucketSync.finish`); a frozen group's stay unmade
        out["optimizer step"] += 4 * sum(n for g, n in shards.items() if not frozen_zero_group(g))
    return out


def _loss_head(cfg: Config, deg) -> float:
    """The "loss head" transient (`_transients`): the logits (B, S/cp, V/tp) of the main and MTP heads and what the
    loss makes of them at once."""
    t, m, c = cfg.train, cfg.model, compute_bytes(cfg)
    tokens, vocab = t.micro_batch * t.seq_len // deg.cp, m.vocab_size // deg.tp
    logits = tokens * vocab
    if deg.tp > 1:  # the vocab-parallel loss's fp32 row blocks: a shifted copy (and a cast of 16-bit logits)
        return logits * c * (1 + m.mtp.depth) + (2 if c == 2 else 1) * min(VOCAB_CE_ROWS, tokens) * vocab * 4
    if c == 4:
        return logits * (c * (1 + m.mtp.depth) + 8)
    # 16-bit logits are kept (saved terms); the loss works on fp32 row chunks of them
    return logits * c + 3 * min(CrossEntropy16.ROWS, tokens) * m.vocab_size * 4


def _pipeline_step(cfg: Config, stages: list[dict], per_stage: list, pp_rank: int, schedule, walks: dict,
                   out: dict[str, float]) -> float:
    """The "step" transient under a pipeline: what `schedule_peak` finds above the most saved bytes, with the
    forward spikes (a part's working set, the loss head's) at each forward's end, the backward spikes (a part's
    working set or a replay) at each backward's start, and what a split backward holds for its W."""
    sizes = stage_sizes(stages, per_stage)
    phases = {st["id"]: phase_count(st) for st in stages}
    held = {st["id"]: wgrad_held_bytes(cfg, st) if schedule.split_backward else 0.0 for st in stages}
    # the head's working set comes before its own saved terms are saved
    spikes = {st["id"]: max(walks[st["id"]][0], out["loss head"] - e.head if st["last"] else 0.0)
              for st, e in zip(stages, per_stage)}
    b_spikes = {i: max(w[1], out["recompute replay"]) for i, w in walks.items()}
    most, peak = schedule_peak(schedule, pp_rank, sizes, phases, held, spikes, b_spikes)
    return peak - most


def plan(cfg: Config, world: int | None = None, recipe: str = "", policies=POLICIES) -> Plan:
    """The plan of a validated config on `world` ranks (None: the recipe's own degrees). `policies`: the
    recompute policies whose saved activations RankPlan.activations lists (the recipe's own, which the
    memory and the peak use, always): --search asks for that one alone, skipping a trace per other policy."""
    layouts = rank_layouts(cfg, world)
    deg = layouts[0].dims
    cfg = cfg.replace(parallel=replace(cfg.parallel, dp=deg.dp))  # the blocks are traced on this mesh
    policy = cfg.recompute.policy
    policies = [p for p in POLICIES if p in policies or p == policy]
    ranks = []
    schedule = pipeline_schedule(cfg, deg)
    # one trace, forward and backward: the saved bytes, what a split backward holds, and what each part sends
    traced = trace_parts(cfg, cfg.data.has_loss_mask, backward=True)
    for pp_rank, layout in enumerate(layouts):
        stages = layout.stages
        rows, buckets = _zero_rows(cfg, layout)
        rows += cache_rows(cfg, layout)
        estimates = {p: _estimates(cfg, stages, p) for p in policies}
        acts, status = _activations(cfg, deg, stages, pp_rank, schedule, estimates)
        act_dims = {"pp": (deg.pp, "S"), "dp": (deg.dp, "S"), "cp": (deg.cp, "S"), "tp": (deg.tp, "S")}
        scale = deg.pp * deg.dp * deg.cp * deg.tp
        numel = acts[policy] * scale
        rows.append(StatePlacement("activations", "saved", int(numel) if float(numel).is_integer() else numel, 1,
                                   f"bytes, recompute {policy}", act_dims,
                                   "batch over dp, sequence over cp, SP/heads over tp; in-flight micro-batches on pp"))
        sends = (zero_traffic(cfg, layout, schedule) + trainer_traffic(cfg, deg, stages)
                 + traced_traffic(cfg, layout, traced, schedule))
        layers = [i for st in stages for i in st["layers"]]
        ranks.append(RankPlan(pp_rank, layers, rows, acts, status, sends, buckets,
                              _transients(cfg, deg, stages, buckets, pp_rank, schedule, estimates[policy],
                                          layout.zero_bucket_units(cfg), gathered_cache_bytes(cfg, layout, schedule)),
                              # train.offload's host bytes, walked through the schedule as the device's are
                              rank_saved_peak(schedule, pp_rank, stages, [e.on_host() for e in estimates[policy]]),
                              host_transfers(cfg, layout, buckets, compute_bytes(cfg))))
    notes = ["peak = parameters + gradients + optimizer + the larger of (saved activations + the step's transients) "
             "and the optimizer step's working set; held to one traced step by tools/dryrun.py. Not modeled: "
             "allocator fragmentation, the CUDA context, NCCL and library workspaces"]
    if cfg.precision.recipe == "fp8":
        kept = (f"precision.fp8_cache {list(cfg.precision.fp8_cache)} keeps those in FP8, the rest in bf16"
                if cfg.precision.fp8_cache else "activations are kept in bf16")
        weights = ("the weights' FP8 copies are made once per step and kept (row 'fp8 weight cache'; under ZeRO-3 "
                   "once per gather)" if any(r.memory["fp8 weight cache"] or "gathered fp8 copies" in r.transients
                                              for r in ranks) else "the weights' too")
        notes.append(f"fp8: {kept}; the FP8 copies of a GEMM's activation operands live only during that GEMM "
                     f"(transients), {weights}")
    degrees = dict(world=deg.world, pp=deg.pp, dp=deg.dp, cp=deg.cp, tp=deg.tp, ep=deg.ep, edp=deg.edp,
                   mirror=deg.pp_mirror, cp_a2a=deg.cp_a2a)
    return Plan(recipe, degrees, policy, ranks, notes)


# ---------------------------------------------------------------------------------------------
# printing


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def _mode(row: StatePlacement, dim: str) -> str:
    if dim not in row.on:
        return "-"
    size, mode = row.on[dim]
    return f"{mode}{size}" if size > 1 else mode if mode == "O" else "1"


def render(p: Plan, cfg: Config, terms: bool = False) -> str:
    d, c = p.degrees, param_counts(cfg.model)
    out = [f"moe_lc plan: {p.recipe} | world={d['world']} pp={d['pp']} dp={d['dp']} cp={d['cp']} tp={d['tp']} "
           f"ep={d['ep']} edp={d['edp']}" + (f" cp_a2a={d['cp_a2a']}" if d.get("cp_a2a", 1) > 1 else "")
           + (" (dualpipe mirrors)" if d["mirror"] else ""),
           f"model {c['total'] / 1e6:,.2f}M params ({c['activated'] / 1e6:,.2f}M activated) | precision "
           f"{cfg.precision.recipe}, optimizer {cfg.train.optimizer}"
           + (f" (moments {cfg.precision.adam_moments})" if cfg.train.optimizer == "adamw" else "") + " | micro-batch "
           f"{cfg.train.micro_batch} x {cfg.train.seq_len} tokens, {cfg.train.microbatches(d['dp'])} per step | "
           f"recompute {p.policy}", ""]
    legend = ", ".join(f"{k} {v}" for k, v in MODES.items())
    for r in p.ranks:
        out.append(f"== pipeline rank {r.pp_rank}: layers {r.layers}" if d["pp"] > 1 else "== every rank")
        dims = [dim for dim in DIM_ORDER if any(dim in row.on for row in r.table)]
        out.append(f"Placement ({legend}; N = group size, - = not placed on that dim)")
        w = max(15, 2 + max(len(row.part) for row in r.table))
        sw = max(12, 2 + max(len(row.state) for row in r.table))
        header = f"{'state':<{sw}}{'part':<{w}}{'dtype':<28}" + "".join(f"{x:>9}" for x in dims) + f"{'MiB/rank':>12}"
        out.append(header)
        for row in r.table:  # an offloaded row's MiB are host memory
            out.append(f"{row.state:<{sw}}{row.part:<{w}}{row.dtype:<28}" + "".join(f"{_mode(row, x):>9}" for x in dims)
                       + f"{_mib(row.host_bytes_per_rank() or row.bytes_per_rank()):>12}"
                       + (f"   {row.note}" if row.note else ""))
        mem = r.memory
        out.append("Memory per rank (MiB): " + ", ".join(f"{k} {_mib(v)}" for k, v in mem.items()
                                                          if v or k != "fp8 weight cache")
                   + f", total {_mib(r.total_bytes)}")
        if r.host_transfers:
            out.append("Host memory per rank (MiB): " + ", ".join(f"{k} {_mib(v)}" for k, v in r.host_memory.items() if v)
                       + " | copies per step (MiB): " + ", ".join(f"{k} {_mib(v)}" for k, v in r.host_transfers.items()))
        out.append("Transients per rank (MiB): " + ", ".join(f"{k} {_mib(v)}" for k, v in r.transients.items())
                   + f" | peak {_mib(r.peak_bytes())}")
        out.append("Saved activations per rank by recompute policy (MiB): " + ", ".join(
            f"{k} {_mib(v)}" + ("" if r.activation_status[k] == CHECKED else " [estimate]") for k, v in r.activations.items()))
        out.append("Communication per step, bytes this rank sends (status: exact unless marked):")
        for t in r.traffic:
            mark = "" if t.status == "exact" else f"   [{t.status}]"
            out.append(f"  {t.key:<36}{t.bytes:>16,.0f}   {t.what}{mark}")
        out.append("")
    if terms:
        out += _render_terms(cfg)
    out += [f"note: {n}" for n in p.notes]
    return "\n".join(out)


def _render_terms(cfg: Config) -> list[str]:
    """What one micro-batch keeps on one rank, tensor by tensor, as traced (tools/planner/block_trace.py)."""
    e = stage_estimate(cfg)
    out = [f"Saved tensors of one micro-batch on one rank, traced under recompute {cfg.recompute.policy} (MiB; "
           "the module that saved it: the op that made it, dtype[local shape]):"]
    for part, tensors in e.tensors.items():
        out.append(f"  {part}: {_mib(sum(n for n, _ in tensors))}")
        out += [f"    {_mib(n):>12}  {what}" for n, what in tensors]
    return out + [""]
