"""Data pipeline throughput: tokenization by tools/prepare_data.py with 1..N workers, and the loader's time
per sample at a long context (128K by default), so the loader can be held against a training step.

    python tools/data_bench.py [--out runs/data_bench] [--workers 1,2] [--tokenizers byte,bpe] [--mb 8]
                               [--seq-len 131072] [--samples 40]

Corpus: the first --mb MB of this interpreter's standard library sources, as one JSON Lines file (a
record per source file), so the parse runs too. Tokenizers: `byte`, and `bpe`, a byte-level BPE of
8,192 ids trained here on the same text with the HuggingFace `tokenizers` library (nothing downloaded;
the `[hf]` extra), which is how a real vocabulary costs. Each (tokenizer, workers) prepares the corpus
into fresh shards; MB/s counts the UTF-8 text, tokens/s the tokens written, both over the whole run
(pool start, reading, writing).

Loader: global samples of --seq-len tokens from (a) the stdlib token stream, (b) prepare_data's shards of
the corpus read as one stream, (c) a [[data.sources]] mixture of stdlib files and stdlib packages joined
per folder, (d) the synthetic passkey task; each sample as the trainer gets it (window, "documents",
collate). Prints a table and writes results.json / results.md to --out.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/data_bench.py` from a checkout: run as tools.data_bench
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.data_bench", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import contextlib
import io
import json
import os
import platform
import time
from pathlib import Path

from moe_lc.config.sections import DataConfig, SourceConfig
from moe_lc.data.corpus import list_text_files, read_text, stdlib_root
from moe_lc.data.loader import SyntheticTasks, TokenWindows, collate
from moe_lc.data.mixture_sources import dataset_from_config
from moe_lc.data.token_corpus import open_token_corpus
from moe_lc.data.tokenizer import ByteTokenizer, load_tokenizer

from .prepare_data import main as prepare_main
from moe_lc.job.out_path import out_dir


def write_corpus(path: Path, max_mb: float) -> int:
    """The first `max_mb` MB of stdlib sources as JSON Lines at `path`; returns the text's UTF-8 bytes."""
    root, total = stdlib_root(), 0
    with open(path, "w", encoding="utf-8") as fh:
        for rel in list_text_files(root, "*.py"):
            text = read_text(root / rel)
            if text:
                fh.write(json.dumps({"text": text, "path": rel}) + "\n")
                total += len(text.encode("utf-8"))
            if total >= max_mb * 1e6:
                break
    return total


def train_bpe(corpus: Path, folder: Path) -> Path:
    """A byte-level BPE tokenizer.json of 8,192 ids trained on the corpus (with an EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = (json.loads(line)["text"] for line in open(corpus, encoding="utf-8"))
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>", "<pad>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def tokenize_run(corpus: Path, text_bytes: int, tokenizer: str, workers: int, out: Path) -> dict:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = prepare_main([str(corpus), "--out", str(out), "--tokenizer", tokenizer, "--workers", str(workers),
                               "--val-fraction", "0", "--shard-tokens", str(1 << 24), "--overwrite"])
    seconds = time.perf_counter() - start
    if status:
        raise SystemExit(f"prepare_data failed ({status}) for tokenizer {tokenizer}, {workers} workers")
    tokens = json.loads(Path(f"{out}.train.shards.json").read_text())["n_tokens"]
    return {"workers": workers, "seconds": seconds, "text_mb": text_bytes / 1e6, "tokens": tokens,
            "mb_per_s": text_bytes / 1e6 / seconds, "tokens_per_s": tokens / seconds}


def time_samples(dataset, n: int) -> dict:
    """Seconds per sample of dataset[i] + collate([sample]) over n global samples (after one warm-up)."""
    collate([dataset[0]])
    start = time.perf_counter()
    for i in range(1, n + 1):
        batch = collate([dataset[i * 7919]])  # spread over the data, as a shuffled epoch reads it
    seconds = (time.perf_counter() - start) / n
    return {"ms_per_sample": seconds * 1e3, "documents_in_last": len(batch["documents"][0]) if batch["documents"] else 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/data_bench")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--tokenizers", default="byte,bpe", help="byte and/or bpe")
    ap.add_argument("--mb", type=float, default=8.0, help="MB of stdlib sources to tokenize")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--samples", type=int, default=40, help="loader samples timed per dataset")
    args = ap.parse_args(argv)
    out = out_dir("--out", args.out)
    corpus = out / "stdlib.jsonl"
    text_bytes = write_corpus(corpus, args.mb)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "corpus_mb": text_bytes / 1e6, "tokenize": [], "loader": []}
    for name in args.tokenizers.split(","):
        spec = "byte" if name == "byte" else str(train_bpe(corpus, out))
        for workers in (int(w) for w in args.workers.split(",")):
            row = {"tokenizer": name, **tokenize_run(corpus, text_bytes, spec, workers, out / f"shards-{name}")}
            results["tokenize"].append(row)
            print(f"tokenize {name:4s} {workers} workers: {row['mb_per_s']:6.2f} MB/s  "
                  f"{row['tokens_per_s'] / 1e6:6.2f}M tokens/s  ({row['seconds']:.1f} s)", flush=True)

    byte, s = ByteTokenizer(), args.seq_len
    stdlib = dataset_from_config(DataConfig(), split="train", seq_len=s, seed=0, tokenizer=byte)
    shards = None
    if "byte" in args.tokenizers.split(","):
        tokens, starts = open_token_corpus(out / "shards-byte", "train", byte).stream()
        shards = TokenWindows(tokens, s, 0, doc_starts=starts)
    mixture = dataset_from_config(DataConfig(sources=[
        SourceConfig(source="stdlib", weight=0.4),
        SourceConfig(name="packages", source="stdlib", concat_by="dir", min_doc_tokens=s, weight=0.6)]),
        split="train", seq_len=s, seed=0, tokenizer=byte)
    synthetic = SyntheticTasks(["passkey"], s, 0, load_tokenizer("byte"))
    for name, ds in (("stdlib stream", stdlib), ("prepare_data shards", shards), ("mixture: files + packages", mixture),
                     ("synthetic passkey", synthetic)):
        if ds is not None:
            row = {"dataset": name, "seq_len": s, **time_samples(ds, args.samples)}
            results["loader"].append(row)
            print(f"loader {name:26s} {row['ms_per_sample']:8.2f} ms per {s:,}-token sample", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"machine: {results['machine']}; corpus {results['corpus_mb']:.1f} MB of stdlib sources", "",
             "| tokenizer | workers | MB/s | tokens/s | seconds |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['tokenizer']} | {r['workers']} | {r['mb_per_s']:.2f} | {r['tokens_per_s'] / 1e6:.2f}M | "
              f"{r['seconds']:.1f} |" for r in results["tokenize"]]
    lines += ["", "| dataset | ms per sample |", "| --- | --- |"]
    lines += [f"| {r['dataset']} ({r['seq_len']:,} tokens) | {r['ms_per_sample']:.2f} |" for r in results["loader"]]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"results: {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
