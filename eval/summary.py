"""One summary table per eval run: task x length, and RULER's average per length, as RULER's tables read.

Cells are percentages: RULER tasks by their string match over the greedy generation (RULER reports
0-100), the older tasks (passkey, multikey_needle, variable_tracking) by teacher-forced exact match.
The average row is RULER's: the mean over the RULER tasks scored at that length (how many is said;
RULER's own average is over all 13, so a run without QA data averages 11). Perplexity has its own figure.
"""

from __future__ import annotations

from .ruler import RULER_TASKS
from .ruler_run import average_by_length


def summary_table(tasks: dict[str, dict], lengths: list[int]) -> dict:
    """{"lengths", "rows": {task: {L: percent or None}}, "metric": {task: metric}, "ruler_average":
    {L: {"score": percent, "tasks": n}}} from results["tasks"]."""
    rows, metric = {}, {}
    for name, r in tasks.items():
        if name == "perplexity":
            continue
        key = "string_match" if name in RULER_TASKS else "exact"
        metric[name] = r.get("metric", key) if name in RULER_TASKS else "teacher-forced exact match"
        rows[name] = {str(x): 100 * r["by_length"][str(x)][key] if str(x) in r["by_length"] else None
                      for x in lengths}
    average = {k: {"score": 100 * v["score"], "tasks": v["tasks"]} for k, v in average_by_length(tasks, lengths).items()}
    return {"lengths": [int(x) for x in lengths], "rows": rows, "metric": metric, "ruler_average": average}


def markdown(summary: dict) -> str:
    """The table as Markdown: one row per task, then RULER's average (with how many tasks it covers)."""
    lengths = summary["lengths"]
    lines = ["| task | " + " | ".join(str(x) for x in lengths) + " |", "| --- |" + " --- |" * len(lengths)]
    for name, cells in summary["rows"].items():
        lines.append(f"| {name} | " + " | ".join("-" if cells[str(x)] is None else f"{cells[str(x)]:.1f}"
                                                  for x in lengths) + " |")
    if summary["ruler_average"]:
        avg = summary["ruler_average"]
        lines.append("| **RULER average** | " + " | ".join(
            f"**{avg[str(x)]['score']:.1f}** ({avg[str(x)]['tasks']} tasks)" if str(x) in avg else "-"
            for x in lengths) + " |")
    return "\n".join(lines)
