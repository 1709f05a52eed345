"""DeepSeek-V4's CSA indexer loss (moe_lc/model/v4_index_loss.py): KL from the attention's head-summed probabilities
of the picked compressed entries to the indexer's softmax over them, the indexer's input detached (V3.2's sparse
stage). Held to a direct autograd reference written here from the formula (a dense softmax over every window key,
readable entry and the sink; a loop over queries for the KL), on a CSA layer whose top-k cuts (S = 42, 10
entries, top-3) with every parameter off its init (sinks and position biases included): the indexer's parameter
gradients equal the reference's within 1e-5, the rest of the module's gradients are those of weight 0 bit for bit,
and the step's ForwardStats books the KL once."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.v4_attention import V4Attention, unweighted_rms_norm
from moe_lc.model.v4_rope import apply_tail_rope

B, S, DIM, HEADS = 2, 42, 64, 4
CFG = V4AttentionConfig(head_dim=32, q_lora_rank=24, rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=8,
                        csa_compress_rate=4, hca_compress_rate=8, index_n_heads=4, index_head_dim=16, index_topk=3,
                        yarn_factor=1.0)


def csa_layer(weight: float) -> V4Attention:
    torch.manual_seed(0)
    attn = V4Attention(DIM, HEADS, dataclasses.replace(CFG, index_loss_weight=weight), "compressed_sparse_attention")
    for p in attn.parameters():
        nn.init.normal_(p, std=0.3)
    return attn


def reference_loss(attn: V4Attention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """weight / (B S) * sum_t KL(p_t || softmax(I_t over S_t)), from the formula."""
    d, W, n_heads = attn.head_dim, attn.window, attn.n_heads
    with torch.no_grad():
        c_q, kv = attn.wa(x).split([attn.q_lora_rank, d], dim=-1)
        c_q, kv = attn.q_norm(c_q), attn.kv_norm(kv)
        q = attn.wq_b(c_q).view(B, S, n_heads, d)
        cos, sin = attn.rope(positions)
        q = apply_tail_rope(unweighted_rms_norm(q, attn.eps), cos, sin).float()
        k = apply_tail_rope(kv.view(B, S, 1, d), cos, sin).view(B, S, d).float()
        entries = attn.compressor(x, attn.rope).float()
        picked = attn.indexer(x, c_q, positions, attn.rope)
        n = entries.shape[1]
        t = torch.arange(S)
        window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - W)  # (S, S)
        readable = torch.zeros(B, S, n, dtype=torch.bool)
        for b in range(B):
            for i in range(S):
                readable[b, i, picked[b, i][picked[b, i] >= 0]] = True
        l_win = torch.einsum("bshd,bjd->bshj", q, k) * attn.softmax_scale
        l_win = l_win.masked_fill(~window[None, :, None, :], float("-inf"))
        l_ent = torch.einsum("bshd,bnd->bshn", q, entries) * attn.softmax_scale
        l_ent = l_ent.masked_fill(~readable[:, :, None, :], float("-inf"))
        sink = attn.sinks.float().view(1, 1, n_heads, 1).expand(B, S, n_heads, 1)
        probs = torch.cat([l_win, l_ent, sink], dim=-1).softmax(-1)[..., S:S + n].sum(dim=2)  # (B, S, n)
    scores = attn.indexer.scores(x, c_q, positions, attn.rope)  # grad to the indexer's parameters only
    total = scores.new_zeros(())
    for b in range(B):
        for i in range(S):
            sel = picked[b, i][picked[b, i] >= 0]
            if len(sel) == 0:
                continue
            p = probs[b, i, sel] / probs[b, i, sel].sum()
            total = total + (p * (p.log() - torch.log_softmax(scores[b, i, sel], dim=-1))).sum()
    return attn.index_loss_weight * total / (B * S)


def run(attn: V4Attention, x: torch.Tensor, positions: torch.Tensor, w: torch.Tensor, stats=None) -> dict:
    attn.zero_grad()
    x = x.clone().requires_grad_()
    (attn(x, positions, stats=stats) * w).sum().backward()
    grads = {name: p.grad for name, p in attn.named_parameters()}
    grads["<x>"] = x.grad
    return grads


def test_indexer_gradient_equals_a_direct_reference():
    x, positions = torch.randn(B, S, DIM), torch.arange(S)
    ours = csa_layer(weight=0.7)
    w = torch.randn(B, S, DIM)
    stats = ForwardStats()
    got = run(ours, x, positions, w, stats)
    picked = ours.indexer(x, ours.q_norm(ours.wa(x)[..., :ours.q_lora_rank]), positions, ours.rope)
    assert (picked >= 0).sum(-1).max() == CFG.index_topk and (picked < 0).all(-1).any()  # a cut, and empty rows

    ref = csa_layer(weight=0.7)
    ref.zero_grad()
    loss = reference_loss(ref, x, positions)
    loss.backward()
    indexer = [name for name, _ in ours.named_parameters() if name.startswith("indexer.")]
    assert len(indexer) == 5  # its compressor (wkv_gate, position_bias, kv_norm), wq_b, weights_proj
    for name in indexer:
        want = dict(ref.named_parameters())[name].grad
        assert want is not None and want.abs().max() > 0, name
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)
    # booked in backward: the unweighted KL summed over queries that picked anything, and their count
    kl_sum, _, count = stats.dsa.tolist()
    assert abs(kl_sum - loss.item() * B * S / 0.7) <= 1e-5 * kl_sum
    assert count == (picked >= 0).any(-1).sum().item()


def test_the_loss_trains_the_indexer_only():
    """The indexer reads x and the query latent detached: every other gradient (the input's too) is weight 0's,
    bit for bit; with weight 0 (or in eval) the indexer gets none."""
    x, positions, w = torch.randn(B, S, DIM), torch.arange(S), torch.randn(B, S, DIM)
    with_loss, without = run(csa_layer(1.0), x, positions, w), run(csa_layer(0.0), x, positions, w)
    for name, grad in without.items():
        if name.startswith("indexer."):
            assert grad is None and with_loss[name] is not None, name
        else:
            assert torch.equal(grad, with_loss[name]), name
    attn = csa_layer(1.0).eval()
    attn(x.clone().requires_grad_(), positions).sum().backward()
    assert all(p.grad is None for p in attn.indexer.parameters())
