"""The ring DeepSeek Sparse Attention runs on: where each rank's rows sit in the sequence, the visit of every
rank's blocks (forward), the same with gradient accumulators that travel home (backward), and the
indexer's selection pass.

Legend: B batch, Q this rank's query rows, T a block's rows (every rank holds as many), E indexer head dim.

A ring is any object with `rank`, `size` and `shift(tensors) -> in-flight` whose `wait()` gives the
tensors of rank - 1 (moe_lc/parallel/cp/ring.py's P2PRing over the "cp" group, counted by comm.py);
`OneRank` is the ring of a single device, so one code path serves both. At step s rank r holds the blocks
of rank (r - s) mod size; the next shift is in flight while the current block is computed.

`RingLayout` says which global positions each rank's rows hold: the zig-zag chunks under CP (or a
micro-batch's balanced placement), the whole sequence on one device. Masks are built from positions
(and document ids), so any placement and any packing of documents is exact with no plan of pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moe_lc.ops.dsa_select import (Selection, indexer_scores, key_positions, key_scores, merge_topk,
                                   selection_from_keys, tile_topk, visible)
from moe_lc.ops.dsa_select_cpu import block_topk
from moe_lc.ops.sparse_attention_cpu import cpu_form

KEY_TILE = 4096  # key columns scored at once by the selection pass (it merges top-k per tile)
QUERY_TILE = 4096


class _Ready:
    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self):
        return self._tensors


class OneRank:
    """The ring of one device: one step, nothing moves."""

    rank, size = 0, 1

    def shift(self, tensors):
        return _Ready(list(tensors))


@dataclass(frozen=True)
class RingLayout:
    """chunks[r]: the global chunk ids ring rank r holds, in local order, each `chunk` positions long;
    rank: this rank. docs: the micro-batch's packed documents (moe_lc/ops/documents.py) or None."""

    chunks: tuple[tuple[int, ...], ...]
    chunk: int
    rank: int
    docs: object = None

    @classmethod
    def one_device(cls, seq_len: int, docs=None) -> "RingLayout":
        return cls(((0,),), seq_len, 0, docs)

    def __post_init__(self):
        for ids in self.chunks:  # positions ascend along every rank's rows: ties break by a cumsum over them
            assert list(ids) == sorted(ids), self.chunks

    def positions(self, rank: int, device=None) -> Tensor:
        """(T,) int64: the global positions of rank `rank`'s rows (ascending)."""
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk, device=device) for c in self.chunks[rank]])

    def doc_ids(self, positions: Tensor) -> Tensor | None:
        """(B, n) int64 document ids of global positions (n,); None without packed documents."""
        if self.docs is None:
            return None
        pos = positions.cpu().numpy()
        ids = np.stack([np.searchsorted(bounds, pos, side="right") - 1 for bounds in self.docs.bounds])
        return torch.from_numpy(ids).to(positions.device)

    def locate(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Global positions (n,) -> (ring rank holding each, its row in that rank's shard)."""
        n_chunks = sum(len(c) for c in self.chunks)
        owner = torch.empty(n_chunks, dtype=torch.int64)
        slot = torch.empty(n_chunks, dtype=torch.int64)
        for r, ids in enumerate(self.chunks):
            for i, c in enumerate(ids):
                owner[c], slot[c] = r, i
        owner, slot = owner.to(positions.device), slot.to(positions.device)
        c = positions // self.chunk
        return owner[c], slot[c] * self.chunk + positions % self.chunk


def ring_visit(ring, blocks: list[Tensor], visit) -> None:
    """visit(src, blocks) for the blocks of every ring rank in turn, from this rank's own."""
    for step in range(ring.size):
        last = step == ring.size - 1
        in_flight = None if last else ring.shift(blocks)
        visit((ring.rank - step) % ring.size, blocks)
        if not last:
            blocks = in_flight.wait()


def ring_visit_grads(ring, blocks: list[Tensor], visit, n_grads: int) -> list[Tensor]:
    """Like `ring_visit`, where visit(src, blocks) returns gradients for the first n_grads visiting blocks
    (fp32, or None for nothing): each block's accumulator travels one step behind it and the last hop
    brings it home. Returns this rank's own blocks' summed gradients (fp32)."""
    acc_in_flight = None
    for step in range(ring.size):
        last = step == ring.size - 1
        blocks_in_flight = None if last else ring.shift(blocks)
        grads = visit((ring.rank - step) % ring.size, blocks)
        if step == 0:
            acc = [torch.zeros_like(b, dtype=torch.float32) for b in blocks[:n_grads]]
        else:
            acc = acc_in_flight.wait()
        for a, g in zip(acc, grads or ()):
            if g is not None:
                a += g
        if not last:
            blocks = blocks_in_flight.wait()
        acc_in_flight = ring.shift(acc)
    return acc_in_flight.wait()


TILE_ELEMS = 1 << 23  # elements of the largest fp32 temporary one tile of a pass may make (32 MiB)


def row_tiles(n: int, size: int, meta: bool = False) -> list[slice]:
    """[lo, lo + size) slices covering 0 .. n; with `meta` (shapes only: a dry run) the first alone, whose
    working memory every tile repeats (tracing them all would cost minutes at 128K and tell nothing more)."""
    tiles = [slice(lo, min(lo + size, n)) for lo in range(0, n, size)]
    return tiles[:1] if meta else tiles


def tile_rows(per_row: int, cap: int = QUERY_TILE) -> int:
    """Query rows per tile so that rows x per_row elements stay near TILE_ELEMS (1 .. cap)."""
    return max(1, min(cap, TILE_ELEMS // max(1, per_row)))


@torch.no_grad()
def select(ring, layout: RingLayout, q: Tensor, w: Tensor, k: Tensor, scale: float, topk: int
           ) -> tuple[Selection, Tensor]:
    """The indexer's top-k of this rank's queries over every visible key of the ring: q (B, Q, G, E),
    w (B, Q, G), k (B, T, E) this rank's keys (they travel). -> (the selection, its scores (B, Q, topk) fp32).
    Tiles of QUERY_TILE x KEY_TILE; a tile whose keys all lie after its queries is skipped. On the meta device
    (a dry run) each block's first tile is scored, for its working memory, and the selection has no values.
    On a CPU each block's exact top-k comes from dsa_select_cpu.block_topk (small tiles, no sort per tile)."""
    q_pos = layout.positions(layout.rank, q.device)
    q_doc = layout.doc_ids(q_pos)
    T = k.shape[1]
    if cpu_form(q):
        return _select_cpu(ring, layout, q, w, k, scale, topk, q_pos, q_doc)
    tiles = row_tiles(q.shape[1], QUERY_TILE)
    best = [None] * len(tiles)

    def visit(src, blocks):
        if q.is_meta:
            indexer_scores(q[:, tiles[0]], w[:, tiles[0]], blocks[0][:, :KEY_TILE], scale)
            return
        k_pos = layout.positions(src, q.device)
        k_doc = layout.doc_ids(k_pos)
        for i, qt in enumerate(tiles):
            for kt in row_tiles(k_pos.shape[0], KEY_TILE):
                if k_pos[kt].min() > q_pos[qt].max():
                    continue
                seen = visible(q_pos[qt], k_pos[kt], None if q_doc is None else q_doc[:, qt],
                               None if k_doc is None else k_doc[:, kt])
                keys = tile_topk(indexer_scores(q[:, qt], w[:, qt], blocks[0][:, kt], scale), k_pos[kt], seen, topk,
                                 best[i])
                best[i] = merge_topk(best[i], keys, topk)

    ring_visit(ring, [k], visit)
    if q.is_meta:
        shape = (q.shape[0], q.shape[1], topk)
        return (Selection(torch.empty(shape, dtype=torch.int32, device=q.device), layout.locate, ring.size, T),
                torch.empty(shape, dtype=torch.float32, device=q.device))
    return selection_from_keys(torch.cat(best, dim=1), layout.locate, ring.size, T)


def _select_cpu(ring, layout: RingLayout, q: Tensor, w: Tensor, k: Tensor, scale: float, topk: int, q_pos: Tensor,
                q_doc: Tensor | None) -> tuple[Selection, Tensor]:
    """`select` on a CPU: every visiting block's exact top-k (dsa_select_cpu.block_topk), merged block by block a
    tile of rows at a time (no full-size temporaries: a fresh large tensor costs its page faults)."""
    B, Q = q.shape[:2]
    qf, wf = q.float(), w.float()
    positions = torch.empty(B, Q, topk, dtype=torch.int32)
    scores = torch.empty(B, Q, topk)
    best = torch.empty(B, Q, topk, dtype=torch.int64) if ring.size > 1 else None

    def final(lo, hi, keys):
        positions[:, lo:hi] = key_positions(keys)
        scores[:, lo:hi] = key_scores(keys)

    def merge(lo, hi, keys):
        best[:, lo:hi] = keys if step == 0 else merge_topk(best[:, lo:hi], keys, topk)

    step = 0

    def visit(src, blocks):
        nonlocal step
        k_pos = layout.positions(src, q.device)
        block_topk(qf, wf, blocks[0].float(), q_pos, k_pos, q_doc, layout.doc_ids(k_pos), scale, topk,
                   merge if best is not None else final)
        step += 1

    ring_visit(ring, [k], visit)
    if best is not None:
        for lo in range(0, Q, QUERY_TILE):
            final(lo, lo + QUERY_TILE, best[:, lo:lo + QUERY_TILE])
    return Selection(positions, layout.locate, ring.size, k.shape[1]), scores
