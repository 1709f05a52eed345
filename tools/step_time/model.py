"""Predicted step time, tokens/s/GPU and MFU of a recipe's layout on a named cluster.

    python -m tools.plan RECIPE --cluster h800|h100|h200|b200|gb200 [--bench FILE]
                         [--set cluster.KEY=V] [--set eff.KEY=V] [--json]

Compute: each block's forward FLOPs per token by kernel kind (moe_lc/model/counting.py's terms: GEMMs
of the attention projections, dense FFN and shared experts; grouped GEMMs of the routed experts; the
causal attention core; memory-bound bytes of norms, SwiGLU, residual adds and the MoE permutation),
times the tokens one rank computes per micro-batch (micro_batch x seq_len / (cp x tp)), over the
cluster's peak x the kind's efficiency (tools/step_time/clusters.py). Per chunk of the pipeline schedule:
F = forward, W = the weight-gradient GEMMs (as many FLOPs as the forward's GEMMs), B = full backward
(2x the GEMMs, ATTENTION_BWD x the attention core, 2x the memory-bound bytes) plus what the recompute
policy replays. The rank whose stages cost most sets every chunk's cost (the simulator takes one cost
per action kind).

Communication: the planner's bytes per group and op (tools/plan.py: what this rank sends per step),
each over its link: a group whose ranks share this rank's node (mesh rank order, `gpus_per_node`)
uses NVLink, one that leaves it the scale-out network; an all-to-all splits its bytes between the two
by where its peers are. What hides what:
  tp              exposed (issued on the critical path of every block)
  cp              the ring hides behind the attention core it feeds; the excess is exposed (under
                  parallel.cp_a2a > 1 the ring is cp_ring, and cp_a2a's all-to-alls are exposed in F and B)
  ep all-to-all   exposed in F and B; in DualPipe's F&B (parallel.overlap) one micro-batch's
                  all-to-alls run beside the other's compute: F&B = max(compute, all-to-alls)
  pp              the simulator's transfer latency (one hidden tensor); exposed = the makespan it adds
  ZeRO            gradient reduce-scatters hide behind one chunk's backward (the last one, which
                  finishes the buckets); parameter all-gathers and the trainer's all-reduces are exposed
  other           subgroups made on demand (cp_tp's document-balance sums, tp_kv: the tp ranks
                  sharing a kv head): exposed, after the pipeline
Then the optimizer step, memory-bound over the rank's optimizer state.
Host costs (a CPU cluster's; 0 on the GPU ones, whose launches run ahead of the kernels): each aten op
a part dispatches in F, B and W (tools/planner/block_trace.py's count) costs `op_us`, each collective call
`call_us` + `link_latency_us` and its bytes a copy at `copy_gbps`; the host's part of the EP all-to-alls
is on the rank's own path, so DualPipe's F&B hides only their link time. Not modelled: kernel launch
and collective latencies on GPUs, SMs given to communication kernels, routing imbalance (the planner's
all-to-all bytes are balanced routing), stage imbalance beyond the slowest rank.
Stated with it: model TFLOP/s with attention counted causally (MFU's) and in full (flop_conventions.py), and a
warning per group that would fit one NVLink domain but straddles two (nvlink_domains.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from moe_lc.config import Config
from moe_lc.config.attention_kinds import attention_kind
from moe_lc.model.counting import attention_core_flops, attention_params, attention_vector_params, \
    shared_expert_params, train_flops_per_token
from moe_lc.parallel.build import pipeline_plan
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.pipeline import FB, B, Costs, F, simulate
from .clusters import Cluster
from .flop_conventions import model_flops_keys, render_flops
from .nvlink_domains import group_partition, plan_warnings, render_warnings
from ..planner.pipeline_memory import stage_forwards

ATTENTION_BWD = 2.5  # flash attention's backward recomputes the scores: 2.5x the forward FLOPs (FlashAttention-2 paper)
LOSS_BYTES = 12  # per vocabulary entry per token beside the logits: fp32 copy, log-softmax write and read
ZERO_GROUPS = ("dp_cp", "edp", "dp_cp_tp", "dp", "world")


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

    def __add__(self, o: "Work") -> "Work":
        rep = (self.recomputed or Work()) + (o.recomputed or Work()) if (self.recomputed or o.recomputed) else None
        return Work(self.gemm + o.gemm, self.gemm_bf16 + o.gemm_bf16, self.grouped + o.grouped,
                    self.attention + o.attention, self.memory + o.memory, rep)

    def scaled(self, k: float) -> "Work":
        return Work(self.gemm * k, self.gemm_bf16 * k, self.grouped * k, self.attention * k, self.memory * k,
                    self.recomputed.scaled(k) if self.recomputed else None)


def block_work(cfg: Config, layer_id: int) -> Work:
    """Forward work per token of block `layer_id` (before any split over ranks)."""
    m, c = cfg.model, _act_bytes(cfg)
    D, seq = m.dim, cfg.train.seq_len
    attn = 2 * (attention_params(m) - attention_vector_params(m))
    core = attention_core_flops(m, seq)
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
    w.recomputed = _replay(cfg, w, norms * c, swiglu * c)
    return w


def _replay(cfg: Config, w: Work, norm_bytes: float, swiglu_bytes: float) -> Work | None:
    """What backward recomputes of one block's forward under the recompute policy."""
    policy, items, m = cfg.recompute.policy, cfg.recompute.selective, cfg.model
    if policy == "full":
        return Work(w.gemm, w.gemm_bf16, w.grouped, w.attention, w.memory)
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


