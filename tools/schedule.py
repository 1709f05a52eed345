"""Build, validate, simulate and draw a pipeline schedule.

    python tools/schedule.py --schedule dualpipe --pp 8 --microbatches 20 \\
        [--v 2] [--costs F=1,B=2,W=1,FB=2.5[,comm=0]] [--comm-model dataflow|rendezvous] \\
        [--png out.png] [--json]

Prints makespan, per-rank busy time and bubble, peak activations and parameter copies next to the
published formulas (a text summary, or JSON with --json), and with --png draws the timeline: one
row per rank, one box per action coloured by kind (F, B, W, F&B) and shaded by chunk, micro-batch
numbers in the boxes. F&B boxes are drawn as their F half and B half inside one black border, as
in the DualPipe README figure. Runs from the repo root without installing the package.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/schedule.py` from a checkout: run as tools.schedule
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.schedule", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import sys


from moe_lc.parallel.pipeline import (
    FB, SCHEDULE_NAMES, CommGroup, Costs, Schedule, SimResult, build_schedule, published_figures,
    simulate,
)

# Light and dark shade per kind; chunk c uses shade c (interleaved chunks > 1 cycle through them).
COLOURS = {"F": ("#fcd38d", "#f59e0b"), "B": ("#a5c8f0", "#3b7dd8"), "W": ("#b7e4b0", "#4a9d45")}


def summarize(schedule: Schedule, costs: Costs, result: SimResult) -> dict:
    """The numbers the tool reports, simulated and published side by side."""
    published = published_figures(schedule, costs)
    return {
        "schedule": schedule.name, "pp": schedule.pp, "microbatches": schedule.n_microbatches,
        "n_stages": schedule.n_stages, "chunks_per_rank": schedule.chunks_per_rank,
        "costs": {"F": costs.F, "B": costs.B, "W": costs.W, "FB": costs.overlapped, "comm": costs.comm},
        "comm_model": result.comm_model,
        "makespan": result.makespan,
        "busy_per_rank": list(result.busy),
        "bubble_per_rank": list(result.bubble),
        "bubble": result.published_bubble, "bubble_formula": published.bubble,
        "bubble_fraction": result.bubble_fraction,
        "formula_holds_when": published.holds_when,
        "peak_activations_per_rank": list(result.peak_activations),
        "peak_activations": max(result.peak_activations), "peak_activations_formula": published.peak_activations,
        "activation_unit": "one micro-batch through one chunk (1/n_stages of the model)",
        "param_copies": result.param_copies, "param_copies_formula": published.param_copies,
    }


def _chunk_label(schedule: Schedule, chunk: int) -> str:
    if schedule.name == "dualpipe":
        return ("down", "up")[chunk]
    return f"chunk {chunk}"


def _box(ax, x, width, row, colour, text, edge="none", lw=0.0):
    """One action box on `row` (a rank), with its micro-batch number written in it."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, row - 0.4), width, 0.8, facecolor=colour, edgecolor=edge, linewidth=lw))
    if text is not None:
        ax.text(x + width / 2, row, text, ha="center", va="center", fontsize=7)


def draw(schedule: Schedule, costs: Costs, result: SimResult, path: str) -> None:
    """Save the timeline of `result` as a PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.22), 0.55 * schedule.pp + 1.6))
    shade = lambda kind, chunk: COLOURS[kind][chunk % 2]  # noqa: E731
    for rank, intervals in enumerate(result.timeline):
        for iv in intervals:
            a, width = iv.action, iv.end - iv.start
            if isinstance(a, CommGroup):
                if width > 0:
                    _box(ax, iv.start, width, rank, "#d0d0d0", None)
            elif isinstance(a, FB):
                f_share = costs.F / (costs.F + costs.B)
                _box(ax, iv.start, width * f_share, rank, shade("F", a.f_chunk), a.f_mb)
                _box(ax, iv.start + width * f_share, width * (1 - f_share), rank, shade("B", a.b_chunk), a.b_mb)
                _box(ax, iv.start, width, rank, "none", None, edge="black", lw=1.6)
            else:
                kind = type(a).__name__
                _box(ax, iv.start, width, rank, shade(kind, a.chunk), a.mb, edge="white", lw=0.5)
    kinds = ["F", "B"] + (["W"] if schedule.split_backward else [])
    handles = [Patch(facecolor=COLOURS[k][c], label=f"{k} {_chunk_label(schedule, c)}")
               for k in kinds for c in range(min(2, schedule.chunks_per_rank))]
    if any(isinstance(a, FB) for acts in schedule.actions for a in acts):
        handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.6, label="F&B (overlapped)"))
    if result.comm_model == "rendezvous":
        handles.append(Patch(facecolor="#d0d0d0", label="comm wait"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_xlim(0, result.makespan)
    ax.set_ylim(schedule.pp - 0.5, -0.5)
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.set_xlabel("time (F=%g, B=%g, W=%g, F&B=%g)" % (costs.F, costs.B, costs.W, costs.overlapped))
    v = f" v={schedule.chunks_per_rank}" if schedule.name == "interleaved_1f1b" else ""
    formula = published_figures(schedule, costs).bubble
    ax.set_title(f"{schedule.name}  pp={schedule.pp} m={schedule.n_microbatches}{v}   "
                 f"makespan={result.makespan:g}   "
                 f"bubble={result.published_bubble:g} (formula {formula:g})   "
                 f"peak act={max(result.peak_activations)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--v", type=int, default=None, help="chunks per rank (interleaved_1f1b)")
    parser.add_argument("--costs", default="F=1,B=2,W=1,FB=2.5", help="e.g. F=1,B=2,W=1,FB=2.5,comm=0")
    parser.add_argument("--comm-model", default="dataflow", choices=("dataflow", "rendezvous"))
    parser.add_argument("--png", default=None, help="write the timeline drawing here")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    try:
        costs = Costs.parse(args.costs)
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.v)  # validates
        result = simulate(schedule, costs, args.comm_model)
    except ValueError as err:
        parser.error(str(err))
    summary = summarize(schedule, costs, result)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key in ("schedule", "pp", "microbatches", "makespan", "bubble", "bubble_formula", "formula_holds_when",
                    "bubble_per_rank", "bubble_fraction", "peak_activations", "peak_activations_formula",
                    "param_copies", "param_copies_formula"):
            value = summary[key]
            print(f"{key:26s} {value if not isinstance(value, float) else round(value, 4)}")
    if args.png:
        draw(schedule, costs, result, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
