"""Incremental decoding (moe_lc/model/decode.py): the cached path gives the full forward's logits and
greedy tokens, for GQA, MLA's latent cache and DSA's (latents + indexer keys; top-k selected per new token), and under context parallelism (prompt through the
ring, cache gathered, decode replicated) the same tokens as one process. fp32 throughout."""

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model import decode
from moe_lc.model.transformer import build_model
from tests.harness import RECIPES, run_workers

RECIPE = RECIPES / "debug_cpu.toml"
MLA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=24"]
YARN = ["model.rope.scaling=yarn", "model.rope.factor=4", "model.rope.original_seq_len=32"]
DSA = MLA + ["model.dsa.enabled=true", "model.dsa.index_topk=12", "model.dsa.index_n_heads=4",
             "model.dsa.index_head_dim=16"]  # top-12 of up to 52 tokens: the cache keeps the indexer keys
MODELS = {"gqa": [], "gqa_yarn": YARN, "mla": MLA, "mla_no_q_lora": MLA + ["model.mla.q_lora_rank=0"],
          "mla_yarn": MLA + YARN + ["model.rope.mscale_all_dim=0.8"], "dsa": DSA + YARN,
          "dsa_warmup": DSA + ["model.dsa.stage=warmup"]}


def _model(overrides, seed=3):
    torch.manual_seed(0)
    return build_model(load_config(RECIPE, overrides, check=False).model, seed=seed).eval()


@pytest.mark.parametrize("name", MODELS)
def test_cached_logits_equal_the_full_forward(name):
    """Prefill's last logits and a 7-token extension's logits are the full forward's (fp32 rounding)."""
    model = _model(MODELS[name])
    prompt, more = torch.randint(0, 256, (2, 45)), torch.randint(0, 256, (2, 7))
    full = model(torch.cat([prompt, more], 1)).float()
    cache = decode.new_cache(model, 2, 60)
    last = decode.prefill(model, prompt, cache)
    torch.testing.assert_close(last, full[:, 44], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode.extend(model, more, cache), full[:, 45:], rtol=1e-5, atol=1e-5)
    assert cache.length == 52
    cache.rewind(45)  # teacher-forced scoring, then generation from the same prompt
    torch.testing.assert_close(decode.extend(model, more[:, :1], cache)[:, 0], full[:, 45], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gqa", "mla", "mla_no_q_lora", "dsa"])
def test_greedy_generation_with_the_cache_equals_it_without(name):
    model = _model(MODELS[name])
    prompt = torch.randint(0, 256, (3, 33))
    cached = decode.generate_greedy(model, prompt, 24)
    assert cached.shape == (3, 24)
    assert torch.equal(cached, decode.generate_uncached(model, prompt, 24))
    # the tokens are the model's own: a cache that ignored the prompt would not reproduce them
    assert not torch.equal(cached, decode.generate_greedy(model, prompt.flip(1), 24))


def test_generation_stops_once_every_row_has_a_stop_id():
    model = _model([])
    prompt = torch.randint(0, 256, (2, 20))
    free = decode.generate_greedy(model, prompt, 12)
    stop = int(free[0, 3])

    def first(row):  # the step a row first produces `stop` (11: never, so it runs to the end)
        hits = (free[row] == stop).nonzero()
        return int(hits[0]) if len(hits) else 11
    last_needed = max(first(0), first(1))
    stopped = decode.generate_greedy(model, prompt, 12, stop_ids=(stop,))
    assert stopped.shape[1] == last_needed + 1 and torch.equal(stopped, free[:, :last_needed + 1])
    assert torch.equal(stopped, decode.generate_uncached(model, prompt, 12, stop_ids=(stop,)))


def test_a_cache_refuses_what_does_not_fit():
    model = _model([])
    cache = decode.new_cache(model, 1, 8)
    with pytest.raises(ValueError, match="does not fit a cache of 8"):
        decode.prefill(model, torch.zeros(1, 9, dtype=torch.long), cache)
    decode.prefill(model, torch.zeros(1, 6, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="exceed the cache's 8"):
        decode.extend(model, torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="cannot rewind"):
        cache.rewind(7)


def _cp_generate(rank, world, overrides, prompt, steps):
    """One cp rank: the eval's context-parallel model (ring attention, latent ring for MLA), greedy decode."""
    from eval.model_io import ContextParallelLM, eval_dims
    from moe_lc.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    cfg = load_config(RECIPE, overrides, check=False)
    dims = eval_dims(cfg, torch.device("cpu"))
    model = ContextParallelLM(parallelize(_model(overrides), dims).module, dims).eval()
    cache = decode.new_cache(model, prompt.shape[0], prompt.shape[1] + steps)
    tokens = decode.greedy_from(model, decode.prefill(model, prompt, cache), cache, steps)
    return {"tokens": tokens, "gathered_from": cache.gathered_from_cp,
            "cache": {k: t.clone() for k, t in cache.layers["0"].read(cache.length).items()}}


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_context_parallel_decode_equals_one_process(name):
    """cp 2: a 37-token prompt (padded to 40 for the ring, the padding cut from the gathered cache) gives
    every rank the single process's cache and greedy tokens."""
    overrides = MODELS[name]
    prompt = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(5))
    one = _model(overrides)
    want = decode.generate_uncached(one, prompt, 16)
    ref_cache = decode.new_cache(one, 2, 37 + 16)
    decode.greedy_from(one, decode.prefill(one, prompt, ref_cache), ref_cache, 16)
    for rank in run_workers(_cp_generate, 2, overrides, prompt, 16, timeout_s=240):
        assert rank["gathered_from"] == 2
        assert torch.equal(rank["tokens"], want)
        for key, tensor in ref_cache.layers["0"].read(ref_cache.length).items():
            torch.testing.assert_close(rank["cache"][key], tensor, rtol=1e-5, atol=1e-5)
