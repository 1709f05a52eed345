"""Figures of an eval run (matplotlib, Agg backend): heatmaps, accuracy by length, perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
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


def accuracy_by_length(results: dict[str, dict], path: Path, title: str) -> Path:
    """Exact match (solid) and per-token accuracy (dashed) vs length for each retrieval task, with
    each task's per-token chance as a dotted line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (kind, r) in enumerate(results.items()):
        lengths = sorted(int(x) for x in r["by_length"])
        if not lengths:
            continue
        colour = f"C{k}"
        ax.plot(lengths, [r["by_length"][str(x)]["exact"] for x in lengths], "o-", color=colour, label=f"{kind} exact")
        ax.plot(lengths, [r["by_length"][str(x)]["token_acc"] for x in lengths], "s--", color=colour, alpha=0.7,
                label=f"{kind} per token")
        ax.axhline(r["chance"]["token"], color=colour, linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (dotted: per-token chance)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def perplexity_plot(result: dict, path: Path, title: str, trained_length: int | None = None) -> Path:
    """Left: perplexity vs context length. Right: loss by token position (moving average)."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = sorted(int(x) for x in result["by_length"])
    left.plot(lengths, [result["by_length"][str(x)]["ppl"] for x in lengths], "o-")
    left.set_xscale("log", base=2)
    left.set_xlabel("context length (tokens)")
    left.set_ylabel("perplexity (sliding window)")
    positions = result.get("loss_by_position") or []
    if positions:
        width = max(1, len(positions) // 32)
        smooth = np.convolve(positions, np.ones(width) / width, mode="valid")
        right.plot(np.arange(len(smooth)) + width // 2 + 1, smooth)
        right.set_xscale("log", base=2)
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


def extension_figure(curves: dict[str, dict], path: Path, trained_lengths: list[int]) -> Path:
    """A context extension at a glance, from one eval results.json per model (label -> results):
    left, passkey exact match by length for every model (models whose label says "no training" dashed),
    with each stage's training length dotted; middle, the last trained model's passkey depth x length
    heatmap; right, held-out perplexity by length."""
    plt = _plt()
    fig, (acc, heat, ppl) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1.1, 1.2, 1]})
    labels = list(curves)
    trained = [label for label in labels if "no training" not in label]
    for k, (label, res) in enumerate(curves.items()):
        style = "s--" if label not in trained else "o-"
        passkey = res["tasks"].get("passkey", {}).get("by_length", {})
        lengths = sorted(int(x) for x in passkey)
        acc.plot(lengths, [passkey[str(x)]["exact"] for x in lengths], style, color=f"C{k}", label=label)
        losses = res["tasks"].get("perplexity", {}).get("by_length", {})
        ppl_lengths = sorted(int(x) for x in losses)
        ppl.plot(ppl_lengths, [losses[str(x)]["ppl"] for x in ppl_lengths], style, color=f"C{k}", label=label)
    for k, length in enumerate(trained_lengths):
        for ax in (acc, ppl):
            ax.axvline(length, color=f"C{k}", linestyle=":", linewidth=1)
    for ax in (acc, ppl):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens; dotted: each stage's training length)")
        ax.grid(alpha=0.3)
    acc.set_ylim(-0.02, 1.02)
    acc.set_ylabel("passkey exact match (mean over depths)")
    acc.set_title("passkey retrieval by length (chance 1e-5)", fontsize=9)
    ppl.set_yscale("log")
    ppl.set_ylabel("held-out perplexity (sliding window)")
    ppl.set_title("perplexity by length", fontsize=9)
    last = curves[trained[-1]]["tasks"].get("passkey")
    if last and last["grid"]:
        grid_lengths = sorted(int(x) for x in last["grid"])
        depths = sorted({float(d) for cells in last["grid"].values() for d in cells})
        values = np.array([[last["grid"][str(x)].get(f"{d:g}", {}).get("exact", np.nan) for x in grid_lengths]
                           for d in depths], dtype=float)
        im = heat.imshow(values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(grid_lengths)):
                heat.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=7)
        heat.set_xticks(range(len(grid_lengths)), [str(x) for x in grid_lengths])
        heat.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        heat.set_xlabel("context length (tokens)")
        heat.set_ylabel("needle depth (0 = start)")
        fig.colorbar(im, ax=heat, label="exact match")
    heat.set_title(f"passkey exact match, {trained[-1]}", fontsize=9)
    # one legend for both line panels, under the figure: inside, it hides the short-length points
    fig.legend(*acc.get_legend_handles_labels(), loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
