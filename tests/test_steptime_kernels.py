"""Kernel rates by shape (tools/step_time/kernel_rates.py), the traced kernels they price (kernel_trace.py,
compute.py), and the published runs' leave-one-out (published.py, published_runs.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from moe_lc.config import load_config
from tools.step_time.clusters import CLUSTERS, EFFICIENCY, resolve
from tools.step_time.kernel_rates import committed, fit_kernel_rates, fit_kind, fit_memory, kernel_seconds

ROOT = Path(__file__).resolve().parents[1]
H100_HBM = 3.35e12


def _gemm_rows(rate: dict) -> list[tuple[float, float, float]]:
    """Synthetic GEMM rows at the bench's spread of shapes (M 2K-16K, K and N 512-32K), timed by `rate`."""
    rows = []
    for m in (2048, 8192, 16384):
        for k, n in ((512, 32768), (1408, 2048), (2048, 7168), (7168, 4096), (18432, 7168), (4096, 129280)):
            flops, nbytes = 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)
            rows.append((flops, nbytes, kernel_seconds(flops, nbytes, rate)))
    return rows


def test_the_fit_recovers_known_constants_from_synthetic_rows():
    known = {"flops_per_s": 700e12, "bytes_per_s": 2.0e12, "launch_s": 6e-6, "p": 3.0}
    fitted = fit_kind(_gemm_rows(known), H100_HBM)
    assert fitted["flops_per_s"] == pytest.approx(known["flops_per_s"], rel=0.02)
    assert fitted["bytes_per_s"] == pytest.approx(known["bytes_per_s"], rel=0.05)
    assert fitted["launch_s"] == pytest.approx(known["launch_s"], rel=0.1)
    assert fitted["p"] == pytest.approx(known["p"], rel=0.1) and fitted["rms_log_error"] < 1e-3
    # the memory-bound kind: launches x launch + bytes / bandwidth
    rows = [(n, b, n * 4e-6 + b / 2.2e12) for n in (12, 24, 40) for b in (2e7, 3e8, 4e9)]
    memory = fit_memory(rows, H100_HBM)
    assert memory["launch_s"] == pytest.approx(4e-6, rel=0.02) and memory["bytes_per_s"] == pytest.approx(2.2e12, rel=0.02)


def test_a_small_gemm_is_slower_per_flop_than_a_large_one():
    gemm = committed()["kinds"]["gemm"]

    def per_flop(m, k, n):
        flops = 2.0 * m * k * n
        return kernel_seconds(flops, 2.0 * (m * k + k * n + m * n), gemm) / flops

    small, large = per_flop(512, 2048, 768), per_flop(8192, 8192, 8192)
    assert small > 2 * large  # a fine-grained expert's GEMM pays its launch and its operands' bytes
    assert 1 / large == pytest.approx(gemm["flops_per_s"], rel=0.05)  # a large one runs at the fitted rate


def test_the_committed_fit_is_what_the_command_makes_of_the_committed_bench_tables():
    fit = committed()
    again = fit_kernel_rates([str(ROOT / p) for p in fit["meta"]["sources"]])
    assert fit["meta"]["command"].startswith("python -m tools.step_time.kernel_rates")
    for kind, constants in again["kinds"].items():
        for key in ("flops_per_s", "bytes_per_s", "launch_s", "p"):
            assert fit["kinds"][kind][key] == pytest.approx(constants[key], rel=1e-6), (kind, key)
    # clusters.py's defaults are this fit as fractions of the H100's peaks
    assert EFFICIENCY["gemm"] == pytest.approx(fit["kinds"]["gemm"]["flops_per_s"] / 989e12, rel=1e-9)
    assert EFFICIENCY["memory"] == pytest.approx(fit["kinds"]["memory"]["bytes_per_s"] / 3350e9, rel=1e-9)


