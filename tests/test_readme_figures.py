"""The README's counted figures come from .ci/readme_figures.py (CI checks them before the tests): its
parsing of pytest's collection line and its rewriting of the marked figures."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

from readme_figures import COLLECTED, MARKED, figures, rewrite  # noqa: E402


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
    assert sorted(names) == sorted(figures({"default": 0, "slow": 0}))
