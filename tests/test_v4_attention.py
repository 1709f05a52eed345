"""DeepSeek-V4's attention (moe_lc/model/v4_*.py) against transformers' DeepseekV4Attention with the same
weights, for each layer type: a tiny config (hidden 64, 4 heads of 32, RoPE on the last 8, window 8, CSA every
4 tokens, HCA every 8, top-3 of the CSA entries, 2 output groups, YaRN on the compress rope past its original
16) at S = 42, so the window, partial windows, entry boundaries and the indexer's cut all occur; outputs
within 1e-5 (fp32) and the gradients of the input and of every parameter. Plus the config's rules, the
indexer's tie order and exact causality of the compressed entries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.model.v4_attention import V4Attention

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

B, S, DIM, HEADS = 2, 42, 64, 4
TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
TINY = V4AttentionConfig(head_dim=32, q_lora_rank=24, rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=8,
                         csa_compress_rate=4, hca_compress_rate=8, index_n_heads=4, index_head_dim=16, index_topk=3,
                         yarn_factor=4.0, yarn_original_seq_len=16, layer_types=list(TYPES))


def hf_config(cfg: V4AttentionConfig) -> DeepseekV4Config:
    c = DeepseekV4Config(
        hidden_size=DIM, num_attention_heads=HEADS, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, sliding_window=cfg.sliding_window,
        compress_rates={"compressed_sparse_attention": cfg.csa_compress_rate,
                        "heavily_compressed_attention": cfg.hca_compress_rate},
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, num_hidden_layers=3, layer_types=list(TYPES),
        vocab_size=64, rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        max_position_embeddings=int(cfg.yarn_original_seq_len * cfg.yarn_factor), rms_norm_eps=cfg.eps,
        rope_parameters={"rope_type": "yarn", "factor": cfg.yarn_factor, "beta_fast": cfg.yarn_beta_fast,
                         "beta_slow": cfg.yarn_beta_slow, "original_max_position_embeddings": cfg.yarn_original_seq_len})
    c._attn_implementation = "eager"
    return c


# transformers' self_attn names -> ours: each of ours is one of theirs, or several concatenated along rows
HF_TO_OURS = {
    "wa.weight": ["q_a_proj.weight", "kv_proj.weight"], "q_norm.weight": ["q_a_norm.weight"],
    "wq_b.weight": ["q_b_proj.weight"], "kv_norm.weight": ["kv_norm.weight"], "wo_a.weight": ["o_a_proj.weight"],
    "wo.weight": ["o_b_proj.weight"], "sinks": ["sinks"],
    "compressor.wkv_gate.weight": ["compressor.kv_proj.weight", "compressor.gate_proj.weight"],
    "compressor.position_bias": ["compressor.position_bias"], "compressor.kv_norm.weight": ["compressor.kv_norm.weight"],
    "indexer.compressor.wkv_gate.weight": ["compressor.indexer.kv_proj.weight", "compressor.indexer.gate_proj.weight"],
    "indexer.compressor.position_bias": ["compressor.indexer.position_bias"],
    "indexer.compressor.kv_norm.weight": ["compressor.indexer.kv_norm.weight"],
    "indexer.wq_b.weight": ["compressor.indexer.q_b_proj.weight"],
    "indexer.weights_proj.weight": ["compressor.indexer.scorer.weights_proj.weight"],
}


def pair(layer_type: str, cfg: V4AttentionConfig = TINY, seed: int = 0):
    """(transformers' module with random weights, ours holding the same values)."""
    torch.manual_seed(seed)
    theirs = hf_v4.DeepseekV4Attention(hf_config(cfg), TYPES.index(layer_type))
    with torch.no_grad():
        for name, p in theirs.named_parameters():  # nonzero sinks, biases and norm weights: every path counts
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 or "position_bias" in name else p.shape[-1] ** -0.5))
            if "norm" in name:
                p.add_(1.0)
    ours = V4Attention(DIM, HEADS, cfg, layer_type)
    hf = dict(theirs.named_parameters())
    state = {k: torch.cat([hf[n] for n in names]).view_as(getattr_path(ours, k))
             for k, names in HF_TO_OURS.items() if all(n in hf for n in names)}
    assert set(state) == {k for k, _ in ours.named_parameters()}
    ours.load_state_dict(state, strict=False)
    return theirs, ours


