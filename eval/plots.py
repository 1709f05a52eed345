"""Figures of an eval run (matplotlib, Agg backend): heatmaps, accuracy by length, perplexity.

Conventions, so a figure reads without its caption: context lengths are labelled as numbers (128,
1K, 128K), not powers of two; a log-scaled perplexity axis has plain ticks (2, 5, 10, 20, 50), not
"4x10^1"; every line style a figure uses is named in its legend or axis label as drawn (solid, dashed,
dotted). Series that share a length are set slightly apart along the (log) length axis, so equal values
(every task at 0 before training) stay visible as separate markers; the values themselves are exact.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def length_label(n: int) -> str:
    """128, 512, 1K, 128K: a context length as people write it."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _length_axis(ax, lengths) -> None:
    """Log2 length axis with a tick at each evaluated length (at most ~10, thinned evenly)."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths))
    ticks = ticks[::-(-len(ticks) // 10)] if ticks else ticks
    ax.set_xticks(ticks, [length_label(x) for x in ticks])
    ax.xaxis.set_minor_locator(NullLocator())


def _dodge(lengths: list[int], k: int, n: int, span: float) -> list[float]:
    """Series k of n, moved along a log2 length axis by ~2.5% of its width per series, centred: equal
    values of different series would otherwise be drawn exactly on top of each other."""
    shift = 0.025 * max(span, 1.0) * (k - (n - 1) / 2)
    return [x * 2.0 ** shift for x in lengths]


def _span(lengths) -> float:
    return math.log2(max(lengths) / min(lengths)) if lengths else 1.0


def _plain(value: float, _pos=None) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:g}"


def _plain_log_y(ax) -> None:
    """Ticks of a log y axis at 1-2-5 steps labelled as plain numbers, finer steps when the range is
    narrow (perplexities of 2.8 to 5 get 3, 4, 5), no minor labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo, hi = ax.get_ylim()
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for steps in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 7), tuple(range(1, 10))):
        ticks = [m * 10.0 ** e for e in decades for m in steps if lo <= m * 10.0 ** e <= hi]
        if len(ticks) >= 3:
            break
    else:
        ticks = [float(f"{v:.2g}") for v in np.geomspace(lo, hi, 4)[1:-1]] or ticks
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(_plain))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(lo, hi)


