"""The step-time model (tools/step_time/model.py) against published runs, leave-one-out.

    python -m tools.step_time.published [--out docs/results/steptime] [--only TEXT ...]

The kernel rates come from an H100's benchmark tables (tools/step_time/kernel_rates.py), never from these runs.
The one constant fitted to the runs is a global overhead factor on throughput: the median of published /
predicted over the runs it is fitted on (what no kernel table sees: stragglers, the framework's host work,
imbalance; the median, so that one framework's outlying run does not move every other prediction). Leave-one-out: each run is predicted with the factor fitted on the other runs. Each run is
planned once on its cluster (tools/step_time/published_runs.py); the figure compared is tokens/s/GPU, or for a
run published as TFLOP/s only, model TFLOP/s/GPU in the source's attention convention (flop_conventions.py;
"unstated" is read as causal, the convention of Megatron-LM since 2025-03). Writes published.json and
published.md into --out.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/step_time/published.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.step_time.published", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict

from moe_lc.config import load_config
from .attention_impls import with_attention
from .clusters import resolve
from .model import predict
from .published_runs import RUNS, Run
from ..planner.plan import plan

COMMAND = "python -m tools.step_time.published --out docs/results/steptime"


def run_one(run: Run) -> dict:
    """The run planned on its cluster and predicted with its implementation and its attention (the kernels its
    stack runs, at its model's head dim, over its sliding window if any): the `predicted` block, its layout and the
    planned peak."""
    cfg = load_config(run.recipe, [])
    p = plan(cfg, None, run.recipe)
    cluster, eff = resolve(run.cluster)
    eff = with_attention(eff, run.attention, cfg.model.qk_head_dim, run.window, cfg.train.seq_len)
    pred = predict(cfg, p, cluster, eff, run.impl)
    pred["degrees"] = p.degrees
    pred["peak_gib"] = max(r.peak_bytes() for r in p.ranks) / 2**30
    return pred


def compared(run: Run, pred: dict) -> tuple[float, float, str]:
    """(published, predicted, unit) of the figure the run is compared on."""
    if run.tokens:
        return run.tokens, pred["tokens_per_s_per_gpu"], "tokens/s/GPU"
    convention = "full" if run.convention == "full" else "causal"
    return run.tflops, pred[f"model_tflops_per_gpu_{convention}"], f"TFLOP/s/GPU ({convention})"


def overhead_factor(rows: list[dict], leave_out: int | None = None) -> float:
    """The median of published / predicted over `rows` ({"published", "predicted"}), without row `leave_out`:
    the factor a predicted throughput is multiplied by (1 with no row to fit on)."""
    ratios = [r["published"] / r["predicted"] for i, r in enumerate(rows) if i != leave_out]
    return statistics.median(ratios) if ratios else 1.0


def leave_one_out(rows: list[dict]) -> list[dict]:
    """Each row's prediction with the factor fitted on the others: {"factor", "loo_predicted", "loo_error"}."""
    out = []
    for i, r in enumerate(rows):
        f = overhead_factor(rows, leave_out=i)
        out.append({"factor": f, "loo_predicted": r["predicted"] * f, "loo_error": r["predicted"] * f / r["published"] - 1})
    return out


def largest_term(pred: dict) -> str:
    """The step-time term the prediction spends most on, with its share of the step."""
    name, seconds = next(iter(pred["terms_s"].items()))
    return f"{name} {seconds / pred['step_s']:.0%}"


def layout(pred: dict) -> str:
    d = pred["degrees"]
    parts = [f"{k}{d[k]}" for k in ("pp", "tp", "cp", "ep") if d.get(k, 1) > 1]
    return " ".join(parts + [f"dp{d['dp']}"]) + f" ({d['world']} GPUs)"


def table(rows: list[dict]) -> str:
    head = ["| run | layout, precision | published | predicted (no factor) | leave-one-out predicted | error | "
            "largest term of the predicted step | step s | planned peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["prediction"]
        head.append(f"| {r['name']} | {layout(p)}, {r['precision']} | {r['published']:,.0f} {r['unit']} | "
                    f"{r['predicted']:,.0f} ({r['predicted'] / r['published'] - 1:+.0%}) | {r['loo_predicted']:,.0f} | "
                    f"{r['loo_error']:+.1%} | {largest_term(p)} | {p['step_s']:.2f} | {p['peak_gib']:.0f} |")
    return "\n".join(head)


def notes(rows: list[dict]) -> str:
    """The known reasons for the runs' misses (published_runs.Run.note) as a markdown section; "" when none."""
    lines = [f"- {r['name']} ({r['loo_error']:+.0%}): {r['note']}" for r in rows if r.get("note")]
    return "\nWhy the model misses where it is known:\n\n" + "\n".join(lines) + "\n" if lines else ""


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["loo_error"]) for r in rows]
    return {"runs": len(rows), "loo_mean_abs_error": sum(errors) / len(errors), "loo_max_abs_error": max(errors),
            "beyond_30pct": [r["name"] for r in rows if abs(r["loo_error"]) > 0.30],
            "factor_all_runs": overhead_factor(rows),
            "raw_mean_abs_error": sum(abs(r["predicted"] / r["published"] - 1) for r in rows) / len(rows)}


def evaluate(runs: list[Run], log=print) -> list[dict]:
    rows = []
    for run in runs:
        start = time.perf_counter()
        pred = run_one(run)
        pub, got, unit = compared(run, pred)
        rows.append({**asdict(run), "published": pub, "predicted": got, "unit": unit, "prediction": pred})
        log(f"{run.name}: {got:,.0f} {unit} predicted, {pub:,.0f} published ({time.perf_counter() - start:.0f} s)")
    for r, loo in zip(rows, leave_one_out(rows)):
        r.update(loo)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/steptime")
    ap.add_argument("--only", action="append", help="runs whose name contains this (repeatable); default all")
    ap.add_argument("--reuse", help="a published.json whose predictions to reuse (only the fit and the table redone)")
    args = ap.parse_args(argv)
    runs = [r for r in RUNS if not args.only or any(s in r.name for s in args.only)]
    if args.reuse:
        with open(args.reuse) as fh:
            rows = [r for r in json.load(fh)["runs"] if any(r["name"] == run.name for run in runs)]
        for r, loo in zip(rows, leave_one_out(rows)):
            r.update(loo)
    else:
        rows = evaluate(runs, log=lambda *a: print(*a, flush=True))
    stats = summary(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "published.json"), "w") as fh:
        json.dump({"command": COMMAND, "summary": stats, "runs": rows}, fh, indent=1)
    text = (f"<!-- generated by `{COMMAND}` (tools/step_time/published.py); do not edit -->\n"
            f"# Step-time predictions against {stats['runs']} published runs, leave-one-out\n\n{table(rows)}\n\n"
            f"Leave-one-out mean absolute error {stats['loo_mean_abs_error']:.1%}, largest "
            f"{stats['loo_max_abs_error']:.1%}; beyond 30%: {', '.join(stats['beyond_30pct']) or 'none'}. "
            f"Overhead factor fitted on all runs: {stats['factor_all_runs']:.3f} (without it: mean absolute error "
            f"{stats['raw_mean_abs_error']:.1%}).\n\nSources:\n\n"
            + "\n".join(f"- {r['name']}: {r['source']} ({r['recipe']})" for r in rows) + "\n" + notes(rows))
    with open(os.path.join(args.out, "published.md"), "w") as fh:
        fh.write(text)
    print(table(rows))
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
