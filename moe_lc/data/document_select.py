"""Per-source document selection before packing: join documents that share a metadata key into one long
document, keep documents within a length range, repeat long ones; the result is the stream the source's
windows are cut from.

Long-context data recipes build long documents and give them more weight: ProLong (Gao et al., "How to
Train Long-Context Language Models (Effectively)", 2024; princeton-nlp/ProLong) concatenates the files
of a code repository into one document and keeps long books and repositories; Fu et al. ("Data
Engineering for Scaling Language Models to 128K Context", 2024) upsample long documents within each
domain. Here, per source:

- `concat_by = FIELD`: documents with the same non-empty value of metadata FIELD become one document,
  its members in corpus order, placed where its first member was (documents without a value stay
  alone). The EOS between members stays in the tokens (a separator), but the boundary does not: the
  joined document is one document to "documents" and so to document masking.
- `min_doc_tokens` / `max_doc_tokens`: keep documents (after joining) with at least / at most that many
  tokens (0 = no bound).
- `upsample_min_tokens = L`, `upsample_factor = k`: documents of at least L tokens appear k times per
  pass over the source (the copies follow the whole selection, so they fall far apart in the stream).

Selection is a pure function of the corpus and these settings: a resumed run packs the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_lc.data.token_corpus import SegmentStream, TokenCorpus


@dataclass(frozen=True)
class Selection:
    concat_by: str = ""
    min_doc_tokens: int = 0
    max_doc_tokens: int = 0
    upsample_min_tokens: int = 0
    upsample_factor: int = 1

    @property
    def active(self) -> bool:
        """Whether the stream differs from the corpus as it lies on disk."""
        return bool(self.concat_by) or self.min_doc_tokens > 0 or self.max_doc_tokens > 0 or self.upsample_factor > 1


def group_first_member(keys: list) -> np.ndarray:
    """(n,) int64: for each document, the index of the first document with its key (itself when its
    key is None or '')."""
    first: dict = {}
    out = np.arange(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        if key is not None and key != "":
            out[i] = first.setdefault(key, i)
    return out


def select_documents(corpus: TokenCorpus, selection: Selection, where: str = ""):
    """(SegmentStream of the selected documents end to end, (n,) int64 document starts in it, stats dict).

    stats: documents (in the corpus), joined (documents after joining), kept (after the length bounds),
    upsampled (kept documents repeated), tokens (of the stream). ValueError (naming `where` when given)
    when no document is kept, or when `concat_by` names a field no document has a value for."""
    files, begins, lengths = corpus.documents()
    n = len(lengths)
    at = f"{where}: " if where else ""
    if selection.concat_by:
        keys = corpus.metadata(selection.concat_by)
        if n and all(key is None or key == "" for key in keys):
            raise ValueError(f"{at}concat_by={selection.concat_by!r}: no document has a value for it (null or empty "
                             f"in all {n:,}), so nothing would be joined; name a field its documents carry")
        first = group_first_member(keys)
    else:
        first = np.arange(n, dtype=np.int64)
    order = np.lexsort((np.arange(n), first))  # groups together, by first appearance; members in corpus order
    opens = np.flatnonzero(np.r_[True, first[order][1:] != first[order][:-1]]) if n else np.zeros(0, np.int64)
    group_len = np.add.reduceat(lengths[order], opens) if n else np.zeros(0, np.int64)
    group_end = np.append(opens[1:], n)

    keep = group_len >= selection.min_doc_tokens
    if selection.max_doc_tokens:
        keep &= group_len <= selection.max_doc_tokens
    kept = np.flatnonzero(keep)
    if len(kept) == 0:
        longest = int(group_len.max()) if n else 0
        raise ValueError(f"{at}no document has between {selection.min_doc_tokens} and "
                         f"{selection.max_doc_tokens or 'any number of'} tokens (the longest has {longest})")
    long_ones = kept[group_len[kept] >= selection.upsample_min_tokens] if selection.upsample_factor > 1 else kept[:0]
    occurrences = np.concatenate([kept] + [long_ones] * (selection.upsample_factor - 1))

    sizes = group_end[occurrences] - opens[occurrences]  # members per occurrence
    first_member = np.cumsum(sizes) - sizes
    members = order[np.arange(sizes.sum()) - np.repeat(first_member, sizes) + np.repeat(opens[occurrences], sizes)]
    member_len = lengths[members]
    member_offset = np.cumsum(member_len) - member_len
    starts = member_offset[first_member]

    # read contiguous runs of members (neighbours in one file) as one segment
    contiguous = np.r_[False, (files[members][1:] == files[members][:-1])
                       & (begins[members][1:] == begins[members][:-1] + member_len[:-1])]
    seg = np.flatnonzero(~contiguous)
    stream = SegmentStream(corpus.arrays, files[members][seg], begins[members][seg], np.add.reduceat(member_len, seg))
    stats = {"documents": n, "joined": len(opens), "kept": len(kept), "upsampled": len(long_ones),
             "tokens": len(stream)}
    return stream, starts.astype(np.int64), stats
