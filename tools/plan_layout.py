"""What one rank of a recipe's layout holds and sends, per mesh dim: the runtime's own layout.

Parameters are not re-described here: each pipeline rank's model is built the way the trainer builds
it (`moe_lc.parallel.build.build_rank_model`: the Transformer on the meta device, parallelize with PP,
TP (its plan table), EP, CP, FP8 and recomputation) on virtual groups of the recipe's mesh, and its
placements give every local shape and gradient group. ZeRO-1 buckets come from
`moe_lc.parallel.zero.bucket_sizes`, the mesh from `ParallelDims`, the dispatcher's counters from
`moe_lc.parallel.expert.counter_elems`. Exact for what the trainer runs (tests/test_plan.py compares
the counted bytes and optimizer state of real runs):

  parameters   compute dtype, one flat buffer per ZeRO group ("dp_cp" dense, "edp" experts, and
               "dp_cp_tp" for tp-replicated ones), padded per bucket to a multiple of the group size
  gradients    fp32, a full-size padded buffer per group (main grads, accumulated over micro-batches)
  optimizer    fp32 master + the state the update rule declares (moe_lc/optim; AdamW: two moments, fp32 or
               bf16 with precision.adam_moments = "bf16"), 1/N
  per step     reduce-scatter of each bucket's fp32 gradients, all-gather of each bucket's parameters,
               and small fp64/fp32 all-reduces: token count over dp (masked data only), loss, grad
               norm (and MTP loss sums) over world, expert loads over dp_cp_tp

What each dim sends beyond ZeRO (`tp_traffic`, `cp_traffic`, `ep_traffic`, `pp_traffic`, and the balance
losses' count sums, `balance_traffic`) follows the formulas in the docstrings of
moe_lc/parallel/{tensor,context,expert,balance_plan}.py; an expert capacity scales EP's copies by the share
it keeps under balanced routing (`kept_fraction`). TP, CP and PP bytes are exact
(tests/test_plan.py runs tp2, cp2, cp2 x tp2 and pp2 and compares every counter); EP's all-to-all volume
follows the routing, so the planner gives the balanced-routing value, marked ESTIMATE (within 10% of
the measured volume on the debug model); hierarchical EP is not modeled.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lc.config import Config
from moe_lc.model.balance_losses import stat_columns
from moe_lc.model.capacity import expert_capacity
from moe_lc.parallel.build import build_rank_model, pipeline_plan
from moe_lc.ops.fp8_storage import fp8_row_bytes
from moe_lc.optim import build_rule
from moe_lc.parallel.expert import counter_elems
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Parallelized
from moe_lc.parallel.zero import bucket_elems, bucket_sizes
from .placement_semantics import Traffic, ring_bytes

ESTIMATE = "estimate: balanced routing"


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
    model as the trainer builds it (on the meta device) and its stages as {"layers", "first", "last"}."""

    dims: ParallelDims
    model: Parallelized
    stages: list[dict]

    def local_params(self) -> dict[str, list[tuple[str, int]]]:
        """{ZeRO group: [(name, local elements)]}, in single-device order (the order ZeRO lays out)."""
        groups: dict[str, list[tuple[str, int]]] = {}
        for name, p, place in self.model.named_parameters():
            groups.setdefault(place.grad_group, []).append((name, p.numel()))
        return groups

    def zero_buckets(self, cfg: Config) -> dict[str, list[int]]:
        """{ZeRO group: padded bucket sizes}, as moe_lc.parallel.zero allocates them for the recipe's update
        rule (the parameters it wants whole are packed into per-rank bins)."""
        rule, whole = build_rule(cfg.train, cfg.precision), {}
        for name, p, place in self.model.named_parameters():
            whole.setdefault(place.grad_group, []).append(rule.whole(name, p.shape))
        return {g: bucket_sizes([k for _, k in params], bucket_elems(cfg.parallel.zero_bucket_mb), self.dims[g].size,
                                whole[g]) for g, params in sorted(self.local_params().items())}


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
# per-step traffic beyond the ZeRO collectives


