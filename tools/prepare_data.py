"""Tokenize a corpus into train/val token shards for `[data] source = "tokens"` or `[[data.sources]]`.

    python tools/prepare_data.py INPUT... --out PREFIX [--tokenizer byte|path/tokenizer.json|model dir]
        [--val-fraction 0.02] [--glob PATTERN] [--text-field text] [--meta-fields a,b] [--split-by FIELD]
        [--workers N] [--shard-tokens N] [--overwrite]

INPUT is a file or a directory, searched recursively for every kind read here (*.txt, *.jsonl,
*.jsonl.gz, *.jsonl.zst, *.parquet) or for --glob PATTERN, skipping __pycache__ and site-packages. Text
files are one document each; JSON Lines and Parquet hold one document per record, its text in
--text-field, and --meta-fields values kept per document (a repository or book id for `concat_by`; text
files offer "path" and "dir"; a field no input has is refused, JSON Lines judged by their first
records). Gzip needs nothing, zstd and Parquet the `[data]` extra (pip install -e '.[data]').

Writes PREFIX.train.NNNNN.{bin,json,docs.npy} and PREFIX.val.NNNNN... shards of about --shard-tokens
tokens (ending where a document ends; docs.npy: where each document starts; meta.jsonl with
--meta-fields), and PREFIX.train.shards.json / PREFIX.val.shards.json, the lists a run reads, once a
split is complete (moe_lc/data/shards.py). A document is its tokens followed by EOS. Documents are split
by a stable hash of their key: a text file's path relative to its INPUT directory (the built-in stdlib
corpus's rule, so a grown corpus keeps every old file in its split), a record's `file:record`, or the
value of --split-by.

--workers N processes tokenize (default: every core); the shards are the same bytes for any N. An
interrupted run (Ctrl-C, a kill, a full disk) continues where it stopped when run again with the same
arguments: complete shards are kept, a half-written one is never visible to a run and is redone. Other
settings over the same PREFIX are refused unless --overwrite (which removes the earlier output first).
Mistakes in the arguments (a missing input, a text file that is not UTF-8 named directly, an unwritable
or directory PREFIX, an unknown tokenizer, a missing package, Parquet column or metadata field) are one
`error: ` line with exit status 2, before anything is tokenized; text files in directories that are not
text are skipped and counted. Inputs that hold no document (empty files, records with empty text) are
one `error: ` line too, and nothing is published.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/prepare_data.py` from a checkout: run as tools.prepare_data
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.prepare_data", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from moe_lc.data.corpus import is_val_file
from moe_lc.data.ingest import (DEFAULT_PATTERNS, check_meta_fields, check_parquet_columns, collect_inputs,
                                encode_records, init_worker, iter_records)
from moe_lc.data.shards import SplitShards, outputs_of, state_path, write_json_atomic
from moe_lc.data.token_corpus import manifest_path
from moe_lc.data.token_file import token_dtype
from moe_lc.data.tokenizer import load_tokenizer
from moe_lc.job.out_path import OutPathError, out_file

SPLITS = ("train", "val")
TASK_DOCS = 256  # documents per worker task
TASK_BYTES = 4 << 20  # ... or this much text, whichever comes first: enough work to outweigh the pickling


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text, JSON Lines or Parquet files, or directories")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.train.* and PREFIX.val.*")
    parser.add_argument("--tokenizer", default="byte", help="'byte', a HuggingFace tokenizer.json, or a model directory holding one")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="fraction of documents held out (by hash of their key)")
    parser.add_argument("--glob", default=None, metavar="PATTERN",
                        help=f"file name pattern inside directories (default: {' '.join(DEFAULT_PATTERNS)})")
    parser.add_argument("--text-field", default="text", help="JSON Lines field / Parquet column holding the text")
    parser.add_argument("--meta-fields", default="", help="comma-separated fields kept per document (text files: path, dir)")
    parser.add_argument("--split-by", default="", metavar="FIELD", help="split by this metadata field's value (default: per document)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: every core)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard, about (default 2^27)")
    parser.add_argument("--overwrite", action="store_true", help="remove an earlier prepare into PREFIX first")
    return parser.parse_args(argv)


def kept_fields(args) -> tuple[str, ...]:
    """The metadata fields the shards keep (--meta-fields)."""
    return tuple(f.strip() for f in args.meta_fields.split(",") if f.strip())


def meta_fields_of(args) -> tuple[str, ...]:
    """The fields the workers read: the kept ones and the --split-by field."""
    fields = kept_fields(args)
    return fields + ((args.split_by,) if args.split_by and args.split_by not in fields else ())


def prepare(args):
    """(tokenizer, input files, skipped binaries, settings) once every argument checks out; ValueError
    (OutPathError too) otherwise. Makes PREFIX's missing folders last."""
    if not 0.0 <= args.val_fraction < 1.0:
        raise ValueError(f"--val-fraction={args.val_fraction} must be in [0, 1)")
    for flag, value in (("--workers", args.workers), ("--shard-tokens", args.shard_tokens)):
        if value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")
    files, skipped = collect_inputs(args.inputs, args.glob or DEFAULT_PATTERNS)
    if not files:
        binary = f" ({len(skipped)} files skipped: not UTF-8 text)" if skipped else ""
        raise ValueError(f"no input files matching {args.glob or ' '.join(DEFAULT_PATTERNS)} under "
                         f"{' '.join(args.inputs)}{binary}")
    if not any(f.size for f in files):
        raise ValueError(no_documents(args, files))
    for f in files:
        if f.format == "parquet":
            check_parquet_columns(f, args.text_field)
    split_by = (args.split_by,) if args.split_by else ()
    check_meta_fields(files, {"--meta-fields": kept_fields(args), "--split-by": split_by}, args.text_field)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--tokenizer: {exc}") from None
    if args.out.endswith(("/", "\\")) or Path(args.out).is_dir():
        raise OutPathError(f"--out {args.out}: names a directory; PREFIX is a file prefix such as "
                           f"{Path(args.out) / 'corpus'} (writes {Path(args.out) / 'corpus'}.train.00000.bin, ...)")
    for path in [state_path(args.out)] + [manifest_path(args.out, s) for s in SPLITS]:
        out_file("--out", path, args.out)
    settings = {"inputs": [[str(f.path.resolve()), f.key, f.size] for f in files], "tokenizer": tokenizer.name,
                "glob": args.glob or ",".join(DEFAULT_PATTERNS), "text_field": args.text_field,
                "meta_fields": list(meta_fields_of(args)),
                "split_by": args.split_by, "val_fraction": args.val_fraction, "shard_tokens": args.shard_tokens}
    return tokenizer, files, skipped, settings


