"""RULER's tasks in the eval harness: every family builds exactly `length` tokens with the answer where the
scorer reads it (byte and Hugging Face tokenizers), seeded; real-text haystacks; RULER's string match;
teacher-forced exact match and greedy generation agree on a deterministic answer; the command line
(summary table, skipped QA, one-line mistakes) and context parallelism (the same predictions)."""

import json

import numpy as np
import pytest
import torch

import eval.run as eval_run
from eval import ruler_run
from eval.haystack import load_haystack, sentences
from eval.ruler import NEEDS_QA, RULER_TASKS, make_ruler_sample
from eval.ruler_qa import load_qa
from eval.ruler_sample import RulerSample, TooShort
from moe_lc.config import load_config
from moe_lc.data import ByteTokenizer, load_tokenizer
from moe_lc.data.token_file import write_token_file
from moe_lc.model import decode
from moe_lc.model.transformer import build_model
from tests.harness import RECIPES, eval_alone_and_on_cp2

PROSE = ("The river runs past the old mill. Nobody remembers who built it! Children still play on its steps. "
         "Is the wheel turning today? It turns when the rain comes. ") * 40
SQUAD = [{"title": "Rivers", "context": "The Nile is a river in Africa. It is about 6650 km long.",
          "question": "How long is the Nile?", "answers": {"text": ["6650 km", "about 6650 km"]}},
         {"title": "Rivers", "context": "The Amazon flows through South America.",
          "question": "Where is the Amazon?", "answers": {"text": ["South America"]}},
         {"title": "Cities", "context": "Paris lies on the Seine.", "question": "Which river?",
          "answers": {"text": ["the Seine"]}},
         {"title": "Cities", "context": "Tokyo is large.", "question": "Is it?", "answers": {"text": []}}]
HOTPOT = [{"question": "Which is older, the mill or the bridge?", "answer": "the mill",
           "context": [["Mill", ["The mill was built in 1820. ", "It still stands."]],
                       ["Bridge", ["The bridge was built in 1901."]]]},
          {"question": "Who built the tower?", "answer": "Ada",
           "context": {"title": ["Tower", "Park"], "sentences": [["Ada built the tower."], ["The park is green."]]}}]


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qa")
    return _jsonl(folder / "squad.jsonl", SQUAD), _jsonl(folder / "hotpot.jsonl", HOTPOT)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A byte-level BPE trained offline on RULER-like text (as tests/test_data.py builds one)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PROSE, "One of the special magic numbers for bitter-falcon is: 1234567.",
                             "VAR ABCDE = VAR FGHIJ", "Document 1:\nThe Nile"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return load_tokenizer(str(path))