def _act_bytes(cfg: Config) -> int:
    return 4 if cfg.precision.recipe == "fp32" else 2


def stage_work(cfg: Config, layers: list[int], first: bool, last: bool) -> Work:
    """One micro-batch through a stage on one rank: per-token work x micro_batch x seq_len / (cp x tp)."""
    m, c, D = cfg.model, _act_bytes(cfg), cfg.model.dim
    w = Work(memory=2 * D * c if first else 0.0)  # the embedding lookup
    for i in layers:
        w = w + block_work(cfg, i)
    if last:
        head = Work(gemm_bf16=2 * m.vocab_size * D, memory=m.vocab_size * (c + LOSS_BYTES))
        w = w + head
        for _ in range(m.mtp.depth):  # projection 2D -> D, one block like the last, its own head pass
            w = w + Work(gemm=2 * 2 * D * D) + block_work(cfg, m.n_layers - 1) + head
    p, t = cfg.parallel, cfg.train
    return w.scaled(t.micro_batch * t.seq_len / (p.cp * p.tp))


@dataclass
class Seconds:
    """A Work's time: forward, full backward (replay included), and the weight-gradient part."""

    F: float
    B: float
    W: float
    attention_F: float
    attention_B: float


def seconds(cfg: Config, w: Work, cluster: Cluster, eff: dict[str, float]) -> Seconds:
    fp8, fp32 = cfg.precision.recipe == "fp8", cfg.precision.recipe == "fp32"
    wide = cluster.peak_tflops("fp32" if fp32 else "bf16") * 1e12
    gemm_peak = cluster.peak_tflops("fp8") * 1e12 if fp8 else wide

    def parts(x: Work) -> tuple[float, float, float]:  # (GEMMs, attention, memory) seconds
        g = (x.gemm / (gemm_peak * eff["gemm_fp8" if fp8 else "gemm"]) + x.gemm_bf16 / (wide * eff["gemm"])
             + x.grouped / (gemm_peak * eff["grouped_gemm_fp8" if fp8 else "grouped_gemm"]))
        return g, x.attention / (wide * eff["attention"]), x.memory / (cluster.hbm_gbps * 1e9 * eff["memory"])

    g, a, mem = parts(w)
    replay = sum(parts(w.recomputed)) if w.recomputed else 0.0
    return Seconds(g + a + mem, 2 * g + ATTENTION_BWD * a + 2 * mem + replay, g, a, ATTENTION_BWD * a)


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


def rank_costs(cfg: Config, plan, cluster: Cluster, eff: dict[str, float], schedule, layers) -> list[RankCosts]:
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
        total = [_with_ops(seconds(cfg, stage_work(cfg, *stages[s]), cluster, eff), cfg, stages[s], cluster)
                 for s in runs]
        k = [runs[s] / n for s in runs]
        mean = Seconds(*(sum(w * getattr(x, f) for w, x in zip(k, total)) for f in Seconds.__dataclass_fields__))
        dims = ParallelDims.from_config(p, deg["world"])
        rank = dims.rank_of(rp.pp_rank, 0, 0, 0)
        rc = RankCosts(rp.pp_rank, n, mean)
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


