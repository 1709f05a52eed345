"""The step-time predictor (tools/steptime.py via tools/plan.py --cluster): link times are bytes over the
group's link, a single-rank step is its FLOPs over peak x efficiency, DualPipe's F&B hides the EP
all-to-all up to the compute beside it, and mistakes are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lc.config import ParallelConfig, load_config
from moe_lc.model.counting import attention_core_flops, train_flops_per_token
from moe_lc.parallel.mesh import ParallelDims
from tools import plan as plan_tool
from tools.clusters import CLUSTERS, EFFICIENCY, resolve
from tools.steptime import link_seconds

ROOT = Path(__file__).resolve().parents[1]


def _plan_json(argv: list[str], capsys) -> dict:
    assert plan_tool.main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_collective_time_is_bytes_over_the_link_of_the_group():
    # 16 ranks, tp 8 innermost (one node), dp 2 across the two nodes of 8 GPUs; ep 16 over both
    dims = ParallelDims.from_config(ParallelConfig(dp=2, tp=8, ep=16, ranks_per_node=8), 16)
    cluster, eff = resolve("h100", ["cluster.nvlink_gbps=400", "cluster.net_gbps=40", "eff.link=0.5"])
    nbytes = 6e9
    assert link_seconds(dims, 0, "tp", "all_gather", nbytes, cluster, eff) == pytest.approx(6e9 / 200e9)
    assert link_seconds(dims, 0, "dp", "reduce_scatter", nbytes, cluster, eff) == pytest.approx(6e9 / 20e9)
    # all-to-all: 7 of rank 0's 15 peers share its node, 8 are on the other one; the network is slower
    assert link_seconds(dims, 0, "ep", "all_to_all", nbytes, cluster, eff) == pytest.approx(6e9 * 8 / 15 / 20e9)
    assert link_seconds(dims, 0, "pp", "send", nbytes, cluster, eff) == 0.0  # no peer


def test_one_rank_without_communication_is_flops_over_peak_times_efficiency(capsys):
    # dense_cpu: one rank, fp32, dense blocks; HBM made so fast that memory-bound time vanishes
    out = _plan_json(["recipes/dense_cpu.toml", "--cluster", "h100", "--set", "cluster.hbm_gbps=1e15",
                      "--set", "eff.gemm=0.6", "--set", "eff.attention=0.6"], capsys)
    pred, cfg = out["predicted"], load_config("recipes/dense_cpu.toml", [])
    m, t = cfg.model, cfg.train
    tokens = t.global_batch * t.seq_len
    # F + B = 3x the GEMMs and (1 + 2.5)x the attention core: the model FLOPs plus half a forward core
    work = tokens * (train_flops_per_token(m, t.seq_len) + 0.5 * m.n_layers * attention_core_flops(m, t.seq_len))
    expected = work / (CLUSTERS["h100"].peak_tflops("fp32") * 1e12 * 0.6)
    assert pred["pipeline_s"] == pytest.approx(expected, rel=1e-6)
    assert pred["step_s"] == pytest.approx(expected, rel=1e-6)
    assert pred["exposed_comm_s"] == {}
    assert pred["mfu"] == pytest.approx(train_flops_per_token(m, t.seq_len) * tokens / expected
                                        / (CLUSTERS["h100"].peak_tflops("fp32") * 1e12), rel=1e-6)


def test_json_has_the_predicted_block(capsys):
    pred = _plan_json(["recipes/dense_cpu.toml", "--cluster", "b200"], capsys)["predicted"]
    for key in ("step_s", "tokens_per_s_per_gpu", "mfu", "model_tflops_per_gpu", "bubble_share",
                "exposed_comm_s", "comm_s", "costs_s", "cluster", "efficiency", "optimizer_s"):
        assert key in pred
    assert pred["cluster"]["name"] == "b200" and pred["efficiency"] == EFFICIENCY


def test_dualpipe_fb_hides_the_all_to_all_up_to_the_compute_beside_it(capsys):
    # overlap_cpu: DualPipe pp 2 x ep 2 x dp 2; one GPU per node puts the EP peer behind the network
    sets = ["recipes/overlap_cpu.toml", "--cluster", "h100", "--set", "cluster.gpus_per_node=1"]
    on = _plan_json(sets, capsys)["predicted"]
    off = _plan_json(sets + ["--set", "parallel.overlap=false"], capsys)["predicted"]
    ep = on["comm_s"]["ep"] / (on["actions"]["F"] + on["actions"]["FB"]) / 2  # one direction, per action
    a, b = off["costs_s"], on["costs_s"]
    assert ep > 0 and a["F"] == pytest.approx(b["F"]) and a["B"] == pytest.approx(b["B"])
    assert a["FB"] == pytest.approx(a["F"] + a["B"])  # no overlap: the pair is F then B, each all-to-all exposed
    assert b["FB"] == pytest.approx(max(b["F"] + b["B"] - 2 * ep, 2 * ep))  # max(compute, all-to-alls)
    assert on["step_s"] < off["step_s"] and on["exposed_comm_s"]["ep"] < off["exposed_comm_s"]["ep"]


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "h900"], "error: --cluster 'h900' is not a known cluster; choose one of h800, h100, h200, b200, gb200, cpu"),
    (["--cluster", "h100", "--set", "cluster.tflops=1"],
     "error: --set cluster.tflops=1: unknown cluster key 'tflops'; keys are bf16_tflops, fp8_tflops, hbm_gbps, "
     "hbm_gb, nvlink_gbps, net_gbps, gpus_per_node, fp32_tflops"),
    (["--cluster", "h100", "--set", "eff.gemm=fast"], "error: --set eff.gemm=fast: 'fast' is not a number"),
    (["--set", "eff.gemm=0.5"], "error: --set cluster./eff. keys, --bench and --search need --cluster NAME"),
])
def test_cluster_mistakes_are_one_line(argv, message, capsys):
    assert plan_tool.main(["recipes/dense_cpu.toml"] + argv) == 2
    assert capsys.readouterr().err.strip() == message


def test_bench_file_replaces_the_default_efficiencies(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"efficiency": {"gemm": 0.8, "attention": 0.3}}))
    _, eff = resolve("h200", ["eff.attention=0.35"], str(bench))
    assert eff == {**EFFICIENCY, "gemm": 0.8, "attention": 0.35}  # the file, then --set


def test_search_ranks_the_layouts_that_fit_and_says_why_each_beats_the_next():
    from dataclasses import replace

    from tools.steptime_search import search

    cluster, eff = resolve("h100")
    found = search("recipes/overlap_cpu.toml", [], 2, cluster, eff, plan_tool.plan, log=lambda *a, **k: None)
    ranked = found["ranked"]
    speeds = [r["predicted"]["tokens_per_s_per_gpu"] for r in ranked]
    assert speeds == sorted(speeds, reverse=True) and len(ranked) >= 3
    assert {"pp2 dp1", "dp2", "ep2 dp2"} <= {r["name"] for r in ranked}
    assert len(found["why"]) == len(ranked) - 1 and found["why"][0].startswith(f"{ranked[0]['name']} beats {ranked[1]['name']} by ")
    # a memory between the peaks keeps only the layouts at or under it
    limit = sorted(r["peak_gb"] for r in ranked)[len(ranked) // 2]
    small = search("recipes/overlap_cpu.toml", [], 2, replace(cluster, hbm_gb=limit), eff, plan_tool.plan,
                   log=lambda *a, **k: None)
    assert {r["name"] for r in small["ranked"]} == {r["name"] for r in ranked if r["peak_gb"] <= limit}
    assert small["skipped"] == {"planned peak exceeds the memory": sum(r["peak_gb"] > limit for r in ranked)}


def test_the_cpu_cluster_is_the_fit_to_the_committed_cpu_bench():
    from tools.steptime_cpu import cluster_from_fit, fit

    fitted, table = cluster_from_fit(fit()), CLUSTERS["cpu"]
    for key in ("fp32_tflops", "hbm_gbps", "net_gbps", "nvlink_gbps", "gpus_per_node"):
        assert getattr(table, key) == pytest.approx(getattr(fitted, key), rel=1e-3), key


def test_shared_cpu_bench_times_each_process_and_refuses_bad_arguments(tmp_path):
    argv = [sys.executable, "-m", "tools.bench.shared_cpu", "--models", "debug", "--procs", "2", "--steps", "1",
            "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "shared_cpu.json").read_text())
    (row,) = data["results"]
    assert data["meta"]["procs"] == row["procs"] == 2 and len(row["per_process_step_s"]) == 2
    assert row["eager_step_s"] == pytest.approx(sum(row["per_process_step_s"]) / 2) and row["eager_step_s"] > 0
    bad = subprocess.run(argv[:3] + ["--models", "huge"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--models a subset of debug,large" in bad.stderr


def test_bench_results_of_the_gpu_bench_become_efficiencies(tmp_path):
    # tools/bench/run.py's layout: per part, entries of a shape and a kernel; the best kernel per shape,
    # then the median over shapes, over the bench device's dense peak
    gemm = [{"M": 1, "K": 2, "N": 3, "variant": "bf16", "tflops": 700.0, "status": "ok"},
            {"M": 1, "K": 2, "N": 3, "variant": "fp8_blockwise", "tflops": 900.0, "status": "ok"},
            {"M": 1, "K": 2, "N": 3, "variant": "fp8_tensorwise", "tflops": 1100.0, "status": "ok"},
            {"M": 4, "K": 2, "N": 3, "variant": "bf16", "tflops": 500.0, "status": "ok"},
            {"M": 4, "K": 2, "N": 3, "variant": "fp8_blockwise", "status": "error"}]
    attention = [{"heads": "mla", "seq": s, "batch": 1, "impl": impl, "fwd_bwd_tflops": tf, "status": "ok"}
                 for s, impl, tf in ((4096, "sdpa", 300.0), (4096, "fa3", 450.0), (8192, "fa3", 500.0),
                                     (16384, "fa3", 520.0))]
    bench = tmp_path / "h100.json"
    bench.write_text(json.dumps({"meta": {"peak_tflops": {"bf16": 1000.0, "fp8": 2000.0}},
                                 "parts": {"gemm[recipe=x]": {"entries": gemm}, "attention": {"entries": attention}}}))
    _, eff = resolve("h100", [], str(bench))
    assert eff == {**EFFICIENCY, "gemm": 0.6, "gemm_fp8": 0.55, "attention": 0.5}
    bench.write_text(json.dumps({"meta": {"peak_tflops": None}, "parts": {}}))
    with pytest.raises(ValueError, match="no peak_tflops"):
        resolve("h100", [], str(bench))