def getattr_path(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def hf_forward(theirs, x, positions, picks=None):
    """transformers' attention on x (B, S, D) with its model's mask and rope tables; `picks`: our indexer's
    selection, handed to it in place of its own (forward hook) once it is checked to be a top-k as well."""
    cfg = theirs.config
    pos = positions[None].expand(x.shape[0], -1)
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    tables = {t: rotary(x, pos, layer_type=t) for t in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=pos)
    hook = None
    if picks is not None:
        hook = theirs.compressor.indexer.register_forward_hook(lambda m, i, out: picks)
    try:
        return theirs(x, tables, pos, mask)[0]
    finally:
        if hook is not None:
            hook.remove()


def our_picks(ours, x, positions):
    """Our indexer's selection (B, S, k) and its scores (B, S, n)."""
    with torch.no_grad():
        c_q = ours.q_norm(ours.wa(x)[..., :ours.q_lora_rank])
        return ours.indexer(x, c_q, positions, ours.rope), ours.indexer.scores(x, c_q, positions, ours.rope)


@pytest.mark.parametrize("layer_type", TYPES)
def test_matches_transformers_outputs_and_gradients(layer_type):
    theirs, ours = pair(layer_type)
    ours.index_loss_weight = 0.0  # the attention alone, as transformers' (the indexer's loss: test_v4_index_loss.py)
    x = torch.randn(B, S, DIM)
    positions = torch.arange(S)
    picks = None
    if layer_type == "compressed_sparse_attention":
        picks, scores = our_picks(ours, x, positions)
        hf_picks = theirs.compressor.indexer(x, theirs.q_a_norm(theirs.q_a_proj(x)), positions[None].expand(B, -1),
                                             None, 1)
        # both are top-k of the same scores: the same multiset of selected scores for every query
        def chosen(sel):
            return torch.where(sel >= 0, scores.gather(-1, sel.clamp_min(0)), float("-inf")).sort(-1).values
        torch.testing.assert_close(chosen(picks), chosen(hf_picks), rtol=1e-6, atol=1e-6)
        assert (picks >= 0).sum(-1).max() == TINY.index_topk and (picks < 0).any()  # a real cut, and short rows
        ranked = scores.sort(-1, descending=True).values  # ties across the cut (ReLU's zeros): order matters
        k = TINY.index_topk
        assert ((ranked[..., k - 1] == ranked[..., k]) & ranked[..., k].isfinite()).any()
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_hf = ours(x_ours, positions), hf_forward(theirs, x_hf, positions, picks)
    assert (y_ours - y_hf).abs().max() <= 1e-5 * y_hf.abs().max()
    w = torch.randn_like(y_hf)
    (y_ours * w).sum().backward()
    (y_hf * w).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-5, atol=1e-5 * x_hf.grad.abs().max().item())
    hf = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        names = HF_TO_OURS[name]
        if name.startswith("indexer."):  # a top-k is an integer choice: no gradient reaches the indexer in either
            assert p.grad is None and all(hf[n].grad is None for n in names), name
            continue
        want = torch.cat([hf[n].grad for n in names]).view_as(p)
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)


def test_indexer_ties_go_to_the_earlier_entry():
    """All scores equal (weights_proj = 0): each query keeps its k earliest visible entries, and a query that
    sees fewer keeps all of them (-1 in the other slots)."""
    _, ours = pair("compressed_sparse_attention")
    with torch.no_grad():
        ours.indexer.weights_proj.weight.zero_()
    positions = torch.arange(S)
    picks, _ = our_picks(ours, torch.randn(B, S, DIM), positions)
    k, m = TINY.index_topk, TINY.csa_compress_rate
    for t in range(S):
        seen = (t + 1) // m
        want = list(range(min(k, seen))) + [-1] * (k - min(k, seen))
        assert picks[:, t].tolist() == [want] * B, t


@pytest.mark.parametrize("layer_type", TYPES[1:])
def test_compressed_entries_are_causal(layer_type):
    """Changing the tokens from position p on leaves every output before p unchanged (at a window boundary,
    in the middle of an entry's window, and at its last token)."""
    _, ours = pair(layer_type)
    x = torch.randn(1, S, DIM)
    positions = torch.arange(S)
    y = ours(x, positions)
    for p in (8, 13, 23, 31):
        x2 = x.clone()
        x2[:, p:] = torch.randn(1, S - p, DIM)
        y2 = ours(x2, positions)
        assert torch.equal(y[:, :p], y2[:, :p]), p
        assert not torch.allclose(y[:, p:], y2[:, p:]), p


