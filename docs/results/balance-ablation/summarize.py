"""Summarize the four balance runs (see README.md): results.json, results.md and balance.png.

    python docs/results/balance-ablation/summarize.py RUNS_DIR OUT_DIR

RUNS_DIR holds one `tools.ablate` output directory per variant (bias, sequence_aux, global_aux,
zloss_capacity), each with its one run's metrics.jsonl.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

VARIANTS = {  # directory -> what the run changes against recipes/debug_cpu.toml
    "bias": "aux-loss-free bias (default: bias_update_speed 0.01)",
    "sequence_aux": "sequence-wise aux loss 1e-2, no bias",
    "global_aux": "global-batch aux loss 1e-2, no bias",
    "zloss_capacity": "bias + z-loss 1e-3 + capacity 1.25 (probability)",
}
TAIL = 50  # steps averaged at the end: one step's loss is one batch's


def _rows(runs: Path, name: str) -> list[dict]:
    (log,) = (runs / name).glob("*/metrics.jsonl")
    return [json.loads(line) for line in log.read_text().splitlines()]


def summarize(rows: list[dict]) -> dict:
    tail = rows[-TAIL:]
    mean = lambda key: statistics.fmean(r[key] for r in tail) if key in tail[-1] else None  # noqa: E731
    layers = sorted({k.rsplit("layer", 1)[1] for k in rows[-1] if k.startswith("moe/imbalance/layer")})
    return {"steps": rows[-1]["step"], "final_loss": rows[-1]["loss"], f"loss_last{TAIL}": mean("loss"),
            "imbalance_max_final": rows[-1]["moe/imbalance_max"], f"imbalance_max_last{TAIL}": mean("moe/imbalance_max"),
            f"imbalance_per_layer_last{TAIL}": {L: mean(f"moe/imbalance/layer{L}") for L in layers},
            f"dropped_fraction_max_last{TAIL}": mean("moe/dropped_fraction_max"),
            f"z_loss_layer1_last{TAIL}": mean("moe/z_loss/layer1"),
            f"aux_loss_layer1_last{TAIL}": mean("moe/aux_loss/layer1"),
            f"global_aux_loss_layer1_last{TAIL}": mean("moe/global_aux_loss/layer1")}


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def write(runs: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    curves = {name: _rows(runs, name) for name in VARIANTS}
    results = {name: {"variant": VARIANTS[name], **summarize(rows)} for name, rows in curves.items()}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    head = ["run", "variant", "final loss", f"loss, last {TAIL}", "imbalance_max final", f"imbalance_max, last {TAIL}",
            f"dropped (max layer), last {TAIL}"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, r in results.items():
        lines.append(f"| {name} | {r['variant']} | {_fmt(r['final_loss'])} | {_fmt(r[f'loss_last{TAIL}'])} | "
                     f"{_fmt(r['imbalance_max_final'])} | {_fmt(r[f'imbalance_max_last{TAIL}'])} | "
                     f"{_fmt(r[f'dropped_fraction_max_last{TAIL}'])} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(curves, out / "balance.png")


def _plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, diff_ax, imb_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    base = [r["loss"] for r in curves["bias"]]
    for (name, rows), style in zip(curves.items(), ("-", "--", ":", "-.")):
        steps = [r["step"] for r in rows]
        loss_ax.plot(steps, [r["loss"] for r in rows], style, label=name, linewidth=1)
        diff = [r["loss"] - b for r, b in zip(rows, base)]  # the same batches in every run: a paired difference
        smooth = [statistics.fmean(diff[max(0, i - 19):i + 1]) for i in range(len(diff))]
        diff_ax.plot(steps, smooth, style, label=name, linewidth=1)
        imb_ax.plot(steps, [r["moe/imbalance_max"] for r in rows], style, label=name, linewidth=1)
    loss_ax.set(xlabel="step", ylabel="training loss", title="loss")
    diff_ax.set(xlabel="step", ylabel="loss - bias run's loss", title="paired difference, 20-step mean")
    imb_ax.set(xlabel="step", ylabel="max / mean expert load (worst layer)", title="moe/imbalance_max", yscale="log")
    for ax in (loss_ax, diff_ax, imb_ax):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("debug MoE (recipes/debug_cpu.toml), 300 steps: load-balancing variants")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    write(Path(sys.argv[1]), Path(sys.argv[2]))
