"""Weighted SwiGLU (model.moe.weighted_swiglu): the gate weights multiply each routed expert's SwiGLU
output before its down projection instead of the expert outputs in combine. The same function (the
down projection is linear), so fp32 training matches within rounding; combine then saves no expert
outputs (tests/test_plan.py holds the saved bytes to the planner), and the weights cross the EP
all-to-all with their rows."""

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.model.moe import LocalDispatcher, RoutedExperts
from tests.harness import RECIPES, assert_equivalent, reference, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=4", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=1", "train.warmup_steps=2"]
ON = ["model.moe.weighted_swiglu=true"]
A2A = "comm/ep/all_to_all_bytes"


def test_weighting_the_swiglu_output_is_weighting_the_expert_output():
    torch.manual_seed(0)
    T, K, D, E = 12, 2, 16, 4
    experts = RoutedExperts(E, D, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, idx = torch.randn(T, D), torch.randint(0, E, (T, K))
    w = torch.rand(T, K, requires_grad=True)
    d = LocalDispatcher()
    xs, counts, handle = d.dispatch_now(x, idx, E)
    after = d.combine_now(experts(xs, counts), w, handle)
    before = d.combine_now(experts(xs, counts, d.sort_weights_now(w, handle)), None, handle)
    torch.testing.assert_close(before, after, rtol=1e-6, atol=1e-6)
    g = torch.randn(T, D)
    (ga,) = torch.autograd.grad(after, w, g)
    (gb,) = torch.autograd.grad(before, w, g)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


def test_weighted_swiglu_trains_like_the_plain_model_and_one_device():
    """fp32: on vs off in one process within 1e-5 (rounding only); ep2 x dp2 with it against one process
    with it within 1e-5; its all-to-all moves 2 x 4 bytes more per token copy (weights and their grads)."""
    plain, weighted = reference(RECIPE, BASE), reference(RECIPE, BASE + ON)
    assert_equivalent(plain, weighted, rtol=1e-5)
    got = run_layout(RECIPE, BASE + ON + ["parallel.ep=2", "parallel.dp=2"], world=2)
    assert_equivalent(weighted, got, rtol=1e-5)
    one_moe = BASE + ["parallel.ep=2", "parallel.dp=2", "train.steps=1", "model.n_layers=2"]
    on, off = run_layout(RECIPE, one_moe + ON, world=2), run_layout(RECIPE, one_moe, world=2)
    D, c = load_config(RECIPE).model.dim, 4
    sent_on, sent_off = (sum(r.comm_per_rank[rank][0][A2A] for rank in range(2)) for r in (on, off))
    assert sent_on * 4 * D * c == sent_off * (4 * D * c + 2 * 4)


def test_weighted_swiglu_composes_with_dualpipe_ep_dp_and_recompute():
    """pp2 DualPipe x dp2 (ep2 folded in) with selective norm + swiglu recompute, against one process
    with none of it (nor the weighting): fp32 within 1e-5."""
    ref = reference(RECIPE, BASE)
    got = run_layout(RECIPE, BASE + ON + ["recompute.policy=selective", "recompute.selective=norm,swiglu",
                                          "parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.ep=2",
                                          "parallel.dp=2"], world=4)
    assert_equivalent(ref, got, rtol=1e-5)


def test_hierarchical_dispatch_refuses_it():
    with pytest.raises(ConfigError, match="weighted_swiglu with parallel.expert_dispatch='hierarchical' is not built"):
        load_config(RECIPE, ON + ["parallel.expert_dispatch=hierarchical"])
