"""Mistakes given to the lm-evaluation-harness bridge (python -m eval.lm_eval, moe-lm-eval): one `error: `
line naming the argument and exit status 2, before lm_eval loads a task or the model a weight; without
the [eval] extra, one line saying how to install it."""

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT


def one_error(capsys, code: int, expected: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err == [expected], err


@pytest.mark.parametrize("argv", [["--help"], ["run", "--model", "moe_lc", "--model_args", "path=x", "--tasks", "t"]])
def test_without_the_extra_one_line_names_it(argv):
    """lm_eval hidden from the import system, as on an install without [eval]: the module still imports
    (lm_eval is imported inside main) and says what to install; --help answers (exit 0) with what it is."""
    code = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv[1:] = " + repr(argv) +
            "; runpy.run_module('eval.lm_eval', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    hint = "pip install -e '.[eval]' (the [eval] extra: lm-eval 0.4.13)"
    if argv == ["--help"]:
        assert proc.returncode == 0 and proc.stdout.startswith("usage: moe-lm-eval") and hint in proc.stdout, proc
        return
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: python -m eval.lm_eval (moe-lm-eval) needs lm-eval, which is not installed: {hint}\n"


@pytest.fixture
def bridge(monkeypatch):
    """eval.lm_eval.main in-process (it sets sys.argv for lm_eval's parser: put back afterwards)."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
    from eval import lm_eval

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr("lm_eval.evaluator.simple_evaluate", lambda *a, **k: pytest.fail("lm_eval started"))
    return lm_eval.main


def run_args(model_args: str, *extra: str) -> list[str]:
    return ["run", "--model", "moe_lc", "--model_args", model_args, "--tasks", "moe_lc_passkey",
            "--include_path", str(ROOT / "docs" / "lm_eval"), *extra]


@pytest.mark.parametrize("model_args, expected", [
    ("pth=runs/x", "--model_args pth=runs/x: unknown argument 'pth' (did you mean 'path'?); moe_lc takes path, "
                   "recipe, set, max_length, max_gen_toks, device, threads, tokenizer"),
    ("recipe=r.toml", "--model_args: path= is required (a run directory, checkpoint root, step directory or from-hf "
                      "directory)"),
    ("path=runs/x,max_length=abc", "--model_args max_length=abc: must be a whole number >= 1"),
    ("path=runs/x,max_gen_toks=0", "--model_args max_gen_toks=0: must be a whole number >= 1"),
    ("path=runs/x,device=gpu", "--model_args device=gpu: must be auto, cpu, cuda or cuda:N"),
    ("path={tmp}/nope", "--model_args path={tmp}/nope: {tmp}/nope: no such run or checkpoint directory"),
])
def test_a_bad_model_argument_is_one_line(model_args, expected, bridge, tmp_path, capsys):
    fill = str(tmp_path)
    one_error(capsys, bridge(run_args(model_args.replace("{tmp}", fill))), "error: " + expected.replace("{tmp}", fill))


def test_a_recipe_override_that_does_not_load_and_sampling_are_one_line(bridge, tiny_run, capsys):
    one_error(capsys, bridge(run_args(f"path={tiny_run},set=model.dim=abc")),
              "error: --model_args set=...: model.dim='abc' must be an integer, got str")
    one_error(capsys, bridge(run_args(f"path={tiny_run}", "--gen_kwargs", "do_sample=True")),
              "error: --gen_kwargs do_sample=True: moe_lc decodes greedily only (leave do_sample out, or false)")
    one_error(capsys, bridge(run_args(f"path={tiny_run}", "--gen_kwargs", "temperature=0.7")),
              "error: --gen_kwargs temperature=0.7: moe_lc decodes greedily only (temperature 0)")


@pytest.mark.slow  # lm_eval's CLI in a subprocess, ~17 s (the --gen_kwargs refusals stay in the default run)
def test_a_task_that_samples_is_refused_in_one_line(tiny_run, tmp_path):
    """The task's own generation_kwargs ask for sampling: found at its first request, after lm_eval loaded
    the model, and said in one line (lm_eval's log lines come before it)."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "The pass key is 1. Key? ", "answer": "1"}) + "\n")
    (tmp_path / "sampling.yaml").write_text(
        f"task: sampling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  do_sample: true\nmetric_list:\n  - metric: exact_match\n")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "eval.lm_eval", "run", "--model", "moe_lc", "--model_args",
                           f"path={tiny_run},threads=1", "--include_path", str(tmp_path), "--tasks", "sampling"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: task sampling: generation_kwargs do_sample=True: moe_lc "
                                                     "decodes greedily only (leave do_sample out, or false)")