def depth_length_heatmap(result: dict, path: Path, title: str, metric: str = "exact") -> Path:
    """Rows: needle depth (0 = start of the context), columns: length; cells: mean `metric`.
    Lengths the task could not fill are drawn empty (grey) and named in the title."""
    plt = _plt()
    grid = result["grid"]
    lengths = sorted({int(k) for k in grid} | {int(k) for k in result.get("skipped", {})})
    depths = sorted({float(d) for cells in grid.values() for d in cells})
    values = np.full((len(depths), len(lengths)), np.nan)
    for j, length in enumerate(lengths):
        for i, depth in enumerate(depths):
            cell = grid.get(str(length), {}).get(f"{depth:g}")
            if cell and cell.get("n"):
                values[i, j] = cell[metric]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 3, 0.6 * len(depths) + 2))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not math.isnan(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [length_label(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    skipped = ", ".join(sorted(result.get("skipped", {}), key=int))
    ax.set_title(title + (f"\n(too short: {skipped})" if skipped else ""), fontsize=9)
    fig.colorbar(im, ax=ax, label=f"{metric} match")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _chance_lines(ax, results: dict[str, dict], colours: dict[str, str]) -> None:
    """One dotted line per distinct per-token chance level, in its task's colour (grey when tasks share
    it), labelled in the legend as dotted with the tasks it belongs to."""
    levels: dict[float, list[str]] = {}
    for kind, r in results.items():
        levels.setdefault(round(r["chance"]["token"], 4), []).append(kind)
    for level, kinds in levels.items():
        colour = colours[kinds[0]] if len(kinds) == 1 else "0.35"
        ax.axhline(level, color=colour, linestyle=":", linewidth=1.2,
                   label=f"per-token chance {level:.3f} (dotted): {', '.join(kinds)}")


def accuracy_by_length(results: dict[str, dict], path: Path, title: str) -> Path:
    """Exact match (solid, filled circles) and per-token accuracy (dashed, open squares) vs length, one
    colour per retrieval task, and the per-token chance levels dotted; the legend names each style as
    drawn. Tasks' points are set slightly apart along the length axis and the open squares ring the
    circles, so equal values (all 0 before training) stay visible."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    drawn = {kind: r for kind, r in results.items() if r["by_length"]}
    every = sorted({int(x) for r in drawn.values() for x in r["by_length"]})
    colours = {kind: f"C{k}" for k, kind in enumerate(drawn)}
    for k, (kind, r) in enumerate(drawn.items()):
        lengths = sorted(int(x) for x in r["by_length"])
        xs = _dodge(lengths, k, len(drawn), _span(every))
        ax.plot(xs, [r["by_length"][str(x)]["exact"] for x in lengths], "o-", color=colours[kind], markersize=5,
                label=f"{kind}: exact match (solid)")
        ax.plot(xs, [r["by_length"][str(x)]["token_acc"] for x in lengths], "s--", color=colours[kind],
                markerfacecolor="none", markersize=8, label=f"{kind}: per token (dashed)")
    _chance_lines(ax, drawn, colours)
    _length_axis(ax, every)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    # under the axes: inside, the legend covers the points at 1.0 or 0
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.032 * math.ceil(len(ax.get_legend_handles_labels()[1]) / 2), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def perplexity_plot(result: dict, path: Path, title: str, trained_length: int | None = None) -> Path:
    """Left: perplexity vs context length. Right: loss by token position (moving average)."""
    from matplotlib.ticker import FuncFormatter

    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = sorted(int(x) for x in result["by_length"])
    left.plot(lengths, [result["by_length"][str(x)]["ppl"] for x in lengths], "o-")
    _length_axis(left, lengths)
    left.set_xlabel("context length (tokens)")
    left.set_ylabel("perplexity (sliding window)")
    positions = result.get("loss_by_position") or []
    if positions:
        width = max(1, len(positions) // 32)
        smooth = np.convolve(positions, np.ones(width) / width, mode="valid")
        right.plot(np.arange(len(smooth)) + width // 2 + 1, smooth)
        right.set_xscale("log", base=2)
        right.xaxis.set_major_formatter(FuncFormatter(lambda v, _: length_label(int(v)) if v >= 1 else f"{v:g}"))
        right.set_xlabel(f"token position (window {result['position_window']})")
        right.set_ylabel(f"loss (moving average of {width})")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if trained_length:
            ax.axvline(trained_length, color="grey", linestyle=":", label=f"trained seq_len {trained_length}")
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _extension_lines(acc, ppl, curves: dict[str, dict], trained_lengths: list[int]) -> None:
    """Passkey exact match and perplexity by length, one colour per model ("no training" models dashed,
    square markers), each stage's training length a dotted vertical line."""
    every = sorted({int(x) for res in curves.values() for task in ("passkey", "perplexity")
                    for x in res["tasks"].get(task, {}).get("by_length", {})})
    for k, (label, res) in enumerate(curves.items()):
        style = "s--" if "no training" in label else "o-"
        passkey = res["tasks"].get("passkey", {}).get("by_length", {})
        lengths = sorted(int(x) for x in passkey)
        acc.plot(_dodge(lengths, k, len(curves), _span(every)), [passkey[str(x)]["exact"] for x in lengths], style,
                 color=f"C{k}", label=label)
        losses = res["tasks"].get("perplexity", {}).get("by_length", {})
        lengths = sorted(int(x) for x in losses)
        ppl.plot(_dodge(lengths, k, len(curves), _span(every)), [losses[str(x)]["ppl"] for x in lengths], style,
                 color=f"C{k}", label=label)
    for k, length in enumerate(trained_lengths):
        for ax in (acc, ppl):
            ax.axvline(length, color=f"C{k}", linestyle=":", linewidth=1)
    for ax in (acc, ppl):
        _length_axis(ax, every)
        ax.set_xlabel("context length (tokens; dotted: each stage's training length)")
        ax.grid(alpha=0.3)
    acc.set_ylim(-0.03, 1.03)
    acc.set_ylabel("passkey exact match (mean over depths)")
    acc.set_title("passkey retrieval by length (chance 1e-5)", fontsize=9)
    ppl.set_title("perplexity by length", fontsize=9)
    if not any(res["tasks"].get("perplexity", {}).get("by_length") for res in curves.values()):
        ppl.cla()  # an empty axis reads as a plotting bug: say why it is empty
        ppl.axis("off")
        ppl.text(0.5, 0.5, "no perplexity in these evals\n(--tasks without perplexity)", ha="center", va="center",
                 fontsize=9, color="0.4", transform=ppl.transAxes)
        return
    ppl.set_yscale("log")
    _plain_log_y(ppl)
    ppl.set_ylabel("held-out perplexity (sliding window, log scale)")


def _extension_heatmap(fig, heat, passkey: dict | None, label: str) -> None:
    """The passkey depth x length heatmap of one model (exact match per cell)."""
    if passkey and passkey["grid"]:
        grid_lengths = sorted(int(x) for x in passkey["grid"])
        depths = sorted({float(d) for cells in passkey["grid"].values() for d in cells})
        values = np.array([[passkey["grid"][str(x)].get(f"{d:g}", {}).get("exact", np.nan) for x in grid_lengths]
                           for d in depths], dtype=float)
        im = heat.imshow(values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(grid_lengths)):
                heat.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=7)
        heat.set_xticks(range(len(grid_lengths)), [length_label(x) for x in grid_lengths])
        heat.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        heat.set_xlabel("context length (tokens)")
        heat.set_ylabel("needle depth (0 = start)")
        fig.colorbar(im, ax=heat, label="exact match")
    heat.set_title(f"passkey exact match, {label}", fontsize=9)


def extension_figure(curves: dict[str, dict], path: Path, trained_lengths: list[int]) -> Path:
    """A context extension at a glance, from one eval results.json per model (label -> results):
    left, passkey exact match by length for every model (models whose label says "no training" dashed),
    with each stage's training length dotted; middle, the last trained model's passkey depth x length
    heatmap; right, held-out perplexity by length (log scale, plain tick labels)."""
    plt = _plt()
    fig, (acc, heat, ppl) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1.1, 1.2, 1]})
    labels = list(curves)
    trained = [label for label in labels if "no training" not in label]
    _extension_lines(acc, ppl, curves, trained_lengths)
    _extension_heatmap(fig, heat, curves[trained[-1]]["tasks"].get("passkey"), trained[-1])
    # one legend for both line panels, under the figure: inside, it hides the short-length points
    fig.legend(*acc.get_legend_handles_labels(), loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_figure(summary: dict, path: Path, title: str) -> Path:
    """The eval's summary table drawn: rows tasks (then RULER's average), columns lengths, each cell its
    percentage on a red-yellow-green scale; lengths a task could not fill are grey with "-"."""
    plt = _plt()
    rows = list(summary["rows"])
    lengths = summary["lengths"]
    avg = summary.get("ruler_average", {})
    labels = rows + (["RULER average"] if avg else [])
    values = np.full((len(labels), len(lengths)), np.nan)
    for i, name in enumerate(rows):
        for j, x in enumerate(lengths):
            cell = summary["rows"][name][str(x)]
            values[i, j] = np.nan if cell is None else cell
    if avg:
        values[-1] = [avg[str(x)]["score"] if str(x) in avg else np.nan for x in lengths]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.0 * len(lengths) + 3.2), 0.34 * len(labels) + 1.8))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#dddddd")
    ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0, vmax=100, aspect="auto")
    for i in range(len(labels)):
        for j in range(len(lengths)):
            v = values[i, j]
            dark = not math.isnan(v) and (v < 20 or v > 85)  # the scale's ends: white text reads there
            ax.text(j, i, "-" if math.isnan(v) else f"{v:.1f}", ha="center", va="center", fontsize=8,
                    color="white" if dark else "black", fontweight="bold" if avg and i == len(labels) - 1 else "normal")
    if avg:
        ax.axhline(len(labels) - 1.5, color="black", linewidth=1)
    ax.set_xticks(range(len(lengths)), [length_label(x) for x in lengths])
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_title(title + "\nRULER tasks: string match of the greedy generation (%)\nolder tasks: teacher-forced "
                 "exact match (%); grey: too short for the task, or skipped", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
