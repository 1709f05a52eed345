"""Reading corpora for tools/prepare_data.py: text files, JSON Lines (plain, .gz, .zst) and Parquet, as
documents in a fixed order, each with its position, its split key and its metadata; and the worker side
that turns them into token ids.

Formats, by file name:
- `*.jsonl`, `*.jsonl.gz`, `*.jsonl.zst`: one JSON object per line; the document is its `text_field`
  (a string; null or "" is an empty document, skipped), metadata the named fields' values (null when
  absent). The main process reads raw lines; the workers parse them, so JSON decoding runs in parallel.
- `*.parquet`: one row per document, the `text_field` column and the metadata columns (pyarrow).
- anything else: a text file, one document (its metadata: "path" relative to its INPUT, '/'-separated,
  and "dir", that path's folder, '' at the top).
A directory is searched for all three kinds (`*.txt`, the JSON Lines suffixes, `*.parquet`:
DEFAULT_PATTERNS) unless prepare_data's --glob names one pattern.
Gzip is the standard library's; zstandard and pyarrow are the `[data]` extra, asked for by name when an
input needs them.

A document's position is (file number, record number), file numbers in input order (a directory's files
sorted), record numbers from 0 in the file: prepare_data's shards record the last position they hold,
which is all a resumed run needs. Its split key is the file's key (a text file: the whole file in one
split, as the built-in stdlib corpus splits) or `key:record` for records, or the value of
`--split-by FIELD` (a repository wholly in train or in val).
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from moe_lc.data.corpus import list_text_files
from moe_lc.data.token_file import token_dtype
from moe_lc.data.tokenizer import load_tokenizer

SNIFF_BYTES = 8192  # how much of a text file decides whether it is text
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
TEXT_METADATA = ("path", "dir")
# what a directory is searched for without --glob: every kind this module reads
DEFAULT_PATTERNS = ("*.txt", *(f"*{suffix}" for suffix in JSONL_SUFFIXES), *(f"*{s}" for s in PARQUET_SUFFIXES))
SNIFF_RECORDS = 100  # JSON Lines records per file read for the field names --meta-fields may take
EXTRA_HINT = "pip install -e '.[data]'"


@dataclass(frozen=True)
class InputFile:
    path: Path
    key: str  # relative to its INPUT directory ('/'-separated), or the name of a file given directly
    format: str  # "text" | "jsonl" | "parquet"
    size: int  # bytes on disk (compressed, for .gz / .zst / Parquet): what progress counts

    @property
    def dir(self) -> str:
        return self.key.rpartition("/")[0]


def file_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "parquet" if name.endswith(PARQUET_SUFFIXES) else "text"


def binary_reason(path: Path) -> str | None:
    """Why text file `path` is not text (unreadable, or a NUL byte or bytes that are not UTF-8 in its
    first SNIFF_BYTES), else None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    where = f"in its first {SNIFF_BYTES // 1024} KiB"
    nul = head.find(b"\0")
    if nul >= 0:
        return f"is not UTF-8 text: a NUL byte at offset {nul} {where}"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text: byte 0x{head[exc.start]:02x} at offset {exc.start} {where}"
    return None


