"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against transformers' DeepseekV32ForCausalLM: a tiny random model
made with its own classes (tests/hf_models.py: 16 indexer heads of 16, top-24 of a 96-token sequence, YaRN past
its original 64), converted: the indexer selects what transformers' selects, the logits agree within 1e-5 of
max |logit| and every gradient transformers computes (it never trains its indexer) agrees; from-hf -> to-hf is
bit-identical."""

from __future__ import annotations

import pytest
import torch

import moe_lc.model.dsa as dsa_module
from moe_lc.convert import from_hf, to_hf
from tests import hf_models
from tests.test_convert import SEQ, checkpoint_grads, hf_tensor_of_grads, our_model, quiet

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    base = tmp_path_factory.mktemp("deepseek_v32")
    model = hf_models.save_model(hf_models.deepseek_v32(), base / "hf")
    from_hf(base / "hf", base / "ours", log=quiet)
    return model, base


def test_converted_recipe_is_dsa_in_the_sparse_stage(v32):
    _, base = v32
    _, cfg = our_model(base / "ours")
    d = cfg.model.dsa
    assert (d.enabled, d.stage, d.index_topk, d.index_n_heads, d.index_head_dim) == (True, "sparse", 24, 16, 16)


def test_selection_logits_and_gradients_match_transformers(v32, monkeypatch):
    hf, base = v32
    ours, cfg = our_model(base / "ours")
    ours_sel, hf_sel = [], []
    select = dsa_module.select
    monkeypatch.setattr(dsa_module, "select", lambda *a, **k: ours_sel.append(select(*a, **k)) or ours_sel[-1])
    # (each call gives (selection, scores))
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, i, o: hf_sel.append(o)) for layer in hf.model.layers]
    tokens = torch.randint(0, hf_models.VOCAB, (2, SEQ))
    weights = torch.randn(2, SEQ, hf_models.VOCAB)
    ours_logits, hf_logits = ours(tokens), hf(tokens).logits
    for h in hooks:
        h.remove()
    for (mine, _), theirs in zip(ours_sel, hf_sel):  # rows past the first 24 see more keys than they keep
        for t in range(24, SEQ):
            assert set(mine.positions[:, t].flatten().tolist()) == set(theirs[:, t].flatten().tolist()), t
    assert len(ours_sel) == cfg.model.n_layers and (ours_sel[0][0].valid.sum(-1) == 24).sum() > SEQ
    assert ((ours_logits - hf_logits).abs().max() / hf_logits.abs().max()).item() <= 1e-5
    (ours_logits * weights).sum().backward()
    (hf_logits * weights).sum().backward()
    want = checkpoint_grads(hf, "deepseek_v32", cfg.model.moe.ffn_dim)
    for name, p in ours.named_parameters():
        if ".indexer." in name:  # transformers scores without gradient; ours in eval mode trains no indexer
            assert p.grad is None or not p.grad.any(), name
            p.grad = torch.zeros_like(p)
    have = hf_tensor_of_grads(ours, cfg, "deepseek_v32")
    assert {k for k in have if ".indexer." not in k} == set(want)
    for name, g in want.items():
        assert (have[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-6), name


def test_from_hf_then_to_hf_is_bit_identical(v32, tmp_path):
    _, base = v32
    to_hf(base / "ours", tmp_path / "back", log=quiet)
    have, want = load_file(tmp_path / "back" / "model.safetensors"), load_file(base / "hf" / "model.safetensors")
    assert have.keys() == want.keys(), set(have) ^ set(want)
    assert [k for k in want if not torch.equal(have[k], want[k])] == []
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert (config.model_type, config.index_topk, config.index_n_heads, config.index_head_dim) == (
        "deepseek_v32", 24, 16, 16)
