"""Decoding DeepSeek-V4 with its own caches (moe_lc/model/v4_decode.py) and decode.py's mHC stream and hash-routed
layers: the tiny V4 (recipes/debug_v4_cpu.toml: window, CSA m = 4 with top-8 of its entries, HCA m = 16, mHC,
a hash layer; fp32) gives the full forward's logits at every position, prompts and steps of every length across
entry boundaries; the cache stays O(window + entries); the eval harness runs on a V4 checkpoint through it."""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model import decode, v4_decode
from moe_lc.model.transformer import build_model
from tests.harness import RECIPES

V4 = RECIPES / "debug_v4_cpu.toml"


def _v4(*overrides: str):
    """The tiny V4 with random sinks and position biases (they start at zero: a slot or sink mix-up would hide)."""
    model = build_model(load_config(V4, list(overrides)).model, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def v4():
    return _v4()


def _cached_logits(model, tokens, prompt: int, steps: list[int]) -> torch.Tensor:
    """fp32 logits (B, sum(steps) + 1, V) at positions prompt - 1 .. prompt - 1 + sum(steps) (the full forward's
    [:, prompt - 1:]): a prefill of `prompt` tokens, then one extend call per entry of `steps`, that many tokens."""
    cache = decode.new_cache(model, tokens.shape[0], tokens.shape[1])
    out, at = [decode.prefill(model, tokens[:, :prompt], cache)[:, None]], prompt
    for n in steps:
        out.append(decode.extend(model, tokens[:, at:at + n], cache))
        at += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("prompt, steps", [
    (16, [1] * 20),            # a multiple of both m: the next token opens a CSA and an HCA window
    (21, [1] * 15),            # neither: partial windows cached over the prompt's end
    (3, [2, 5, 1, 13, 4, 8]),  # n > 1 per call, calls straddling entries; a prompt shorter than one CSA window
    (37, [19, 1, 1, 9]),       # a prompt of three query chunks (W = 16); a teacher-forced answer longer than W
])
def test_cached_logits_equal_the_full_forward(v4, prompt, steps):
    tokens = torch.randint(0, 512, (2, prompt + sum(steps)), generator=torch.Generator().manual_seed(prompt))
    full = v4(tokens).float()
    cached = _cached_logits(v4, tokens, prompt, steps)
    torch.testing.assert_close(cached, full[:, prompt - 1:], rtol=1e-5, atol=1e-5)


def test_greedy_generation_with_the_cache_is_the_full_forwards(v4):
    """30 greedy tokens after a 21-token prompt (past two HCA entries and 12 CSA ones, top-8 of them read): the
    tokens of the uncached model, and each step's logits its full forward's at that position."""
    prompt = torch.randint(0, 512, (2, 21), generator=torch.Generator().manual_seed(5))
    cache = decode.new_cache(v4, 2, 51)
    logits = [decode.prefill(v4, prompt, cache)]
    new = [logits[-1].argmax(-1)]
    while len(new) < 30:
        logits.append(decode.extend(v4, new[-1][:, None], cache)[:, -1])
        new.append(logits[-1].argmax(-1))
    new = torch.stack(new, 1)
    assert torch.equal(new, decode.generate_uncached(v4, prompt, 30))
    full = v4(torch.cat([prompt, new], 1)).float()
    torch.testing.assert_close(torch.stack(logits, 1), full[:, 20:-1], rtol=1e-5, atol=1e-5)


def test_the_cache_holds_the_window_and_the_entries_not_the_sequence(v4, monkeypatch):
    """After T tokens: W - 1 window rows, T // m entries (and index keys), T mod m pending rows per compressor, none
    of them a view of the prompt's rows; a one-token step attends W window rows, never T."""
    T, W = 45, v4.cfg.v4_attention.sliding_window
    cache = decode.new_cache(v4, 1, 60)
    decode.prefill(v4, torch.randint(0, 512, (1, T)), cache)
    for name, block in v4.layers.items():
        layer = cache.layers[name]
        assert layer.window.shape == (1, W - 1, block.attn.head_dim) and layer.length == T
        for state, comp in ((layer.compressor, block.attn.compressor),
                            (layer.index_keys, block.attn.indexer and block.attn.indexer.compressor)):
            assert (state is None) == (comp is None)
            if state is not None:
                assert state.count == T // comp.rate and state.pending.shape[1] == T % comp.rate
                held = [state.pending] + ([state.prev_kv, state.prev_gate] if comp.overlap else [])
                assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in held)
        # no view that keeps the prompt's rows alive behind the window
        assert layer.window.untyped_storage().nbytes() == layer.window.numel() * 4
    seen = []
    inner = v4_decode.sink_attention_rows
    monkeypatch.setattr(v4_decode, "sink_attention_rows", lambda q, keys, *a: seen.append(keys.shape[1]) or
                        inner(q, keys, *a))
    decode.extend(v4, torch.randint(0, 512, (1, 1)), cache)
    assert seen == [W] * len(v4.layers)


