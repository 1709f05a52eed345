"""Router: group limits, bias steers selection only, balancing works, dispatch is exact."""

import torch

from moe_lc.config import model_config
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.balance_losses import sequence_aux_loss
from moe_lc.model.moe import LocalDispatcher, MoE, Router, route


def cfg(**kw):
    base = dict(dim=32, n_heads=2, n_kv_heads=1, n_layers=2, n_dense_layers=1, n_routed_experts=16,
                n_shared_experts=1, moe_ffn_dim=24, topk=4, n_groups=4, topk_groups=2, bias_update_speed=0.01)
    base.update(kw)
    return model_config(**base)


def test_route_keeps_every_token_within_topk_groups():
    torch.manual_seed(0)
    for n_groups, topk_groups, topk in [(4, 2, 4), (8, 3, 6), (4, 1, 2), (2, 1, 3)]:
        scores = torch.rand(500, 16)
        bias = torch.randn(16) * 0.3
        idx = route(scores, bias, n_groups, topk_groups, topk)
        groups_used = (idx // (16 // n_groups)).sort(dim=1).values
        n_used = 1 + (groups_used.diff(dim=1) != 0).sum(dim=1)
        assert n_used.max().item() <= topk_groups
        assert idx.shape == (500, topk) and all(len(set(row.tolist())) == topk for row in idx)


def test_route_picks_groups_by_top2_sum():
    # group 0 has one huge expert, group 1 two good ones: top-2 sum prefers group 1
    scores = torch.tensor([[0.95, 0.0, 0.0, 0.0, 0.6, 0.6, 0.0, 0.0]])
    idx = route(scores, torch.zeros(8), n_groups=2, topk_groups=1, topk=2)
    assert sorted(idx[0].tolist()) == [4, 5]


def test_route_without_group_limit_is_plain_topk():
    scores = torch.rand(64, 16)
    idx = route(scores, torch.zeros(16), n_groups=4, topk_groups=4, topk=3)
    assert torch.equal(idx.sort(1).values, scores.topk(3, dim=1).indices.sort(1).values)


def test_bias_changes_selection_not_gate_weights():
    torch.manual_seed(0)
    router = Router(cfg(score_func="sigmoid", routed_scaling_factor=2.5))
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    x = torch.randn(256, 32)
    idx0, w0, scores = router(x)
    router.expert_bias[:] = torch.linspace(-1, 1, 16)
    idx1, w1, scores1 = router(x)
    assert not torch.equal(idx0, idx1)  # selection moved
    assert torch.equal(scores, scores1)  # affinities untouched
    # gate weights are the selected *unbiased* affinities, normalized, times the scaling factor
    expected = scores.gather(1, idx1)
    expected = expected / expected.sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(w1, expected)


def test_softmax_affinities_normalized():
    router = Router(cfg(score_func="softmax"))
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    _, w, scores = router(torch.randn(10, 32))
    torch.testing.assert_close(scores.sum(-1), torch.ones(10))
    torch.testing.assert_close(w.sum(-1), torch.ones(10))


def test_bias_updates_reduce_imbalance_on_skewed_input():
    torch.manual_seed(0)
    router = Router(cfg(n_groups=1, topk_groups=1, topk=2, bias_update_speed=0.02))
    torch.nn.init.normal_(router.gate.weight, std=0.05)
    x = torch.randn(1024, 32) + 2.0 * router.gate.weight[0].detach() / router.gate.weight[0].norm()  # skew
    imbalance = []
    for _ in range(60):
        stats = ForwardStats()  # one step's
        router.route_and_score(x, stats)
        load = stats.routing[router]["loads"]
        imbalance.append((load.max() / load.mean()).item())
        router.update_bias(load)
    assert imbalance[0] > 2.0, imbalance[0]
    assert imbalance[-1] < 0.6 * imbalance[0], (imbalance[0], imbalance[-1])
    assert set(dict(router.named_buffers())) == {"expert_bias"}  # no count kept on the module


def test_bias_update_is_sign_of_mean_minus_load():
    router = Router(cfg(bias_update_speed=0.1))
    router.update_bias(torch.tensor([4.0, 0.0] + [2.0] * 14))
    expected = torch.tensor([-0.1, 0.1] + [0.0] * 14)
    assert torch.equal(router.expert_bias, expected)


def test_local_dispatch_combine_matches_per_token_loop():
    torch.manual_seed(0)
    T, K, E, D = 37, 3, 6, 5
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    d = LocalDispatcher()
    xs, counts, handle = d.dispatch_now(x, idx, E)
    assert counts.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    scale = torch.arange(1, E + 1, dtype=torch.float32)  # "expert e multiplies by e+1"
    ys = xs * torch.repeat_interleave(scale, counts)[:, None]
    out = d.combine_now(ys, w, handle)
    ref = torch.stack([sum(w[t, k] * x[t] * scale[idx[t, k]] for k in range(K)) for t in range(T)])
    torch.testing.assert_close(out, ref)


def test_moe_matches_naive_expert_loop_and_backprops():
    torch.manual_seed(0)
    c = cfg()
    moe = MoE(c)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 9, 32, requires_grad=True)
    out = moe(x)
    idx, w, _ = moe.router(x.reshape(-1, 32))
    xt = x.reshape(-1, 32)
    ref = []
    for t in range(xt.shape[0]):
        acc = moe.shared(xt[t:t + 1])[0]
        for k in range(c.moe.topk):
            e = idx[t, k]
            h = xt[t] @ moe.experts.w13.weight[e].t()
            g, u = h.chunk(2)
            acc = acc + w[t, k] * (torch.nn.functional.silu(g) * u) @ moe.experts.w2.weight[e].t()
        ref.append(acc)
    torch.testing.assert_close(out.reshape(-1, 32), torch.stack(ref), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert x.grad is not None and moe.router.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w13.weight.grad.abs().sum() > 0


def test_sequence_aux_loss_is_one_when_uniform_and_grows_with_skew():
    B, S, E, K = 2, 8, 4, 2
    scores = torch.full((B, S, E), 0.5)
    idx = torch.tensor([[0, 1], [2, 3]] * (B * S // 2)).view(B, S, K)
    assert abs(sequence_aux_loss(scores, idx, E).item() - 1.0) < 1e-6
    skew_scores = torch.tensor([0.9, 0.9, 0.1, 0.1]).expand(B, S, E)
    skew_idx = torch.tensor([0, 1]).expand(B, S, K)
    assert sequence_aux_loss(skew_scores, skew_idx, E).item() > 1.5


def test_aux_loss_reaches_router_gradient():
    torch.manual_seed(0)
    moe = MoE(cfg(aux_loss_weight=1.0))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 8, 32)
    stats = ForwardStats()
    moe(x, stats).sum().backward()
    g_with = moe.router.gate.weight.grad.clone()
    assert stats.aux_losses[moe].item() > 0  # reported for the step's metrics, not kept on the module
    moe.zero_grad()
    moe.aux_loss_weight = 0.0
    stats = ForwardStats()
    moe(x, stats).sum().backward()
    assert not torch.allclose(g_with, moe.router.gate.weight.grad)
    assert not stats.aux_losses
