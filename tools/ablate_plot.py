"""loss_curves.png of an ablation: every run's training loss by step, each run findable.

Why: runs that should agree (recompute none / full, exact by construction) draw the same curve, and
the later one used to hide the earlier; and a few-step run got fractional step ticks (1.25, 1.5).
Now a run whose losses equal an earlier run's says so in the legend ("b (= a)"), every curve has its
own line style and marker (markers only while there are few points), later curves are drawn thinner
on top of thicker ones, steps are integer ticks, and a long title wraps.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x", "+", "*")
MARKERS_UP_TO = 60  # points per curve; more and markers hide the line


def twin_labels(runs: list[tuple[str, list[tuple[int, float]]]]) -> list[str]:
    """Legend labels: "name (= earlier)" for a run whose (step, loss) list equals an earlier run's."""
    labels, first_of = [], {}
    for name, losses in runs:
        key = tuple(losses)
        labels.append(f"{name} (= {first_of[key]})" if key in first_of else name)
        first_of.setdefault(key, name)
    return labels


def plot_losses(results, path: Path, title: str) -> None:
    """Draw the loss curves of `results` (tools.ablate.RunResult) into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    drawn = [r for r in results if r.losses]
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = twin_labels([(r.combo.name, r.losses) for r in drawn])
    for i, (r, label) in enumerate(zip(drawn, labels)):
        steps, losses = zip(*r.losses)
        marker = MARKERS[i % len(MARKERS)] if len(steps) <= MARKERS_UP_TO else None
        ax.plot(steps, losses, STYLES[i % len(STYLES)], marker=marker, markersize=max(3.0, 7.0 - i),
                fillstyle="none", linewidth=max(0.8, 2.4 - 0.4 * i), label=f"{label} ({r.status})")
    if not drawn:
        ax.text(0.5, 0.5, "no run logged a step", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=9)  # a long --set list used to run off the figure
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
