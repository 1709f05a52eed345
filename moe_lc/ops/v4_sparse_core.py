"""DeepSeek-V4's attention core without the (B, S, n) mask or the saved probabilities: the window, the compressed
entries a query reads and the per-head sink in one softmax, computed in query tiles, the entries gathered by
index, and a backward that recomputes each tile's probabilities from the saved log-sum-exp (flash attention's
scheme, Dao et al. 2022, arXiv 2205.14135: dS = P (dP - rowsum(dO * O))). The same numbers as the torch
reference moe_lc/model/v4_core.py `sink_attention` (transformers src/transformers/models/deepseek_v4/
modeling_deepseek_v4.py, `eager_attention_forward` with `sinks`; report arXiv 2606.19348, section 2.3).

Legend: B batch, S sequence, H heads, d head dim (key = value: one shared KV head), W window, n compressed
entries, k entries a CSA query reads (index_topk), T query rows of a tile.

    logits(t) = [ scale q_t . kv_j  for j in (t - W, t] | scale q_t . e_s  for readable s | sink_h ]
    lse(t)    = logsumexp(logits(t))                                                      (B, S, H) fp32
    out_t     = sum over j, s of exp(logit - lse(t)) [kv_j | e_s]  (the sink has no value)  (B, S, H, d)

Which entries a query reads, one of:
    picked  (B, S, k) int64, -1 = an empty slot: CSA, the indexer's top-k (moe_lc/model/v4_indexer.py);
            the entries are gathered per query, (B, T, k, d) per tile
    visible (B, S) int64: HCA, every entry s < visible(t) (causality: (t + 1) // m), or (B, S, 2): entries
            first(t) <= s < stop(t) (packed documents: a document's entries are a run of the global order);
            the tile reads all n entries under that mask (n = S / 128 is small)
and, with packed documents or context parallelism, segments (B, S): the window reads only its query's segment.

Tiles: a tile's queries [lo, hi) are cut in blocks of W, each reading the 2W keys before and with it (v4_core's
blockwise window, counted from the tile's first row), so the window costs 2W per query and head whatever T is.
A tile holds the whole row of logits, so its softmax is exact without an online rescale. Working set of one
tile, fp32 elements: B T H (2W + k) scores (and in backward their probabilities and dS), B T k d gathered
entries (HCA: B n d), B T H d of q, dO and the output; `auto_tile` keeps it near TILE_ELEMS, 64 MiB (V4-Flash,
B = 1: CSA 40 rows of 1.6 MB, the gathered entries 64% of it; HCA at 1M tokens, n = 8192, 26 rows of 2.6 MB,
the scores 85% of it).

Saved for backward (`saved_bytes`), with c the bytes of q's dtype: q and out (2 S H d c), kv (S d c), lse (4 S H),
the entries (n d c), picked (8 S k) or visible (8 S; ranges 16 S), segments if given (8 S), sinks (4 H): O(S H)
beyond the inputs, nothing of size S n. Per token at V4-Flash's shapes (H 64, d 512, k 512, W 128, m 4 / 128,
bf16): CSA 136,704 bytes, HCA 132,368 bytes (q and out 131,072 of it; picked is the indexer loss's tensor too,
saved once when shared), independent of S. The reference core keeps S H (2W + n + 1) fp32 probabilities and more
(moe_lc/model/v4_counting.py `reference_core_saved_bytes`): a CSA layer 600 KB per token at 4K, 4.5 MB at 64K,
67.7 MB at 1M; HCA 345 KB, 468 KB, 2.4 MB; a window-only layer 205 KB.

Softmax and accumulation run in fp32; out takes q's dtype, each gradient its input's dtype. A CUDA run wants
the Triton form (moe_lc/kernels/v4_sparse_attention.py); this one is its reference and the CPU path.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

TILE_ELEMS = 1 << 24  # fp32 elements of one tile's working set (64 MiB)


def auto_tile(B: int, H: int, d: int, W: int, k: int, gathered: bool = True) -> int:
    """Query rows per tile (whole windows where that fits) so that B T (H (2W + k) + k d + 3 H d) fp32 elements
    stay near TILE_ELEMS; k: the entries a query reads (CSA: k, HCA: n, window only: 0); gathered: each row has
    its own k d keys (CSA), else the tile shares the n entries (HCA)."""
    rows = max(1, TILE_ELEMS // max(1, B * (H * (2 * W + k) + (k * d if gathered else 0) + 3 * H * d)))
    return rows - rows % W if 0 < W < rows else rows  # whole window blocks


def saved_bytes(B: int, S: int, H: int, d: int, n: int, k: int | None, c: int, sinks: bool, ranges: bool = False,
                segments: bool = False) -> int:
    """Bytes `sparse_sink_attention` keeps for backward (module docstring): k the picked slots (CSA), None for
    the `visible` form (HCA; ranges: (B, S, 2) first / stop, else (B, S) counts), n = 0 for a window-only layer;
    c the bytes of q's dtype; segments: a (B, S) int64 segment id per row was given."""
    total = 2 * B * S * H * d * c + B * S * d * c + 4 * B * S * H + (4 * H if sinks else 0)
    total += 8 * B * S if segments else 0
    if n or k:
        total += B * n * d * c + 8 * B * S * (k if k is not None else 2 if ranges else 1)
    return total


