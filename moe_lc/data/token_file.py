"""Token files: a raw binary array of token ids `NAME.bin` plus a JSON sidecar `NAME.json`.

The .bin holds little-endian uint16 (vocab <= 65536) or uint32 ids, nothing else, so it can be
memory-mapped and sliced without a parser. The sidecar says how to read it and where it came from:

    {"dtype": "uint16", "n_tokens": 123, "tokenizer": "byte", "vocab_size": 259,
     "max_token_id": 257, "source": "...", "format_version": 1}

Writes are atomic: data goes to temporary files that are renamed into place, the .bin first and the
.json last, so a sidecar only ever describes a complete .bin (a crashed or concurrent writer never
leaves a file that opens but is short).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_REQUIRED_KEYS = ("dtype", "n_tokens", "tokenizer", "vocab_size", "source")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary: uint16 below 65536, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _paths(path_prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(path_prefix)
    return Path(prefix + ".bin"), Path(prefix + ".json")


class TokenFileWriter:
    """Streams token arrays into `PREFIX.bin` and writes `PREFIX.json` on close.

    Use as a context manager; if the block raises, nothing is left behind (and an existing token file with
    the same prefix is untouched).
    """

    def __init__(self, path_prefix: str | Path, *, tokenizer_name: str, vocab_size: int, source: str):
        self.bin_path, self.json_path = _paths(path_prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = int(vocab_size)
        self.tokenizer_name = tokenizer_name
        self.source = source
        self.n_tokens = 0
        self.max_token_id = -1
        self.meta: dict | None = None  # the sidecar, once closed
        suffix = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + suffix)
        self._json_tmp = self.json_path.with_name(self.json_path.name + suffix)
        self._file = open(self._bin_tmp, "wb")

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
        """Finish the .bin, publish both files atomically, return the sidecar dict."""
        self._file.close()
        meta = {
            "dtype": self.dtype.name,
            "n_tokens": self.n_tokens,
            "tokenizer": self.tokenizer_name,
            "vocab_size": self.vocab_size,
            "max_token_id": self.max_token_id,
            "source": self.source,
            "format_version": FORMAT_VERSION,
        }
        self._json_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._json_tmp, self.json_path)
        self.meta = meta
        return meta

    def abort(self) -> None:
        """Drop the partial output."""
        self._file.close()
        for tmp in (self._bin_tmp, self._json_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TokenFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_token_file(
    path_prefix: str | Path, tokens: np.ndarray, tokenizer_name: str, vocab_size: int, source: str
) -> dict:
    """Write (n,) ids to `PREFIX.bin` + `PREFIX.json`; returns the sidecar dict."""
    with TokenFileWriter(
        path_prefix, tokenizer_name=tokenizer_name, vocab_size=vocab_size, source=source
    ) as writer:
        writer.append(tokens)
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


def open_token_file(path_prefix: str | Path) -> tuple[np.ndarray, dict]:
    """Memory-map `PREFIX.bin` read-only; returns ((n_tokens,) uint16/uint32 array, sidecar dict).

    Raises FileNotFoundError when either file is missing and ValueError when the .bin size disagrees
    with the sidecar (a truncated copy, or a .bin from another build).
    """
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
