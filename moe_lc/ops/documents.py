"""Packed documents: which query rows may see which key columns when attention stays inside each document.

A micro-batch row of S tokens may hold several documents back to back (`data.document_mask`). Token t
then sees token u only if u <= t and both lie in the same document: the causal mask becomes
block-diagonal. `Documents` holds each row's document boundaries over the *full* sequence and answers,
for any query rows and key columns given as global position ranges (one device: the whole sequence;
a zig-zag CP rank: its two chunks; a ring step: the visiting rank's two chunks), the exact rectangles
to compute as `Piece`s:

  key range before the query range   at most one piece per row: the document that holds the first
                                     query of the range, if it started before the keys end (full);
  the same range (the diagonal)      one piece per document meeting it, causal (q and k are the same
                                     positions, so the usual top-left causal mask is exact);
  key range after the query range    nothing.

A query/key range pair with no shared document gives no piece: its block is skipped (ring attention
still moves the K/V). Every backend computes pieces (AttentionBackend.forward_pieces: one kernel call
per piece, or one varlen call per kind for flash-attn) and merges them by LSE, so a document may start
or end anywhere, span any number of chunks and be shorter than one: no padding, no divisibility rule.

`work` counts the attention score elements a piece list computes (a causal piece of n rows counts
n(n+1)/2), the measure the per-rank balance metric and the MFU use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class Piece:
    """One rectangle of attention: batch row `row`, local query rows `q`, local key columns `k`;
    causal = top-left causal over a square (q and k are the same positions)."""

    row: int
    q: slice
    k: slice
    causal: bool

    @property
    def work(self) -> int:
        """Score elements computed (the causal mask's upper triangle is not)."""
        n_q, n_k = self.q.stop - self.q.start, self.k.stop - self.k.start
        return n_q * (n_q + 1) // 2 if self.causal else n_q * n_k


Ranges = tuple[tuple[int, int], ...]  # global [start, stop) position ranges, concatenated in local order


class Documents:
    """Document boundaries of a micro-batch: row b holds documents [bounds[b][i], bounds[b][i+1]) of the
    full sequence [0, S). Built on the host from the loader's lengths; pieces are cached per
    (query ranges, key ranges), so every layer and the backward reuse one plan per micro-batch."""

    def __init__(self, lengths: Sequence[Sequence[int]], seq_len: int):
        self.seq_len = int(seq_len)
        self.bounds = []
        for b, row in enumerate(lengths):
            row = np.asarray(row, dtype=np.int64)
            if (row <= 0).any() or int(row.sum()) != self.seq_len:
                raise ValueError(f"row {b}: document lengths {row.tolist()} must be positive and sum to the "
                                 f"sequence length {self.seq_len}")
            self.bounds.append(np.concatenate([[0], np.cumsum(row)]))
        self._pieces: dict[tuple[Ranges, Ranges], tuple[Piece, ...]] = {}
        self.call_work = 0  # score elements one attention call computes on this rank (`plan_call`)
        self.chunks: tuple[tuple[int, int], ...] | None = None  # each cp rank's chunks when not zig-zag

    @classmethod
    def from_batch(cls, lengths: Sequence[Tensor | Sequence[int]] | None, batch: int, seq_len: int) -> "Documents":
        """From collate's "documents" (None: every row is one document)."""
        if lengths is None:
            return cls([[seq_len]] * batch, seq_len)
        rows = [t.tolist() if isinstance(t, Tensor) else list(t) for t in lengths]
        if len(rows) != batch:
            raise ValueError(f"{len(rows)} document-length rows for a batch of {batch}")
        return cls(rows, seq_len)

    @property
    def batch(self) -> int:
        return len(self.bounds)

    def positions(self) -> Tensor:
        """(B, S) int64: each token's position inside its document (RoPE under `document_positions`)."""
        out = np.empty((self.batch, self.seq_len), dtype=np.int64)
        for b, bounds in enumerate(self.bounds):
            starts = np.repeat(bounds[:-1], np.diff(bounds))
            out[b] = np.arange(self.seq_len) - starts
        return torch.from_numpy(out)

    def chunk_work(self, n_chunks: int) -> np.ndarray:
        """(n_chunks,) attention work of each of the sequence's equal chunks, summed over the rows: a query
        row's work is its position inside its document + 1 (the keys it sees)."""
        return (self.positions() + 1).view(self.batch, n_chunks, -1).sum((0, 2)).numpy()

    def balanced_chunks(self, cp: int) -> tuple[tuple[int, int], ...]:
        """Each cp rank's two of the 2cp chunks, heaviest paired with lightest by `chunk_work` (the pairing
        that minimizes the busiest rank's work; for one document it is zig-zag's), in position order."""
        order = np.argsort(self.chunk_work(2 * cp), kind="stable")
        return tuple(tuple(sorted((int(order[i]), int(order[2 * cp - 1 - i])))) for i in range(cp))

    def pieces(self, q_ranges: Ranges, k_ranges: Ranges) -> tuple[Piece, ...]:
        """The pieces that cover exactly what queries at `q_ranges` see of keys at `k_ranges` (each a
        tuple of global [start, stop) ranges, laid out one after another in the local tensors). Two
        ranges are either equal or disjoint (chunks)."""
        key = (tuple(q_ranges), tuple(k_ranges))
        if key not in self._pieces:
            self._pieces[key] = tuple(self._plan(*key))
        return self._pieces[key]

    def plan_call(self, q_ranges: Ranges, k_ranges_by_step: Sequence[Ranges]) -> list[tuple[Piece, ...]]:
        """The pieces of one attention call, per step (one step on one device; per ring step the visiting
        block's ranges), and its work recorded as `call_work`: every attention layer of the micro-batch
        makes the same call, so recording (not adding) keeps recomputed forwards from counting twice."""
        steps = [self.pieces(q_ranges, k) for k in k_ranges_by_step]
        self.call_work = sum(pieces_work(p) for p in steps)
        return steps

    def _plan(self, q_ranges: Ranges, k_ranges: Ranges):
        for row, bounds in enumerate(self.bounds):
            q_off = 0
            for qa, qb in q_ranges:
                k_off = 0
                for ka, kb in k_ranges:
                    if (ka, kb) == (qa, qb):
                        yield from self._diagonal(row, bounds, qa, qb, q_off, k_off)
                    elif kb <= qa:
                        yield from self._before(row, bounds, qa, qb, ka, kb, q_off, k_off)
                    elif ka < qb:
                        raise ValueError(f"query range {(qa, qb)} and key range {(ka, kb)} overlap without being equal")
                    k_off += kb - ka
                q_off += qb - qa

    @staticmethod
    def _diagonal(row, bounds, a, b, q_off, k_off):
        first = int(np.searchsorted(bounds, a, side="right")) - 1  # the document holding position a
        for d in range(first, len(bounds) - 1):
            lo, hi = max(a, int(bounds[d])), min(b, int(bounds[d + 1]))
            if lo >= hi:
                break
            yield Piece(row, slice(q_off + lo - a, q_off + hi - a), slice(k_off + lo - a, k_off + hi - a), True)

    @staticmethod
    def _before(row, bounds, qa, qb, ka, kb, q_off, k_off):
        d = int(np.searchsorted(bounds, qa, side="right")) - 1  # only the document holding qa reaches back
        start, stop = int(bounds[d]), int(bounds[d + 1])
        if start < kb:
            lo = max(ka, start)
            yield Piece(row, slice(q_off, q_off + min(qb, stop) - qa), slice(k_off + lo - ka, k_off + kb - ka), False)


def pieces_work(pieces: Sequence[Piece]) -> int:
    """Score elements a list of pieces computes."""
    return sum(p.work for p in pieces)