def require(module: str, what: str):
    """Import `module` for `what` (an input that needs it), or ValueError naming the extra to install."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(f"{what} needs the Python package {module.split('.')[0]}: {EXTRA_HINT} "
                         f"(or pip install {module.split('.')[0]})") from None


def collect_inputs(inputs: list[str], pattern: str | tuple[str, ...] = DEFAULT_PATTERNS
                   ) -> tuple[list[InputFile], list[Path]]:
    """(every input file in order, text files skipped in directories as binary). Directories are searched
    for `pattern` (default: text, JSON Lines and Parquet files); a file named directly is taken whatever
    its name. ValueError for a missing input, a text file given directly that is not text, or a format
    whose package is missing."""
    found, skipped = [], []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            candidates = [(path / rel, rel) for rel in list_text_files(path, pattern)]
        elif path.is_file():
            candidates = [(path, path.name)]
        else:
            raise ValueError(f"input not found: {item}")
        for file, key in candidates:
            kind = file_format(file)
            if kind == "text" and (reason := binary_reason(file)):
                if not path.is_dir():
                    raise ValueError(f"input {item} {reason}")
                skipped.append(file)
                continue
            found.append(InputFile(file, key, kind, file.stat().st_size))
    for f in found:
        if f.format == "parquet":
            require("pyarrow.parquet", f"input {f.path} (Parquet)")
        elif f.path.name.lower().endswith(".zst"):
            require("zstandard", f"input {f.path} (zstd)")
    return found, skipped


def _jsonl_fields(f: InputFile) -> set[str]:
    """The field names of the first SNIFF_RECORDS records of a JSON Lines file (lines that are not JSON
    objects are left to the run, which names them with their line)."""
    names: set[str] = set()
    with open(f.path, "rb") as raw:
        for number, line in enumerate(_open_lines(f, raw)):
            if number >= SNIFF_RECORDS:
                break
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue
            names |= set(record) if isinstance(record, dict) else set()
    return names


def offered_fields(f: InputFile) -> set[str]:
    """The metadata fields input `f` can give its documents: a text file its path and dir, Parquet its
    columns, JSON Lines the fields of its first SNIFF_RECORDS records."""
    if f.format == "text":
        return set(TEXT_METADATA)
    if f.format == "parquet":
        return set(require("pyarrow.parquet", "Parquet").ParquetFile(f.path).schema_arrow.names)
    return _jsonl_fields(f)


def check_meta_fields(files: list[InputFile], fields: dict[str, tuple[str, ...]], text_field: str) -> None:
    """ValueError naming the flag when a field it asks for is offered by no input (every document would
    store null for it): `fields` maps a flag (--meta-fields, --split-by) to the fields it names."""
    asked = {name for names in fields.values() for name in names}
    if not asked:
        return
    by_kind: dict[str, set[str]] = {}  # input kind -> the fields its files offer
    for f in files:
        kind = {"text": "text files", "jsonl": f"JSON Lines (first {SNIFF_RECORDS} records of each file)",
                "parquet": "Parquet columns"}[f.format]
        by_kind.setdefault(kind, set()).update(offered_fields(f))
    found = set().union(*by_kind.values())
    for flag, names in fields.items():
        missing = [n for n in names if n not in found]
        if missing:
            have = "; ".join(f"{kind}: {', '.join(sorted(by_kind[kind] - {text_field})) or 'none'}"
                             for kind in sorted(by_kind))
            raise ValueError(f"{flag}: no input has the field{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))} (fields offered: {have})")


def check_parquet_columns(f: InputFile, text_field: str) -> None:
    """ValueError naming the columns when a Parquet input has no `text_field` (before any work)."""
    names = require("pyarrow.parquet", "Parquet").ParquetFile(f.path).schema_arrow.names
    if text_field not in names:
        raise ValueError(f"input {f.path} has no column {text_field!r} (columns: {', '.join(names)}); "
                         "name the text column with --text-field")


def _open_lines(f: InputFile, raw: io.BufferedReader):
    if f.path.name.lower().endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if f.path.name.lower().endswith(".zst"):
        return io.BufferedReader(require("zstandard", "zstd").ZstdDecompressor().stream_reader(raw))
    return raw


# A document as the main process reads it: (record number, raw, metadata or None, bytes of the file read
# so far). raw is the text (text files, Parquet) or one JSON line as bytes (parsed by a worker).
Record = tuple[int, "str | bytes", "dict | None", int]


def iter_records(f: InputFile, meta_fields: tuple[str, ...], text_field: str, start: int = 0) -> Iterator[Record]:
    """The records of one input from record number `start` on (earlier ones are read past, not parsed)."""
    if f.format == "text":
        if start == 0:
            with open(f.path, "rb") as fh:
                text = fh.read().decode("utf-8", errors="replace")
            yield 0, text, {"path": f.key, "dir": f.dir}, f.size
        return
    if f.format == "jsonl":
        with open(f.path, "rb") as raw:
            for number, line in enumerate(_open_lines(f, raw)):
                if number >= start and line.strip():
                    yield number, line, None, raw.tell()
        return
    pq = require("pyarrow.parquet", "Parquet")
    parquet = pq.ParquetFile(f.path)
    columns = [c for c in dict.fromkeys((text_field, *meta_fields)) if c in parquet.schema_arrow.names]
    number, total = 0, max(parquet.metadata.num_rows, 1)
    for batch in parquet.iter_batches(columns=columns, batch_size=1024):
        if number + batch.num_rows <= start:
            number += batch.num_rows
            continue
        table = batch.to_pydict()
        for row in range(batch.num_rows):
            if number >= start:
                metadata = {m: table[m][row] for m in meta_fields if m in table}
                yield number, table[text_field][row] or "", metadata, f.size * (number + 1) // total
            number += 1


# ------------------------------------------------------------------------------------------ worker side

_WORKER: dict = {}


def init_worker(tokenizer_spec: str, text_field: str, meta_fields: tuple[str, ...]) -> None:
    """Per-process state of a tokenizing worker (also called once in-process for --workers 1)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    tokenizer = load_tokenizer(tokenizer_spec)
    _WORKER.update(tokenizer=tokenizer, dtype=token_dtype(tokenizer.vocab_size), text_field=text_field,
                   meta_fields=meta_fields)


def parse_json_line(line: bytes, text_field: str, meta_fields: tuple[str, ...]) -> tuple[str, dict]:
    """(text, metadata) of one JSON Lines record; ValueError saying what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    if text_field not in record:
        keys = ", ".join(list(record)[:12])
        raise ValueError(f"no field {text_field!r} (fields: {keys}); name the text field with --text-field")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"field {text_field!r} is a {type(text).__name__}, not a string")
    return text or "", {m: record.get(m) for m in meta_fields}


def encode_records(batch: list[tuple[str | bytes, dict | None, str]]) -> list:
    """Worker task: [(raw, metadata, where)] -> [(ids (n,) uint16/uint32, metadata) or an error line
    naming `where`] in order. Empty documents give ids of length 0."""
    w = _WORKER
    texts, metas, out = [], [], []
    for raw, metadata, where in batch:
        if isinstance(raw, bytes):
            try:
                raw, metadata = parse_json_line(raw, w["text_field"], w["meta_fields"])
            except ValueError as exc:
                return [f"{where}: {exc}"]
        texts.append(raw)
        metas.append(metadata or {})
    for ids, metadata in zip(w["tokenizer"].encode_batch(texts), metas):
        out.append((np.asarray(ids).astype(w["dtype"]), metadata))
    return out
