"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM: a tiny random model made with its own classes (every
attention layer type, two hash-routed and two learned MoE layers, mHC of 3 streams, top-6 of up to 24 CSA entries,
YaRN on the compress rope past its original 64), converted from-hf: logits within 1e-5 of max |logit| at 96 tokens
and every gradient transformers computes; to-hf gives back every tensor bit for bit (tid2eid tables included), and
DeepSeek's own checkpoint names (and its MTP layer, both ways) convert too.

The indexer's top-k: ReLU'd scores tie (at 0) across the cut, and the two top-ks break ties differently. Each CSA
layer's selection is checked to be a top-k of the same scores as transformers' own (the same multiset of selected
scores for every query, on the same input), then handed to transformers in place of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lc.convert import ConvertError, from_hf, to_hf
from tests.test_convert import checkpoint_grads, hf_tensor_of_grads, our_model, quiet

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from tests import hf_models  # noqa: E402

SEQ, TOPK, E = 96, 6, 8
TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]


def v4_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=hf_models.VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, num_experts_per_tok=2,
        n_routed_experts=E, n_shared_experts=1, layer_types=TYPES, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, sliding_window=16,
        o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=TOPK, hc_mult=3,
        max_position_embeddings=4 * hf_models.ORIGINAL, rms_norm_eps=1e-6,
        rope_parameters={**hf_models.YARN, "rope_theta": 160000.0})


