"""DeepSeek Sparse Attention vs dense MLA on a CPU: one attention sublayer's forward + backward by length.

    python -m tools.bench.dsa_cpu [--lengths 4096,8192,16384,32768] [--topk 512] [--threads 1]
                                  [--out docs/results/dsa-cpu] [--quick]

The sublayer (norm excluded: the MLA module from x to wo's output) in training mode, batch 1, fp32, on
`--threads` torch threads (1 by default: a number that does not depend on how many cores are idle):
  dense   MLAttention, the "torch" backend (aten's fused CPU flash attention), causal
  dsa     DSAttention in the sparse stage: the indexer's selection (top-k over every earlier token), the
          absorbed sparse attention over the k selected keys, the indexer's KL loss and its backward
  select  the indexer's selection alone (no gradient): the S^2 part of DSA, reported as its share
Shape (`SHAPE`): a small DeepSeek-V3-proportioned MLA, dim 256, 16 heads, latents 64/64, head dims 32 + 16
rope, 32 value; indexer 4 heads of 32. Each point is the median of `--iters` runs after one warm-up run,
except where the first run alone takes over `LONG_S` seconds: then that run is the point (a warm-up's
effect is lost in it, and the 32K dense point would otherwise take 20 minutes).

Writes results.json, table.md (the table, the ratio at the longest length, the growth exponents) and
time_vs_length.png to --out. Timings from a shared machine are not comparable: run it with nothing else
running, and say which machine in the results.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_lc.config import load_config
from moe_lc.config.attention_kinds import attention_kind, load
from moe_lc.model.rope import RotaryEmbedding
from moe_lc.ops.dsa_ring import OneRank, RingLayout, select

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["model.attention=mla", "model.dim=256", "model.n_heads=16", "model.mla.q_lora_rank=64",
         "model.mla.kv_lora_rank=64", "model.mla.qk_nope_head_dim=32", "model.mla.qk_rope_head_dim=16",
         "model.mla.v_head_dim=32", "model.attn_backend=torch", "model.dsa.enabled=true",
         "model.dsa.index_n_heads=4", "model.dsa.index_head_dim=32"]


def model_cfg(topk: int, dsa: bool = True):
    return load_config(ROOT / "recipes" / "debug_cpu.toml",
                       SHAPE + [f"model.dsa.index_topk={topk}", f"model.dsa.enabled={str(dsa).lower()}"]).model


def build(cfg, seed: int = 0):
    """The attention module of cfg's kind (MLA, or DSA with [model.dsa] on), fixed random weights."""
    torch.manual_seed(seed)
    module = load(attention_kind(cfg).module)(cfg).train()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.zeros_like(p) if name.endswith("bias")
                    else torch.randn_like(p) * 0.02 * (4 if "indexer" in name else 1))
    return module


LONG_S = 20.0


def median_s(fn, iters: int) -> float:
    t0 = time.perf_counter()
    fn()  # warm-up
    first = time.perf_counter() - t0
    if first > LONG_S:
        return first
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(S: int, topk: int, iters: int) -> dict:
    cfg = model_cfg(topk)
    rope = RotaryEmbedding.from_config(cfg.rope, cfg.mla.qk_rope_head_dim)
    cos, sin = rope(torch.arange(S))
    x = torch.randn(1, S, cfg.dim)
    dense, dsa = build(model_cfg(topk, dsa=False)), build(cfg)

    def step(module):
        def run():
            xi = x.clone().requires_grad_()
            module(xi, cos, sin).sum().backward()
        return run

    def selection():
        with torch.no_grad():
            a = dsa.wa(x)
            q_lat = dsa.q_norm(a[..., :cfg.mla.q_lora_rank])
            q, k, w = dsa.indexer.heads(q_lat, dsa.indexer.project_tokens(x), cos, sin)
            select(OneRank(), RingLayout.one_device(S), q, w, k, dsa.indexer.scale, topk)

    out = {"seq": S, "topk": topk}
    for name, fn in (("dense_s", step(dense)), ("dsa_s", step(dsa)), ("select_s", selection)):
        out[name] = median_s(fn, iters)
        print(f"S={S:6d} {name[:-2]:>6}: {out[name]:8.2f} s", flush=True)
    out["ratio"] = out["dense_s"] / out["dsa_s"]
    out["select_share"] = out["select_s"] / out["dsa_s"]
    return out


def slope(rows: list[dict], key: str) -> float:
    """Least-squares exponent a of time ~ S^a over the rows."""
    xs = [math.log(r["seq"]) for r in rows]
    ys = [math.log(r[key]) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def write(out_dir: Path, rows: list[dict], meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    exps = {k: slope(rows, k) for k in ("dense_s", "dsa_s", "select_s")} if len(rows) > 1 else {}
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "exponents": exps}, indent=1))
    lines = ["| S | dense MLA s | DSA s | dense / DSA | DSA's selection s (share) |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['seq']:,} | {r['dense_s']:.2f} | {r['dsa_s']:.2f} | {r['ratio']:.2f} | "
              f"{r['select_s']:.2f} ({100 * r['select_share']:.0f}%) |" for r in rows]
    if exps:
        lines += ["", f"Growth exponents (time ~ S^a, least squares over the table): dense {exps['dense_s']:.2f}, "
                      f"DSA {exps['dsa_s']:.2f}, DSA's selection {exps['select_s']:.2f}."]
    (out_dir / "table.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    seqs = [r["seq"] for r in rows]
    for key, label in (("dense_s", "dense MLA"), ("dsa_s", f"DSA (k = {rows[0]['topk']})"),
                       ("select_s", "DSA's selection alone")):
        ax.loglog(seqs, [r[key] for r in rows], "o-", label=label, base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("forward + backward seconds")
    ax.set_title(f"one attention sublayer, {meta['threads']} CPU thread(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "time_vs_length.png", dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.dsa_cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "dsa-cpu")
    ap.add_argument("--quick", action="store_true", help="lengths 1024,2048, one run each (a smoke test)")
    args = ap.parse_args(argv)
    try:
        lengths = [int(v) for v in ("1024,2048" if args.quick else args.lengths).split(",")]
    except ValueError:
        print(f"error: --lengths {args.lengths!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    if args.threads < 1 or args.topk < 1 or args.iters < 1 or any(s < 2 for s in lengths):
        print("error: --threads, --topk, --iters must be >= 1 and every --lengths value >= 2", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    iters = 1 if args.quick else args.iters
    rows = [measure(S, args.topk, iters) for S in lengths]
    meta = {"threads": args.threads, "iters": iters, "single_run_above_s": LONG_S, "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "shape": SHAPE}
    write(args.out, rows, meta)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
