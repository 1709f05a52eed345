"""Document boundaries through the data pipeline: the token files' index, its EOS fallback, the stdlib
corpus's, and each sample's "documents" (lengths over the S input positions) through collate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_lc.data.corpus import stdlib_token_stream
from moe_lc.data.documents import check_starts, starts_from_eos, window_documents
from moe_lc.data.loader import Mixture, StepLoader, SyntheticTasks, TokenWindows, build_dataset, collate
from moe_lc.data.token_file import TokenFileWriter, documents_path, open_token_file, write_token_file
from moe_lc.data.tokenizer import ByteTokenizer

BYTE = ByteTokenizer()
EOS = BYTE.eos_id


def corpus(n_docs: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """Documents of random lengths (1 to 60 tokens, each a run of its own byte, then EOS) and the
    document each stream position belongs to."""
    rng = np.random.default_rng(seed)
    docs = [np.append(np.full(rng.integers(1, 61), k % 200, dtype=np.int64), EOS) for k in range(n_docs)]
    owner = np.repeat(np.arange(n_docs), [len(d) for d in docs])
    return docs, owner


def run_lengths(owner: np.ndarray) -> list[int]:
    """Lengths of the runs of equal values: the documents a window of positions crosses."""
    cuts = np.flatnonzero(np.diff(owner)) + 1
    return np.diff(np.concatenate([[0], cuts, [len(owner)]])).tolist()


def write_corpus(prefix, docs) -> dict:
    with TokenFileWriter(prefix, tokenizer_name="byte", vocab_size=259, source="test") as writer:
        for doc in docs:
            writer.append_document(doc[:-1], [EOS])
    return writer.meta


# ---------------------------------------------------------------------------------------------- boundaries


def test_window_documents_and_eos_starts_exact():
    starts = np.array([0, 10, 15, 35])
    assert window_documents(starts, 0, 10).tolist() == [10]
    assert window_documents(starts, 8, 8).tolist() == [2, 5, 1]  # starts mid-document 0, ends in 2
    assert window_documents(starts, 10, 5).tolist() == [5]  # exactly document 1
    assert window_documents(starts, 36, 4).tolist() == [4]  # inside the last document
    tokens = np.array([1, 2, EOS, 3, EOS, EOS, 4, 5])  # an empty document is its EOS; a tail without one
    assert starts_from_eos(tokens, EOS).tolist() == [0, 3, 5, 6]
    assert starts_from_eos(tokens[:5], EOS).tolist() == [0, 3]  # a final EOS opens nothing
    assert starts_from_eos(np.zeros(0, dtype=np.uint16), EOS).tolist() == []
    with pytest.raises(ValueError, match=r"starts\[1\] = 4, starts\[2\] = 4"):
        check_starts(np.array([0, 4, 4]), 9, "t")
    with pytest.raises(ValueError, match="must begin with 0"):
        check_starts(np.array([1, 4]), 9, "t")
    with pytest.raises(ValueError, match="start 9 lies past the stream's 9 tokens"):
        check_starts(np.array([0, 9]), 9, "t")


def test_eos_scan_in_chunks_equals_one_pass(monkeypatch):
    docs, _ = corpus(300, seed=3)
    tokens = np.concatenate(docs).astype(np.uint16)
    whole = starts_from_eos(tokens, EOS)
    monkeypatch.setattr("moe_lc.data.documents.EOS_SCAN_CHUNK", 7)
    assert np.array_equal(starts_from_eos(tokens, EOS), whole)


def test_token_file_records_each_document(tmp_path):
    docs, _ = corpus(50)
    meta = write_corpus(tmp_path / "c", docs)
    tokens, meta2, starts = open_token_file(tmp_path / "c", documents=True)
    assert meta == meta2 and meta["n_documents"] == 50
    assert starts.dtype == np.int64
    assert starts.tolist() == np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist()
    assert np.array_equal(tokens, np.concatenate(docs))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.docs.npy", "c.json"]
    assert open_token_file(tmp_path / "c")[1] == meta  # the two-item form stays as it was
    # write_token_file takes the starts too, and writes the same three files
    write_token_file(tmp_path / "w", tokens, "byte", 259, "test", doc_starts=starts)
    assert np.array_equal(open_token_file(tmp_path / "w", documents=True)[2], starts)
    # tokens appended before the first document form one of their own
    with TokenFileWriter(tmp_path / "m", tokenizer_name="byte", vocab_size=259, source="t") as writer:
        writer.append(np.array([5, 6]))
        writer.append_document(np.array([7, EOS]))
        writer.append_document(np.zeros(0, dtype=np.int64))  # empty: no document
        writer.append(np.array([8]))  # continues the last
    assert open_token_file(tmp_path / "m", documents=True)[2].tolist() == [0, 2]


def test_old_token_files_without_an_index_still_load(tmp_path):
    docs, _ = corpus(40)
    write_corpus(tmp_path / "c", docs)
    written = open_token_file(tmp_path / "c", documents=True)[2].copy()
    write_token_file(tmp_path / "old", np.concatenate(docs), "byte", 259, "an older build")  # plain append
    assert not documents_path(tmp_path / "old").exists()
    tokens, meta = open_token_file(tmp_path / "old")
    assert "n_documents" not in meta
    with pytest.raises(ValueError, match="has no document index .*pass the tokenizer's eos_id"):
        open_token_file(tmp_path / "old", documents=True)
    assert np.array_equal(open_token_file(tmp_path / "old", documents=True, eos_id=EOS)[2], written)

    # rewriting a prefix without documents drops the stale index of an earlier build
    write_token_file(tmp_path / "c", np.concatenate(docs), "byte", 259, "rewritten")
    assert not documents_path(tmp_path / "c").exists()


def test_damaged_index_is_named(tmp_path):
    docs, _ = corpus(20)
    write_corpus(tmp_path / "c", docs)
    np.save(documents_path(tmp_path / "c"), np.arange(19, dtype=np.int64) * 3)
    with pytest.raises(ValueError, match=r"c\.docs\.npy is truncated or corrupt: 19 starts, sidecar says 20"):
        open_token_file(tmp_path / "c", documents=True)
    documents_path(tmp_path / "c").unlink()
    with pytest.raises(FileNotFoundError, match=r"document index missing: .*c\.docs\.npy .* 20 documents"):
        open_token_file(tmp_path / "c", documents=True)


# ---------------------------------------------------------------------------------------------- samples


@pytest.mark.parametrize("seq_len", [1, 7, 64, 500])
def test_window_documents_match_the_documents_written(tmp_path, seq_len):
    docs, owner = corpus(120, seed=seq_len)
    write_corpus(tmp_path / "c", docs)
    tokens, _, starts = open_token_file(tmp_path / "c", documents=True)
    ds = TokenWindows(tokens, seq_len, seed=1, doc_starts=starts)
    for i in range(ds.n_windows + 3):  # a whole epoch and into the next
        sample = ds[i]
        begin = ds.window_index(i) * seq_len
        lengths = sample["documents"]
        assert lengths.dtype == torch.int64 and int(lengths.sum()) == seq_len
        assert lengths.tolist() == run_lengths(owner[begin : begin + seq_len])


def test_a_window_starting_mid_document():
    tokens = np.concatenate([np.full(9, 1), [EOS], np.full(4, 2), [EOS], np.full(19, 3), [EOS]])  # 10, 5, 20
    ds = TokenWindows(tokens, 8, seed=0, doc_starts=starts_from_eos(tokens, EOS))
    by_window = {ds.window_index(i): ds[i] for i in range(ds.n_windows)}
    assert by_window[1]["tokens"][:-1].tolist() == [1, EOS, 2, 2, 2, 2, EOS, 3]  # positions 8-15
    assert by_window[1]["documents"].tolist() == [2, 5, 1]  # doc 0's tail, doc 1, doc 2's first token
    assert by_window[0]["documents"].tolist() == [8]
    assert by_window[3]["documents"].tolist() == [8]  # inside document 2


def test_eos_fallback_equals_the_written_index(tmp_path):
    docs, _ = corpus(200, seed=5)
    write_corpus(tmp_path / "new.train", docs)
    write_token_file(tmp_path / "old.train", np.concatenate(docs), "byte", 259, "no index")
    new = build_dataset("tokens", split="train", seq_len=33, seed=2, tokenizer=BYTE, path=tmp_path / "new")
    old = build_dataset("tokens", split="train", seq_len=33, seed=2, tokenizer=BYTE, path=tmp_path / "old")
    assert np.array_equal(new.doc_starts, old.doc_starts)
    for i in range(new.n_windows):
        a, b = new[i], old[i]
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["documents"], b["documents"])


def test_documents_leave_tokens_masks_and_resume_unchanged():
    docs, _ = corpus(400, seed=9)
    tokens = np.concatenate(docs).astype(np.uint16)
    plain = TokenWindows(tokens, 16, seed=7)
    with_docs = TokenWindows(tokens, 16, seed=7, doc_starts=starts_from_eos(tokens, EOS))
    assert plain[3]["documents"] is None
    straight = StepLoader(with_docs, 8, 2)
    reference = StepLoader(plain, 8, 2)
    steps = [straight.next_step() for _ in range(4)]
    for step in steps:
        for mb, ref in zip(step, reference.next_step()):
            assert torch.equal(mb["tokens"], ref["tokens"]) and mb["loss_mask"] is None
            assert len(mb["documents"]) == 2 and all(int(d.sum()) == 16 for d in mb["documents"])
    resumed = StepLoader(with_docs, 8, 4, dp_rank=1, dp_size=2)  # resume at step 2 on dp 2, rank 1
    resumed.load_state_dict({"samples_consumed": 16})
    (mb,) = resumed.next_step()
    assert torch.equal(mb["tokens"], torch.cat([steps[2][2]["tokens"], steps[2][3]["tokens"]]))
    assert [d.tolist() for d in mb["documents"]] == [d.tolist() for m in steps[2][2:] for d in m["documents"]]
    assert resumed.state_dict()["samples_consumed"] == 24


def test_synthetic_mixture_and_collate_documents():
    tokens = np.concatenate(corpus(300, seed=2)[0])
    windows = TokenWindows(tokens, 127, seed=1, doc_starts=starts_from_eos(tokens, EOS))
    synthetic = SyntheticTasks(["passkey"], 127, 1, BYTE)
    assert synthetic[0]["documents"] is None  # one document
    mix = Mixture([windows, synthetic], [0.5, 0.5], seed=1)
    picks = [(mix.source_index(i), mix[i]) for i in range(12)]
    assert {j for j, _ in picks} == {0, 1}
    for i, (j, sample) in enumerate(picks):  # a mixture passes its source's documents through
        expected = windows[i]["documents"] if j == 0 else None
        assert (sample["documents"] is None) == (expected is None)
        if expected is not None:
            assert torch.equal(sample["documents"], expected)

    batch = collate([windows[0], synthetic[0]])
    assert batch["documents"][0].tolist() == windows[0]["documents"].tolist()
    assert batch["documents"][1].tolist() == [127] and batch["documents"][1].dtype == torch.int64
    assert batch["loss_mask"][0].tolist() == [1.0] * 127
    assert collate([synthetic[0], synthetic[1]])["documents"] is None


def test_stdlib_documents_one_per_file_and_cached(tmp_path, caplog):
    tokens, starts = stdlib_token_stream("val", BYTE, documents=True, cache_dir=tmp_path, cache_min_seconds=1e9)
    assert np.array_equal(starts, starts_from_eos(tokens, EOS))  # the byte vocabulary never makes EOS
    assert np.array_equal(stdlib_token_stream("val", BYTE, cache_dir=tmp_path, cache_min_seconds=1e9), tokens)
    stdlib_token_stream("val", BYTE, cache_dir=tmp_path, cache_min_seconds=0.0)  # build and cache
    assert sorted(p.name.partition("-vf0.02")[2] for p in tmp_path.iterdir()) == [".bin", ".docs.npy", ".json"]
    cached_tokens, cached_starts = stdlib_token_stream("val", BYTE, documents=True, cache_dir=tmp_path)
    assert isinstance(cached_tokens, np.memmap) and np.array_equal(cached_starts, starts)
    del cached_tokens, cached_starts  # drop the mappings before rewriting the files under them
    # a cache from before the index existed is rebuilt with one
    sidecar = next(tmp_path.glob("*.json"))
    meta = json.loads(sidecar.read_text())
    del meta["n_documents"]
    sidecar.write_text(json.dumps(meta))
    next(tmp_path.glob("*.docs.npy")).unlink()
    with caplog.at_level("WARNING"):
        rebuilt, rebuilt_starts = stdlib_token_stream("val", BYTE, documents=True, cache_dir=tmp_path,
                                                      cache_min_seconds=0.0)
    assert "no document index" in caplog.text
    assert np.array_equal(rebuilt_starts, starts) and next(tmp_path.glob("*.docs.npy")).is_file()


def test_default_stdlib_dataset_tokens_unchanged():
    """The default run's data: the extra key changes no token or mask."""
    ds = build_dataset("stdlib", split="val", seq_len=128, seed=0, tokenizer=BYTE)
    plain = TokenWindows(stdlib_token_stream("val", BYTE), 128, seed=0)
    for i in range(0, 4000, 97):
        a, b = ds[i], plain[i]
        assert torch.equal(a["tokens"], b["tokens"]) and a["loss_mask"] is None
        assert int(a["documents"].sum()) == 128
