"""tools/prepare_data.py on real corpus formats: JSON Lines (plain, gzip, zstd) and Parquet through worker
processes into token shards with document indexes, resumed after a kill, and its mistakes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_lc.data.corpus import is_val_file
from moe_lc.data.token_corpus import open_token_corpus, split_token_files
from moe_lc.data.token_file import open_token_file, read_document_metadata
from moe_lc.data.tokenizer import ByteTokenizer
from tools import prepare_data

REPO = Path(__file__).resolve().parents[1]
BYTE = ByteTokenizer()
pyarrow = pytest.importorskip("pyarrow", reason="Parquet inputs need pyarrow (pip install -e '.[data]')")
zstandard = pytest.importorskip("zstandard", reason=".jsonl.zst inputs need zstandard (pip install -e '.[data]')")


def records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "ünï", "δέλτα", "code()", "\n"]
    return [{"text": " ".join(rng.choice(words, size=rng.integers(1, 40))), "repo": f"repo{k % 7}", "id": k}
            for k in range(n)]


def write_inputs(folder: Path, recs: list[dict]) -> list[str]:
    """The records in four files: JSONL, JSONL.gz, JSONL.zst and Parquet, a quarter each, in that order."""
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    q = len(recs) // 4
    parts = [recs[:q], recs[q : 2 * q], recs[2 * q : 3 * q], recs[3 * q :]]
    lines = [("".join(json.dumps(r) + "\n" for r in part)).encode() for part in parts[:3]]
    (folder / "a.jsonl").write_bytes(lines[0])
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(lines[1]))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines[2]))
    pq.write_table(pyarrow.Table.from_pylist(parts[3]), folder / "d.parquet", row_group_size=17)
    return [str(folder / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet")]


def expected_split(recs: list[dict], inputs: list[str], split: str, val_fraction: float) -> list[dict]:
    """The records of `split` in order: split by `file:record` keys, as prepare_data does."""
    q = len(recs) // 4
    out = []
    for k, rec in enumerate(recs):
        part = min(k // q, 3)
        key = f"{Path(inputs[part]).name}:{k - part * q}"
        if is_val_file(key, val_fraction) == (split == "val") and rec["text"]:
            out.append(rec)
    return out


def prepare(inputs, out, *extra) -> int:
    return prepare_data.main([*inputs, "--out", str(out), "--val-fraction", "0.2", "--shard-tokens", "700",
                              "--meta-fields", "repo", *extra])


def output_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_two_workers_write_the_bytes_of_one_and_of_a_plain_tokenization(tmp_path, capsys):
    recs = records(240)
    inputs = write_inputs(tmp_path / "in", recs)
    assert prepare(inputs, tmp_path / "w1" / "c", "--workers", "1") == 0
    assert prepare(inputs, tmp_path / "w2" / "c", "--workers", "2") == 0
    printed = capsys.readouterr()
    assert "4 files (2 jsonl, 1 parquet)" not in printed.out and "4 files (3 jsonl, 1 parquet)" in printed.out
    assert "summary:" in printed.out and "with 2 workers" in printed.out
    assert "docs 240" in printed.err  # the progress bar's last state: documents, tokens/s
    assert output_bytes(tmp_path / "w1") == output_bytes(tmp_path / "w2")

    for split in ("train", "val"):
        want = expected_split(recs, inputs, split, 0.2)
        files = split_token_files(tmp_path / "w2" / "c", split)
        assert len(files) > (1 if split == "train" else 0)  # several shards of about 700 tokens
        corpus = open_token_corpus(tmp_path / "w2" / "c", split, BYTE)
        tokens, starts = corpus.stream()
        plain = [np.append(BYTE.encode(r["text"]), BYTE.eos_id) for r in want]
        assert np.array_equal(tokens[0 : len(tokens)], np.concatenate(plain))
        assert starts.tolist() == np.cumsum([0] + [len(d) for d in plain[:-1]]).tolist()
        assert corpus.metadata("repo") == [r["repo"] for r in want]
        for prefix in files:  # every shard ends where a document ends, with a complete index
            shard, meta, shard_starts = open_token_file(prefix, documents=True)
            assert shard[-1] == BYTE.eos_id and meta["n_documents"] == len(shard_starts)
            assert read_document_metadata(prefix, ["repo"])["repo"][0].startswith("repo")


def test_an_interrupted_prepare_resumes_to_the_same_bytes(tmp_path):
    recs = records(240, seed=1)
    inputs = write_inputs(tmp_path / "in", recs)
    assert prepare(inputs, tmp_path / "whole" / "c", "--workers", "1") == 0
    cmd = [sys.executable, str(REPO / "tools" / "prepare_data.py"), *inputs, "--out", str(tmp_path / "cut" / "c"),
           "--val-fraction", "0.2", "--shard-tokens", "700", "--meta-fields", "repo", "--workers", "1"]
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(REPO), MOE_LC_FAULT="prepare_kill@4"))
    assert killed.returncode == -9, killed.stderr  # SIGKILLed right after its fourth train shard
    left = sorted(p.name for p in (tmp_path / "cut").iterdir())
    assert "c.train.00003.json" in left and "c.train.00004.json" not in left
    assert "c.val.00001.bin" not in left and any(n.startswith("c.val.00001.bin.tmp-") for n in left)  # half-written
    with pytest.raises(FileNotFoundError, match="has shards but no c.train.shards.json: .* interrupted"):
        split_token_files(tmp_path / "cut" / "c", "train")  # a run never reads part of a split
    assert prepare(inputs, tmp_path / "cut" / "c", "--workers", "2") == 0
    assert output_bytes(tmp_path / "cut") == output_bytes(tmp_path / "whole")
    assert prepare(inputs, tmp_path / "cut" / "c", "--workers", "2") == 0  # complete: nothing to do
    assert output_bytes(tmp_path / "cut") == output_bytes(tmp_path / "whole")


def test_text_files_keep_path_and_dir_and_split_by_a_field(tmp_path):
    root = tmp_path / "lib"
    texts = {"pkg/a.py": "a = 1\n", "pkg/sub/b.py": "b = 2\n", "top.py": "top\n", "pkg/empty.py": ""}
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert prepare_data.main([str(root), "--out", str(tmp_path / "t"), "--glob", "*.py", "--val-fraction", "0.5",
                              "--meta-fields", "path,dir", "--split-by", "dir", "--workers", "1"]) == 0
    by_split = {}
    for split in ("train", "val"):
        corpus = open_token_corpus(tmp_path / "t", split, BYTE)
        by_split[split] = list(zip(corpus.metadata("path"), corpus.metadata("dir")))
    assert sorted(by_split["train"] + by_split["val"]) == [("pkg/a.py", "pkg"), ("pkg/sub/b.py", "pkg/sub"),
                                                          ("top.py", "")]  # the empty file is no document
    for split, docs in by_split.items():  # the split follows the dir's hash
        assert all(is_val_file(d, 0.5) == (split == "val") for _, d in docs if d)


def one_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_mistakes_are_one_line(tmp_path, capsys, monkeypatch):
    inputs = write_inputs(tmp_path / "in", records(40))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x", "id": 3}) + "\n")
    assert prepare_data.main([str(bad), "--out", str(tmp_path / "b"), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # found while tokenizing: after the progress bar
    assert err[-1] == f"error: {bad}:2: no field 'text' (fields: body, id); name the text field with --text-field"
    assert "Traceback" not in "".join(err) and not list(tmp_path.glob("b.*.0000*"))  # no shard published
    line = one_error(capsys, prepare_data.main([inputs[3], "--out", str(tmp_path / "p"), "--text-field", "body"]))
    assert "has no column 'body' (columns: text, repo, id)" in line

    assert prepare(inputs, tmp_path / "o" / "c", "--workers", "1") == 0
    capsys.readouterr()
    line = one_error(capsys, prepare(inputs, tmp_path / "o" / "c", "--workers", "1", "--text-field", "id"))
    assert "holds a prepare with other settings (text_field differ)" in line and "--overwrite" in line
    before = len(split_token_files(tmp_path / "o" / "c", "train"))
    assert prepare(inputs[:1], tmp_path / "o" / "c", "--workers", "1", "--overwrite") == 0
    capsys.readouterr()
    assert 1 <= len(split_token_files(tmp_path / "o" / "c", "train")) < before  # the old shards are gone
    assert not (tmp_path / "o" / f"c.train.{before - 1:05d}.bin").exists()

    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if the [data] extra were not installed
    line = one_error(capsys, prepare_data.main([inputs[2], "--out", str(tmp_path / "z")]))
    assert "needs the Python package zstandard: pip install -e '.[data]'" in line
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    line = one_error(capsys, prepare_data.main([inputs[3], "--out", str(tmp_path / "z")]))
    assert "(Parquet) needs the Python package pyarrow: pip install -e '.[data]'" in line
