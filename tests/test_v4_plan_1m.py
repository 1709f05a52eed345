"""DeepSeek-V4 at a million tokens on the planner's side: its attention FLOPs per layer type against a hand count,
its cp bytes (the runtime's `v4_cp_bytes` with the replay) against a hand count and against what the dry run and
the planner's trace count, V3.2's DSA ring against the planner's traced ring, the step-time
model pricing V4 blocks' kernels, and the 1M recipe's plan under 80 GB (tools/step_time/v4_flops.py,
tools/planner/v4_context.py)."""

from __future__ import annotations

import pytest

from moe_lc.config import load_config
from moe_lc.model.v4_counting import v4_attention_flops
from tools.planner.v4_context import (cp_step_traffic, dsa_ring_layer_bytes, efficient_core_bytes,
                                      equivalent_config, layer_cp_bytes)
from tools.step_time.v4_flops import LAYER_TYPES, v4_layer_flops

SWA, CSA, HCA = LAYER_TYPES
TINY = "recipes/debug_v4_cpu.toml"  # D 64, H 4, d 32, Cq 32, 2 output groups of 16, W 16, m 4 / 16, G 4, E 16, k 8


@pytest.fixture(scope="module")
def tiny():
    return load_config(TINY).model


def test_flops_per_layer_type_match_a_hand_count(tiny):
    """S = 64, causal: window keys sum_t min(16, t + 1) = 136 + 48 x 16 = 904; CSA entries sum_t (t + 1) // 4 =
    4 (1 + ... + 15) + 16 = 496, capped at k = 8: 4 (1 + ... + 7) + 8 x 8 x 4 + 8 = 376; HCA's (t + 1) // 16:
    16 + 32 + 48 + 4 = 100. 4 d H = 512 FLOPs a key; the indexer 4 heads x (2 x 16 + 2) = 136 an entry."""
    S, key = 64, 4 * 32 * 4
    projections = 2 * (64 * (32 + 32) + 32 * 4 * 32 + 4 * 32 * 16 + 2 * 16 * 64)
    mhc = 2 * (2 * 4 * 6 * 4 * 64 + 2 * 4 * 64 + 2 * 4 * 4 * 64)
    expect = {
        SWA: dict(window=key * 904 / S, sparse=0, dense=0, indexer=0, compressor=0, indexer_proj=0),
        CSA: dict(window=key * 904 / S, sparse=key * 376 / S, dense=0, indexer=136 * 496 / S,
                  compressor=2 * 64 * 2 * 2 * 32, indexer_proj=2 * (64 * 4 * 16 + 32 * 4 * 16 + 64 * 4)),
        HCA: dict(window=key * 904 / S, sparse=0, dense=key * 100 / S, indexer=0, compressor=2 * 64 * 2 * 32,
                  indexer_proj=0)}
    for layer_type, parts in expect.items():
        got = v4_layer_flops(tiny, layer_type, S)
        for part, value in {**parts, "projections": projections, "mhc": mhc}.items():
            assert got[part] == pytest.approx(value), (layer_type, part)
        # the attention parts are moe_lc/model/v4_counting.py's count (what MFU's numerator reads), part for part
        ref = v4_attention_flops(tiny.v4_attention, tiny.dim, tiny.n_heads, layer_type, S)
        assert got["total"] - got["mhc"] == pytest.approx(ref["total"])
        assert got["window"] + got["sparse"] + got["dense"] == pytest.approx(ref["core"])


def test_full_convention_counts_every_key(tiny):
    """No causal mask: every query reads W = 16 window keys and all 64 / m entries (CSA: k = 8 of its 16)."""
    key = 4 * 32 * 4
    csa, hca = v4_layer_flops(tiny, CSA, 64, "full"), v4_layer_flops(tiny, HCA, 64, "full")
    assert (csa["window"], csa["sparse"], csa["indexer"]) == (key * 16, key * 8, 16 * 136)
    assert hca["dense"] == key * 4
    with pytest.raises(ValueError, match="convention"):
        v4_layer_flops(tiny, CSA, 64, "half")


