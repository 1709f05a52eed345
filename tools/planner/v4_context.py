"""DeepSeek-V4 under context parallelism on the planner's side: what the "cp" group carries per step (the runtime's
own count, moe_lc/parallel/cp/v4_context.py `v4_cp_bytes`: one formula, not two), what a memory-efficient core
keeps, the indexer's tile working set, and a plan of a V4 recipe with cp > 1 at lengths the trace cannot hold.

    python -m tools.planner.v4_context RECIPE [--set KEY=VALUE ...] [--cluster h100|h800 ...] [--json]
           [--formulas] [--index-tile-q 512] [--index-tile-k 4096]

Legend: B micro-batch, S sequence, cp ranks, c compute-dtype bytes, d the shared KV head dim (512), E the
indexer head dim (128), H query heads, D model dim, W window (128), m tokens per entry, k index_topk, n = S / m.

Which path plans what (the runtime builds V4 under cp, zig-zag and contiguous, since issue #67's runtime side):

    tools/plan.py, tools/dryrun.py   traced: the recipe's own layout, its blocks run on the meta device under a fake
                                     "cp" group, every all-gather, reduce-scatter and halo send counted by comm.py,
                                     and what autograd keeps measured. Exact at the shapes the CPU trains
                                     (tests/test_v4_plan_1m.py holds this file's rows to the dry run's counts). At 1M
                                     its cp rows are this file's too (the trace of v4_flash_1m.toml counts them to the
                                     byte), but its memory is the core the recipe builds (model.v4_attention.core):
                                     the torch reference ("reference", moe_lc/model/v4_core.py) keeps fp32
                                     probabilities (B, S/cp + h, H, 2W + n) for backward, 275 GB for one CSA layer at
                                     cp 256 (`reference_core_saved_bytes`); the tiled core ("tiled",
                                     moe_lc/ops/v4_sparse_core.py) keeps O(S H).
    python -m tools.planner.v4_context
                                     cp > 1 with the reference core traced, or `--formulas`: `plan_v4_cp` below, the
                                     efficient core's design from formulas. Otherwise tools/plan.py's trace, with the
                                     DSA comparison and the step-time predictions added.
    the hook                         `traced_core_is_reference` (the recipe's model.v4_attention.core): True, the
                                     trace cannot hold the core at 1M and the formulas plan it; False (the tiled core
                                     wired), the trace plans it and `--formulas` remains its check.

The "cp" bytes (`cp_step_traffic`), per layer and micro-batch on cp rank r, as the runtime counts them (report arXiv
2606.19348 section 3.4.3's scheme): forward, each rank's own compressed entries (S / (cp m) rows of d, CSA's index
keys of E likewise) all-gathered, (cp - 1) / cp of the output a rank's; the halo, h = max(W - 1, c m - 1) rows of
the attention's input (B, h, D), sent point to point by the rank holding the rows before a span (c = 2 for CSA's
overlapping pooling windows), only to a span on another rank: zig-zag 2 ([r > 0] + [r < cp - 1]) halos a rank sends
or receives, contiguous [r > 0] + [r < cp - 1]. Backward: the entries' gradients reduce-scattered (the index keys'
only where the indexer loss trains), each halo's gradient sent back. Under full recomputation the replay runs the
forward's gather and halo sends again. Unpadded: the entries a rank pools are exactly S / (cp m) without packed
documents (DeepSeek pads to S / m + 1; the runtime pads only when packed documents make the ranks' counts differ,
which this plan does not model). The trace and the dry run count cp rank 0 (`cp_rank`); a middle zig-zag rank
exchanges 4 halos a layer where rank 0 exchanges 2 (one more h D c sent each pass: 1 MB at 1M, 0.3% of a CSA layer's
gathers).

V3.2's DSA ring for the same model and length (`dsa_ring_layer_bytes`, the passes of moe_lc/ops/dsa_attention.py
and moe_lc/ops/dsa_ring.py, zig-zag): forward the indexer keys' selection ring and the latent's attention and
indexer-target rings, (cp - 1) B (S/cp) c (E + 2 L); backward the latent's and the keys' rings again with fp32
gradient accumulators travelling home: (cp - 1) B (S/cp) c (L + E) + cp B (S/cp) 4 (L + E); L the latent per
token (V3.2: 512 + 64; here V4's shared KV head, d). Checked against the planner's traced ring
(tests/test_v4_plan_1m.py).

The memory-efficient core (moe_lc/ops/v4_sparse_core.py's design: q, kv, entries, the picked indices, out and an
fp32 LSE saved, no probabilities; a tiled indexer top-k that never holds (S, n) scores) keeps for one layer's
backward, on a rank's S/cp tokens: q and out (2 H d c), the token's kv (d c), the LSE (4 H), CSA's picked indices
(8 k, int64), and the gathered entries (n d c) and index keys (n E c) of the whole sequence. The indexer's working
set is one (Tq, G, Tk) fp32 score tile, its head-summed (Tq, Tk) and a running top-k (Tq, k) of fp32 scores and
int64 ids.

The plan (`plan_v4_cp`) still assumes: the layout with cp folded into dp (cp = 1, dp' = dp cp, S' = S / cp, global
batch x cp) has the same states on every rank, the same tokens a rank computes, micro-batches in flight and EP / pp
traffic (the halo's h extra rows per span, 2 x 127 beside a rank's 4,096 at 1M, are not in its replay); its traced
reference core (fp32 probabilities over S' / m entries) comes out of the replay transient and the efficient core's
bytes at S go in; full recomputation (refused otherwise: under it a block keeps its input alone, which does not
depend on the attention); one pipeline rank's largest layer type for the replay; balanced routing (the planner's).
"""