def test_rewinding_to_the_prompt_and_only_there(v4):
    """Teacher forcing an answer, then generating from the prompt (eval/ruler_run.py): the same logits as a fresh
    cache; any other length is refused, naming the mark."""
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(7))
    cache = decode.new_cache(v4, 2, 40)
    decode.prefill(v4, tokens[:, :22], cache)
    decode.extend(v4, tokens[:, 22:35], cache)
    for _ in range(2):  # a mark survives a rewind: twice to the same prompt
        cache.rewind(22)
        again = decode.extend(v4, tokens[:, 30:33], cache)
    fresh = decode.new_cache(v4, 2, 40)
    decode.prefill(v4, tokens[:, :22], fresh)
    torch.testing.assert_close(again, decode.extend(v4, tokens[:, 30:33], fresh), rtol=0, atol=0)
    with pytest.raises(ValueError, match="rewinds only to the end of its prompt \\(its mark at 22\\), not to 23"):
        cache.rewind(23)


@pytest.mark.parametrize("overrides", [
    ["model.residual=plain"],       # the learned router and the hash layer on a plain stream
    ["model.moe.hash_layers=0"],    # mHC alone
])
def test_mhc_and_hash_layers_each_decode_as_the_full_forward(overrides):
    model = _v4(*overrides)
    tokens = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_cached_logits(model, tokens, 17, [1] * 13), model(tokens).float()[:, 16:],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_gqa_and_mla_decode_with_mhc_and_a_hash_layer(attention):
    """decode.py's stream and routing are the model's, whatever the attention: mHC's widened stream, its maps and
    head, and a hash-routed first MoE layer under GQA's and MLA's caches."""
    mla = ["model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
           "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=24"] if attention == "mla" else []
    cfg = load_config(RECIPES / "debug_cpu.toml", [f"model.attention={attention}", "model.residual=mhc",
                                                   "model.moe.hash_layers=1", *mla], check=False).model
    model = build_model(cfg, seed=3).eval()
    assert model.stream_head is not None and any(hasattr(f.router, "tid2eid") for f in model.moe_layers().values())
    tokens = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_cached_logits(model, tokens, 20, [4, 1, 5]), model(tokens).float()[:, 19:],
                               rtol=1e-5, atol=1e-5)


def test_the_eval_harness_runs_on_a_v4_checkpoint_through_its_cache(tmp_path, monkeypatch):
    """passkey (teacher-forced: one forward) and RULER's niah_single_1 (the passkey with a noise haystack, scored
    on a greedy generation: prefill, teacher-forced answer, rewind, decode) on a freshly initialised tiny V4."""
    from eval.run import evaluate, parse_args
    from moe_lc.train import run

    out = tmp_path / "run"
    run(load_config(V4, ["train.steps=1", "train.lr=1e-12", "train.warmup_steps=0", "train.global_batch=2",
                         "train.micro_batch=2", "train.seq_len=32", "checkpoint.interval=1",
                         "train.log_interval=100", f"train.output_dir={out}"]))
    calls = []
    step = v4_decode.V4Decode.step
    monkeypatch.setattr(v4_decode.V4Decode, "step", staticmethod(
        lambda attn, x, *a: calls.append((a[-1], x.shape[1])) or step(attn, x, *a)))
    res = evaluate(parse_args([str(out), "--tasks", "passkey,niah_single_1", "--lengths", "400", "--depths", "0.5",
                               "--samples", "2", "--gen-tokens", "3", "--threads", "1", "--out",
                               str(tmp_path / "eval")]), progress=lambda *_: None)
    assert res["tasks"]["passkey"]["by_length"]["400"]["n"] == 2
    assert res["tasks"]["niah_single_1"]["by_length"]["400"]["n"] == 2
    starts = {start for start, _ in calls}
    assert 0 in starts and max(starts) > 380  # the prompt from position 0, then steps far into the cache
    assert {n for start, n in calls if start > 0 and n == 1}  # one-token decode steps
