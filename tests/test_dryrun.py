"""The dry run (tools/dryrun.py) holds the planner to what one traced training step does."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_lc.config import load_config
from tools.dry_run.trace import HostLiterals, StepTracer, balanced_select
from tools.dry_run.rank_trace import pick_ranks

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "debug_cpu.toml")
# world 64: pp 4 DualPipe x dp 8 (ep 8 folded in) x tp 2 on an 8-layer slice of the 16B recipe at 4K
# tokens (bf16, selective recompute): real widths, so transients weigh what they weigh at full size
MID_RECIPE = str(ROOT / "recipes" / "moe16b_128k.toml")
MID = ["parallel.pp=4", "parallel.pp_schedule=dualpipe", "parallel.dp=8", "parallel.cp=1", "parallel.tp=2",
       "parallel.ep=8", "model.n_layers=8", "train.seq_len=4096", "train.global_batch=64", "model.rope.scaling=none"]


def dryrun(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "dryrun.py"), *args, "--json"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def assert_holds_the_planner_to_it(report: dict) -> None:
    memory = report["comparison"]["memory"]
    for state in ("params", "grads", "optimizer"):
        traced, planned = memory[state]
        assert traced == planned, (report["rank"], state, traced, planned)
    for what in ("saved activations", "peak"):
        traced, planned = memory[what]
        assert traced == pytest.approx(planned, rel=0.05), (report["rank"], what, traced, planned)
    assert report["peak_bytes"] == memory["peak"][0] and report["planner_peak_bytes"] == memory["peak"][1]
    exact = {k: v for k, v in report["comparison"]["comm"].items() if v[2] == "exact"}
    assert exact, "the planner claims no exact traffic"
    for key, (traced, planned, _) in exact.items():
        assert traced == planned, (report["rank"], key, traced, planned)
    assert not report["problems"] and report["update_applied"]


def test_mid_size_dualpipe_ep_tp_layout_matches_the_planner_on_every_role():
    result = dryrun(MID_RECIPE, "--ranks", "0,16,32,48", *[f"--set={s}" for s in MID])
    assert result["world"] == 64
    reports = result["ranks"]
    assert [r["coords"]["pp"] for r in reports] == [0, 1, 2, 3]
    # DualPipe's mirror ranks hold the same stages: the same step, byte for byte ("all-roles" traces one)
    for a, b in ((0, 3), (1, 2)):
        assert reports[a]["peak_bytes"] == reports[b]["peak_bytes"] and reports[a]["comm"] == reports[b]["comm"]
    assert pick_ranks("all-roles", load_config(MID_RECIPE, MID), 64) == [0, 16]
    for report in reports:
        assert_holds_the_planner_to_it(report)
        # the all-to-all follows the balanced routing the dry run uses, which is the planner's estimate
        traced, planned, _ = report["comparison"]["comm"]["comm/ep/all_to_all_bytes"]
        assert traced == planned > 0
        # every dispatch reads its split sizes on the host (torch's all-to-all takes host lists)
        assert any("ep/dispatch.py" in site and "(dispatch)" in site for site in report["host_reads"])


def test_balanced_select_loads_every_expert_equally_inside_the_group_limit():
    for E, G, g, K in [(8, 4, 2, 2), (256, 8, 4, 8), (64, 1, 1, 6)]:
        idx = balanced_select(torch.zeros(4096, E), None, G, g, K)
        load = torch.bincount(idx.flatten(), minlength=E)
        assert load.min() == load.max() == 4096 * K // E
        assert all(len(set(row.tolist())) == K for row in idx)  # K distinct experts per token
        assert all(len(set(row.tolist())) == g for row in idx // (E // G))  # in exactly g groups


def test_tracer_gives_known_values_to_data_dependent_shapes_and_reads():
    with StepTracer() as tracer, HostLiterals():
        ids = torch.tensor([3, 1, 3, 0], device="meta")
        picked = ids.nonzero()  # the meta device alone cannot size this
        counts = torch.zeros(4, dtype=torch.int64, device="meta").scatter_add_(0, ids, torch.ones_like(ids))
        assert picked.shape == (3, 1)  # three non-zero ids
        assert counts.tolist() == [1, 1, 0, 2]
        unknown = torch.ones(2048, 2048, device="meta").sum()  # too big to carry values
        assert unknown.item() == 1.0  # no value: a loss or a norm reads as 1
    assert sum(tracer.host_reads.values()) == 2


def test_cpu_tensor_handed_to_a_collective_is_refused_in_the_dry_run(tmp_path):
    """The dry run's groups run on the device the trainer uses (meta standing for CUDA), so a CPU tensor
    sent through a collective fails here as it would under NCCL."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moe_lc.parallel import comm
    from moe_lc.parallel.mesh import ParallelDims

    cfg = load_config(RECIPE, ["parallel.dp=4"], world_size=4)
    dist.init_process_group("meta:fake,cpu:fake", store=FakeStore(), rank=1, world_size=4)
    try:
        dims = ParallelDims.from_config(cfg.parallel, 4, 1, "meta")
        dims.init_groups()
        with pytest.raises(ValueError, match="collective all_reduce on group 'dp' got a tensor on cpu"):
            comm.all_reduce(torch.ones(2), dims["dp"])
    finally:
        dist.destroy_process_group()


