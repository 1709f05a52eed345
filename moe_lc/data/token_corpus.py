"""A source's tokens as one corpus: a token file, the shards tools/prepare_data.py wrote, or a glob of
either, opened as arrays with their document starts (and metadata on request), and read as one stream.

Where a source's `path` leads, for split s:
- PREFIX.s.shards.json (prepare_data's manifest, written once a split is complete): the shards it lists,
  PREFIX.s.00000, PREFIX.s.00001, ... in order;
- else PREFIX.s.json: one token file (as prepare_data wrote them before shards);
- a path with glob characters (`data/books-*`) matches such prefixes; their corpora are joined in
  sorted order.
Shards of an interrupted prepare (no manifest yet) are refused, so a run never trains on part of a
corpus. Every file must be of the run's tokenizer.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_lc.data.token_file import check_vocab, open_token_file, read_document_metadata, read_token_meta

MANIFEST_SUFFIX = ".shards.json"


def manifest_path(prefix: str | Path, split: str) -> Path:
    """PREFIX.split.shards.json: the list of a split's shards, written when the split is complete."""
    return Path(f"{prefix}.{split}{MANIFEST_SUFFIX}")


def split_token_files(path: str | Path, split: str) -> list[str]:
    """Prefixes of the token files that hold `split` of the source at `path` (see the module docstring)."""
    path = str(path)
    if glob.has_magic(path):
        found = {m[: -len(MANIFEST_SUFFIX)] for m in glob.glob(f"{path}.{split}{MANIFEST_SUFFIX}")}
        found |= {m[: -len(".json")] for m in glob.glob(f"{path}.{split}.json")}
        if not found:
            raise FileNotFoundError(f"no token files match {path}.{split}{MANIFEST_SUFFIX} or {path}.{split}.json "
                                    "(build them with tools/prepare_data.py --out PREFIX)")
        prefixes = [m[: -len(f".{split}")] for m in sorted(found)]
        return [name for prefix in dict.fromkeys(prefixes) for name in split_token_files(prefix, split)]
    manifest = manifest_path(path, split)
    if manifest.is_file():
        listed = json.loads(manifest.read_text())["shards"]
        return [str(manifest.parent / name) for name in listed]
    if Path(f"{path}.{split}.json").is_file():
        return [f"{path}.{split}"]
    if glob.glob(f"{glob.escape(path)}.{split}.[0-9][0-9][0-9][0-9][0-9].json"):
        raise FileNotFoundError(f"{path}.{split} has shards but no {manifest.name}: tools/prepare_data.py was "
                                "interrupted; run it again with the same arguments to finish")
    raise FileNotFoundError(f"no token files for split {split!r} at {path}: expected {manifest} "
                            f"(tools/prepare_data.py) or {path}.{split}.json")


class SegmentStream:
    """Segments of several token arrays read as one stream: segment k is arrays[array[k]][begin[k] :
    begin[k] + length[k]], and the stream is segment 0, then 1, ... `stream[a:b]` gathers the pieces
    ((b - a,) array of the arrays' dtype); len() is the total length. One binary search per read."""

    def __init__(self, arrays: list[np.ndarray], array: np.ndarray, begin: np.ndarray, length: np.ndarray):
        self.arrays = arrays
        self.array, self.begin, self.length = (np.asarray(x, dtype=np.int64) for x in (array, begin, length))
        self.offsets = np.concatenate([[0], np.cumsum(self.length)]).astype(np.int64)
        self.dtype = np.result_type(*[a.dtype for a in arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        if not isinstance(window, slice) or window.step not in (None, 1):
            raise TypeError("SegmentStream reads contiguous slices only")
        a, b, _ = window.indices(len(self))
        pieces, k = [], int(np.searchsorted(self.offsets, a, side="right")) - 1
        while a < b:
            inside = a - int(self.offsets[k])
            take = min(b - a, int(self.length[k]) - inside)
            first = int(self.begin[k]) + inside
            pieces.append(self.arrays[int(self.array[k])][first : first + take])
            a, k = a + take, k + 1
        return np.concatenate(pieces).astype(self.dtype, copy=False) if pieces else np.zeros(0, self.dtype)


@dataclass
class TokenCorpus:
    """A source's token files (in order) with each one's document starts.

    arrays: one (n_i,) uint16/uint32 memmap per file; starts: each file's (d_i,) int64 document starts;
    files: their prefixes (for metadata and messages)."""

    arrays: list[np.ndarray]
    starts: list[np.ndarray]
    files: list[str] = field(default_factory=list)
    known_metadata: dict[str, list] = field(default_factory=dict)  # fields given with the corpus (stdlib's)

    @property
    def n_tokens(self) -> int:
        return sum(len(a) for a in self.arrays)

    def stream(self):
        """(tokens, (n_docs,) int64 document starts) of the files end to end: the memmap itself for one
        file (the default run reads exactly what it read before), a SegmentStream for several. Shards
        end where a document ends, so joining them keeps every boundary."""
        if len(self.arrays) == 1:
            return self.arrays[0], self.starts[0]
        lengths = np.array([len(a) for a in self.arrays], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        stream = SegmentStream(self.arrays, np.arange(len(self.arrays)), np.zeros(len(self.arrays)), lengths)
        return stream, np.concatenate([s + o for s, o in zip(self.starts, offsets)]).astype(np.int64)

    def documents(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every document as (file index, start in its file, length): three (n_docs,) int64 arrays."""
        files, begins, lengths = [], [], []
        for k, (tokens, starts) in enumerate(zip(self.arrays, self.starts)):
            files.append(np.full(len(starts), k, dtype=np.int64))
            begins.append(np.asarray(starts, dtype=np.int64))
            lengths.append(np.diff(np.append(starts, len(tokens))).astype(np.int64))
        return tuple(np.concatenate(x) if x else np.zeros(0, np.int64) for x in (files, begins, lengths))

    def metadata(self, name: str) -> list:
        """Field `name` of every document, in order (ValueError when a file does not keep it)."""
        if name in self.known_metadata:
            return self.known_metadata[name]
        if not self.files:
            raise ValueError(f"its documents keep no metadata {name!r} (they keep: {', '.join(self.known_metadata)})")
        return [value for prefix in self.files for value in read_document_metadata(prefix, [name])[name]]


def open_token_corpus(path: str | Path, split: str, tokenizer) -> TokenCorpus:
    """The token files of `split` at `path`, each checked to be of `tokenizer` and within its vocabulary;
    files without a document index get their starts from the EOS tokens."""
    files = split_token_files(path, split)
    if not files:  # a manifest written by a prepare that found no documents (it refuses that now)
        raise ValueError(f"split {split!r} of {path} holds no documents ({manifest_path(path, split).name} lists no "
                         "shards): prepare it again from inputs that hold text")
    arrays, starts = [], []
    for prefix in files:
        meta = read_token_meta(prefix)
        if meta["tokenizer"] != tokenizer.name:
            raise ValueError(f"token file {prefix} was built with tokenizer {meta['tokenizer']!r}, "
                             f"but this run uses {tokenizer.name!r}")
        check_vocab(meta, tokenizer.vocab_size)
        tokens, _, doc_starts = open_token_file(prefix, documents=True, eos_id=tokenizer.eos_id)
        arrays.append(tokens)
        starts.append(doc_starts)
    return TokenCorpus(arrays, starts, files)