def trainer_traffic(cfg: Config, dims: ParallelDims, stages: list[dict]) -> list[Traffic]:
    """The small all-reduces `moe_lc.train` issues every step (exact)."""
    out = []
    masked = cfg.data.has_loss_mask
    if masked:
        out.append(Traffic("dp", "all_reduce", ring_bytes("all_reduce", 8, dims.dp), "step token count (fp64)"))
    m = cfg.model
    if m.mtp.depth:
        out.append(Traffic("world", "all_reduce", ring_bytes("all_reduce", 8 * m.mtp.depth, dims.world),
                           f"MTP loss sums ({m.mtp.depth} fp64)"))
    for what in ("loss sum (fp64)", "grad-norm square sum (fp64)"):
        out.append(Traffic("world", "all_reduce", ring_bytes("all_reduce", 8, dims.world), what))
    out.append(Traffic("world", "all_reduce", ring_bytes("all_reduce", 4, dims.world), "stop-signal flag (int32)"))
    n_moe = sum(moe_blocks(cfg, st) for st in stages)
    if n_moe and dims.ep == 1:  # under EP the loads ride in the dispatchers' fp64 all-reduce (`ep_traffic`)
        extra = stat_columns(m.moe)  # each enabled aux loss's sum and the dropped copies, per layer
        loads = 4 * n_moe * (m.moe.n_routed_experts + extra)
        out.append(Traffic("dp_cp_tp", "all_reduce", ring_bytes("all_reduce", loads, dims["dp_cp_tp"].size),
                           f"expert loads ({n_moe} MoE layers x {m.moe.n_routed_experts}"
                           f"{f' + {extra}' if extra else ''} fp32)"))
    return [t for t in out if t.bytes]


def moe_blocks(cfg: Config, stage: dict) -> int:
    """MoE blocks a micro-batch meets in a stage: its MoE layers, and on the last stage the MTP modules'
    blocks (MoE blocks too, numbered after the main layers)."""
    m = cfg.model
    if not m.moe.n_routed_experts:
        return 0
    mtp = range(m.n_layers, m.n_layers + m.mtp.depth) if stage["last"] else ()
    return sum(1 for i in (*stage["layers"], *mtp) if i >= m.moe.n_dense_layers)


def _blocks(cfg: Config, stage: dict) -> int:
    """Transformer blocks a micro-batch meets in a stage (the MTP modules' on the last)."""
    return len(stage["layers"]) + (cfg.model.mtp.depth if stage["last"] else 0)


def _per_microbatch(count: float, dims: ParallelDims) -> float:
    """Per micro-batch share of a count summed over a rank's stages: under DualPipe each micro-batch
    runs only one of the rank's two (mirrored) stages."""
    return count / 2 if dims.pp_mirror else count


def _tokens(cfg: Config, dims: ParallelDims) -> int:
    """Tokens of one micro-batch on this rank's cp shard (before sequence parallelism)."""
    return cfg.train.micro_batch * cfg.train.seq_len // dims.cp


def tp_traffic(cfg: Config, dims: ParallelDims, stages: list[dict], c: int) -> list[Traffic]:
    """TP+SP hook (tensor.py's docstring): per block and micro-batch, 2 all-gathers and 2
    reduce-scatters of (B, S, D) forward and the same backward; embedding, head and loss extra."""
    if dims.tp == 1:
        return []
    act = _tokens(cfg, dims) * cfg.model.dim * c
    mb = cfg.train.microbatches(dims.dp)
    first, last = any(st["first"] for st in stages), any(st["last"] for st in stages)
    # under DualPipe a micro-batch meets the embedding or the head on this rank, not both (the dry run
    # showed the planner counting both: 10% over)
    # each MTP depth adds a block, an embedding of the shifted tokens and a pass through the head and loss
    depth = cfg.model.mtp.depth
    n_ag = n_rs = _per_microbatch(4 * sum(_blocks(cfg, st) for st in stages) + int(first) + int(last) * (1 + 2 * depth),
                                  dims)
    out = [Traffic("tp", "all_gather", mb * n_ag * ring_bytes("all_gather", act, dims.tp), "TP+SP activations"),
           Traffic("tp", "reduce_scatter", mb * n_rs * ring_bytes("reduce_scatter", act, dims.tp), "TP+SP activations")]
    if last:  # one all-reduce of the max (B*S fp32), one of sum-exp and target logit (2*B*S fp32)
        loss = ring_bytes("all_reduce", 4 * _tokens(cfg, dims), dims.tp) + ring_bytes("all_reduce", 8 * _tokens(cfg, dims), dims.tp)
        out.append(Traffic("tp", "all_reduce", mb * _per_microbatch(loss * (1 + depth), dims),
                           "vocab-parallel loss (max; sum-exp, target)" + (" of the main and MTP heads" if depth else "")))
    if cfg.model.attention == "gqa" and cfg.model.qk_norm == "full":
        out.append(_whole_row_qk_norm(cfg, dims, stages, mb))
    if cfg.model.attention == "gqa" and cfg.model.n_kv_heads < dims.tp:
        out.append(_replicated_kv_rows(cfg, dims, stages, mb, c))
    return out


