"""What one rank of a recipe's layout holds and sends, per mesh dim, from the config alone.

Exact for what the trainer runs today (one process, ZeRO-1 data parallelism), checked against the
counted bytes and optimizer state of real runs in tests/test_plan.py:

  parameters   compute dtype, one flat buffer per ZeRO group ("dp_cp" dense, "edp" experts, and
               "dp_cp_tp" for tp-replicated ones), laid out like `moe_lc.parallel.zero`: parameters
               in reverse single-device order, greedy buckets of zero_bucket_mb (fp32 elements),
               each bucket padded to a multiple of the group size N
  gradients    fp32, a full-size padded buffer per group (main grads, accumulated over micro-batches)
  optimizer    fp32 master + two moments (fp32, or bf16 with precision.adam_moments = "bf16"), 1/N
  per step     reduce-scatter of each bucket's fp32 gradients, all-gather of each bucket's parameters,
               and small fp64/fp32 all-reduces: token count over dp (masked data only), loss, grad
               norm (and MTP loss sums) over world, expert loads over dp_cp_tp

One hook per dim states how that dim changes parameters (`tp_param`, `ep_param`, `pp_rank_stages`)
and what it sends (`tp_traffic`, `cp_traffic`, `ep_traffic`, `pp_traffic`). They follow the formulas
in the docstrings of moe_lc/parallel/{tensor,context,expert}.py and REFERENCE.md. TP, CP and PP bytes
are exact (tests/test_plan.py runs tp2, cp2, cp2 x tp2 and pp2 and compares every counter); EP's
all-to-all volume follows the routing, so the planner gives the balanced-routing value, marked
ESTIMATE (within 10% of the measured volume on the debug model); hierarchical EP is not modeled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_lc.config import Config, ModelConfig, resolve_degrees
from tools.placement_semantics import Traffic, ring_bytes

ESTIMATE = "estimate: balanced routing"


@dataclass(frozen=True)
class Degrees:
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    world: int
    mirror: bool  # DualPipe: ranks r and pp-1-r hold the same stages and share gradient groups

    @property
    def edp(self) -> int:
        return self.dp * self.cp * self.tp // self.ep

    def group_size(self, name: str) -> int:
        m = 2 if self.mirror else 1
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep,
                "dp_cp": self.dp * self.cp * m, "dp_cp_tp": self.dp * self.cp * self.tp * m,
                "edp": self.edp * m, "world": self.world}[name]


def degrees(cfg: Config, world: int | None = None) -> Degrees:
    d, errors = resolve_degrees(cfg.parallel, world)
    if errors:
        raise ValueError("; ".join(errors))
    p = cfg.parallel
    return Degrees(p.pp, d["dp"], p.cp, p.tp, p.ep, d["world"], p.pp_schedule == "dualpipe" and p.pp > 1)


# ---------------------------------------------------------------------------------------------
# parameters


def _attention_shapes(m: ModelConfig, p: str) -> list[tuple[str, tuple[int, ...]]]:
    D, H = m.dim, m.n_heads
    if m.attention != "mla":
        Dh, K = m.head_size, m.n_kv_heads
        return [(p + "attn.wqkv.weight", ((H + 2 * K) * Dh, D)), (p + "attn.wo.weight", (D, H * Dh))]
    qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
    out = [(p + "attn.wa.weight", (m.mla.q_lora_rank + m.mla.kv_lora_rank + m.mla.qk_rope_head_dim, D))]
    if m.mla.q_lora_rank:
        out += [(p + "attn.q_norm.weight", (m.mla.q_lora_rank,)), (p + "attn.wq_b.weight", (H * qk, m.mla.q_lora_rank))]
    else:
        out += [(p + "attn.wq.weight", (H * qk, D))]
    return out + [(p + "attn.kv_norm.weight", (m.mla.kv_lora_rank,)),
                  (p + "attn.wkv_b.weight", (H * (m.mla.qk_nope_head_dim + m.mla.v_head_dim), m.mla.kv_lora_rank)),
                  (p + "attn.wo.weight", (D, H * m.mla.v_head_dim))]


def _block_shapes(m: ModelConfig, layer_id: int, p: str) -> list[tuple[str, tuple[int, ...]]]:
    D = m.dim
    out = [(p + "attn_norm.weight", (D,)), *_attention_shapes(m, p), (p + "ffn_norm.weight", (D,))]
    if m.moe.n_routed_experts > 0 and layer_id >= m.moe.n_dense_layers:
        E, F = m.moe.n_routed_experts, m.moe.ffn_dim
        out += [(p + "ffn.router.gate.weight", (E, D)), (p + "ffn.experts.w13.weight", (E, 2 * F, D)),
                (p + "ffn.experts.w2.weight", (E, D, F))]
        if m.moe.n_shared_experts:
            Fs = m.moe.n_shared_experts * F
            out += [(p + "ffn.shared.w13.weight", (2 * Fs, D)), (p + "ffn.shared.w2.weight", (D, Fs))]
        return out
    return out + [(p + "ffn.w13.weight", (2 * m.ffn_dim, D)), (p + "ffn.w2.weight", (D, m.ffn_dim))]


def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter in the single-device registration order of
    `moe_lc.model.transformer.Transformer`, GQA or MLA attention, MTP modules last (a test compares
    it with the model built on the meta device)."""
    D = m.dim
    out = [("embed.weight", (m.vocab_size, D))]
    for i in range(m.n_layers):
        out += _block_shapes(m, i, f"layers.{i}.")
    out += [("norm.weight", (D,)), ("head.weight", (m.vocab_size, D))]
    for d in range(m.mtp.depth):
        p = f"mtp.{d}."
        out += [(p + "hnorm.weight", (D,)), (p + "enorm.weight", (D,)), (p + "eh_proj.weight", (D, 2 * D)),
                *_block_shapes(m, m.n_layers + d, p + "block."), (p + "norm.weight", (D,))]
    return out


