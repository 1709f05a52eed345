"""DeepSeek Sparse Attention's ops on one device against brute-force references: the exact top-k, sparse
attention over the selection, and the indexer's KL loss of both training stages (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from moe_lc.ops import dsa_ring, dsa_warmup
from moe_lc.ops.documents import Documents
from moe_lc.ops.dsa_attention import IndexerKLSparse, SparseLatentAttention, selected_probs, split_wkv
from moe_lc.ops.dsa_ring import OneRank, RingLayout, select
from moe_lc.ops.dsa_select import key_positions, key_scores, merge_topk, order_keys, visible
from moe_lc.ops.dsa_warmup import IndexerKLDense, head_lse

B, S, G, E, H = 2, 48, 3, 8, 4
DN, DR, C, DV = 6, 4, 8, 5  # MLA: nope and rope dims of a query head, the latent rank, the value dim


def inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return dict(qi=r(B, S, G, E), w=r(B, S, G), ki=r(B, S, E), q=r(B, S, H, DN + DR), kv=r(B, S, C + DR),
                wkv=r(H * (DN + DV), C) * 0.5)


def decompressed(q, kv, wkv):
    """MLA's keys and values per head from the latent rows: k_h = [W_UK_h c, k_r], v_h = W_UV_h c."""
    w_uk, w_uv = split_wkv(wkv, H, DN)
    c, k_r = kv[..., :C], kv[..., C:]
    k = torch.cat([torch.einsum("hnc,bsc->bshn", w_uk, c), k_r[:, :, None].expand(B, S, H, DR)], -1)
    return k, torch.einsum("hvc,bsc->bshv", w_uv, c)


def dense_mask(docs=None):
    pos = torch.arange(S)
    doc = RingLayout.one_device(S, docs).doc_ids(pos)
    return visible(pos, pos, doc, doc).expand(B, S, S)


def brute_topk(I, mask, k):
    """Per query: visible keys sorted by (score desc, position asc), the first k (padded with -1)."""
    out = torch.full((B, S, k), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(S):
            keys = [s for s in range(S) if mask[b, t, s]]
            keys.sort(key=lambda s: (-float(I[b, t, s]), s))
            out[b, t, :min(k, len(keys))] = torch.tensor(keys[:k])
    return out


def indexer_dense(qi, w, ki, scale):
    return torch.einsum("bqg,bqgk->bqk", w, (torch.einsum("bqge,bke->bqgk", qi, ki) * scale).relu())


DOCS = Documents([[20, 28], [5, 30, 13]], S)


@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
@pytest.mark.parametrize("tiles", [(4096, 4096), (7, 5)], ids=["one-tile", "tiles"])
def test_selection_is_the_exact_topk_with_ties_broken_by_position(monkeypatch, docs, tiles):
    monkeypatch.setattr(dsa_ring, "QUERY_TILE", tiles[0])
    monkeypatch.setattr(dsa_ring, "KEY_TILE", tiles[1])
    x = inputs(dtype=torch.float32)
    x["qi"][:, :, :, :] = x["qi"].abs() * (torch.rand(B, S, G, 1) > 0.5)  # many exact zeros: ties
    k = 10
    sel, scores = select(OneRank(), RingLayout.one_device(S, docs), x["qi"], x["w"], x["ki"], 0.5, k)
    mask = dense_mask(docs)
    I = indexer_dense(x["qi"].double(), x["w"].double(), x["ki"].double(), 0.5).float()
    want = brute_topk(I, mask, k)
    assert sel.positions.dtype == torch.int32 and torch.equal(sel.positions.long(), want)
    valid = want >= 0
    assert torch.allclose(scores[valid], torch.gather(I, -1, want.clamp_min(0))[valid], rtol=1e-5, atol=1e-6)
    assert bool((I == 0).sum() > 100), "the case must really have ties"


def test_order_keys_sorts_floats_then_positions():
    scores = torch.tensor([[[1.5, -0.0, 0.0, -2.0, float("-inf"), 3e-39, -3e-39, 2.0]]])
    pos = torch.arange(8)
    keys = order_keys(scores, pos, torch.ones(1, 1, 8, dtype=torch.bool))
    got = key_positions(merge_topk(None, keys, 8))[0, 0].tolist()
    assert got == [7, 0, 5, 1, 2, 6, 3, 4]  # 2.0, 1.5, 3e-39, (-0.0 == 0.0 by position), -3e-39, -2, -inf
    assert key_scores(keys)[0, 0].tolist() == [1.5, 0.0, 0.0, -2.0, float("-inf"), scores[0, 0, 5].item(),
                                                scores[0, 0, 6].item(), 2.0]


def reference_sparse(q, kv, wkv, positions, scale):
    """MLA in its decompressed form, dense, masked to the selected positions."""
    positions = positions.long()
    allowed = torch.zeros(B, S, S).scatter_add_(-1, positions.clamp_min(0), (positions >= 0).float()) > 0
    k, v = decompressed(q, kv, wkv)
    s = torch.einsum("bqhd,bkhd->bqhk", q, k) * scale
    s = s.masked_fill(~allowed[:, :, None, :], float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("bqhk,bkhd->bqhd", p, v), torch.logsumexp(s, -1).transpose(1, 2), p


@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
def test_sparse_attention_and_its_gradients_equal_masked_dense_attention(docs):
    x = inputs(dtype=torch.float32)
    layout = RingLayout.one_device(S, docs)
    sel, _ = select(OneRank(), layout, x["qi"], x["w"], x["ki"], 0.5, 9)
    q, kv, wkv = (x[n].requires_grad_() for n in ("q", "kv", "wkv"))
    out, lse = SparseLatentAttention.apply(q, kv, wkv, sel, 0.3, DN, OneRank())
    q2, kv2, wkv2 = (x[n].detach().double().requires_grad_() for n in ("q", "kv", "wkv"))
    ref, ref_lse, _ = reference_sparse(q2, kv2, wkv2, sel.positions, 0.3)
    close = lambda a, b: torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5)
    assert out.shape == (B, S, H, DV) and close(out, ref) and close(lse, ref_lse)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    (ref * dout.double()).sum().backward()
    assert close(q.grad, q2.grad) and close(kv.grad, kv2.grad) and close(wkv.grad, wkv2.grad)


def test_sparse_stage_kl_and_gradients_equal_autograd_reference():
    x = inputs()
    layout = RingLayout.one_device(S)
    sel, scores = select(OneRank(), layout, x["qi"], x["w"], x["ki"], 0.5, 9)
    out, lse = SparseLatentAttention.apply(x["q"], x["kv"], x["wkv"], sel, 0.3, DN, OneRank())
    p = selected_probs(OneRank(), x["q"], x["kv"], x["wkv"], DN, lse, sel, 0.3, lambda t: t)
    _, _, P = reference_sparse(x["q"], x["kv"], x["wkv"], sel.positions, 0.3)
    positions = sel.positions.long()
    p_ref = torch.gather(P.sum(2) / H, -1, positions.clamp_min(0)).masked_fill(~sel.valid, 0.0)
    assert torch.allclose(p.double(), p_ref, atol=1e-6)
    qi, w, ki = (x[n].clone().requires_grad_() for n in ("qi", "w", "ki"))
    loss = IndexerKLSparse.apply(qi, w, ki, sel, scores, p, 0.5, 0.25, OneRank())
    qi2, w2, ki2 = (x[n].clone().requires_grad_() for n in ("qi", "w", "ki"))
    I = torch.gather(indexer_dense(qi2, w2, ki2, 0.5), -1, positions.clamp_min(0))
    log_q = torch.log_softmax(I.masked_fill(~sel.valid, float("-inf")), -1)
    pd = p.double()
    ref = 0.25 * torch.where(pd > 0, pd * (pd.clamp_min(1e-300).log() - log_q), 0.0).sum()
    assert torch.allclose(loss.double(), ref, rtol=1e-5)
    loss.backward()
    ref.backward()
    for a, b in ((qi, qi2), (w, w2), (ki, ki2)):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), (a.grad - b.grad).abs().max()


