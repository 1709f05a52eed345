"""DeepSeek Sparse Attention's selection on a CPU: each query row's exact top-k over one block of keys, in
small tiles that stay in cache.

Legend as in dsa_select.py: B batch, Q query rows, T key rows of the block, G indexer heads, E indexer head
dim, k = index_topk.

On a CPU a fresh large temporary costs its page faults on every use, and a sort per tile costs more than the
scores, so `block_topk` takes ROWS query rows at a time:
  scores   the rows' whole score rows over the keys at or before their last position, into one reused
           (B, ROWS, T) buffer, KEY_CHUNK keys per GEMM: the same two batched GEMMs as `indexer_scores`'
           einsums, so the same bits; -inf where not visible (the causal edge, other documents)
  floor    a lower bound of each row's k-th score, from a sample of every SAMPLE-th score: its r-th largest
           sits near the row's (r SAMPLE)-th, taken a few standard deviations above k (`_floors`); a row that
           finds fewer than k scores at or above it falls back to a lower floor (twice the sample's rank,
           then everything it sees), so no winner is ever missed
  top-k    the scores at or above the floor (one compare, one nonzero; rows of at most k keys keep all) become
           int64 keys (dsa_select.order_keys: the score, then the earlier position) and one sorted topk of
           them is the row's exact top-k, in the order of `merge_topk`
A tile where ties crowd the floor (more than CROWD k scores at or above it, e.g. ReLU's zeros) takes
`tile_topk`'s exact top-k of whole rows instead.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_lc.ops.dsa_select import HIDDEN, key_low, merge_topk, tile_topk

ROWS = 16  # query rows per tile: (ROWS G, E) x (E, KEY_CHUNK) GEMMs, (ROWS, T) score rows
KEY_CHUNK = 4096  # keys per GEMM: (ROWS, G, KEY_CHUNK) fp32 logits, 1 MiB
SAMPLE = 16  # the floor's sample: every SAMPLE-th score of a row
MARGIN = 3.5  # standard deviations of the sample's estimate between the tight floor's expected count and k
CROWD = 8  # more than CROWD * k scores at the floor (ties): the exact path
_FLOOR = torch.finfo(torch.float32).min


def _floors(s: Tensor, k: int) -> list[Tensor]:
    """Lower bounds to try for score rows s (B, R, P), tightest first, each (B, R, 1) and at least the lowest
    finite float (so -inf, hidden, never passes); the last passes everything a row sees. The sample's r-th
    largest has about r SAMPLE scores of the row at or above it, give or take SAMPLE sqrt(r): the tight floor
    asks for k + MARGIN of those, the next for 2k."""
    B, R, P = s.shape
    every = s.new_full((B, R, 1), _FLOOR)
    n = -(-P // SAMPLE)
    r_loose = -(-2 * k // SAMPLE)
    if P <= k or r_loose >= n:
        return [every]
    rank = k / SAMPLE
    r_tight = max(1, min(r_loose, math.ceil(rank + MARGIN * math.sqrt(rank))))
    top = s[..., ::SAMPLE].topk(r_loose, dim=-1, sorted=False).values
    loose = top.amin(-1, keepdim=True).clamp_min_(_FLOOR)
    tight = top.topk(r_tight, dim=-1, sorted=False).values.amin(-1, keepdim=True).clamp_min_(_FLOOR)
    return [tight, loose, every]


def _keys(scores: Tensor, low: Tensor) -> Tensor:
    """Finite fp32 scores (n,) and their positions' `key_low` (n,) -> int64 keys (dsa_select.order_keys)."""
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 and 0.0 tie, as floats do
    if bool((bits < 0).any()):
        bits = torch.where(bits >= 0, bits, -1 - (bits & 0x7FFFFFFF))
    return (bits << 32) | low


