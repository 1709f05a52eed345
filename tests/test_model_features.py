"""Model features of the Hugging Face MoE families (issue #35), each a recipe key, default off:
qk_norm ("head": Qwen3 / GLM-4.5, "full": OLMoE), rope.partial_rotary_factor (GLM-4.5), rope.scaling =
"llama3" (Llama 3.1), attn_out_bias (attention_bias of Llama / Qwen3 / OLMoE), moe.shared_expert_gate and
moe.shared_ffn_dim (Qwen2-MoE), and the softmax router of Mixtral / Qwen3-MoE / OLMoE / Qwen2-MoE.

Unit tests hold each piece to a direct formula (or to transformers' own function where it can be
imported); equivalence runs hold each feature under a layout that cuts what it touches to one process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.config.loading import model_config
from moe_lc.model.attention import Attention
from moe_lc.model.counting import param_counts
from moe_lc.model.moe import MoE, Router
from moe_lc.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from moe_lc.model.transformer import Transformer, build_model
from tests.harness import RECIPES, assert_equivalent, reference, run_layout, run_workers

RECIPE = RECIPES / "debug_cpu.toml"


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_half(x, cos, sin):
    """transformers' rotate_half RoPE on the first 2 * cos.shape[-1] dims (B, S, H, d); cos (S, r/2)."""
    r = 2 * cos.shape[-1]
    c, s = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], -1)
    return torch.cat([rot * c + half * s, rest], -1)


def _attention(qk_norm: str, factor: float = 1.0):
    cfg = model_config(dim=64, n_heads=4, n_kv_heads=2, qk_norm=qk_norm, norm_eps=1e-5,
                       rope=dataclasses.replace(model_config().rope, partial_rotary_factor=factor))
    attn = Attention(cfg)
    torch.manual_seed(0)
    for p in attn.parameters():
        p.data = torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0)
    rope = RotaryEmbedding.from_config(cfg.rope, cfg.rope_dim)
    cos, sin = rope(torch.arange(6))
    return attn, cfg, torch.randn(2, 6, (4 + 2 * 2) * 16), cos, sin


@pytest.mark.parametrize("kind", ["head", "full"])
def test_qk_norm_is_rmsnorm_before_rope(kind):
    attn, cfg, qkv, cos, sin = _attention(kind, factor=0.5)
    q, k, v = attn.heads(qkv, cos, sin)
    q_raw, k_raw, v_raw = qkv.split([64, 32, 32], -1)
    if kind == "head":  # Qwen3: q_norm(q_proj(x).view(..., Dh)), one (Dh,) weight for every head
        assert attn.q_norm.weight.shape == (16,) and attn.k_norm.weight.shape == (16,)
        q_want = _rms(q_raw.view(2, 6, 4, 16), attn.q_norm.weight, 1e-5)
        k_want = _rms(k_raw.view(2, 6, 2, 16), attn.k_norm.weight, 1e-5)
    else:  # OLMoE: q_norm(q_proj(x)) over H*Dh, k_norm over K*Dh, then the split into heads
        assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
        q_want = _rms(q_raw, attn.q_norm.weight, 1e-5).view(2, 6, 4, 16)
        k_want = _rms(k_raw, attn.k_norm.weight, 1e-5).view(2, 6, 2, 16)
    torch.testing.assert_close(q, _rope_half(q_want, cos, sin), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, _rope_half(k_want, cos, sin), rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_raw.view(2, 6, 2, 16))
    # a wrong order (RoPE first, then the norm) would give other values: the test can tell
    assert not torch.allclose(q, _rms(_rope_half(q_raw.view(2, 6, 4, 16), cos, sin), 1.0, 1e-5), atol=1e-3)


def test_partial_rotary_matches_transformers_glm4_moe():
    glm = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")
    cos, sin = RotaryEmbedding(8, 10000.0)(torch.arange(5))  # head_dim 16, factor 0.5: 8 rotated dims
    q, k = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16)
    emb_cos, emb_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # (1, S, 8)
    q_want, k_want = glm.apply_rotary_pos_emb(q, k, emb_cos, emb_sin, unsqueeze_dim=2)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_want, rtol=1e-6, atol=1e-6)
    assert torch.equal(apply_rope(q, cos, sin)[..., 8:], q[..., 8:])  # the pass-through half is untouched
    half = dataclasses.replace(model_config().rope, partial_rotary_factor=0.5)
    assert model_config(head_dim=16, rope=half).rope_dim == 8


