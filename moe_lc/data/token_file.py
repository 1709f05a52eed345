"""Token files: a raw binary array of token ids `NAME.bin`, a JSON sidecar `NAME.json`, and the
document index `NAME.docs.npy`.

The .bin holds little-endian uint16 (vocab <= 65536) or uint32 ids, nothing else, so it can be
memory-mapped and sliced without a parser. The sidecar says how to read it and where it came from:

    {"dtype": "uint16", "n_tokens": 123, "tokenizer": "byte", "vocab_size": 259,
     "max_token_id": 257, "source": "...", "format_version": 1, "n_documents": 4}

`NAME.docs.npy` is (n_documents,) int64: where each document starts in the .bin (documents.py says
what a valid one is). A writer records one start per `append_document`; the sidecar has
"n_documents" exactly when the index was written. Files without it (older builds, or streams written
with plain `append`) still open: `open_token_file(..., documents=True, eos_id=...)` then recovers the
starts from the EOS that ends every document.

A writer given `metadata_fields` also keeps `NAME.meta.jsonl`: one JSON object per document, in order,
with those fields (a repository or book id to concatenate by); the sidecar lists them as
"metadata_fields". `read_document_metadata` reads them back, one list per field.

Writes are atomic: data goes to temporary files that are renamed into place, the .bin first, then the
index, the .json last, so a sidecar only ever describes a complete .bin and index (a crashed or
concurrent writer never leaves a file that opens but is short).
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path

import numpy as np

from moe_lc.data.documents import check_starts, starts_from_eos

FORMAT_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_REQUIRED_KEYS = ("dtype", "n_tokens", "tokenizer", "vocab_size", "source")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary: uint16 below 65536, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _paths(path_prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(path_prefix)
    return Path(prefix + ".bin"), Path(prefix + ".json")


def documents_path(path_prefix: str | Path) -> Path:
    """`NAME.docs.npy`: the document index of token file NAME."""
    return Path(str(path_prefix) + ".docs.npy")


def metadata_path(path_prefix: str | Path) -> Path:
    """`NAME.meta.jsonl`: the per-document metadata of token file NAME."""
    return Path(str(path_prefix) + ".meta.jsonl")


def read_document_metadata(path_prefix: str | Path, fields: list[str]) -> dict[str, list]:
    """{field: its value for each document, in order} for `fields` of a token file's metadata;
    ValueError naming the file when it lacks a field or its line count disagrees with the sidecar."""
    meta = read_token_meta(path_prefix)
    kept = meta.get("metadata_fields", [])
    missing = [f for f in fields if f not in kept]
    if missing:
        raise ValueError(f"token file {path_prefix} keeps no document metadata {missing} (it keeps "
                         f"{kept or 'none'}: give them to tools/prepare_data.py --meta-fields)")
    values: dict[str, list] = {f: [] for f in fields}
    with open(metadata_path(path_prefix), encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            for f in fields:
                values[f].append(record.get(f))
    n = len(values[fields[0]]) if fields else int(meta.get("n_documents", 0))
    if n != int(meta.get("n_documents", 0)):
        raise ValueError(f"token file metadata {metadata_path(path_prefix)} has {n} documents, "
                         f"its sidecar says {meta.get('n_documents', 0)}")
    return values


class TokenFileWriter:
    """Streams token arrays into `PREFIX.bin` and writes `PREFIX.json` (and `PREFIX.docs.npy` when
    documents were recorded) on close.

    `append_document(ids, [eos])` starts a document where the stream stands and appends its pieces;
    `append` continues the current one. Use as a context manager; if the block raises, nothing is left
    behind (and an existing token file with the same prefix is untouched).
    """

    def __init__(self, path_prefix: str | Path, *, tokenizer_name: str, vocab_size: int, source: str,
                 metadata_fields: tuple[str, ...] = ()):
        self.bin_path, self.json_path = _paths(path_prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = int(vocab_size)
        self.tokenizer_name = tokenizer_name
        self.source = source
        self.n_tokens = 0
        self.max_token_id = -1
        self.meta: dict | None = None  # the sidecar, once closed
        self.extra: dict = {}  # more sidecar keys, written on close (prepare_data's resume position)
        self.metadata_fields = tuple(metadata_fields)
        self.metadata_path = metadata_path(path_prefix)
        self.docs_path = documents_path(path_prefix)
        self._starts = array("q")  # 8 bytes a document: millions of them stay small
        suffix = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + suffix)
        self._json_tmp = self.json_path.with_name(self.json_path.name + suffix)
        self._docs_tmp = self.docs_path.with_name(self.docs_path.name + suffix)
        self._metadata_tmp = self.metadata_path.with_name(self.metadata_path.name + suffix)
        self._metadata_file = open(self._metadata_tmp, "w", encoding="utf-8") if self.metadata_fields else None
        self._file = open(self._bin_tmp, "wb")

    @property
    def n_documents(self) -> int:
        return len(self._starts)

    def append_document(self, *pieces: np.ndarray, metadata: dict | None = None) -> None:
        """Record a document start at the current end of the stream, then append `pieces` (a document is
        its tokens plus its EOS: `append_document(ids, [eos_id])`). An empty document records nothing.
        Tokens appended with `append` before the first document form a document of their own.
        `metadata`: the document's values of `metadata_fields` (a missing one is null)."""
        if sum(np.size(p) for p in pieces) == 0:
            return
        if not self._starts and self.n_tokens:
            if self._metadata_file:
                raise ValueError("a writer with metadata_fields takes every document through append_document")
            self._starts.append(0)
        self._starts.append(self.n_tokens)
        for piece in pieces:
            self.append(piece)
        if self._metadata_file:
            values = {name: (metadata or {}).get(name) for name in self.metadata_fields}
            self._metadata_file.write(json.dumps(values, ensure_ascii=False) + "\n")

    def append(self, tokens: np.ndarray) -> None:
        """Append a 1-D array of ids; every id must lie in [0, vocab_size)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"token arrays must be 1-D, got shape {tokens.shape}")
        if tokens.size == 0:
            return
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"token id {low if low < 0 else high} outside [0, {self.vocab_size}) "
                f"for tokenizer {self.tokenizer_name!r}"
            )
        self.max_token_id = max(self.max_token_id, high)
        self._file.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.n_tokens += int(tokens.size)

    def close(self) -> dict:
        """Finish the .bin, publish the files atomically, return the sidecar dict."""
        self._file.close()
        if self._metadata_file:
            self._metadata_file.close()
        meta = {
            "dtype": self.dtype.name,
            "n_tokens": self.n_tokens,
            "tokenizer": self.tokenizer_name,
            "vocab_size": self.vocab_size,
            "max_token_id": self.max_token_id,
            "source": self.source,
            "format_version": FORMAT_VERSION,
        }
        if self.metadata_fields:
            meta["metadata_fields"] = list(self.metadata_fields)
        meta.update(self.extra)
        if self._starts:
            meta["n_documents"] = len(self._starts)
            with open(self._docs_tmp, "wb") as fh:
                np.save(fh, np.frombuffer(self._starts, dtype=np.int64))
        self._json_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(self._bin_tmp, self.bin_path)
        if self._starts:
            os.replace(self._docs_tmp, self.docs_path)
        else:  # an index left by an earlier build of this prefix describes other tokens
            self.docs_path.unlink(missing_ok=True)
        if self.metadata_fields:
            os.replace(self._metadata_tmp, self.metadata_path)
        else:
            self.metadata_path.unlink(missing_ok=True)
        os.replace(self._json_tmp, self.json_path)
        self.meta = meta
        return meta

    def abort(self) -> None:
        """Drop the partial output."""
        self._file.close()
        if self._metadata_file:
            self._metadata_file.close()
        for tmp in (self._bin_tmp, self._json_tmp, self._docs_tmp, self._metadata_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TokenFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_token_file(
    path_prefix: str | Path, tokens: np.ndarray, tokenizer_name: str, vocab_size: int, source: str,
    doc_starts: np.ndarray | None = None,
) -> dict:
    """Write (n,) ids to `PREFIX.bin` + `PREFIX.json`, and `doc_starts` ((n_docs,) int64, see
    documents.py) to `PREFIX.docs.npy` when given; returns the sidecar dict."""
    tokens = np.asarray(tokens)
    if doc_starts is not None:
        doc_starts = check_starts(doc_starts, len(tokens), f"write_token_file {path_prefix}")
    with TokenFileWriter(
        path_prefix, tokenizer_name=tokenizer_name, vocab_size=vocab_size, source=source
    ) as writer:
        if doc_starts is None:
            writer.append(tokens)
        else:
            for document in np.split(tokens, doc_starts[1:]):
                writer.append_document(document)
    return writer.meta


def read_token_meta(path_prefix: str | Path) -> dict:
    """Read and validate the sidecar of a token file (without touching the .bin)."""
    bin_path, json_path = _paths(path_prefix)
    if not json_path.is_file():
        raise FileNotFoundError(
            f"token file sidecar missing: {json_path} (build token files with tools/prepare_data.py)"
        )
    try:
        meta = json.loads(json_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"token file sidecar {json_path} is not valid JSON: {exc}") from exc
    missing = [k for k in _REQUIRED_KEYS if k not in meta]
    if missing:
        raise ValueError(f"token file sidecar {json_path} lacks keys: {', '.join(missing)}")
    if meta["dtype"] not in _DTYPES:
        raise ValueError(
            f"token file sidecar {json_path}: dtype {meta['dtype']!r} is not one of {sorted(_DTYPES)}"
        )
    return meta


def open_token_file(path_prefix: str | Path, *, documents: bool = False, eos_id: int | None = None):
    """Memory-map `PREFIX.bin` read-only; returns ((n_tokens,) uint16/uint32 array, sidecar dict), and
    with `documents=True` a third item: the (n_docs,) int64 document starts (documents.py), read from
    `PREFIX.docs.npy` when the file has an index, else found at the EOS `eos_id` ends each document with
    (required then: the file does not say which id that is).

    Raises FileNotFoundError when a file is missing and ValueError when the .bin size disagrees with
    the sidecar (a truncated copy, or a .bin from another build), or the index with either.
    """
    tokens, meta = _open_tokens(path_prefix)
    if not documents:
        return tokens, meta
    if "n_documents" not in meta:
        if eos_id is None:
            raise ValueError(f"token file {path_prefix} has no document index ({documents_path(path_prefix).name}): "
                             "pass the tokenizer's eos_id to find its documents at the EOS ending each")
        return tokens, meta, starts_from_eos(tokens, eos_id)
    return tokens, meta, _open_starts(path_prefix, meta)


def _open_starts(path_prefix: str | Path, meta: dict) -> np.ndarray:
    """The checked document index of a token file whose sidecar lists one."""
    path = documents_path(path_prefix)
    if not path.is_file():
        raise FileNotFoundError(f"token file document index missing: {path} (its sidecar lists "
                                f"{meta['n_documents']} documents)")
    try:
        starts = np.load(path, mmap_mode="r")
    except ValueError as exc:  # a damaged .npy header
        raise ValueError(f"token file document index {path} is unreadable: {exc}") from None
    if len(starts) != int(meta["n_documents"]):
        raise ValueError(f"token file document index {path} is truncated or corrupt: {len(starts)} starts, "
                         f"sidecar says {meta['n_documents']} documents")
    return check_starts(starts, int(meta["n_tokens"]), str(path))


def _open_tokens(path_prefix: str | Path) -> tuple[np.ndarray, dict]:
    bin_path, json_path = _paths(path_prefix)
    meta = read_token_meta(path_prefix)
    if not bin_path.is_file():
        raise FileNotFoundError(f"token file data missing: {bin_path} (its sidecar {json_path} exists)")
    dtype = _DTYPES[meta["dtype"]]
    expected = int(meta["n_tokens"]) * dtype.itemsize
    actual = bin_path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"token file {bin_path} is truncated or corrupt: {actual} bytes on disk, sidecar says "
            f"{meta['n_tokens']} tokens x {dtype.itemsize} bytes = {expected} bytes"
        )
    if expected == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype), meta
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(int(meta["n_tokens"]),)), meta


def check_vocab(meta: dict, vocab_size: int, tokens: np.ndarray | None = None) -> None:
    """Raise ValueError if the file holds a token id >= `vocab_size` (the model's embedding rows).

    Uses the sidecar's recorded `max_token_id`; pass `tokens` to scan the data itself instead (for
    files written by other tools, or to distrust the sidecar).
    """
    if tokens is not None:
        max_id = int(tokens.max()) if len(tokens) else -1
    else:
        max_id = int(meta.get("max_token_id", int(meta["vocab_size"]) - 1))
    if max_id >= vocab_size:
        raise ValueError(
            f"token file ({meta.get('source', '?')}, tokenizer {meta['tokenizer']!r}, vocab "
            f"{meta['vocab_size']}) contains token id {max_id} >= model vocab_size {vocab_size}"
        )
