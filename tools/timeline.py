"""Draw and measure one traced training step (`train.trace_step = N`), beside the pipeline simulator.

    python tools/timeline.py RUN_DIR [--png timeline.png] [--json] [--window START:END]

Reads RUN_DIR/timeline/rank<R>.json (moe_lc/job/timeline.py) and prints, per mesh group and op,
the communication time of the step and the part hidden behind compute (1 - exposed / time), the
measured mean cost of each pipeline action kind (F, B, W, F&B) and the simulator's step time for
those costs next to the measured one. With --png it draws, per rank, one lane of compute phases
(forward solid, backward hatched, coloured by phase: attention, dispatch, experts, combine, ...)
and one lane per communication group (issue to done; the part a wait was blocked on is dark), and
under them the simulator's timeline for the measured costs. A missing run folder, a run without a
traced step, a record cut short (named), a --window that is not START:END or starts after the step ends,
and a --png that cannot be written are each one `error: ` line with exit status 2, before any drawing.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/timeline.py` from a checkout: run as tools.timeline
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.timeline", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from moe_lc.job.out_path import out_file
from moe_lc.parallel.pipeline import FB, CommGroup, Costs, build_schedule, simulate

PHASE_COLOURS = {"attention": "#6baed6", "dispatch": "#fd8d3c", "experts": "#e6550d", "combine": "#fdae6b",
                 "ffn": "#9e9ac8", "embed": "#bdbdbd", "head": "#74c476", "W": "#31a354"}
GROUP_ORDER = ("ep", "pp", "cp", "tp", "dp_cp", "edp", "dp_cp_tp", "dp", "world")


RECORD_KEYS = ("rank", "step", "schedule", "overlap", "link", "step_interval", "comm")  # job/timeline.py writes them


def load(run: Path) -> list[dict]:
    """Every rank's timeline record, by rank. FileNotFoundError / ValueError (one line, naming the folder
    or file) for a missing run folder, a run traced no step of, or a record cut short."""
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run folder (give a run's train.output_dir)")
    files = sorted((run / "timeline").glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
    if not files:
        raise FileNotFoundError(f"{run}/timeline/ holds no rank*.json: train with --set train.trace_step=N")
    records = []
    for f in files:
        try:
            record = json.loads(f.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}: not a complete timeline record ({exc.msg} at line {exc.lineno} column "
                             f"{exc.colno}): the run may have stopped while writing it; trace the step again") from None
        missing = [k for k in RECORD_KEYS if k not in record] if isinstance(record, dict) else list(RECORD_KEYS)
        if missing:
            raise ValueError(f"{f}: not a timeline record (no {', '.join(missing)}); train.trace_step writes them")
        records.append(record)
    return records


def parse_window(text: str, step_end_s: float) -> tuple[float, float]:
    """--window START:END (seconds from the start of the traced step) -> (START, END); ValueError when it
    is not two numbers with START < END, or starts after the step (and its simulated rows) ended."""
    wrong = f"--window {text!r} must be START:END seconds with START < END (e.g. 0:{step_end_s:.3g})"
    try:
        start, end = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(wrong) from None
    if not start < end or not all(map(math.isfinite, (start, end))):
        raise ValueError(wrong)
    if start >= step_end_s:
        raise ValueError(f"--window {text!r} starts after the traced step ends at {step_end_s:.3f} s: nothing to "
                         f"draw; give a window within 0:{step_end_s:.3f}")
    return start, end


def comm_summary(ranks: list[dict]) -> dict[str, dict[str, float]]:
    """{"group/op": {time_s, exposed_s, hidden}} summed over ranks (per-rank averages)."""
    time_s, exposed_s = defaultdict(float), defaultdict(float)
    for r in ranks:
        for group, op, issued, done, wait_start, wait_end in r["comm"]:
            took = max(done - issued, 0.0)
            time_s[f"{group}/{op}"] += took / len(ranks)
            exposed_s[f"{group}/{op}"] += min(max(wait_end - wait_start, 0.0), took) / len(ranks)
    return {k: {"time_s": t, "exposed_s": exposed_s[k], "hidden": 1 - exposed_s[k] / t if t else 0.0}
            for k, t in sorted(time_s.items())}


def measured_costs(ranks: list[dict]) -> tuple[Costs, dict[str, float]]:
    """Mean duration of each pipeline action kind over every rank, from its first phase to its end: a
    received input's wait before the first phase is the pipeline transfer's (the simulator's `comm`),
    the expert all-to-alls exposed between its phases are the action's own."""
    spans = defaultdict(list)
    for r in ranks:
        phase_starts = sorted(start for _, _, _, start, _ in r.get("phases", []))
        for kind, entry, start, end in r.get("actions", []):
            if kind == "CommGroup":
                continue
            if kind == "B":
                kind = "B_split" if entry[3] == "True" else "B"
            elif kind == "FB" and entry[5] == "True":
                kind = "FB_split"
            first = next((t for t in phase_starts if start <= t <= end), start)
            spans[kind].append(end - first)
    mean = {k: statistics.mean(v) for k, v in spans.items() if v}
    comm = [done - issued for r in ranks for g, op, issued, done, *_ in r["comm"] if g == "pp" and op == "recv"]
    w = mean.get("W", 0.0)
    b = mean.get("B", mean.get("B_split", 0.0) + w)
    f = mean.get("F", 0.0)
    fb = mean.get("FB", mean.get("FB_split", f + b - w) + w) if ("FB" in mean or "FB_split" in mean) else None
    costs = Costs(F=max(f, 1e-9), B=max(b, w + 1e-9), W=w, FB=max(fb, w + 1e-9) if fb is not None else None,
                  comm=statistics.mean(comm) if comm else 0.0)
    return costs, mean


def predicted(ranks: list[dict], costs: Costs):
    r0 = ranks[0]
    schedule = build_schedule(r0["schedule"], r0["pp"], r0["microbatches"])
    # the runtime waits for a received tensor where it is used, not where its group is posted: dataflow
    return simulate(schedule, costs, comm_model="dataflow")


def summary(run: Path) -> dict:
    ranks = load(run)
    out = {"run": str(run), "ranks": len(ranks), "step": ranks[0]["step"], "link": ranks[0]["link"],
           "overlap": ranks[0]["overlap"], "schedule": ranks[0]["schedule"],
           "step_s": max(r["step_interval"][1] for r in ranks), "comm": comm_summary(ranks)}
    if ranks[0]["schedule"] is not None:
        costs, means = measured_costs(ranks)
        sim = predicted(ranks, costs)
        measured = max(r["pipeline"][1] - r["pipeline"][0] for r in ranks)
        out.update(action_means_s=means, costs=costs.__dict__, pipeline_s=measured, simulated_s=sim.makespan,
                   simulated_error=sim.makespan / measured - 1)
    return out


def print_summary(s: dict) -> None:
    print(f"{s['run']}: step {s['step']}, {s['ranks']} ranks, schedule {s['schedule']}, overlap {s['overlap']}, "
          f"link {s['link'] or 'none'}: step {s['step_s']:.3f} s")
    print(f"  {'group/op':<26}{'time s':>10}{'exposed s':>11}{'hidden':>9}")
    for key, c in s["comm"].items():
        print(f"  {key:<26}{c['time_s']:>10.4f}{c['exposed_s']:>11.4f}{c['hidden']:>9.0%}")
    if "pipeline_s" in s:
        means = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(s["action_means_s"].items()))
        print(f"  pipeline actions (mean): {means}")
        print(f"  pipeline: measured {s['pipeline_s']:.3f} s, simulator for these costs {s['simulated_s']:.3f} s "
              f"({s['simulated_error']:+.1%})")


