"""Tokenize text files into train/val token files for `[data] source = "tokens"`.

    python tools/prepare_data.py INPUT... --out PREFIX [--tokenizer byte|path/tokenizer.json|model dir]
                                 [--val-fraction 0.02] [--glob '*.txt']

INPUT is a file or a directory (searched recursively for --glob, skipping __pycache__ and
site-packages). Writes PREFIX.train.{bin,json} and PREFIX.val.{bin,json}. Files are split by a stable
hash of their path relative to the INPUT directory (a file given directly: its name), the same rule as
the built-in stdlib corpus, so re-running on a grown corpus keeps every old file in its split. Each
document is followed by EOS. Output appears atomically when a split is complete.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/prepare_data.py` from a checkout: run as tools.prepare_data
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.prepare_data", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import sys
import time
from pathlib import Path


from moe_lc.data.corpus import is_val_file, list_text_files, read_text
from moe_lc.data.token_file import TokenFileWriter, token_dtype
from moe_lc.data.tokenizer import load_tokenizer

ENCODE_BATCH_FILES = 64  # files per encode_batch call (HF tokenizers encode a batch in parallel)
PROGRESS_EVERY_S = 1.0


def collect_files(inputs: list[str], pattern: str) -> list[tuple[Path, str]]:
    """(absolute path, split key) for every input file; the key is the path relative to its INPUT dir."""
    found = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += [(path / rel, rel) for rel in list_text_files(path, pattern)]
        elif path.is_file():
            found.append((path, path.name))
        else:
            raise FileNotFoundError(f"input not found: {item}")
    return found


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
                    writer.append(ids)
                    writer.append(eos)
            now = time.perf_counter() - start
            if now - last_print >= PROGRESS_EVERY_S or first + len(batch) == len(files):
                last_print = now
                print(
                    f"[{name}] files {first + len(batch)}/{len(files)}  {n_bytes / 1e6:.1f} MB  "
                    f"{writer.n_tokens / 1e6:.2f}M tokens  {now:.1f}s",
                    flush=True,
                )
    return {"files": len(files), "bytes": n_bytes, "tokens": writer.n_tokens, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or directories")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.train.* and PREFIX.val.*")
    parser.add_argument("--tokenizer", default="byte", help="'byte', a HuggingFace tokenizer.json, or a model directory holding one")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="fraction of files held out (by hash)")
    parser.add_argument("--glob", default="*.txt", help="file name pattern inside directories (default *.txt)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.val_fraction < 1.0:
        parser.error(f"--val-fraction={args.val_fraction} must be in [0, 1)")

    tokenizer = load_tokenizer(args.tokenizer)
    try:
        files = collect_files(args.inputs, args.glob)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if not files:
        parser.error(f"no files matching {args.glob!r} under {' '.join(args.inputs)}")
    splits = {"train": [], "val": []}
    for path, key in files:
        splits["val" if is_val_file(key, args.val_fraction) else "train"].append(path)
    print(
        f"{len(files)} files -> train {len(splits['train'])}, val {len(splits['val'])}; "
        f"tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size}, {token_dtype(tokenizer.vocab_size).name})",
        flush=True,
    )

    stats = {}
    for name, split_files in splits.items():
        source = f"prepare_data {name}: {' '.join(args.inputs)} glob={args.glob} val_fraction={args.val_fraction:g}"
        stats[name] = write_split(name, split_files, args.out, tokenizer, source)

    print("summary:")
    for name, s in stats.items():
        bytes_per_token = s["bytes"] / s["tokens"] if s["tokens"] else float("nan")
        print(
            f"  {name:5s} {s['files']:6d} files  {s['bytes'] / 1e6:8.2f} MB  {s['tokens']:12,d} tokens  "
            f"{bytes_per_token:.2f} bytes/token  {s['seconds']:.1f}s  -> {args.out}.{name}.bin"
        )
    if stats["val"]["tokens"] == 0:
        print(
            f"warning: the val split is empty ({len(files)} files, val-fraction {args.val_fraction:g}); "
            "splitting is by file, so give more files or a larger --val-fraction",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
