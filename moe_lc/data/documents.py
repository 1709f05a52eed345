"""Document boundaries in a token stream, and the document lengths of one training window.

A stream is documents laid end to end, each one its tokens followed by EOS (`doc0 EOS doc1 EOS ...`).
Its boundaries are kept as `starts`: (n_docs,) int64, sorted, strictly increasing, starts[0] == 0 for a
non-empty stream, every start < n_tokens; document k is tokens[starts[k] : starts[k+1]] (the last one
runs to the end of the stream). Token files written by tools/prepare_data.py store them (token_file.py);
for older files they are recovered from the EOS positions (`starts_from_eos`): the next document starts
after each EOS.

A window's documents (`window_documents`) are what a sample's `"documents"` holds: the lengths of the
runs of input positions that belong to one document, summing to the window's length. The first may be
the tail of a document the window cut, the last the head of one.
"""

from __future__ import annotations

import numpy as np

# Tokens compared with EOS at a time: bounds the temporary bool array when scanning a large memmap.
EOS_SCAN_CHUNK = 1 << 26


def starts_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """(n_docs,) int64 document starts of a stream whose documents each end with `eos_id`.

    0 opens the first document and each EOS closes one, so the next starts right after it; an EOS
    that is the stream's last token opens nothing. A stream whose tail lacks the EOS (a cut file)
    keeps that tail as its last document. One pass over the stream, chunked to bound memory.
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    ends = [np.flatnonzero(np.asarray(tokens[lo : lo + EOS_SCAN_CHUNK]) == eos_id) + lo
            for lo in range(0, n, EOS_SCAN_CHUNK)]
    after_eos = np.concatenate(ends).astype(np.int64) + 1
    return np.concatenate([[0], after_eos[after_eos < n]]).astype(np.int64)


def check_starts(starts: np.ndarray, n_tokens: int, where: str) -> np.ndarray:
    """`starts` as int64 if it is a valid boundary array for a stream of n_tokens, else ValueError
    naming `where` (the file or caller) and the first broken rule."""
    starts = np.asarray(starts)
    if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
        raise ValueError(f"{where}: document starts must be a 1-D integer array, got {starts.dtype} {starts.shape}")
    starts = starts.astype(np.int64, copy=False)
    if n_tokens == 0:
        if len(starts):
            raise ValueError(f"{where}: {len(starts)} document starts for an empty stream")
        return starts
    if len(starts) == 0 or starts[0] != 0:
        raise ValueError(f"{where}: document starts must begin with 0 (got {starts[:1].tolist()})")
    if starts[-1] >= n_tokens:
        raise ValueError(f"{where}: document start {int(starts[-1])} lies past the stream's {n_tokens} tokens")
    steps = np.diff(starts)
    if len(steps) and steps.min() <= 0:
        k = int(np.argmax(steps <= 0))
        raise ValueError(f"{where}: document starts must increase strictly: starts[{k}] = {int(starts[k])}, "
                         f"starts[{k + 1}] = {int(starts[k + 1])}")
    return starts


def window_documents(starts: np.ndarray, begin: int, length: int) -> np.ndarray:
    """Lengths (n,) int64 of the documents over stream positions [begin, begin + length), summing to
    `length`: one entry per document that has a position in the window, in order.

    Two binary searches and a slice of the boundaries inside the window: O(log n_docs + n), whatever
    the stream's size (no scan of the tokens).
    """
    end = begin + length
    first_inside = np.searchsorted(starts, begin, side="right")  # starts <= begin belong to the first doc
    last_inside = np.searchsorted(starts, end, side="left")  # starts >= end lie past the window
    cuts = np.concatenate([[begin], starts[first_inside:last_inside], [end]]).astype(np.int64)
    return np.diff(cuts)