def test_llama3_frequencies_match_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    for theta, factor, low, high, L in [(500000.0, 8.0, 1.0, 4.0, 8192), (10000.0, 4.0, 2.0, 8.0, 256)]:
        hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=L * int(factor),
                         rope_parameters=dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=low,
                                              high_freq_factor=high, original_max_position_embeddings=L))
        want, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
        got = rope_inv_freq(128, theta, "llama3", factor, L, low_freq_factor=low, high_freq_factor=high)
        assert torch.equal(got, want), (got - want).abs().max()
        assert attention_factor == 1.0 and RotaryEmbedding(128, theta, "llama3", factor, L).attention_factor == 1.0
        plain = rope_inv_freq(128, theta)
        assert (got < plain).any() and (got == plain).any()  # some pairs slowed down, the fastest kept


def test_shared_expert_gate_scales_the_shared_expert():
    on = model_config(dim=32, moe=dataclasses.replace(model_config().moe, ffn_dim=16, shared_ffn_dim=40,
                                                      shared_expert_gate=True, n_groups=1, topk_groups=1))
    off = dataclasses.replace(on, moe=dataclasses.replace(on.moe, shared_expert_gate=False))
    torch.manual_seed(0)
    gated, plain = MoE(on), MoE(off)
    for p in gated.parameters():
        p.data = torch.randn_like(p) * 0.3
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("shared_gate.")})
    assert gated.shared.w2.weight.shape == (32, 40) and gated.shared_gate.weight.shape == (1, 32)
    x = torch.randn(2, 5, 32)
    shared = gated.shared(x)
    routed = plain(x) - shared
    want = routed + torch.sigmoid(x @ gated.shared_gate.weight.T) * shared  # Qwen2-MoE's shared expert
    torch.testing.assert_close(gated(x), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(gated(x), plain(x), atol=1e-3)


@pytest.mark.parametrize("family, norm_topk_prob", [("mixtral", True), ("qwen3_moe", True), ("olmoe", False),
                                                    ("qwen2_moe", False)])
def test_softmax_router_matches_the_families(family, norm_topk_prob):
    """Mixtral: softmax over the top-k logits; Qwen3-MoE: softmax over all, top-k, renormalized;
    OLMoE and Qwen2-MoE: softmax over all, top-k, not renormalized (transformers' routers)."""
    moe = dataclasses.replace(model_config().moe, n_routed_experts=8, topk=2, n_groups=1, topk_groups=1,
                              score_func="softmax", norm_topk_prob=norm_topk_prob, routed_scaling_factor=1.0)
    router = Router(model_config(dim=16, moe=moe))
    torch.manual_seed(0)
    router.gate.weight.data = torch.randn(8, 16)
    x = torch.randn(20, 16)
    idx, weights, _ = router(x)
    logits = x @ router.gate.weight.T
    top_logits, top_idx = logits.topk(2, dim=-1)
    if family == "mixtral":
        want = top_logits.softmax(-1)
    else:
        want = logits.softmax(-1).gather(1, top_idx)
        want = want / want.sum(-1, keepdim=True) if norm_topk_prob else want
    assert torch.equal(idx, top_idx)
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_cached_decoding_sees_the_same_normalized_partly_rotated_keys(qk_norm):
    """moe_lc.model.decode goes through Attention.heads: prefill + extend equal the full forward."""
    from moe_lc.model import decode

    model = build_model(load_config(RECIPE, [f"model.qk_norm={qk_norm}", *ALL_ON[1:]]).model, seed=3).eval()
    prompt, more = torch.randint(0, 256, (2, 20)), torch.randint(0, 256, (2, 5))
    full = model(torch.cat([prompt, more], 1)).float()
    cache = decode.new_cache(model, 2, 30)
    torch.testing.assert_close(decode.prefill(model, prompt, cache), full[:, 19], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode.extend(model, more, cache), full[:, 20:], rtol=1e-5, atol=1e-5)


# -- config: default off, counts, errors ---------------------------------------------------------------

ALL_ON = ["model.qk_norm=full", "model.rope.partial_rotary_factor=0.5", "model.attn_out_bias=true",
          "model.moe.shared_expert_gate=true", "model.moe.shared_ffn_dim=64", "model.rope.scaling=llama3",
          "model.rope.factor=8", "model.rope.original_seq_len=32"]


def test_default_off_keeps_names_and_initial_values():
    plain = build_model(load_config(RECIPE).model, seed=3).state_dict()
    with_all = build_model(load_config(RECIPE, ALL_ON).model, seed=3).state_dict()
    new = set(with_all) - set(plain)
    attn = {f"layers.{i}.attn.{n}" for i in range(4) for n in ("q_norm.weight", "k_norm.weight", "wo.bias")}
    assert new == attn | {f"layers.{i}.ffn.shared_gate.weight" for i in range(1, 4)}
    assert set(plain) <= set(with_all)
    changed = [k for k in plain if not torch.equal(plain[k], with_all[k]) and "shared." not in k]
    assert changed == []  # init is by name: adding parameters moves no other one's values
    assert not any("q_norm" in k or "shared_gate" in k or k.endswith("wo.bias") for k in plain)


@pytest.mark.parametrize("overrides", [["model.qk_norm=head"], ["model.qk_norm=full", "model.qkv_bias=true"],
                                       ALL_ON, ALL_ON + ["model.mtp.depth=1"]],
                         ids=["head", "full-qkv-bias", "all", "all-mtp"])
def test_param_counter_counts_the_new_parameters(overrides):
    cfg = load_config(RECIPE, overrides).model
    with torch.device("meta"):
        model = Transformer(cfg)
    counts = param_counts(cfg)
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert counts["total"] == sum(p.numel() for p in model.parameters()) - mtp
    assert counts["mtp"] == mtp


@pytest.mark.parametrize("overrides, message", [
    (["model.attention=mla", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
      "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=16", "model.qk_norm=head"],
     "model.qk_norm='head' needs model.attention = 'gqa'"),
    (["model.attention=mla", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
      "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=16", "model.rope.partial_rotary_factor=0.5"],
     "model.rope.partial_rotary_factor=0.5 needs model.attention = 'gqa'"),
    (["model.qk_norm=layer"], "model.qk_norm='layer' must be one of 'none', 'head', 'full'"),
    (["model.rope.partial_rotary_factor=0.3"], "rotates int(32 * 0.3) = 9 dims per head: must be even"),
    (["model.rope.partial_rotary_factor=1.5"], "model.rope.partial_rotary_factor=1.5 must lie in (0, 1]"),
    (["model.rope.scaling=llama3", "model.rope.high_freq_factor=1.0"],
     "model.rope.high_freq_factor=1.0 must exceed rope.low_freq_factor=1.0"),
    (["model.moe.n_shared_experts=0", "model.moe.shared_expert_gate=true"],
     "model.moe.shared_expert_gate = true needs model.moe.n_shared_experts >= 1"),
    (["model.moe.shared_ffn_dim=-4"], "model.moe.shared_ffn_dim=-4 must be >= 0"),
])
def test_bad_feature_settings_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, overrides)
    assert message in str(info.value)