def test_default_config_is_v4_flash_and_valid():
    c = V4AttentionConfig()
    assert (c.head_dim, c.q_lora_rank, c.rope_head_dim, c.o_groups, c.o_lora_rank, c.sliding_window) == \
        (512, 1024, 64, 8, 1024, 128)
    assert (c.csa_compress_rate, c.hca_compress_rate, c.index_n_heads, c.index_head_dim, c.index_topk) == \
        (4, 128, 64, 128, 512)
    assert c.errors(n_heads=64, n_layers=43) == []
    types = c.layer_types_for(43)
    assert types[:4] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention"] and len(types) == 43


def test_config_errors_name_field_value_and_rule():
    bad = dataclasses.replace(TINY, rope_head_dim=7, o_groups=3, yarn_factor=0.5,
                              layer_types=["sliding_attention", "dense"])
    e = bad.errors(n_heads=4, n_layers=3)
    assert "model.v4_attention.rope_head_dim=7 must be even (RoPE rotates pairs)" in e
    assert "model.v4_attention.o_groups=3 must divide model.n_heads=4 (whole heads per group)" in e
    assert "model.v4_attention.yarn_factor=0.5 must be >= 1 (1 = no scaling)" in e
    assert any("layer_types has ['dense']" in line for line in e)
    assert any("layer_types has 2 entries: must be model.n_layers=3" in line for line in e)
    assert dataclasses.replace(TINY, index_topk=0).errors(4, 3) == ["model.v4_attention.index_topk=0 must be > 0"]
    with pytest.raises(ValueError, match="layer_type='csa' must be one of"):
        V4Attention(DIM, HEADS, TINY, "csa")


# ------------------------------------------------------------------------------------------- counts


@pytest.mark.parametrize("layer_type", TYPES)
def test_counts_match_the_module(layer_type):
    """Parameters as built; core FLOPs from the keys each query really reads (window mask and the readable
    entries the module computes); the reference core's saved bytes as autograd keeps them."""
    from moe_lc.model.v4_core import sink_attention, window_mask
    from moe_lc.model.v4_counting import reference_core_saved_bytes, v4_attention_flops, v4_attention_params

    _, ours = pair(layer_type)
    count = v4_attention_params(TINY, DIM, HEADS, layer_type)
    params = dict(ours.named_parameters())
    assert count["total"] == sum(p.numel() for p in params.values())
    assert count["vector"] == sum(p.numel() for n, p in params.items() if p.dim() == 1 or "position_bias" in n)
    x, positions = torch.randn(1, S, DIM), torch.arange(S)
    with torch.no_grad():
        c_q = ours.q_norm(ours.wa(x)[..., :ours.q_lora_rank])
        entries, readable, _ = ours.compressed(x, c_q, positions)
    nb = -(-S // TINY.sliding_window)
    window = window_mask(nb, TINY.sliding_window, "cpu").sum(-1).flatten()[:S]  # keys each query sees
    keys = window.sum().item() + (0 if readable is None else readable.sum().item())
    flops = v4_attention_flops(TINY, DIM, HEADS, layer_type, S)
    assert flops["core"] == pytest.approx(4 * TINY.head_dim * HEADS * keys / S, rel=1e-12)
    assert flops["matmul"] == 2 * count["matmul"]
    assert (flops["indexer"] > 0) == (layer_type == "compressed_sparse_attention")

    q = torch.randn(1, S, HEADS, TINY.head_dim, requires_grad=True)
    kv = torch.randn(1, S, TINY.head_dim, requires_grad=True)
    ents = None if entries is None else entries.clone().requires_grad_()
    kept = {}

    def pack(t):
        kept[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sink_attention(q, kv, TINY.sliding_window, 0.1, ours.sinks, ents, readable)
    kept.pop(ours.sinks.untyped_storage()._cdata, None)  # a parameter, not an activation
    assert sum(kept.values()) / S == reference_core_saved_bytes(TINY, HEADS, layer_type, S)
