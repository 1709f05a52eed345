"""Tests for moe_lc.data: tokenizers, corpus, token files, synthetic tasks, datasets, loader, prepare_data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_lc.data import loader, synthetic
from moe_lc.data.corpus import is_val_file, list_text_files, split_files, stdlib_root, stdlib_token_stream
from moe_lc.data.documents import starts_from_eos
from moe_lc.data.loader import Mixture, StepLoader, SyntheticTasks, TokenWindows, build_dataset, collate
from moe_lc.data.synthetic import TASKS, Sample, make_task
from moe_lc.data.token_corpus import split_token_files
from moe_lc.data.token_file import TokenFileWriter, check_vocab, open_token_file, write_token_file
from moe_lc.data.tokenizer import ByteTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
BYTE = ByteTokenizer()


# ---------------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "hello world\n", "héllo wörld — ünïcödé ✓ 日本語 🚀", "\x00\t\r\n"])
def test_byte_tokenizer_round_trip(text):
    ids = BYTE.encode(text)
    assert ids.dtype == np.int64
    assert len(ids) == len(text.encode("utf-8"))
    assert BYTE.decode(ids) == text
    assert BYTE.decode(torch.from_numpy(ids)) == text  # tensors and lists are accepted too
    assert BYTE.decode(ids.tolist()) == text


def test_byte_tokenizer_specials_and_invalid_utf8():
    assert (BYTE.bos_id, BYTE.eos_id, BYTE.pad_id, BYTE.vocab_size, BYTE.name) == (256, 257, 258, 259, "byte")
    ids = [BYTE.bos_id, *BYTE.encode("ab"), BYTE.eos_id, BYTE.pad_id, *BYTE.encode("c")]
    assert BYTE.decode(ids) == "abc"
    assert BYTE.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"  # a lone 0xFF is not UTF-8
    with pytest.raises(ValueError, match="negative"):
        BYTE.decode([-1])


def test_load_tokenizer_forms(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match=r"expected 'byte', a HuggingFace tokenizer\.json file, or a directory"):
        load_tokenizer("gpt2")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tokenizers"):
            load_tokenizer(str(tmp_path / "tok.json"))
    else:
        with pytest.raises(FileNotFoundError, match="tok.json"):
            load_tokenizer(str(tmp_path / "tok.json"))


def test_hf_tokenizer_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["The grass is green. The sky is blue. def f(x): return x"] * 20, trainer)
    tok.save(str(tmp_path / "tok.json"))
    hf = load_tokenizer(str(tmp_path / "tok.json"))
    assert (hf.eos_id, hf.pad_id) == (0, 1) and hf.bos_id == hf.eos_id  # no BOS in vocab: falls back to EOS
    assert hf.name.startswith("hf-tok-")
    text = "The sky is grün — ✓ 42"
    ids = hf.encode(text)
    assert ids.dtype == np.int64 and hf.decode(ids) == text
    assert hf.decode([hf.eos_id, *ids]) == text
    sample = make_task("passkey", np.random.default_rng(0), 300, hf)
    assert len(sample.tokens) == 300
    assert hf.decode(sample.tokens[sample.answer_start :]) == sample.answer
    # a model directory: tokenizer.json plus the special tokens its tokenizer_config.json names
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_bytes((tmp_path / "tok.json").read_bytes())
    (model_dir / "tokenizer_config.json").write_text(
        '{"eos_token": {"content": "<pad>"}, "bos_token": "<|endoftext|>", "pad_token": null}')
    from_dir = load_tokenizer(str(model_dir))
    assert (from_dir.eos_id, from_dir.bos_id, from_dir.pad_id) == (1, 0, 1)
    assert from_dir.encode(text).tolist() == ids.tolist()
    (model_dir / "tokenizer_config.json").write_text('{"eos_token": "<missing>"}')
    with pytest.raises(ValueError, match="eos_token '<missing>' is not in the vocabulary"):
        load_tokenizer(str(model_dir))


# ---------------------------------------------------------------------------------------------- corpus


def test_stdlib_split_is_by_file_disjoint_and_deterministic():
    files = list_text_files(stdlib_root(), "*.py")
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f or "__pycache__" in f for f in files)
    train, val = split_files(files, "train", 0.02), split_files(files, "val", 0.02)
    assert set(train).isdisjoint(val) and sorted(train + val) == files
    assert 0 < len(val) < 0.06 * len(files)
    assert split_files(files, "val", 0.02) == val
    # The split must never change between versions or processes (a moved file would leak val into train).
    golden = [5, 6, 14, 17, 59, 66, 70, 73, 87, 91, 92, 104, 107, 111, 112, 138, 160, 163, 175, 176, 182, 194, 197]
    assert [k for k in range(200) if is_val_file(f"mod{k}.py", 0.1)] == golden
    with pytest.raises(ValueError, match="split='test'"):
        split_files(files, "test", 0.02)


def test_token_stream_joins_documents_with_eos(tmp_path):
    texts = {"b.py": "print('b')\n", "a.py": "x = 'ü'\n", "sub/c.py": "pass\n", "empty.py": "", "d.txt": "no"}
    for rel, text in texts.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    stream = stdlib_token_stream("train", BYTE, val_fraction=0.0, root=tmp_path)
    assert stream.dtype == np.uint16
    expected = b"".join(texts[r].encode() + b"\x00" for r in ("a.py", "b.py", "sub/c.py"))  # sorted, no empty
    eos_free = np.where(stream == BYTE.eos_id, 0, stream).astype(np.uint8).tobytes()
    assert eos_free == expected and int((stream == BYTE.eos_id).sum()) == 3
    # max_bytes cuts the source text (here inside the 2-byte 'ü', which then decodes as U+FFFD) and stops.
    capped = stdlib_token_stream("train", BYTE, val_fraction=0.0, root=tmp_path, max_bytes=6)
    assert capped.tolist() == [*BYTE.encode("x = '\ufffd"), BYTE.eos_id]
    with pytest.raises(FileNotFoundError, match="no Python standard library sources"):
        stdlib_token_stream("train", BYTE, root=tmp_path / "sub" / "missing")


def test_stdlib_stream_real_and_cached(tmp_path):
    val = stdlib_token_stream("val", BYTE, cache_dir=tmp_path, cache_min_seconds=1e9)
    assert val.dtype == np.uint16 and len(val) > 10_000
    assert not list(tmp_path.iterdir())  # fast builds are not cached
    val_files = split_files(list_text_files(stdlib_root()), "val", 0.02)
    assert int((val == BYTE.eos_id).sum()) == sum(1 for f in val_files if (stdlib_root() / f).stat().st_size)
    cached_build = stdlib_token_stream("val", BYTE, cache_dir=tmp_path, cache_min_seconds=0.0)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".bin", ".json", ".npy"]  # tokens, sidecar, docs
    assert "-byte-val-vf0.02" in next(tmp_path.glob("*.json")).name
    from_cache = stdlib_token_stream("val", BYTE, cache_dir=tmp_path)
    assert isinstance(from_cache, np.memmap)
    assert np.array_equal(from_cache, val) and np.array_equal(cached_build, val)
    del from_cache  # drop the mapping before damaging the file under it
    cache_bin = next(tmp_path.glob("*.bin"))
    cache_bin.write_bytes(cache_bin.read_bytes()[:100])  # a damaged cache is rebuilt, not fatal
    assert np.array_equal(stdlib_token_stream("val", BYTE, cache_dir=tmp_path, cache_min_seconds=0.0), val)
    assert np.array_equal(stdlib_token_stream("val", BYTE, cache_dir=tmp_path), val)


# ---------------------------------------------------------------------------------------------- token files


@pytest.mark.parametrize("vocab_size, dtype", [(259, np.uint16), (65536, np.uint16), (70_000, np.uint32)])
def test_token_file_round_trip(tmp_path, vocab_size, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1000)
    meta = write_token_file(tmp_path / "d", tokens, "tok", vocab_size, "unit test")
    opened, meta2 = open_token_file(tmp_path / "d")
    assert opened.dtype == dtype and np.array_equal(opened, tokens)
    assert meta == meta2
    assert {k: meta[k] for k in ("dtype", "n_tokens", "tokenizer", "vocab_size", "source")} == {
        "dtype": np.dtype(dtype).name, "n_tokens": 1000, "tokenizer": "tok", "vocab_size": vocab_size,
        "source": "unit test",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.json"]  # no temporary files left


def test_token_file_errors(tmp_path):
    write_token_file(tmp_path / "d", np.arange(100), "byte", 259, "t")
    bin_path, json_path = tmp_path / "d.bin", tmp_path / "d.json"

    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated or corrupt: 198 bytes .* 100 tokens x 2 bytes = 200"):
        open_token_file(tmp_path / "d")
    bin_path.unlink()
    with pytest.raises(FileNotFoundError, match=r"data missing: .*d\.bin"):
        open_token_file(tmp_path / "d")
    json_path.unlink()
    with pytest.raises(FileNotFoundError, match=r"sidecar missing: .*d\.json"):
        open_token_file(tmp_path / "d")

    bad_meta = {"dtype": "float32", "n_tokens": 1, "tokenizer": "b", "vocab_size": 2, "source": ""}
    json_path.write_text(json.dumps(bad_meta))
    with pytest.raises(ValueError, match="dtype 'float32'"):
        open_token_file(tmp_path / "d")
    with pytest.raises(ValueError, match=r"token id 300 outside \[0, 259\)"):
        write_token_file(tmp_path / "bad", np.array([1, 300]), "byte", 259, "t")
    assert not list(tmp_path.glob("bad*"))  # an aborted write leaves nothing behind


def test_check_vocab(tmp_path):
    meta = write_token_file(tmp_path / "d", np.array([1, 2, 257]), "byte", 259, "t")
    check_vocab(meta, 259)
    check_vocab(meta, 258)  # only ids actually present matter
    with pytest.raises(ValueError, match="contains token id 257 >= model vocab_size 256"):
        check_vocab(meta, 256)
    tokens, meta = open_token_file(tmp_path / "d")
    with pytest.raises(ValueError, match="token id 257 >= model vocab_size 200"):
        check_vocab(meta, 200, tokens)


def test_empty_token_file_opens(tmp_path):
    with TokenFileWriter(tmp_path / "e", tokenizer_name="byte", vocab_size=259, source="t"):
        pass
    tokens, meta = open_token_file(tmp_path / "e")
    assert len(tokens) == 0 and meta["n_tokens"] == 0
    with pytest.raises(ValueError, match="data too short: 0 tokens for seq_len 8"):
        TokenWindows(tokens, 8, seed=0)


# ---------------------------------------------------------------------------------------------- windows


def test_token_windows_cover_each_window_once_per_epoch():
    seq_len, n_windows = 10, 100
    tokens = np.arange(seq_len * n_windows + 5)  # 5 spare tokens: (1005 - 1) // 10 = 100 windows
    ds = TokenWindows(tokens, seq_len, seed=3)
    assert ds.n_windows == n_windows
    epochs = []
    for epoch in range(2):
        starts = [int(ds[i]["tokens"][0]) for i in range(epoch * n_windows, (epoch + 1) * n_windows)]
        assert sorted(starts) == list(range(0, seq_len * n_windows, seq_len))
        epochs.append(starts)
    assert epochs[0] != epochs[1]
    sample = ds[7]
    assert sample["loss_mask"] is None and sample["tokens"].dtype == torch.int64
    assert sample["tokens"].tolist() == list(range(int(sample["tokens"][0]), int(sample["tokens"][0]) + 11))
    other_seed = TokenWindows(tokens, seq_len, seed=4)
    assert [other_seed.window_index(i) for i in range(20)] != [ds.window_index(i) for i in range(20)]
    with pytest.raises(ValueError, match="data too short: 10 tokens for seq_len 10"):
        TokenWindows(np.arange(10), 10, seed=0)
    with pytest.raises(IndexError):
        ds[-1]


def test_samples_are_pure_functions_of_index(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint16)
    order = [250, 3, 999, 0, 42]
    for make in (
        lambda: TokenWindows(tokens, 16, seed=1),
        lambda: SyntheticTasks(["passkey", "associative_recall"], 127, 1, BYTE),
        lambda: Mixture([TokenWindows(tokens, 127, 1), SyntheticTasks(["passkey"], 127, 1, BYTE)], [0.5, 0.5], 1),
    ):
        first, second = make(), make()
        for i in range(5):  # read some samples on one object only, then read out of order on both
            first[i]
        for i in order:
            a, b = first[i], second[i]
            assert torch.equal(a["tokens"], b["tokens"])
            assert (a["loss_mask"] is None) == (b["loss_mask"] is None)
    assert not torch.equal(make()[0]["tokens"], make()[1]["tokens"])


def test_mixture_follows_weights_and_passes_global_index():
    class Echo:
        seq_len = 2

        def __init__(self, tag):
            self.tag = tag

        def __getitem__(self, i):
            return {"tokens": torch.tensor([self.tag, i, 0]), "loss_mask": None}

    mix = Mixture([Echo(0), Echo(1), Echo(2)], [0.2, 0.0, 0.8], seed=5)
    picks = [mix[i]["tokens"].tolist() for i in range(2000)]
    assert all(p[1] == i for i, p in enumerate(picks))
    counts = np.bincount([p[0] for p in picks], minlength=3)
    assert counts[1] == 0 and abs(counts[0] / 2000 - 0.2) < 0.04
    with pytest.raises(ValueError, match="one weight per source"):
        Mixture([Echo(0)], [0.5, 0.5], seed=0)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        Mixture([Echo(0)], [0.0], seed=0)


def test_synthetic_dataset_masks(monkeypatch):
    ds = SyntheticTasks(list(TASKS), 1023, seed=0, tokenizer=BYTE)
    item = ds[5]
    assert item["tokens"].shape == (1024,) and item["loss_mask"].shape == (1023,)
    assert item["loss_mask"][1:].all()  # no padding: every label counts (but the very first)

    answer_ds = SyntheticTasks(["passkey"], 511, seed=0, tokenizer=BYTE, answer_only_loss=True)
    item, sample = answer_ds[2], answer_ds.sample(2)
    labels = item["tokens"][1:][item["loss_mask"].bool()]
    assert BYTE.decode(labels) == sample.answer

    # Left padding: the tasks fill the length exactly, so force a short sample to test the padding path.
    short = Sample(BYTE.encode("ab cd 42"), 6, 8, "42", "passkey", {})
    monkeypatch.setattr(loader, "make_task", lambda *args, **kwargs: short)
    item = SyntheticTasks(["passkey"], 11, seed=0, tokenizer=BYTE)[0]
    assert item["tokens"].tolist() == [BYTE.pad_id] * 4 + BYTE.encode("ab cd 42").tolist()
    assert item["loss_mask"].tolist() == [0.0] * 4 + [1.0] * 7  # label tokens[t+1]; t < 4 is pad or after pad only


def test_synthetic_dataset_rejects_bad_kinds_and_short_lengths():
    with pytest.raises(ValueError, match="unknown synthetic task.*known tasks: passkey"):
        SyntheticTasks(["passkey", "sudoku"], 512, 0, BYTE)
    with pytest.raises(ValueError, match="too short for task 'multikey_needle'"):
        SyntheticTasks(["multikey_needle"], 127, 0, BYTE)
    train, val = SyntheticTasks(["passkey"], 255, 0, BYTE), SyntheticTasks(["passkey"], 255, 0, BYTE, split="val")
    assert not torch.equal(train[0]["tokens"], val[0]["tokens"])


# ---------------------------------------------------------------------------------------------- step loader


def _tokens_of(batches):
    return torch.cat([b["tokens"] for b in batches])


@pytest.fixture(scope="module")
def windows():
    return TokenWindows(np.random.default_rng(1).integers(0, 256, size=20_000), 16, seed=7)


def test_step_loader_dp_ranks_partition_the_global_batch(windows):
    single = StepLoader(windows, global_batch=8, micro_batch=2, dp_rank=0, dp_size=1)
    for _ in range(3):
        reference = single.next_step()
        assert len(reference) == 4 and reference[0]["tokens"].shape == (2, 17) and reference[0]["loss_mask"] is None
        for dp_size in (2, 4):
            ranks = [StepLoader(windows, 8, 2, r, dp_size) for r in range(dp_size)]
            for rank in ranks:
                rank.load_state_dict(single.state_dict() | {"samples_consumed": single.samples_consumed - 8})
            union = torch.cat([_tokens_of(rank.next_step()) for rank in ranks])
            assert torch.equal(union, _tokens_of(reference))
    rank1 = StepLoader(windows, 8, 2, 1, 2)
    assert rank1.step_indices() == [[4, 5], [6, 7]]
    rank1.next_step()
    assert rank1.step_indices() == [[12, 13], [14, 15]] and rank1.state_dict()["samples_consumed"] == 8


def test_step_loader_resume_and_change_dp_size(windows):
    straight = StepLoader(windows, 8, 2, 0, 1)
    expected = [_tokens_of(straight.next_step()) for _ in range(5)]
    assert not torch.equal(expected[0], expected[1])  # steps move through the data

    before = StepLoader(windows, 8, 2, 0, 1)
    for _ in range(2):
        before.next_step()
    state = before.state_dict()
    assert state["samples_consumed"] == 16

    resumed = StepLoader(windows, 8, 2, 0, 1)
    resumed.load_state_dict(state)
    assert torch.equal(_tokens_of(resumed.next_step()), expected[2])

    ranks = [StepLoader(windows, 8, 4, r, 2) for r in range(2)]  # dp 1 -> 2 and a new micro_batch
    for rank in ranks:
        rank.load_state_dict(resumed.state_dict())
    for step in (3, 4):
        assert torch.equal(torch.cat([_tokens_of(r.next_step()) for r in ranks]), expected[step])


def test_step_loader_validation(windows):
    with pytest.raises(ValueError, match=r"global_batch=10 must be divisible by micro_batch=2 x dp_size=4"):
        StepLoader(windows, 10, 2, 0, 4)
    with pytest.raises(ValueError, match="dp_rank=2"):
        StepLoader(windows, 8, 2, 2, 2)
    with pytest.raises(ValueError, match="samples_consumed"):
        StepLoader(windows, 8, 2).load_state_dict({"samples_consumed": -8})


def test_collate_fills_missing_masks():
    a = {"tokens": torch.arange(4), "loss_mask": None}
    b = {"tokens": torch.arange(4), "loss_mask": torch.tensor([0.0, 1.0, 1.0])}
    assert collate([a, a])["loss_mask"] is None
    assert collate([a, b])["loss_mask"].tolist() == [[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]


# ---------------------------------------------------------------------------------------------- synthetic tasks


@pytest.mark.parametrize("kind", list(TASKS))
@pytest.mark.parametrize("length", [600, 1999, 8192])
def test_task_length_answer_and_determinism(kind, length):
    sample = make_task(kind, np.random.default_rng(11), length, BYTE)
    assert len(sample.tokens) <= length and len(sample.tokens) >= length - 4
    assert sample.tokens.dtype == np.int64 and sample.kind == kind
    assert sample.answer_end == len(sample.tokens)
    assert BYTE.decode(sample.tokens[sample.answer_start : sample.answer_end]) == sample.answer
    again = make_task(kind, np.random.default_rng(11), length, BYTE)
    assert np.array_equal(sample.tokens, again.tokens) and sample.params == again.params
    other = make_task(kind, np.random.default_rng(12), length, BYTE)
    assert not np.array_equal(sample.tokens, other.tokens)


@pytest.mark.parametrize("kind", ["passkey", "multikey_needle"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_depth_is_honored(kind, depth):
    """depth = fraction of the filler text that precedes the (queried) needle, up to half a sentence."""
    sample = make_task(kind, np.random.default_rng(0), 4000, BYTE, depth=depth)
    text = BYTE.decode(sample.tokens)  # all ASCII: character offsets are token offsets
    context = text[: text.rindex("What is")]
    pattern = r"The pass key is (\d+)\. Remember it\. \1 is the pass key\. " if kind == "passkey" else (
        r"One of the special magic numbers for (\w+) is: \d+\. ")
    needles = list(re.finditer(pattern, context))
    assert len(needles) == (1 if kind == "passkey" else 4)
    queried = next(m for m in needles if m.group(1) == sample.params.get("query_key", sample.answer))
    filler_total = len(context) - sum(len(m.group(0)) for m in needles)
    filler_before = queried.start() - sum(len(m.group(0)) for m in needles if m.start() < queried.start())
    longest_sentence = max(len(s) for s in synthetic.FILLER_SENTENCES)
    # Needles go to the nearest sentence boundary: off by at most half a sentence.
    assert abs(filler_before / filler_total - depth) <= 0.5 * longest_sentence / filler_total
    assert sample.params["depth_actual"] == pytest.approx(filler_before / filler_total)
    assert queried.start() in sample.params["needle_starts"]  # recorded token offsets are where the needles are


def test_variable_tracking_answer_is_the_chain():
    sample = make_task("variable_tracking", np.random.default_rng(4), 3000, BYTE, n_chains=3, n_hops=5)
    text = BYTE.decode(sample.tokens)
    value = re.search(r"assigned the value (\d+): ", text).group(1)
    assigned = {}
    for name, rhs in re.findall(r"VAR (\w+) = ([^.]+)\.", text):
        assigned[name] = assigned[rhs[4:]] if rhs.startswith("VAR ") else rhs  # statements come in order
    names = sample.answer.split(" ")
    assert len(names) == 5 and len(assigned) == 15
    assert sorted(names) == sorted(n for n, v in assigned.items() if v == value)
    positions = [text.index(f"VAR {n} =") for n in names]
    assert positions == sorted(positions)


def test_associative_recall_answer_matches_the_list():
    for depth in (0.0, 0.5, 1.0):
        sample = make_task("associative_recall", np.random.default_rng(1), 2000, BYTE, depth=depth)
        text = BYTE.decode(sample.tokens)
        pairs = re.findall(r"^([a-z]{4}): (\d{5})$", text, flags=re.M)
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)) == sample.params["n_pairs"] > 100
        assert dict(pairs)[sample.params["query_key"]] == sample.answer
        assert keys.index(sample.params["query_key"]) == round(depth * (len(keys) - 1))
    few = make_task("associative_recall", np.random.default_rng(1), 2000, BYTE, n_pairs=3)
    assert few.params["n_pairs"] == 3 and len(few.tokens) == 2000


def test_make_task_errors():
    with pytest.raises(ValueError, match="unknown synthetic task 'sudoku'; known tasks: passkey, multikey_needle"):
        make_task("sudoku", np.random.default_rng(0), 100, BYTE)
    with pytest.raises(ValueError, match="length=50 is too short for task 'passkey'"):
        make_task("passkey", np.random.default_rng(0), 50, BYTE)
    with pytest.raises(ValueError, match=r"depth=1.5 must be in \[0, 1\]"):
        make_task("passkey", np.random.default_rng(0), 500, BYTE, depth=1.5)


# ---------------------------------------------------------------------------------------------- build_dataset + CLI


def test_build_dataset_sources(tmp_path):
    stdlib = build_dataset("stdlib", split="val", seq_len=64, seed=0, tokenizer=BYTE)
    assert isinstance(stdlib, TokenWindows) and stdlib[0]["tokens"].shape == (65,)
    mix = build_dataset("stdlib+synthetic", split="val", seq_len=511, seed=0, tokenizer=BYTE,
                        synthetic_kinds=["passkey"], synthetic_weight=0.5)
    assert isinstance(mix, Mixture) and {mix.source_index(i) for i in range(20)} == {0, 1}
    assert isinstance(build_dataset("synthetic", split="train", seq_len=1023, seed=0, tokenizer=BYTE), SyntheticTasks)

    write_token_file(tmp_path / "c.train", np.arange(300) % 256, "byte", 259, "t")
    tokens_ds = build_dataset("tokens", split="train", seq_len=32, seed=0, tokenizer=BYTE, path=tmp_path / "c")
    assert tokens_ds.n_windows == 9
    write_token_file(tmp_path / "o.train", np.arange(300) % 256, "hf-other-123", 259, "t")
    with pytest.raises(ValueError, match="built with tokenizer 'hf-other-123', but this run uses 'byte'"):
        build_dataset("tokens", split="train", seq_len=32, seed=0, tokenizer=BYTE, path=tmp_path / "o")
    with pytest.raises(FileNotFoundError, match=r"c\.val\.json"):
        build_dataset("tokens", split="val", seq_len=32, seed=0, tokenizer=BYTE, path=tmp_path / "c")
    with pytest.raises(ValueError, match="data source 'wiki' is not one of stdlib, tokens"):
        build_dataset("wiki", split="train", seq_len=32, seed=0, tokenizer=BYTE)
    with pytest.raises(ValueError, match="needs 0 < synthetic_weight < 1"):
        build_dataset("stdlib+synthetic", split="train", seq_len=32, seed=0, tokenizer=BYTE)
    with pytest.raises(ValueError, match="use source 'stdlib\\+synthetic'"):
        build_dataset("stdlib", split="val", seq_len=32, seed=0, tokenizer=BYTE, synthetic_weight=0.1)


def test_prepare_data_cli(tmp_path):
    corpus_dir = tmp_path / "corpus"
    texts = {f"doc{k:02d}.txt": f"document {k} — ünïcode\n" * (k + 1) for k in range(40)}
    texts["nested/deep.txt"] = "nested file\n"
    for rel, text in texts.items():
        (corpus_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus_dir / rel).write_text(text, encoding="utf-8")
    (corpus_dir / "ignored.md").write_text("not matched by the glob")
    extra = tmp_path / "extra.txt"
    extra.write_text("a file given directly")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(REPO / "tools" / "prepare_data.py"), str(corpus_dir), str(extra),
           "--out", str(tmp_path / "out" / "c"), "--val-fraction", "0.25", "--glob", "*.txt"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"tokenize \(\d+ workers\): 100%.* docs 42 ", result.stderr) and "summary:" in result.stdout

    texts["extra.txt"] = extra.read_text()
    decoded = {}
    for split in ("train", "val"):
        (shard,) = split_token_files(tmp_path / "out" / "c", split)  # one shard each: far below --shard-tokens
        tokens, meta, starts = open_token_file(shard, documents=True)
        assert meta["tokenizer"] == "byte" and tokens[-1] == BYTE.eos_id
        assert np.array_equal(starts, starts_from_eos(tokens, BYTE.eos_id))  # the index: one start per file
        docs = np.split(np.asarray(tokens), np.flatnonzero(np.asarray(tokens) == BYTE.eos_id) + 1)[:-1]
        decoded[split] = [BYTE.decode(d) for d in docs]
    assert sorted(decoded["train"] + decoded["val"]) == sorted(texts.values())
    val_keys = {rel for rel in texts if is_val_file(rel if rel != "extra.txt" else "extra.txt", 0.25)}
    assert sorted(decoded["val"]) == sorted(texts[rel] for rel in val_keys) and decoded["val"]

    missing = subprocess.run(cmd[:2] + [str(tmp_path / "nope"), "--out", str(tmp_path / "x")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode != 0 and "input not found" in missing.stderr