def _haystack(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("hay") / "prose.txt"
    path.write_text(PROSE)
    return load_haystack(str(path), tokenizer)


@pytest.mark.parametrize("which", ["byte", "hf"])
def test_every_task_is_exactly_length_tokens_with_the_answer_last(which, hf_tokenizer, qa_files, tmp_path_factory):
    tok = ByteTokenizer() if which == "byte" else hf_tokenizer
    haystack = _haystack(tmp_path_factory, tok)
    qa = {"squad": load_qa(qa_files[0], "squad"), "hotpotqa": load_qa(qa_files[1], "hotpotqa")}
    for name in RULER_TASKS:
        for length in (2500, 8200):  # cwe changes its repeats at 4096, as RULER's
            s = make_ruler_sample(name, np.random.default_rng([1, length]), length, tok, haystack=haystack,
                                  qa_data=qa.get(NEEDS_QA.get(name)))
            assert isinstance(s, RulerSample) and len(s.tokens) == length and s.tokens.dtype == np.int64, name
            assert tok.decode(s.tokens[s.answer_start:]) == s.answer, name  # the scorer reads exactly these
            assert ruler_run.string_match_all(s.answer, s.outputs) == 1.0, name  # the reference scores 1
            prompt = tok.decode(s.tokens[:s.answer_start])
            assert prompt.rstrip().endswith(("text is", "text are", "they are:", "in the list are:",
                                             "words are:", "Answer:")), (name, prompt[-60:])
            if name.startswith("niah"):
                for key in s.params["asked"]:
                    assert f"special magic {s.params['type_needle_v']} for {key} is: " in prompt, name
            if name == "vt":
                assert all(f"VAR {b} = VAR {a}" in prompt for a, b in zip(s.outputs, s.outputs[1:]))
        with pytest.raises(TooShort, match="too short"):
            make_ruler_sample(name, np.random.default_rng(0), 60, tok, haystack=haystack,
                              qa_data=qa.get(NEEDS_QA.get(name)))


def test_samples_are_seeded_and_cells_independent(tmp_path_factory):
    tok = ByteTokenizer()
    haystack = _haystack(tmp_path_factory, tok)
    a, b = (ruler_run.make_samples("niah_single_2", 1500, 3, 7, tok, haystack) for _ in range(2))
    c = ruler_run.make_samples("niah_single_2", 1500, 3, 8, tok, haystack)
    d = ruler_run.make_samples("niah_single_1", 1500, 3, 7, tok, haystack)  # another task: other values
    assert [s.outputs for s in a] == [s.outputs for s in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert [s.outputs for s in a] != [s.outputs for s in c] and [s.outputs for s in a] != [s.outputs for s in d]


def test_needles_land_at_sentence_starts_of_a_real_text(tmp_path_factory):
    tok = ByteTokenizer()
    haystack = _haystack(tmp_path_factory, tok)
    assert haystack.name.startswith("text file") and sentences("A b. C d!  E f?\nG")[:2] == ["A b. ", "C d! "]
    for i in range(5):
        s = make_ruler_sample("niah_multikey_1", np.random.default_rng(i), 2000, tok, haystack=haystack)
        text = tok.decode(s.tokens)
        for key in s.params["keys"]:
            at = text.index(f"One of the special magic numbers for {key}")
            assert text[at - 2:at] in (". ", "! ", "? ") or text[at - 1] == "\n", text[at - 40:at]


def test_a_token_file_haystack(tmp_path):
    tok = ByteTokenizer()
    write_token_file(tmp_path / "hay", np.concatenate(tok.encode_batch(sentences(PROSE))), tokenizer_name="byte",
                     vocab_size=tok.vocab_size, source="test")
    haystack = load_haystack(str(tmp_path / "hay"), tok)
    assert haystack.name == f"token file {tmp_path / 'hay'}"
    text = PROSE.replace("  ", " ")
    starts = [int(x) for x in haystack.starts[:6]]
    assert [text[x - 2:x] for x in starts[1:]] == [". ", "! ", ". ", "? ", ". "]  # after each sentence end
    window, inside = haystack.window(3000, np.random.default_rng(0))  # longer than the text: it wraps
    assert len(window) == 3000 and inside[0] == 0 and inside[-1] == 3000
    with pytest.raises(ValueError, match="tokenizer 'byte'"):
        load_haystack(str(tmp_path / "hay"), type("T", (), {"name": "other"})())


def test_string_match_is_rulers():
    assert ruler_run.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler_run.string_match_all("ABC", ["abc"]) == 1.0  # case-insensitive
    assert ruler_run.string_match_part("It is the Seine.", ["Seine", "the river"]) == 1.0
    assert ruler_run.string_match_part("no idea", ["Seine"]) == 0.0
    assert ruler_run.postprocess("  1234\x00567\t ") == "1234\n567"


def test_chance_levels_are_stated_for_every_task():
    for name in RULER_TASKS:
        assert ruler_run.chance(name)["note"], name
    assert ruler_run.chance("niah_single_1")["guess"] == pytest.approx(1 / 9e6)
    assert ruler_run.chance("niah_multikey_3")["guess"] == 2.0 ** -122
    tok = ByteTokenizer()
    samples = ruler_run.make_samples("niah_multikey_2", 3000, 3, 0, tok)
    copy = ruler_run._copy_chance("niah_multikey_2", samples)
    lines = [tok.decode(s.tokens).count("One of the special magic numbers for") for s in samples]
    assert copy == pytest.approx(np.mean([1 / n for n in lines]), rel=0.05) and copy < 0.05


def _model(vocab=256):
    torch.manual_seed(0)
    return build_model(load_config(RECIPES / "debug_cpu.toml", [f"model.vocab_size={vocab}"], check=False).model,
                       seed=2).eval()


def test_teacher_forced_exact_and_generation_agree_on_a_deterministic_answer():
    """A sample whose answer is the model's own greedy continuation (from the uncached full forward):
    teacher-forced exact must be 1 and the string match of the (cached) generation 1. On RULER's own
    samples (which this random model gets wrong) exact is 0 and the generation does not start with them."""
    tok, model = ByteTokenizer(), _model()
    samples = ruler_run.make_samples("niah_single_1", 700, 3, 0, tok)
    own = []
    for s in samples:
        prompt = torch.from_numpy(s.tokens[:s.answer_start])[None]
        gen = decode.generate_uncached(model, prompt, 6)[0].numpy()
        text = ruler_run.postprocess(tok.decode(gen))
        own.append(RulerSample(np.concatenate([s.tokens[:s.answer_start], gen]), s.answer_start, tok.decode(gen),
                               [text], s.kind, True, s.params))
    assert any(o.outputs[0] for o in own)  # some continuation has printable text to match
    for o, sc in zip(own, ruler_run.score_samples(model, own, tok, gen_tokens=6, batch_size=2)):
        assert sc["exact"] and sc["token_acc"] == 1.0
        assert sc["string_match"] == 1.0 or not o.outputs[0]
    for s, sc in zip(samples, ruler_run.score_samples(model, samples, tok, gen_tokens=8)):
        prompt = torch.from_numpy(s.tokens[:s.answer_start])[None]
        starts_with_answer = torch.equal(decode.generate_uncached(model, prompt, 8)[0, :8],
                                         torch.from_numpy(s.tokens[s.answer_start:]))
        assert sc["exact"] == starts_with_answer and (not sc["exact"] or sc["string_match"] == 1.0)


def test_cli_scores_ruler_with_a_summary_table(tiny_run, qa_files, tmp_path, capsys):
    out = tmp_path / "eval"
    assert eval_run.main([str(tiny_run), "--tasks", "ruler,passkey", "--lengths", "1200,2600", "--samples", "1",
                          "--gen-tokens", "4", "--depths", "0", "--squad", str(qa_files[0]), "--threads", "1",
                          "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["haystack"]["name"].startswith("stdlib-prose") and res["qa_data"] == {"squad": str(qa_files[0])}
    assert "--hotpotqa" in res["tasks"]["qa_2"]["skipped"]["1200"]
    assert set(res["tasks"]["qa_1"]["by_length"]) == {"1200", "2600"}
    assert res["tasks"]["niah_single_1"]["tokens_to_generate"] == 4
    assert "exact" in res["tasks"]["niah_single_1"]["by_length"]["1200"]  # a fixed answer: teacher-forced too
    assert "exact" not in res["tasks"]["niah_multivalue"]["by_length"]["2600"]  # four values in any order: not
    summary = res["summary"]
    assert list(summary["rows"]) == [*RULER_TASKS, "passkey"] and summary["lengths"] == [1200, 2600]
    assert summary["rows"]["qa_2"]["1200"] is None and summary["ruler_average"]["2600"]["tasks"] == 12
    assert "| **RULER average** |" in printed and (out / "summary.png").stat().st_size > 5000


@pytest.mark.parametrize("flags,pattern", [
    (["--haystack", "/no/such/file"], r"--haystack /no/such/file: no such file"),
    (["--tasks", "ruler,bogus"], r"unknown task 'bogus'; .* or ruler \(= 13 tasks\)"),
    (["--task-param", "niah_single_1.type_haystack=bogus"], r"type_haystack='bogus' must be essay, noise or needle"),
    (["--task-param", "cwe.alpha=2"], r"cwe has no parameter 'alpha'; its parameters: freq_cw"),
    (["--gen-tokens", "-1"], r"--gen-tokens -1 must be >= 0"),
])
def test_a_bad_ruler_flag_is_one_line(flags, pattern, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(eval_run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert eval_run.main([str(tmp_path / "no_run"), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and __import__("re").search(pattern, lines[0]), lines


def test_a_bad_qa_file_is_named_with_its_line(tmp_path, capsys):
    bad = tmp_path / "squad.jsonl"
    bad.write_text(json.dumps(SQUAD[0]) + "\n{not json\n")
    assert eval_run.main([str(tmp_path / "no_run"), "--squad", str(bad)]) == 2
    assert f"error: --squad: {bad} line 2 is not JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"question": "q", "context": "c"}) + "\n")
    with pytest.raises(ValueError, match="no answerable squad question"):
        load_qa(bad, "squad")


def test_context_parallel_ruler_eval_matches_one_process(tiny_run, tmp_path):
    """torchrun with 2 ranks: the prompt through the ring, the decode on the gathered cache: the same
    predictions and scores as one process."""
    args = ["--tasks", "niah_single_1,fwe", "--lengths", "701", "--samples", "2", "--gen-tokens", "12",
            "--threads", "1"]
    _, a, b = eval_alone_and_on_cp2(tiny_run, args, tmp_path)
    for name in ("niah_single_1", "fwe"):
        assert b[name]["examples"] == a[name]["examples"]
        for key, value in a[name]["by_length"]["701"].items():
            assert b[name]["by_length"]["701"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
