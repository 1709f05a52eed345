"""Muon as DeepSeek-V4 runs it (moe_lc/optim/muon.py, train.muon_ns = "v4", train.muon_update_rms = 0.18): the
hybrid Newton-Schulz (8 steps of (3.4445, -4.7750, 2.0315), then 2 of (2, -1.5, 0.5)) against the same
iteration in fp64, its singular values on 1, the update's RMS 0.18, the default left as Moonlight's, and
which of a V4-style model's parameters (mHC, hash router) take Muon and which AdamW."""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import ModelConfig, load_config
from moe_lc.config.model_sections import MoEConfig
from moe_lc.model.transformer import Transformer
from moe_lc.optim import Muon, recipe_rule
from moe_lc.optim.muon import NS_SCHEDULES, newton_schulz


def _fp64_iteration(g: torch.Tensor, schedule) -> torch.Tensor:
    """X <- a X + b (X X^T) X + c (X X^T)^2 X in fp64, written out, from X = G / ||G||_F (wide: A <= B)."""
    x = g.double()
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / torch.linalg.matrix_norm(x, keepdim=True)
    for (a, b, c), steps in schedule:
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.mT if tall else x


@pytest.mark.parametrize("shape", [(3, 24, 40), (2, 40, 24), (16, 16)])
def test_v4_newton_schulz_is_its_iteration_and_lands_on_one(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = newton_schulz(g, schedule=NS_SCHEDULES["v4"])
    want = _fp64_iteration(g, NS_SCHEDULES["v4"])
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    s = torch.linalg.svdvals(got.double())
    assert (s - 1).abs().max() < 0.02, s  # the quintic alone leaves them in about [0.68, 1.13]
    s5 = torch.linalg.svdvals(newton_schulz(g).double())
    assert (s5 - 1).abs().max() > 0.05  # (so the check above measures the last two steps)
    assert NS_SCHEDULES["v4"] == (((3.4445, -4.7750, 2.0315), 8), ((2.0, -1.5, 0.5), 2))


def test_moonlight_default_is_unchanged():
    g = torch.randn(4, 24, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(newton_schulz(g), newton_schulz(g, schedule=NS_SCHEDULES["moonlight"]))
    torch.testing.assert_close(newton_schulz(g).double(), _fp64_iteration(g, NS_SCHEDULES["moonlight"]),
                               rtol=0, atol=2e-5)
    rule = Muon()
    assert rule.schedule == NS_SCHEDULES["moonlight"] and rule.update_rms == 0.2


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (4, 16, 48)])
def test_v4_update_rms_is_0_18(shape):
    cfg = load_config("recipes/debug_cpu.toml", ["train.optimizer=muon", "train.muon_ns=v4",
                                                 "train.muon_update_rms=0.18"])
    rule = recipe_rule(cfg)
    assert isinstance(rule, Muon) and rule.schedule == NS_SCHEDULES["v4"]
    u = rule.orthogonal_update("layers.1.attn.wo.weight", torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    rms = u.pow(2).mean(dim=(-2, -1)).sqrt()
    torch.testing.assert_close(rms, torch.full_like(rms, 0.18), rtol=0.01, atol=0)


def test_v4_model_parameters_split_between_muon_and_adamw():
    """V4's report: AdamW for the embedding, the prediction head, RMSNorm weights and mHC's static biases and
    gating factors; Muon for everything else (mHC's projections, the hash router's gate, experts)."""
    cfg = ModelConfig(n_layers=2, residual="mhc", moe=MoEConfig(n_dense_layers=0, hash_layers=1,
                                                                score_func="sqrtsoftplus", swiglu_limit=10.0))
    with torch.device("meta"):
        model = Transformer(cfg)
    rule = Muon(ns="v4", update_rms=0.18)
    adamw = sorted(n for n, p in model.named_parameters() if not rule.whole(n, p.shape))
    muon = {n for n, p in model.named_parameters() if rule.whole(n, p.shape)}
    assert adamw == sorted(["embed.weight", "head.weight", "norm.weight", "stream_head.bias", "stream_head.scale"]
                           + [f"layers.{i}.{m}" for i in range(2) for m in
                              ("attn_norm.weight", "ffn_norm.weight", "attn_res.bias", "attn_res.scale",
                               "ffn_res.bias", "ffn_res.scale")])
    assert {"layers.0.attn_res.fn.weight", "layers.1.ffn_res.fn.weight", "stream_head.fn.weight",
            "layers.0.ffn.router.gate.weight", "layers.0.ffn.experts.w13.weight"} <= muon


def test_bad_values_are_named():
    from moe_lc.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config("recipes/debug_cpu.toml", ["train.optimizer=muon", "train.muon_ns=v5",
                                               "train.muon_update_rms=0"])
    text = str(err.value)
    assert "train.muon_ns='v5' must be one of 'moonlight', 'v4'" in text and "train.muon_update_rms=0" in text
    assert load_config("recipes/debug_cpu.toml").train.muon_ns == "moonlight"