def test_a_bench_results_file_refits_the_rates(tmp_path):
    # tools/bench/run.py's layout: a GEMM table timed at known constants, against a device of half the H100's peak
    known = {"flops_per_s": 400e12, "bytes_per_s": 1.5e12, "launch_s": 8e-6, "p": 2.0}
    entries = [{"M": m, "K": k, "N": n, "variant": "bf16", "status": "ok", "ms": 1e3 * kernel_seconds(
        2.0 * m * k * n, 2.0 * (m * k + k * n + m * n), known)} for m in (2048, 8192, 16384)
        for k, n in ((512, 32768), (1408, 2048), (2048, 7168), (7168, 4096), (18432, 7168))]
    bench = tmp_path / "gpu.json"
    bench.write_text(json.dumps({"meta": {"peak_tflops": {"bf16": 500.0, "fp8": 1000.0}, "hbm_gbps": 2000.0},
                                 "parts": {"gemm": {"entries": entries}}}))
    _, eff = resolve("h100", [], str(bench))
    assert eff["gemm"] == pytest.approx(0.8, rel=0.02) and eff["gemm.launch_us"] == pytest.approx(8.0, rel=0.1)
    assert eff["attention_fwd"] == pytest.approx(EFFICIENCY["attention_fwd"], rel=1e-9)  # no rows: the committed fit's
    bench.write_text(json.dumps({"meta": {"peak_tflops": None}, "parts": {}}))
    with pytest.raises(ValueError, match="no peak_tflops"):
        resolve("h100", [], str(bench))


def _tiny_gpu_recipe() -> list[str]:
    from tools.bench.model_step import DRY_MODEL, LAYOUT, MODEL

    return LAYOUT + MODEL + DRY_MODEL + ["train.seq_len=256"]


def test_the_traced_gemms_are_the_models_flops_forward_dgrad_and_wgrad():
    from tools.step_time.kernel_trace import trace_kernels
    from tools.step_time.work import part_work, tokens_per_rank

    cfg = load_config(ROOT / "recipes/moe16b_128k.toml", _tiny_gpu_recipe(), world_size=1)
    traced = trace_kernels(cfg)
    for part, layer in (("dense", 0), ("moe", 1)):
        w = part_work(cfg, part, layer)
        gemm = (w.gemm + w.gemm_bf16 + w.grouped) * tokens_per_rank(cfg)
        flops = {ph: sum(k.flops * n for k, n in traced.of(part, ph).items() if "gemm" in k.kind) for ph in "FBW"}
        assert flops["F"] == pytest.approx(gemm, rel=1e-6)
        assert flops["B"] + flops["W"] == pytest.approx(2 * gemm, rel=1e-6)  # dgrad and wgrad (no GEMM replayed)
        assert traced.ops[part]["F"] > 0 and any(k.kind == "attention_fwd" for k in traced.of(part, "F"))


def test_eager_kernels_cost_more_than_fused_and_the_host_floors_a_phase(capsys):
    from dataclasses import replace

    from tools import plan as plan_tool
    from tools.planner.plan import plan
    from tools.step_time.model import predict

    cfg = load_config(ROOT / "recipes/moe16b_128k.toml", _tiny_gpu_recipe(), world_size=1)
    p, (cluster, eff) = plan(cfg, 1, "tiny"), resolve("h100")
    free = replace(cluster, host_op_us=0.0)  # the kernels alone (this tiny step is host-bound under either)
    fused, eager = predict(cfg, p, free, eff, "fused"), predict(cfg, p, free, eff, "eager")
    assert eager["compute_s"]["memory"] > fused["compute_s"]["memory"] and eager["step_s"] > fused["step_s"]
    slow_host = predict(cfg, p, replace(cluster, host_op_us=1e3), eff, "eager")  # 1 ms per aten op: host-bound
    assert slow_host["compute_s"]["host"] > 0 and slow_host["step_s"] > eager["step_s"]
    # the fused kernels are floored by the same dispatch: a host-bound phase costs exactly its ops x host_op_us
    from tools.step_time.compute import part_seconds
    from tools.step_time.kernel_trace import trace_kernels as traced_kernels

    ops = traced_kernels(cfg).ops["moe"]
    slow = part_seconds(cfg, "moe", 1, replace(cluster, host_op_us=1e3), eff, "fused")
    assert all(sum(slow[ph].values()) == pytest.approx(ops[ph] * 1e-3) for ph in "FBW")
    free = part_seconds(cfg, "moe", 1, replace(cluster, host_op_us=0.0), eff, "fused")
    assert all("host" not in free[ph] for ph in "FBW") and sum(free["F"].values()) < ops["F"] * 1e-3
    assert predict(cfg, p, replace(cluster, host_op_us=1e3), eff, "fused")["compute_s"]["host"] > 0
    assert plan_tool.main(["recipes/dense_cpu.toml", "--impl", "eager"]) == 2
    assert capsys.readouterr().err.strip().endswith("--impl and --search need --cluster NAME")