def test_cp_bytes_are_the_runtimes_with_the_replay():
    """S = 128 on cp 2 (zig-zag), B = 8, fp32: a rank pools 64 / 4 = 16 CSA entries (32 values, index keys 16) and
    64 / 16 = 4 HCA entries, all sent to the other rank; every layer type's halo is 15 rows (W - 1 = 15 >= 2 x 4 - 1,
    16 - 1) of 64, one sent and one received a layer (rank 0: chunk 0's tail to chunk 1, chunk 2's tail from rank
    1). Full recomputation's replay gathers and sends the forward's again; none does not."""
    sets = ["parallel.cp=2", "parallel.dp=1"]
    halo = 8 * 15 * 64 * 4
    for policy, again in (("full", 1), ("none", 0)):
        cfg = load_config(TINY, sets + [f"recompute.policy={policy}"], world_size=2)
        csa, hca, swa = (layer_cp_bytes(cfg, t) for t in (CSA, HCA, SWA))
        assert (csa["all_gather"], csa["reduce_scatter"]) == (8 * 16 * (32 + 16) * 4,) * 2
        assert (hca["all_gather"], swa["all_gather"]) == (8 * 4 * 32 * 4, 0)
        assert csa["send"] == hca["send"] == swa["send"] == 2 * halo
        assert csa["replay"] == again * (8 * 16 * 48 * 4 + halo)
        rows = {t.op: t.bytes for t in cp_step_traffic(cfg, [0, 1, 2, 3], 3)}  # SWA, CSA, HCA, CSA; 3 micro-batches
        gathered = 2 * 8 * 16 * 48 * 4 + 8 * 4 * 32 * 4
        assert rows == {"all_gather": 3 * (1 + again) * gathered, "reduce_scatter": 3 * gathered,
                        "send": 3 * 4 * (2 + again) * halo}
    # the keys' gradients are reduce-scattered only where the indexer loss trains
    frozen = load_config(TINY, sets + ["model.v4_attention.index_loss_weight=0"], world_size=2)
    assert layer_cp_bytes(frozen, CSA)["reduce_scatter"] == 8 * 16 * 32 * 4
    assert layer_cp_bytes(load_config(TINY, ["parallel.dp=1"]), CSA)["step"] == 0


def _counted_cp_bytes(sets: list[str], cp: int, rank: int) -> tuple[dict, dict]:
    """(the dry run's "cp" bytes of global rank `rank`, one step of the tiny V4 on cp ranks, counted by comm.py; this
    file's rows for that cp rank)."""
    from tools.dry_run.rank_trace import trace_rank

    cfg = load_config(TINY, [f"parallel.cp={cp}", "parallel.dp=1", *sets], world_size=cp)
    report = trace_rank(cfg, cp, rank)
    counted = {k: v for k, v in report["comm"].items() if k.startswith("comm/cp/")}
    runs = cfg.train.microbatches(cfg.parallel.dp)
    return counted, {t.key: t.bytes for t in cp_step_traffic(cfg, list(range(cfg.model.n_layers)), runs, rank)}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("policy", ["full", "none"])
def test_counted_cp_bytes_equal_the_planners_rows(layout, policy):
    """Must-show 1's counted = planned: the dry run of the tiny V4 (every layer type, cp 2) counts exactly this file's
    all-gather, reduce-scatter and send rows on cp rank 1, and the planner's trace (tools/plan.py) of rank 0 the same."""
    from tools.planner.plan import plan

    sets = [f"parallel.cp_layout={layout}", f"recompute.policy={policy}"]
    counted, planned = _counted_cp_bytes(sets, 2, 1)
    assert counted == planned and len(counted) == 3, (counted, planned)
    cfg = load_config(TINY, ["parallel.cp=2", "parallel.dp=1", *sets], world_size=2)
    traced = {t.key: t.bytes for t in plan(cfg, 2).ranks[0].traffic if t.group == "cp"}
    assert traced == {t.key: t.bytes for t in cp_step_traffic(cfg, [0, 1, 2, 3], 1)}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_counted_cp_bytes_on_a_middle_rank_of_cp_4(layout):
    """cp 4, rank 1: a middle zig-zag rank exchanges 4 halos a layer pass, a contiguous one 2 (rank 0: 2 and 1)."""
    counted, planned = _counted_cp_bytes([f"parallel.cp_layout={layout}", "recompute.policy=full"], 4, 1)
    assert counted == planned, (counted, planned)


def test_efficient_core_keeps_no_probabilities(tiny):
    """What the efficient core keeps on one of 2 ranks at S = 256 (B 1, bf16): q and out 128 x 2 x 4 x 32 x 2, kv
    128 x 32 x 2, the LSE 128 x 4 x 4, CSA's picked ids 128 x 8 x 8, the gathered 64 entries and keys."""
    got = efficient_core_bytes(tiny, CSA, 256, 2, 1, 2)
    assert got == {"q, out": 128 * 2 * 4 * 32 * 2, "kv": 128 * 32 * 2, "lse": 128 * 4 * 4, "picked indices": 128 * 64,
                   "gathered entries": 64 * 32 * 2, "gathered index keys": 64 * 16 * 2}