@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
def test_warmup_kl_mass_and_gradients_equal_dense_reference(monkeypatch, docs):
    monkeypatch.setattr(dsa_warmup, "KEY_TILE", 7)
    monkeypatch.setattr(dsa_ring, "TILE_ELEMS", 11 * H * 7)  # 11 query rows a tile
    x = inputs()
    layout = RingLayout.one_device(S, docs)
    mask = dense_mask(docs)
    sel, _ = select(OneRank(), layout, x["qi"], x["w"], x["ki"], 0.5, 6)
    w_uk, _ = split_wkv(x["wkv"], H, DN)
    lse = head_lse(OneRank(), layout, x["q"], x["kv"], w_uk, 0.3)
    k, _ = decompressed(x["q"], x["kv"], x["wkv"])
    s = (torch.einsum("bqhd,bkhd->bqhk", x["q"], k) * 0.3).masked_fill(~mask[:, :, None], float("-inf"))
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1).transpose(1, 2), atol=1e-6)
    qi, w, ki = (x[n].clone().requires_grad_() for n in ("qi", "w", "ki"))
    loss, stats = IndexerKLDense.apply(qi, w, ki, x["q"], x["kv"], w_uk, lse, layout, 0.3, 0.5, 0.5, OneRank(),
                                       lambda t: t, H, sel)
    qi2, w2, ki2 = (x[n].clone().requires_grad_() for n in ("qi", "w", "ki"))
    p = torch.softmax(s, -1).sum(2) / H
    log_q = torch.log_softmax(indexer_dense(qi2, w2, ki2, 0.5).masked_fill(~mask, float("-inf")), -1)
    kl = torch.where(p > 0, p * (p.clamp_min(1e-300).log() - log_q), 0.0).sum()
    assert torch.allclose(loss.double(), 0.5 * kl, rtol=1e-5)
    chosen = torch.zeros(B, S, S, dtype=torch.float64).scatter_add_(-1, sel.positions.long().clamp_min(0),
                                                                    sel.valid.double())
    assert torch.allclose(stats[1], (p * chosen).sum(), rtol=1e-5)
    loss.backward()
    (0.5 * kl).backward()
    for a, b in ((qi, qi2), (w, w2), (ki, ki2)):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)