def save_v4(directory: Path):
    """The random model (std 0.1; norm weights near 1; nonzero sinks, position biases, mHC biases, router biases;
    each hash layer a table of distinct experts per token id) saved with a tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = v4_config()
    config.initializer_range = 0.1
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn_like(t))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                t.copy_(0.3 * torch.randn_like(t))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
            elif name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], E).topk(b.shape[1], dim=-1).indices)
    model.save_pretrained(directory)
    hf_models.tokenizer_files(directory)
    return model


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    base = tmp_path_factory.mktemp("deepseek_v4")
    model = save_v4(base / "hf")
    from_hf(base / "hf", base / "ours", log=quiet)
    return model, base


def test_converted_recipe(v4):
    _, base = v4
    _, cfg = our_model(base / "ours")
    m = cfg.model
    assert (m.attention, m.residual, m.mhc.hc_mult, m.moe.hash_layers, m.moe.n_dense_layers) == ("v4", "mhc", 3, 2, 0)
    a = m.v4_attention
    assert (a.layer_types, a.index_topk, a.rope_head_dim, a.yarn_factor, a.compress_rope_theta) == (
        TYPES, TOPK, 8, 4.0, 160000.0)
    assert (m.moe.score_func, m.moe.swiglu_limit, m.moe.routed_scaling_factor) == ("sqrtsoftplus", 10.0, 1.5)


def test_logits_and_gradients_match_transformers(v4):
    hf, base = v4
    ours, cfg = our_model(base / "ours")
    picks, scores, theirs = {}, {}, {}
    hooks = []
    for i, block in ours.layers.items():
        indexer = block.attn.indexer
        if indexer is not None:
            # the picks, and every entry's scores from the same inputs (the tiled top-k keeps none of them)
            hooks.append(indexer.register_forward_hook(
                lambda m, a, out, i=int(i): picks.__setitem__(i, out) or scores.__setitem__(i, m.scores(*a))))

    def hand_ours(i):
        def hook(module, args, out):
            theirs[i] = out
            return picks[i]
        return hook
    hooks += [layer.self_attn.compressor.indexer.register_forward_hook(hand_ours(i))
              for i, layer in enumerate(hf.model.layers) if TYPES[i] == "compressed_sparse_attention"]
    tokens = torch.randint(0, hf_models.VOCAB, (2, SEQ))
    weights = torch.randn(2, SEQ, hf_models.VOCAB)
    try:
        ours_logits, hf_logits = ours(tokens), hf(tokens).logits
    finally:
        for h in hooks:
            h.remove()
    assert sorted(theirs) == [1, 3]
    for i, sel in theirs.items():  # both top-k of the same scores: the same selected scores for every query
        s = scores[i]

        def chosen(x):
            return torch.where(x >= 0, s.gather(-1, x.clamp_min(0)), float("-inf")).sort(-1).values
        torch.testing.assert_close(chosen(picks[i]), chosen(sel), rtol=0, atol=0)
        assert (picks[i] >= 0).sum(-1).max() == TOPK and (s.isfinite().sum(-1) > TOPK).any()  # a real cut
    assert ((ours_logits - hf_logits).abs().max() / hf_logits.abs().max()).item() <= 1e-5
    (ours_logits * weights).sum().backward()
    (hf_logits * weights).sum().backward()
    want = checkpoint_grads(hf, "deepseek_v4", cfg.model.moe.ffn_dim)
    for name, p in ours.named_parameters():  # the indexer: no gradient in either (its top-k is an integer choice)
        assert p.grad is None or ".indexer." not in name, name
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    have = hf_tensor_of_grads(ours, cfg, "deepseek_v4")
    renamed = {_saved_name(k): g for k, g in want.items()}
    for name, g in renamed.items():
        assert name in have, name
        assert (have[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-6), name
    assert {k for k in set(have) - set(renamed) if ".indexer." not in k} == set()  # every other tensor compared


def _saved_name(name: str) -> str:
    """transformers' parameter name -> the name save_pretrained writes (its conversion mapping, reversed)."""
    import re

    pairs = [(r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."), (r"\.compressor\.indexer\.scorer\.weights_proj\.",
             ".indexer.weights_proj."), (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
             (r"\.compressor\.indexer\.", ".indexer.compressor."), (r"^lm_head\.", "head."),
             (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
             (r"\.attn_hc\.", ".hc_attn_"), (r"\.ffn_hc\.", ".hc_ffn_"), (r"\.sinks$", ".attn_sink"),
             (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"), (r"\.q_a_proj\.", ".wq_a."),
             (r"\.attn\.q_b_proj\.", ".attn.wq_b."), (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".wgate."),
             (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."), (r"\.q_a_norm\.", ".q_norm."),
             (r"shared_experts\.wgate\.", "shared_experts.w1."), (r"shared_experts\.up_proj\.", "shared_experts.w3."),
             (r"shared_experts\.down_proj\.", "shared_experts.w2."), (r"experts\.(\d+)\.wgate\.", r"experts.\1.w1."),
             (r"experts\.(\d+)\.up_proj\.", r"experts.\1.w3."), (r"experts\.(\d+)\.down_proj\.", r"experts.\1.w2.")]
    for pattern, repl in pairs:
        name = re.sub(pattern, repl, name)
    return name


def test_from_hf_then_to_hf_is_bit_identical(v4, tmp_path):
    _, base = v4
    to_hf(base / "ours", tmp_path / "back", log=quiet)
    have, want = load_file(tmp_path / "back" / "model.safetensors"), load_file(base / "hf" / "model.safetensors")
    assert have.keys() == want.keys(), set(have) ^ set(want)
    assert [k for k in want if not torch.equal(have[k], want[k])] == []
    assert have["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64  # the hash tables, both ways
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert (config.layer_types, config.mlp_layer_types[:3], config.hc_mult) == (TYPES, ["hash_moe"] * 2 + ["moe"], 3)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    original = v4[0]
    assert all(torch.equal(t, original.state_dict()[k]) for k, t in theirs.state_dict().items())


def test_deepseek_names_and_mtp_layer(v4, tmp_path):
    """A checkpoint under DeepSeek's own names (no "model." prefix, hc_head_fn, ...) with an MTP layer converts to
    the same main weights plus our mtp.0. The MTP layer is named as DeepSeek's inference/model.py names its MTPBlock
    (a Block: attn.*, ffn.*, hc_attn_* ..., plus e_proj, h_proj, enorm, hnorm, norm, hc_head_*), built here from
    layer 0's window-only attention and layer 3's learned-routed MoE, random values. to-hf writes it back bit for bit
    and transformers loads the result, skipping it."""
    from moe_lc.convert.hf_v4 import _TOP

    _, base = v4
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in base.joinpath("hf").iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (hub / f.name).write_bytes(f.read_bytes())
    tensors = load_file(base / "hf" / "model.safetensors")
    renamed = {_TOP.get(k, k.removeprefix("model.")): t for k, t in tensors.items()}
    torch.manual_seed(1)
    mtp = {"mtp.0." + k.split(".", 2)[2]: torch.randn_like(t) for k, t in renamed.items()
           if k.startswith("layers.0.attn.") or (k.startswith("layers.3.") and not k.startswith("layers.3.attn."))}
    D, n = 64, 3
    mtp |= {f"mtp.0.{name}.weight": 1 + 0.1 * torch.randn(D) for name in ("enorm", "hnorm", "norm")}
    mtp |= {f"mtp.0.{name}.weight": 0.1 * torch.randn(D, D) for name in ("e_proj", "h_proj")}
    mtp |= {"mtp.0.hc_head_fn": torch.randn(n, n * D), "mtp.0.hc_head_base": torch.randn(n),
            "mtp.0.hc_head_scale": torch.randn(1)}
    assert "mtp.0.ffn.gate.bias" in mtp and "mtp.0.attn.wq_a.weight" in mtp and "mtp.0.hc_ffn_fn" in mtp
    save_file(renamed | mtp, hub / "model.safetensors")
    from_hf(hub, tmp_path / "ours", log=quiet)
    a, _ = our_model(base / "ours")
    b, cfg = our_model(tmp_path / "ours")
    assert cfg.model.mtp.depth == 1 and b.mtp[0].block.attn.layer_type == "sliding_attention"
    assert all(torch.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())
    assert torch.equal(b.mtp[0].e_proj.weight, mtp["mtp.0.e_proj.weight"])
    assert torch.equal(b.mtp[0].stream_head.fn.weight, mtp["mtp.0.hc_head_fn"])
    to_hf(tmp_path / "ours", tmp_path / "back", log=quiet)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert {k: t for k, t in back.items() if k.startswith("mtp.")}.keys() == mtp.keys()
    assert [k for k, t in mtp.items() if not torch.equal(back[k], t)] == []
    assert transformers.AutoConfig.from_pretrained(tmp_path / "back").num_nextn_predict_layers == 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    assert not any(k.startswith("mtp.") for k in theirs.state_dict())


def test_to_hf_refuses_a_v4_without_mhc(v4, tmp_path):
    from moe_lc.config import load_config
    from moe_lc.convert.hf_config import family_of

    cfg = load_config(Path(__file__).resolve().parents[1] / "recipes" / "debug_v4_cpu.toml", ["model.residual=plain"])
    with pytest.raises(ConvertError, match="model.residual='plain' .* has no deepseek_v4 form"):
        family_of(cfg.model)
