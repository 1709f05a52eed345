"""mHC (moe_lc/model/residual_stream.py) against transformers' DeepseekV4HyperConnection, DeepseekV4HyperHead
and the way DeepseekV4DecoderLayer wraps a sublayer with them, with the same weights: outputs and the gradients
of the stream and of every parameter (fp32, within 1e-5). Plus the Sinkhorn projection's doubly-stochastic
result, the plain stream left as it was, and the model built with mHC training (its maps' parameters get
gradients)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lc.config import ModelConfig
from moe_lc.config.model_sections import MHCConfig
from moe_lc.model.residual_stream import HyperConnection, HyperHead, MHCStream, PlainResidual, sinkhorn
from moe_lc.model.transformer import build_model

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

B, S, N, DIM = 2, 5, 4, 32
CFG = ModelConfig(dim=DIM, residual="mhc", mhc=MHCConfig(hc_mult=N, sinkhorn_iters=20, eps=1e-6))


def hf_config() -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=DIM, num_attention_heads=2, head_dim=16, q_lora_rank=16, num_hidden_layers=1,
                            vocab_size=64, hc_mult=N, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                            o_groups=2, o_lora_rank=8, layer_types=["sliding_attention"], mlp_layer_types=["moe"],
                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _random_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (the biases and scales too, so each term of the maps is exercised)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _ours_from(theirs: hf_v4.DeepseekV4HyperConnection) -> HyperConnection:
    ours = HyperConnection(CFG)
    with torch.no_grad():
        ours.fn.weight.copy_(theirs.fn)
        ours.bias.copy_(theirs.base)
        ours.scale.copy_(theirs.scale)
    return ours


def _stream(seed: int) -> torch.Tensor:
    return torch.randn(B, S, N, DIM, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def test_hyper_connection_matches_transformers():
    theirs = hf_v4.DeepseekV4HyperConnection(hf_config())
    _random_(theirs, 0)
    ours = _ours_from(theirs)
    h_hf, h_ours = _stream(1), _stream(1)
    post_hf, comb_hf, x_hf = theirs(h_hf)
    x, post, comb = ours.split(h_ours)
    for a, b in ((x, x_hf), (post, post_hf), (comb, comb_hf)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    w = torch.randn(B, S, DIM), torch.randn(B, S, N), torch.randn(B, S, N, N)
    loss_hf = (x_hf * w[0]).sum() + (post_hf * w[1]).sum() + (comb_hf * w[2]).sum()
    loss = (x * w[0]).sum() + (post * w[1]).sum() + (comb * w[2]).sum()
    got = _grads(loss, [h_ours, ours.fn.weight, ours.bias, ours.scale])
    want = _grads(loss_hf, [h_hf, theirs.fn, theirs.base, theirs.scale])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sublayer_wrap_matches_decoder_layer():
    """A decoder layer whose attention and MLP are fixed functions: transformers' residual wiring (collapse,
    sublayer, post * out + comb^T h, twice) against our split / merge, values and gradients."""
    hf_cfg = hf_config()
    layer = hf_v4.DeepseekV4DecoderLayer(hf_cfg, 0)
    _random_(layer.attn_hc, 2)
    _random_(layer.ffn_hc, 3)
    a_mat, f_mat = torch.randn(DIM, DIM) / DIM**0.5, torch.randn(DIM, DIM) / DIM**0.5

    def attn(x):
        return torch.tanh(x @ a_mat)

    def mlp(x):
        return torch.sin(x @ f_mat)

    class Fixed(torch.nn.Module):
        def __init__(self, fn, pair: bool):
            super().__init__()
            self.fn, self.pair = fn, pair

        def forward(self, hidden_states, **kw):
            return (self.fn(hidden_states), None) if self.pair else self.fn(hidden_states)

    layer.self_attn, layer.mlp = Fixed(attn, True), Fixed(mlp, False)
    attn_res, ffn_res = _ours_from(layer.attn_hc), _ours_from(layer.ffn_hc)
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm  # weights 1: the same norm on both sides
    h_hf, h = _stream(4), _stream(4)
    out_hf = layer(h_hf)
    x, *carried = attn_res.split(h)
    h1 = attn_res.merge(h, attn(norm1(x)), *carried)
    x, *carried = ffn_res.split(h1)
    out = ffn_res.merge(h1, mlp(norm2(x)), *carried)
    torch.testing.assert_close(out, out_hf, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    got = _grads((out * dout).sum(), [h, attn_res.fn.weight, attn_res.bias, ffn_res.scale, ffn_res.fn.weight])
    want = _grads((out_hf * dout).sum(), [h_hf, layer.attn_hc.fn, layer.attn_hc.base, layer.ffn_hc.scale,
                                          layer.ffn_hc.fn])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_hyper_head_and_widen_match_transformers():
    theirs = hf_v4.DeepseekV4HyperHead(hf_config())
    _random_(theirs, 5)
    ours = HyperHead(CFG)
    with torch.no_grad():
        ours.fn.weight.copy_(theirs.hc_fn)
        ours.bias.copy_(theirs.hc_base)
        ours.scale.copy_(theirs.hc_scale)
    h_hf, h = _stream(6), _stream(6)
    out_hf, out = theirs(h_hf), ours(h)
    torch.testing.assert_close(out, out_hf, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    got = _grads((out * dout).sum(), [h, ours.fn.weight, ours.bias, ours.scale])
    want = _grads((out_hf * dout).sum(), [h_hf, theirs.hc_fn, theirs.hc_base, theirs.hc_scale])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    e = torch.randn(B, S, DIM)  # DeepseekV4Model: inputs_embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1)
    assert torch.equal(MHCStream.widen(CFG, e), e.unsqueeze(2).expand(-1, -1, N, -1))


def test_sinkhorn_is_doubly_stochastic_and_init_is_transformers():
    comb = torch.rand(3, N, N) * 5 + 0.01
    out = sinkhorn(comb, 20, 1e-6)
    torch.testing.assert_close(out.sum(-1), torch.ones(3, N), atol=1e-3, rtol=0)
    torch.testing.assert_close(out.sum(-2), torch.ones(3, N), atol=1e-5, rtol=0)
    model = build_model(dataclasses.replace(CFG, n_layers=2), seed=0)
    res = model.layers["0"].attn_res  # transformers' _init_weights: fn ~ N(0, std), base 0, scale 1
    assert torch.equal(res.scale, torch.ones(3)) and torch.equal(res.bias, torch.zeros(N * (N + 2)))
    assert torch.equal(model.stream_head.scale, torch.ones(1))
    assert 0.5 * CFG.init_std < res.fn.weight.std() < 2 * CFG.init_std


def test_plain_stream_is_the_old_residual():
    h, out = torch.randn(B, S, DIM), torch.randn(B, S, DIM)
    plain = PlainResidual()
    assert plain.split(h)[0] is h and torch.equal(plain.merge(h, out), h + out)
    model = build_model(ModelConfig(), seed=0)
    assert model.stream_head is None and not any("_res" in n for n, _ in model.named_parameters())


def test_mhc_model_trains_its_maps():
    cfg = dataclasses.replace(CFG, n_layers=2, n_heads=2, n_kv_heads=1)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    errors = dataclasses.replace(CFG, mhc=MHCConfig(hc_mult=0, sinkhorn_iters=-1)).errors()
    assert [e.split("=")[0] for e in errors] == ["model.mhc.hc_mult", "model.mhc.sinkhorn_iters"], errors


def test_mhc_gains_and_biases_are_not_weight_decayed():
    from moe_lc.parallel.parallelize import no_weight_decay_names

    model = build_model(dataclasses.replace(CFG, n_layers=2, n_heads=2, n_kv_heads=1), seed=0)
    kept = no_weight_decay_names(model)
    mhc = {n for n, _ in model.named_parameters() if "_res." in n or n.startswith("stream_head.")}
    assert mhc and {n for n in mhc if n.rsplit(".", 1)[-1] in ("scale", "bias")} <= kept
    assert not {n for n in mhc if n.endswith(".fn.weight")} & kept  # the maps' projections decay
