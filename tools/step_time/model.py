"""Predicted step time, tokens/s/GPU and MFU of a recipe's layout on a named cluster.

    python -m tools.plan RECIPE --cluster h800|h100|h200|b200|gb200 [--bench FILE] [--impl fused|fused_a2a_overlap|eager]
                         [--set cluster.KEY=V] [--set eff.KEY=V] [--json]

Compute on a GPU cluster (tools/step_time/compute.py): every kernel one micro-batch launches through each part of a
stage (embedding, each block, head), traced on the meta device with its shapes (kernel_trace.py), forward (F),
backward (B: input gradients and what recomputation replays) and weight gradients (W), each priced by the kernel
rates of its kind and shape (kernel_rates.py: a roofline with a per-launch cost fitted to an H100's benchmark
tables; clusters.py scales them to each cluster's peaks). `--impl` says whose memory-bound kernels: "fused"
(Megatron / Transformer Engine / DeepSeek: fused norms, SwiGLU, RoPE, permutation and loss at the bytes work.py
counts), "fused_a2a_overlap" (the same, and the EP all-to-all beside the other micro-batch's compute in 1F1B's
steady state: Megatron-Core's --overlap-moe-expert-parallel-comm) or "eager" (this repo's trainer: every traced
aten op a kernel of its own, and the host's dispatch as a floor). On the `cpu` cluster each Work's FLOPs over one
measured rate per kind, plus the host's cost per aten op (work.py `flop_seconds`); on a GPU cluster the same with
`predict(..., formulas=True)`, at the cluster's peak x the kind's efficiency, for a layout the model code cannot
trace at its size (DeepSeek-V4 at 1M with the reference core: tools/planner/v4_context.py). The rank whose stages
cost most sets every chunk's cost (the simulator takes one cost per action kind).

Communication: the planner's bytes per group and op (tools/plan.py: what this rank sends per step),
each over its link: a group whose ranks share this rank's node (mesh rank order, `gpus_per_node`)
uses NVLink, one that leaves it the scale-out network; an all-to-all splits its bytes between the two
by where its peers are. What hides what:
  tp              exposed (issued on the critical path of every block)
  cp              the ring hides behind the attention core it feeds; the excess is exposed (under
                  parallel.cp_a2a > 1 the ring is cp_ring, and cp_a2a's all-to-alls are exposed in F and B)
  ep all-to-all   exposed in F and B; in DualPipe's F&B (parallel.overlap) one micro-batch's
                  all-to-alls run beside the other's compute: F&B = max(all-to-alls, compute + 20/132 of
                  them, the SMs their kernels take: COMM_SM_SHARE); under --impl fused_a2a_overlap every
                  F and B pair likewise
  pp              the simulator's transfer latency (one hidden tensor); exposed = the makespan it adds
  ZeRO            gradient reduce-scatters hide behind one chunk's backward (ZeRO-1's, the last one, which
                  finishes the buckets) or every backward (ZeRO-2/3's rounds per micro-batch); ZeRO-3's unit
                  gathers behind the forwards and backwards they prefetch for; ZeRO-1's parameter
                  all-gather and the trainer's all-reduces are exposed
  other           subgroups made on demand (cp_tp's document-balance sums, tp_kv: the tp ranks
                  sharing a kv head): exposed, after the pipeline
Then the optimizer step (optimizer_time.py: one fused pass over the rank's optimizer state, or under "eager" this
repo's ZeroOptimizer passes and Muon's Newton-Schulz, traced).
Host costs (a CPU cluster's; on the GPU ones each phase is instead floored at its traced ops x host_op_us, the
dropless dispatcher's host read per MoE layer keeping the host from running ahead: compute.py): each aten op
a part dispatches in F, B and W (tools/planner/block_trace.py's count) costs `op_us`, each collective call
`call_us` + `link_latency_us` and its bytes a copy at `copy_gbps`; the host's part of the EP all-to-alls
is on the rank's own path, so DualPipe's F&B hides only their link time. Not modelled: collective
latencies on GPUs, SMs given to collectives other than the overlapped EP all-to-all, routing imbalance (the
planner's all-to-all bytes are balanced routing), stage imbalance beyond the slowest rank.
Stated with it: model TFLOP/s with attention counted causally (MFU's) and in full (flop_conventions.py), and a
warning per group that would fit one NVLink domain but straddles two (nvlink_domains.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from moe_lc.config import Config
from moe_lc.model.counting import train_flops_per_token
from moe_lc.parallel.build import pipeline_plan
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.pipeline import FB, B, Costs, F, simulate
from .clusters import ACHIEVED_RATES, Cluster
from .compute import kernel_rates, stage_seconds
from .flop_conventions import model_flops_keys, render_flops
from .nvlink_domains import group_partition, plan_warnings, render_warnings
from .optimizer_time import optimizer_seconds
# (block_work: tools/bench/cpu_costs.py imports it from here)
from .work import Seconds, act_bytes, block_work, flop_seconds, stage_work
from ..planner.pipeline_memory import stage_forwards

ZERO_GROUPS = ("dp_cp", "edp", "dp_cp_tp", "dp", "world")
IMPLEMENTATIONS = ("fused", "fused_a2a_overlap", "eager")  # (tools/step_time/compute.py; `_action_costs`)
# The SMs an EP all-to-all overlapped with compute takes from it: DeepSeek-V3's dispatch and combine kernels run on
# 20 of the H800's 132 SMs (DeepSeek-V3 report, arXiv 2412.19437, 3.2.2; DeepEP's default); Megatron's overlapped
# all-to-all (NCCL, or DeepEP under its flex dispatcher) is taken to need as many
COMM_SM_SHARE = 20 / 132


def link_seconds(dims: ParallelDims, rank: int, group: str, op: str, nbytes: float, cluster: Cluster,
                 eff: dict[str, float], calls: float = 0.0) -> float:
    """Time to send `nbytes` (what `rank` sends of this op) over the group's links: NVLink to the peers
    on its node, the network to the others (a ring over several nodes runs at the network's rate). A
    subgroup made on demand (e.g. "tp_kv": the tp ranks sharing a kv head) is placed as its mesh dim.
    Plus, in `calls` calls, what a host pays per call (the cluster's call_us and link_latency_us) and the
    backend's copy of the bytes (copy_gbps): 0 on the GPU clusters."""
    ranks = next(r for r in group_partition(dims, group) if rank in r)
    peers = [r for r in ranks if r != rank]
    if not peers or not (nbytes or calls):
        return 0.0
    return host_seconds(nbytes, calls, cluster) + _bytes_seconds(rank, peers, op, nbytes, cluster, eff)


def host_seconds(nbytes: float, calls: float, cluster: Cluster) -> float:
    """The part of `link_seconds` the rank's host spends itself (per call and the backend's copy): no compute
    of its own runs beside it, so no overlap hides it. The link latency is the link's, not the host's."""
    return calls * cluster.call_us * 1e-6 + (nbytes / (cluster.copy_gbps * 1e9) if cluster.copy_gbps else 0.0)


def _bytes_seconds(rank: int, peers: list[int], op: str, nbytes: float, cluster: Cluster, eff: dict[str, float]) -> float:
    node = rank // cluster.gpus_per_node
    off = sum(r // cluster.gpus_per_node != node for r in peers) / len(peers)
    nv, net = cluster.nvlink_gbps * 1e9 * eff["link"], cluster.net_gbps * 1e9 * eff["link"]
    if op == "all_to_all":
        return max(nbytes * off / net, nbytes * (1 - off) / nv)
    return nbytes / (net if off else nv)


@dataclass
class RankCosts:
    """Per action (one micro-batch through one chunk) on one pipeline rank, and its step totals."""

    pp_rank: int
    actions: int  # micro-batch x chunk passes per step
    compute: Seconds
    comm_s: dict[str, float] = field(default_factory=dict)  # group -> link seconds per step, every op
    host_s: dict[str, float] = field(default_factory=dict)  # group -> the host's part of comm_s (host_seconds)
    ops: dict[tuple[str, str], float] = field(default_factory=dict)  # (group, op) -> seconds per step
    compute_by_kind: dict[str, float] = field(default_factory=dict)  # kernel kind -> F + B seconds per step


def stage_cost(cfg: Config, stage: tuple, cluster: Cluster, eff: dict[str, float], impl: str,
               formulas: bool = False) -> tuple[Seconds, dict]:
    """(Seconds, {kind: F + B seconds}) of one micro-batch through `stage` (layers, first, last): its traced kernels
    at their shapes' rates on a GPU cluster (tools/step_time/compute.py), or the Work at one measured rate per
    kind plus the host's op costs on the `cpu` cluster. `formulas`: the Work at the cluster's rate per kind on a GPU
    cluster too, for a layout the model code cannot trace at its size (DeepSeek-V4 at 1M with the reference core:
    tools/planner/v4_context.py)."""
    if cluster.name in ACHIEVED_RATES or formulas:
        sec = _with_ops(flop_seconds(cfg, stage_work(cfg, *stage), cluster, eff), cfg, stage, cluster)
        return sec, {"compute": sec.F + sec.B}
    sec, kinds = stage_seconds(cfg, *stage, cluster, eff, impl)
    with_ops = _with_ops(sec, cfg, stage, cluster)  # (a host cost per op set on a GPU cluster: serial, as the CPU's)
    if with_ops is not sec:
        kinds["host"] = kinds.get("host", 0.0) + (with_ops.F + with_ops.B) - (sec.F + sec.B)
    return with_ops, kinds


def rank_costs(cfg: Config, plan, cluster: Cluster, eff: dict[str, float], schedule, layers,
               impl: str = "fused", formulas: bool = False) -> list[RankCosts]:
    """Every pipeline rank's mean cost per action and its communication per step."""
    p, deg = cfg.parallel, plan.degrees
    out = []
    for rp in plan.ranks:
        if schedule is None:
            runs = {0: cfg.train.microbatches(deg["dp"])}
            stages = {0: (list(range(cfg.model.n_layers)), True, True)}
        else:
            runs = stage_forwards(schedule, rp.pp_rank)
            stages = {s: (layers[s], s == 0, s == schedule.n_stages - 1) for s in runs}
        n = sum(runs.values())
        costs = {s: stage_cost(cfg, stages[s], cluster, eff, impl, formulas) for s in runs}
        k = [runs[s] / n for s in runs]
        total = [costs[s][0] for s in runs]
        mean = Seconds(*(sum(w * getattr(x, f) for w, x in zip(k, total)) for f in Seconds.__dataclass_fields__))
        dims = ParallelDims.from_config(p, deg["world"])
        rank = dims.rank_of(rp.pp_rank, 0, 0, 0)
        rc = RankCosts(rp.pp_rank, n, mean)
        for s in runs:
            for kind, sec in costs[s][1].items():
                rc.compute_by_kind[kind] = rc.compute_by_kind.get(kind, 0.0) + runs[s] * sec
        calls = _step_calls(cfg, {s: (runs[s], stages[s]) for s in runs}) if cluster.call_us or cluster.link_latency_us \
            else None
        for t in rp.traffic:
            n_calls = _row_calls(t, calls)
            s = link_seconds(dims, rank, t.group, t.op, t.bytes, cluster, eff, n_calls)
            if s:
                rc.host_s[t.group] = rc.host_s.get(t.group, 0.0) + host_seconds(t.bytes, n_calls, cluster)
            rc.ops[(t.group, t.op)] = rc.ops.get((t.group, t.op), 0.0) + s
            rc.comm_s[t.group] = rc.comm_s.get(t.group, 0.0) + s
        out.append(rc)
    return out


def _traced(cfg: Config):
    from ..planner.block_trace import trace_parts  # (the planner traced it already: cached)
    return trace_parts(cfg, cfg.data.has_loss_mask, backward=True)


def _parts(cfg: Config, layers: list[int], first: bool, last: bool) -> list[str]:
    from ..planner.block_trace import block_kind
    return ["embed"] * first + [block_kind(cfg.model, i) for i in layers] + ["head"] * last


def _with_ops(sec: Seconds, cfg: Config, stage: tuple, cluster: Cluster) -> Seconds:
    """sec plus the framework time of the aten ops one micro-batch dispatches through the stage (F, its
    B and W as tools/planner/block_trace.py counts them) at the cluster's op_us; sec itself where op_us is 0."""
    if not cluster.op_us:
        return sec
    ops = _traced(cfg).ops
    n = {k: sum(ops[p].get(k, 0) for p in _parts(cfg, *stage)) for k in "FBW"}
    op_s = cluster.op_us * 1e-6
    return Seconds(sec.F + n["F"] * op_s, sec.B + (n["B"] + n["W"]) * op_s, sec.W + n["W"] * op_s,
                   sec.attention_F, sec.attention_B)


def _step_calls(cfg: Config, stages: dict[int, tuple[int, tuple]]) -> Counter:
    """(group, op) -> collective calls per step of the model's parts: {stage: (micro-batches, stage)}."""
    calls, traced = Counter(), _traced(cfg).calls
    for runs, stage in stages.values():
        for part in _parts(cfg, *stage):
            for key, k in traced.get(part, {}).items():
                calls[key] += runs * k
    return calls


def _row_calls(t, calls: Counter | None) -> float:
    """Calls behind one traffic row (0 where the cluster has no per-call cost: `calls` None): the traced
    parts' count, none for the stage sends (the simulator's transfers carry their own call), else one
    (a ZeRO bucket's or the trainer's collective)."""
    if calls is None or t.group == "pp":
        return 0.0
    return calls[(t.group, t.op)] if t.what.startswith("traced") else 1.0


def _per_action(rc: RankCosts, group: str) -> float:
    """Link seconds of `group` per action (every op of the group)."""
    return rc.comm_s.get(group, 0.0) / rc.actions


def _action_counts(schedule, rank: int) -> Counter:
    """{"F": alone, "B": alone, "FB": overlapped pairs} of `rank`'s compute actions."""
    kinds = Counter()
    for a in schedule.actions[rank]:
        if isinstance(a, FB):
            kinds["FB"] += 1
        elif isinstance(a, (F, B)):
            kinds[type(a).__name__] += 1
    return kinds


def predict(cfg: Config, plan, cluster: Cluster, eff: dict[str, float], impl: str = "fused",
            formulas: bool = False) -> dict:
    """The `predicted` block of tools/plan.py --cluster (see the module doc); `impl` one of IMPLEMENTATIONS;
    `formulas`: compute from the model's counts (work.py) instead of traced kernels (`stage_cost`)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl {impl!r}: one of {', '.join(IMPLEMENTATIONS)}")
    deg, t = plan.degrees, cfg.train
    schedule, layers = pipeline_plan(cfg, t.microbatches(deg["dp"]))
    ranks = rank_costs(cfg, plan, cluster, eff, schedule, layers, "eager" if impl == "eager" else "fused", formulas)
    rc = max(ranks, key=lambda r: r.compute.F + r.compute.B + sum(r.comm_s.get(g, 0) for g in (
        "tp", "cp", "cp_a2a", "cp_ring", "ep")) / r.actions)
    costs, per_action = _action_costs(cfg, rc, schedule, impl, 0.0 if cluster.name in ACHIEVED_RATES else COMM_SM_SHARE)
    hidden = t.micro_batch * t.seq_len // (deg["cp"] * deg["tp"]) * cfg.model.dim * act_bytes(cfg)
    pp_send = (link_seconds(ParallelDims.from_config(cfg.parallel, deg["world"]), rc.pp_rank * deg["world"] // deg["pp"],
                            "pp", "send", hidden, cluster, eff, calls=1.0) if schedule else 0.0)
    if schedule is None:
        pipeline_s, bubble, kinds = rc.actions * (costs["F"] + costs["B"]), 0.0, Counter(F=rc.actions, B=rc.actions)
        pp_exposed = 0.0
    else:
        sim = simulate(schedule, Costs(comm=pp_send, **costs))
        pipeline_s, bubble = sim.makespan, sim.published_bubble
        pp_exposed = sim.makespan - simulate(schedule, Costs(comm=0.0, **costs)).makespan
        kinds = _action_counts(schedule, rc.pp_rank)
    exposed = _exposed(cfg, rc, per_action, kinds, pp_exposed)
    outside = [g for g in exposed if g not in ("tp", "cp", "cp_ring", "cp_a2a", "ep", "pp", *ZERO_GROUPS)]
    rp = next(r for r in plan.ranks if r.pp_rank == rc.pp_rank)
    optimizer = _optimizer(cfg, rp, deg, cluster, eff, impl)
    step = pipeline_s + sum(exposed[g] for g in (*ZERO_GROUPS, *outside)) + sum(optimizer.values())
    tokens = t.global_batch * t.seq_len
    flops = train_flops_per_token(cfg.model, t.seq_len)
    peak = cluster.peak_tflops("fp32" if cfg.precision.recipe == "fp32" else "bf16") * 1e12
    achieved = flops * tokens / step / deg["world"]
    return {"cluster": cluster.__dict__, "efficiency": dict(eff), "impl": impl, "step_s": step,
            "tokens_per_s_per_gpu": tokens / step / deg["world"], "mfu": achieved / peak,
            "model_tflops_per_gpu": achieved / 1e12, "model_flops_per_token": flops,  # causal: MFU's numerator
            **model_flops_keys(cfg.model, t.seq_len, tokens / step / deg["world"]),
            "warnings": plan_warnings(cfg, plan, cluster, rc.pp_rank),
            "pipeline_s": pipeline_s, "bubble_share": bubble / pipeline_s if pipeline_s else 0.0,
            "optimizer_s": sum(optimizer.values()), "exposed_comm_s": {g: s for g, s in exposed.items() if s > 0},
            "compute_s": {k: v for k, v in rc.compute_by_kind.items() if v > 0},
            "terms_s": step_terms(rc, bubble, exposed, optimizer),
            "comm_s": rc.comm_s, "costs_s": {**costs, "FB": costs["FB"] or costs["F"] + costs["B"], "comm": pp_send},
            "slowest_pp_rank": rc.pp_rank, "actions": dict(kinds),
            "mfu_peak": "bf16 dense" if cfg.precision.recipe != "fp32" else "fp32"}


def _action_costs(cfg: Config, rc: RankCosts, schedule, impl: str, sm_share: float = 0.0) -> tuple[dict, dict]:
    """(the simulator's cost per action kind, F/B/W/FB, and each group's exposed seconds per action): tp's
    collectives exposed, the cp ring beyond the attention it hides behind, hybrid cp's all-to-alls, the EP
    all-to-alls exposed, or beside the other micro-batch's compute in DualPipe's F&B pairs, and with
    `impl` "fused_a2a_overlap" in 1F1B's steady state too (Megatron-Core's --overlap-moe-expert-parallel-comm:
    each F runs beside another micro-batch's B); `sm_share` the SMs the overlapped all-to-all kernels take from
    the compute beside them (COMM_SM_SHARE on a GPU)."""
    c = rc.compute
    tp = _per_action(rc, "tp") / 2  # forward and backward each move half (all-gather <-> reduce-scatter)
    ring = "cp_ring" if cfg.parallel.cp_a2a > 1 else "cp"  # hybrid cp: the ring over cp / cp_a2a positions
    cp_f, cp_b = _per_action(rc, ring) / 3, 2 * _per_action(rc, ring) / 3  # backward rings K, V and their grads
    cp_f, cp_b = max(0.0, cp_f - c.attention_F), max(0.0, cp_b - c.attention_B)
    a2a = _per_action(rc, "cp_a2a") / 2  # hybrid cp's all-to-alls: on the critical path, same bytes F and B
    ep = _per_action(rc, "ep") / 2
    ep_host = rc.host_s.get("ep", 0.0) / rc.actions / 2  # (0 on GPUs) what the host spends, unhidable
    Fc, Bc = c.F + tp + cp_f + a2a + ep_host, c.B + tp + cp_b + a2a + ep_host
    ep -= ep_host
    overlap = cfg.parallel.pp_schedule == "dualpipe" and cfg.parallel.overlap and schedule is not None
    # a pair's all-to-alls (2 ep) beside its compute: the compute runs on the SMs the communication kernels leave,
    # so the pair takes max(all-to-alls, compute + sm_share x all-to-alls); beyond the compute, max(those two - it)
    beside = max(0.0, 2 * ep - (Fc + Bc), sm_share * 2 * ep)
    if impl == "fused_a2a_overlap" and not overlap:  # every F beside a B
        ep = beside / 2
    costs = dict(F=Fc + ep, B=Bc + ep, W=c.W, FB=Fc + Bc + beside if overlap else None)
    ep_pairs = (beside if overlap else 2 * ep) + 2 * ep_host
    return costs, {"tp": tp, ring: cp_f + cp_b, "ring": ring, "cp_a2a": a2a, "ep": ep + ep_host, "ep_pairs": ep_pairs}


def _exposed(cfg: Config, rc: RankCosts, a: dict, kinds: Counter, pp_exposed: float) -> dict[str, float]:
    """Exposed seconds per group over the step. ZeRO: a reduce-scatter hides behind the backward that runs beside
    it (ZeRO-1's once a step behind the last chunk's; ZeRO-2/3's rounds behind every backward), ZeRO-3's unit
    gathers behind the forwards and backwards they prefetch for (one unit ahead); the rest is exposed."""
    c, n = rc.compute, rc.actions
    place = cfg.parallel.placement
    exposed = {"tp": 2 * a["tp"] * n, a["ring"]: a[a["ring"]] * n, "cp_a2a": 2 * a["cp_a2a"] * n,
               "ep": a["ep"] * (kinds["F"] + kinds["B"]) + a["ep_pairs"] * kinds["FB"], "pp": pp_exposed}
    rs_window = c.B * (n if place.grads == "sharded" or place.params == "sharded_gather" else 1)
    ag_window = (c.F + c.B) * n if place.params == "sharded_gather" else 0.0
    for g in ZERO_GROUPS:
        rs, ag = rc.ops.get((g, "reduce_scatter"), 0.0), rc.ops.get((g, "all_gather"), 0.0)
        rest = sum(s for (h, op), s in rc.ops.items() if h == g and op not in ("reduce_scatter", "all_gather"))
        exposed[g] = max(0.0, rs - rs_window) + max(0.0, ag - ag_window) + rest
    exposed.update({g: s for g, s in rc.comm_s.items() if g not in exposed})  # subgroups made on demand: exposed
    return exposed


def _optimizer(cfg: Config, rp, deg: dict, cluster: Cluster, eff: dict[str, float], impl: str) -> dict[str, float]:
    """{kind: seconds} of the optimizer step on the slowest rank (tools/step_time/optimizer_time.py); on the `cpu`
    cluster one memory-bound pass over its state at the measured rate."""
    mem = rp.memory
    if cluster.name in ACHIEVED_RATES:
        return {"memory": (2 * mem["optimizer"] + mem["params"]) / (cluster.hbm_gbps * 1e9 * eff["memory"])}
    return optimizer_seconds(cfg, mem, rp.layers, deg, cluster, kernel_rates(cfg, cluster, eff),
                             "eager" if impl == "eager" else "fused")


def step_terms(rc: RankCosts, bubble: float, exposed: dict[str, float], optimizer: dict[str, float]) -> dict[str, float]:
    """The step's seconds by cause, largest first: compute by kernel kind (F + B of the slowest rank's actions),
    the pipeline bubble, each group's exposed communication, the optimizer."""
    terms = {f"compute {k}": v for k, v in rc.compute_by_kind.items()}
    terms.update({"bubble": bubble, **{f"exposed {g}": s for g, s in exposed.items()},
                  "optimizer": sum(optimizer.values())})
    return dict(sorted(((k, v) for k, v in terms.items() if v > 0), key=lambda kv: -kv[1]))


def render(pred: dict) -> str:
    """Text lines of the prediction (tools/plan.py prints them after the plan)."""
    c, k = pred["cluster"], pred["costs_s"]
    out = [f"Predicted on {c['name']} ({c['bf16_tflops']:g} BF16 / {c['fp8_tflops']:g} FP8 TFLOP/s, HBM "
           f"{c['hbm_gbps']:g} GB/s, NVLink {c['nvlink_gbps']:g} GB/s, network {c['net_gbps']:g} GB/s per GPU, "
           f"{c['gpus_per_node']} per node), {pred['impl']} kernels; compute efficiencies "
           + ", ".join(f"{a} {b:.2f}" for a, b in pred["efficiency"].items() if "." not in a),
           f"  step {pred['step_s']:.3f} s | {pred['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU | "
           f"{pred['model_tflops_per_gpu']:.0f} model TFLOP/s/GPU | MFU {pred['mfu']:.1%} of the {pred['mfu_peak']} peak",
           f"  pipeline {pred['pipeline_s']:.3f} s (bubble {pred['bubble_share']:.1%}, slowest rank pp {pred['slowest_pp_rank']}), "
           f"optimizer {pred['optimizer_s']:.3f} s; per action F {k['F'] * 1e3:.2f} B {k['B'] * 1e3:.2f} "
           f"W {k['W'] * 1e3:.2f} F&B {k['FB'] * 1e3:.2f} ms, pp transfer {k['comm'] * 1e3:.2f} ms",
           "  communication per step, link time (exposed): " + ", ".join(
               f"{g} {s:.3f} s ({pred['exposed_comm_s'].get(g, 0.0):.3f})" for g, s in pred["comm_s"].items()),
           "  largest terms of the step: " + ", ".join(f"{t} {s:.3f} s" for t, s in list(pred["terms_s"].items())[:4])]
    return "\n".join(out[:2] + render_flops(pred) + out[2:] + render_warnings(pred))