def test_llama3_scaling_warns_past_its_reach():
    from moe_lc.config.rules import recipe_warnings

    cfg = load_config(RECIPE, ["model.rope.scaling=llama3", "model.rope.factor=2", "model.rope.original_seq_len=32"])
    assert any("beyond what Llama 3 RoPE scaling is scaled for" in w for w in recipe_warnings(cfg))


def test_shared_ffn_dim_must_split_over_tp():
    with pytest.raises(ConfigError, match="parallel.tp=2 must divide model.moe.shared_ffn_dim=63"):
        load_config(RECIPE, ["parallel.tp=2", "model.moe.shared_ffn_dim=63"], world_size=2)


# -- tensor parallelism in fp64: every gradient and its share of the global grad norm ----------------

def _tp_gradient_worker(rank, world):
    """tp = 2 with one kv head (replicated on both ranks): each parameter's gradient made whole (gathered
    shards; replicated ones summed over tp, as ZeRO-1's "dp_cp_tp" group does) vs one device, and its
    squares as ZeRO-1 counts them in the global norm (placement norm weights; replicated once)."""
    import copy

    from moe_lc.config import ParallelConfig
    from moe_lc.parallel import comm
    from moe_lc.parallel.mesh import ParallelDims
    from moe_lc.parallel.parallelize import parallelize
    from moe_lc.parallel.placement import gather_full

    small = ["model.dim=32", "model.n_layers=2", "model.n_kv_heads=1", "model.vocab_size=128", "model.ffn_dim=64",
             "model.moe.ffn_dim=16", "model.attn_backend=reference"]
    cfg = load_config(RECIPE, small + ALL_ON[:5], check=False).model  # qk_norm full, partial RoPE, biases, gate
    dims = ParallelDims.from_config(ParallelConfig(tp=world), world, rank)
    dims.init_groups()
    ref = build_model(cfg, seed=0, dtype=torch.float64)
    for name, p in ref.named_parameters():  # norm weights and biases away from their init (1, 0)
        if p.dim() == 1:
            p.data += 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype)
    parallel = parallelize(copy.deepcopy(ref), dims)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    parallel.module(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    ref(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    ref_grads, out = dict(ref.named_parameters()), {}
    for name, p in parallel.module.named_parameters():
        grad, place = p.grad.clone(), parallel.placements[name]
        replicated = place.grad_group in ("dp_cp_tp", "edp")  # edp = tp here (ep = 1)
        if replicated:
            comm.all_reduce(grad, dims["tp"])
        squares = grad.pow(2) * (place.norm_weight if place.norm_weight is not None else 1.0)
        counted = squares.sum() / (world if replicated else 1)
        comm.all_reduce(counted, dims["tp"])
        want = ref_grads[name].grad
        out[name] = (((gather_full(grad, place.shards, dims.groups) - want).norm() / want.norm()).item(),
                     abs(counted.item() / want.pow(2).sum().item() - 1))
    return out


def test_tp_gradients_and_grad_norm_shares_match_one_device_in_fp64():
    """RMSNorm and RoPE run in fp32 by design, which leaves ~1e-7; a layout error is O(1) (a k_norm
    counted on both ranks that share its kv head is off by 100% in its norm share)."""
    for rank in run_workers(_tp_gradient_worker, 2):
        assert {n for n in rank if "q_norm" in n or "shared_gate" in n or "wo.bias" in n}
        worst_grad = max(rank, key=lambda n: rank[n][0])
        worst_share = max(rank, key=lambda n: rank[n][1])
        assert rank[worst_grad][0] < 1e-6, (worst_grad, rank[worst_grad])
        assert rank[worst_share][1] < 1e-6, (worst_share, rank[worst_share])


# -- equivalence: each feature under a layout that cuts what it touches --------------------------------
# fp32, 3 steps, 2 micro-batches per rank where the layout allows; the harness's seed 1 and Adam eps
# 1e-6 (tests/harness.py) so that reordered fp32 sums are measured, not amplified.
BASE = ["train.steps=3", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.warmup_steps=1"]


def _equivalent(features, layout, world):
    ref = reference(RECIPE, BASE + features)
    got = run_layout(RECIPE, BASE + features + layout, world=world)
    report = assert_equivalent(ref, got, rtol=1e-5)
    norm_rel = max(abs(a - b) / b for a, b in zip(got.grad_norms, ref.grad_norms))
    print(f"{features} {layout}: loss rel {report.max_loss_rel:.1e}, param rel {report.max_param_rel:.1e} "
          f"({report.worst_param}), grad-norm rel {norm_rel:.1e}")
    assert norm_rel <= 1e-5, (ref.grad_norms, got.grad_norms)  # replicated copies counted once in the norm


@pytest.mark.parametrize("features", [["model.qk_norm=head"], ["model.qk_norm=full"]], ids=["head", "full"])
def test_qk_norm_and_partial_rotary_under_tp2_cp2(features):
    _equivalent(features + ["model.rope.partial_rotary_factor=0.5"], ["parallel.tp=2", "parallel.cp=2"], 4)


def test_full_qk_norm_with_kv_heads_replicated_over_tp():
    """n_kv_heads = 1 < tp = 2: k_norm's weight and the k rows are copies on both tp ranks."""
    _equivalent(["model.qk_norm=full", "model.n_kv_heads=1"], ["parallel.tp=2", "parallel.dp=2"], 4)


def test_shared_gate_shared_width_and_out_bias_under_tp2_ep2():
    _equivalent(["model.moe.shared_expert_gate=true", "model.moe.shared_ffn_dim=64", "model.attn_out_bias=true"],
                ["parallel.tp=2", "parallel.ep=2"], 2)


def test_every_feature_under_pp2_tp2():
    _equivalent(ALL_ON + ["model.n_kv_heads=1"],
                ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=1f1b"], 4)