def test_default_ranks_add_the_pipeline_rank_the_planner_expects_to_peak():
    from types import SimpleNamespace

    cfg = load_config(MID_RECIPE, MID)
    peaks = [5.0, 9.0, 7.0, 5.0]  # pp rank 1 highest
    stub = SimpleNamespace(ranks=[SimpleNamespace(pp_rank=i, peak_bytes=lambda v=v: v) for i, v in enumerate(peaks)])
    assert pick_ranks("first,last", cfg, 64) == [0, 48]
    assert pick_ranks("first,last", cfg, 64, stub) == [0, 16, 48]


def test_one_host_sync_per_dispatch_with_fp8_experts():
    """The FP8 per-expert GEMMs and their W take the row counts dispatch already brought to the host; the
    metrics read theirs in one go: nothing else syncs per MoE layer (a GPU would stall an F&B pair)."""
    fp8 = ["precision.recipe=fp8", "precision.fp8_dispatch=true", "precision.fp8_cache=linear,swiglu,attn_out",
           "recompute.policy=selective", "recompute.selective=norm,swiglu,router", "model.moe.weighted_swiglu=true"]
    (report,) = dryrun(MID_RECIPE, "--ranks", "16", *[f"--set={s}" for s in MID + fp8])["ranks"]
    reads = report["host_reads"]
    dispatch = [n for site, n in reads.items() if "(dispatch)" in site]
    assert len(dispatch) == 1, reads  # one call site: the layout's one read per dispatch
    assert not any("moe_lc/ops/" in site for site in reads), reads
    assert sum(n for site, n in reads.items() if "(dispatch)" not in site) <= 8, reads


# The 671B 128K recipe's terms at a reduced shape (world 8): MLA at V3's widths on the latent ring over
# cp 4 (4K tokens per rank, as at 128K), pp 2 DualPipe, FP8 GEMMs and caching, mla_up recompute; 4 blocks
REDUCED_128K = ["parallel.pp=2", "parallel.dp=1", "parallel.cp=4", "parallel.ep=4", "parallel.ranks_per_node=4",
                "model.n_layers=4", "model.moe.n_dense_layers=1", "model.moe.n_routed_experts=16",
                "model.moe.n_groups=4", "model.moe.topk_groups=2", "train.seq_len=16384", "train.global_batch=8"]


@pytest.fixture(scope="module")
def reduced_128k() -> dict:
    result = dryrun(str(ROOT / "recipes" / "deepseek_v3_671b_128k.toml"), "--ranks", "0", "--microbatches", "all",
                    *[f"--set={s}" for s in REDUCED_128K])  # all 8: the traffic below counts them
    return result["ranks"][0]


