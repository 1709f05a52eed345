"""The README's counted figures, produced here and checked by CI, never edited by hand.

    python .ci/readme_figures.py            # check: exit 1, one line per figure the README has wrong
    python .ci/readme_figures.py --write    # rewrite them in README.md

A figure sits between markers in the README's text (HTML comments, which GitHub does not show):

    <!-- figure default-tests -->1,590 tests<!-- /figure -->

Each name below says how its text is made, from `pytest --collect-only -q` passes (seconds: nothing
runs). The default count is what the README's install (`.[dev]`) collects, whatever else is installed:
modules that need another extra (EXTRA_MODULES) are left out of it and counted on their own, where their
extra is installed (elsewhere that figure is left unchecked, with a note). Wall times beside them (how long
the suite takes) are measured on an idle machine and written by hand; this script does not touch them.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"<!-- figure ([a-z0-9-]+) -->(.*?)<!-- /figure -->")
COLLECTED = re.compile(r"^(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?", re.MULTILINE)
# test modules that skip themselves without an extra beyond [dev]: (the extra, the module it imports)
EXTRA_MODULES = {"tests/test_eval_lm_eval.py": ("eval", "lm_eval")}
FIGURES = ("default-tests", "slow-tests", "eval-tests")


def _collect(root: Path, args: list[str]) -> tuple[int, int]:
    """(tests selected, tests deselected) by `pytest --collect-only -q ARGS`."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=root, capture_output=True, text=True)
    found = COLLECTED.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"pytest --collect-only failed (exit {proc.returncode}): {proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    selected, _, deselected = found[-1]
    return int(selected), int(deselected or 0)


def collected_counts(root: Path = ROOT) -> dict[str, int]:
    """{"default": tests the default `python -m pytest -q` runs with `.[dev]`, "slow": those its
    `-m 'not slow'` leaves out, and per extra installed here (e.g. "eval"): the tests its modules add}."""
    ignored = [f"--ignore={module}" for module in EXTRA_MODULES]
    default, slow = _collect(root, ignored)
    counts = {"default": default, "slow": slow}
    for module, (extra, imported) in EXTRA_MODULES.items():
        if importlib.util.find_spec(imported) is not None:
            counts[extra] = counts.get(extra, 0) + sum(_collect(root, [module]))
    return counts


def figures(counts: dict[str, int]) -> dict[str, str]:
    """Each figure's text; a figure whose extra is not installed here is absent."""
    out = {"default-tests": f"{counts['default']:,} tests", "slow-tests": f"{counts['slow']:,}"}
    if "eval" in counts:
        out["eval-tests"] = f"{counts['eval']:,}"
    return out


def rewrite(readme: str, wanted: dict[str, str]) -> tuple[str, list[str]]:
    """(README with every marked figure set to `wanted`, one line per figure that differed); ValueError for
    a marker with an unknown name. A known figure missing from `wanted` (its extra not installed) is left."""
    stale = []

    def put(match: re.Match) -> str:
        name, text = match.group(1), match.group(2)
        if name not in FIGURES:
            raise ValueError(f"README.md: unknown figure {name!r} (known: {', '.join(FIGURES)})")
        if name not in wanted:
            return match.group(0)
        if text != wanted[name]:
            line = readme.count("\n", 0, match.start()) + 1
            stale.append(f"README.md:{line}: figure {name} reads {text!r}, the suite gives {wanted[name]!r}")
        return f"<!-- figure {name} -->{wanted[name]}<!-- /figure -->"

    return MARKED.sub(put, readme), stale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite README.md's figures instead of checking them")
    args = ap.parse_args(argv)
    path = ROOT / "README.md"
    readme = path.read_text()
    try:
        wanted = figures(collected_counts())
        updated, stale = rewrite(readme, wanted)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name in sorted(set(FIGURES) - set(wanted)):
        extra = name.removesuffix("-tests")
        print(f"note: figure {name} not checked: the [{extra}] extra is not installed here")
    if args.write:
        path.write_text(updated)
        print(f"README.md: {len(stale)} figure(s) rewritten" + "".join(f"\n  {s}" for s in stale))
        return 0
    if stale:
        print("\n".join(stale) + "\nrun: python .ci/readme_figures.py --write", file=sys.stderr)
        return 1
    print(f"README.md: every figure ({len(MARKED.findall(readme))}) matches the suite")
    return 0


if __name__ == "__main__":
    sys.exit(main())