def check_earlier_run(args, settings: dict) -> str:
    """'fresh', 'resume' or 'complete' for PREFIX; ValueError when it holds another prepare."""
    if args.overwrite:
        for path in outputs_of(args.out, SPLITS):
            path.unlink()
        return "fresh"
    state = state_path(args.out)
    if not state.is_file():
        return "fresh"
    earlier = json.loads(state.read_text())
    if earlier != settings:
        changed = [k for k in settings if earlier.get(k) != settings[k]]
        raise ValueError(f"--out {args.out}: holds a prepare with other settings ({', '.join(changed)} differ); "
                         "run it with the same arguments to resume it, or pass --overwrite to start over")
    return "complete" if all(manifest_path(args.out, s).is_file() for s in SPLITS) else "resume"


def ordered_map(tasks, workers: int, initargs: tuple):
    """(key, encode_records(payload)) for (key, payload) in `tasks`, in order: in this process for one
    worker, else with at most 2 x workers + 2 tasks in flight (bounded memory, however large the corpus)."""
    if workers == 1:
        init_worker(*initargs)
        for key, payload in tasks:
            yield key, encode_records(payload)
        return
    with ProcessPoolExecutor(workers, initializer=init_worker, initargs=initargs) as pool:
        pending = deque()
        for key, payload in tasks:
            pending.append((key, pool.submit(encode_records, payload)))
            if len(pending) >= 2 * workers + 2:
                done_key, future = pending.popleft()
                yield done_key, future.result()
        while pending:
            done_key, future = pending.popleft()
            yield done_key, future.result()


def make_tasks(files, splits: dict, meta_fields, text_field: str):
    """Batches of the documents some split still wants, as ((positions, split keys, bytes read), payload)."""
    wanted = [s.last_position for s in splits.values()]
    start = (0, -1) if any(p is None for p in wanted) else min(tuple(p) for p in wanted)
    keys, positions, payload, size = [], [], [], 0
    for number, f in enumerate(files):
        if number < start[0]:
            continue
        first = start[1] + 1 if number == start[0] else 0
        bytes_read = 0
        for record, raw, metadata, bytes_read in iter_records(f, meta_fields, text_field, first):
            positions.append((number, record))
            keys.append(f.key if f.format == "text" else f"{f.key}:{record}")
            payload.append((raw, metadata, f"{f.path}:{record + 1}" if f.format == "jsonl" else f"{f.path} row {record}"))
            size += len(raw)
            if len(payload) >= TASK_DOCS or size >= TASK_BYTES:
                yield (positions, keys, (number, bytes_read)), payload
                keys, positions, payload, size = [], [], [], 0
        if payload:
            yield (positions, keys, (number, bytes_read)), payload
            keys, positions, payload, size = [], [], [], 0
        yield ([], [], (number, f.size)), []  # the file is done: progress counts all of it


def no_documents(args, files) -> str:
    n, size = len(files), sum(f.size for f in files)
    return (f"no documents in {' '.join(args.inputs)}: every input is empty ({n} file{'s' if n != 1 else ''}, "
            f"{size:,} bytes; empty files and records whose {args.text_field!r} is empty or null are skipped); "
            "nothing was written")


class NoDocuments(ValueError):
    """Inputs that hold no document: nothing to publish (the run's state file is removed too)."""


