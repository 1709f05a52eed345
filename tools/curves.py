"""Training curves from runs' metrics.jsonl, one panel per metric, for a README or a note.

    python tools/curves.py RUN [RUN ...] --keys loss,dsa/indexer_kl [--chain] [--smooth N] [--out curves.png]

Each RUN is a training run's output directory (its metrics.jsonl, one JSON object per step). Each key
gets a panel with a line per run that logged it (a run without the key is left out of that panel). With
--chain the runs are stages of one training, in order: each run's steps continue from where the one
before it ended (tools/extend.py's stages), and a dotted line marks where each stage starts. TensorBoard
shows the same metrics live; --smooth N draws each curve's running mean over N steps over its raw values
(faint), for losses that jump from batch to batch (`tensorboard --logdir RUN/tb`); this is the static picture.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/curves.py` from a checkout: run as tools.curves
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.curves", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import math
import sys
from pathlib import Path

from .ablate import read_metrics


def run_records(run: Path) -> list[dict]:
    """run/metrics.jsonl's step records in step order (ablate.read_metrics: a resumed run's re-logged step
    counts once); FileNotFoundError names the file."""
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (is {run} a training run's output_dir?)")
    return [rec for _, rec in sorted(read_metrics(path).items())]


def series(runs: list[Path], keys: list[str], chain: bool = False) -> tuple[dict, list[int]]:
    """({key: {run name: [(step, value)]}}, the steps where each later run starts); with chain, each run's
    steps offset by the steps of the runs before it (else no starts)."""
    out: dict[str, dict[str, list]] = {k: {} for k in keys}
    offset, starts = 0, []
    for i, run in enumerate(runs):
        records = run_records(run)
        if chain and i:
            starts.append(offset)
        for key in keys:
            points = [(offset + r["step"], float(r[key])) for r in records if key in r and r[key] is not None]
            if points:
                out[key][Path(run).name] = points
        if chain and records:
            offset += records[-1]["step"]
    return out, starts


def running_mean(values: list[float], n: int) -> list[float]:
    """Each value's mean with up to n - 1 values before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def plot(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str = "",
         starts: list[int] = (), smooth: int = 1) -> Path:
    """One panel per key (side by side, at most 3 a row); `starts`: steps where chained stages begin;
    smooth > 1: the running mean over that many steps, the raw values faint beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, runs in curves.items() if runs]
    if not keys:
        raise ValueError("none of the runs logged any of the keys")
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for name, points in curves[key].items():
            steps, values = zip(*points)
            if smooth > 1:
                line, = ax.plot(steps, values, lw=0.6, alpha=0.3)
                ax.plot(steps, running_mean(list(values), smooth), color=line.get_color(), lw=1.4,
                        label=f"{name} (mean of {smooth})")
            else:
                ax.plot(steps, values, label=name, lw=1.2)
        for s in starts:
            ax.axvline(s, color="0.6", ls=":", lw=0.8)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/curves.py", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="training output directories")
    ap.add_argument("--keys", default="loss", help="comma-separated metrics.jsonl keys, one panel each")
    ap.add_argument("--chain", action="store_true", help="the runs are consecutive stages: steps continue")
    ap.add_argument("--smooth", type=int, default=1, help="running mean over this many steps (1: raw)")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", type=Path, default=Path("curves.png"))
    args = ap.parse_args(argv)
    try:
        curves, starts = series(args.runs, args.keys.split(","), args.chain)
        print(f"wrote {plot(curves, args.out, args.title, starts, args.smooth)}")
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
