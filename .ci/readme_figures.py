"""The README's counted figures, produced here and checked by CI, never edited by hand.

    python .ci/readme_figures.py            # check: exit 1, one line per figure the README has wrong
    python .ci/readme_figures.py --write    # rewrite them in README.md

A figure sits between markers in the README's text (HTML comments, which GitHub does not show):

    <!-- figure default-tests -->1,590 tests<!-- /figure -->

Each name below says how its text is made, from one `pytest --collect-only -q` pass (seconds: nothing
runs). Wall times beside them (how long the suite takes) are measured on an idle machine and written by
hand; this script does not touch them.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"<!-- figure ([a-z0-9-]+) -->(.*?)<!-- /figure -->")
COLLECTED = re.compile(r"^(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?", re.MULTILINE)


def collected_counts(root: Path = ROOT) -> dict[str, int]:
    """{"default": tests the default `python -m pytest -q` runs, "slow": those its `-m 'not slow'` leaves out}."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=root, capture_output=True, text=True)
    found = COLLECTED.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"pytest --collect-only failed (exit {proc.returncode}): {proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    selected, _, deselected = found[-1]
    return {"default": int(selected), "slow": int(deselected or 0)}


def figures(counts: dict[str, int]) -> dict[str, str]:
    """Each figure's text."""
    return {"default-tests": f"{counts['default']:,} tests", "slow-tests": f"{counts['slow']:,}"}


def rewrite(readme: str, wanted: dict[str, str]) -> tuple[str, list[str]]:
    """(README with every marked figure set to `wanted`, one line per figure that differed); ValueError for
    a marker with an unknown name."""
    stale = []

    def put(match: re.Match) -> str:
        name, text = match.group(1), match.group(2)
        if name not in wanted:
            raise ValueError(f"README.md: unknown figure {name!r} (known: {', '.join(wanted)})")
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
        updated, stale = rewrite(readme, figures(collected_counts()))
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
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