def test_reduced_128k_mla_ring_layout_matches_the_planners_states_saved_bytes_and_traffic(reduced_128k):
    memory = reduced_128k["comparison"]["memory"]
    for state in ("params", "grads", "optimizer"):
        assert memory[state][0] == memory[state][1], state
    traced, planned = memory["saved activations"]
    assert traced == pytest.approx(planned, rel=0.02)
    comm = reduced_128k["comparison"]["comm"]
    assert all(traced == planned for traced, planned, _ in comm.values()), comm
    tokens, per_token = 16384 // 4, 512 + 64  # the latent ring: kv_lora_rank + qk_rope_head_dim values per token
    blocks = tokens * per_token
    per_call = 3 * blocks * 2 * 2 + 4 * blocks * 4  # (cp-1) blocks each way in bf16, cp fp32 accumulators
    # DualPipe pp 2: rank 0 runs stage 0 (blocks 0, 1) for the 4 micro-batches of one direction and the last
    # stage (blocks 2, 3 and the MTP block) for the 4 of the other: 4 x 2 + 4 x 3 attention calls
    assert comm["comm/cp/send_bytes"][0] == (4 * 2 + 4 * 3) * per_call


@pytest.mark.xfail(strict=True, reason="at this reduced shape the peak holds the dense FFN weight's FP8 "
                                       "quantization temporaries (3 fp32 copies of w13's 36,864 x 7,168, 1 GiB each), "
                                       "which the planner's walk does not place (traced +5.1%); at full size every "
                                       "role is within 3% (docs/results/dryrun-671b-128k)")
def test_reduced_128k_peak_within_3_percent_of_the_planner(reduced_128k):
    traced, planned = reduced_128k["comparison"]["memory"]["peak"]
    assert traced == pytest.approx(planned, rel=0.03)


# Every shipped recipe sized for a CPU (fp32; `block_trace.runs_on_gpu` is False): traced as it runs there,
# with the CPU's fused attention kernel (an H100 would fall back to the O(S^2) reference math in fp32).
CPU_RECIPES = ["debug_cpu.toml", "dense_cpu.toml", "overlap_cpu.toml", "longctx/base.toml", "longctx/extend_2k.toml",
               "longctx/extend_2k_mix.toml", "longctx/extend_4k.toml", "longctx/dsa_warmup.toml",
               "longctx/dsa_sparse.toml", "debug_v4_cpu.toml"]


# fp32 recipes the planner cannot trace yet, each with why (the issue that extends it)
NOT_PLANNED: dict[str, str] = {}


def test_cpu_recipe_list_is_every_fp32_recipe():
    from tools.planner.block_trace import runs_on_gpu

    shipped = {str(p.relative_to(ROOT / "recipes")) for p in (ROOT / "recipes").rglob("*.toml")}
    assert {r for r in shipped if not runs_on_gpu(load_config(str(ROOT / "recipes" / r)))} == \
        set(CPU_RECIPES) | set(NOT_PLANNED)


def test_every_cpu_recipe_peaks_within_5_percent_of_the_planner():
    """The DSA stages' indexer score tiles and the warm-up's KL tiles are planned (the parts' working sets,
    `block_trace.TracedParts.working`): they traced 41% and 288% above the planner before."""
    script = ("import json, sys\nfrom tools.dryrun import main\n"
              "for r in sys.argv[1:]:\n    main([r, '--json'])\n")
    out = subprocess.run([sys.executable, "-c", script, *[str(ROOT / "recipes" / r) for r in CPU_RECIPES]],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads("[" + out.stdout.replace("}\n{", "},\n{") + "]")
    assert len(reports) == len(CPU_RECIPES)
    for recipe, report in zip(CPU_RECIPES, reports):
        for rank in report["ranks"]:
            traced, planned = rank["comparison"]["memory"]["peak"]
            assert traced == pytest.approx(planned, rel=0.05), (recipe, rank["rank"], traced, planned)
