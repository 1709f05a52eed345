"""The long-context eval harness: checkpoint loading, seeded tasks, scoring, perplexity, outputs.

The default tests use a 2-step debug checkpoint (the pipeline works); the slow test trains the debug
model on the passkey task and checks that it beats chance clearly at short lengths."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import eval.tasks as tasks
from eval.model_io import load_eval_config, load_model, resolve_checkpoint
from eval.perplexity import sliding_window_perplexity
from eval.run import evaluate, parse_args
from moe_lc.config import load_config
from moe_lc.data import ByteTokenizer
from moe_lc.train import run
from tests.harness import RECIPES, ROOT, eval_alone_and_on_cp2

RECIPE = RECIPES / "debug_cpu.toml"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "run"
    cfg = load_config(RECIPE, ["train.steps=2", "train.seq_len=64", "train.global_batch=4", "train.micro_batch=4",
                               "train.warmup_steps=1", "checkpoint.interval=2", "train.log_interval=100",
                               f"train.output_dir={out}"])
    run(cfg)
    return out


def test_checkpoint_paths_resolve_to_the_committed_step(tiny_run, tmp_path):
    step = tiny_run / "checkpoints" / "step_00000002"
    for path in (tiny_run, tiny_run / "checkpoints", step):
        assert resolve_checkpoint(path) == (step, tiny_run / "config.toml")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="checkpoint.interval > 0"):
        resolve_checkpoint(tmp_path / "empty")


def test_loaded_weights_are_the_trained_ones(tiny_run):
    step, config = resolve_checkpoint(tiny_run)
    cfg = load_eval_config(config, None, [])
    model = load_model(step, cfg)
    tokens = torch.randint(0, 259, (2, 33))
    logits = model(tokens)
    assert logits.shape == (2, 33, cfg.model.vocab_size) and torch.isfinite(logits).all()
    fresh = load_model(step, cfg)  # loading twice gives identical weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    wrong = load_config(RECIPE, ["model.dim=64"], check=False)
    with pytest.raises(Exception, match="does not fit the recipe"):
        load_model(step, wrong)


def test_samples_are_seeded_and_cells_independent():
    tok = ByteTokenizer()
    a = tasks.make_samples("passkey", 160, 3, seed=7, tokenizer=tok, depth=0.5, depth_index=2)
    b = tasks.make_samples("passkey", 160, 3, seed=7, tokenizer=tok, depth=0.5, depth_index=2)
    c = tasks.make_samples("passkey", 160, 3, seed=8, tokenizer=tok, depth=0.5, depth_index=2)
    assert [s.answer for s in a] == [s.answer for s in b] != [s.answer for s in c]
    assert all(len(s.tokens) == 160 and tok.decode(s.tokens[s.answer_start:]) == s.answer for s in a)


def _oracle(samples, batch_size, shift=0):
    """A stand-in forward that puts all probability on the true next token (shift=1: on the token after it)."""
    full = iter(torch.from_numpy(np.stack([s.tokens for s in samples])).split(batch_size))

    def forward(model, inputs):
        t = next(full)
        assert torch.equal(t[:, :-1], inputs)  # the scorer feeds tokens[:-1]
        target = torch.roll(t[:, 1:], -shift, dims=1)
        return torch.nn.functional.one_hot(target, 512).float() * 30
    return forward


def test_scoring_reads_the_answer_positions(monkeypatch):
    samples = tasks.make_samples("multikey_needle", 300, 5, seed=0, tokenizer=ByteTokenizer(), n_keys=2)
    monkeypatch.setattr(tasks, "forward_logits", _oracle(samples, 2))
    perfect = tasks.score_samples(None, samples, batch_size=2)
    assert all(s.exact and s.token_acc == 1.0 and s.logprob > -1e-6 for s in perfect)
    monkeypatch.setattr(tasks, "forward_logits", _oracle(samples, 2, shift=1))
    off_by_one = tasks.summarize(tasks.score_samples(None, samples, batch_size=2))
    assert off_by_one["exact"] == 0.0 and off_by_one["logprob"] < -20


def test_chance_levels():
    assert tasks.chance("passkey") == {"exact": pytest.approx(1 / 90000), "token": pytest.approx(0.10222, abs=1e-5)}
    keys = [int(s.answer) for s in tasks.make_samples("passkey", 120, 300, seed=1, tokenizer=ByteTokenizer())]
    assert 10000 <= min(keys) and max(keys) <= 99999  # the space the chance level assumes
    assert tasks.chance("multikey_needle", {"n_keys": 4})["copy_exact"] == 0.25
    assert tasks.chance("variable_tracking")["token"] == pytest.approx((20 / 26 + 3) / 23)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens):
            return torch.zeros(*tokens.shape, 300)

    tokens = np.arange(1000) % 259
    r = sliding_window_perplexity(Uniform(), tokens, length=100, stride=30)
    assert r["ppl"] == pytest.approx(300) and r["windows"] == 31 and r["tokens"] == 99 + 30 * 30


def test_cli_writes_json_and_heatmaps(tiny_run, tmp_path):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "eval", str(tiny_run), "--lengths", "64,128,256", "--depths", "0,0.5,1",
           "--samples", "2", "--ppl-tokens", "1024", "--task-param", "multikey_needle.n_keys=2", "--threads", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["step"] == 2 and res["tasks"]["passkey"]["chance"]["exact"] == pytest.approx(1 / 90000)
    assert set(res["tasks"]["passkey"]["grid"]["128"]) == {"0", "0.5", "1"}
    assert res["tasks"]["passkey"]["by_length"]["256"]["n"] == 6  # 2 samples x 3 depths
    assert "too short" in res["tasks"]["passkey"]["skipped"]["64"]
    assert res["tasks"]["multikey_needle"]["by_length"]["256"]["n"] == 6
    assert res["tasks"]["perplexity"]["by_length"]["64"]["tokens"] == 1023
    assert len(res["tasks"]["perplexity"]["loss_by_position"]) == 255
    for png in ("passkey_heatmap.png", "multikey_needle_heatmap.png", "accuracy_by_length.png", "perplexity.png"):
        assert (out / png).stat().st_size > 5000, png
    bad = subprocess.run([sys.executable, "-m", "eval", str(tmp_path / "nope")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "no such run" in bad.stderr


@pytest.mark.slow
def test_passkey_trained_model_beats_chance(tmp_path):
    """The debug model trained on synthetic passkey samples of 128 tokens, 32 per step at a constant
    lr of 1.5e-3 for 2,000 steps (~11 minutes on one thread). Copying the key is learned abruptly, the
    loss falling from a ~0.27 plateau to ~0.1, but when depends on the machine's rounding: at lr 3e-3
    it came at steps 700-900 on the machine this test was written on (0.80 exact after 1,200 steps)
    and on a later one only partly by step 1,200 (0.12 exact; 0.56 after 2,000); at 1.5e-3 it came at
    step ~1,250 (0.80 exact at 1,500 and 2,000). With 256-token samples and the default cosine schedule
    it was not learned within 1,200 steps. Chance: exact match of the 5-digit key 1/90000 = 1.1e-5,
    per digit 0.102."""
    out = tmp_path / "passkey"
    cfg = load_config(RECIPE, ["data.source=synthetic", "data.synthetic_tasks=passkey", "train.seq_len=128",
                               "train.global_batch=32", "train.micro_batch=16", "train.lr_schedule=constant",
                               "train.lr=1.5e-3", "train.steps=2000", "checkpoint.interval=2000",
                               "train.log_interval=100", "train.threads=1", f"train.output_dir={out}"])
    run(cfg)
    res = evaluate(parse_args([str(out), "--tasks", "passkey", "--lengths", "128,256", "--samples", "10",
                               "--out", str(tmp_path / "eval")]))
    by_length = res["tasks"]["passkey"]["by_length"]
    print({k: (v["exact"], v["token_acc"]) for k, v in by_length.items()})
    chance = res["tasks"]["passkey"]["chance"]
    assert by_length["128"]["exact"] >= 0.3 > 1000 * chance["exact"]
    assert by_length["128"]["token_acc"] >= 0.5 > 4 * chance["token"]


def test_context_parallel_eval_under_torchrun_matches_one_process(tiny_run, tmp_path):
    """torchrun with 2 ranks runs the model with zig-zag ring attention (cp=2, odd lengths padded):
    every score and perplexity equals the single-process eval's."""
    args = ["--tasks", "passkey,perplexity", "--lengths", "128,200", "--depths", "0,1", "--samples", "2",
            "--ppl-tokens", "600", "--threads", "1"]
    cp, a, b = eval_alone_and_on_cp2(tiny_run, args, tmp_path)
    assert "context parallel over 2 ranks" in cp.stdout
    for length in ("128", "200"):
        for key in ("logprob", "token_acc", "exact"):
            assert b["passkey"]["by_length"][length][key] == pytest.approx(a["passkey"]["by_length"][length][key],
                                                                         rel=1e-5, abs=1e-6)
        assert b["perplexity"]["by_length"][length]["ppl"] == pytest.approx(a["perplexity"]["by_length"][length]["ppl"],
                                                                         rel=1e-5)
    assert b["perplexity"]["loss_by_position"] == pytest.approx(a["perplexity"]["loss_by_position"], rel=1e-4, abs=1e-5)
