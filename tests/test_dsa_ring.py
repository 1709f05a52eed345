"""DeepSeek Sparse Attention's ring passes on real zig-zag rings (gloo, cp = 2 and 4) against one device:
the selection, sparse attention and both stages' indexer losses, values and gradients, with and without
packed documents. One 4-process job builds the cp = 2 and cp = 4 groups and runs every case."""

from __future__ import annotations

import pytest
import torch

from moe_lc.ops.documents import Documents
from moe_lc.ops.dsa_attention import IndexerKLSparse, SparseLatentAttention, selected_probs, split_wkv
from moe_lc.ops.dsa_ring import OneRank, RingLayout, select
from moe_lc.ops.dsa_warmup import IndexerKLDense, head_lse
from moe_lc.parallel.comm import Group
from moe_lc.parallel.cp.ring import P2PRing, chunk_ids
from tests.harness import run_workers

B, S, G, E, H, TOPK = 2, 64, 3, 8, 4, 9
DN, DR, C, DV = 6, 4, 8, 5
DOCS = [[20, 28, 16], [5, 30, 13, 16]]


def inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    x = dict(qi=r(B, S, G, E), w=r(B, S, G), ki=r(B, S, E), q=r(B, S, H, DN + DR), kv=r(B, S, C + DR),
             dout=r(B, S, H, DV))
    x["qi"] = x["qi"] * (torch.rand(B, S, G, 1, generator=g) > 0.5)  # exact-zero scores: ties to break
    return x


WKV = torch.randn(H * (DN + DV), C, generator=torch.Generator().manual_seed(1)) * 0.5


def run_all(ring, layout, x, rows):
    """Every op on this rank's rows of x; returns what each computes, with the inputs' gradients (wkv_b's is
    this rank's part: they sum over the ring)."""
    loc = {n: t[:, rows].clone().requires_grad_(n != "dout") for n, t in x.items()}
    wkv = WKV.clone().requires_grad_()
    sel, scores = select(ring, layout, loc["qi"], loc["w"], loc["ki"], 0.5, TOPK)
    out, lse = SparseLatentAttention.apply(loc["q"], loc["kv"], wkv, sel, 0.3, DN, ring)
    q, kv = loc["q"].detach(), loc["kv"].detach()
    p = selected_probs(ring, q, kv, WKV, DN, lse, sel, 0.3, lambda t: t)
    kl_sparse = IndexerKLSparse.apply(loc["qi"], loc["w"], loc["ki"], sel, scores, p, 0.5, 0.5, ring)
    w_uk, _ = split_wkv(WKV, H, DN)
    lse_dense = head_lse(ring, layout, q, kv, w_uk, 0.3)
    kl_dense, stats = IndexerKLDense.apply(loc["qi"], loc["w"], loc["ki"], q, kv, w_uk, lse_dense, layout, 0.3, 0.5,
                                           0.25, ring, lambda t: t, H, sel)
    ((out * loc["dout"]).sum() + kl_sparse + kl_dense).backward()
    return {"positions": sel.positions, "out": out.detach(), "lse": lse, "p": p, "kl_sparse": kl_sparse.detach(),
            "kl_dense": kl_dense.detach(), "stats": stats, "lse_dense": lse_dense, "dwkv": wkv.grad,
            **{f"d{n}": loc[n].grad for n in ("qi", "w", "ki", "q", "kv")}}


def _worker(rank, world, with_docs):
    x = inputs()
    results = {}
    for cp in (2, 4):
        pg = torch.distributed.new_group(list(range(cp)))  # every rank takes part in creating it
        if rank >= cp:
            continue
        group = Group(f"cp{cp}", list(range(cp)), rank, pg)
        docs = Documents(DOCS, S) if with_docs else None
        C = S // (2 * cp)
        layout = RingLayout(tuple(chunk_ids(r, cp) for r in range(cp)), C, rank, docs)
        rows = layout.positions(rank)
        results[cp] = (rows, run_all(P2PRing(group), layout, x, rows))
    return results


@pytest.fixture(scope="module", params=[False, True], ids=["causal", "documents"])
def ring_results(request):
    x = inputs()
    docs = Documents(DOCS, S) if request.param else None
    one = run_all(OneRank(), RingLayout.one_device(S, docs), x, torch.arange(S))
    return one, run_workers(_worker, 4, request.param, timeout_s=300)


def close(a, b) -> bool:
    """fp32 agreement: within 1e-5 of the tensor's largest value."""
    return torch.allclose(a.double(), b.double(), rtol=0, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_equals_one_device(ring_results, cp):
    one, ranks = ring_results
    for rank in range(cp):
        rows, got = ranks[rank][cp]
        assert torch.equal(got["positions"], one["positions"][:, rows]), "the ring selects what one device selects"
        for name in ("out", "p", "dq", "dkv", "dqi", "dw", "dki"):
            assert close(got[name], one[name][:, rows]), name
        for name in ("lse", "lse_dense"):
            assert close(got[name], one[name][:, :, rows]), name
    for name in ("kl_sparse", "kl_dense", "stats", "dwkv"):  # each rank holds its queries' share of the sum
        total = sum(ranks[r][cp][1][name] for r in range(cp))
        want = one[name].double()
        assert torch.allclose(total.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max())), name
