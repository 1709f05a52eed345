"""DeepSeek-V4's CSA indexer selection without a (B, S, n) score matrix: a running top-k over tiles of the
compressed entries, per tile of queries, and the indexer's scores at the picked entries with a tiled backward
(what its KL loss trains through). The same choice as moe_lc/model/v4_indexer.py `V4Indexer.pick` (report
arXiv 2606.19348, section 2.3.1; V3.2's lightning indexer, arXiv 2512.02556, eq. 1).

Legend: B batch, S sequence, G indexer heads, E indexer head dim, n compressed entries, k = min(index_topk, n),
T query rows of a tile, N entries of a tile.

    I(t, s)     = sum_g w(t, g) relu(scale q_I(t, g) . K(s))       (B, T, N) per tile, never (B, S, n)
    picked(t)   = the k entries t sees (s < visible(t), or a range) of highest I, ties to the earlier entry;
                  -1 past what t sees

Order and ties are moe_lc/ops/dsa_select.py's: each candidate an int64 key (the score's order-preserving bits,
then the earlier position), so the top-k of a union is the top-k of the running best and one tile's keys
(`merge_topk`), whatever the tiling. A tile's scores come from the same `indexer_scores` as the reference; a
GEMM's rounding may depend on the tile's width, so scores agree to fp32 rounding (bit for bit where the
arithmetic is exact) and picks are V4Indexer.pick's except between entries whose scores lie within that
rounding of each other (the same holds between any two tilings of the reference, and under CP).

Working set per (query tile, entry tile): the (B, T, G, N) fp32 head scores (TILE_ELEMS at most; the
default tiles make it 64 MiB), their (B, T, N) sum and int64 keys, and the running (B, T, k) best. One host
sync per call: the entries each query tile may see (the least first, the most stop), so a causal tile skips
those no query of it sees (about half the work; on a GPU, one sync per layer).

The indexer loss (moe_lc/model/v4_index_loss.py `kl_to_indexer`) reads I only at the picked entries: its
softmax is over the picked set, not over every visible entry, so a tiled form needs the picked scores with a
gradient (`picked_index_scores`) and the attention's mass at the picked entries (v4_sparse_core.picked_mass),
no log-sum-exp over all visible entries.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moe_lc.ops.dsa_select import indexer_scores, key_positions, key_scores, merge_topk, order_keys

TILE_ELEMS = 1 << 24  # fp32 elements of one tile's (B, T, G, N) head scores


def _tiles(total: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, total)) for lo in range(0, total, size)]


@torch.no_grad()
def tiled_index_topk(q_I: Tensor, w: Tensor, keys: Tensor, scale: float, visible: Tensor, k: int, *,
                     query_tile: int | None = None, entry_tile: int | None = None) -> tuple[Tensor, Tensor]:
    """q_I (B, S, G, E), w (B, S, G) fp32 (G^-0.5 folded in), keys (B, n, E), visible (B, S) int64 (entries s <
    visible(t) are seen) or (B, S, 2) (entries first(t) <= s < stop(t): packed documents, whose entries are runs
    of the global order; ties still go to the earlier entry of that order) -> picked (B, S, min(k, n)) int64 in
    top-k order, -1 past what a query sees; and the indexer's scores there (B, S, min(k, n)) fp32, -inf at -1.
    query_tile, entry_tile: rows and entries per tile (None: entry_tile = min(n, max(k, 2048)), query_tile
    keeping B T G N near TILE_ELEMS)."""
    B, S, G, _ = q_I.shape
    n = keys.shape[1]
    kk = min(k, n)
    picked = torch.full((B, S, kk), -1, dtype=torch.int64, device=q_I.device)
    scores = torch.full((B, S, kk), float("-inf"), dtype=torch.float32, device=q_I.device)
    if kk == 0 or S == 0:
        return picked, scores
    entry_tile = entry_tile or min(n, max(kk, 2048))
    query_tile = query_tile or max(1, TILE_ELEMS // max(1, B * G * entry_tile))
    first, stop = (visible[..., 0], visible[..., 1]) if visible.dim() == 3 else (torch.zeros_like(visible), visible)
    q_tiles = _tiles(S, query_tile)
    if q_I.is_meta:  # a dry run (tools/planner): shapes only, every tile planned over all n entries
        bounds = [(0, n)] * len(q_tiles)
    else:  # one host sync: the entries each tile may see
        bounds = torch.stack([torch.stack([first[:, lo:hi].amin(), stop[:, lo:hi].amax()]) for lo, hi in q_tiles])
        bounds = bounds.tolist()
    for (lo, hi), (e_lo, e_hi) in zip(q_tiles, bounds):
        best = None
        for e0 in range(max(0, e_lo), min(n, e_hi), entry_tile):
            e1 = min(e0 + entry_tile, n, e_hi)
            I = indexer_scores(q_I[:, lo:hi], w[:, lo:hi], keys[:, e0:e1], scale)  # (B, T, N)
            pos = torch.arange(e0, e1, device=keys.device)
            seen = (pos >= first[:, lo:hi, None]) & (pos < stop[:, lo:hi, None])
            best = merge_topk(best, order_keys(I, pos, seen), kk)
        if best is not None:
            picked[:, lo:hi], scores[:, lo:hi] = key_positions(best), key_scores(best)
    return picked, scores


def _gathered(keys: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """keys (B, n, E), idx (B, T, k) (-1 allowed) -> (rows (B T k,) into keys viewed (B n, E), (B, T, k, E) fp32)."""
    B, n, E = keys.shape
    rows = (idx.clamp_min(0) + torch.arange(B, device=idx.device)[:, None, None] * n).flatten()
    return rows, keys.reshape(B * n, E).index_select(0, rows).view(*idx.shape, E).float()


class PickedIndexScores(torch.autograd.Function):
    """I at the picked entries with a backward that recomputes each tile: saves q_I, w, keys and picked only
    (autograd through the gather would keep B S k (E + G) fp32 per layer: 393 KB per token at V4-Flash)."""

    @staticmethod
    def forward(ctx, q_I, w, keys, picked, scale: float, tile: int):
        B, S = picked.shape[:2]
        out = torch.empty(picked.shape, dtype=torch.float32, device=q_I.device)
        for lo, hi in _tiles(S, tile):
            _, kg = _gathered(keys, picked[:, lo:hi])
            a = torch.einsum("btge,btke->btgk", q_I[:, lo:hi].float(), kg).mul_(scale).relu_()
            out[:, lo:hi] = torch.einsum("btg,btgk->btk", w[:, lo:hi].float(), a)
        ctx.save_for_backward(q_I, w, keys, picked)
        ctx.scale, ctx.tile = scale, tile
        return out.masked_fill_(picked < 0, float("-inf"))

    @staticmethod
    @once_differentiable
    def backward(ctx, dI):
        q_I, w, keys, picked = ctx.saved_tensors
        scale, S, E = ctx.scale, picked.shape[1], keys.shape[-1]
        dq = torch.empty(q_I.shape, dtype=torch.float32, device=q_I.device)
        dw = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        dkeys = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        dI = dI.masked_fill(picked < 0, 0.0)
        for lo, hi in _tiles(S, ctx.tile):
            rows, kg = _gathered(keys, picked[:, lo:hi])
            q_t, d_t = q_I[:, lo:hi].float(), dI[:, lo:hi].float()
            a = torch.einsum("btge,btke->btgk", q_t, kg).mul_(scale)
            dw[:, lo:hi] = torch.einsum("btgk,btk->btg", a.relu(), d_t)
            da = (w[:, lo:hi].float()[..., None] * d_t[:, :, None, :]).mul_(a > 0).mul_(scale)  # (B, T, G, k)
            dq[:, lo:hi] = torch.einsum("btgk,btke->btge", da, kg)
            dkeys.view(-1, E).index_add_(0, rows, torch.einsum("btgk,btge->btke", da, q_t).reshape(-1, E))
        return dq.to(q_I.dtype), dw.to(w.dtype), dkeys.to(keys.dtype), None, None, None


def picked_index_scores(q_I: Tensor, w: Tensor, keys: Tensor, picked: Tensor, scale: float, *,
                        query_tile: int | None = None) -> Tensor:
    """The indexer's I at the picked entries: q_I (B, S, G, E), w (B, S, G), keys (B, n, E), picked (B, S, k) ->
    (B, S, k) fp32, -inf at -1 slots; differentiable in q_I, w and keys (what kl_to_indexer's gather of the full
    scores gives, without them)."""
    B, S, G, E = q_I.shape
    k = picked.shape[-1]
    tile = query_tile or max(1, TILE_ELEMS // max(1, B * k * (G + E)))
    return PickedIndexScores.apply(q_I, w, keys, picked, scale, tile)
