"""The console scripts pyproject.toml installs: each names a function that exists, the README names them
all, and the tools run as the installed package (moe_lc_tools, moe_lc_eval) from a folder outside the
checkout, where `python -m tools.<name>` cannot: moe-extend writes its runs and results where it is run
(issue 61), and every script of a real non-editable install answers --help (slow: the cheap ones run) from
a folder outside the checkout with the checkout not importable."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time
import tomllib

import pytest

from tests.harness import RECIPES, ROOT

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
CHECKOUT_NAMES = {"moe_lc_tools": "tools", "moe_lc_eval": "eval"}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_console_script_names_a_function(script):
    module, _, func = SCRIPTS[script].partition(":")
    top, _, rest = module.partition(".")
    checkout_module = ".".join(filter(None, [CHECKOUT_NAMES.get(top, top), rest]))
    assert callable(getattr(importlib.import_module(checkout_module), func)), SCRIPTS[script]


def test_the_readme_names_every_console_script_and_the_tools_the_issue_missed():
    named = set(re.findall(r"`(moe-[a-z-]+)`", (ROOT / "README.md").read_text()))
    assert set(SCRIPTS) <= named, sorted(set(SCRIPTS) - named)
    assert {"moe-timeline", "moe-overlap-bench", "moe-bench"} <= set(SCRIPTS)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A site folder laid out as `pip install .` lays the packages out (moe_lc, moe_lc_tools, moe_lc_eval;
    no recipes), and an empty working folder elsewhere."""
    site = tmp_path_factory.mktemp("site")
    ignore = shutil.ignore_patterns("__pycache__", "results")
    shutil.copytree(ROOT / "moe_lc", site / "moe_lc", ignore=ignore)
    for installed_name, checkout_name in CHECKOUT_NAMES.items():
        shutil.copytree(ROOT / checkout_name, site / installed_name, ignore=ignore)
    return site, tmp_path_factory.mktemp("elsewhere")


def run_installed(installed, script: str, *args: str) -> subprocess.CompletedProcess:
    """What the console script `script` runs, in a fresh interpreter whose only moe_lc is the site folder
    (-P: neither the checkout nor the working folder is on sys.path)."""
    site, cwd = installed
    module, _, func = SCRIPTS[script].partition(":")
    code = (f"import sys; import {module} as m; assert m.__file__.startswith({str(site)!r}), m.__file__; "
            f"sys.exit(m.{func}({list(args)!r}))")
    return subprocess.run([sys.executable, "-P", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(cwd)})