def _replicated_kv_rows(cfg: Config, dims: ParallelDims, stages: list[dict], mb: int, c: int) -> Traffic:
    """Fewer kv heads than tp ranks (tensor.py's replicated_rows_grad): per block and micro-batch, the
    backward all-reduces the gradients of this rank's one kv head over the tp / K ranks sharing it: its
    k|v rows of wqkv (2 Dh x D) and of the q|k|v bias (2 Dh), and its slice of a whole-row k_norm (Dh),
    in the parameters' dtype."""
    m = cfg.model
    Dh = m.head_size
    numel = 2 * Dh * m.dim + 2 * Dh * int(m.qkv_bias) + Dh * int(m.qk_norm == "full")
    n_blocks = _per_microbatch(sum(_blocks(cfg, st) for st in stages), dims)
    return Traffic("tp_kv", "all_reduce", mb * n_blocks * ring_bytes("all_reduce", c * numel, dims.tp // m.n_kv_heads),
                   "gradients of the kv head shared by tp ranks")


def _whole_row_qk_norm(cfg: Config, dims: ParallelDims, stages: list[dict], mb: int) -> Traffic:
    """qk_norm = "full" under TP (tensor.py's RowSquaresOverTP): per block and micro-batch, the q and k rows'
    sums of squares ((B, S, 1) fp32 each) are all-reduced forward and their gradients backward; every replay
    of the forward (recompute "full", selective "attention" or "norm") all-reduces them again."""
    r = cfg.recompute
    items = set(r.selective) if r.policy == "selective" else set()
    replays = int(r.policy == "full") + len(items & {"attention", "norm"})
    per_block = (4 + 2 * replays) * ring_bytes("all_reduce", 4 * _tokens(cfg, dims), dims.tp)
    n_blocks = _per_microbatch(sum(_blocks(cfg, st) for st in stages), dims)
    # nested replays (selective "attention" and "norm" together) were not measured
    return Traffic("tp", "all_reduce", mb * n_blocks * per_block, "qk_norm='full': q and k sums of squares",
                   "exact" if replays <= 1 else "estimate")


def cp_traffic(cfg: Config, dims: ParallelDims, stages: list[dict], c: int) -> list[Traffic]:
    """CP hook (context.py's docstring): per attention call, forward (cp-1)(|K|+|V|)c (again for each
    replay under recomputation), backward (cp-1)(|K|+|V|)c + cp(|K|+|V|)*4 (fp32 accumulators), sent to
    the next cp rank. What
    travels: GQA's K and V (this rank's kv heads under TP); MLA's latent and shared RoPE key
    (parallel.mla_ring = latent, latent_ring.py: whole on every TP rank), or its expanded per-head K, V."""
    if dims.cp == 1:
        return []
    m = cfg.model
    if m.attention == "mla" and cfg.parallel.mla_ring == "latent":
        per_token, what = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim, "ring attention MLA latent + RoPE key (+grads)"
    elif m.attention == "mla":
        per_token, what = m.n_heads // dims.tp * (m.qk_head_dim + m.value_head_dim), "ring attention K/V (+dK/dV)"
    else:
        kv_heads = m.n_kv_heads // min(m.n_kv_heads, dims.tp) if dims.tp > 1 else m.n_kv_heads
        per_token, what = 2 * kv_heads * m.head_size, "ring attention K/V (+dK/dV)"
    kv = _tokens(cfg, dims) * per_token
    # every replay of the forward's core runs the ring again: recompute "full", and selective "attention"
    # unless MLA's "mla_up" takes that path (it rebuilds q, k, v from the latents, not the core)
    r = cfg.recompute
    core = r.policy == "selective" and "attention" in r.selective and not (m.attention == "mla" and "mla_up" in r.selective)
    replays = int(r.policy == "full") + int(core)
    per_call = (dims.cp - 1) * kv * c * (2 + replays) + dims.cp * kv * 4
    n_layers = _per_microbatch(sum(_blocks(cfg, st) for st in stages), dims)
    return [Traffic("cp", "send", cfg.train.microbatches(dims.dp) * n_layers * per_call, what)]


def ep_traffic(cfg: Config, dims: ParallelDims, stages: list[dict], c: int) -> list[Traffic]:
    """EP hook (flat dispatcher, balanced routing): each of a rank's T*k token copies
    leaves the rank with probability (ep-1)/ep in dispatch and comes back in combine, forward and
    backward: 4 x T k D c (ep-1)/ep per MoE layer and micro-batch (under TP+SP T is the tp shard; with
    precision.fp8_dispatch the forward dispatch's D c is D + 4 D/128 bytes; model.moe.weighted_swiglu sends
    each copy's fp32 gate weight along, and its gradient back: 2 x 4 bytes more per copy);
    plus one all-gather of every rank's per-expert counts. The real all-to-all volume follows the
    routing: within ~7% of this at ep=2 on the debug model early in training."""
    m = cfg.model
    if dims.ep == 1 or not m.moe.n_routed_experts:
        return []
    n_moe = _per_microbatch(sum(moe_blocks(cfg, st) for st in stages), dims)
    copies = _tokens(cfg, dims) // dims.tp * m.moe.topk * kept_fraction(cfg, dims)
    # FP8 dispatch: the forward dispatch moves FP8 rows with their 1 x 128 scales; combine and both
    # backward transfers stay in the compute dtype
    dispatch = fp8_row_bytes(m.dim) if cfg.precision.fp8_dispatch else m.dim * c
    weights = 2 * 4 if m.moe.weighted_swiglu else 0
    per_layer = copies * (dispatch + 3 * m.dim * c + weights) * (dims.ep - 1) / dims.ep
    layout = ring_bytes("all_gather", dims.ep * m.moe.n_routed_experts * 8, dims.ep)  # per-expert int64 counts
    mb = cfg.train.microbatches(dims.dp)
    stats = 8 * (counter_elems(m.moe.n_routed_experts, dims["ep"].n_nodes()) + stat_columns(m.moe))  # fp64
    n_stats = sum(moe_blocks(cfg, st) for st in stages)
    return [Traffic("ep", "all_to_all", mb * n_moe * per_layer, "token dispatch + combine, fwd + bwd (balanced)",
                    ESTIMATE),
            Traffic("ep", "all_gather", mb * n_moe * layout, "dispatch layout (expert counts of every ep rank)"),
            Traffic("dp_cp_tp", "all_reduce", ring_bytes("all_reduce", n_stats * stats, dims["dp_cp_tp"].size),
                    "expert loads and dispatcher counters per MoE layer (fp64 metrics)")]


def pp_traffic(cfg: Config, dims: ParallelDims, stages: list[dict], c: int) -> list[Traffic]:
    """PP hook: every micro-batch sends its activations (B, S/(cp tp), D) to the next stage
    and its input gradient back to the previous one, for each stage boundary on another rank."""
    if dims.pp == 1:
        return []
    act = _tokens(cfg, dims) // dims.tp * cfg.model.dim * c
    sends = _per_microbatch(sum(int(not st["last"]) + int(not st["first"]) for st in stages), dims)
    return [Traffic("pp", "send", cfg.train.microbatches(dims.dp) * sends * act, "stage activations / gradients")]


def kept_fraction(cfg: Config, dims: ParallelDims) -> float:
    """The share of a router call's T*k copies that an expert capacity lets through under balanced
    routing (each expert asked for T*k/E copies, taking at most C = ceil(capacity_factor*T*k/E)):
    min(1, C / (T*k/E)); 1 without a capacity. T: one micro-batch's tokens on this rank's cp and tp shard."""
    moe = cfg.model.moe
    if moe.capacity_factor <= 0:
        return 1.0
    asked = _tokens(cfg, dims) // dims.tp * moe.topk / moe.n_routed_experts
    return min(1.0, expert_capacity(_tokens(cfg, dims) // dims.tp, moe.topk, moe.n_routed_experts,
                                    moe.capacity_factor) / asked)


def balance_traffic(cfg: Config, dims: ParallelDims, stages: list[dict], c: int) -> list[Traffic]:
    """Balance-loss hook (moe_lc/parallel/balance_plan.py): per MoE layer and training forward, the
    sequence-wise loss under cp or tp all-reduces the (B, E) per-sequence counts over "cp_tp", the
    global-batch loss the (E + 1) counts and tokens over "dp_cp_tp" (fp32). Full recomputation replays
    the forward, and its collectives, once more in backward."""
    m = cfg.model
    if not m.moe.n_routed_experts:
        return []
    n_moe = _per_microbatch(sum(moe_blocks(cfg, st) for st in stages), dims)
    calls = cfg.train.microbatches(dims.dp) * n_moe * (2 if cfg.recompute.policy == "full" else 1)
    E, out = m.moe.n_routed_experts, []
    if m.moe.aux_loss_weight > 0 and dims.cp * dims.tp > 1:
        per_call = ring_bytes("all_reduce", 4 * cfg.train.micro_batch * E, dims.cp * dims.tp)
        out.append(Traffic("cp_tp", "all_reduce", calls * per_call, "sequence-wise balance: per-sequence expert counts"))
    if m.moe.global_aux_loss_weight > 0 and dims["dp_cp_tp"].size > 1:
        per_call = ring_bytes("all_reduce", 4 * (E + 1), dims["dp_cp_tp"].size)
        out.append(Traffic("dp_cp_tp", "all_reduce", calls * per_call, "global-batch balance: expert counts, tokens"))
    return out


HOOKS = (tp_traffic, cp_traffic, ep_traffic, pp_traffic, balance_traffic)