def _top_keys(buf: Tensor, R: int, P: int, low: Tensor, k: int) -> Tensor | None:
    """The exact top-k keys (B, R, k), sorted, of the score rows buf[:, :R, :P] (-inf: hidden) at positions whose
    `key_low` is low (P,); None where ties crowd a row's floor."""
    B, _, T = buf.shape
    s = buf[:, :R, :P]
    floors = _floors(s, k)
    floor = floors[0]
    for lower in floors[1:] + [None]:
        # row-major: each row's entries together, in column order
        row, col = (s >= floor).view(B * R, P).nonzero(as_tuple=True)
        counts = torch.bincount(row, minlength=B * R)
        short = (counts < k) & (floor.view(-1) > _FLOOR)  # a row the floor may have cut short of k
        if lower is None or not bool(short.any()):
            break
        floor = torch.where(short.view(B, R, 1), lower, floor)
    most = int(counts.max()) if counts.numel() else 0
    if most > CROWD * k:
        return None
    b = row // R if B > 1 else 0
    vals = buf.view(-1).take((row + b * (buf.shape[1] - R)) * T + col)
    width = max(most, k)
    start = torch.cumsum(counts, 0) - counts
    place = torch.arange(row.numel()) + (torch.arange(B * R) * width - start)[row]  # row * width + rank in row
    pool = torch.full((B * R, width), HIDDEN, dtype=torch.int64)
    pool.view(-1).scatter_(0, place, _keys(vals, low[col]))
    return pool.topk(k, dim=-1, sorted=True).values.view(B, R, k)


def block_topk(q: Tensor, w: Tensor, k_blk: Tensor, q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None,
               k_doc: Tensor | None, scale: float, k: int, sink) -> None:
    """Each query row's exact top-k over one block of keys: q (B, Q, G, E), w (B, Q, G), k_blk (B, T, E) fp32;
    positions q_pos (Q,), k_pos (T,) ascending; document ids (B, Q) / (B, T) or None. sink(lo, hi, keys) takes
    rows lo:hi's int64 keys (B, hi - lo, k) sorted descending, HIDDEN past what a row sees."""
    B, Q, G, E = q.shape
    T = k_blk.shape[1]
    buf = torch.empty(B, min(ROWS, Q), T)
    kT = k_blk.transpose(1, 2)
    low = key_low(k_pos)
    starts = list(range(0, Q, ROWS))
    q_hi = torch.stack([q_pos[lo:lo + ROWS].max() for lo in starts])
    q_lo = torch.stack([q_pos[lo:lo + ROWS].min() for lo in starts])
    ends = torch.searchsorted(k_pos, q_hi, right=True).tolist()  # keys at or before the tile's last row
    full = torch.searchsorted(k_pos, q_lo, right=True).tolist()  # keys at or before its first row
    for lo, P, D in zip(starts, ends, full):
        hi = min(lo + ROWS, Q)
        R = hi - lo
        if P == 0:
            sink(lo, hi, torch.full((B, R, k), HIDDEN, dtype=torch.int64))
            continue
        s = buf[:, :R, :P]
        qt = q[:, lo:hi].reshape(B, R * G, E)
        wt = w[:, lo:hi].reshape(B * R, 1, G)
        for c0 in range(0, P, KEY_CHUNK):
            n = min(KEY_CHUNK, P - c0)
            logits = torch.bmm(qt, kT[:, :, c0:c0 + n]).mul_(scale).relu_()
            s[:, :, c0:c0 + n] = torch.bmm(wt, logits.view(B * R, G, n)).view(B, R, n)
        if q_doc is not None:
            D = 0
        if D < P:
            seen = k_pos[None, D:P] <= q_pos[lo:hi, None]
            if q_doc is not None:
                seen = seen & (q_doc[:, lo:hi, None] == k_doc[:, None, D:P])
            s[:, :, D:P].masked_fill_(~seen, float("-inf"))
        keys = _top_keys(buf, R, P, low, k)
        if keys is None:
            keys = merge_topk(None, tile_topk(s, k_pos[:P], None, k), k)
        sink(lo, hi, keys)
