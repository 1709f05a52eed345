"""DeepSeek-V4's MoE pieces against transformers' (src/transformers/models/deepseek_v4/modeling_deepseek_v4.py)
with the same weights, fp32: the sqrt(softplus) router (DeepseekV4TopKRouter), the hash router
(DeepseekV4HashRouter: tid2eid[token id]) and the whole layer with clamped SwiGLU experts
(DeepseekV4SparseMoeBlock: routed and shared experts both clamp), outputs and gradients within 1e-5. Plus the
drawn tid2eid tables, the sequence-wise loss on sqrt(softplus) scores, and the config's rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lc.config import ModelConfig
from moe_lc.config.model_sections import MoEConfig
from moe_lc.config.rules import ConfigError
from moe_lc.model.balance_losses import sequence_aux_loss
from moe_lc.model.ffn import clamp_gate_up
from moe_lc.model.hash_router import HashRouter, hash_table, router_for
from moe_lc.model.moe import MoE, Router

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

B, S, DIM, E, K, F, V, LIMIT = 2, 6, 32, 8, 2, 16, 64, 0.3
CFG = ModelConfig(vocab_size=V, dim=DIM, n_layers=2, moe=MoEConfig(
    n_dense_layers=0, n_routed_experts=E, n_shared_experts=1, ffn_dim=F, topk=K, n_groups=1, topk_groups=1,
    score_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=LIMIT, hash_layers=1))


def hf_config() -> DeepseekV4Config:
    c = DeepseekV4Config(hidden_size=DIM, num_attention_heads=2, head_dim=16, q_lora_rank=16, num_hidden_layers=2,
                         vocab_size=V, o_groups=2, o_lora_rank=8, layer_types=["sliding_attention"] * 2,
                         mlp_layer_types=["hash_moe", "moe"], n_routed_experts=E, num_experts_per_tok=K,
                         moe_intermediate_size=F, routed_scaling_factor=1.5, swiglu_limit=LIMIT,
                         scoring_func="sqrtsoftplus")
    c._experts_implementation = "eager"
    return c


def _copy_block(theirs: hf_v4.DeepseekV4SparseMoeBlock, ours: MoE) -> None:
    """transformers' names -> ours: gate.weight -> router.gate.weight; experts.gate_up_proj (E, 2F, D), gate rows
    first -> experts.w13 (the same layout); down_proj -> w2; the shared expert's gate / up rows -> shared.w13."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.experts.w13.weight.copy_(theirs.experts.gate_up_proj)
        ours.experts.w2.weight.copy_(theirs.experts.down_proj)
        sh = theirs.shared_experts
        ours.shared.w13.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        ours.shared.w2.weight.copy_(sh.down_proj.weight)
        if isinstance(ours.router, HashRouter):
            theirs.gate.tid2eid.copy_(ours.router.tid2eid)
        else:
            bias = torch.randn(E, generator=g) * 0.1  # a non-zero balancing bias steers selection only
            ours.router.expert_bias.copy_(bias)
            theirs.gate.e_score_correction_bias.copy_(bias)


def _sorted(idx: torch.Tensor, w: torch.Tensor):
    """transformers' top-k is unsorted: compare (expert, weight) pairs in expert order."""
    order = idx.argsort(-1)
    return idx.gather(-1, order), w.gather(-1, order)


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "learned"])
def test_router_matches_transformers(layer):
    theirs = hf_v4.DeepseekV4SparseMoeBlock(hf_config(), layer)
    ours = MoE(CFG, router_for(CFG, layer))
    assert isinstance(ours.router, HashRouter) == (layer == 0)
    _copy_block(theirs, ours)
    x = torch.randn(B, S, DIM, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    got = ours.router.route_and_score(x.reshape(-1, DIM), tokens=tokens)
    want = theirs.gate(x, tokens) if layer == 0 else theirs.gate(x)
    idx, w = _sorted(got[0], got[1])
    idx_hf, w_hf = _sorted(want[2], want[1])
    assert torch.equal(idx, idx_hf)
    torch.testing.assert_close(w, w_hf, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[3], want[0], rtol=1e-6, atol=1e-7)  # the logits


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "learned"])
def test_moe_layer_matches_transformers(layer):
    theirs = hf_v4.DeepseekV4SparseMoeBlock(hf_config(), layer)
    ours = MoE(CFG, router_for(CFG, layer))
    _copy_block(theirs, ours)
    x_hf = torch.randn(B, S, DIM, generator=torch.Generator().manual_seed(3)).requires_grad_()
    x = x_hf.detach().clone().requires_grad_()
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
    gate_up = torch.einsum("td,efd->tef", x.detach().reshape(-1, DIM), ours.experts.w13.weight)
    assert (gate_up.abs() > LIMIT).float().mean() > 0.2  # the clamp is exercised
    out_hf, out = theirs(x_hf, input_ids=tokens), ours(x, tokens=tokens)
    torch.testing.assert_close(out, out_hf, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    ours_p = [x, ours.router.gate.weight, ours.experts.w13.weight, ours.experts.w2.weight, ours.shared.w13.weight]
    theirs_p = [x_hf, theirs.gate.weight, theirs.experts.gate_up_proj, theirs.experts.down_proj]
    got = torch.autograd.grad((out * dout).sum(), ours_p)
    want = torch.autograd.grad((out_hf * dout).sum(), theirs_p + [theirs.shared_experts.gate_proj.weight,
                                                                  theirs.shared_experts.up_proj.weight])
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[4], torch.cat(want[4:]), rtol=1e-5, atol=1e-6)


