"""DeepSeek-V4 under context parallelism, from formulas: what the "cp" group carries per layer, what a
memory-efficient core keeps, the indexer's tile working set, and a plan of a V4 recipe with cp > 1, which the
runtime (and so the planner's trace) refuses until V4's context parallelism lands.

    python -m tools.planner.v4_context RECIPE [--set KEY=VALUE ...] [--cluster h100|h800 ...] [--json]
           [--index-tile-q 512] [--index-tile-k 4096]

Legend: B micro-batch, S sequence, cp ranks, c compute-dtype bytes, d the shared KV head dim (512), E the
indexer head dim (128), G its heads, H query heads, D model dim, W window (128), m tokens per entry, k index_topk.

The design planned (issue #67; DeepSeek-V4 report arXiv 2606.19348 section 3.4.3): a rank holds `chunks` pieces
of the sequence (zig-zag: 2, chunks r and 2cp-1-r; contiguous: 1), each of S / (cp chunks) tokens. Per layer and
micro-batch, forward, bytes this rank sends (as moe_lc/parallel/comm.py counts an all-gather: (cp - 1) / cp of
its output):

    entries     all-gather of the rank's compressed entries, padded to chunks (S / (cp chunks m) + 1) rows of d
                (DeepSeek's fixed s/m + 1 a chunk): (cp - 1) B n_pad d c            (CSA m = 4, HCA m = 128)
    index keys  CSA only: the indexer's keys of those entries likewise:   (cp - 1) B n_pad E c
    rows        each chunk's last W rows of the attention's input (B, W, D) to the rank of the next chunk (the
                window and the overlapping pooling window of the next chunk read them): chunks B W D c
Backward sends the same bytes back (the entries' and keys' gradients reduce-scattered, the rows' gradients
returned); under full recomputation the forward's collectives run again in the replay: 3x the forward a layer.

V3.2's DSA ring for the same model and length (`dsa_ring_layer_bytes`, the passes of moe_lc/ops/dsa_attention.py
and moe_lc/ops/dsa_ring.py, zig-zag): forward the indexer keys' selection ring and the latent's attention and
indexer-target rings, (cp - 1) B (S/cp) c (E + 2 L); backward the latent's and the keys' rings again with fp32
gradient accumulators travelling home: (cp - 1) B (S/cp) c (L + E) + cp B (S/cp) 4 (L + E); L the latent per
token (V3.2: 512 + 64; here V4's shared KV head, d). Checked against the planner's traced rows
(tests/test_v4_plan_1m.py).

The memory-efficient core (the design being built: q, kv, entries, the picked indices, out and an fp32 LSE saved,
no probabilities; a tiled indexer top-k that never holds (S, n) scores) keeps for one layer's backward, on a
rank's S/cp tokens: q and out (2 H d c), the token's kv (d c), the LSE (4 H), CSA's picked indices (8 k, int64),
and the gathered entries (n d c) and index keys (n E c) of the whole sequence. The indexer's working set is one
(Tq, G, Tk) fp32 score tile, its head-summed (Tq, Tk) and a running top-k (Tq, k) of fp32 scores and int64 ids.

The plan (`plan_v4_cp`): the recipe's layout with cp folded into dp (cp = 1, dp' = dp cp, S' = S / cp, global
batch x cp) has the same states on every rank (dense parameters replicated and ZeRO-sharded over dp x cp, experts
over ep within it), the same tokens a rank computes, micro-batches in flight and EP / pp traffic; the planner
plans that one as usual. What differs is the attention: the traced block's torch reference core (fp32
probabilities over its S' / m entries) is taken out of the replay transient and the efficient core's bytes at S
put in, and the "cp" traffic rows above are added. Assumes full recomputation (refused otherwise: under it a block
keeps its input alone, which does not depend on the attention), one pipeline rank's largest layer type for the
replay, and balanced routing (the planner's).
"""

from __future__ import annotations

from dataclasses import replace

from moe_lc.config import Config
from moe_lc.model.v4_counting import reference_core_saved_bytes
from .placement_semantics import Traffic

INDEX_TILE_Q = 512  # query rows of one indexer score tile (the design's; --index-tile-q)
INDEX_TILE_K = 4096  # entries of one tile (--index-tile-k)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
ADDED_TO_STEP = ("gradient rounds", "gathered units", "gathered fp8 copies", "offload fetch")


def chunks_per_rank(layout: str) -> int:
    """Pieces of the sequence a cp rank holds: zig-zag 2 (r and 2cp-1-r), contiguous 1."""
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"cp layout {layout!r}: zigzag or contiguous")
    return 2 if layout == "zigzag" else 1