def _blocked(x: Tensor, W: int) -> Tensor:
    """(B, T, ...) -> (B, ceil(T / W), W, ...), zero rows past T."""
    B, T = x.shape[:2]
    nb = -(-T // W)
    if nb * W != T:
        x = torch.cat([x, x.new_zeros(B, nb * W - T, *x.shape[2:])], dim=1)
    return x.view(B, nb, W, *x.shape[2:])


def _unblocked(x: Tensor, T: int) -> Tensor:
    """(B, nb, W, ...) -> (B, T, ...)."""
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def _spans(x: Tensor, lo: int, nb: int, W: int) -> Tensor:
    """x (B, S, ...) -> (B, nb, 2W, ...): the rows [a - W, a + W) of each block a = lo + i W, zeros outside [0, S)."""
    B, S = x.shape[:2]
    start, end = lo - W, lo + nb * W
    span = x[:, max(start, 0):min(end, S)]
    span = torch.cat([span.new_zeros(B, max(0, -start), *x.shape[2:]), span,
                      span.new_zeros(B, end - min(end, S), *x.shape[2:])], dim=1).view(B, nb + 1, W, *x.shape[2:])
    return torch.cat([span[:, :-1], span[:, 1:]], dim=2)


def _window(q_t: Tensor, kv: Tensor, lo: int, W: int, scale: float, segments: Tensor | None
            ) -> tuple[Tensor, Tensor]:
    """The tile's window, in blocks of W queries [a, a + W) each reading the 2W keys [a - W, a + W) (v4_core's
    blockwise form, the blocks counted from the tile's first row): (scores (B, T, H, 2W) fp32, -inf outside
    (t - W, t] and, with segments (B, S), outside the query's segment; keys (B, nb, 2W, d) fp32, zeros before
    position 0 and past S)."""
    B, T = q_t.shape[:2]
    nb = -(-T // W)
    keys = _spans(kv.float(), lo, nb, W)
    s = _unblocked(torch.einsum("bnqhd,bnkd->bnqhk", _blocked(q_t, W), keys), T).mul_(scale)
    i, c = torch.arange(W, device=kv.device)[:, None], torch.arange(2 * W, device=kv.device)[None, :]
    first = lo + W * torch.arange(nb, device=kv.device)[:, None, None]  # each block's first query
    seen = ((c > i) & (c <= i + W) & (first - W + c >= 0)).view(nb * W, 2 * W)[:T][None]  # (1, T, 2W)
    if segments is not None:  # (B, nb, W, 2W): query and key in one segment
        same = _blocked(segments[:, lo:lo + T], W)[..., :, None] == _spans(segments, lo, nb, W)[:, :, None, :]
        seen = seen & _unblocked(same, T)
    return s.masked_fill_(~seen[:, :, None, :], float("-inf")), keys


def _window_grad_keys(dkv: Tensor, dkeys: Tensor, lo: int, W: int) -> None:
    """dkv (B, S, d) += the blocks' key gradients dkeys (B, nb, 2W, d), each block's 2W keys folded back onto the
    positions [a - W, a + W) they were read from."""
    B, nb = dkeys.shape[:2]
    S, d = dkv.shape[1:]
    fold = dkeys.new_zeros(B, nb + 1, W, d)
    fold[:, :-1] += dkeys[:, :, :W]
    fold[:, 1:] += dkeys[:, :, W:]
    start, end = lo - W, lo + nb * W
    first = max(0, -start)
    dkv[:, max(start, 0):min(end, S)] += fold.view(B, -1, d)[:, first:first + min(end, S) - max(start, 0)]


def _entries(q_t: Tensor, entries: Tensor, index: Tensor, gathered: bool, lo: int, hi: int, scale: float
             ) -> tuple[Tensor, Tensor, Tensor]:
    """The tile's entries: (scores (B, T, H, k or n) fp32, -inf where unread; keys (B, T, k, d) gathered or
    (B, n, d), fp32; the flat rows gathered (B T k,) or None)."""
    B, n, d = entries.shape
    if gathered:
        idx = index[:, lo:hi]
        rows = (idx.clamp_min(0) + torch.arange(B, device=idx.device)[:, None, None] * n).flatten()
        keys = entries.reshape(B * n, d).index_select(0, rows).view(*idx.shape, d).float()
        s = torch.einsum("bthd,btkd->bthk", q_t, keys).mul_(scale)
        return s.masked_fill_((idx < 0)[:, :, None, :], float("-inf")), keys, rows
    keys = entries.float()
    s = torch.einsum("bthd,bnd->bthn", q_t, keys).mul_(scale)
    ar = torch.arange(n, device=entries.device)
    if index.dim() == 2:  # counts: entries [0, visible)
        unread = ar >= index[:, lo:hi, None]  # (B, T, n)
    else:  # ranges: entries [first, stop)
        unread = (ar < index[:, lo:hi, 0, None]) | (ar >= index[:, lo:hi, 1, None])
    return s.masked_fill_(unread[:, :, None, :], float("-inf")), keys, None


def _parts(q, kv, entries, index, gathered, sinks, segments, lo, hi, W, scale):
    """One tile's logits by part: (q_t (B, T, H, d) fp32, window scores, window keys, entry scores | None, entry
    keys | None, gathered rows | None, sink logits (H,) fp32 | None)."""
    q_t = q[:, lo:hi].float()
    s_w, k_w = _window(q_t, kv, lo, W, scale, segments)
    s_e = k_e = rows = None
    if entries is not None and entries.shape[1] and index.shape[-1]:
        s_e, k_e, rows = _entries(q_t, entries, index, gathered, lo, hi, scale)
    return q_t, s_w, k_w, s_e, k_e, rows, None if sinks is None else sinks.float()


def _mix(p_w: Tensor, k_w: Tensor, p_e: Tensor | None, k_e: Tensor | None, gathered: bool, W: int) -> Tensor:
    """sum p [kv_j | e_s] -> (B, T, H, d) fp32 (p_w: the window's probabilities, p_e: the entries')."""
    out = _unblocked(torch.einsum("bnqhk,bnkd->bnqhd", _blocked(p_w, W), k_w), p_w.shape[1])
    if p_e is not None:
        out += torch.einsum("bthk,btkd->bthd", p_e, k_e) if gathered else torch.einsum("bthn,bnd->bthd", p_e, k_e)
    return out


def _forward(q, kv, entries, index, gathered, sinks, segments, W, scale, tile):
    B, S, H, d = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty(B, S, H, dtype=torch.float32)
    for lo in range(0, S, tile):
        hi = min(lo + tile, S)
        _, s_w, k_w, s_e, k_e, _, sink = _parts(q, kv, entries, index, gathered, sinks, segments, lo, hi, W, scale)
        l = torch.logsumexp(s_w, dim=-1)  # finite: a query always sees itself
        if s_e is not None:
            l = torch.logaddexp(l, torch.logsumexp(s_e, dim=-1))
        if sink is not None:
            l = torch.logaddexp(l, sink)
        p_w = torch.exp(s_w - l[..., None])
        p_e = None if s_e is None else torch.exp(s_e - l[..., None])
        out[:, lo:hi] = _mix(p_w, k_w, p_e, k_e, gathered, W).to(q.dtype)
        lse[:, lo:hi] = l
    return out, lse


def _backward(dout, q, kv, entries, index, gathered, sinks, segments, out, lse, W, scale, tile):
    """-> dq (B, S, H, d), dkv (B, S, d), dentries (B, n, d) | None, dsinks (H,) | None, all fp32."""
    B, S, H, d = q.shape
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dent = None if entries is None else torch.zeros(entries.shape, dtype=torch.float32, device=q.device)
    dsink = None if sinks is None else torch.zeros(H, dtype=torch.float32, device=q.device)
    for lo in range(0, S, tile):
        hi = min(lo + tile, S)
        q_t, s_w, k_w, s_e, k_e, rows, sink = _parts(q, kv, entries, index, gathered, sinks, segments, lo, hi, W,
                                                     scale)
        l, do = lse[:, lo:hi, :, None], dout[:, lo:hi].float()
        delta = (do * out[:, lo:hi].float()).sum(-1, keepdim=True)  # (B, T, H, 1): rowsum(dO * O)
        T = hi - lo
        p_w, do_b = _blocked(torch.exp(s_w - l), W), _blocked(do, W)  # rows past T: p = 0, dO = 0
        ds_w = p_w * (torch.einsum("bnqhd,bnkd->bnqhk", do_b, k_w) - _blocked(delta, W))
        dq_t = _unblocked(torch.einsum("bnqhk,bnkd->bnqhd", ds_w, k_w), T)
        # dK = scale dS^T q + P^T dO, one GEMM over the heads stacked twice
        _window_grad_keys(dkv, torch.einsum("bnqhk,bnqhd->bnkd", torch.cat([ds_w * scale, p_w], 3),
                                            torch.cat([_blocked(q_t, W), do_b], 3)), lo, W)
        if s_e is not None:
            p_e = torch.exp(s_e - l)
            if gathered:  # each (query, slot) its own key row: index_add once per tile
                ds_e = p_e * (torch.einsum("bthd,btkd->bthk", do, k_e) - delta)
                dq_t += torch.einsum("bthk,btkd->bthd", ds_e, k_e)
                dk = torch.einsum("bthk,bthd->btkd", torch.cat([ds_e * scale, p_e], 2), torch.cat([q_t, do], 2))
                dent.view(-1, d).index_add_(0, rows, dk.reshape(-1, d))  # an empty slot's p and dS are 0
            else:
                ds_e = p_e * (torch.einsum("bthd,bnd->bthn", do, k_e) - delta)
                dq_t += torch.einsum("bthn,bnd->bthd", ds_e, k_e)
                dent += torch.einsum("bthn,bthd->bnd", torch.cat([ds_e * scale, p_e], 2), torch.cat([q_t, do], 2))
        if sink is not None:  # the sink's logit has no value: dP = 0, dS = -P delta
            dsink -= (torch.exp(sink - l[..., 0]) * delta[..., 0]).sum((0, 1))
        dq[:, lo:hi] = dq_t.mul_(scale)
    return dq, dkv, dent, dsink


@torch.no_grad()
def picked_mass(q: Tensor, entries: Tensor, lse: Tensor, picked: Tensor, scale: float, *,
                query_tile: int | None = None) -> Tensor:
    """The attention's probability of each picked entry summed over the heads, (B, S, k) fp32, 0 at -1 slots:
    moe_lc/model/v4_index_loss.py `picked_mass` (the indexer loss's target) without its (B, S, n) logits. q the
    core's roped queries (B, S, H, d), lse its (B, S, H) from `sparse_sink_attention`."""
    B, S, H, d = q.shape
    k = picked.shape[-1]
    out = torch.zeros(B, S, k, dtype=torch.float32, device=q.device)
    if k == 0 or entries.shape[1] == 0:
        return out
    tile = query_tile or auto_tile(B, H, d, 0, k)
    for lo in range(0, S, tile):
        hi = min(lo + tile, S)
        s, _, _ = _entries(q[:, lo:hi].float(), entries, picked, True, lo, hi, scale)
        out[:, lo:hi] = torch.exp(s - lse[:, lo:hi, :, None]).sum(2)  # exp(-inf) = 0 at -1 slots
    return out


class SparseSinkAttention(torch.autograd.Function):
    """`sparse_sink_attention` with its own backward: saves q, kv, entries, picked / visible, sinks, out and lse
    (see `saved_bytes`), recomputes each tile's probabilities in backward."""

    @staticmethod
    def forward(ctx, q, kv, sinks, entries, index, segments, gathered: bool, window: int, scale: float, tile: int):
        out, lse = _forward(q, kv, entries, index, gathered, sinks, segments, window, scale, tile)
        ctx.save_for_backward(q, kv, sinks, entries, index, segments, out, lse)
        ctx.args = (gathered, window, scale, tile)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, kv, sinks, entries, index, segments, out, lse = ctx.saved_tensors
        gathered, W, scale, tile = ctx.args
        dq, dkv, dent, dsink = _backward(dout, q, kv, entries, index, gathered, sinks, segments, out, lse, W, scale,
                                         tile)
        return (dq.to(q.dtype), dkv.to(kv.dtype), None if sinks is None else dsink.to(sinks.dtype),
                None if entries is None else dent.to(entries.dtype), None, None, None, None, None, None)


def sparse_sink_attention(q: Tensor, kv: Tensor, window: int, scale: float, sinks: Tensor | None,
                          entries: Tensor | None = None, picked: Tensor | None = None, visible: Tensor | None = None,
                          *, segments: Tensor | None = None, query_tile: int | None = None) -> tuple[Tensor, Tensor]:
    """q (B, S, H, d), kv (B, S, d) roped; sinks (H,) or None; entries (B, n, d) with picked (B, S, k) int64 (-1:
    an empty slot; CSA) or visible (HCA): (B, S) int64, entries s < visible(t), or (B, S, 2) int64, entries
    first(t) <= s < stop(t) (a packed document's entries in the global order); or entries None for a window-only
    layer. segments (B, S) int64 or None: a window key is read only in its query's segment (packed documents, rows
    before a context-parallel span's start). -> out (B, S, H, d) in q's dtype, lse (B, S, H) fp32 detached over
    window, entries and sink: v4_core.sink_attention(q, kv, window, scale, sinks, entries, readable,
    return_lse=True, segments) with readable the set picked names (or the visible range). query_tile: query rows
    per tile (None: `auto_tile`)."""
    B, S, H, d = q.shape
    if kv.shape != (B, S, d):
        raise ValueError(f"sparse_sink_attention needs kv (B, S, d) = {(B, S, d)} for q {tuple(q.shape)}; "
                         f"got {tuple(kv.shape)}")
    if entries is None:
        if picked is not None or visible is not None:
            raise ValueError("sparse_sink_attention: picked / visible name entries, but entries is None")
        index, gathered, k = None, False, 0
    else:
        if (picked is None) == (visible is None):
            raise ValueError("sparse_sink_attention: with entries, pass exactly one of picked (B, S, k) (CSA) and "
                             "visible (B, S) (HCA)")
        if entries.dim() != 3 or entries.shape[0] != B or entries.shape[2] != d:
            raise ValueError(f"sparse_sink_attention needs entries (B, n, d) with B={B}, d={d}; "
                             f"got {tuple(entries.shape)}")
        index, gathered = (picked, True) if picked is not None else (visible, False)
        want = [(B, S, picked.shape[-1] if picked.dim() == 3 else -1)] if gathered else [(B, S), (B, S, 2)]
        if tuple(index.shape) not in want:
            raise ValueError(f"sparse_sink_attention needs "
                             f"{'picked (B, S, k)' if gathered else 'visible (B, S) or (B, S, 2)'} with (B, S) = "
                             f"{(B, S)}; got {tuple(index.shape)}")
        k = index.shape[-1] if gathered else entries.shape[1]
    tile = query_tile or auto_tile(B, H, d, window, k, gathered)
    if segments is not None and tuple(segments.shape) != (B, S):
        raise ValueError(f"sparse_sink_attention needs segments (B, S) = {(B, S)}; got {tuple(segments.shape)}")
    return SparseSinkAttention.apply(q, kv, sinks, entries, index, segments, gathered, window, scale, tile)
