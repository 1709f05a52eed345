"""The tiled V4 attention core (moe_lc/ops/v4_sparse_core.py) against the torch reference v4_core.sink_attention
with the equivalent readable mask: outputs, lse and the gradients of q, kv, the entries and the sinks, for the
window-only, CSA (picked, with empty slots) and HCA (visible count) forms, at shapes where S is a multiple of
neither the window nor the tile, B = 2; bf16 inputs within bf16's rounding; what backward keeps, counted by
saved-tensor hooks, equal to `saved_bytes` and independent of n."""

from __future__ import annotations

import pytest
import torch

from moe_lc.model.v4_core import sink_attention
from moe_lc.ops.v4_sparse_core import saved_bytes, sparse_sink_attention

B, S, H, D, W = 2, 37, 3, 16, 8
SCALE = D ** -0.5


def picks(n: int, k: int, m: int = 4, seed: int = 1) -> torch.Tensor:
    """(B, S, k) int64: k distinct causal entries per query (s < (t + 1) // m) in random order, -1 in the slots
    a query cannot fill (it sees fewer than k)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((B, S, k), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(S):
            seen = min((t + 1) // m, n)
            chosen = torch.randperm(seen, generator=g)[:k]
            out[b, t, :chosen.numel()] = chosen
            out[b, t] = out[b, t, torch.randperm(k, generator=g)]  # empty slots anywhere, not only last
    return out


def readable_of(picked: torch.Tensor | None, visible: torch.Tensor | None, n: int) -> torch.Tensor:
    """The (B, S, n) bool mask the reference reads (as V4Attention.compressed builds it)."""
    if visible is not None:
        return torch.arange(n) < visible[..., None]
    r = torch.zeros(B, S, n + 1, dtype=torch.bool)
    r.scatter_(-1, torch.where(picked >= 0, picked, n), True)
    return r[..., :n]


def inputs(form: str, dtype=torch.float32, sinks: bool = True):
    """(q, kv, sinks, entries, picked, visible) for a form: 'window', 'csa' (n = 9, k = 4) or 'hca' (n = 4, m 8)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_()
    sk = torch.randn(H, generator=g).requires_grad_() if sinks else None
    entries = picked = visible = None
    if form == "csa":
        entries = torch.randn(B, S // 4, D, generator=g).to(dtype).requires_grad_()
        picked = picks(S // 4, 4)
    elif form == "hca":
        entries = torch.randn(B, S // 8, D, generator=g).to(dtype).requires_grad_()
        visible = torch.div(torch.arange(S) + 1, 8, rounding_mode="floor").expand(B, S).contiguous()
    return q, kv, sk, entries, picked, visible


def run_both(form: str, dtype=torch.float32, tile: int = 5, sinks: bool = True):
    """-> ((out, lse, grads) of the tiled core, the same of the reference), grads of q, kv, sinks, entries."""
    q, kv, sk, entries, picked, visible = inputs(form, dtype, sinks)
    leaves = [t for t in (q, kv, sk, entries) if t is not None]
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(B, S, H, D, generator=g).to(dtype)
    results = []
    for core in ("tiled", "reference"):
        if core == "tiled":
            out, lse = sparse_sink_attention(q, kv, W, SCALE, sk, entries, picked, visible, query_tile=tile)
        else:
            readable = None if entries is None else readable_of(picked, visible, entries.shape[1])
            out, lse = sink_attention(q, kv, W, SCALE, sk, entries, readable, return_lse=True)
        grads = torch.autograd.grad(out, leaves, dout)
        results.append((out, lse, grads))
    return results


@pytest.mark.parametrize("form", ["window", "csa", "hca"])
@pytest.mark.parametrize("tile", [5, 16, 64])
def test_equals_reference_fp32(form, tile):
    (out, lse, grads), (r_out, r_lse, r_grads) = run_both(form, tile=tile)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and not lse.requires_grad
    torch.testing.assert_close(out, r_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_without_sinks():
    (out, lse, grads), (r_out, r_lse, r_grads) = run_both("csa", sinks=False)
    torch.testing.assert_close(out, r_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["csa", "hca"])
def test_bf16_within_bf16_rounding(form):
    """bf16 in, bf16 out and gradients: within a few bf16 ulps of the reference (both compute in fp32; they
    differ in rounding the output and, in backward, in reading the rounded output for rowsum(dO * O))."""
    (out, lse, grads), (r_out, r_lse, r_grads) = run_both(form, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and all(g.dtype == r.dtype for g, r in zip(grads, r_grads))
    torch.testing.assert_close(out, r_out, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)


def test_empty_slots_read_nothing():
    """A query whose slots are all -1 reads no entry: its output is the window-only core's."""
    q, kv, sk, entries, picked, _ = inputs("csa")
    picked = picked.clone()
    picked[:, 20:] = -1
    out, lse = sparse_sink_attention(q, kv, W, SCALE, sk, entries, picked, query_tile=7)
    w_out, w_lse = sparse_sink_attention(q, kv, W, SCALE, sk, query_tile=7)
    torch.testing.assert_close(out[:, 20:], w_out[:, 20:], rtol=0, atol=0)
    assert not torch.equal(out[:, :20], w_out[:, :20])


DOC_LENGTHS = ([13, 9, 15], [20, 17])  # per batch row, S = 37 each: packed documents


def packed_documents(m: int):
    """segments (B, S) document ids, and per query the range [first, stop) of its document's entries in the
    global order (entry w of a document pools its rows w m .. (w + 1) m - 1; n: the most entries of any row)."""
    segments, ranges, n = torch.zeros(B, S, dtype=torch.int64), torch.zeros(B, S, 2, dtype=torch.int64), 0
    for b, lengths in enumerate(DOC_LENGTHS):
        row, first = 0, 0
        for doc, length in enumerate(lengths):
            p = torch.arange(length)
            segments[b, row:row + length] = doc
            ranges[b, row:row + length, 0] = first
            ranges[b, row:row + length, 1] = first + (p + 1) // m
            row, first = row + length, first + length // m
        n = max(n, first)
    return segments, ranges, n


def dense_reference(q, kv, W, scale, sinks, entries, readable, segments):
    """Every (query, key) pair at once, from the definition: key j read when t - W < j <= t in t's segment."""
    t, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    seen = ((j <= t) & (j > t - W))[None] & (segments[:, :, None] == segments[:, None, :])  # (B, S, S)
    s_w = torch.einsum("bthd,bjd->bthj", q.float(), kv.float()).mul(scale)
    parts = [s_w.masked_fill(~seen[:, :, None], -torch.inf)]
    if entries is not None:
        s_e = torch.einsum("bthd,bnd->bthn", q.float(), entries.float()).mul(scale)
        parts.append(s_e.masked_fill(~readable[:, :, None], -torch.inf))
    parts.append(sinks.float().view(1, 1, -1, 1).expand(B, S, -1, 1))
    logits = torch.cat(parts, -1)
    p = logits.softmax(-1)
    out = torch.einsum("bthj,bjd->bthd", p[..., :S], kv.float())
    if entries is not None:
        out = out + torch.einsum("bthn,bnd->bthd", p[..., S:-1], entries.float())
    return out.to(q.dtype), logits.logsumexp(-1)


def packed_inputs(form: str):
    """(leaves q, kv, sinks, entries | None; picked, visible, segments, readable, dout) of packed documents."""
    m = 4 if form == "csa" else 8
    segments, ranges, n = packed_documents(m)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, S, H, D, generator=g).requires_grad_()
    kv = torch.randn(B, S, D, generator=g).requires_grad_()
    sk = torch.randn(H, generator=g).requires_grad_()
    entries = torch.randn(B, n, D, generator=g).requires_grad_() if form != "window" else None
    picked = visible = readable = None
    if form == "hca":
        visible = ranges
        readable = (torch.arange(n) >= ranges[..., :1]) & (torch.arange(n) < ranges[..., 1:])
    elif form == "csa":
        inside = (torch.arange(n) >= ranges[..., :1]) & (torch.arange(n) < ranges[..., 1:])
        top = torch.rand(B, S, n, generator=g).masked_fill(~inside, -1.0).topk(3, dim=-1)
        picked = top.indices.masked_fill(top.values < 0, -1)
        readable = readable_of(picked, None, n)
    dout = torch.randn(B, S, H, D, generator=g)
    return (q, kv, sk, entries), picked, visible, segments, readable, dout


@pytest.mark.parametrize("form", ["window", "csa", "hca"])
def test_packed_documents_equal_dense_reference(form):
    """segments keep the window inside a document; HCA's entries given as [first, stop) ranges of the global
    order; CSA's picks from the query's own document (with -1 slots)."""
    (q, kv, sk, entries), picked, visible, segments, readable, dout = packed_inputs(form)
    leaves = [t for t in (q, kv, sk, entries) if t is not None]
    out, lse = sparse_sink_attention(q, kv, W, SCALE, sk, entries, picked, visible, segments=segments, query_tile=6)
    r_out, r_lse = dense_reference(q, kv, W, SCALE, sk, entries, readable, segments)
    torch.testing.assert_close(out, r_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, r_lse.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(r_out, leaves, dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if form == "window":  # the documents matter: one segment gives other numbers
        assert not torch.allclose(out, sparse_sink_attention(q, kv, W, SCALE, sk, query_tile=6)[0])


def _saved(fn) -> int:
    """Bytes of every tensor autograd saves while fn() runs."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4, 9, 40])
def test_saved_bytes_formula_and_independent_of_n(n, dtype):
    """Counted saved bytes = saved_bytes(...) for each form; the part beyond the inputs does not grow with n
    (the reference's does: its probabilities are S H (2W + n + 1) fp32)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_()
    sk = torch.randn(H, generator=g).requires_grad_()
    entries = torch.randn(B, n, D, generator=g).to(dtype).requires_grad_()
    c = q.element_size()
    picked = torch.randint(0, n, (B, S, 4), generator=g)
    visible = torch.randint(0, n + 1, (B, S), generator=g)
    counted = _saved(lambda: sparse_sink_attention(q, kv, W, SCALE, sk, entries, picked, query_tile=8))
    assert counted == saved_bytes(B, S, H, D, n, 4, c, sinks=True)
    counted = _saved(lambda: sparse_sink_attention(q, kv, W, SCALE, sk, entries, visible=visible, query_tile=8))
    assert counted == saved_bytes(B, S, H, D, n, None, c, sinks=True)
    counted = _saved(lambda: sparse_sink_attention(q, kv, W, SCALE, None, query_tile=8))
    assert counted == saved_bytes(B, S, H, D, 0, None, c, sinks=False)
    ranges, segments = torch.stack([visible // 2, visible], -1), torch.zeros(B, S, dtype=torch.int64)
    counted = _saved(lambda: sparse_sink_attention(q, kv, W, SCALE, sk, entries, visible=ranges, segments=segments,
                                                   query_tile=8))
    assert counted == saved_bytes(B, S, H, D, n, None, c, sinks=True, ranges=True, segments=True)
    beyond_entries = saved_bytes(B, S, H, D, n, 4, c, True) - B * n * D * c
    assert beyond_entries == saved_bytes(B, S, H, D, 1, 4, c, True) - B * D * c
    ref = _saved(lambda: sink_attention(q, kv, W, SCALE, sk, entries, readable_of(picked, None, n)))
    assert ref > B * S * H * (2 * W + n + 1) * 4  # its fp32 probabilities alone


def test_rejects_bad_shapes():
    q, kv, sk, entries, picked, visible = inputs("csa")
    with pytest.raises(ValueError, match="exactly one of picked"):
        sparse_sink_attention(q, kv, W, SCALE, sk, entries)
    with pytest.raises(ValueError, match=r"visible \(B, S\)"):
        sparse_sink_attention(q, kv, W, SCALE, sk, entries, visible=picked)
    with pytest.raises(ValueError, match="entries is None"):
        sparse_sink_attention(q, kv, W, SCALE, sk, None, picked)
    with pytest.raises(ValueError, match=r"kv \(B, S, d\)"):
        sparse_sink_attention(q, kv[:, :-1], W, SCALE, sk)


# --------------------------------------------------------- the Triton form (moe_lc/kernels/v4_sparse_attention.py)

def _edge_inputs(form: str, dtype=torch.float32, device="cpu"):
    """Shapes past one block everywhere: 17 heads (BLOCK_H 16), window 40 and 37 picked slots (BLOCK_N 32), S = 75,
    d = 24 (not a power of two), B = 2; CSA picks with -1 slots, HCA counts every 16 tokens."""
    b, s, h, d, m = 2, 75, 17, 24, 2
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, s, h, d, generator=g)
    kv, sk = torch.randn(b, s, d, generator=g), torch.randn(h, generator=g)
    entries = picked = visible = None
    if form == "csa":
        n = s // m
        entries = torch.randn(b, n, d, generator=g)
        vis = (torch.arange(s) + 1) // m
        scores = torch.rand(b, s, n, generator=g).masked_fill(torch.arange(n) >= vis[:, None], -1.0)
        picked = scores.topk(37, dim=-1).indices.masked_fill(scores.topk(37, dim=-1).values < 0, -1)
    elif form == "hca":
        entries = torch.randn(b, s // 16, d, generator=g)
        visible = ((torch.arange(s) + 1) // 16).expand(b, s).contiguous()
    leaves = [t.to(device, dtype).requires_grad_() if t is not None else None for t in (q, kv, sk, entries)]
    leaves[2] = leaves[2].detach().float().requires_grad_()  # sinks stay fp32 (a parameter)
    dout = torch.randn(b, s, h, d, generator=g).to(device, dtype)
    return leaves, (None if picked is None else picked.to(device)), (None if visible is None else visible.to(device)), \
        dout


def _both_forms(form, dtype=torch.float32, device="cpu", window=40):
    from moe_lc.kernels import v4_sparse_attention as kernel
    (q, kv, sk, entries), picked, visible, dout = _edge_inputs(form, dtype, device)
    leaves = [t for t in (q, kv, sk, entries) if t is not None]
    scale = q.shape[-1] ** -0.5
    results = []
    for fn in (kernel.sparse_sink_attention, sparse_sink_attention):
        out, lse = fn(q, kv, window, scale, sk, entries, picked, visible)
        results.append((out, lse, torch.autograd.grad(out, leaves, dout)))
    return results


def assert_forms_agree(kernel_result, torch_result, tol: float = 1e-5) -> None:
    """(out, lse, grads) of the Triton form against the torch form's, each within `tol` (fp32)."""
    (out, lse, grads), (r_out, r_lse, r_grads) = kernel_result, torch_result
    torch.testing.assert_close(out, r_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, r_lse, rtol=tol, atol=tol)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter checks run where there is no GPU")
@pytest.mark.parametrize("form", ["window", "csa", "hca"])
def test_triton_form_equals_torch_form_small(form):
    """This file's small shapes (one block of heads, window and slots), interpreted: a few seconds each."""
    pytest.importorskip("triton")
    from moe_lc.kernels import v4_sparse_attention as kernel
    q, kv, sk, entries, picked, visible = inputs(form)
    leaves = [t for t in (q, kv, sk, entries) if t is not None]
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(2))
    results = []
    for fn in (kernel.sparse_sink_attention, sparse_sink_attention):
        out, lse = fn(q, kv, W, SCALE, sk, entries, picked, visible)
        results.append((out, lse, torch.autograd.grad(out, leaves, dout)))
    assert_forms_agree(*results)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter checks run where there is no GPU")
@pytest.mark.parametrize("form", ["window", "csa", "hca"])
def test_triton_form_equals_torch_form_interpreted(form):
    """Past one block in every dimension (about 30 s each, interpreted)."""
    pytest.importorskip("triton")
    assert_forms_agree(*_both_forms(form))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["window", "csa", "hca"])
def test_triton_form_bf16_on_gpu(form):
    """Compiled on CUDA, bf16 in: within bf16's rounding of the torch form (which computes in fp32)."""
    (out, lse, grads), (r_out, r_lse, r_grads) = _both_forms(form, torch.bfloat16, "cuda")
    torch.testing.assert_close(out, r_out, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(lse, r_lse, rtol=1e-3, atol=1e-3)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter checks run where there is no GPU")
def test_triton_form_saves_what_the_torch_form_saves():
    pytest.importorskip("triton")
    from moe_lc.kernels import v4_sparse_attention as kernel
    q, kv, sk, entries, picked, _ = inputs("csa")
    counted = _saved(lambda: kernel.sparse_sink_attention(q, kv, W, SCALE, sk, entries, picked))
    assert counted == saved_bytes(B, S, H, D, entries.shape[1], picked.shape[-1], 4, sinks=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter checks run where there is no GPU")
@pytest.mark.parametrize("form", ["window", "csa", "hca"])
def test_triton_form_packed_documents(form):
    """Segments and [first, stop) entry ranges in the kernels, interpreted, against the torch form."""
    pytest.importorskip("triton")
    from moe_lc.kernels import v4_sparse_attention as kernel
    (q, kv, sk, entries), picked, visible, segments, _, dout = packed_inputs(form)
    leaves = [t for t in (q, kv, sk, entries) if t is not None]
    results = []
    for fn in (kernel.sparse_sink_attention, sparse_sink_attention):
        out, lse = fn(q, kv, W, SCALE, sk, entries, picked, visible, segments=segments)
        results.append((out, lse, torch.autograd.grad(out, leaves, dout)))
    assert_forms_agree(*results)
