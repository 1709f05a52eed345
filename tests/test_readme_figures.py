"""The README's counted figures come from .ci/readme_figures.py (CI checks them before the tests): its
parsing of pytest's collection line and its rewriting of the marked figures."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

from readme_figures import COLLECTED, EXTRA_MODULES, FIGURES, MARKED, figures, rewrite  # noqa: E402


@pytest.mark.parametrize("line, counts", [("1590/1639 tests collected (49 deselected) in 10.14s", ("1590", "1639", "49")),
                                          ("3 tests collected in 0.10s", ("3", "", "")),
                                          ("1 test collected in 0.01s", ("1", "", ""))])
def test_pytests_collection_line_is_read(line, counts):
    assert COLLECTED.findall(f"tests/test_a.py::test_b\n\n{line}\n") == [counts]


def test_stale_figures_are_named_with_their_line_and_rewritten():
    wanted = figures({"default": 1590, "slow": 49})
    readme = ("# x\n\nruns <!-- figure default-tests -->1,510 tests<!-- /figure --> and\n"
              "<!-- figure slow-tests -->49<!-- /figure --> more\n")
    updated, stale = rewrite(readme, wanted)
    assert stale == ["README.md:3: figure default-tests reads '1,510 tests', the suite gives '1,590 tests'"]
    assert "<!-- figure default-tests -->1,590 tests<!-- /figure -->" in updated
    assert rewrite(updated, wanted) == (updated, [])
    with pytest.raises(ValueError, match="unknown figure 'nope'"):
        rewrite("<!-- figure nope -->3<!-- /figure -->", wanted)


def test_the_readme_marks_its_test_counts():
    names = [name for name, _ in MARKED.findall((ROOT / "README.md").read_text())]
    assert sorted(names) == sorted(FIGURES) == sorted(figures({"default": 0, "slow": 0, "eval": 0}))


def test_a_figure_whose_extra_is_missing_is_left_unchecked():
    """Without lm-eval the [eval] count cannot be collected: the figure stays as written, the others are
    checked; the default count never includes an extra's modules, so it reads the same either way."""
    readme = "<!-- figure default-tests -->5 tests<!-- /figure --> <!-- figure eval-tests -->4<!-- /figure -->"
    updated, stale = rewrite(readme, figures({"default": 6, "slow": 0}))
    assert "<!-- figure eval-tests -->4<!-- /figure -->" in updated and len(stale) == 1
    assert all((ROOT / module).is_file() for module in EXTRA_MODULES)


def test_ci_installs_what_the_readme_installs():
    """CI runs in a fresh virtual environment and installs with the quick start's own command, so a
    package the resolver picks today reaches CI as it reaches a new user (pytest 9.2 broke a test that
    an older pytest already on the machine hid)."""
    from readme_check import blocks

    quick_start = blocks((ROOT / "README.md").read_text())[0].commands[0]
    install = quick_start.split(" && python -m moe_lc.train")[0]
    assert install.startswith("python -m pip install torch==") and "-e '.[dev]'" in install, quick_start
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci, install
    assert ci.index("python -m venv \"$venv\"") < ci.index(install)