from __future__ import annotations

from dataclasses import fields, replace

from moe_lc.config import Config
from moe_lc.model.v4_counting import reference_core_saved_bytes
from moe_lc.parallel.cp.v4_context import v4_cp_bytes
from .placement_semantics import Traffic

INDEX_TILE_Q = 512  # query rows of one indexer score tile (the design's; --index-tile-q)
INDEX_TILE_K = 4096  # entries of one tile (--index-tile-k)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
ADDED_TO_STEP = ("gradient rounds", "gathered units", "gathered fp8 copies", "offload fetch")
CP_OPS = ("all_gather", "reduce_scatter", "send")


def traced_core_is_reference(cfg: Config) -> bool:
    """Whether the V4 block the trace builds runs the torch reference core (moe_lc/model/v4_core.py `V4Core`, fp32
    probabilities kept: `model.v4_attention.core = "reference"`), whose saved bytes `attention_replay_swap` takes
    out: the hook for the efficient core (module docstring)."""
    return cfg.model.v4_attention.core == "reference"


def compute_bytes(cfg: Config) -> int:
    """c: bytes of an activation element ("cp" moves the compute dtype's; FP8 GEMMs' outputs are bf16)."""
    return 4 if cfg.precision.recipe == "fp32" else 2


def layer_cp_bytes(cfg: Config, layer_type: str, cp_rank: int = 0) -> dict[str, float]:
    """Bytes cp rank `cp_rank` sends over "cp" for one layer of `layer_type` and one micro-batch, per op and pass:
    the runtime's `v4_cp_bytes` on the recipe's sequence, micro-batch, cp layout, dtype and indexer loss, with
    "replay" added (the forward's gathers and halo sends again under full recomputation, else 0) and "step" (the
    sum of the ops over forward, replay and backward)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if p.cp == 1:
        return dict.fromkeys((*CP_OPS, "forward", "backward", "replay", "step"), 0.0)
    trains = m.v4_attention.index_loss_weight > 0
    got = dict(v4_cp_bytes(layer_type, m, t.seq_len, t.micro_batch, p.cp, p.cp_layout, compute_bytes(cfg), trains,
                           cp_rank))
    got["replay"] = got["forward"] if cfg.recompute.policy == "full" else 0
    got["step"] = got["forward"] + got["replay"] + got["backward"]
    return got


def cp_step_traffic(cfg: Config, layers: list[int], runs: int, cp_rank: int = 0) -> list[Traffic]:
    """The "cp" rows of one pipeline rank per step: its layers' bytes (`layer_cp_bytes`) x the micro-batches it runs,
    per op; the replay's gathers are all-gathers again, its halos sends again."""
    total = dict.fromkeys(CP_OPS, 0.0)
    for lt in layer_types_of(cfg, layers):
        b = layer_cp_bytes(cfg, lt, cp_rank)
        replayed_sends = b["replay"] - b["all_gather"] if b["replay"] else 0
        total["all_gather"] += runs * (b["all_gather"] * (2 if b["replay"] else 1))
        total["reduce_scatter"] += runs * b["reduce_scatter"]
        total["send"] += runs * (b["send"] + replayed_sends)
    what = (f"v4_cp_bytes (moe_lc/parallel/cp/v4_context.py): {len(layers)} V4 layers x {runs} micro-batches, cp rank "
            f"{cp_rank}")
    replay = ", replay" if cfg.recompute.policy == "full" else ""
    status = "estimate" if cfg.data.document_mask else "exact"  # (packed documents pad the gathers: not modeled)
    return [Traffic("cp", "all_gather", total["all_gather"], f"{what}: entries, index keys, forward{replay}", status),
            Traffic("cp", "reduce_scatter", total["reduce_scatter"], f"{what}: their gradients, backward", status),
            Traffic("cp", "send", total["send"], f"{what}: halos forward{replay}, their gradients backward", status)]