def draw(run: Path, png: Path, window: tuple[float, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = load(run)
    groups = [g for g in GROUP_ORDER if any(c[0] == g for r in ranks for c in r["comm"])]
    lanes = 1 + len(groups)
    sim = None
    if ranks[0]["schedule"] is not None:
        sim = predicted(ranks, measured_costs(ranks)[0])
    n_rows = len(ranks) * lanes + (sim.pp if sim else 0)
    fig, ax = plt.subplots(figsize=(16, 0.32 * n_rows + 1.6))
    y, ticks = 0, []
    for r in ranks:
        for kind, label, name, start, end in r.get("phases", []):
            colour = PHASE_COLOURS.get(str(name).split(":")[-1], "#969696")
            ax.barh(y, end - start, left=start, height=0.8, color=colour, hatch="///" if kind == "B" else None,
                    edgecolor="white" if kind != "B" else "#555555", linewidth=0.2)
        ticks.append((y, f"rank {r['rank']} compute"))
        for i, group in enumerate(groups, 1):
            for g, op, issued, done, wait_start, wait_end in r["comm"]:
                if g != group:
                    continue
                ax.barh(y + i, done - issued, left=issued, height=0.5, color="#c6dbef", edgecolor="none")
                if wait_end > wait_start and wait_start < done:
                    ax.barh(y + i, min(wait_end, done) - wait_start, left=wait_start, height=0.5, color="#cb181d")
            ticks.append((y + i, f"rank {r['rank']} {group}"))
        y += lanes
    if sim is not None:
        for rank, intervals in enumerate(sim.timeline):
            for iv in intervals:
                if isinstance(iv.action, CommGroup):
                    continue
                kind = "FB" if isinstance(iv.action, FB) else type(iv.action).__name__
                ax.barh(y, iv.end - iv.start, left=iv.start, height=0.8, edgecolor="black", linewidth=0.3,
                        color={"F": "#fcd38d", "B": "#a5c8f0", "W": "#b7e4b0", "FB": "#d9c2ef"}[kind])
            ticks.append((y, f"simulated pp {rank}"))
            y += 1
    ax.set_yticks([t for t, _ in ticks], [lbl for _, lbl in ticks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of the traced step")
    if window:
        ax.set_xlim(*window)
    legend = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items()]
    legend += [Patch(facecolor="white", edgecolor="#555555", hatch="///", label="backward"),
               Patch(color="#c6dbef", label="comm in flight"), Patch(color="#cb181d", label="comm exposed (waited)")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=6, fontsize=8, frameon=False)
    ax.set_title(f"{run.name}: step {ranks[0]['step']}, schedule {ranks[0]['schedule']}, overlap "
                 f"{ranks[0]['overlap']}, link {ranks[0]['link'] or 'none'} (simulated rows: measured mean costs)",
                 fontsize=9)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/timeline.py", description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run's train.output_dir, trained with --set train.trace_step=N")
    ap.add_argument("--png", default=None, help="draw the timeline here")
    ap.add_argument("--window", default=None, help="only START:END seconds of the step in the drawing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    try:
        png = out_file("--png", args.png) if args.png else None
        s = summary(Path(args.run))
        window = parse_window(args.window, max(s["step_s"], s.get("simulated_s", 0.0))) if args.window else None
    except (FileNotFoundError, ValueError) as exc:  # OutPathError too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(s, indent=1) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_summary(s)
    if png is not None:
        draw(Path(args.run), png, window)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
