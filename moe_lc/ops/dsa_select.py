"""DeepSeek Sparse Attention's selection: the lightning indexer's scores and an exact, layout-free top-k.

Legend: B batch, Q query rows (this rank's), K key columns of one block, G indexer heads, E indexer head
dim, k = index_topk.

    I(t, s) = sum_g w(t, g) * relu(scale * q(t, g) . k(s))      (DeepSeek-V3.2 report, eq. 1; transformers'
                                                                   DeepseekV32Indexer: scale = E^-0.5, w
                                                                   already carries G^-0.5)

A query sees key s when s is at or before it and, with packed documents, in its document (`visible`).

Top-k order: the higher score first, then the earlier position. With that total order the k winners of a
query do not depend on how its keys are split into blocks, so a zig-zag ring that merges one visiting block
at a time selects exactly what one device selects (ReLU makes exact ties, e.g. at 0, common). Each
candidate is one int64 `key`: the fp32 score's bits mapped to an order-preserving int32 in the high half,
2^32 - 1 - position in the low half; torch.topk over keys is then the exact order, and merging is a topk
of the union. A key that is not visible is `HIDDEN` (below every real key).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

HIDDEN = torch.iinfo(torch.int64).min
_LOW = (1 << 32) - 1
# rows x heads x keys of the fp32 score temporaries one tile of `indexer_scores` makes (about 64 MiB)
TILE_ELEMS = 1 << 24


def visible(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None = None, k_doc: Tensor | None = None) -> Tensor:
    """q_pos (Q,), k_pos (K,) global positions; q_doc (B, Q), k_doc (B, K) document ids or None ->
    (B or 1, Q, K) bool: key at or before the query, in the same document."""
    seen = (k_pos[None, :] <= q_pos[:, None])[None]
    if q_doc is not None:
        seen = seen & (q_doc[:, :, None] == k_doc[:, None, :])
    return seen


def indexer_scores(q: Tensor, w: Tensor, k: Tensor, scale: float) -> Tensor:
    """q (B, Q, G, E), w (B, Q, G), k (B, K, E) -> I (B, Q, K) fp32, in tiles of query rows so the
    (rows, G, K) temporaries stay near TILE_ELEMS."""
    B, Q, G, _ = q.shape
    K = k.shape[1]
    out = torch.empty(B, Q, K, dtype=torch.float32, device=q.device)
    rows = max(1, TILE_ELEMS // max(1, B * G * K))
    kf = k.float()
    for lo in range(0, Q, rows):
        qs = q[:, lo:lo + rows].float()
        logits = torch.einsum("bqge,bke->bqgk", qs, kf).mul_(scale).relu_()
        out[:, lo:lo + rows] = torch.einsum("bqg,bqgk->bqk", w[:, lo:lo + rows].float(), logits)
    return out


def key_low(pos: Tensor) -> Tensor:
    """The low half of the keys of positions `pos`: 2^32 - 1 - position, so the earlier position ranks higher."""
    return _LOW - pos.to(torch.int64)


def order_keys(scores: Tensor, k_pos: Tensor, seen: Tensor) -> Tensor:
    """scores (B, Q, K) fp32, k_pos (K,) or (B, Q, K) int64, seen (B or 1, Q, K) -> int64 keys (B, Q, K): the
    exact top-k order (module docstring); HIDDEN where not seen."""
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 and 0.0 tie, as floats do
    ordered = torch.where(bits >= 0, bits, -1 - (bits & 0x7FFFFFFF))  # negative floats: larger magnitude lower
    keys = (ordered << 32) | key_low(k_pos)
    return torch.where(seen, keys, torch.full_like(keys, HIDDEN))


def tile_topk(scores: Tensor, k_pos: Tensor, seen: Tensor, k: int, best: Tensor | None = None) -> Tensor:
    """Keys (B, Q, m) of one tile's candidates for the running top-k `best` (B, Q, k) (None: none yet):
    scores (B, Q, K) fp32, k_pos (K,) ascending, seen (B or 1, Q, K), or None where hidden scores are -inf
    already; `merge_topk(best, candidates, k)` is then the exact top-k of both. With a full `best`, only
    scores >= its k-th score can enter (ties too: an earlier position may win), usually few: they are packed
    with nonzero. Otherwise the tile's own exact top-k: a float topk finds each row's k-th score v; scores
    above v win, and of those equal to v the earliest positions fill the rest (a cumsum over the tie mask
    ranks them). Hidden columns score -inf."""
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    if best is not None:
        floor = key_scores(best[..., -1:])
        cand = scores >= floor
        counts = cand.count_nonzero(-1)
        m = int(counts.max()) if counts.numel() else 0
        if torch.isfinite(floor).all() and m <= k:
            return _packed(scores, k_pos, cand, counts, m)
    kk = min(k, scores.shape[-1])
    v = scores.topk(kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, tie = scores > v, scores == v
    need = kk - above.count_nonzero(-1)
    chosen = above | tie
    crowded = tie.count_nonzero(-1) > need  # rows with more ties at v than places left: rank them
    if crowded.any():
        rows = crowded.nonzero(as_tuple=True)
        t = tie[rows]
        chosen[rows] = above[rows] | (t & (t.cumsum(-1) <= need[rows][:, None]))
    return _packed(scores, k_pos, chosen, chosen.count_nonzero(-1), kk)


def _packed(scores: Tensor, k_pos: Tensor, chosen: Tensor, counts: Tensor, m: int) -> Tensor:
    """Keys (B, Q, m) of the `chosen` (B, Q, K) entries of each row (counts (B, Q) of them, at most m),
    padded with HIDDEN."""
    B, Q, _ = scores.shape
    out = torch.full((B, Q, max(m, 1)), HIDDEN, dtype=torch.int64, device=scores.device)
    b, q, col = chosen.nonzero(as_tuple=True)  # row-major: each row's entries together, in column order
    if col.numel():
        row = b * Q + q
        first = torch.cumsum(counts.flatten(), 0) - counts.flatten()
        slot = torch.arange(col.numel(), device=col.device) - first[row]
        keys = order_keys(scores[b, q, col], k_pos[col], torch.ones_like(col, dtype=torch.bool))
        keys = torch.where(torch.isneginf(scores[b, q, col]), torch.full_like(keys, HIDDEN), keys)
        out.view(B * Q, -1)[row, slot] = keys
    return out


def merge_topk(best: Tensor | None, keys: Tensor, k: int) -> Tensor:
    """The k largest of `best` (B, Q, k) and `keys` (B, Q, K) along the last dim, sorted descending."""
    pool = keys if best is None else torch.cat([best, keys], dim=-1)
    if pool.shape[-1] < k:  # fewer candidates than k so far: pad with HIDDEN
        pad = pool.new_full((*pool.shape[:-1], k - pool.shape[-1]), HIDDEN)
        pool = torch.cat([pool, pad], dim=-1)
    return pool.topk(k, dim=-1, sorted=True).values


def key_scores(keys: Tensor) -> Tensor:
    """int64 keys -> their fp32 scores (-inf where HIDDEN)."""
    hi = keys >> 32
    bits = torch.where(hi >= 0, hi, (-1 - hi) | -0x80000000).to(torch.int32)
    return torch.where(keys == HIDDEN, torch.full_like(bits.float(), float("-inf")), bits.view(torch.float32))


def key_positions(keys: Tensor) -> Tensor:
    """int64 keys -> their global positions (-1 where HIDDEN)."""
    return torch.where(keys == HIDDEN, torch.full_like(keys, -1), _LOW - (keys & _LOW))


@dataclass
class Groups:
    """A selection grouped by the ring rank holding each key, for one ring pass (made by `Selection.groups`,
    dropped after the pass: only the int32 positions stay between forward and backward).

    owner, local (B, Q, k): the ring rank holding each selected key and its row in that rank's shard (empty
    slots: owner = n_ranks, local = 0); order (B, Q, k): slots sorted by owner (stable), so rank r's slots of
    a query are order[..., start[r]:start[r] + count[r]]; start, count (n_ranks, B, Q); m_max: on the meta
    device (a dry run: no values), the slots every block is planned for."""

    owner: Tensor
    local: Tensor
    order: Tensor
    start: Tensor
    count: Tensor
    m_max: int | None = None

    def block(self, src: int) -> tuple[Tensor, Tensor] | None:
        """The slots whose key lives on ring rank `src`: (slots (B, Q, m) into the k dim, rows (B, Q, m)
        into src's shard), m = the most any query has there, padded with slot -1 / row 0; None when no
        query selected a key there."""
        count = self.count[src]
        m = self.m_max if self.m_max is not None else int(count.max()) if count.numel() else 0
        if m == 0:
            return None
        ar = torch.arange(m, device=count.device)
        take = (self.start[src][..., None] + ar).clamp_max(self.order.shape[-1] - 1)
        slots = torch.gather(self.order, -1, take)
        inside = ar < count[..., None]
        rows = torch.gather(self.local, -1, slots)
        return torch.where(inside, slots, -1), torch.where(inside, rows, 0)


@dataclass
class Selection:
    """What the indexer selected for this rank's queries: positions (B, Q, k) int32 global positions in the
    top-k order, -1 for an empty slot (fewer visible keys than k: the query attends to all it sees); what
    DeepSeek Sparse Attention keeps from forward to backward (4 bytes per query and slot). locate(positions
    (N,)) -> (ring rank holding each, its row there); n_ranks, block_rows: the ring's size and rows per rank.
    probs: None, or a dict the caller hands the sparse attention to keep its forward's head-summed
    probabilities in ({"lse": the lse it returned, "p": (B, Q, k) fp32}) where that forward has them anyway (a
    CPU ring of one rank), for `selected_probs` to take instead of another pass."""

    positions: Tensor
    locate: object
    n_ranks: int
    block_rows: int
    probs: dict | None = None

    @property
    def valid(self) -> Tensor:
        return self.positions >= 0

    def with_positions(self, positions: Tensor) -> "Selection":
        """The same selection over `positions` as autograd gave them back (a Function saves them as a tensor,
        so what backward keeps is counted and hooked like any saved activation)."""
        return Selection(positions, self.locate, self.n_ranks, self.block_rows)

    def groups(self) -> Groups:
        """The slots grouped by owning rank (see `Groups`)."""
        pos = self.positions.long()
        valid = pos >= 0
        if pos.is_meta:  # a dry run: shapes only; every block planned for min(k, its rows) slots
            meta = torch.zeros_like(pos)
            return Groups(meta, meta, meta, meta.new_zeros(self.n_ranks, *pos.shape[:2]),
                          meta.new_zeros(self.n_ranks, *pos.shape[:2]), min(pos.shape[-1], self.block_rows))
        owner, local = self.locate(pos.clamp_min(0).flatten())
        owner = torch.where(valid, owner.view_as(pos), self.n_ranks)
        local = torch.where(valid, local.view_as(pos), 0)
        order = torch.argsort(owner, dim=-1, stable=True)
        ranks = torch.arange(self.n_ranks, device=pos.device)
        count = (owner[None] == ranks[:, None, None, None]).sum(-1)  # (n_ranks, B, Q)
        return Groups(owner, local, order, torch.cumsum(count, 0) - count, count)


def selection_from_keys(keys: Tensor, locate, n_ranks: int, block_rows: int) -> tuple[Selection, Tensor]:
    """(Selection, scores (B, Q, k) fp32, -inf at empty slots) of keys (B, Q, k) from `merge_topk`."""
    return Selection(key_positions(keys).to(torch.int32), locate, n_ranks, block_rows), key_scores(keys)
