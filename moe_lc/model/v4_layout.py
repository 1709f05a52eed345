"""Which rows and compressed entries a DeepSeek-V4 attention call reads when they are not simply one sequence from
position 0: packed documents (data.document_mask with data.document_positions) and context parallelism (a rank holds
spans of the sequence). The index arithmetic here is host-side numpy, planned once per micro-batch and layer shape.

Legend: B batch, S the whole sequence, S_loc this rank's rows, h halo rows before each span, S_ext = S_loc + spans h
(the extended rows), m tokens per entry, n entries of the whole sequence (padded to the most of any batch row),
n_own the entries this rank pools (padded to the most any rank and row pools), d an entry's width.

Every V4 computation is per row except three reads of other rows (report arXiv 2606.19348, sections 2.3 and 3.4.3):

    the window          a query reads itself and the W - 1 rows before it, of its own document
    a pooling window    entry w of a document pools that document's rows w m .. (w + 1) m - 1 (a trailing partial
                        window makes none); CSA's (overlap) also reads window w - 1's Ca half, the m rows before
    the entries         a query at document position p reads its document's entries w < (p + 1) // m (HCA: all of
                        them; CSA: the indexer's top-k of them)

so each span is preceded by its h = max(W - 1, c m - 1) earlier rows (c = 2 with overlap, else 1; `halo_rows`: a
window straddling a span boundary is whole in the extended rows), an entry is pooled by the span that holds its last
row (exactly one span in the world), and the pooled entries of every rank are gathered and put in the global order
(`EntryGrid.order`) before any query reads them. Without documents, entry w of the whole sequence is global entry w,
so visibility, the indexer's ties (by entry index) and every sum are the single device's. Rows before the sequence's
start are document -1: nothing real is in their document, so no query reads them.

`LocalRows` is the `context` seam of a V4 module on one device (identity exchanges; packed documents planned here);
moe_lc/parallel/cp/v4_context.py's is the context-parallel one (its exchanges are collectives over "cp").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

NEVER = 2 ** 62  # the document index of a padding entry: no query position reaches it


@dataclass
class EntryGrid:
    """The compressed entries of one rate: those this rank pools, and all of them in global order."""

    m: int
    last: Tensor      # (B, n_own) int64: the extended row of each pooled entry's last token (0 in padding)
    has_prev: Tensor  # (B, n_own) bool: window w - 1 is in the same document (CSA's overlap reads it)
    pos: Tensor       # (B, n_own) int64: the RoPE position of each pooled entry (its first token's)
    order: Tensor     # (B, n) int64: global entry -> its slot in the gathered (ranks * n_own) pooled entries
    doc: Tensor       # (B, n) int64: each global entry's document (-2: padding)
    index: Tensor     # (B, n) int64: its index w inside its document (NEVER: padding)

    def visible(self, doc_q: Tensor, pos_q: Tensor) -> Tensor:
        """doc_q, pos_q (B, s) of some query rows -> (B, s, n) bool: entry visible to the query."""
        ready = torch.div(pos_q + 1, self.m, rounding_mode="floor")
        return (self.doc[:, None, :] == doc_q[..., None]) & (self.index[:, None, :] < ready[..., None])


@dataclass
class RowLayout:
    """The extended rows of one attention call: per span its h earlier rows, then the span's own."""

    rows: Tensor   # (S_ext,) int64: global row of each extended row (negative: before the sequence)
    doc: Tensor    # (B, S_ext) int64: document of each extended row (-1: before the sequence)
    pos: Tensor    # (B, S_ext) int64: RoPE position of each extended row
    query: Tensor  # (S_loc,) int64: the extended rows that are this rank's own rows, in local order
    grid: EntryGrid | None
    halo: int
    spans: tuple   # ((global start, length), ...) this rank's spans, in local order


def halo_rows(window: int, rate: int, overlap: bool) -> int:
    """Earlier rows a span needs: the window's W - 1, a pooling window's reach back (c m - 1)."""
    return max(window - 1, ((2 if overlap else 1) * rate - 1) if rate else 0, 0)


def plan_rows(bounds: list, S: int, spans_by_rank: list, rank: int, halo: int, rate: int, overlap: bool,
              doc_positions: bool, device) -> RowLayout:
    """bounds: per batch row its document boundaries over [0, S) (0, ..., S); spans_by_rank: every rank's
    ((global start, length), ...) in local order; rate: tokens per entry (0: no entries); doc_positions: RoPE
    positions restart per document (else the global row)."""
    B = len(bounds)
    ext, query, own_ext = [], [], {}
    for r, spans in enumerate(spans_by_rank):  # every rank's extended layout: where each row is pooled
        o, own = 0, np.full(S, -1, dtype=np.int64)
        for start, length in spans:
            own[start:start + length] = np.arange(o + halo, o + halo + length)
            if r == rank:
                ext.append(np.arange(start - halo, start + length))
                query.append(np.arange(o + halo, o + halo + length))
            o += halo + length
        own_ext[r] = own
    rows = np.concatenate(ext)
    doc = np.full((B, rows.size), -1, dtype=np.int64)
    pos = np.zeros((B, rows.size), dtype=np.int64)
    real, starts = rows >= 0, []
    for b, bd in enumerate(bounds):
        bd = np.asarray(bd, dtype=np.int64)
        d_of = np.searchsorted(bd, rows[real], side="right") - 1
        doc[b, real] = d_of
        pos[b, real] = rows[real] - (bd[d_of] if doc_positions else 0)
        starts.append(bd)
    grid = _entry_grid(starts, S, spans_by_rank, own_ext, rank, rate, doc_positions, device) if rate else None
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return RowLayout(t(rows), t(doc), t(pos), t(np.concatenate(query)), grid, halo,
                     tuple(spans_by_rank[rank]))


