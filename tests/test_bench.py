"""tools/bench: the dry run goes end to end on CPU and writes complete results; FLOP formulas by hand."""

import json
import math
import subprocess
import sys

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model.transformer import Transformer
from moe_lc.ops.linear import GroupedLinear, Linear
from tools.bench.attention import causal_attention_flops
from tools.bench.common import RESULTS_DIR, ROOT, Timing, peak_tflops, time_fn
from tools.bench.gemm import gemm_flops, linear_shapes
from tools.bench.grouped_gemm import expert_counts
from tools.bench.model_step import categorize, step_flops
from tools.bench.run import PARTS
# metrics every "ok" entry of a part must carry as finite positive numbers
METRICS = {"attention": ("fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops"),
           "gemm": ("ms", "tflops"),
           "grouped_gemm": ("fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops"),
           "model_step": ("step_ms", "tokens_per_s", "model_flops", "hardware_flops"),
           "layer": ("fwd_ms", "fwd_bwd_ms", "planned_saved_gib"),
           "dsa_attention": ("fwd_bwd_ms",), "fp8_linear": ("fwd_bwd_ms", "tflops"),
           "moe_layer": ("fwd_bwd_ms",)}


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    before = sorted(RESULTS_DIR.rglob("*")) if RESULTS_DIR.exists() else []
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "run.py"), "--dry-run", "--profile",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    after = sorted(RESULTS_DIR.rglob("*")) if RESULTS_DIR.exists() else []
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert before == after, "a dry run wrote into tools/bench/results"
    (json_path,) = out.glob("*.json")
    return json.loads(json_path.read_text()), json_path, proc.stdout


def test_dry_run_results_cover_every_part(dry_run):
    results, _, stdout = dry_run
    meta = results["meta"]
    assert meta["dry_run"] is True and meta["torch"] == torch.__version__ and meta["device"]
    assert "attention" in meta["backends"] and "fp8_blockwise" in meta["backends"]
    assert sorted(results["parts"]) == sorted(PARTS)
    for part in PARTS:
        body = results["parts"][part]
        assert "error" not in body, f"{part} crashed: {body.get('error')}"
        entries = body["entries"]
        ok = [e for e in entries if e["status"] == "ok" and e.get("what") != "build"]
        assert len(ok) >= 3, f"{part}: only {len(ok)} successful measurements"
        for e in entries:
            assert e["status"] in ("ok", "error", "skipped"), e
            if e["status"] == "error":
                assert e["error"].strip(), e
            if e["status"] == "skipped":
                assert e["reason"].strip(), e
        for e in ok:
            for key in METRICS[part]:
                assert _positive_number(e.get(key)), f"{part} {key}={e.get(key)!r} in {e}"
        assert f"[{part}" in stdout  # progress lines were printed


def test_dry_run_part_details(dry_run):
    results, _, _ = dry_run
    attn = [e for e in results["parts"]["attention"]["entries"] if e["status"] == "ok"]
    impls = {e["impl"] for e in attn}
    assert {"wrapper:torch", "raw:aten_flash", "wrapper:reference"} <= impls
    assert {e["heads"] for e in attn} == {"mha", "gqa", "mla"}
    assert {(e["head_dim"], e["head_dim_v"]) for e in attn if e["heads"] == "mla"} == {(48, 32)}
    wrapped = [e for e in attn if e["impl"] == "wrapper:torch"]
    assert wrapped and all(_positive_number(e["overhead_fwd"]) and e["raw_impl"] == "raw:aten_flash" for e in wrapped)

    gemm = results["parts"]["gemm"]["entries"]
    by_variant = {e["variant"]: e for e in gemm if e["status"] == "ok"}
    assert {"bf16", "fp8_tensorwise", "fp8_blockwise", "raw_tensorwise"} <= set(by_variant)
    assert by_variant["fp8_blockwise"]["backend"] in ("native", "chunked_rowwise", "emulated")
    assert _positive_number(by_variant["fp8_tensorwise"]["speedup_vs_bf16"])

    grouped = [e for e in results["parts"]["grouped_gemm"]["entries"] if e["status"] == "ok" and e["impl"] == "grouped"]
    assert grouped and all(_positive_number(e["speedup_fwd"]) for e in grouped)
    assert all(e["max_rel_err"] < 0.05 for e in grouped)  # grouped and loop compute the same thing

    steps = [e for e in results["parts"]["model_step"]["entries"] if e["status"] == "ok" and "seq" in e]
    assert [e["seq"] for e in steps] == [64, 128, 256]
    for e in steps:
        prof = e["profile"]
        assert prof["top"] and _positive_number(prof["kernel_ms"])
        assert "gemm" in prof["by_category_ms"] and "attention" in prof["by_category_ms"]
        assert e["hardware_flops"] >= e["model_flops"]