def padded_entries(seq_len: int, cp: int, rate: int, layout: str) -> int:
    """Entries one rank contributes to the all-gather: chunks x (chunk tokens // m + 1)."""
    n = chunks_per_rank(layout)
    return n * (seq_len // (cp * n) // rate + 1)


def v4_cp_layer_bytes(m, layer_type: str, seq_len: int, cp: int, micro_batch: int, c: int,
                      layout: str = "zigzag") -> dict[str, float]:
    """Forward bytes one rank sends over "cp" for one layer and micro-batch, by part (module docstring)."""
    a = m.v4_attention
    if cp == 1:
        return {"entries": 0.0, "index_keys": 0.0, "rows": 0.0}
    rate = a.compress_rate(layer_type)
    n_pad = padded_entries(seq_len, cp, rate, layout) if rate else 0
    gathered = (cp - 1) * micro_batch * n_pad * c
    return {"entries": gathered * a.head_dim if rate else 0.0,
            "index_keys": gathered * a.index_head_dim if layer_type == CSA else 0.0,
            "rows": chunks_per_rank(layout) * micro_batch * a.sliding_window * m.dim * c}


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
    """cfg with cp folded into dp (module docstring): cp 1, dp x cp ranks, S / cp tokens, global batch x cp."""
    p, t = cfg.parallel, cfg.train
    if cfg.recompute.policy != "full":
        raise ValueError(f"recompute.policy={cfg.recompute.policy!r}: the V4 cp plan assumes 'full' (a block keeps its "
                         "input alone); plan another policy once the runtime traces V4 under cp")
    if t.seq_len % (p.cp * 2 * 128):
        raise ValueError(f"train.seq_len={t.seq_len} must be divisible by 2 cp x 128 = {p.cp * 256}")
    return cfg.replace(parallel=replace(p, cp=1, dp=p.dp * p.cp, cp_a2a=1),
                       train=replace(t, seq_len=t.seq_len // p.cp, global_batch=t.global_batch * p.cp))


def layer_types_of(cfg: Config, layers: list[int]) -> list[str]:
    return [cfg.model.v4_attention.layer_types_for(cfg.model.n_layers)[i] for i in layers]


def cp_step_traffic(cfg: Config, layers: list[int], runs: int, layout: str) -> list[Traffic]:
    """The "cp" rows of one pipeline rank per step: its layers' forward bytes x (1 forward + 1 backward + 1
    replay) x the micro-batches the rank runs, per op."""
    p, t = cfg.parallel, cfg.train
    c = 2 if cfg.precision.recipe != "fp32" else 4
    total = {"entries": 0.0, "index_keys": 0.0, "rows": 0.0}
    for lt in layer_types_of(cfg, layers):
        for k, v in v4_cp_layer_bytes(cfg.model, lt, t.seq_len, p.cp, t.micro_batch, c, layout).items():
            total[k] += v * runs
    what = f"formula: {len(layers)} V4 layers x {runs} micro-batches (tools/planner/v4_context.py)"
    gathered = total["entries"] + total["index_keys"]
    return [Traffic("cp", "all_gather", 2 * gathered, what + ", forward and replay", "estimate"),
            Traffic("cp", "reduce_scatter", gathered, what + ", backward", "estimate"),
            Traffic("cp", "send", 3 * total["rows"], what + ", rows: forward, replay, backward", "estimate")]


def attention_replay_swap(cfg: Config, eq: Config, layers: list[int]) -> dict[str, float]:
    """Per layer type of `layers`: the efficient core's bytes at S on cp ranks minus the reference core's the
    equivalent layout's trace kept at S / cp (what the replay transient changes by)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    c = 2 if cfg.precision.recipe != "fp32" else 4
    tokens = eq.train.micro_batch * eq.train.seq_len
    out = {}
    for lt in set(layer_types_of(cfg, layers)):
        ref = tokens * reference_core_saved_bytes(m.v4_attention, m.n_heads, lt, eq.train.seq_len)
        out[lt] = sum(efficient_core_bytes(m, lt, t.seq_len, p.cp, t.micro_batch, c).values()) - ref
    return out


def plan_v4_cp(cfg: Config, tile_q: int = INDEX_TILE_Q, tile_k: int = INDEX_TILE_K):
    """(the Plan of `cfg`'s layout, {pp rank: the V4 cp terms}) (module docstring). The Plan's degrees are cfg's,
    its states, saved activations, EP / ZeRO / pp traffic the equivalent layout's; its "cp" rows and its replay
    transient from the formulas here."""
    from .activation_memory import replay_working
    from .block_kinds import block_kind
    from .pipeline_memory import stage_forwards
    from .plan import plan
    from moe_lc.parallel.build import pipeline_plan

    eq = equivalent_config(cfg)
    p, t, m = cfg.parallel, cfg.train, cfg.model
    base = plan(eq, None, "", policies=("full",))
    kinds = replay_working(eq, eq.data.has_loss_mask)
    layout = p.cp_layout if p.cp_layout in ("zigzag", "contiguous") else "zigzag"
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
        rp.traffic += cp_step_traffic(cfg, rp.layers, runs, layout)
        rp.table = [replace(r, on={**r.on, "dp": (p.dp, "S"), "cp": (p.cp, "S")}) if r.state == "activations" else r
                    for r in rp.table]  # the sequence split over cp, not the batch over dp (same bytes a rank)
        c = 2 if cfg.precision.recipe != "fp32" else 4
        details[rp.pp_rank] = {
            "micro_batches": runs, "replay_swap_bytes": swap,
            "cp_bytes_per_layer": {lt: v4_cp_layer_bytes(m, lt, t.seq_len, p.cp, t.micro_batch, c, layout)
                                   for lt in set(types.values())},
            "efficient_core_bytes": {lt: efficient_core_bytes(m, lt, t.seq_len, p.cp, t.micro_batch, c)
                                     for lt in set(types.values())}}
    base.degrees.update(dp=p.dp, cp=p.cp, cp_a2a=p.cp_a2a)
    base.recipe = "v4 cp plan (tools/planner/v4_context.py)"
    base.notes.append("V4 under cp from formulas (tools/planner/v4_context.py): states, saved activations, EP / ZeRO / "
                      f"pp traffic of the equivalent cp = 1 layout (dp {p.dp * p.cp}, {t.seq_len // p.cp:,} tokens); "
                      "cp rows and the replay from the efficient core's design")
    return base, details


def dsa_comparison(cfg: Config, runs: int) -> dict:
    """The cp bytes one rank sends per step for V4's attention (`cp_step_traffic`'s formula) and for V3.2's DSA
    ring on the same model and length (every layer DSA, its latent taken as V4's shared KV head d, its indexer
    keys E), both under full recomputation (forward, replay, backward), `runs` micro-batches."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    c = 2 if cfg.precision.recipe != "fp32" else 4
    layout = p.cp_layout if p.cp_layout in ("zigzag", "contiguous") else "zigzag"
    types = m.v4_attention.layer_types_for(m.n_layers)
    per_type = {lt: v4_cp_layer_bytes(m, lt, t.seq_len, p.cp, t.micro_batch, c, layout) for lt in set(types)}
    v4 = sum(3 * sum(per_type[lt].values()) for lt in types) * runs
    dsa = dsa_ring_layer_bytes(m.v4_attention.head_dim, m.v4_attention.index_head_dim, t.seq_len, p.cp,
                               t.micro_batch, c)
    dsa_layer = 2 * dsa["forward"] + dsa["backward"]
    return {"v4_per_layer_forward": per_type, "v4_step": v4, "dsa_per_layer": dsa,
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.set, check=False)
        if cfg.parallel.cp > 1:
            validate(equivalent_config(cfg))  # every rule but V4's cp refusal (which this plan stands in for)
        else:
            validate(cfg)
        clusters = [resolve(name, [], None) for name in args.cluster]
    except (ConfigError, ClusterError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.parallel.cp > 1:
        pl, details = plan_v4_cp(cfg, args.index_tile_q, args.index_tile_k)
        runs = details[0]["micro_batches"]
    else:  # (the traced plan as tools/plan.py makes it; the predictions both ways, traced and from formulas)
        pl, details, runs = plan(cfg, None, args.recipe), {}, cfg.train.microbatches(cfg.parallel.dp)
    out = {"recipe": args.recipe, "plan": pl.to_json(), "v4_cp": details, "cp_vs_dsa": dsa_comparison(cfg, runs),
           "fits_gb": {c.name: max(r.peak_bytes() for r in pl.ranks) <= c.hbm_gb * 1e9 for c, _ in clusters},
           "predicted": {}}
    for cluster, eff in clusters:
        ways = {"formulas": True} if cfg.parallel.cp > 1 else {"traced": False, "formulas": True}
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
