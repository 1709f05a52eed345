"""The CSA indexer's tiled selection (moe_lc/ops/v4_index_topk.py) against V4Indexer's scores + pick: the same
entries in the same order and the same scores, bit for bit, over many tilings, with quantized inputs so that
ties (and ReLU's zeros) are common, queries that see fewer than k entries, B = 2 with per-row positions (a CP
chunk's offset); the scores at the picked entries with their gradients against autograd through the full score
matrix (bit for bit where the inputs make every score exact; to fp32 rounding otherwise, a GEMM's rounding
depending on the tile's width); the attention's mass at the picked entries against v4_index_loss.picked_mass."""

from __future__ import annotations

import pytest
import torch

from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.model.v4_compressor import visible_entries
from moe_lc.model.v4_core import sink_attention
from moe_lc.model.v4_index_loss import picked_mass as reference_mass
from moe_lc.model.v4_indexer import V4Indexer
from moe_lc.ops.dsa_select import indexer_scores, key_positions, order_keys
from moe_lc.ops.v4_index_topk import picked_index_scores, tiled_index_topk
from moe_lc.ops.v4_sparse_core import picked_mass, sparse_sink_attention

B, S, G, E, M = 2, 45, 3, 8, 4
N = S // M  # 11 entries


def indexer(k: int) -> V4Indexer:
    cfg = V4AttentionConfig(head_dim=16, q_lora_rank=8, rope_head_dim=4, index_n_heads=G, index_head_dim=E,
                            index_topk=k, csa_compress_rate=M)
    return V4Indexer(16, cfg)


def inputs(quantized: bool, seed: int = 0):
    """(q_I, w, keys, positions (B, S): row 1 starts at 8, as a later CP chunk would). Quantized: small integers
    and a power-of-two scale, so every score is exact and ties are common."""
    g = torch.Generator().manual_seed(seed)
    if quantized:
        q = torch.randint(-2, 3, (B, S, G, E), generator=g).float()
        w = torch.randint(0, 3, (B, S, G), generator=g).float()
        keys = torch.randint(-2, 3, (B, N, E), generator=g).float()
    else:
        q, w, keys = torch.randn(B, S, G, E, generator=g), torch.rand(B, S, G, generator=g), \
            torch.randn(B, N, E, generator=g)
    positions = torch.stack([torch.arange(S), torch.arange(S) + 8])
    return q, w, keys, positions


def reference(q, w, keys, positions, k, scale):
    """(picked, their scores, the full masked scores) as V4Indexer.scores and .pick make them."""
    ix = indexer(k)
    full = indexer_scores(q, w, keys, scale).masked_fill(~ix.seen(positions, N, B), float("-inf"))
    picked = ix.pick(full, positions)
    return picked, full.gather(-1, picked.clamp_min(0)).masked_fill(picked < 0, float("-inf")), full


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("k", [1, 4, 11, 20])
@pytest.mark.parametrize("tiles", [(7, 3), (5, 4), (64, 64), (None, None)])
def test_picks_equal_v4_indexer(quantized, k, tiles):
    q, w, keys, positions = inputs(quantized)
    scale = 0.25 if quantized else E ** -0.5
    ref_picked, ref_scores, full = reference(q, w, keys, positions, k, scale)
    picked, scores = tiled_index_topk(q, w, keys, scale, visible_entries(positions, M), k,
                                      query_tile=tiles[0], entry_tile=tiles[1])
    assert picked.shape == (B, S, min(k, N)) and picked.dtype == torch.int64
    assert torch.equal(picked, ref_picked)
    assert torch.equal(scores.isinf(), ref_scores.isinf())
    if quantized:  # exact arithmetic: the same bits
        assert torch.equal(scores, ref_scores)
    else:  # a GEMM's rounding may depend on the tile's width: fp32 rounding apart
        torch.testing.assert_close(scores, ref_scores, rtol=2e-6, atol=2e-6)
    if quantized:  # the inputs make ties: the test exercises the tie rule, not only distinct scores
        row = full[0, -1][torch.isfinite(full[0, -1])]
        assert row.unique().numel() < row.numel()
    assert (picked[0, :M - 1] == -1).all()  # queries that see no entry yet
    partial = (picked >= 0).any(-1) & (picked < 0).any(-1)  # queries that see some, fewer than k
    assert bool(partial.any()) == (1 < k)


