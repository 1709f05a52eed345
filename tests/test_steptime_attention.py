"""A run's attention as the step-time model prices it (tools/step_time/attention_impls.py): its kernels' rates at
the model's head dim and its sliding window's share of the causal work, and the published GPT-OSS runs that carry
both (tools/step_time/published_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_lc.config import load_config
from tools.step_time.attention_impls import HEAD_DIM_64, SlidingWindow, with_attention
from tools.step_time.clusters import EFFICIENCY

ROOT = Path(__file__).resolve().parents[1]


def test_heads_of_64_run_at_the_published_ratios_and_wider_heads_at_the_bench_rates():
    for impl, kind in (("cudnn", "attention"), ("flex", "attention_fa2")):
        narrow, wide = with_attention(EFFICIENCY, impl, 64), with_attention(EFFICIENCY, impl, 128)
        for i, phase in enumerate(("fwd", "bwd")):
            assert wide[f"attention_{phase}"] == EFFICIENCY[f"{kind}_{phase}"]
            assert narrow[f"attention_{phase}"] == pytest.approx(EFFICIENCY[f"{kind}_{phase}"] * HEAD_DIM_64[kind][i])
            assert narrow[f"attention_{phase}.launch_us"] == EFFICIENCY[f"{kind}_{phase}.launch_us"]
    # FlashAttention-3 paper, H100, 4K: cuDNN loses more at 64 than FlashAttention-2 does, in both directions
    assert HEAD_DIM_64["attention"][0] == pytest.approx(363 / 518)
    assert HEAD_DIM_64["attention_fa2"][1] == pytest.approx(279 / 310)
    assert all(c < f < 1 for c, f in zip(HEAD_DIM_64["attention"], HEAD_DIM_64["attention_fa2"]))
    assert with_attention(EFFICIENCY, "cudnn", 192) == EFFICIENCY  # MLA's 192, what the bench measured beside 128


def test_a_window_visits_the_key_tiles_it_spans_and_every_other_layer_halves_the_saving():
    # 4K in tiles of 128: a causal query tile visits 1..32 key tiles (528 in all), a 128-token window 1 then 2 (63)
    assert SlidingWindow(128).work(4096) == pytest.approx(63 / 528)
    assert SlidingWindow(128, every=2).work(4096) == pytest.approx((63 / 528 + 1) / 2)
    assert SlidingWindow(4096).work(4096) == pytest.approx(1.0)  # a window as long as the sequence is causal
    assert SlidingWindow(129).work(4096) == SlidingWindow(128).work(4096)  # 128 keys back: still the previous tile
    assert SlidingWindow(130).work(4096) > SlidingWindow(128).work(4096)  # one more reaches a third tile
    # the rate rises as the work falls, so the traced causal FLOPs take the windowed kernels' time
    w = SlidingWindow(128, every=2)
    eff = with_attention(EFFICIENCY, "cudnn", 64, w, 4096)
    expected = EFFICIENCY["attention_fwd"] * HEAD_DIM_64["attention"][0] / w.work(4096)
    assert eff["attention_fwd"] == pytest.approx(expected)


def test_the_gpt_oss_runs_carry_its_window_and_heads_of_64_and_megatron_s_even_stage_split():
    from tools.step_time.published_runs import GPT_OSS_WINDOW, RUNS

    gpt_oss = [r for r in RUNS if "GPT-OSS" in r.name]
    assert len(gpt_oss) == 3 and all(r.window == GPT_OSS_WINDOW for r in gpt_oss)
    assert all(r.window is None for r in RUNS if r not in gpt_oss)
    for run in gpt_oss:
        cfg = load_config(ROOT / run.recipe, [])
        assert cfg.model.qk_head_dim == 64 and cfg.parallel.pp_stage_layers in ([], [9, 9, 9, 9])
    mb = load_config(ROOT / "recipes/published/gpt_oss_120b_4k_h100.toml", [])
    assert mb.parallel.pp_stage_layers == [9, 9, 9, 9] and mb.train.micro_batch == 1  # the release's H100 preset
    am20 = load_config(ROOT / "recipes/published/automodel_gpt_oss_20b_4k_h100.toml", [])
    assert am20.recompute.policy == "full"  # its config checkpointed every block when the row was published


@pytest.mark.slow
def test_the_megatron_gpt_oss_row_s_micro_batch_of_4_would_not_fit_an_80_gb_h100():
    from tools.planner.plan import plan

    recipe = ROOT / "recipes/published/gpt_oss_120b_4k_h100.toml"
    peaks = {}
    for mbs in (1, 4):
        cfg = load_config(recipe, [f"train.micro_batch={mbs}"])
        peaks[mbs] = max(r.peak_bytes() for r in plan(cfg, None, str(recipe)).ranks) / 2**30
    assert peaks[1] < 80 < peaks[4]
