"""Summarize the tiny-V4 ablation (see README.md): results.json, results.md and losses.png.

    python docs/results/v4-ablation/summarize.py RUNS_DIR OUT_DIR

RUNS_DIR is one `tools/ablate.py` output directory; each run's config.toml gives its model.residual,
model.moe.hash_layers and train.seed.
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
    for log in sorted(root.glob("*/metrics.jsonl")):
        cfg = tomllib.loads((log.parent / "config.toml").read_text())
        losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        out.append({"residual": cfg["model"]["residual"], "hash_layers": cfg["model"]["moe"]["hash_layers"],
                    "seed": cfg["train"]["seed"], "steps": len(losses), "final": losses[-1],
                    "tail": statistics.mean(losses[-TAIL:]), "losses": losses})
    return out


def variant(r: dict) -> tuple[str, int]:
    return r["residual"], r["hash_layers"]


def table(rows: list[dict]) -> str:
    lines = [f"| residual | hash layers | seeds | final loss, mean (min-max) | last {TAIL} steps, mean (min-max) |",
             "| --- | --- | --- | --- | --- |"]
    for v in sorted({variant(r) for r in rows}):
        sel = [r for r in rows if variant(r) == v]
        f, t = [r["final"] for r in sel], [r["tail"] for r in sel]
        lines.append(f"| {v[0]} | {v[1]} | {len(sel)} | {statistics.mean(f):.4f} ({min(f):.4f}-{max(f):.4f}) | "
                     f"{statistics.mean(t):.4f} ({min(t):.4f}-{max(t):.4f}) |")
    lines += ["", f"Paired by seed (same initialization stream and batches), the last-{TAIL} mean's difference:", "",
              "| comparison | seed 0 | seed 1 | seed 2 | mean |", "| --- | --- | --- | --- | --- |"]
    tail = {(variant(r), r["seed"]): r["tail"] for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    for name, a, b in [("mhc - plain (hash 1)", ("mhc", 1), ("plain", 1)),
                       ("mhc - plain (hash 0)", ("mhc", 0), ("plain", 0)),
                       ("hash 1 - learned (mhc)", ("mhc", 1), ("mhc", 0)),
                       ("hash 1 - learned (plain)", ("plain", 1), ("plain", 0))]:
        d = [tail[a, s] - tail[b, s] for s in seeds if (a, s) in tail and (b, s) in tail]
        lines.append(f"| {name} | " + " | ".join(f"{x:+.4f}" for x in d) + f" | {statistics.mean(d):+.4f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, window: int = 25) -> None:
    """Left: each variant's loss, mean of its seeds. Right: the paired differences against plain residual + learned
    routing, per seed, as a moving average over `window` steps (one step's loss is one batch's: noisy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {("mhc", 1): "C0", ("mhc", 0): "C1", ("plain", 1): "C2", ("plain", 0): "C3"}
    by = {(variant(r), r["seed"]): r["losses"] for r in rows}
    base = ("plain", 0)
    for v in sorted(colors):
        sel = [r for r in rows if variant(r) == v]
        if not sel:
            continue
        n = min(r["steps"] for r in sel)
        mean = [statistics.mean(r["losses"][i] for r in sel) for i in range(n)]
        ax.plot(range(1, n + 1), mean, lw=1, color=colors[v],
                label=f"{v[0]}, hash layers {v[1]} (mean of {len(sel)} seeds)")
        if v == base:
            continue
        for r in sel:
            if (base, r["seed"]) not in by:
                continue
            d = [a - b for a, b in zip(r["losses"], by[base, r["seed"]])]
            avg = [statistics.mean(d[max(0, i - window + 1):i + 1]) for i in range(len(d))]
            dx.plot(range(1, len(avg) + 1), avg, lw=1, color=colors[v],
                    label=f"{v[0]}, hash layers {v[1]}" if r["seed"] == sel[0]["seed"] else None)
    ax.set(xlabel="step", ylabel="training loss", ylim=(1.0, 4.0), title="tiny DeepSeek-V4: mHC and hash routing")
    ax.legend(fontsize=8)
    dx.axhline(0, color="k", lw=0.5)
    dx.set(xlabel="step", ylabel=f"loss minus plain + learned routing, same seed ({window}-step mean)",
           ylim=(-0.12, 0.06), title="paired by seed (one line per seed)")
    dx.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main(root: str, out: str) -> None:
    rows, dest = runs(Path(root)), Path(out)
    (dest / "results.md").write_text(table(rows))
    (dest / "results.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "losses"} for r in rows],
                                                  indent=1) + "\n")
    plot(rows, dest / "losses.png")
    print(table(rows))


if __name__ == "__main__":
    main(*sys.argv[1:3])
