"""[[data.sources]] mixtures: weights drawn as asked, exact resume, the same global samples under any
data-parallel size; shards and globs read as one stream; documents joined, filtered and upsampled; the
recipe tables and their errors; what the trainer logs per source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_lc.config import ConfigError, load_config, to_toml
from moe_lc.config.sections import DataConfig, SourceConfig
from moe_lc.data.document_select import Selection, select_documents
from moe_lc.data.loader import Mixture, StepLoader
from moe_lc.data.mixture_sources import dataset_from_config, drawn_tokens, format_report, mixture_report
from moe_lc.data.token_corpus import SegmentStream, TokenCorpus, open_token_corpus, split_token_files
from moe_lc.data.token_file import TokenFileWriter
from moe_lc.data.tokenizer import ByteTokenizer
from tests.harness import RECIPES

BYTE = ByteTokenizer()
EOS = BYTE.eos_id


def write_source(prefix, n_docs: int, value: int, seed: int, keys=None, split: str = "train") -> list[np.ndarray]:
    """A token file PREFIX.split of documents filled with `value` (lengths 5..80, then EOS); `keys`: a
    metadata 'repo' per document. Returns the documents."""
    rng = np.random.default_rng(seed)
    docs = [np.append(np.full(rng.integers(5, 81), value), EOS) for _ in range(n_docs)]
    fields = ("repo",) if keys is not None else ()
    with TokenFileWriter(f"{prefix}.{split}", tokenizer_name="byte", vocab_size=259, source="t",
                         metadata_fields=fields) as writer:
        for k, doc in enumerate(docs):
            writer.append_document(doc, metadata={"repo": keys[k]} if keys is not None else None)
    return docs


def three_sources(tmp_path, weights=(0.5, 0.3, 0.2), **data) -> DataConfig:
    for name, value in (("web", 1), ("code", 2), ("books", 3)):
        write_source(tmp_path / name, 300, value, seed=value)
    sources = [SourceConfig(path=str(tmp_path / name), weight=w) for name, w in zip(("web", "code", "books"), weights)]
    return DataConfig(source="stdlib", sources=sources, **data)


def test_three_sources_follow_their_weights(tmp_path):
    ds = dataset_from_config(three_sources(tmp_path), split="train", seq_len=32, seed=3, tokenizer=BYTE)
    assert isinstance(ds, Mixture) and ds.names == ["web", "code", "books"]
    n = 10_000
    report = mixture_report(ds, 0, n, 32)
    shares = [r["share"] for r in report["sources"]]
    assert all(abs(s - w) < 0.02 for s, w in zip(shares, (0.5, 0.3, 0.2))), shares
    assert sum(r["samples"] for r in report["sources"]) == n
    assert "web" in format_report(report) and "(weight 0.500)" in format_report(report)
    for i in range(0, 400, 7):  # a sample's tokens are its source's: each source is one byte value
        sample = ds[i]
        assert set(sample["tokens"].tolist()) - {EOS} == {ds.source_index(i) + 1}
        assert sample["source"] == ds.source_index(i) and int(sample["documents"].sum()) == 32
    tokens = drawn_tokens(ds, 100, 16, 32)
    assert sum(tokens.values()) == 16 * 32 and set(tokens) == {"data/tokens/web", "data/tokens/code", "data/tokens/books"}


def test_mixture_resumes_exactly_and_dp_layouts_see_the_same_samples(tmp_path):
    ds = dataset_from_config(three_sources(tmp_path, synthetic_weight=0.25, synthetic_tasks=["passkey"]),
                             split="train", seq_len=127, seed=1, tokenizer=BYTE)
    assert ds.names == ["web", "code", "books", "synthetic"] and ds.weights[3] == pytest.approx(0.25)
    straight = StepLoader(ds, global_batch=8, micro_batch=2)
    steps = [straight.next_step() for _ in range(6)]

    def flat(step, key):
        return torch.cat([mb[key] for mb in step])

    resumed = StepLoader(ds, 8, 2)
    resumed.load_state_dict({"samples_consumed": 3 * 8})  # a checkpoint after step 3
    for k in range(3, 6):
        step = resumed.next_step()
        assert torch.equal(flat(step, "tokens"), flat(steps[k], "tokens"))
        assert torch.equal(flat(step, "source"), flat(steps[k], "source"))
    sources = torch.cat([flat(s, "source") for s in steps])
    assert set(sources.tolist()) == {0, 1, 2, 3}

    for k in range(6):  # dp 2 (micro-batches of 4) against dp 1, step by step
        ranks = [StepLoader(ds, 8, 4, dp_rank=r, dp_size=2) for r in range(2)]
        for rank in ranks:
            rank.load_state_dict({"samples_consumed": k * 8})
        both = [rank.next_step() for rank in ranks]
        assert torch.equal(torch.cat([flat(b, "tokens") for b in both]), flat(steps[k], "tokens"))
        assert torch.equal(torch.cat([flat(b, "source") for b in both]), flat(steps[k], "source"))
        docs = [d.tolist() for b in both for mb in b for d in (mb["documents"] or [])]
        assert docs == [d.tolist() for mb in steps[k] for d in (mb["documents"] or [])]


def test_shards_and_globs_read_as_one_stream(tmp_path):
    parts = [write_source(tmp_path / f"part{k}", 20, k + 1, seed=k, split=f"train.{k:05d}") for k in range(3)]
    (tmp_path / "part.train.shards.json").write_text(json.dumps({"shards": [f"part{k}.train.{k:05d}" for k in range(3)]}))
    whole = np.concatenate([d for docs in parts for d in docs])
    tokens, starts = open_token_corpus(tmp_path / "part", "train", BYTE).stream()
    assert isinstance(tokens, SegmentStream) and len(tokens) == len(whole)
    assert np.array_equal(tokens[0 : len(tokens)], whole)
    for a, b in ((0, 10), (50, 2000), (len(whole) - 7, len(whole))):  # across shard ends too
        assert np.array_equal(tokens[a:b], whole[a:b])
    assert starts.tolist() == np.cumsum([0] + [len(d) for docs in parts for d in docs][:-1]).tolist()

    write_source(tmp_path / "g" / "x-a", 10, 7, seed=1)
    write_source(tmp_path / "g" / "x-b", 10, 8, seed=2)
    assert [p.rpartition("/")[2] for p in split_token_files(tmp_path / "g" / "x-*", "train")] == \
        ["x-a.train", "x-b.train"]
    with pytest.raises(FileNotFoundError, match=r"no token files match .*y-\*\.train"):
        split_token_files(tmp_path / "g" / "y-*", "train")
    with pytest.raises(FileNotFoundError, match=r"expected .*nope\.val\.shards\.json .* or .*nope\.val\.json"):
        split_token_files(tmp_path / "nope", "val")


def test_concatenate_by_key_filter_and_upsample():
    # documents of lengths 3, 4, 5, 6, 7 (each ends with EOS); keys a, -, a, b, - ('' stays alone)
    lengths = [3, 4, 5, 6, 7]
    tokens = np.concatenate([np.append(np.full(n - 1, k), EOS) for k, n in enumerate(lengths)]).astype(np.uint16)
    starts = np.cumsum([0] + lengths[:-1])
    corpus = TokenCorpus([tokens], [starts], known_metadata={"repo": ["a", "", "a", "b", None]})

    stream, doc_starts, stats = select_documents(corpus, Selection(concat_by="repo"))
    # a's two members first (where a began), then the lone 4, then b, then the lone 7
    assert stream[0 : len(stream)].tolist() == [0, 0, EOS, 2, 2, 2, 2, EOS, 1, 1, 1, EOS, 3] + [3] * 4 + [EOS] + \
        [4] * 6 + [EOS]
    assert np.diff(np.append(doc_starts, len(stream))).tolist() == [8, 4, 6, 7]  # a is one document of 3 + 5
    assert stats == {"documents": 5, "joined": 4, "kept": 4, "upsampled": 0, "tokens": 25}

    _, doc_starts, stats = select_documents(corpus, Selection(concat_by="repo", min_doc_tokens=6, max_doc_tokens=7))
    assert stats["kept"] == 2 and np.diff(np.append(doc_starts, 13)).tolist() == [6, 7]  # b and the lone 7

    stream, doc_starts, stats = select_documents(corpus, Selection(upsample_min_tokens=6, upsample_factor=3))
    lengths_out = np.diff(np.append(doc_starts, len(stream))).tolist()
    assert lengths_out == [3, 4, 5, 6, 7, 6, 7, 6, 7] and stats["upsampled"] == 2  # two more passes of the long two
    assert stream[25:31].tolist() == [3] * 5 + [EOS]

    with pytest.raises(ValueError, match="src: no document has between 100 and any number of tokens .*longest has 7"):
        select_documents(corpus, Selection(min_doc_tokens=100), "src")


def test_stdlib_packages_joined_as_long_documents():
    data = DataConfig(sources=[SourceConfig(source="stdlib", weight=0.5),
                               SourceConfig(name="packages", source="stdlib", concat_by="dir", min_doc_tokens=4096,
                                            weight=0.5)])
    ds = dataset_from_config(data, split="val", seq_len=256, seed=0, tokenizer=BYTE)
    files, packages = ds.sources
    assert len(packages.doc_starts) < len(files.doc_starts)
    package_lengths = np.diff(np.append(packages.doc_starts, len(packages.tokens)))
    assert package_lengths.min() >= 4096 and package_lengths.max() > np.diff(files.doc_starts).max()


def test_recipe_tables_round_trip_and_errors(tmp_path):
    recipe = tmp_path / "mix.toml"
    recipe.write_text(f'extends = "{RECIPES / "debug_cpu.toml"}"\n'
                      '[[data.sources]]\nsource = "stdlib"\nweight = 0.7\n'
                      '[[data.sources]]\nname = "books"\npath = "data/books*"\nweight = 0.3\nconcat_by = "book"\n'
                      'min_doc_tokens = 1024\n')
    cfg = load_config(recipe)
    assert [s.label for s in cfg.data.sources] == ["stdlib", "books"] and cfg.data.sources[1].concat_by == "book"
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg
    assert "[[data.sources]]" in to_toml(cfg, docs=True)

    bad = load_config(recipe, ["data.path=x"], check=False)
    assert bad.data.errors() == ["data.sources lists the corpora: data.source='stdlib' and data.path='x' describe a "
                                 "single one (leave them out with [[data.sources]])"]
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ['data.sources=[{weight = 0.0}, {source = "stdlib", path = "p", concat_by = "repo"}, '
                             '{source = "wiki", path = "q"}, {path = "a/q", upsample_factor = 2}]'])
    assert info.value.errors == [
        "data.sources[2].source='wiki' must be one of 'tokens', 'stdlib'",  # the choices are checked first
        "data.sources[0].path is empty: a tokens source needs a token-file prefix or glob",
        "data.sources[0].weight=0.0 must be > 0 (leave the table out to draw nothing from it)",
        "data.sources[1].path='p' is set, but a stdlib source reads this machine's Python sources (remove path, "
        "or set source = 'tokens')",
        "data.sources[1].concat_by='repo': stdlib documents keep only path, dir",
        "data.sources[3].upsample_factor=2 repeats every document (upsample_min_tokens = 0), which changes "
        "nothing: set upsample_min_tokens to the length that counts as long",
        "data.sources[2] and data.sources[3] are both named 'q': give each a distinct name",
    ]
    with pytest.raises(ConfigError, match=r"data.sources must be an array of tables"):
        load_config(recipe, ["data.sources=5"])


TWO_SOURCES = ('data.sources=[{source = "stdlib", weight = 0.6}, {name = "packages", source = "stdlib", '
               'concat_by = "dir", min_doc_tokens = 4096, weight = 0.4}]')


def test_the_trainer_logs_tokens_and_loss_per_source(tmp_path):
    """Per step: the tokens each source gave, and its next-token loss, which, weighted by those tokens,
    averages to the step's loss (these sources have no loss mask)."""
    from moe_lc.train import main

    out = tmp_path / "run"
    sets = ["train.steps=3", "train.seq_len=64", "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=1",
            "train.threads=1", f"train.output_dir={out}", "train.loggers=[]", TWO_SOURCES]
    assert main([str(RECIPES / "debug_cpu.toml"), *sum((["--set", s] for s in sets), [])]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    both = 0
    for line in lines:
        assert line["data/tokens/stdlib"] + line["data/tokens/packages"] == 4 * 64
        drawn = {name: line[f"data/tokens/{name}"] for name in ("stdlib", "packages")}
        assert {k for k in line if k.startswith("data/loss/")} == {f"data/loss/{n}" for n, t in drawn.items() if t}
        mean = sum(line.get(f"data/loss/{n}", 0.0) * t for n, t in drawn.items()) / (4 * 64)
        assert mean == pytest.approx(line["loss"], rel=1e-6)
        both += all(drawn.values())
    assert both and len({line["data/loss/stdlib"] for line in lines}) == 3  # a real per-step value
    report = json.loads((out / "data_mixture.json").read_text())
    assert report["samples"] == 12 and [r["name"] for r in report["sources"]] == ["stdlib", "packages"]
    assert sum(line["data/tokens/packages"] for line in lines) == report["sources"][1]["tokens"]


@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.pp=2", "parallel.cp=2"], id="pp2xcp2"),
    pytest.param(["parallel.tp=2", "parallel.dp=2"], id="tp2xdp2"),
])
def test_loss_per_source_is_the_same_under_any_layout(layout):
    """The per-source losses are reduced like the main loss: pipeline stages without the head book
    nothing, cp ranks book parts of each row, tp ranks the same rows (vocab-parallel loss)."""
    from tests.harness import reference, run_layout

    sets = ["train.steps=3", "train.seq_len=64", "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=1",
            TWO_SOURCES]
    ref = reference(RECIPES / "debug_cpu.toml", sets)
    got = run_layout(RECIPES / "debug_cpu.toml", sets + layout, world=4)
    keys = [k for k in ref.metrics[0] if k.startswith("data/loss/")]
    assert keys and len(ref.metrics) == len(got.metrics) == 3
    for a, b in zip(ref.metrics, got.metrics):
        assert [k for k in b if k.startswith("data/loss/")] == [k for k in a if k.startswith("data/loss/")]
        for key in (k for k in a if k.startswith("data/loss/")):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