@pytest.mark.parametrize("script", ["moe-timeline", "moe-overlap-bench", "moe-bench"])
def test_the_new_scripts_answer_help_outside_the_checkout(installed, script):
    proc = run_installed(installed, script, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_outside_the_checkout_a_missing_default_recipe_is_one_line(installed):
    proc = run_installed(installed, "moe-overlap-bench")
    assert proc.returncode == 2 and proc.stderr == (
        "error: --recipe: the default, recipes/overlap_cpu.toml, ships with the moe_lc checkout, not the installed "
        "package; give --recipe PATH\n")
    proc = run_installed(installed, "moe-bench", "--dry-run", "--parts", "gemm")
    assert proc.returncode == 2 and proc.stderr == (
        "error: --parts gemm reads recipes/moe16b_128k.toml, which is not there (a default: the recipes ship with "
        "the moe_lc checkout, not the package); give --recipe PATH\n")


def test_the_installed_timeline_draws_a_run_outside_the_checkout(installed, tmp_path):
    from moe_lc.train import main as train

    run = tmp_path / "run"
    assert train([str(ROOT / "recipes" / "debug_cpu.toml"), "--set", "train.steps=2", "--set", "train.trace_step=2",
                  "--set", "train.seq_len=64", "--set", "train.global_batch=4", "--set", "train.micro_batch=4",
                  "--set", "train.warmup_steps=0", "--set", "train.threads=1", "--set",
                  f"train.output_dir={run}"]) == 0
    proc = run_installed(installed, "moe-timeline", str(run), "--png", "timeline.png")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (installed[1] / "timeline.png").read_bytes()[:4] == b"\x89PNG"


# -- moe-extend outside the checkout (issue 61) --------------------------------------------------------
EXTEND = "import sys; from moe_lc_tools.extend import main; sys.exit(main())"  # what the moe-extend script runs


def tiny_stage(folder, name: str = "base.toml"):
    """The base stage of the CPU chain at its smallest: 1 step of 128 tokens, a checkpoint after it."""
    (folder / name).write_text(f'extends = "{RECIPES / "longctx" / "base.toml"}"\n[train]\nsteps = 1\nseq_len = 128\n'
                               'global_batch = 2\nmicro_batch = 2\nwarmup_steps = 0\nthreads = 1\nlog_interval = 1\n'
                               '[checkpoint]\ninterval = 1\n[data]\nsynthetic_tasks = ["passkey"]\n')
    return folder / name


def test_moe_extend_outside_the_checkout_writes_its_runs_and_results_there(tmp_path):
    """Run from another folder, moe-extend trained and scored in the checkout (relative paths resolved
    there) and then failed reading results.json where it was run (exit 2). Now its stage recipe, --runs and
    --out (defaults) are the working folder's, the trainer and the eval run there, and it exits 0; the
    summary's commands read as typed in that folder. ~20 s."""
    work = tmp_path / "work"
    work.mkdir()
    tiny_stage(work)
    before = sorted((ROOT / "runs" / "longctx").rglob("*")) if (ROOT / "runs" / "longctx").exists() else None
    proc = subprocess.run([sys.executable, "-P", "-c", EXTEND, "base.toml", "--lengths", "128", "--samples", "1",
                           "--tasks", "passkey"], cwd=work, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = work / "runs" / "longctx"
    assert (runs / "base" / "metrics.jsonl").is_file() and (runs / "base" / "train.log").stat().st_size > 0
    assert json.loads((runs / "eval" / "base" / "results.json").read_text())["step"] == 1
    summary = json.loads((runs / "eval" / "summary.json").read_text())
    assert summary["commands"][0] == ("python -m moe_lc.train base.toml --set train.output_dir=runs/longctx/base "
                                      "--set checkpoint.resume=true")
    assert (runs / "eval" / "summary.md").is_file() and (runs / "eval" / "longctx.png").is_file()
    after = sorted((ROOT / "runs" / "longctx").rglob("*")) if (ROOT / "runs" / "longctx").exists() else None
    assert before == after  # nothing written into the checkout


def test_moe_extend_stopped_before_training_starts_leaves_nothing_behind(tmp_path):
    """Killed (SIGTERM) while its first step starts, moe-extend left an empty train.log in the user's
    folder and the trainer running on. Now it stops the step, removes the log that received nothing
    with the folders made for it, says how to continue, and exits 143."""
    tiny_stage(tmp_path)
    log = tmp_path / "runs" / "base" / "train.log"
    proc = subprocess.Popen([sys.executable, "-P", "-c", EXTEND, "base.toml", "--runs", "runs", "--out", "out"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not log.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert log.exists(), "the first step never started"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-2000:] + err[-2000:]
    assert err.splitlines()[-1].startswith("stopped by SIGTERM; the same command continues the chain")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.toml"]


# -- a real non-editable install ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    """`pip install --target SITE` of a copy of the package's sources (the build's scratch stays out of
    the checkout): what a user's non-editable install holds, console scripts in SITE/bin. ~10 s."""
    src, target = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("site")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copy(ROOT / "pyproject.toml", src)
    for folder in ("moe_lc", "tools", "eval"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-compile", "-q",
                    "--target", str(target), str(src)], check=True, capture_output=True, timeout=600)
    return target


def run_wheel(target, cwd, script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The console script SITE/bin/`script` run in `cwd` by an interpreter without site processing (-S:
    no .pth file, so not the editable install's finder either): the only moe_lc is SITE's, torch and the
    other dependencies come from site-packages as plain folders on PYTHONPATH."""
    return subprocess.run([sys.executable, "-S", str(target / "bin" / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=_wheel_env(target, cwd))


def _wheel_env(target, cwd) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(target), *site.getsitepackages()])}


HELP_ALL = """
import contextlib, importlib, importlib.metadata as md, importlib.util, io, json, sys
site = sys.argv[1]
dist = md.Distribution.at(next(__import__("pathlib").Path(site).glob("moe_lc-*.dist-info")))
out = {"tools": importlib.util.find_spec("tools") is not None, "eval": importlib.util.find_spec("eval") is not None}
for ep in dist.entry_points.select(group="console_scripts"):
    module = importlib.import_module(ep.module)
    text = io.StringIO()
    sys.argv = [ep.name, "--help"]
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            code = ep.load()()
        except SystemExit as exc:
            code = exc.code
    out[ep.name] = [code, module.__file__, text.getvalue()[:300]]
print(json.dumps(out))
"""


def test_every_script_of_a_non_editable_install_answers_help_outside_the_checkout(wheel_site, tmp_path):
    """Every console script of the installed package parses its arguments from a folder outside the
    checkout, with neither `tools` nor `eval` importable: ~10 s with the install (one interpreter for all)."""
    assert sorted(p.name for p in (wheel_site / "bin").iterdir()) == sorted(SCRIPTS)
    proc = subprocess.run([sys.executable, "-S", "-P", "-c", HELP_ALL, str(wheel_site)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=_wheel_env(wheel_site, tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found.pop("tools") is False and found.pop("eval") is False  # the checkout's names: not importable
    assert sorted(found) == sorted(SCRIPTS)
    for script, (code, where, text) in found.items():
        assert code in (0, None) and "usage:" in text.lower(), (script, code, text)
        assert where.startswith(str(wheel_site)), (script, where)


@pytest.mark.slow  # ~30 s: a process per script, moe-extend's tiny stage (train + eval) the longest
def test_the_scripts_of_a_non_editable_install_run_outside_the_checkout(wheel_site, tmp_path):
    """Run from a folder outside the checkout with the checkout not importable, each tool reads and
    writes where it is run; one that reads a checkout file by default says so in one line."""
    plan = run_wheel(wheel_site, tmp_path, "moe-plan", str(RECIPES / "debug_cpu.toml"), "--world", "2")
    assert plan.returncode == 0 and "Placement" in plan.stdout, plan.stderr[-2000:]
    drawn = run_wheel(wheel_site, tmp_path, "moe-schedule", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4",
                      "--png", "schedule.png")
    assert drawn.returncode == 0 and (tmp_path / "schedule.png").read_bytes()[:4] == b"\x89PNG", drawn.stderr[-2000:]
    (tmp_path / "corpus").mkdir()
    for i in range(20):  # documents for both splits
        (tmp_path / "corpus" / f"{i}.txt").write_text(f"def f{i}():\n    return {i}\n" * 50)
    tokens = run_wheel(wheel_site, tmp_path, "moe-prepare-data", "corpus", "--out", "tokens/c", "--workers", "1")
    assert tokens.returncode == 0 and (tmp_path / "tokens" / "c.train.shards.json").is_file(), tokens.stderr[-2000:]
    check = run_wheel(wheel_site, tmp_path, "moe-gpu-check", "--dry-run", "--steps", "env,tests")
    (summary,) = (tmp_path / "runs").glob("gpu_check-*/summary.md")  # the default --out, in the working folder
    assert check.returncode == 0
    assert "- tests: skipped: the gpu tests ship with the moe_lc checkout" in summary.read_text()
    missing = run_wheel(wheel_site, tmp_path, "moe-extend")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and missing.stderr.startswith(
        "error: the default stages, recipes/longctx/{base,extend_2k,extend_4k}.toml, ship with the moe_lc checkout, "
        "not the installed package (")
    assert missing.stderr.endswith("; give the stage recipes: moe-extend STAGE.toml ...\n")
    work = tmp_path / "work"
    work.mkdir()
    tiny_stage(work)
    chain = run_wheel(wheel_site, work, "moe-extend", "base.toml", "--lengths", "128", "--samples", "1", "--tasks",
                      "passkey", timeout=600)
    assert chain.returncode == 0, chain.stdout[-3000:] + chain.stderr[-3000:]
    assert (work / "runs" / "longctx" / "eval" / "base" / "results.json").is_file()
    assert (work / "runs" / "longctx" / "eval" / "summary.md").is_file()
