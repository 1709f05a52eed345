"""The default offline corpus: the Python standard library sources of the running interpreter.

Every machine that runs moe_lc has ~30 MB of real, varied text here (code, docstrings, comments), so a
debug run trains on real data without a download. The same file-walking, file-splitting and
document-joining helpers serve `tools/prepare_data.py` for arbitrary text corpora.

Conventions:
- Files are listed by path relative to the corpus root, '/'-separated, sorted: the order (and so the
  token stream) is the same on every machine with the same sources.
- Train/val is split *by file* with a stable hash of the relative path (crc32, not Python's salted
  `hash`), so a file is wholly in one split, and adding or removing other files never moves it.
- A stream is each document's tokens followed by EOS: `doc0 EOS doc1 EOS ...`. Putting EOS after
  every document (not only between) lets streams be built, and concatenated, one file at a time.
  One file is one document; the stream's document starts (documents.py) come with it on request and
  are kept in the cache's index.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from moe_lc.data.token_corpus import TokenCorpus
from moe_lc.data.token_file import open_token_file, read_token_meta, token_dtype, write_token_file

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
# Building is cached on disk only when it took longer than this (the byte tokenizer builds in ~1 s).
DEFAULT_CACHE_MIN_SECONDS = 2.0


def list_text_files(root: str | Path, pattern: str | tuple[str, ...] = "*.py",
                    skip_dirs: Iterable[str] = SKIP_DIRS) -> list[str]:
    """Relative '/'-separated paths of files under `root` whose name matches `pattern` (or one of
    several), sorted.

    Directories named in `skip_dirs` are pruned, not just filtered, which keeps the walk fast when
    site-packages is large.
    """
    root = Path(root)
    skip = set(skip_dirs)
    patterns = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                found.append((rel_dir / name).as_posix())
    return sorted(found)


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """True if the file at `rel_path` belongs to the validation split (stable across runs/machines)."""
    return zlib.crc32(rel_path.encode("utf-8")) / 2**32 < val_fraction


def check_split(split: str, val_fraction: float) -> None:
    """ValueError for an unknown split name or a val_fraction outside [0, 1)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")


def split_files(rel_paths: Iterable[str], split: str, val_fraction: float) -> list[str]:
    """The subset of `rel_paths` in `split` ('train' or 'val'), order preserved."""
    check_split(split, val_fraction)
    want_val = split == "val"
    return [p for p in rel_paths if is_val_file(p, val_fraction) == want_val]


def read_text(path: str | Path, max_bytes: int | None = None) -> str:
    """A file's text as UTF-8 (invalid bytes become U+FFFD), optionally only its first `max_bytes`."""
    with open(path, "rb") as f:
        raw = f.read() if max_bytes is None else f.read(max_bytes)
    return raw.decode("utf-8", errors="replace")


def iter_documents(root: Path, rel_paths: Iterable[str], max_bytes: int | None = None) -> Iterator[str]:
    """Texts of the files in order, stopping once `max_bytes` source bytes have been read."""
    budget = max_bytes
    for rel in rel_paths:
        if budget is not None and budget <= 0:
            return
        text = read_text(root / rel, budget)
        if budget is not None:
            budget -= min(budget, (root / rel).stat().st_size)
        if text:
            yield text


