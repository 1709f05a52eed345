"""Tokenize text files into train/val token files for `[data] source = "tokens"`.

    python tools/prepare_data.py INPUT... --out PREFIX [--tokenizer byte|path/tokenizer.json|model dir]
                                 [--val-fraction 0.02] [--glob '*.txt']

INPUT is a file or a directory (searched recursively for --glob, skipping __pycache__ and
site-packages). Writes PREFIX.train.{bin,json,docs.npy} and PREFIX.val.{bin,json,docs.npy} (docs.npy:
where each document starts, see moe_lc/data/token_file.py). Files are split by a stable hash of their
path relative to the INPUT directory (a file given directly: its name), the same rule as the built-in
stdlib corpus, so re-running on a grown corpus keeps every old file in its split. A file is a
document: its tokens followed by EOS. Output appears atomically when a split is complete; missing parent
folders of PREFIX are made.

Only text is tokenized: a file whose first 8 KiB hold a NUL byte or are not UTF-8 is binary. A
binary file named directly is refused (exit status 2, one line naming it); binary files found in a
directory (a stray .so or image matching --glob) are skipped and counted in the first line printed,
since a directory is a corpus whose odd member should not cost the rest. Mistakes in the arguments
(a missing input, an unwritable or directory PREFIX, an unknown tokenizer) are one `error: ` line with
exit status 2, found before anything is tokenized.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/prepare_data.py` from a checkout: run as tools.prepare_data
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.prepare_data", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import codecs
import sys
import time
from pathlib import Path


from moe_lc.data.corpus import is_val_file, list_text_files, read_text
from moe_lc.data.token_file import TokenFileWriter, token_dtype
from moe_lc.data.tokenizer import load_tokenizer

from moe_lc.out_path import OutPathError, out_file

ENCODE_BATCH_FILES = 64  # files per encode_batch call (HF tokenizers encode a batch in parallel)
PROGRESS_EVERY_S = 1.0
SNIFF_BYTES = 8192  # how much of a file decides whether it is text


def binary_reason(path: Path) -> str | None:
    """Why `path` is not text (unreadable, or a NUL byte or bytes that are not UTF-8 in its first
    SNIFF_BYTES), else None."""
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


def collect_files(inputs: list[str], pattern: str) -> tuple[list[tuple[Path, str]], list[Path]]:
    """((path, split key) for every text file, files skipped in directories). The key is the path
    relative to its INPUT dir. ValueError for a missing input or a file given directly that is not text."""
    found, skipped = [], []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            for rel in list_text_files(path, pattern):
                if binary_reason(path / rel):
                    skipped.append(path / rel)
                else:
                    found.append((path / rel, rel))
        elif path.is_file():
            reason = binary_reason(path)
            if reason:
                raise ValueError(f"input {item} {reason}")
            found.append((path, path.name))
        else:
            raise ValueError(f"input not found: {item}")
    return found, skipped


def output_files(prefix: str) -> list[Path]:
    """The four output files of PREFIX, checked and their folder made (OutPathError: one line)."""
    if prefix.endswith(("/", "\\")) or Path(prefix).is_dir():
        raise OutPathError(f"--out {prefix}: names a directory; PREFIX is a file prefix such as "
                           f"{Path(prefix) / 'corpus'} (writes {Path(prefix) / 'corpus'}.train.bin, ...)")
    return [out_file("--out", f"{prefix}.{split}.{ext}", prefix)
            for split in ("train", "val") for ext in ("bin", "json")]


def write_split(name: str, files: list[Path], prefix: str, tokenizer, source: str) -> dict:
    """Tokenize `files` into `{prefix}.{name}`, printing progress; returns counts."""
    eos = [tokenizer.eos_id]
    n_bytes, start, last_print = 0, time.perf_counter(), 0.0
    with TokenFileWriter(
        f"{prefix}.{name}", tokenizer_name=tokenizer.name, vocab_size=tokenizer.vocab_size, source=source
    ) as writer:
        for first in range(0, len(files), ENCODE_BATCH_FILES):
            batch = files[first : first + ENCODE_BATCH_FILES]
            texts = [read_text(p) for p in batch]
            n_bytes += sum(p.stat().st_size for p in batch)
            for text, ids in zip(texts, tokenizer.encode_batch(texts)):
                if text:
                    writer.append_document(ids, eos)
            now = time.perf_counter() - start
            if now - last_print >= PROGRESS_EVERY_S or first + len(batch) == len(files):
                last_print = now
                print(
                    f"[{name}] files {first + len(batch)}/{len(files)}  {n_bytes / 1e6:.1f} MB  "
                    f"{writer.n_tokens / 1e6:.2f}M tokens  {now:.1f}s",
                    flush=True,
                )
    return {"files": len(files), "bytes": n_bytes, "tokens": writer.n_tokens, "seconds": time.perf_counter() - start}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or directories")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.train.* and PREFIX.val.*")
    parser.add_argument("--tokenizer", default="byte", help="'byte', a HuggingFace tokenizer.json, or a model directory holding one")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="fraction of files held out (by hash)")
    parser.add_argument("--glob", default="*.txt", help="file name pattern inside directories (default *.txt)")
    return parser.parse_args(argv)


def prepare(args) -> tuple[object, list[tuple[Path, str]], list[Path]]:
    """(tokenizer, files, skipped binary files) once every argument checks out; ValueError otherwise."""
    if not 0.0 <= args.val_fraction < 1.0:
        raise ValueError(f"--val-fraction={args.val_fraction} must be in [0, 1)")
    files, skipped = collect_files(args.inputs, args.glob)
    if not files:
        binary = f" ({len(skipped)} files skipped: not UTF-8 text)" if skipped else ""
        raise ValueError(f"no text files matching {args.glob!r} under {' '.join(args.inputs)}{binary}")
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--tokenizer: {exc}") from None
    output_files(args.out)  # last: it makes PREFIX's missing folders
    return tokenizer, files, skipped


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, or 2 with one `error: ` line when an argument is wrong (no token file is written then)."""
    args = parse_args(argv)
    try:
        tokenizer, files, skipped = prepare(args)
    except ValueError as exc:  # OutPathError too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    splits = {"train": [], "val": []}
    for path, key in files:
        splits["val" if is_val_file(key, args.val_fraction) else "train"].append(path)
    shown = ", ".join(str(p) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    print(
        f"{len(files)} files -> train {len(splits['train'])}, val {len(splits['val'])}; "
        f"tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size}, {token_dtype(tokenizer.vocab_size).name})"
        + (f"; skipped {len(skipped)} files that are not UTF-8 text ({shown})" if skipped else ""),
        flush=True,
    )
    stats = {}
    for name, split_files in splits.items():
        source = f"prepare_data {name}: {' '.join(args.inputs)} glob={args.glob} val_fraction={args.val_fraction:g}"
        stats[name] = write_split(name, split_files, args.out, tokenizer, source)
    print_summary(stats, args, len(files), len(skipped))
    return 0


def print_summary(stats: dict, args, n_files: int, n_skipped: int) -> None:
    print("summary:")
    for name, s in stats.items():
        bytes_per_token = s["bytes"] / s["tokens"] if s["tokens"] else float("nan")
        print(
            f"  {name:5s} {s['files']:6d} files  {s['bytes'] / 1e6:8.2f} MB  {s['tokens']:12,d} tokens  "
            f"{bytes_per_token:.2f} bytes/token  {s['seconds']:.1f}s  -> {args.out}.{name}.bin"
        )
    if n_skipped:
        print(f"  skipped {n_skipped} files that are not UTF-8 text (binary or unreadable)")
    if stats["val"]["tokens"] == 0:
        print(
            f"warning: the val split is empty ({n_files} files, val-fraction {args.val_fraction:g}); "
            "splitting is by file, so give more files or a larger --val-fraction",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