def test_leave_one_out_fits_the_factor_without_the_held_out_run():
    from tools.step_time.published import leave_one_out, overhead_factor

    rows = [{"published": 100.0, "predicted": 100.0 * r} for r in (1.1, 0.9, 1.0, 1.05, 0.95)]
    rows.append({"published": 100.0, "predicted": 400.0})  # predicted 4x too fast
    loo = leave_one_out(rows)
    # the outlier's factor comes from the other five alone (median 1 / 1.0); had it leaked in, the median of six
    assert loo[-1]["factor"] == pytest.approx(1.0) and loo[-1]["loo_error"] == pytest.approx(3.0)
    assert overhead_factor(rows) != pytest.approx(1.0)
    for i, r in enumerate(loo[:-1]):
        others = [x for j, x in enumerate(rows) if j != i]
        assert r["factor"] == pytest.approx(overhead_factor(others))


def test_the_published_runs_are_ten_or_more_recipes_that_cite_their_source_and_figure():
    from tools.step_time.model import IMPLEMENTATIONS
    from tools.step_time.published_runs import RUNS

    assert len(RUNS) >= 10 and len({r.recipe for r in RUNS}) == len(RUNS)
    for run in RUNS:
        cfg = load_config(ROOT / run.recipe, [])
        assert run.cluster in CLUSTERS and run.impl in IMPLEMENTATIONS and (run.tokens or run.tflops)
        assert run.convention in ("causal", "full", "unstated", "-")
        assert ("fp8" in run.precision.lower()) == (cfg.precision.recipe == "fp8"), run.name
        header = "".join(ln for ln in (ROOT / run.recipe).read_text().splitlines(keepends=True) if ln.startswith("#"))
        figure = f"{run.tokens:,.0f}" if run.tokens else f"{run.tflops:.0f}"
        assert figure in header or figure in run.source, run.name
        assert re.search(r"(arXiv|github\.com|docs\.nvidia\.com)", header + run.source), run.name


@pytest.mark.slow
def test_each_published_run_plans_and_predicts():
    from tools.step_time.published import run_one
    from tools.step_time.published_runs import RUNS

    for run in RUNS:
        pred = run_one(run)
        assert pred["tokens_per_s_per_gpu"] > 0 and math.isfinite(pred["step_s"]) and pred["terms_s"], run.name


def test_a_runs_attention_implementation_swaps_in_its_measured_rates():
    from tools.step_time.attention_impls import with_attention

    flex = with_attention(EFFICIENCY, "flex")
    for phase in ("fwd", "bwd"):  # FlexAttention at FlashAttention-2's fitted rates, below cuDNN's on the H100
        for f in ("", ".bw", ".launch_us", ".p"):
            assert flex[f"attention_{phase}{f}"] == EFFICIENCY[f"attention_fa2_{phase}{f}"]
        assert flex[f"attention_{phase}"] < EFFICIENCY[f"attention_{phase}"]
    assert with_attention(EFFICIENCY, "cudnn") == EFFICIENCY and flex["gemm"] == EFFICIENCY["gemm"]
    with pytest.raises(ValueError, match="'xformers': one of cudnn, fa2, flex"):
        with_attention(EFFICIENCY, "xformers")
    # the FA2 kinds are fitted to the bench's raw:aten_flash rows only
    entry = {"status": "ok", "heads": "mha", "q_heads": 16, "kv_heads": 16, "head_dim": 128, "head_dim_v": 128,
             "seq": 4096, "batch": 8, "flops_fwd": 1e12, "fwd_ms": 2.0, "fwd_bwd_ms": 7.0}
    from tools.step_time.kernel_rates import bench_rows

    rows = bench_rows({"parts": {"attention": {"entries": [{**entry, "impl": "raw:aten_flash"},
                                                            {**entry, "impl": "raw:sdpa_cudnn", "fwd_ms": 1.0,
                                                             "fwd_bwd_ms": 4.0}]}}})
    assert [r[2] for r in rows["attention_fa2_fwd"]] == [2e-3] and [r[2] for r in rows["attention_fwd"]] == [1e-3]
    assert rows["attention_fa2_bwd"][0][2] == pytest.approx(5e-3)