def test_dry_run_markdown_names_device_and_versions(dry_run):
    results, json_path, _ = dry_run
    md = json_path.with_suffix(".md").read_text()
    assert results["meta"]["device"] in md and f"torch {torch.__version__}" in md
    for part in PARTS:
        assert f"## {part}" in md
    assert "| impl |" in md and "### profile" in md


def test_dry_run_refuses_the_results_directory(capsys):
    from tools.bench import run

    assert run.main(["--dry-run", "--parts", "attention", "--out", str(RESULTS_DIR / "dry")]) == 2
    assert capsys.readouterr().err.startswith("error: --dry-run must not write into")
    assert not (RESULTS_DIR / "dry").exists()


def test_a_recipe_that_is_not_there_is_one_line_before_any_part(tmp_path, capsys):
    from tools.bench import run

    assert run.main(["--dry-run", "--parts", "attention,layer", "--recipe", str(tmp_path / "no.toml"),
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --parts layer reads {tmp_path / 'no.toml'}, which is not there; give --recipe PATH\n"
    assert not (tmp_path / "o").exists()


def test_failures_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    """A part that crashes and a measurement that runs out of memory become error entries; the rest runs."""
    from tools.bench import gemm, grouped_gemm, run

    def broken_part(ctx, rec):
        raise RuntimeError("part exploded")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(gemm, "run", broken_part)
    monkeypatch.setattr(grouped_gemm, "grouped_mm", oom)
    assert run.main(["--dry-run", "--parts", "gemm,grouped_gemm", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("*.json")
    parts = json.loads(json_path.read_text())["parts"]
    assert "part exploded" in parts["gemm"]["error"]
    entries = parts["grouped_gemm"]["entries"]
    grouped = [e for e in entries if e["impl"] == "grouped"]
    loop = [e for e in entries if e["impl"] == "loop"]
    assert grouped and all(e["status"] == "error" and e["oom"] and "out of memory" in e["error"] for e in grouped)
    assert loop and all(e["status"] == "ok" and _positive_number(e["fwd_ms"]) for e in loop)
    assert "part failed" in json_path.with_suffix(".md").read_text()


# ------------------------------------------------------------------------------ formulas by hand


def test_causal_attention_flops_hand_count():
    # S=4, D=2, one head: QK^T is 4x4 dot products of length 2 (2*2 FLOPs each) = 64, PV the same = 64;
    # causal keeps half of the 4x4 score matrix -> (64 + 64) / 2.
    assert causal_attention_flops(1, 1, 4, 2) == 64
    # D_qk != D_v, batch 2, 3 heads: (2*S*S*24 + 2*S*S*16) / 2 per head.
    assert causal_attention_flops(2, 3, 8, 24, 16) == 2 * 3 * (2 * 64 * 24 + 2 * 64 * 16) / 2


def test_gemm_flops_and_shapes():
    assert gemm_flops(3, 5, 7) == 2 * 3 * 5 * 7
    cfg = load_config(ROOT / "recipes" / "moe16b_128k.toml", check=False).model
    shapes = {(s["K"], s["N"]): s for s in linear_shapes(cfg)}
    # fused q|k|v (16 + 2*16 heads of 128), dense FFN gate|up and down, experts, output head
    assert {(2048, 48 * 128), (2048, 2 * 10944), (10944, 2048), (2048, 2 * 1408), (2048, 102400)} <= set(shapes)
    assert not shapes[(2048, 102400)]["fp8_eligible"] and shapes[(2048, 2 * 10944)]["fp8_eligible"]
    assert (2048, 64) not in shapes  # the fp32 router gate is left out


def test_expert_counts_are_uneven_seeded_and_aligned():
    counts = expert_counts(16, 512, seed=3)
    assert counts.sum().item() == 16 * 512 and counts.min().item() >= 0
    assert counts.max().item() > 1.3 * counts.float().mean().item()  # uneven
    assert torch.equal(counts, expert_counts(16, 512, seed=3))
    aligned = expert_counts(16, 512, seed=3, align=16)
    assert (aligned % 16 == 0).all() and (aligned >= counts).all() and (aligned - counts < 16).all()


def _matmul_params_by_hand(model_cfg) -> float:
    """Activated matmul weights counted off a meta-device model: every Linear (not the embedding),
    routed experts at topk / E of their weights."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, GroupedLinear):
            total += m.weight.numel() * model_cfg.moe.topk / model_cfg.moe.n_routed_experts
        elif isinstance(m, Linear):
            total += m.weight.numel()
    return total


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_step_flops_by_hand(policy):
    sets = ["model.dim=64", "model.n_layers=3", "model.moe.n_dense_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_dim=96", "model.moe.n_routed_experts=8", "model.moe.topk=2", "model.moe.n_groups=1",
            "model.moe.topk_groups=1", "model.moe.ffn_dim=32", "model.vocab_size=512", f"recompute.policy={policy}",
            "recompute.selective=norm,swiglu,attention"]
    cfg = load_config(ROOT / "recipes" / "debug_cpu.toml", sets)
    m, seq = cfg.model, 256
    n_act = _matmul_params_by_hand(m)
    attn_fwd = m.n_layers * m.n_heads * seq * seq / 2 * 2 * (m.head_size + m.head_size)  # causal QK^T + PV
    flops = step_flops(m, cfg.recompute, seq)
    assert flops["model"] == pytest.approx(6 * n_act * seq + 3 * attn_fwd)
    extra = {"none": 0.5 * attn_fwd,  # flash backward at 2.5x forward
             "selective": 0.5 * attn_fwd + attn_fwd,  # + the replayed attention core
             "full": 0.5 * attn_fwd + attn_fwd + 2 * (n_act - 512 * 64) * seq}  # + every block's forward
    assert flops["hardware"] == pytest.approx(flops["model"] + extra[policy])


def test_peak_table_and_kernel_categories():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == {"bf16": 989.0, "fp8": 1979.0}
    assert peak_tflops("NVIDIA H200") == {"bf16": 989.0, "fp8": 1979.0}
    assert peak_tflops("NVIDIA H100 PCIe")["bf16"] == 756.0
    assert peak_tflops("NVIDIA H100 NVL")["bf16"] == peak_tflops("NVIDIA H200 NVL")["bf16"] == 835.0
    assert peak_tflops("NVIDIA H20")["bf16"] == 148.0  # not taken for an H200 by its prefix
    assert peak_tflops("CPU x86_64") is None
    kernels = {
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<>>>": "grouped_gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",  # not grouped
        "nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_TNT": "gemm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
        "ncclDevKernel_AllToAll_RING_LL": "all_to_all",
        "some_custom_kernel": "other",
    }
    assert {name: categorize(name) for name in kernels} == kernels


def test_time_fn_reports_median_of_timed_calls():
    calls = []
    t = time_fn(lambda: calls.append(1), torch.device("cpu"), Timing(warmup=2, iters=5, min_iters=5, max_s=0.0))
    assert len(calls) == 7 and t["n"] == 5 and 0 <= t["min_s"] <= t["s"]


@pytest.mark.slow  # ~20 s; run it (and `DRY=1 bash tools/gpu_session.sh`) before a device session
def test_gpu_check_dry_run_goes_through_every_step(tmp_path):
    """The one-command GPU bring-up (python -m tools.gpu_check) on a CPU: env report, the `gpu` tests
    (each skipped with its reason), the benchmark dry run, one summary."""
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--dry-run", "--out", str(tmp_path),
                           "--parts", "attention,grouped_gemm"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for step in ("env", "install: skipped (dry run)", "tests: passed", "bench: done"):
        assert f"- {step}" in summary, summary
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] == torch.__version__ and set(env["optional"]) == {"flash_attn", "flash_attn4", "transformer_engine"}
    tests_log = (tmp_path / "gpu_tests.log").read_text()
    assert "needs a CUDA GPU" in tests_log and " skipped" in tests_log and "failed" not in tests_log
    (bench,) = tmp_path.glob("*-dry-run.json")
    assert sorted(json.loads(bench.read_text())["parts"]) == ["attention", "grouped_gemm"]


def test_headline_ratios_from_parts_and_which_targets_hold():
    """tools/bench/ratios.py on synthetic entries: each ratio from its part, the slower-over-faster direction,
    the lowest shape for the FP8 Linear, a missing part named, and the targets judged (Muon's lower-is-better,
    FP8's MFU relative to bf16's)."""
    from tools.bench.ratios import FP8_STEP, MUON_STEP, met, ratios

    def part(*entries):
        return {"entries": [{"status": "ok", **e} for e in entries]}

    parts = {
        "fp8_linear": part({"M": 8192, "K": 7168, "N": 1536, "variant": "bf16", "fwd_bwd_ms": 3.0},
                           {"M": 8192, "K": 7168, "N": 1536, "variant": "fp8", "fwd_bwd_ms": 2.0},
                           {"M": 8192, "K": 2048, "N": 7168, "variant": "bf16", "fwd_bwd_ms": 2.4},
                           {"M": 8192, "K": 2048, "N": 7168, "variant": "fp8", "fwd_bwd_ms": 2.0}),
        "dsa_attention": part({"seq": 32768, "impl": "dense", "topk": 2048, "fwd_bwd_ms": 300.0},
                              {"seq": 32768, "impl": "dsa", "topk": 2048, "fwd_bwd_ms": 150.0}),
        "model_step": part({"seq": 4096, "mfu_pct": 36.0, "step_ms": 100.0}, {"seq": 32768, "mfu_pct": 30.0}),
        FP8_STEP: part({"seq": 4096, "mfu_pct": 40.0}),
        MUON_STEP: part({"seq": 4096, "step_ms": 160.0}),
    }
    values, missing = ratios(parts)
    assert values["fp8_linear_vs_bf16"] == pytest.approx(1.2)  # the lower of 1.5 and 1.2
    assert values["dsa_vs_dense_32k"] == 2.0 and values["dsa_vs_dense_128k"] is None
    assert values["mfu_4k_bf16"] == 0.36 and values["mfu_4k_fp8"] == 0.40 and values["muon_vs_adamw"] == 1.6
    assert "moe_layer" in missing["fp8_moe_vs_bf16"] and "dsa_attention" in missing["dsa_vs_dense_128k"]
    judged = met(values)
    assert judged["fp8_linear_vs_bf16"] is False and judged["dsa_vs_dense_32k"] is True
    assert judged["mfu_4k_fp8"] is True and judged["muon_vs_adamw"] is False and judged["mfu_32k_bf16"] is False
    assert judged["fp8_moe_vs_bf16"] is None
