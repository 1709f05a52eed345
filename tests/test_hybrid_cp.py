"""Hybrid context parallelism (`parallel.cp_a2a`, moe_lc/parallel/cp/ulysses.py): placement, the attention on
real all-to-all and ring groups against fp64 full attention, counted bytes by formula, the rules that
refuse a layout before any process group, and training equal to one process (fp32, 1e-5) with the
planner's counted bytes equal to the run's.

The attention checks share one 4-process gloo job (`hybrid_results`, module scope): cp = 4 with A = 2 and
A = 4, GQA with J = 2 and J = 1 kv heads (fewer than A: repeated), D_v != D_qk, and packed documents.
Training: 5 steps per layout; cp4 A2 x tp2 (8 ranks), MLA and documents at A = 4 are `-m slow` (~100 s
for the whole file with them on this 2-core machine, ~60 s without).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moe_lc.config import ConfigError, ParallelConfig, load_config
from moe_lc.ops.attention import attention_with_lse
from moe_lc.ops.documents import Documents
from moe_lc.parallel.cp.ring import chunk_ids, zigzag_shard
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.cp.ulysses import hybrid_attention_with_lse, hybrid_chunk_ids, kv_repeats
from tests.harness import RECIPES, ROOT, assert_equivalent, reference, run_layout, run_workers

RECIPE = RECIPES / "debug_cpu.toml"
SCALE = 0.3


# --------------------------------------------------------------------------- placement (no processes)


def test_hybrid_placement_is_the_docstring_table_and_covers_every_chunk_once():
    assert [hybrid_chunk_ids(r, 4, 2) for r in range(4)] == [(0, 6), (1, 7), (2, 4), (3, 5)]
    for cp, a2a in [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]:
        held = [c for r in range(cp) for c in hybrid_chunk_ids(r, cp, a2a)]
        assert sorted(held) == list(range(2 * cp)), (cp, a2a, held)
        if a2a == 1:
            assert [hybrid_chunk_ids(r, cp, 1) for r in range(cp)] == [chunk_ids(r, cp) for r in range(cp)]
        # after the all-to-all, ring position o holds super-chunks (o, 2R-1-o) of A chunks: zig-zag over R
        R = cp // a2a
        for o in range(R):
            got = sorted(c for a in range(a2a) for c in hybrid_chunk_ids(o * a2a + a, cp, a2a))
            want = sorted(s * a2a + i for s in chunk_ids(o, R) for i in range(a2a))
            assert got == want, (cp, a2a, o)


def test_hybrid_groups_split_cp_into_consecutive_a2a_and_strided_rings():
    dims = ParallelDims.from_config(ParallelConfig(cp=4, cp_a2a=2, tp=2), 16)  # dp = 2
    assert dims.group_ranks("cp_a2a")[:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert dims.group_ranks("cp_ring")[:4] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert sorted(r for g in dims.group_ranks("cp_a2a") for r in g) == list(range(16))


def test_kv_repeats():
    assert [kv_repeats(j, a) for j, a in [(2, 2), (1, 2), (2, 4), (1, 4), (4, 2), (3, 2)]] == [1, 2, 2, 4, 1, 2]


# --------------------------------------------------------------------------- rules


LINE = {
    "heads": "parallel.cp_a2a=4 must divide the query heads per tp rank, model.n_heads / parallel.tp = 4 / 2 = 2 "
             "(the all-to-all splits heads)",
    "cp": "parallel.cp_a2a=3 must divide parallel.cp=4 (all-to-all groups of consecutive cp ranks)",
    "dsa": "parallel.cp_a2a=2 with DeepSeek Sparse Attention (model.dsa.enabled) is not built: its sparse ring "
           "moves the latent, which the all-to-all cannot split by head",
}
MLA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=24"]


@pytest.mark.parametrize("case, overrides, world", [
    ("heads", ["parallel.cp=4", "parallel.cp_a2a=4", "parallel.tp=2"], 8),
    ("cp", ["parallel.cp=4", "parallel.cp_a2a=3"], 4),
    ("dsa", MLA + ["model.dsa.enabled=true", "model.dsa.index_topk=16", "parallel.cp=4", "parallel.cp_a2a=2"], 4),
])
def test_refused_layouts_say_one_line(case, overrides, world):
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, overrides, world_size=world)
    assert info.value.errors == [LINE[case]]


def test_refused_layout_stops_before_any_process_group(tmp_path):
    """Under torchrun (4 ranks) the trainer exits 2 with the one line, before init_process_group: a
    rank that reached it would wait for the others' rendezvous, and the run would hang, not exit."""
    proc = subprocess.run([sys.executable, "-m", "moe_lc.train", str(RECIPE), "--set", "parallel.cp=4",
                           "--set", "parallel.cp_a2a=4", "--set", "parallel.tp=2", "--set",
                           f"train.output_dir={tmp_path}/run"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**__import__("os").environ, "WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0",
                               "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert LINE["heads"] in proc.stderr


# --------------------------------------------------------------------------- the attention on 4 gloo ranks


CASES = {  # name: (B, S, H, J, D_qk, D_v, document lengths per row or None)
    "gqa": (2, 64, 4, 2, 16, 16, None),
    "gqa_one_kv_head": (1, 64, 4, 1, 16, 24, None),
    "mha_dv_lt_dqk": (1, 64, 4, 4, 24, 16, None),
    "documents": (2, 64, 4, 2, 16, 16, [[3, 20, 1, 40], [64]]),
}


def _inputs(case, seed=0):
    B, S, H, J, Dqk, Dv, _ = CASES[case]
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return make(B, S, H, Dqk), make(B, S, J, Dqk) * 2, make(B, S, J, Dv), make(B, S, H, Dv)


def _truth(case):
    """fp64 causal attention on one process (inside each document with lengths)."""
    q, k, v, dout = (x.requires_grad_() if i < 3 else x for i, x in enumerate(_inputs(case)))
    lengths, S = CASES[case][6], q.shape[1]
    pieces = Documents(lengths, S).plan_call(((0, S),), [((0, S),)])[0] if lengths else None
    out, lse = attention_with_lse(q, k, v, True, SCALE, "reference", pieces)
    out.backward(dout)
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _hybrid_worker(rank, world):
    """Per (case, A): this rank's chunks, its out / dq / dk / dv (fp32, hybrid placement), its head group's
    lse, and the counted bytes of both collectives (forward, backward) with their formulas."""
    results = {}
    for a2a in (2, 4):
        dims = ParallelDims.from_config(ParallelConfig(cp=4, cp_a2a=a2a), world, rank)
        dims.init_groups()
        cp, inner, ring = dims["cp"], dims["cp_a2a"], dims["cp_ring"]
        chunks = hybrid_chunk_ids(cp.rank, 4, a2a)
        for case in CASES:
            q, k, v, dout = (zigzag_shard(x.float(), cp, 1, chunks) for x in _inputs(case))
            q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
            lengths = CASES[case][6]
            docs = Documents(lengths, CASES[case][1]) if lengths else None
            dims.counter.reset()
            out, lse = hybrid_attention_with_lse(q, k, v, SCALE, inner, ring, "reference", docs)
            fwd = dict(dims.counter.bytes)
            out.backward(dout)
            bwd = {key: n - fwd.get(key, 0) for key, n in dims.counter.bytes.items()}
            results[(case, a2a)] = {"chunks": chunks, "a2a": inner.rank, "ring": ring.rank, "out": out.detach(),
                                    "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad, "fwd": fwd, "bwd": bwd,
                                    "formula": _formula(q, k, v, out, a2a, ring.size)}
    return results


def _formula(q, k, v, out, a2a, R):
    """(forward, backward) bytes per (group, op): the all-to-all moves (A-1)/A of q, k, v (kv heads repeated
    to a multiple of A) and out, each way; the ring over R positions moves its K/V blocks (cp/ring.py)."""
    f = kv_repeats(k.shape[2], a2a)
    e, kv = 4, (k.numel() + v.numel()) * f  # the blocks after the all-to-all hold as many elements
    moved = (q.numel() + kv + out.numel()) * e * (a2a - 1) // a2a
    fwd, bwd = {("cp_a2a", "all_to_all"): moved}, {("cp_a2a", "all_to_all"): moved}
    if R > 1:
        fwd[("cp_ring", "send")] = (R - 1) * kv * e
        bwd[("cp_ring", "send")] = (R - 1) * kv * e + R * kv * 4
    return fwd, bwd


@pytest.fixture(scope="module")
def hybrid_results():
    return run_workers(_hybrid_worker, 4)


def _gather(per_rank, name):
    """The full (B, S, ...) tensor from every rank's hybrid chunks."""
    B, S = per_rank[0][name].shape[:2]
    C = S // 2
    full = torch.empty(B, C * 2 * len(per_rank), *per_rank[0][name].shape[2:])
    for r in per_rank:
        for i, c in enumerate(r["chunks"]):
            full[:, c * C:(c + 1) * C] = r[name][:, i * C:(i + 1) * C]
    return full


@pytest.mark.parametrize("a2a", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_attention_equals_full_attention(hybrid_results, case, a2a):
    """out, dq, dk, dv (gathered by chunk) and each head group's lse vs fp64 attention on one process."""
    truth = _truth(case)
    per_rank = [res[(case, a2a)] for res in hybrid_results]
    errs = {}
    for name in ("out", "dq", "dk", "dv"):
        got, want = _gather(per_rank, name).double(), truth[name]
        errs[name] = ((got - want).norm() / want.norm()).item()
    H, S, R = CASES[case][2], CASES[case][1], 4 // a2a
    for r in per_rank:  # lse (B, H/A, 2 A c): head group a over ring position o's super-chunks
        o, a, sc = r["ring"], r["a2a"], S // (2 * R)
        cols = torch.cat([torch.arange(s * sc, (s + 1) * sc) for s in chunk_ids(o, R)])
        want = truth["lse"][:, a * H // a2a:(a + 1) * H // a2a][:, :, cols]
        errs["lse"] = max(errs.get("lse", 0.0), (r["lse"].double() - want).abs().max().item())
    print(case, a2a, {k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("a2a", [2, 4])
def test_hybrid_traffic_matches_formula(hybrid_results, a2a):
    for rank, res in enumerate(hybrid_results):
        for case in CASES:
            r = res[(case, a2a)]
            assert (r["fwd"], r["bwd"]) == r["formula"], (rank, case, r["fwd"], r["bwd"], r["formula"])


# --------------------------------------------------------------------------- training equal to one process


TRAIN = ["train.steps=5", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=2"]
LAYOUTS = {  # name: (overrides beside TRAIN, world); the debug model has 4 query and 2 kv heads
    "cp4_a2": (["parallel.cp=4", "parallel.cp_a2a=2"], 4),
    "cp4_a4": (["parallel.cp=4", "parallel.cp_a2a=4"], 4),  # pure Ulysses, kv heads repeated 2x
    "mla_expanded_cp4_a2": (MLA + ["parallel.cp=4", "parallel.cp_a2a=2", "parallel.mla_ring=expanded"], 4),
    # the latent all-gathered over the a2a ranks, its ring outside, W_UKV's rows split by head group
    "mla_latent_cp4_a2": (MLA + ["parallel.cp=4", "parallel.cp_a2a=2"], 4),
    "mla_latent_cp4_a4": (MLA + ["parallel.cp=4", "parallel.cp_a2a=4"], 4),
    "pp2_dualpipe_cp2_a2": (["parallel.cp=2", "parallel.cp_a2a=2", "parallel.pp=2", "parallel.pp_schedule=dualpipe",
                             "train.micro_batch=1"], 4),
    # one kv head per tp rank, fewer than A: repeated 2x
    "cp4_a2_tp2": (["parallel.cp=4", "parallel.cp_a2a=2", "parallel.tp=2"], 8),
}


SLOW = ("cp4_a2_tp2", "mla_expanded_cp4_a2", "mla_latent_cp4_a4")  # 17 s each beside other work on 2 cores: -m slow


def _assert_counted_equals_planned(got, overrides, world, groups=None):
    """Every rank's counted bytes per step, every group and op (or those of `groups`), equal the planner's
    (tools/plan.py traces the blocks on the recipe's mesh, the all-to-all and ring groups included)."""
    from tools.planner.plan import plan

    cfg = load_config(RECIPE, overrides, world_size=world)
    predicted = plan(cfg, world)
    per_stage = world // cfg.parallel.pp
    for r in range(world):
        rank = predicted.ranks[r // per_stage]
        want = rank.comm_per_step()
        estimated = {t.key for t in rank.traffic if t.status != "exact"}
        assert any("cp_a2a" in k for k in want), want
        assert not {k for k in estimated if k.split("/")[1] in ("cp_a2a", "cp_ring")}, estimated  # planned exactly
        for step in got.comm_per_rank[r]:
            if groups is not None:
                step, want = ({k: v for k, v in d.items() if k.split("/")[1] in groups} for d in (step, want))
            assert step.keys() == want.keys(), (r, step, want)
            for key, value in want.items():
                want_value = pytest.approx(value, rel=0.10) if key in estimated else value
                assert step[key] == want_value, (r, key, step, want)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LAYOUTS])
def test_hybrid_cp_trains_like_one_process(layout):
    extra, world = LAYOUTS[layout]
    micro = [o for o in extra if not o.startswith("parallel.")]
    ref = reference(RECIPE, TRAIN + micro)
    overrides = TRAIN + extra + ["parallel.dp=1"]
    got = run_layout(RECIPE, overrides, world=world)
    report = assert_equivalent(ref, got, rtol=1e-5)
    print(f"{layout}: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e} ({report.worst_param})")
    latent = "latent" in layout  # the latent core gathers the latent (and scatters its gradient) over cp_a2a
    for ranks in got.comm_per_rank:
        assert all(("comm/cp_a2a/all_gather_bytes" in step) == latent for step in ranks), ranks[0]
    _assert_counted_equals_planned(got, overrides, world)


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory):
    from tests.test_documents_training import write_packed_corpus

    prefix = tmp_path_factory.mktemp("packed") / "docs"
    write_packed_corpus(prefix)
    return [f"data.path={prefix}"]


@pytest.mark.parametrize("a2a", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_document_masked_hybrid_cp_trains_like_one_process(packed_corpus, a2a):
    """Packed documents (tests/test_documents_training.py's corpus: documents shorter than a chunk, starting
    mid-chunk, spanning chunks, longer than the window) under cp4 with A = 2 and A = 4, no padding."""
    from tests.test_documents_training import TRAIN as DOC_TRAIN

    ref = reference(RECIPE, DOC_TRAIN + packed_corpus)
    overrides = DOC_TRAIN + packed_corpus + ["parallel.cp=4", f"parallel.cp_a2a={a2a}", "parallel.dp=1"]
    got = run_layout(RECIPE, overrides, world=4)
    report = assert_equivalent(ref, got, rtol=1e-5)
    print(f"documents cp4 A={a2a}: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e}")
    # the trainer's document-work metric (an all-gather of a few bytes over "cp") is not planned, ring or not
    _assert_counted_equals_planned(got, overrides, 4, groups=("cp_a2a", "cp_ring"))


# --------------------------------------------------------------------------- the two-level modelled link


def test_two_level_link_parses_and_charges_inter_node_bytes_to_the_slow_level():
    from moe_lc.parallel.comm_timing import Link

    p = ParallelConfig(link="intra=2:200,inter=10:25")
    assert p.errors() == [] and p.link_model == (pytest.approx((2e-6, 200e9)), pytest.approx((10e-6, 25e9)))
    assert ParallelConfig(link="50:2").link_model == (pytest.approx((50e-6, 2e9)),) * 2
    bad = ParallelConfig(link="intra=2:200").errors()
    assert bad == ["parallel.link='intra=2:200' must be 'LATENCY_US:GBPS' with latency >= 0 and bandwidth > 0 (e.g. "
                   "'50:2': 50 us, 2 GB/s), 'intra=LATENCY_US:GBPS,inter=LATENCY_US:GBPS' (inside a node, between "
                   "nodes), or '' (off)"]
    link = Link(0.0, 1e9, inter=Link(1e-3, 1e8))
    assert link.seconds(1e6) == pytest.approx(1e-3)  # all inside the node
    assert link.seconds(1e6, 1e6) == pytest.approx(1e-3 + 1e-2)  # all across
    assert link.seconds(2e6, 1e6) == pytest.approx(1.1e-2)  # both at once: the slower


def _link_worker(rank, world):
    """4 ranks as 2 nodes x 2, link intra 0 us : 1 GB/s, inter 0 us : 0.01 GB/s: the modelled seconds of a
    1 MB all-to-all inside a node, a ring send to the other node, and a hybrid cp's collectives."""
    import time

    from moe_lc.parallel import comm

    dims = ParallelDims.from_config(ParallelConfig(cp=4, cp_a2a=2, ranks_per_node=2,
                                                   link="intra=0:1,inter=0:0.01"), world, rank)
    dims.init_groups()
    x = torch.zeros(2, 250_000)  # 1 MB per row
    out = {}
    for name in ("cp_a2a", "cp_ring"):
        group = dims[name]
        start = time.perf_counter()
        if name == "cp_a2a":
            comm.all_to_all(torch.empty_like(x), x, [1, 1], [1, 1], group)
        else:
            peer = (group.rank + 1) % group.size
            ops = [comm.p2p_op("send", x[0].clone(), peer, group),
                   comm.p2p_op("recv", torch.empty(250_000), peer, group)]
            for w in comm.batch_isend_irecv(ops, group):
                w.wait()
        out[name] = time.perf_counter() - start
    return out


def test_two_level_link_times_the_all_to_all_inside_and_the_ring_across_nodes():
    """1 MB inside a node at 1 GB/s: >= 1 ms; across at 0.01 GB/s: >= 100 ms."""
    results = run_workers(_link_worker, 4, ranks_per_node=2)
    for r in results:
        assert 1e-3 <= r["cp_a2a"] < 0.1, r
        assert r["cp_ring"] >= 0.1, r


# --------------------------------------------------------------------------- the dry run


def test_dry_run_traces_the_hybrid_layout_and_holds_the_planner_to_it():
    """tools/dryrun.py on cp4 A2 (one rank traced): both collectives traced = planned, to the byte. (With tp 2 at
    these tiny shapes the optimizer step's transients put the peak 6% over the plan, with the ring alone too.)"""
    from tests.test_dryrun import assert_holds_the_planner_to_it, dryrun

    result = dryrun(str(RECIPE), *[f"--set={s}" for s in ["parallel.cp=4", "parallel.cp_a2a=2",
                                                            "parallel.dp=1", "train.seq_len=256", "train.micro_batch=2",
                                                            "train.global_batch=4"]])
    (report,) = result["ranks"]
    assert_holds_the_planner_to_it(report)
    comm = report["comparison"]["comm"]
    for key in ("comm/cp_a2a/all_to_all_bytes", "comm/cp_ring/send_bytes"):
        traced, planned, status = comm[key]
        assert traced == planned > 0 and status == "exact", (key, comm[key])


@pytest.mark.parametrize("name, overrides, act_rtol", [
    ("cp4-a2", ["parallel.cp=4", "parallel.cp_a2a=2", "parallel.dp=1", "train.micro_batch=4"], 0.0),
    # the all-to-alls and the ring run again in each replay of the attention core
    pytest.param("cp4-a2-recompute-full", ["parallel.cp=4", "parallel.cp_a2a=2", "parallel.dp=1", "train.micro_batch=4",
                                           "recompute.policy=full"], None, marks=pytest.mark.slow),
    # MLA's latent core under the "mla_up" and "attention" replays
    pytest.param("cp4-a2-mla-latent-recompute-mla-up", ["parallel.cp=4", "parallel.cp_a2a=2", "parallel.dp=1",
                                                        "train.micro_batch=4", *MLA, "recompute.policy=selective",
                                                        'recompute.selective=["mla_up", "attention"]'], None,
                 marks=pytest.mark.slow),
])
def test_planner_holds_for_hybrid_cp(name, overrides, act_rtol):
    """tests/test_plan.py's check: optimizer bytes and every counted byte per step equal the plan on a real
    4-rank run, and one micro-batch's saved activations equal the traced ones to the byte."""
    from tests.test_plan import _check_layout

    _check_layout(name, 4, overrides, act_rtol)


def test_search_tries_each_all_to_all_size_inside_a_node():
    """tools/plan.py --search: every cp > 1 candidate also with cp_a2a = 2, 4, ... while A x tp fits a node
    and A divides the heads per tp rank (moe16b_128k: 16 heads, nodes of 8)."""
    from tools.step_time.clusters import resolve
    from tools.step_time.search import candidates, name

    cfg = load_config(ROOT / "recipes" / "moe16b_128k.toml", world_size=64)
    cluster, _ = resolve("h100")
    found = candidates(cfg, 64, cluster)
    for d in found:
        assert d["cp"] % d["cp_a2a"] == 0 and (d["cp_a2a"] == 1 or d["cp_a2a"] * d["tp"] <= 8)
    assert {d["cp_a2a"] for d in found if d["cp"] == 8 and d["tp"] == 2} == {1, 2, 4}
    assert name(dict(pp=1, tp=2, cp=8, cp_a2a=2, ep=8, dp=4)) == "tp2 cp8 a2a2 ep8 dp4"