def test_dsa_ring_formula_equals_the_planners_traced_ring():
    """V3.2's DSA ring as the planner traces it (moe_lc/ops/dsa_attention.py's passes under cp 2: the indexer keys,
    the latent twice forward; both again with fp32 accumulators backward): one DSA layer at S = 1024, fp32,
    latent 64 + 16, indexer keys 32; under "full" the forward's rings run again."""
    from tools.planner.plan import plan

    sets = ["parallel.cp=2", "parallel.dp=1", "parallel.pp=1", "parallel.tp=1", "parallel.ep=1", "train.micro_batch=1",
            "train.global_batch=1", "train.seq_len=1024", "model.n_layers=1", "model.moe.n_dense_layers=1"]
    f = dsa_ring_layer_bytes(64 + 16, 32, 1024, 2, 1, 4)
    for policy, expect in (("none", f["forward"] + f["backward"]), ("full", 2 * f["forward"] + f["backward"])):
        cfg = load_config("recipes/longctx/dsa_sparse.toml", sets + [f"recompute.policy={policy}"], world_size=2)
        sent = sum(t.bytes for t in plan(cfg, 2).ranks[0].traffic if t.group == "cp")
        assert sent == expect, policy


def test_equivalent_layout_folds_cp_into_dp():
    cfg = load_config("recipes/longctx/v4_flash_1m.toml", check=False)
    eq = equivalent_config(cfg)
    p, q = cfg.parallel, eq.parallel
    assert (q.cp, q.dp * q.pp, eq.train.seq_len) == (1, p.dp * p.cp * p.pp, cfg.train.seq_len // p.cp)
    assert eq.train.microbatches(q.dp) == cfg.train.microbatches(p.dp)
    with pytest.raises(ValueError, match="full"):
        equivalent_config(cfg.replace(recompute=cfg.recompute.__class__("selective", ["norm"])))


def test_step_time_prices_v4_blocks_kernels():
    """The traced kernels of a V4 block are booked under its kind ("csa moe", ...): the stage's compute has its
    GEMMs (before the fix, a V4 stage was priced as memory-bound work alone)."""
    from tools.step_time.clusters import resolve
    from tools.step_time.compute import stage_seconds

    cfg = load_config(TINY, ["parallel.dp=1"], world_size=1)
    cluster, eff = resolve("h100", [], None)
    _, kinds = stage_seconds(cfg, list(range(cfg.model.n_layers)), False, False, cluster, eff)  # blocks alone
    assert kinds.get("gemm", 0) > 0, kinds  # (before the fix: {"memory": ...} alone)


@pytest.mark.slow
def test_v4_flash_1m_plans_under_80_gb():
    """The 1M recipe (pp 1 x cp 256, EP 256, ZeRO-2, FP8, full recomputation): every rank's planned peak within an
    80 GB GPU (the layout search's rule: peak <= 80e9 bytes), its cp rows the formula's."""
    from tools.planner.v4_context import plan_v4_cp

    cfg = load_config("recipes/longctx/v4_flash_1m.toml", check=False)
    pl, details = plan_v4_cp(cfg)
    assert pl.degrees["cp"] == 256 and pl.degrees["world"] == 256
    assert max(r.peak_bytes() for r in pl.ranks) <= 80e9
    sent = {t.op: t.bytes for t in pl.ranks[0].traffic if t.group == "cp"}
    # what the trace of the real layout counts at 1M (tools/plan.py, 3 minutes): a CSA layer gathers 255 x 1,024
    # entries of 512 + 128 bf16 values, an HCA layer 255 x 32 of 512; 16 micro-batches, the replay's again
    gathered = 16 * 255 * (21 * 1024 * 640 + 20 * 32 * 512) * 2
    assert sent["all_gather"] == 2 * gathered and sent["reduce_scatter"] == gathered
    assert details[0]["cp_bytes_per_layer"][CSA]["all_gather"] == 255 * 1024 * 640 * 2


def test_work_prices_the_indexer_forward_only():
    """The step-time Work of a CSA block: its core is the window and the picked entries, the indexer's scores a
    separate forward-only term (no 2.5x backward), and the mHC maps are GEMMs."""
    from tools.step_time.work import block_work

    cfg = load_config(TINY, ["recompute.policy=full"])
    m, S = cfg.model, cfg.train.seq_len
    f = v4_layer_flops(m, CSA, S)
    w = block_work(cfg, 1)  # debug_v4_cpu's block 1 is CSA
    assert w.scores == pytest.approx(f["indexer"]) and w.attention == pytest.approx(f["window"] + f["sparse"])
    assert w.recomputed.scores == w.scores  # full recomputation replays it
    assert block_work(cfg, 0).scores == 0
