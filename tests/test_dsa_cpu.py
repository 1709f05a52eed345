"""DeepSeek Sparse Attention's CPU forms (moe_lc/ops/dsa_select_cpu.py, sparse_attention_cpu.py) against the
device forms they stand in for on a CPU (sparse_attention_cpu.ENABLED off): the same selection (ties,
documents, several sequences, every fallback of the floor), and the sparse attention, its head-summed
probabilities and the indexer loss's gradients to fp32 rounding, tiles and chunks made small so every edge
(padding, a row with no key, several chunks) is crossed. The scores are compared to fp32 rounding: at these
tiny dims (E = 8) the BLAS may round a dot product differently for another tile shape (at the bench's, E = 32,
they come out bit for bit)."""

from __future__ import annotations

import pytest
import torch

from moe_lc.ops import dsa_select_cpu, sparse_attention, sparse_attention_cpu
from moe_lc.ops.documents import Documents
from moe_lc.ops.dsa_attention import IndexerKLSparse, SparseLatentAttention, selected_probs, split_wkv
from moe_lc.ops.dsa_ring import OneRank, RingLayout, select

B, S, G, E, H = 2, 160, 3, 8, 4
DN, DR, C, DV = 6, 4, 8, 5
DOCS = Documents([[50, 70, 40], [5, 100, 55]], S)


def inputs(seed=0, zeros=0.5):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    qi = r(B, S, G, E) * (torch.rand(B, S, G, 1, generator=g) > zeros)  # exact-zero scores: ties to break
    return dict(qi=qi, w=r(B, S, G), ki=r(B, S, E), q=r(B, S, H, DN + DR), kv=r(B, S, C + DR),
                wkv=r(H * (DN + DV), C) * 0.5)


def both(monkeypatch, fn):
    """fn() with the CPU forms, then with the device forms."""
    got = fn()
    monkeypatch.setattr(sparse_attention_cpu, "ENABLED", False)
    want = fn()
    monkeypatch.setattr(sparse_attention_cpu, "ENABLED", True)
    return got, want


def close(a, b, tol=2e-6) -> bool:
    """fp32 agreement: within tol of the tensor's largest finite value (at least 1)."""
    return torch.allclose(a.double(), b.double(), rtol=0, atol=tol * max(1.0, float(b[b.isfinite()].abs().max())))


@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
@pytest.mark.parametrize("k", [9, 40])
@pytest.mark.parametrize("zeros", [0.0, 0.5, 0.95], ids=["no-ties", "ties", "mostly-ties"])
def test_cpu_selection_is_the_device_forms_bit_for_bit(monkeypatch, docs, k, zeros):
    monkeypatch.setattr(dsa_select_cpu, "ROWS", 7)
    monkeypatch.setattr(dsa_select_cpu, "KEY_CHUNK", 33)
    monkeypatch.setattr(dsa_select_cpu, "SAMPLE", 4)
    x = inputs(zeros=zeros)
    layout = RingLayout.one_device(S, docs)
    (sel, scores), (ref, ref_scores) = both(monkeypatch, lambda: select(OneRank(), layout, x["qi"], x["w"], x["ki"],
                                                                        0.5, k))
    assert sel.positions.dtype == torch.int32 and torch.equal(sel.positions, ref.positions)
    assert torch.equal(scores.isinf(), ref_scores.isinf())
    assert close(scores.nan_to_num(neginf=0), ref_scores.nan_to_num(neginf=0))


@pytest.mark.parametrize("margin, crowd", [(-3.0, 8), (3.5, 1)], ids=["floors-fall-back", "ties-crowd"])
def test_cpu_selection_fallbacks_keep_it_exact(monkeypatch, margin, crowd):
    """A floor set too high for some rows (negative margin: about half of them fall back to the looser floor)
    and ties crowding it (the whole rows' exact top-k) change nothing."""
    monkeypatch.setattr(dsa_select_cpu, "SAMPLE", 4)
    monkeypatch.setattr(dsa_select_cpu, "MARGIN", margin)
    monkeypatch.setattr(dsa_select_cpu, "CROWD", crowd)
    x = inputs(zeros=0.5)
    layout = RingLayout.one_device(S)
    (sel, scores), (ref, ref_scores) = both(monkeypatch, lambda: select(OneRank(), layout, x["qi"], x["w"], x["ki"],
                                                                        0.5, 12))
    assert torch.equal(sel.positions, ref.positions)
    assert close(scores.nan_to_num(neginf=0), ref_scores.nan_to_num(neginf=0))


