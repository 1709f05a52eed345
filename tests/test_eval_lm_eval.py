"""The lm-evaluation-harness bridge (eval/lm_eval.py): lm_eval's CLI runs a moe_lc checkpoint offline on
local task YAMLs (generate_until, multiple choice, rolling log-likelihood), and each request type gives
what the model itself says. Needs the [eval] extra (lm-eval); skipped without it."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

from lm_eval.api.instance import Instance  # noqa: E402

from eval.lm_eval import MoeLcLM  # noqa: E402
from moe_lc.model import decode  # noqa: E402
from tests.harness import ROOT  # noqa: E402

ROWS = [{"prompt": "The pass key is 12345. What is the pass key? ", "answer": "12345", "choices": ["12345", "67890"],
         "label": 0, "text": "The grass is green. The sky is blue. Here we go."}] * 2
TASKS = {
    "moe_lc_gen": "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
                  "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
                  "metric_list:\n  - metric: exact_match\n",
    "moe_lc_mc": "output_type: multiple_choice\ndoc_to_text: \"{{prompt}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                 "doc_to_target: label\nmetric_list:\n  - metric: acc\n",
    "moe_lc_roll": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                   "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    source = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\ntest_split: test\n"
    for name, body in TASKS.items():
        (folder / f"{name}.yaml").write_text(f"task: {name}\n{source}{body}")
    return folder


def test_lm_eval_cli_runs_a_checkpoint_offline(tiny_run, task_dir, tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "eval.lm_eval", "run", "--model", "moe_lc", "--model_args",
           f"path={tiny_run},threads=1", "--include_path", str(task_dir), "--tasks", ",".join(TASKS),
           "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert set(results) == set(TASKS)
    assert results["moe_lc_gen"]["exact_match,none"] in (0.0, 0.5, 1.0)
    assert results["moe_lc_mc"]["acc,none"] in (0.0, 0.5, 1.0)
    assert 0 < results["moe_lc_roll"]["bits_per_byte,none"] < 20  # a 259-token byte model: log2(512) = 9 at most
    assert "|moe_lc_roll|" in proc.stdout


@pytest.fixture(scope="module")
def lm(tiny_run):
    return MoeLcLM(path=str(tiny_run), threads=1)


def _requests(kind, *args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_is_the_models_and_moves_trailing_spaces(lm):
    context, continuation = "The pass key is", " 12345"
    (logprob, greedy), = lm.loglikelihood(_requests("loglikelihood", (context, continuation)))
    tokens = torch.tensor([[*lm.tok.encode(context), *lm.tok.encode(continuation)]])
    logp = torch.log_softmax(lm.model(tokens[:, :-1]).float()[0, -6:], -1)
    target = tokens[0, -6:]
    assert logprob == pytest.approx(logp.gather(-1, target[:, None]).sum().item(), rel=1e-5)
    assert greedy == bool((logp.argmax(-1) == target).all())
    moved, = lm.loglikelihood(_requests("loglikelihood", (context + " ", "12345")))  # the space moves over
    assert moved[0] == pytest.approx(logprob, rel=1e-5)


def test_rolling_loglikelihood_predicts_every_token_once(lm, monkeypatch):
    text = "The grass is green. The sky is blue."
    whole, = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", (text,)))
    assert whole == pytest.approx(lm.loglikelihood(_requests("loglikelihood", ("", text)))[0][0], rel=1e-5)
    scored, score = [], lm._continuation_logprob
    monkeypatch.setattr(lm, "_continuation_logprob", lambda c, p: scored.append((len(c), len(p))) or score(c, p))
    monkeypatch.setattr(lm, "max_length", 8)
    windows, = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", (text,)))
    assert sum(p for _, p in scored) == len(text) and all(c + p <= 9 for c, p in scored) and len(scored) == 5
    assert windows < 0 and windows != pytest.approx(whole)  # less context, another likelihood


def test_generate_until_is_greedy_with_the_cache_and_stops_at_until(lm):
    context = "The pass key is 12345. What is the pass key? "
    free = decode.generate_uncached(lm.model, torch.from_numpy(lm.tok.encode(context))[None], 12)[0].tolist()
    text = lm.tok.decode(free)
    got, = lm.generate_until(_requests("generate_until", (context, {"until": [], "max_gen_toks": 12})))
    assert got == text
    stop = text[3:5] if len(text) >= 5 else None
    if stop:
        cut, = lm.generate_until(_requests("generate_until", (context, {"until": [stop], "max_gen_toks": 12})))
        assert cut == text[:text.index(stop)]
    with pytest.raises(ValueError, match="greedily only"):
        lm.generate_until(_requests("generate_until", (context, {"do_sample": True, "temperature": 0.7})))
