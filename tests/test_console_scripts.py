"""The console scripts pyproject.toml installs: each names a function that exists, the README names them
all, and the tools run as the installed package (moe_lc_tools, moe_lc_eval) from a folder outside the
checkout, where `python -m tools.<name>` cannot."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.harness import ROOT

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