def core_inputs(m=12, seed=1, scale_up=1.0):
    """q, kv, w_uk, w_uv, idx (B, S, m) int32 of rows at or before each query (-1 past what it sees), one query
    row with no key at all."""
    g = torch.Generator().manual_seed(seed)
    x = inputs(seed)
    pos = torch.arange(S)
    idx = torch.rand(B, S, S, generator=g).masked_fill_(pos[None, :] > pos[:, None], -1.0).topk(m).indices
    idx = torch.where(idx <= pos[:, None], idx, -1)
    idx[1, 7] = -1
    w_uk, w_uv = split_wkv(x["wkv"], H, DN)
    return x["q"] * scale_up, x["kv"], w_uk, w_uv, idx.int()


@pytest.mark.parametrize("scale_up", [1.0, 30.0], ids=["plain", "wide-scores"])  # exp's subnormals cut
def test_cpu_sparse_attention_equals_the_device_form(monkeypatch, scale_up):
    monkeypatch.setattr(sparse_attention_cpu, "ROW_PAIRS", 30)  # 2 query rows a tile
    monkeypatch.setattr(sparse_attention_cpu, "CHUNK", 9)
    q, kv, w_uk, w_uv, idx = core_inputs(scale_up=scale_up)
    dout = torch.randn(B, S, H, DV, generator=torch.Generator().manual_seed(2))

    def run():
        out, lse = sparse_attention.latent_forward(q, kv, idx, w_uk, w_uv, 0.3)
        p = sparse_attention.latent_probs(q, kv, idx, lse, w_uk, 0.3)
        return (out, lse, p, *sparse_attention.latent_backward(dout, q, kv, idx, out, lse, w_uk, w_uv, 0.3))

    got, want = both(monkeypatch, run)
    tol = 2e-6 * scale_up  # scores scale_up times wider: their rounding too
    for name, a, b in zip(("out", "lse", "p", "dq", "dkv", "dw_uk", "dw_uv"), got, want):
        assert a.shape == b.shape and close(a, b, tol), name
    assert got[1][1, :, 7].eq(float("-inf")).all() and got[0][1, 7].eq(0).all()  # the row with no key
    probs = torch.empty(idx.shape)
    out, lse = sparse_attention_cpu.latent_forward(q, kv, idx, w_uk, w_uv, 0.3, probs)
    assert close(probs, got[2], tol)  # the forward's own head sums are latent_probs'


def test_cpu_indexer_loss_and_kept_probabilities_equal_the_device_forms(monkeypatch):
    """The sparse stage on one CPU rank: the selection's slots taken as the block's rows, the forward's head-summed
    probabilities kept for the target (and taken once), the loss's gradients from dsa's CPU form."""
    monkeypatch.setattr(sparse_attention_cpu, "ROW_PAIRS", 30)
    x = inputs(3)
    layout = RingLayout.one_device(S, DOCS)

    def run():
        sel, scores = select(OneRank(), layout, x["qi"], x["w"], x["ki"], 0.5, 11)
        sel.probs = {}
        q, kv, wkv = (x[n].clone().requires_grad_() for n in ("q", "kv", "wkv"))
        out, lse = SparseLatentAttention.apply(q, kv, wkv, sel, 0.3, DN, OneRank())
        kept = dict(sel.probs)
        p = selected_probs(OneRank(), q.detach(), kv.detach(), wkv.detach(), DN, lse, sel, 0.3, lambda t: t)
        if sparse_attention_cpu.ENABLED:  # kept by the forward, taken by the target
            assert kept["lse"] is lse and sel.probs is None
        qi, w, ki = (x[n].clone().requires_grad_() for n in ("qi", "w", "ki"))
        loss = IndexerKLSparse.apply(qi, w, ki, sel, scores, p, 0.5, 0.25, OneRank())
        (out.square().sum() + loss).backward()
        return out, lse, p, loss, q.grad, kv.grad, wkv.grad, qi.grad, w.grad, ki.grad

    got, want = both(monkeypatch, run)
    names = ("out", "lse", "p", "loss", "dq", "dkv", "dwkv", "dqi", "dw", "dki")
    for name, a, b in zip(names, got, want):
        assert close(a.detach(), b.detach()), name