def tp_param(name: str, shape: tuple[int, ...], m: ModelConfig, tp: int) -> tuple[int, str | None]:
    """TP hook: (local elements, gradient group if TP sets one). Megatron column/row
    split as moe_lc/parallel/tensor.py documents: wqkv by heads (kv heads replicated when K < tp),
    wo / w2 by input columns, w13 / MLA up-projections by output rows, embedding and head by
    vocabulary rows; norms, router gates, MLA's latent projection wa and MTP's eh_proj replicated on
    the sequence shard (group dp_cp_tp); routed experts untouched (left to EP)."""
    numel = math.prod(shape)
    if tp == 1 or ".experts." in name:
        return numel, None
    if name.endswith("norm.weight") or ".router." in name or name.endswith(("attn.wa.weight", "eh_proj.weight")):
        return numel, "dp_cp_tp"
    if name.endswith("attn.wqkv.weight"):
        Dh = m.head_size
        kv_local = m.n_kv_heads // min(m.n_kv_heads, tp)
        return (m.n_heads // tp + 2 * kv_local) * Dh * m.dim, None
    return numel // tp, None


def ep_param(name: str, shape: tuple[int, ...], ep: int) -> tuple[int, str]:
    """EP hook: routed experts (E, ...) keep E/ep experts; their gradients sum over "edp"."""
    return math.prod(shape) // ep, "edp"


def pp_rank_stages(cfg: Config, deg: Degrees) -> list[list[dict]]:
    """PP hook: for each pipeline rank, its stages as {"layers", "first", "last"}, from the
    project's schedule routes and stage split (moe_lc.parallel.pipeline)."""
    every = {"layers": list(range(cfg.model.n_layers)), "first": True, "last": True}
    if deg.pp == 1:
        return [[every]]
    from moe_lc.parallel.pipeline import build_schedule
    from moe_lc.parallel.pipeline.stage import stage_layers

    p = cfg.parallel
    schedule = build_schedule(p.pp_schedule, p.pp, microbatches(cfg, deg),
                              p.pp_chunks if p.pp_schedule == "interleaved_1f1b" else None)
    layers = stage_layers(cfg.model, schedule.n_stages, cfg.train.seq_len, p.pp_stage_layers or None)
    held: list[set[int]] = [set() for _ in range(p.pp)]
    for route in schedule.routes:
        for stage, (rank, _) in enumerate(route):
            held[rank].add(stage)
    last = schedule.n_stages - 1
    return [[{"layers": layers[s], "first": s == 0, "last": s == last} for s in sorted(h)] for h in held]


def microbatches(cfg: Config, deg: Degrees) -> int:
    return cfg.train.global_batch // (cfg.train.micro_batch * deg.dp)


def local_params(cfg: Config, deg: Degrees, stages: list[dict]) -> dict[str, list[tuple[str, int]]]:
    """{ZeRO group: [(name, local elements)]} of one rank, in single-device order."""
    m = cfg.model
    layers = {i for st in stages for i in st["layers"]}
    first, last = any(st["first"] for st in stages), any(st["last"] for st in stages)
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, shape in param_shapes(m):
        parts = name.split(".")
        if (parts[0] == "layers" and int(parts[1]) not in layers) or (parts[0] == "embed" and not first) \
                or (parts[0] in ("norm", "head", "mtp") and not last):
            continue
        if ".experts." in name:
            numel, group = ep_param(name, shape, deg.ep)
        else:
            numel, tp_group = tp_param(name, shape, m, deg.tp)
            group = tp_group or "dp_cp"
        groups.setdefault(group, []).append((name, numel))
    return groups


def zero_bucket_sizes(numels: list[int], bucket_elems: int, n: int) -> list[int]:
    """Padded bucket sizes of one ZeRO-1 group (numels in single-device order): reverse order,
    greedy buckets (a parameter never straddles two), each padded to a multiple of n."""
    sizes, cur = [], 0
    for k in reversed(numels):
        if cur and cur + k > bucket_elems:
            sizes.append(cur)
            cur = 0
        cur += k
    sizes.append(cur)
    return [-(-s // n) * n for s in sizes]


def bucket_elems(cfg: Config) -> int:
    return max(int(cfg.parallel.zero_bucket_mb * 2**20 / 4), 1)


# ---------------------------------------------------------------------------------------------
# per-step traffic beyond the ZeRO collectives


def trainer_traffic(cfg: Config, deg: Degrees, stages: list[dict]) -> list[Traffic]:
    """The small all-reduces `moe_lc.train` issues every step (exact)."""
    out = []
    masked = cfg.data.source == "synthetic" or cfg.data.synthetic_weight > 0
    if masked:
        out.append(Traffic("dp", "all_reduce", ring_bytes("all_reduce", 8, deg.dp), "step token count (fp64)"))
    m = cfg.model
    if m.mtp.depth:
        out.append(Traffic("world", "all_reduce", ring_bytes("all_reduce", 8 * m.mtp.depth, deg.world),
                           f"MTP loss sums ({m.mtp.depth} fp64)"))
    for what in ("loss sum (fp64)", "grad-norm square sum (fp64)"):
        out.append(Traffic("world", "all_reduce", ring_bytes("all_reduce", 8, deg.world), what))
    n_moe = sum(1 for st in stages for i in st["layers"] if m.moe.n_routed_experts and i >= m.moe.n_dense_layers)
    if m.moe.n_routed_experts and any(st["last"] for st in stages):  # MTP blocks are MoE blocks too
        n_moe += sum(1 for d in range(m.mtp.depth) if m.n_layers + d >= m.moe.n_dense_layers)
    if n_moe:
        loads = 4 * n_moe * m.moe.n_routed_experts
        out.append(Traffic("dp_cp_tp", "all_reduce", ring_bytes("all_reduce", loads, deg.group_size("dp_cp_tp")),
                           f"expert loads ({n_moe} MoE layers x {m.moe.n_routed_experts} fp32)"))
    return [t for t in out if t.bytes]


def _per_microbatch(count: float, deg: Degrees) -> float:
    """Per micro-batch share of a count summed over a rank's stages: under DualPipe each micro-batch
    runs only one of the rank's two (mirrored) stages."""
    return count / 2 if deg.mirror else count


def _tokens(cfg: Config, deg: Degrees) -> int:
    """Tokens of one micro-batch on this rank's cp shard (before sequence parallelism)."""
    return cfg.train.micro_batch * cfg.train.seq_len // deg.cp


def tp_traffic(cfg: Config, deg: Degrees, stages: list[dict], c: int) -> list[Traffic]:
    """TP+SP hook (tensor.py's docstring): per block and micro-batch, 2 all-gathers and 2
    reduce-scatters of (B, S, D) forward and the same backward; embedding, head and loss extra."""
    if deg.tp == 1:
        return []
    act = _tokens(cfg, deg) * cfg.model.dim * c
    mb = microbatches(cfg, deg)
    first, last = any(st["first"] for st in stages), any(st["last"] for st in stages)
    n_ag = n_rs = 4 * _per_microbatch(sum(len(st["layers"]) for st in stages), deg) + int(first) + int(last)
    out = [Traffic("tp", "all_gather", mb * n_ag * ring_bytes("all_gather", act, deg.tp), "TP+SP activations"),
           Traffic("tp", "reduce_scatter", mb * n_rs * ring_bytes("reduce_scatter", act, deg.tp), "TP+SP activations")]
    if last:  # one all-reduce of the max (B*S fp32), one of sum-exp and target logit (2*B*S fp32)
        loss = ring_bytes("all_reduce", 4 * _tokens(cfg, deg), deg.tp) + ring_bytes("all_reduce", 8 * _tokens(cfg, deg), deg.tp)
        out.append(Traffic("tp", "all_reduce", mb * loss, "vocab-parallel loss (max; sum-exp, target)"))
    return out


def cp_traffic(cfg: Config, deg: Degrees, stages: list[dict], c: int) -> list[Traffic]:
    """CP hook (context.py's docstring): per attention call, forward (cp-1)(|K|+|V|)c,
    backward (cp-1)(|K|+|V|)c + cp(|K|+|V|)*4 (fp32 dK/dV accumulators), sent to the next cp rank."""
    if deg.cp == 1:
        return []
    m = cfg.model
    kv_heads = m.n_kv_heads // min(m.n_kv_heads, deg.tp) if deg.tp > 1 else m.n_kv_heads
    kv = 2 * _tokens(cfg, deg) * kv_heads * m.head_size
    per_call = (deg.cp - 1) * kv * c * 2 + deg.cp * kv * 4
    n_layers = _per_microbatch(sum(len(st["layers"]) for st in stages), deg)
    return [Traffic("cp", "send", microbatches(cfg, deg) * n_layers * per_call, "ring attention K/V (+dK/dV)")]


def ep_traffic(cfg: Config, deg: Degrees, stages: list[dict], c: int) -> list[Traffic]:
    """EP hook (flat dispatcher, balanced routing): each of a rank's T*k token copies
    leaves the rank with probability (ep-1)/ep in dispatch and comes back in combine, forward and
    backward: 4 x T k D c (ep-1)/ep per MoE layer and micro-batch (under TP+SP T is the tp shard);
    plus one all-gather of every rank's per-expert counts. The real all-to-all volume follows the
    routing: within ~7% of this at ep=2 on the debug model early in training."""
    m = cfg.model
    if deg.ep == 1 or not m.moe.n_routed_experts:
        return []
    n_moe = _per_microbatch(sum(1 for st in stages for i in st["layers"] if i >= m.moe.n_dense_layers), deg)
    copies = _tokens(cfg, deg) // deg.tp * m.moe.topk
    per_layer = 4 * copies * m.dim * c * (deg.ep - 1) / deg.ep
    layout = ring_bytes("all_gather", deg.ep * m.moe.n_routed_experts * 8, deg.ep)  # per-expert int64 counts
    mb = microbatches(cfg, deg)
    rpn = cfg.parallel.ranks_per_node or deg.world
    nodes = deg.ep // rpn if deg.ep > rpn else 1
    stats = 8 * (m.moe.n_routed_experts + nodes + 1 + 3)  # fp64 load, nodes-per-token histogram, 3 counters
    n_stats = sum(1 for st in stages for i in st["layers"] if i >= m.moe.n_dense_layers)
    return [Traffic("ep", "all_to_all", mb * n_moe * per_layer, "token dispatch + combine, fwd + bwd (balanced)",
                    ESTIMATE),
            Traffic("ep", "all_gather", mb * n_moe * layout, "dispatch layout (expert counts of every ep rank)"),
            Traffic("dp_cp_tp", "all_reduce", ring_bytes("all_reduce", n_stats * stats, deg.group_size("dp_cp_tp")),
                    "dispatcher statistics per MoE layer (metrics)")]


def pp_traffic(cfg: Config, deg: Degrees, stages: list[dict], c: int) -> list[Traffic]:
    """PP hook: every micro-batch sends its activations (B, S/(cp tp), D) to the next stage
    and its input gradient back to the previous one, for each stage boundary on another rank."""
    if deg.pp == 1:
        return []
    act = _tokens(cfg, deg) // deg.tp * cfg.model.dim * c
    sends = _per_microbatch(sum(int(not st["last"]) + int(not st["first"]) for st in stages), deg)
    return [Traffic("pp", "send", microbatches(cfg, deg) * sends * act, "stage activations / gradients")]


HOOKS = (tp_traffic, cp_traffic, ep_traffic, pp_traffic)