def predict(cfg: Config, plan, cluster: Cluster, eff: dict[str, float]) -> dict:
    """The `predicted` block of tools/plan.py --cluster (see the module doc)."""
    deg, t = plan.degrees, cfg.train
    schedule, layers = pipeline_plan(cfg, t.microbatches(deg["dp"]))
    ranks = rank_costs(cfg, plan, cluster, eff, schedule, layers)
    rc = max(ranks, key=lambda r: r.compute.F + r.compute.B + sum(r.comm_s.get(g, 0) for g in (
        "tp", "cp", "cp_a2a", "cp_ring", "ep")) / r.actions)
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
    costs = dict(F=Fc + ep, B=Bc + ep, W=c.W, FB=max(Fc + Bc, 2 * ep) if overlap else None)
    hidden = t.micro_batch * t.seq_len // (deg["cp"] * deg["tp"]) * cfg.model.dim * _act_bytes(cfg)
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
    ep_pairs = (max(0.0, 2 * ep - (Fc + Bc)) if overlap else 2 * ep) + 2 * ep_host
    exposed = {"tp": 2 * tp * rc.actions, ring: (cp_f + cp_b) * rc.actions, "cp_a2a": 2 * a2a * rc.actions,
               "ep": (ep + ep_host) * (kinds["F"] + kinds["B"]) + ep_pairs * kinds["FB"], "pp": pp_exposed}
    for g in ZERO_GROUPS:  # reduce-scatters hide behind the last backward, the rest is exposed
        rs, rest = rc.ops.get((g, "reduce_scatter"), 0.0), sum(s for (h, op), s in rc.ops.items()
                                                               if h == g and op != "reduce_scatter")
        exposed[g] = max(0.0, rs - c.B) + rest
    outside = [g for g in rc.comm_s if g not in exposed]  # subgroups made on demand (e.g. cp_tp): exposed
    exposed.update({g: rc.comm_s[g] for g in outside})
    rp = next(r for r in plan.ranks if r.pp_rank == rc.pp_rank)
    mem = rp.memory
    optimizer_s = (2 * mem["optimizer"] + mem["params"]) / (cluster.hbm_gbps * 1e9 * eff["memory"])
    step = pipeline_s + sum(exposed[g] for g in (*ZERO_GROUPS, *outside)) + optimizer_s
    tokens = t.global_batch * t.seq_len
    flops = train_flops_per_token(cfg.model, t.seq_len)
    peak = cluster.peak_tflops("fp32" if cfg.precision.recipe == "fp32" else "bf16") * 1e12
    achieved = flops * tokens / step / deg["world"]
    return {"cluster": cluster.__dict__, "efficiency": dict(eff), "step_s": step,
            "tokens_per_s_per_gpu": tokens / step / deg["world"], "mfu": achieved / peak,
            "model_tflops_per_gpu": achieved / 1e12, "model_flops_per_token": flops,  # causal: MFU's numerator
            **model_flops_keys(cfg.model, t.seq_len, tokens / step / deg["world"]),
            "warnings": plan_warnings(cfg, plan, cluster, rc.pp_rank),
            "pipeline_s": pipeline_s, "bubble_share": bubble / pipeline_s if pipeline_s else 0.0,
            "optimizer_s": optimizer_s, "exposed_comm_s": {g: s for g, s in exposed.items() if s > 0},
            "comm_s": rc.comm_s, "costs_s": {**costs, "FB": costs["FB"] or costs["F"] + costs["B"], "comm": pp_send},
            "slowest_pp_rank": rc.pp_rank, "actions": dict(kinds),
            "mfu_peak": "bf16 dense" if cfg.precision.recipe != "fp32" else "fp32"}


def render(pred: dict) -> str:
    """Text lines of the prediction (tools/plan.py prints them after the plan)."""
    c, k = pred["cluster"], pred["costs_s"]
    out = [f"Predicted on {c['name']} ({c['bf16_tflops']:g} BF16 / {c['fp8_tflops']:g} FP8 TFLOP/s, HBM "
           f"{c['hbm_gbps']:g} GB/s, NVLink {c['nvlink_gbps']:g} GB/s, network {c['net_gbps']:g} GB/s per GPU, "
           f"{c['gpus_per_node']} per node); efficiencies " + ", ".join(f"{a} {b:g}" for a, b in pred["efficiency"].items()),
           f"  step {pred['step_s']:.3f} s | {pred['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU | "
           f"{pred['model_tflops_per_gpu']:.0f} model TFLOP/s/GPU | MFU {pred['mfu']:.1%} of the {pred['mfu_peak']} peak",
           f"  pipeline {pred['pipeline_s']:.3f} s (bubble {pred['bubble_share']:.1%}, slowest rank pp {pred['slowest_pp_rank']}), "
           f"optimizer {pred['optimizer_s']:.3f} s; per action F {k['F'] * 1e3:.2f} B {k['B'] * 1e3:.2f} "
           f"W {k['W'] * 1e3:.2f} F&B {k['FB'] * 1e3:.2f} ms, pp transfer {k['comm'] * 1e3:.2f} ms",
           "  communication per step, link time (exposed): " + ", ".join(
               f"{g} {s:.3f} s ({pred['exposed_comm_s'].get(g, 0.0):.3f})" for g, s in pred["comm_s"].items())]
    return "\n".join(out[:2] + render_flops(pred) + out[2:] + render_warnings(pred))
