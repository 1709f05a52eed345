"""The step-time predictor (tools/step_time/model.py via tools/plan.py --cluster): link times are bytes over the
group's link, a single-rank step on a GPU cluster is its traced kernels at their rates, DualPipe's F&B hides the EP
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
from tools.step_time.clusters import CLUSTERS, EFFICIENCY, resolve
from tools.step_time.model import COMM_SM_SHARE, link_seconds

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


def test_one_rank_without_communication_is_its_traced_kernels_at_their_rates(capsys):
    # dense_cpu: one rank, fp32, dense blocks; every launch cost ~0 and every bandwidth unbounded, so each kernel
    # costs its FLOPs over its kind's rate: the GEMMs 3x the forward's (F, dgrad, wgrad), attention 1 + 2.5x its core
    kinds = ("gemm", "attention_fwd", "attention_bwd")
    free = [f"eff.{k}.{x}={v}" for k in kinds for x, v in (("bw", 1e9), ("launch_us", 1e-9))]
    free += ["eff.memory=1e9", "eff.memory.launch_us=1e-9", "eff.gemm=0.6", "eff.attention_fwd=0.5",
             "eff.attention_bwd=0.4", "cluster.host_op_us=1e-9"]  # (and no host floor: tools/step_time/compute.py)
    out = _plan_json(["recipes/dense_cpu.toml", "--cluster", "h100"] + [a for x in free for a in ("--set", x)], capsys)
    pred, cfg = out["predicted"], load_config("recipes/dense_cpu.toml", [])
    m, t = cfg.model, cfg.train
    tokens = t.global_batch * t.seq_len
    peak = CLUSTERS["h100"].peak_tflops("fp32") * 1e12  # dense_cpu trains in fp32: the TF32 peak
    core = m.n_layers * attention_core_flops(m, t.seq_len) * tokens
    gemm = train_flops_per_token(m, t.seq_len) * tokens - 3 * core  # the model's FLOPs less the attention core
    expected = gemm / (0.6 * peak) + core / (0.5 * peak) + 2.5 * core / (0.4 * peak)
    assert pred["pipeline_s"] == pytest.approx(expected, rel=1e-4)
    assert pred["step_s"] == pytest.approx(expected, rel=1e-4)
    assert pred["exposed_comm_s"] == {}
    assert pred["compute_s"]["gemm"] == pytest.approx(gemm / (0.6 * peak), rel=1e-4)


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
    # max(all-to-alls, compute + the SMs the all-to-all kernels take from it while they run beside it)
    assert b["FB"] == pytest.approx(max(b["F"] + b["B"] - 2 * ep + COMM_SM_SHARE * 2 * ep, 2 * ep))
    assert b["FB"] > max(b["F"] + b["B"] - 2 * ep, 2 * ep)  # (this layout's pairs are compute-bound)
    assert on["step_s"] < off["step_s"] and on["exposed_comm_s"]["ep"] < off["exposed_comm_s"]["ep"]


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "h900"], "error: --cluster 'h900' is not a known cluster; choose one of h800, h100, h200, b200, gb200, cpu"),
    (["--cluster", "h100", "--set", "cluster.tflops=1"],
     "error: --set cluster.tflops=1: unknown cluster key 'tflops'; keys are bf16_tflops, fp8_tflops, hbm_gbps, "
     "hbm_gb, nvlink_gbps, net_gbps, gpus_per_node, fp32_tflops, "
     "op_us, call_us, copy_gbps, link_latency_us, host_op_us"),
    (["--cluster", "h100", "--set", "eff.gemm=fast"], "error: --set eff.gemm=fast: 'fast' is not a number"),
    (["--set", "eff.gemm=0.5"], "error: --set cluster./eff. keys, --bench, --impl and --search need --cluster NAME"),
])
def test_cluster_mistakes_are_one_line(argv, message, capsys):
    assert plan_tool.main(["recipes/dense_cpu.toml"] + argv) == 2
    assert capsys.readouterr().err.strip() == message


def test_bench_file_replaces_the_default_efficiencies(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"efficiency": {"gemm": 0.8, "attention_fwd": 0.3}}))
    _, eff = resolve("h200", ["eff.attention_fwd=0.35"], str(bench))
    assert eff == {**EFFICIENCY, "gemm": 0.8, "attention_fwd": 0.35}  # the file, then --set


def test_search_ranks_the_layouts_that_fit_and_says_why_each_beats_the_next():
    from dataclasses import replace

    from tools.step_time.search import search

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


def test_the_cpu_cluster_is_built_from_the_committed_cpu_benches():
    from tools.step_time.cpu import cluster_from_fit, fit

    fitted, table = cluster_from_fit(fit()), CLUSTERS["cpu"]
    for key in ("fp32_tflops", "hbm_gbps", "net_gbps", "nvlink_gbps", "gpus_per_node", "op_us", "call_us",
                "copy_gbps", "link_latency_us"):
        assert getattr(table, key) == pytest.approx(getattr(fitted, key), rel=1e-3), key
    assert table.link_latency_us == 50.0 and table.net_gbps == 0.1  # overlap_cpu's parallel.link = "50:0.1"


def test_steptime_cpu_names_a_missing_bench_file(tmp_path, capsys):
    from tools.step_time.cpu import main

    with pytest.raises(SystemExit) as stop:
        main(["--bench", str(tmp_path), "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'cpu_costs.json'}: ")


def test_plan_on_the_cpu_cluster_is_the_committed_cpu_prediction(capsys):
    # `--cluster cpu` takes the measured rates as they are (efficiencies 1) and gives cpu.json's DualPipe row
    pred = _plan_json(["recipes/overlap_cpu.toml", "--cluster", "cpu"], capsys)["predicted"]
    committed = json.loads((ROOT / "docs/results/steptime/cpu.json").read_text())["runs"][0]
    assert committed["run"] == "dualpipe" and set(pred["efficiency"].values()) == {1.0}
    assert pred["step_s"] == pytest.approx(committed["predicted"]["step_s"], rel=1e-9)


def test_host_costs_add_each_traced_op_and_call_and_only_the_link_hides_in_fb(capsys):
    from tools.planner.block_trace import trace_parts

    # dense_cpu: one rank, no pipeline; every micro-batch runs embed, the blocks and the head F, B and W
    base = ["recipes/dense_cpu.toml", "--cluster", "h100"]
    cfg = load_config("recipes/dense_cpu.toml", [])
    ops = trace_parts(cfg, cfg.data.has_loss_mask, backward=True).ops
    n = {k: ops["embed"][k] + cfg.model.n_layers * ops["dense"][k] + ops["head"][k] for k in "FBW"}
    assert min(n.values()) > 0
    off = _plan_json(base, capsys)["predicted"]["costs_s"]
    on = _plan_json(base + ["--set", "cluster.op_us=10"], capsys)["predicted"]["costs_s"]
    assert on["F"] - off["F"] == pytest.approx(n["F"] * 1e-5)
    assert on["B"] - off["B"] == pytest.approx((n["B"] + n["W"]) * 1e-5)  # B is the full backward
    assert on["W"] - off["W"] == pytest.approx(n["W"] * 1e-5)
    # overlap_cpu (DualPipe, ep 2): 1 all-gather and 4 all-to-alls per MoE block and micro-batch
    ocfg = load_config("recipes/overlap_cpu.toml", [], world_size=4)
    calls = trace_parts(ocfg, False, backward=True).calls
    assert calls["moe"] == {("ep", "all_gather"): 1, ("ep", "all_to_all"): 4} and calls["dense"] == {}
    # the link made fast (the pairs compute-bound): what the host adds per call the pair cannot hide
    sets = ["recipes/overlap_cpu.toml", "--cluster", "h100", "--set", "cluster.gpus_per_node=1",
            "--set", "cluster.net_gbps=1e6"]
    plain = _plan_json(sets, capsys)["predicted"]
    host = _plan_json(sets + ["--set", "cluster.call_us=1000"], capsys)["predicted"]
    moe_per_rank = ocfg.model.n_moe_layers  # DualPipe: each rank runs half the micro-batches through both halves
    ep_calls = 5 * moe_per_rank * ocfg.train.microbatches(2) // 2
    assert host["comm_s"]["ep"] - plain["comm_s"]["ep"] == pytest.approx(ep_calls * 1e-3)
    per_action = ep_calls * 1e-3 / (plain["actions"]["F"] + plain["actions"]["FB"]) / 2
    a, b = plain["costs_s"], host["costs_s"]
    assert b["F"] - a["F"] == pytest.approx(per_action) and b["B"] - a["B"] == pytest.approx(per_action)
    assert b["FB"] - a["FB"] == pytest.approx(2 * per_action)  # the host's part is not hidden by the pair


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


def test_cpu_costs_bench_counts_gemm_flops_and_writes_its_rates(tmp_path):
    import torch

    from tools.bench.cpu_costs import gemm_flops

    aten = torch.ops.aten
    a, b = torch.empty(128, 256), torch.empty(256, 512)
    assert gemm_flops(aten.mm.default, [a, b]) == 2 * 128 * 256 * 512
    assert gemm_flops(aten.addmm.default, [torch.empty(512), a, b]) == 2 * 128 * 256 * 512
    assert gemm_flops(aten.bmm.default, [torch.empty(4, 8, 16), torch.empty(4, 16, 32)]) == 2 * 4 * 8 * 16 * 32
    # the experts' grouped GEMMs: rows (T, K) by expert into (E, K, N); the wgrad (K, T) x (T, N) by row groups
    assert gemm_flops(aten._grouped_mm.default, [torch.empty(256, 64), torch.empty(8, 64, 32)]) == 2 * 256 * 64 * 32
    assert gemm_flops(aten._grouped_mm.default, [torch.empty(64, 256), torch.empty(256, 32)]) == 2 * 64 * 256 * 32
    done = subprocess.run([sys.executable, "-m", "tools.bench.cpu_costs", "--reps", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "cpu_costs.json").read_text())
    assert data["op_s"] > 0 and data["gemm_flops_per_s"] > 0 and data["memory_bytes_per_s"] > 0
    assert set(data["blocks"]) == {"dense", "moe"} and all(b["ops"] > 0 for b in data["blocks"].values())
    assert any(k.startswith("moe _grouped_mm") for k in data["gemms"])


def test_gloo_collectives_bench_times_each_call_and_fits_a_line(tmp_path):
    from tools.bench.gloo_collectives import fit_line

    assert fit_line([(0, 1.0), (10, 3.0), (20, 5.0)]) == pytest.approx((1.0, 0.2))
    done = subprocess.run([sys.executable, "-m", "tools.bench.gloo_collectives", "--procs", "2", "--calls", "3",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "gloo_collectives.json").read_text())
    assert data["meta"]["rows"] == 128 and data["meta"]["link"] == pytest.approx([50e-6, 0.1e9])  # overlap_cpu's
    assert set(data["busy_call_s"]) == {"all_to_all", "all_gather"} and data["call_s"] > 0
    assert all(t > 0 for t in data["times_s"].values()) and len(data["times_s"]) == 10
    bad = subprocess.run([sys.executable, "-m", "tools.bench.gloo_collectives", "--procs", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--procs must be an even number >= 2" in bad.stderr
