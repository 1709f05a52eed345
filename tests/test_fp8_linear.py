"""FP8 in the one Linear: GEMM error bounds, which layers switch, and training in FP8 vs BF16."""

import json
from pathlib import Path

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model.transformer import build_model
from moe_lc.config import PrecisionConfig
from moe_lc.ops.fp8_linear import Fp8Gemms
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from moe_lc.ops.linear import GroupedLinear, Linear
from moe_lc.train import run

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "debug_cpu.toml"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise", "delayed"])
def test_fp8_linear_forward_and_grads_within_bounds(scaling):
    """E4M3 keeps 3 mantissa bits: ~2.6% RMS error per quantized operand, sqrt(2) x that for a GEMM
    of two quantized operands on Gaussian data (measured 3.6-3.8%). Bound: 4.5%, and > 1% so that
    the test fails if FP8 silently stops being applied."""
    torch.manual_seed(0)
    ref, lin = Linear(200, 72), Linear(200, 72)  # K = 200: a short last tile
    torch.nn.init.normal_(ref.weight, std=0.05)
    lin.weight.data.copy_(ref.weight.data)
    lin.gemms = Fp8Gemms(scaling, "emulate")
    for _ in range(2):  # delayed scaling: the second step uses the first step's amax history
        x = torch.randn(4, 33, 200, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        dy = torch.randn(4, 33, 72)
        lin.weight.grad = ref.weight.grad = None
        y, yr = lin(x), ref(xr)
        y.backward(dy)
        yr.backward(dy)
        for got, want in ((y, yr), (x.grad, xr.grad), (lin.weight.grad, ref.weight.grad)):
            assert 0.01 < rel(got, want) < 0.045


def test_fp8_grouped_experts_within_bounds_and_empty_expert():
    torch.manual_seed(0)
    ref, g = GroupedLinear(4, 130, 64), GroupedLinear(4, 130, 64)
    torch.nn.init.normal_(ref.weight, std=0.05)
    g.weight.data.copy_(ref.weight.data)
    g.gemms = Fp8Gemms("blockwise", "emulate")
    counts = torch.tensor([50, 0, 200, 7])
    x = torch.randn(257, 130, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    dy = torch.randn(257, 64)
    g(x, counts).backward(dy)
    ref(xr, counts).backward(dy)
    assert 0.01 < rel(x.grad, xr.grad) < 0.045 and 0.01 < rel(g.weight.grad, ref.weight.grad) < 0.045
    assert g.weight.grad[1].abs().max() == 0


def test_delayed_scaling_keeps_history():
    gemms = Fp8Gemms("delayed", "emulate")
    lin = Linear(16, 8)
    torch.nn.init.normal_(lin.weight)
    lin.gemms = gemms
    lin(torch.randn(4, 16) * 10).sum().backward()
    assert gemms.history["x"].scale_amax() > 5  # recorded the first step's activation amax


def test_layer_plan_switches_only_eligible_layers_to_fp8():
    model = build_model(load_config(RECIPE).model)
    fp8 = LayerPlanOptions(precision=PrecisionConfig(recipe="fp8", fp8_backend="emulate"))
    plan = apply_layer_plan(model, options=fp8)
    n = sum("gemms" in row for row in plan.settings.values())
    assert model.head.gemms.name == "plain"  # output head stays bf16
    moe = next(iter(model.moe_layers().values()))
    assert moe.router.gate.gemms.name == "plain"  # router stays fp32
    assert moe.experts.w13.gemms.name == "fp8-blockwise" and model.layers["0"].attn.wqkv.gemms.name == "fp8-blockwise"
    # per block: wqkv, wo, w13, w2 (+ shared w13, w2 and experts w13, w2 in MoE blocks)
    assert n == 4 + 3 * 6


def test_fp8_training_tracks_bf16(tmp_path):
    """A short run from one seed: the first loss differs from BF16 only by quantization error and
    FP8 learns as fast. (Mid-descent, at ~0.2 loss per step, trajectories drift by a few percent;
    the 200-step <1% comparison of issue #8 is the slow test below.)"""
    common = ["train.steps=10", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=8",
              "train.warmup_steps=3", "train.log_interval=100"]
    bf16 = run(load_config(RECIPE, common + ["precision.recipe=bf16", f"train.output_dir={tmp_path}/b"]))
    fp8 = run(load_config(RECIPE, common + ["precision.recipe=fp8", "precision.fp8_backend=emulate",
                                            f"train.output_dir={tmp_path}/f"]))
    assert fp8.losses != bf16.losses
    assert abs(fp8.losses[0] - bf16.losses[0]) / bf16.losses[0] < 0.005
    assert fp8.losses[-1] < 0.7 * fp8.losses[0]
    assert abs(fp8.losses[-1] - bf16.losses[-1]) / bf16.losses[-1] < 0.05


@pytest.mark.slow
def test_fp8_vs_bf16_200_steps(tmp_path):
    """Issue #8: 200 debug steps of fp8 (blockwise, emulated) vs bf16, paired by seed (seeds 0, 1, 2): the
    mean final-loss gap is within 1%, and no seed has fp8 more than 3% worse. Prints every gap.

    Why a mean over seeds. On this 1.5M-parameter MoE, rounding alone moves a run's final loss by up to ~1%:
    bf16 vs bf16 with only the micro-batch split changed (4 -> 8, i.e. the order of sums) differed by
    -0.75..+0.96% at the final step over seeds 0-7 (2026-11-24, 1 thread). fp8 blockwise vs bf16 over the
    same 8 seeds: final step -1.25..+2.14%, mean +0.46% (standard error 0.39); fp32 held-out loss of the
    final weights mean +0.43% (SE 0.29); tensorwise fp8 mean +0.50% (SE 0.24). So one seed's gap is mostly
    chaos and a mean over seeds is what can fail when FP8 costs accuracy. The emulation's fp32 matmuls sum
    in an order set by the thread count: with 2 threads seeds 0/1/2 gave -0.28/+1.23/+0.45%, mean +0.47%
    (6.5 minutes); with 1 thread -0.79/+1.20/+0.94%. Since d7caa4d (RoPE angles in fp32 as the official
    YaRN code; fp32 losses moved by ~5e-9, the one numeric change to this path since) the same 2-thread run
    gives -2.51/+0.60/-0.71%, mean -0.87%: seed 0 moved by 2.2% with fp8 now *below* bf16, which is chaos,
    not an FP8 cost, so a single seed's gap is bounded only on the side where FP8 would cost accuracy."""
    gaps = []
    for seed in (0, 1, 2):
        final = {}
        for recipe in ("bf16", "fp8"):
            result = run(load_config(RECIPE, [f"precision.recipe={recipe}", "precision.fp8_backend=emulate",
                                              f"train.seed={seed}", f"train.output_dir={tmp_path}/{recipe}{seed}"]))
            final[recipe] = result.losses[-1]
        gaps.append((final["fp8"] - final["bf16"]) / final["bf16"])
        print(json.dumps({"seed": seed, "bf16_final": final["bf16"], "fp8_final": final["fp8"], "rel_gap": gaps[-1]}))
    mean = sum(gaps) / len(gaps)
    print(json.dumps({"mean_rel_gap": mean}))
    assert abs(mean) < 0.01 and max(gaps) < 0.03
