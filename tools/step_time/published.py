"""The step-time predictor (tools/step_time/model.py) against published runs, one set of defaults for all.

    python -m tools.step_time.published [--out docs/results/steptime]

For each run: its recipe planned on its cluster, the predicted tokens/s/GPU and model TFLOP/s/GPU
beside the source's figure, the error, and how much each default (every efficiency and the network
bandwidth) moves the prediction when raised by 10% (the plan is made once; only the prediction is
redone). Writes results.json and results.md into --out.
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
from dataclasses import replace

from moe_lc.config import load_config
from .clusters import resolve
from ..planner.plan import plan
from .model import predict

# (recipe, cluster, published tokens/s/GPU or None, published model TFLOP/s/GPU or None, source)
RUNS = [
    ("recipes/deepseek_v3_671b.toml", "h800", 1543.0, None,
     "DeepSeek-V3 report (arXiv 2412.19437) Table 1: 2.664M H800 GPU-hours of pre-training for 14.8T "
     "tokens on 2,048 H800 = 14.8e12 / (2.664e6 x 3600) tokens/s/GPU"),
    ("recipes/megatron_deepseek_v3_h100.toml", "h100", 1297.0, 338.0,
     "Megatron-Bridge 25.09 performance summary (docs.nvidia.com/nemo/megatron-bridge): DeepSeek-V3, "
     "1,024 H100, FP8, TP2 PP8 EP64, 4K"),
    ("recipes/qwen3_235b_a22b_128k.toml", "h100", None, 357.0,
     "Megatron MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md): "
     "Qwen3-235B-A22B, 128K, TP4 CP8 PP8 VPP4 EP8, 32 H100 nodes, BF16, dropless"),
]
RAISE = 1.10


def run_one(recipe: str, cluster_name: str) -> dict:
    cfg = load_config(recipe, [])
    p = plan(cfg, None, recipe)
    cluster, eff = resolve(cluster_name)
    base = predict(cfg, p, cluster, eff)
    moves = {}
    for key in eff:
        moves[f"eff.{key}"] = predict(cfg, p, cluster, {**eff, key: eff[key] * RAISE})["tokens_per_s_per_gpu"]
    for key in ("net_gbps", "nvlink_gbps", "hbm_gbps"):
        bigger = replace(cluster, **{key: getattr(cluster, key) * RAISE})
        moves[f"cluster.{key}"] = predict(cfg, p, bigger, eff)["tokens_per_s_per_gpu"]
    base["raise_10pct"] = {k: v / base["tokens_per_s_per_gpu"] - 1 for k, v in moves.items()}
    base["model_tflops_full_attention"] = base["model_tflops_per_gpu_full"]  # (flop_conventions.py; results.json's key)
    base["degrees"] = p.degrees
    base["peak_gib"] = max(r.peak_bytes() for r in p.ranks) / 2**30
    return base


def table(rows: list[dict]) -> str:
    out = ["| run | layout | published | predicted | error | predicted step s | MFU | bubble | exposed comm s "
           "(largest) | default that moves it most (+10%) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred, d = r["predicted"], r["predicted"]["degrees"]
        layout = f"pp{d['pp']} tp{d['tp']} cp{d['cp']} ep{d['ep']} dp{d['dp']} ({d['world']} GPUs)"
        if r["tokens"]:
            pub, got = f"{r['tokens']:,.0f} tok/s/GPU", f"{pred['tokens_per_s_per_gpu']:,.0f} tok/s/GPU"
            err = pred["tokens_per_s_per_gpu"] / r["tokens"] - 1
        else:
            pub = f"{r['tflops']:.0f} TFLOP/s/GPU"
            got = (f"{pred['model_tflops_per_gpu']:.0f} TFLOP/s/GPU (causal); "
                   f"{pred['model_tflops_full_attention']:.0f} counting attention in full")
            err = pred["model_tflops_per_gpu"] / r["tflops"] - 1
        if r["tokens"] and r["tflops"]:
            pub += f", {r['tflops']:.0f} TFLOP/s"
            got += f", {pred['model_tflops_per_gpu']:.0f} TFLOP/s"
        top = max(pred["raise_10pct"].items(), key=lambda kv: abs(kv[1]))
        comm = max(pred["exposed_comm_s"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        out.append(f"| {os.path.basename(r['recipe'])} on {r['cluster']} | {layout} | {pub} | {got} | {err:+.0%} | "
                   f"{pred['step_s']:.2f} | {pred['mfu']:.1%} | {pred['bubble_share']:.1%} | "
                   f"{sum(pred['exposed_comm_s'].values()):.2f} ({comm[0]} {comm[1]:.2f}) | {top[0]} {top[1]:+.1%} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/steptime")
    args = ap.parse_args(argv)
    rows = []
    for recipe, cluster, tokens, tflops, source in RUNS:
        rows.append(dict(recipe=recipe, cluster=cluster, tokens=tokens, tflops=tflops, source=source,
                         predicted=run_one(recipe, cluster)))
        print(f"{recipe}: {rows[-1]['predicted']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