def run(args, tokenizer, files, progress) -> dict:
    """Tokenize every document some split still wants into its shards; returns the two manifests."""
    fields = meta_fields_of(args)
    source = (f"prepare_data: {' '.join(args.inputs)} glob={args.glob or ','.join(DEFAULT_PATTERNS)} "
              f"val_fraction={args.val_fraction:g}")
    splits = {s: SplitShards(args.out, s, tokenizer, args.shard_tokens, kept_fields(args), source) for s in SPLITS}
    file_start = [0]
    for f in files:
        file_start.append(file_start[-1] + f.size)
    try:
        results = ordered_map(make_tasks(files, splits, fields, args.text_field), args.workers,
                              (args.tokenizer, args.text_field, fields))
        for (positions, keys, (number, bytes_read)), encoded in results:
            if encoded and isinstance(encoded[0], str):
                raise ValueError(encoded[0])  # a record the worker could not read, with its file and line
            for position, key, (ids, metadata) in zip(positions, keys, encoded):
                if args.split_by and metadata.get(args.split_by) is not None:
                    key = str(metadata[args.split_by])
                splits["val" if is_val_file(key, args.val_fraction) else "train"].add(ids, metadata, position)
            progress(file_start[number] + bytes_read, splits)
        if not any(s.n_documents for s in splits.values()):
            raise NoDocuments(no_documents(args, files))
        return {name: s.finish() for name, s in splits.items()}
    finally:
        for s in splits.values():
            s.abort()


class Progress:
    """A tqdm bar over the input bytes (compressed, as on disk) with documents and tokens/s; ETA by bytes."""

    def __init__(self, total_bytes: int, workers: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenize ({workers} workers)",
                        mininterval=1.0, file=sys.stderr)
        self.start, self.done, self.tokens0 = time.perf_counter(), 0, None

    def __call__(self, done_bytes: int, splits: dict) -> None:
        tokens = sum(s.n_tokens for s in splits.values())
        if self.tokens0 is None:  # shards kept from an interrupted run do not count as this run's speed
            self.tokens0 = sum(sum(m["n_tokens"] for m in s.done[: s.resumed_shards]) for s in splits.values())
        if done_bytes > self.done:
            self.bar.update(done_bytes - self.done)
            self.done = done_bytes
        rate = (tokens - self.tokens0) / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"docs {sum(s.n_documents for s in splits.values()):,}  {rate / 1e6:.2f}M tok/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def main(argv: list[str] | None = None) -> int:
    """Exit status 0; 2 with one `error: ` line when an argument or an input record is wrong; 130 on Ctrl-C."""
    args = parse_args(argv)
    try:
        tokenizer, files, skipped, settings = prepare(args)
        status = check_earlier_run(args, settings)
    except ValueError as exc:  # OutPathError too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    formats = ", ".join(f"{sum(f.format == k for f in files)} {k}" for k in ("text", "jsonl", "parquet")
                        if any(f.format == k for f in files))
    shown = ", ".join(str(p) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    print(f"{len(files)} files ({formats}), {sum(f.size for f in files) / 1e6:.1f} MB; tokenizer {tokenizer.name} "
          f"(vocab {tokenizer.vocab_size}, {token_dtype(tokenizer.vocab_size).name}); {args.workers} workers"
          + (f"; skipped {len(skipped)} files that are not UTF-8 text ({shown})" if skipped else ""), flush=True)
    if status == "complete":
        print(f"{args.out}: already complete (its shards.json lists every shard); nothing to do")
        return 0
    write_json_atomic(state_path(args.out), settings)
    start, total = time.perf_counter(), sum(f.size for f in files)
    progress = Progress(total, args.workers)
    try:
        manifests = run(args, tokenizer, files, progress)
    except ValueError as exc:
        progress.close()
        if isinstance(exc, NoDocuments):  # no shard exists: a later prepare into PREFIX starts fresh
            state_path(args.out).unlink(missing_ok=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.close()
        print("interrupted: the shards published so far are kept; run the same command to continue",
              file=sys.stderr)
        return 130
    progress.close()
    print_summary(manifests, args, total, time.perf_counter() - start, status == "resume")
    return 0


def print_summary(manifests: dict, args, total_bytes: int, seconds: float, resumed: bool) -> None:
    print("summary:" + (" (resumed: shards kept from the interrupted run count too)" if resumed else ""))
    tokens = sum(m["n_tokens"] for m in manifests.values())
    for name, m in manifests.items():
        print(f"  {name:5s} {len(m['shards']):4d} shards  {m['n_documents']:9,d} documents  {m['n_tokens']:14,d} tokens"
              f"  -> {manifest_path(args.out, name)}")
    print(f"  {total_bytes / 1e6:.2f} MB in {seconds:.1f}s: {total_bytes / 1e6 / seconds:.2f} MB/s, "
          f"{tokens / seconds / 1e6:.2f}M tokens/s with {args.workers} workers")
    for name, fix in (("val", "a larger"), ("train", "a smaller")):
        if manifests[name]["n_tokens"] == 0:
            print(f"warning: the {name} split is empty (val-fraction {args.val_fraction:g}); splitting is by "
                  f"document key, so give more documents or {fix} --val-fraction", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
