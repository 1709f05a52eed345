"""The README's side-by-side RULER table of two eval runs (a base and its extension):

    python docs/results/ruler-cpu/table.py docs/results/ruler-cpu/base docs/results/ruler-cpu/extend_4k

Cells: percent as `python -m eval` scores them (results.json "summary"); "-" where a length cannot hold
the task or no data was given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())["summary"]


def cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(runs: list[Path]) -> str:
    summaries = [load(r) for r in runs]
    names = [r.name for r in runs]
    head = ["task"] + [f"{n} {length}" for n, s in zip(names, summaries) for length in s["lengths"]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for task in summaries[0]["rows"]:
        cells = [cell(s["rows"][task].get(str(length))) for s in summaries for length in s["lengths"]]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    avg = [f"**{a['score']:.1f}** ({a['tasks']})" if (a := s["ruler_average"].get(str(length))) else "-"
           for s in summaries for length in s["lengths"]]
    lines.append("| **RULER average** (tasks) | " + " | ".join(avg) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([Path(p) for p in sys.argv[1:]]))