def tokenize_documents(texts: Iterable[str], tokenizer, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Documents -> (one (n_tokens,) uint16/uint32 stream, each document followed by EOS; its (n_docs,)
    int64 document starts)."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_batch(batch):
            pieces.append(ids.astype(dtype))  # narrow per document: int64 copies of 30 MB would be 240 MB
            pieces.append(eos)
            lengths.append(len(ids) + 1)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    flush()
    starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) if lengths else np.zeros(0)
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)), starts.astype(np.int64)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    """$MOE_LC_CACHE_DIR, else ~/.cache/moe_lc/tokens."""
    env = os.environ.get("MOE_LC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "moe_lc" / "tokens"


def _stdlib_cache_prefix(cache_dir: Path, tokenizer_name: str, split: str, val_fraction: float) -> Path:
    py = "py{}.{}.{}-{}".format(*sys.version_info[:3], sys.implementation.name)
    return cache_dir / f"stdlib-{py}-{tokenizer_name}-{split}-vf{val_fraction:g}"


def stdlib_token_stream(
    split: str,
    tokenizer,
    val_fraction: float = 0.02,
    max_bytes: int | None = None,
    *,
    root: str | Path | None = None,
    cache_dir: str | Path | None = None,
    cache_min_seconds: float = DEFAULT_CACHE_MIN_SECONDS,
    documents: bool = False,
):
    """Token stream (n_tokens,) of the standard library's *.py files in `split`; with `documents=True`
    the pair (stream, (n_files,) int64 document starts): one document per non-empty file.

    dtype is uint16 when the vocabulary fits, else uint32. `max_bytes` caps the source text read (for
    quick tests; such partial streams are never cached). A full build that takes longer than
    `cache_min_seconds` is saved as a token file with its document index under `cache_dir` (default:
    `default_cache_dir()`), keyed by Python version, tokenizer name, split and val_fraction, and
    memory-mapped on later calls; a cache written before the index existed is rebuilt.
    `root` overrides the stdlib location (tests).
    """
    check_split(split, val_fraction)
    root = Path(root) if root is not None else stdlib_root()
    cache_prefix, stale = None, False
    if max_bytes is None and root == stdlib_root():
        cache_prefix = _stdlib_cache_prefix(
            Path(cache_dir) if cache_dir is not None else default_cache_dir(), tokenizer.name, split, val_fraction
        )
        if Path(str(cache_prefix) + ".json").is_file():
            try:  # a damaged cache is rebuilt (and overwritten), not fatal
                if "n_documents" not in read_token_meta(cache_prefix):
                    raise ValueError("it has no document index (an older cache)")
                tokens, meta, starts = open_token_file(cache_prefix, documents=True)
            except (OSError, ValueError) as exc:
                log.warning("rebuilding stdlib cache %s: %s", cache_prefix, exc)
                stale = True  # replaced below however fast the build is, so the warning comes once
            else:
                if meta["tokenizer"] == tokenizer.name:
                    return (tokens, starts) if documents else tokens
                log.warning("ignoring stdlib cache %s built with tokenizer %s", cache_prefix, meta["tokenizer"])

    start = time.perf_counter()
    rel_paths = list_text_files(root, "*.py")
    if not rel_paths:
        raise FileNotFoundError(
            f"no Python standard library sources (*.py) found under {root}; this interpreter may ship "
            "only compiled files. Use a token file instead (data.source = 'tokens', see tools/prepare_data.py)"
        )
    chosen = split_files(rel_paths, split, val_fraction)
    if not chosen:
        raise ValueError(
            f"stdlib split {split!r} is empty: {len(rel_paths)} files under {root}, val_fraction={val_fraction}"
        )
    tokens, starts = tokenize_documents(iter_documents(root, chosen, max_bytes), tokenizer)
    seconds = time.perf_counter() - start
    log.info("stdlib %s: %d files, %d tokens in %.2f s", split, len(chosen), len(tokens), seconds)

    if cache_prefix is not None and (seconds > cache_min_seconds or stale):
        write_token_file(cache_prefix, tokens, tokenizer.name, tokenizer.vocab_size,
                         f"stdlib:{root}:{split}:vf{val_fraction:g}", doc_starts=starts)
        log.info("cached stdlib %s tokens at %s", split, cache_prefix)
    return (tokens, starts) if documents else tokens


def stdlib_corpus(split: str, tokenizer, val_fraction: float = 0.02) -> TokenCorpus:
    """The stdlib stream of `split` as a TokenCorpus whose documents (one per non-empty file) keep
    metadata "path" (relative, '/'-separated) and "dir" (its folder: the package, '' at the top)."""
    tokens, starts = stdlib_token_stream(split, tokenizer, val_fraction, documents=True)
    root = stdlib_root()
    paths = [p for p in split_files(list_text_files(root, "*.py"), split, val_fraction) if (root / p).stat().st_size]
    if len(paths) != len(starts):
        raise ValueError(f"stdlib {split}: {len(paths)} non-empty files but {len(starts)} documents in its token "
                         f"stream (a stale cache? remove {default_cache_dir()})")
    return TokenCorpus([tokens], [starts], known_metadata={"path": paths, "dir": [p.rpartition("/")[0] for p in paths]})