def test_clamp_gradient_is_torch_clamps():
    gate_up = (torch.randn(7, 2 * F) * 2).requires_grad_()
    ref = gate_up.detach().clone().requires_grad_()
    gate, up = ref.chunk(2, dim=-1)
    want = torch.cat([gate.clamp(max=1.0), up.clamp(-1.0, 1.0)], dim=-1)
    got = clamp_gate_up(gate_up, 1.0)
    assert torch.equal(got, want)
    dy = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, gate_up, dy)[0], torch.autograd.grad(want, ref, dy)[0])
    assert clamp_gate_up(gate_up, 0.0) is gate_up  # off


def test_hash_tables_are_seeded_distinct_and_frozen():
    t = hash_table(1000, 16, 6, seed=0, layer_id=0)
    assert t.shape == (1000, 6) and t.dtype == torch.int64
    assert (t.sort(-1).values.diff(dim=-1) > 0).all()  # K distinct experts per token
    assert torch.equal(t, hash_table(1000, 16, 6, seed=0, layer_id=0))
    assert not torch.equal(t, hash_table(1000, 16, 6, seed=0, layer_id=1))
    assert not torch.equal(t, hash_table(1000, 16, 6, seed=1, layer_id=0))
    counts = torch.bincount(t.flatten(), minlength=16).float()  # uniform over experts: 375 each in expectation
    assert counts.min() > 300 and counts.max() < 450
    router = HashRouter(CFG, 0)
    assert "tid2eid" in router.state_dict() and router.bias_update_speed == 0
    with torch.device("meta"):
        meta = HashRouter(CFG, 0)
    meta.to_empty(device="cpu")
    meta.init_buffers()
    assert torch.equal(meta.tid2eid, router.tid2eid)
    with pytest.raises(ValueError, match="routes by token id"):
        router.route_and_score(torch.randn(4, DIM))


def test_sequence_loss_normalizes_sqrtsoftplus_scores():
    """V4 keeps V3's sequence-wise loss: P_e the mean of each token's scores divided by their sum."""
    router = Router(CFG)
    torch.nn.init.normal_(router.gate.weight, std=0.02, generator=torch.Generator().manual_seed(5))  # built, not
    # initialized (the model's init_weights does that): left as torch.empty, it sometimes held NaNs
    x = torch.randn(B * S, DIM, generator=torch.Generator().manual_seed(5))
    idx, _, scores, _ = router.route_and_score(x)
    # the router's own GEMM path may round differently from a second call of the gate: equal to fp32 rounding
    torch.testing.assert_close(scores, torch.nn.functional.softplus(router.gate(x)).sqrt())
    loss = sequence_aux_loss(scores.view(B, S, E), idx.view(B, S, K), E)
    p = (scores / scores.sum(-1, keepdim=True)).view(B, S, E).mean(1)
    f = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in idx.view(B, S, K)]).float() * E / (K * S)
    torch.testing.assert_close(loss, (f * p).sum(-1).mean())


def test_rules():
    bad = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, hash_layers=3, swiglu_limit=-1.0))
    errors = bad.errors()
    assert any("model.moe.hash_layers=3 exceeds the 2 MoE layers" in e for e in errors), errors
    assert any("model.moe.swiglu_limit=-1.0" in e for e in errors), errors
    dense = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, n_routed_experts=0))
    assert any("hash_layers=1 needs MoE layers" in e for e in dense.errors())
    assert [CFG.is_hash_layer(i) for i in range(3)] == [True, False, False]  # (2: an MTP module's block)


def test_v3_defaults_unchanged():
    m = ModelConfig().moe
    assert (m.score_func, m.swiglu_limit, m.hash_layers) == ("sigmoid", 0.0, 0)
    assert ModelConfig().residual == "plain"
    with pytest.raises(ConfigError, match="model.residual='wide' must be one of"):
        from moe_lc.config.loading import load_config
        load_config("recipes/debug_cpu.toml", ["model.residual=wide"])