@pytest.mark.parametrize("tiles", [(7, 3), (None, None)])
def test_packed_document_ranges(tiles):
    """visible as [first, stop) ranges (documents of 13, 9, 15 and 20, 17 rows: entries w < (p + 1) // m of the
    query's own document, at the document's run of the global order) = V4Indexer.pick's order over that mask."""
    q, w, keys, _ = inputs(True, seed=6)
    ranges = torch.zeros(B, S, 2, dtype=torch.int64)
    for b, lengths in enumerate(([13, 9, 15, 8], [20, 17, 8])):
        row, first = 0, 0
        for length in lengths:
            ranges[b, row:row + length, 0] = first
            ranges[b, row:row + length, 1] = first + (torch.arange(length) + 1) // M
            row, first = row + length, first + length // M
    ar = torch.arange(N)
    seen = (ar >= ranges[..., :1]) & (ar < ranges[..., 1:])
    full = indexer_scores(q, w, keys, 0.25).masked_fill(~seen, float("-inf"))
    ref = key_positions(order_keys(full, ar, seen).topk(4, dim=-1, sorted=True).values)
    picked, scores = tiled_index_topk(q, w, keys, 0.25, ranges, 4, query_tile=tiles[0], entry_tile=tiles[1])
    assert torch.equal(picked, ref)
    assert torch.equal(scores, full.gather(-1, ref.clamp_min(0)).masked_fill(ref < 0, float("-inf")))
    assert (picked[0, 13:16] == -1).all() and picked[0, 16].tolist() == [3, -1, -1, -1]  # a new document


def test_no_entries_or_no_topk():
    q, w, keys, positions = inputs(False)
    vis = visible_entries(positions, M)
    picked, scores = tiled_index_topk(q, w, keys[:, :0], 1.0, vis, 4)
    assert picked.shape == (B, S, 0) and scores.shape == (B, S, 0)
    picked, _ = tiled_index_topk(q, w, keys, 1.0, vis, 0)
    assert picked.shape == (B, S, 0)


def test_picked_scores_and_gradients_equal_full_matrix():
    """picked_index_scores = the full score matrix gathered at the picks; gradients of q_I, w and the keys
    through a KL-like loss the same as autograd through indexer_scores."""
    q, w, keys, positions = inputs(False, seed=3)
    scale = E ** -0.5
    picked, _, _ = reference(q, w, keys, positions, 4, scale)
    g = torch.Generator().manual_seed(4)
    weight = torch.rand(B, S, picked.shape[-1], generator=g)
    results = []
    for tiled in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, w, keys)]
        if tiled:
            sc = picked_index_scores(*leaves, picked, scale, query_tile=7)
        else:
            sc = indexer_scores(*leaves, scale).gather(-1, picked.clamp_min(0)).masked_fill(picked < 0,
                                                                                           float("-inf"))
        loss = (torch.log_softmax(sc.masked_fill(~(picked >= 0).any(-1, keepdim=True), 0.0), -1)
                .masked_fill(picked < 0, 0.0) * weight).sum()
        results.append((sc, torch.autograd.grad(loss, leaves)))
    (sc, grads), (r_sc, r_grads) = results
    torch.testing.assert_close(sc, r_sc, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, r_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_picked_mass_equals_index_loss_target():
    """v4_sparse_core.picked_mass with the tiled core's lse = v4_index_loss.picked_mass with the reference's."""
    g = torch.Generator().manual_seed(5)
    H, D = 2, 16
    q, kv = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, D, generator=g)
    entries, sinks = torch.randn(B, N, D, generator=g), torch.randn(H, generator=g)
    picked, _ = tiled_index_topk(*inputs(False)[:3], E ** -0.5, visible_entries(inputs(False)[3], M), 4)
    readable = torch.zeros(B, S, N + 1, dtype=torch.bool).scatter_(-1, torch.where(picked >= 0, picked, N), True)
    _, r_lse = sink_attention(q, kv, 8, D ** -0.5, sinks, entries, readable[..., :N], return_lse=True)
    _, lse = sparse_sink_attention(q, kv, 8, D ** -0.5, sinks, entries, picked, query_tile=6)
    ref = reference_mass(q, entries, r_lse, picked, D ** -0.5)
    for tile in (5, None):
        torch.testing.assert_close(picked_mass(q, entries, lse, picked, D ** -0.5, query_tile=tile), ref,
                                   rtol=1e-5, atol=1e-6)
    assert (ref[picked < 0] == 0).all() and (ref[picked >= 0] > 0).all()