def _entry_grid(bounds, S, spans_by_rank, own_ext, rank, m, doc_positions, device) -> EntryGrid:
    """Every batch row's entries in global order, which rank pools each (the one holding its last row), and this
    rank's pooled slots (module docstring)."""
    owner = np.full(S, -1, dtype=np.int64)
    for r, spans in enumerate(spans_by_rank):
        for start, length in spans:
            owner[start:start + length] = r
    ranks, per_row = len(spans_by_rank), []
    for bd in bounds:
        d, w, first = [], [], []
        for i in range(len(bd) - 1):
            k = (bd[i + 1] - bd[i]) // m
            d.append(np.full(k, i))
            w.append(np.arange(k))
            first.append(bd[i] + np.arange(k) * m)
        d, w, first = (np.concatenate(a).astype(np.int64) for a in (d, w, first))
        r_of = owner[first + m - 1]
        slot = np.zeros_like(r_of)
        for r in range(ranks):  # the j-th entry a rank pools, in global order
            slot[r_of == r] = np.arange(int((r_of == r).sum()))
        per_row.append((d, w, first, r_of, slot))
    n = max(p[0].size for p in per_row)
    n_own = max([int((p[3] == r).sum()) for p in per_row for r in range(ranks)] + [0])
    B = len(bounds)
    last, has_prev, pos = (np.zeros((B, n_own), dtype=np.int64) for _ in range(3))
    has_prev = has_prev.astype(bool)
    order, doc, index = np.zeros((B, n), np.int64), np.full((B, n), -2, np.int64), np.full((B, n), NEVER, np.int64)
    for b, (d, w, first, r_of, slot) in enumerate(per_row):
        k = d.size
        order[b, :k], doc[b, :k], index[b, :k] = r_of * n_own + slot, d, w
        mine = r_of == rank
        j = slot[mine]
        last[b, j] = own_ext[rank][first[mine] + m - 1]
        has_prev[b, j] = w[mine] > 0
        pos[b, j] = w[mine] * m if doc_positions else first[mine]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return EntryGrid(m, t(last), t(has_prev), t(pos), t(order), t(doc), t(index))


def needs_document_positions(positions: Tensor) -> None:
    """Each document is compressed on its own grid from its own position 0: its positions must restart."""
    if positions.dim() != 2:
        raise ValueError("packed documents with DeepSeek-V4 attention need positions (B, S) restarting in each "
                         "document (data.document_positions = true)")


class LocalRows:
    """The `context` seam on one device: the whole sequence is here (no halo, nothing exchanged); with packed
    documents (docs: moe_lc/ops/documents.py's Documents) the windows and entries stay inside each document."""

    ranks = 1

    def __init__(self):
        self._cache: dict = {}

    def layout(self, attn, x_BSD: Tensor, positions: Tensor, docs) -> RowLayout | None:
        """None without documents: the module's own whole-sequence path."""
        if docs is None:
            return None
        needs_document_positions(positions)
        B, S = x_BSD.shape[:2]
        key = (S, attn.compress_rate, attn.overlap, positions.dim())
        held = self._cache.get(key)
        if held is None or held[0] is not docs:  # one plan per micro-batch and layer shape (the docs object kept)
            held = docs, plan_rows(docs.bounds, S, [((0, S),)], 0, 0, attn.compress_rate, attn.overlap,
                                   positions.dim() == 2, x_BSD.device)
            self._cache = {k: v for k, v in self._cache.items() if v[0] is docs} | {key: held}
        return held[1]

    def extend(self, x_BSD: Tensor, rows: RowLayout) -> Tensor:
        return x_BSD

    def gather_later(self, pooled_Bnd: Tensor, grid: EntryGrid):
        """(B, n_own, d) -> a call giving (B, n, d) in global order (here the same entries, padding slots included;
        under cp the gather is in flight until the call)."""
        idx = grid.order[..., None].expand(-1, -1, pooled_Bnd.shape[-1])
        out = pooled_Bnd.gather(1, idx) if pooled_Bnd.shape[1] else pooled_Bnd.new_zeros(*idx.shape)
        return lambda: out

    def __repr__(self) -> str:
        return "LocalRows()"
