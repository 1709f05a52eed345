"""Build, validate, simulate and draw a pipeline schedule.

    python tools/schedule.py --schedule dualpipe --pp 8 --microbatches 20 \\
        [--v 2] [--costs F=1,B=2,W=1,FB=2.5[,comm=0]] [--comm-model dataflow|rendezvous] \\
        [--png out.png] [--json]

Prints makespan, per-rank busy time and bubble, peak activations and parameter copies next to the
published formulas (a text summary, or JSON with --json), and with --png draws the timeline: one
row per rank, one box per action coloured by kind (F, B, W, F&B) and shaded by chunk, micro-batch
numbers in the boxes. F&B boxes are drawn as their F half and B half inside one black border, as
in the DualPipe README figure. Runs from the repo root without installing the package.

Sizes: building and simulating take about 0.3 ms per stage-micro-batch (pp x microbatches x chunks per
rank) in Python, so more than MAX_STAGE_MICROBATCHES is refused up front with a size that fits (the
published bubble formulas do not depend on --microbatches). A drawing of more than MAX_DRAWN_BOXES boxes
is refused after the numbers are printed (pp=64 x 4096 micro-batches once drew for 8 minutes into
7.5 GB); wide drawings are scaled to at most MAX_WIDTH_IN inches, their boxes unlabelled when too narrow.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/schedule.py` from a checkout: run as tools.schedule
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.schedule", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import math
import sys

from moe_lc.config.rules import schedule_shape_errors
from moe_lc.parallel.pipeline import (
    FB, SCHEDULE_NAMES, CommGroup, Costs, Schedule, SimResult, build_schedule, published_figures,
    simulate,
)

from moe_lc.job.out_path import out_file

# Light and dark shade per kind; chunk c uses shade c (interleaved chunks > 1 cycle through them).
COLOURS = {"F": ("#fcd38d", "#f59e0b"), "B": ("#a5c8f0", "#3b7dd8"), "W": ("#b7e4b0", "#4a9d45")}
COST_KEYS = ("F", "B", "W", "FB", "comm")
MAX_STAGE_MICROBATCHES = 32_768  # pp x microbatches x chunks per rank: about 10 s to build and simulate
MAX_DRAWN_BOXES = 20_000  # boxes in the drawing: about 10 s and a few hundred MB
MAX_LABELS = 2_000  # micro-batch numbers written into boxes (each ~2 ms)
MAX_WIDTH_IN, INCH_PER_UNIT, MAX_PIXELS = 100.0, 0.22, 40e6


def parse_costs(text: str) -> Costs:
    """Costs from --costs "F=1,B=2,W=1,FB=2.5[,comm=0]"; ValueError names the flag and the bad item."""
    fields: dict[str, float] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in COST_KEYS:
            what = f"unknown cost {key!r}" if sep else "expected KEY=NUMBER"
            raise ValueError(f"--costs item {item!r}: {what}; keys are {', '.join(COST_KEYS)} "
                             "(e.g. F=1,B=2,W=1,FB=2.5)")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--costs item {item!r}: {value!r} is not a number") from None
        if not math.isfinite(number):
            raise ValueError(f"--costs item {item!r}: {value!r} is not a finite number")
        if key in fields:
            raise ValueError(f"--costs item {item!r}: {key} is given twice")
        fields[key] = number
    try:
        return Costs(**fields)
    except ValueError as err:
        raise ValueError(f"--costs {text!r}: {err}") from None


def _stage_microbatches(name: str, pp: int, m: int, v: int | None) -> int:
    return pp * m * (v if name == "interleaved_1f1b" else 2 if name == "dualpipev" else 1)


def _fitting_m(name: str, pp: int, m: int, v: int | None, limit: int) -> int | None:
    """The largest valid micro-batch count <= m whose size is within `limit` (None: none is)."""
    fit = min(m, limit // max(1, _stage_microbatches(name, pp, 1, v)))
    return next((k for k in range(fit, 0, -1) if not schedule_shape_errors(name, pp, k, v)), None)


def check_size(name: str, pp: int, m: int, v: int | None) -> None:
    """ValueError for a shape the schedule cannot run, then for one too large to build in seconds."""
    errors = schedule_shape_errors(name, pp, m, v) if name in SCHEDULE_NAMES else []
    if errors:
        raise ValueError(errors[0])
    size = _stage_microbatches(name, pp, m, v)
    if size > MAX_STAGE_MICROBATCHES:
        fit = _fitting_m(name, pp, m, v, MAX_STAGE_MICROBATCHES)
        hint = f"a smaller --microbatches (e.g. {fit}) or --pp" if fit else "a smaller --pp"
        raise ValueError(f"--pp {pp} x --microbatches {m} is {size:,} stage-micro-batches, more than the "
                         f"{MAX_STAGE_MICROBATCHES:,} this tool builds and simulates in seconds; give {hint} "
                         f"(the published bubble formulas do not depend on --microbatches)")


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


class _Boxes:
    """The boxes of a drawing, gathered and then added as one collection: one matplotlib patch per
    action took ~3 ms each (a minute for 20,000 boxes). Labels (micro-batch numbers) only where they fit:
    `inch` is inches per time unit, and a digit at fontsize 7 takes about 0.06 in."""

    def __init__(self, inch: float):
        self.inch, self.verts, self.faces, self.edges, self.widths, self.labels = inch, [], [], [], [], []

    def add(self, x, width, row, colour, text=None, edge="none", lw=0.0) -> None:
        self.verts.append(((x, row - 0.4), (x + width, row - 0.4), (x + width, row + 0.4), (x, row + 0.4)))
        self.faces.append(colour)
        self.edges.append(edge)
        self.widths.append(lw)
        if text is not None and width * self.inch >= 0.06 * len(str(text)) + 0.02:
            self.labels.append((x + width / 2, row, str(text)))

    def draw(self, ax, labels: bool = True) -> None:
        from matplotlib.collections import PolyCollection

        ax.add_collection(PolyCollection(self.verts, facecolors=self.faces, edgecolors=self.edges,
                                         linewidths=self.widths))
        for x, row, text in self.labels if labels else ():
            ax.text(x, row, text, ha="center", va="center", fontsize=7, in_layout=False)


def drawn_boxes(result: SimResult) -> int:
    """How many boxes the drawing of `result` holds (one per interval; F&B counts as its two halves)."""
    return sum(len(intervals) + sum(isinstance(iv.action, FB) for iv in intervals) for intervals in result.timeline)


def check_drawable(schedule: Schedule, result: SimResult, png: str) -> None:
    """ValueError when the drawing would be too large to draw in seconds, with a size that fits."""
    boxes = drawn_boxes(result)
    if boxes <= MAX_DRAWN_BOXES:
        return
    m = schedule.n_microbatches
    fit = next((k for k in range(m * MAX_DRAWN_BOXES // boxes, 0, -1)
                if not schedule_shape_errors(schedule.name, schedule.pp, k, _v_of(schedule))), None)
    hint = f"--microbatches {fit} or a smaller --pp" if fit else "a smaller --pp"
    raise ValueError(f"--png {png} not written: the timeline has {boxes:,} boxes, more than the "
                     f"{MAX_DRAWN_BOXES:,} this tool draws; give {hint} to draw it (the numbers above are complete)")


def _v_of(schedule: Schedule) -> int | None:
    return schedule.chunks_per_rank if schedule.name == "interleaved_1f1b" else None


def _figure_size(pp: int, makespan: float) -> tuple[float, float, float]:
    """(width in, height in, dpi): 0.22 in per time unit up to MAX_WIDTH_IN, at most MAX_PIXELS pixels."""
    width, height = min(MAX_WIDTH_IN, max(8.0, makespan * INCH_PER_UNIT)), 0.55 * pp + 1.6
    return width, height, min(130.0, math.sqrt(MAX_PIXELS / (width * height)))


def _draw_timeline(ax, costs: Costs, result: SimResult, inch: float) -> bool:
    """Draw every box; returns whether the micro-batch numbers were written (at most MAX_LABELS: each
    text costs ~2 ms to lay out and render)."""
    shade = lambda kind, chunk: COLOURS[kind][chunk % 2]  # noqa: E731
    boxes, borders = _Boxes(inch), _Boxes(inch)  # F&B borders go on top of every box
    for rank, intervals in enumerate(result.timeline):
        for iv in intervals:
            a, width = iv.action, iv.end - iv.start
            if isinstance(a, CommGroup):
                if width > 0:
                    boxes.add(iv.start, width, rank, "#d0d0d0")
            elif isinstance(a, FB):
                f_share = costs.F / (costs.F + costs.B)
                boxes.add(iv.start, width * f_share, rank, shade("F", a.f_chunk), a.f_mb)
                boxes.add(iv.start + width * f_share, width * (1 - f_share), rank, shade("B", a.b_chunk), a.b_mb)
                borders.add(iv.start, width, rank, "none", edge="black", lw=1.6)
            else:
                kind = type(a).__name__
                boxes.add(iv.start, width, rank, shade(kind, a.chunk), a.mb, edge="white", lw=0.5)
    labelled = len(boxes.labels) <= MAX_LABELS
    boxes.draw(ax, labelled)
    if borders.verts:
        borders.draw(ax)
    return labelled


def _legend(ax, schedule: Schedule, result: SimResult) -> None:
    from matplotlib.patches import Patch

    kinds = ["F", "B"] + (["W"] if schedule.split_backward else [])
    handles = [Patch(facecolor=COLOURS[k][c], label=f"{k} {_chunk_label(schedule, c)}")
               for k in kinds for c in range(min(2, schedule.chunks_per_rank))]
    if any(isinstance(a, FB) for acts in schedule.actions for a in acts):
        handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.6, label="F&B (overlapped)"))
    if result.comm_model == "rendezvous":
        handles.append(Patch(facecolor="#d0d0d0", label="comm wait"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def draw(schedule: Schedule, costs: Costs, result: SimResult, path: str) -> None:
    """Save the timeline of `result` as a PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width, height, dpi = _figure_size(schedule.pp, result.makespan)
    fig, ax = plt.subplots(figsize=(width, height))
    labelled = _draw_timeline(ax, costs, result, inch=width / max(result.makespan, 1e-9))
    _legend(ax, schedule, result)
    ax.set_xlim(0, result.makespan)
    ax.set_ylim(schedule.pp - 0.5, -0.5)
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.set_xlabel("time (F=%g, B=%g, W=%g, F&B=%g)" % (costs.F, costs.B, costs.W, costs.overlapped)
                  + ("" if labelled else f"; micro-batch numbers left out (more than {MAX_LABELS:,} boxes)"))
    v = f" v={schedule.chunks_per_rank}" if schedule.name == "interleaved_1f1b" else ""
    formula = published_figures(schedule, costs).bubble
    ax.set_title(f"{schedule.name}  pp={schedule.pp} m={schedule.n_microbatches}{v}   "
                 f"makespan={result.makespan:g}   "
                 f"bubble={result.published_bubble:g} (formula {formula:g})   "
                 f"peak act={max(result.peak_activations)}", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    for key in ("schedule", "pp", "microbatches", "makespan", "bubble", "bubble_formula", "formula_holds_when",
                "bubble_per_rank", "bubble_fraction", "peak_activations", "peak_activations_formula",
                "param_copies", "param_copies_formula"):
        value = summary[key]
        print(f"{key:26s} {value if not isinstance(value, float) else round(value, 4)}")


def main(argv=None) -> int:
    """Exit status 0; 2 with one `error: ` line for a bad argument, a too large size or an unusable --png."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--v", type=int, default=None, help="chunks per rank (interleaved_1f1b)")
    parser.add_argument("--costs", default="F=1,B=2,W=1,FB=2.5", help="e.g. F=1,B=2,W=1,FB=2.5,comm=0")
    parser.add_argument("--comm-model", default="dataflow", choices=("dataflow", "rendezvous"))
    parser.add_argument("--png", default=None, help="write the timeline drawing here (missing folders are made)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    try:
        costs = parse_costs(args.costs)
        check_size(args.schedule, args.pp, args.microbatches, args.v)
        png = out_file("--png", args.png) if args.png else None
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.v)  # validates
        result = simulate(schedule, costs, args.comm_model)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_summary(summarize(schedule, costs, result), args.json)
    if png is None:
        return 0
    try:
        check_drawable(schedule, result, args.png)
        draw(schedule, costs, result, str(png))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