def dsa_ring_layer_bytes(latent: int, index_dim: int, seq_len: int, cp: int, micro_batch: int,
                         c: int) -> dict[str, float]:
    """Bytes one rank sends over "cp" for one DSA layer (sparse stage) and micro-batch: {"forward", "backward"}
    (module docstring); a replay under full recomputation sends "forward" again."""
    t = micro_batch * seq_len // cp
    return {"forward": (cp - 1) * t * c * (index_dim + 2 * latent),
            "backward": (cp - 1) * t * c * (latent + index_dim) + cp * t * 4 * (latent + index_dim)}


def efficient_core_bytes(m, layer_type: str, seq_len: int, cp: int, micro_batch: int, c: int) -> dict[str, float]:
    """What the memory-efficient core keeps for one layer's backward on one rank, by term (module docstring)."""
    a, H = m.v4_attention, m.n_heads
    t = micro_batch * seq_len // cp
    rate = a.compress_rate(layer_type)
    n = micro_batch * (seq_len // rate) if rate else 0
    return {"q, out": t * 2 * H * a.head_dim * c, "kv": t * a.head_dim * c, "lse": t * 4 * H,
            "picked indices": t * 8 * a.index_topk if layer_type == CSA else 0.0,
            "gathered entries": n * a.head_dim * c,
            "gathered index keys": n * a.index_head_dim * c if layer_type == CSA else 0.0}


def indexer_tile_bytes(m, micro_batch: int, tile_q: int = INDEX_TILE_Q, tile_k: int = INDEX_TILE_K) -> float:
    """The tiled top-k's working set: a (B, Tq, G, Tk) fp32 score tile, its head sum (B, Tq, Tk) and the running
    top-k (B, Tq, k) fp32 scores + int64 ids, twice (the one kept and the tile's merged into it)."""
    a = m.v4_attention
    return micro_batch * (tile_q * tile_k * 4 * (a.index_n_heads + 1) + 2 * tile_q * a.index_topk * 12)


def equivalent_config(cfg: Config) -> Config:
    """cfg with cp folded into dp (module docstring): cp 1, dp x cp ranks, S / cp tokens, global batch x cp; the
    torch reference core (model.v4_attention.core), which `attention_replay_swap` takes out of its trace."""
    p, t = cfg.parallel, cfg.train
    if cfg.recompute.policy != "full":
        raise ValueError(f"recompute.policy={cfg.recompute.policy!r}: the V4 cp plan assumes 'full' (a block keeps its "
                         "input alone); plan another policy with tools/plan.py, which traces V4 under cp")
    if t.seq_len % (2 * p.cp):
        raise ValueError(f"train.seq_len={t.seq_len} must be divisible by 2 cp = {2 * p.cp}")
    a = cfg.model.v4_attention
    if "core" in {f.name for f in fields(a)}:  # traced with the reference core, whose bytes the swap takes out
        cfg = cfg.replace(model=replace(cfg.model, v4_attention=replace(a, core="reference")))
    return cfg.replace(parallel=replace(p, cp=1, dp=p.dp * p.cp, cp_a2a=1),
                       train=replace(t, seq_len=t.seq_len // p.cp, global_batch=t.global_batch * p.cp))


def layer_types_of(cfg: Config, layers: list[int]) -> list[str]:
    return [cfg.model.v4_attention.layer_types_for(cfg.model.n_layers)[i] for i in layers]


def attention_replay_swap(cfg: Config, eq: Config, layers: list[int]) -> dict[str, float]:
    """Per layer type of `layers`: the efficient core's bytes at S on cp ranks minus the reference core's the
    equivalent layout's trace kept at S / cp (what the replay transient changes by)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    tokens = eq.train.micro_batch * eq.train.seq_len
    out = {}
    for lt in set(layer_types_of(cfg, layers)):
        ref = tokens * reference_core_saved_bytes(m.v4_attention, m.n_heads, lt, eq.train.seq_len)
        out[lt] = sum(efficient_core_bytes(m, lt, t.seq_len, p.cp, t.micro_batch, compute_bytes(cfg)).values()) - ref
    return out


def plan_v4_cp(cfg: Config, tile_q: int = INDEX_TILE_Q, tile_k: int = INDEX_TILE_K):
    """(the Plan of `cfg`'s layout, {pp rank: the V4 cp terms}) (module docstring). The Plan's degrees are cfg's,
    its states, saved activations, EP / ZeRO / pp traffic the equivalent layout's; its "cp" rows `cp_step_traffic`'s
    and its replay transient the efficient core's."""
    from .activation_memory import replay_working
    from .block_kinds import block_kind
    from .pipeline_memory import stage_forwards
    from .plan import plan
    from moe_lc.parallel.build import pipeline_plan

    eq = equivalent_config(cfg)
    p, t, m = cfg.parallel, cfg.train, cfg.model
    base = plan(eq, None, "", policies=("full",))
    kinds = replay_working(eq, eq.data.has_loss_mask)
    schedule = pipeline_plan(eq, eq.train.microbatches(eq.parallel.dp))[0]  # (None without pp)
    tiles = indexer_tile_bytes(m, t.micro_batch, tile_q, tile_k)
    details = {}
    for rp in base.ranks:
        runs = sum(stage_forwards(schedule, rp.pp_rank).values()) if schedule else t.microbatches(p.dp)
        swap = attention_replay_swap(cfg, eq, rp.layers)
        types = dict(zip(rp.layers, layer_types_of(cfg, rp.layers)))
        replay = max(kinds[block_kind(m, i)] + swap[types[i]] + (tiles if types[i] == CSA else 0.0) for i in rp.layers)
        tr = rp.transients
        old = max(tr["recompute replay"], tr["parts' working"])
        added = sum(tr.get(k, 0.0) for k in ADDED_TO_STEP)  # (plan.py `_transients` adds these to "step")
        # a block's forward holds what its replay re-creates: one figure for both (module docstring)
        step = max(replay, tr.get("loss head", 0.0)) + added if schedule is None else tr["step"] - old + replay
        tr.update({"recompute replay": replay, "parts' working": replay, "step": step, "indexer tiles": tiles})
        rp.traffic += cp_step_traffic(cfg, rp.layers, runs)
        rp.table = [replace(r, on={**r.on, "dp": (p.dp, "S"), "cp": (p.cp, "S")}) if r.state == "activations" else r
                    for r in rp.table]  # the sequence split over cp, not the batch over dp (same bytes a rank)
        details[rp.pp_rank] = {
            "micro_batches": runs, "replay_swap_bytes": swap,
            "cp_bytes_per_layer": {lt: layer_cp_bytes(cfg, lt) for lt in set(types.values())},
            "efficient_core_bytes": {lt: efficient_core_bytes(m, lt, t.seq_len, p.cp, t.micro_batch, compute_bytes(cfg))
                                     for lt in set(types.values())}}
    base.degrees.update(dp=p.dp, cp=p.cp, cp_a2a=p.cp_a2a)
    base.recipe = "v4 cp plan (tools/planner/v4_context.py)"
    base.notes.append("V4 under cp with the efficient core (tools/planner/v4_context.py): states, saved activations, "
                      f"EP / ZeRO / pp traffic of the equivalent cp = 1 layout (dp {p.dp * p.cp}, "
                      f"{t.seq_len // p.cp:,} tokens); cp rows the runtime's v4_cp_bytes; the replay the efficient "
                      "core's design")
    return base, details


def dsa_comparison(cfg: Config, runs: int) -> dict:
    """The cp bytes one rank sends per step for V4's attention (`layer_cp_bytes`, the runtime's count) and for V3.2's
    DSA ring on the same model and length (every layer DSA, its latent taken as V4's shared KV head d, its indexer
    keys E), both under the recipe's recomputation (full: forward, replay, backward), `runs` micro-batches, over every
    layer of the model (one rank's at pp 1; under pp the stages' sum)."""
    t, m = cfg.train, cfg.model
    types = m.v4_attention.layer_types_for(m.n_layers)
    per_type = {lt: layer_cp_bytes(cfg, lt) for lt in set(types)}
    v4 = sum(per_type[lt]["step"] for lt in types) * runs
    dsa = dsa_ring_layer_bytes(m.v4_attention.head_dim, m.v4_attention.index_head_dim, t.seq_len, cfg.parallel.cp,
                               t.micro_batch, compute_bytes(cfg))
    dsa_layer = (2 if cfg.recompute.policy == "full" else 1) * dsa["forward"] + dsa["backward"]
    return {"v4_per_layer": per_type, "v4_step": v4, "dsa_per_layer": dsa,
            "dsa_step": dsa_layer * m.n_layers * runs, "layers": {lt: types.count(lt) for lt in set(types)},
            "micro_batches": runs}


def main(argv=None) -> int:
    import argparse
    import json
    import sys

    from moe_lc.config import ConfigError, load_config
    from moe_lc.config.rules import validate
    from .plan import plan, render
    from ..step_time import model as steptime
    from ..step_time.clusters import ClusterError, resolve

    ap = argparse.ArgumentParser(prog="python -m tools.planner.v4_context", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--cluster", action="append", default=[], help="predict on this cluster (repeatable)")
    ap.add_argument("--index-tile-q", type=int, default=INDEX_TILE_Q)
    ap.add_argument("--index-tile-k", type=int, default=INDEX_TILE_K)
    ap.add_argument("--formulas", action="store_true", help="cp > 1: plan the efficient core from formulas even "
                    "where the trace's core is not the reference one (the check of that trace)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.set, check=False)
        validate(cfg)  # the runtime's rules, V4's cp spans among them
        clusters = [resolve(name, [], None) for name in args.cluster]
        formulas_only = cfg.parallel.cp > 1 and (args.formulas or traced_core_is_reference(cfg))
        if formulas_only:
            equivalent_config(cfg)  # (its refusals, before any trace)
    except (ConfigError, ClusterError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if formulas_only:  # the trace would hold the reference core at S (module docstring: the hook)
        pl, details = plan_v4_cp(cfg, args.index_tile_q, args.index_tile_k)
        runs = details[0]["micro_batches"]
    else:  # (the traced plan as tools/plan.py makes it; the predictions both ways, traced and from formulas)
        pl, details, runs = plan(cfg, None, args.recipe), {}, cfg.train.microbatches(cfg.parallel.dp)
    out = {"recipe": args.recipe, "sets": args.set, "path": "formulas (efficient core)" if formulas_only else "traced",
           "plan": pl.to_json(), "v4_cp": details, "cp_vs_dsa": dsa_comparison(cfg, runs),
           "fits_gb": {c.name: max(r.peak_bytes() for r in pl.ranks) <= c.hbm_gb * 1e9 for c, _ in clusters},
           "predicted": {}}
    for cluster, eff in clusters:
        ways = {"formulas": True} if formulas_only else {"traced": False, "formulas": True}
        for way, formulas in ways.items():
            out["predicted"][f"{cluster.name} {way}"] = steptime.predict(cfg, pl, cluster, eff, formulas=formulas)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return 0
    print(render(pl, cfg))
    cmp = out["cp_vs_dsa"]
    print(f"cp bytes per rank per step: V4 {cmp['v4_step']:,.0f} | V3.2's DSA ring on the same model "
          f"{cmp['dsa_step']:,.0f} ({cmp['dsa_step'] / max(cmp['v4_step'], 1):.1f}x)")
    for name, pred in out["predicted"].items():
        print(f"[{name}] {steptime.render(pred)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
