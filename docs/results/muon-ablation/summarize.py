"""Summarize the AdamW-vs-Muon runs (see README.md): results.json, results.md and losses.png.

    python docs/results/muon-ablation/summarize.py RUNS_DIR OUT_DIR

RUNS_DIR holds the `tools.ablate` output directories of run.sh; each run directory's name carries its
grid point (optimizer=muon__lr=3e-3, seed=1) and its config.toml the rest.
"""

from __future__ import annotations

import json
import statistics
import sys
import tomllib
from pathlib import Path

TAIL = 50  # steps averaged at the end: one step's loss is one batch's


def runs(root: Path) -> list[dict]:
    out = []
    for log in sorted(root.glob("*/*/metrics.jsonl")):
        train = tomllib.loads((log.parent / "config.toml").read_text())["train"]
        losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        out.append({"run": f"{log.parent.parent.name}/{log.parent.name}", "optimizer": train["optimizer"],
                    "lr": train["lr"], "seed": train["seed"], "steps": len(losses), "final": losses[-1],
                    "tail": statistics.mean(losses[-TAIL:]), "max_after_20": max(losses[20:] or [float("nan")]),
                    "losses": losses})
    return out


def best_lrs(rows: list[dict]) -> dict[str, float]:
    """Each optimizer's seed-0 learning rate with the lowest mean loss over the last TAIL steps."""
    done = [r for r in rows if r["seed"] == 0 and r["steps"] == 200]
    return {opt: min((r for r in done if r["optimizer"] == opt), key=lambda r: r["tail"])["lr"]
            for opt in sorted({r["optimizer"] for r in done})}


def table(rows: list[dict], best: dict[str, float]) -> str:
    lines = ["| optimizer | lr | seed | steps | final loss | mean of the last 50 | max after step 20 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["lr"], r["seed"])):
        lines.append(f"| {r['optimizer']} | {r['lr']:g} | {r['seed']} | {r['steps']} | {r['final']:.3f} | "
                     f"{r['tail']:.3f} | {r['max_after_20']:.2f} |")
    lines += ["", "| optimizer (best lr) | seeds | final loss, mean (min-max) | last 50, mean (min-max) |",
              "| --- | --- | --- | --- |"]
    for opt, lr in best.items():
        sel = [r for r in rows if r["optimizer"] == opt and r["lr"] == lr and r["steps"] == 200]
        f, t = [r["final"] for r in sel], [r["tail"] for r in sel]
        lines.append(f"| {opt} ({lr:g}) | {len(sel)} | {statistics.mean(f):.3f} ({min(f):.3f}-{max(f):.3f}) | "
                     f"{statistics.mean(t):.3f} ({min(t):.3f}-{max(t):.3f}) |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], best: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r["lr"] == best.get(r["optimizer"]):
            ax.plot(range(1, r["steps"] + 1), r["losses"], lw=1, ls="-" if r["optimizer"] == "muon" else "--",
                    label=f"{r['optimizer']} lr {r['lr']:g} seed {r['seed']}")
    ax.set(xlabel="step", ylabel="training loss", ylim=(1.5, 4.0),
           title="debug MoE: AdamW vs Muon at each one's best seed-0 lr")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main(root: str, out: str) -> None:
    rows, dest = runs(Path(root)), Path(out)
    best = best_lrs(rows)
    (dest / "results.md").write_text(table(rows, best))
    (dest / "results.json").write_text(json.dumps({"best_lr": best, "runs": [{k: v for k, v in r.items()
                                                                            if k != "losses"} for r in rows]},
                                                  indent=1) + "\n")
    plot(rows, best, dest / "losses.png")
    print(table(rows, best))


if __name__ == "__main__":
    main(*sys.argv[1:3])
