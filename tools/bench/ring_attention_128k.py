"""Benchmark: one 128K-token causal attention layer, forward + backward, on one GPU.

    python tools/bench/ring_attention_128k.py [--recipe recipes/moe16b_128k.toml] [--out FILE.json]
    python tools/bench/ring_attention_128k.py --dry-run     # tiny shapes on CPU (checks the script)

Shapes come from the recipe, per GPU: query/kv heads divided by parallel.tp, the recipe's head dim,
batch 1, train.seq_len tokens (131072 for moe16b_128k), parallel.cp ring ranks. Two measurements,
both with the attention backend the model would use (`model.attn_backend`, "auto": flash-attn if
importable, else torch's fused flash kernel):

  full       the whole sequence on this GPU (moe_lc.ops.attention.attention_with_lse);
  ring_rank  the exact compute of cp rank r of the zig-zag ring at seq_len / cp local tokens
             (moe_lc.parallel.cp.ring with a LoopbackRing: the same block calls, LSE merges and fp32
             accumulators, no network), for r = 0 and r = cp - 1 (equal work by construction).

Reported per measurement: median seconds of forward and of forward + backward, achieved TFLOP/s
(causal forward = 2 * S^2 * H * (D_qk + D_v) FLOPs, backward 2.5x forward), and peak GPU memory
above the inputs. `ring_compute_efficiency` = full time / (cp x ring_rank time): what splitting
the work into ring blocks costs before any communication (the zig-zag reference point:
~85% fwd / ~90% fwd+bwd of single-GPU flash-attn on 8 H800, network included).
Numbers are only meaningful on a GPU; the dry run only proves the script runs.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/ring_attention_128k.py` from a checkout: run as tools.bench.ring_attention_128k
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.ring_attention_128k", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_lc.config import load_config
from moe_lc.ops.attention import attention_with_lse, get_backend
from moe_lc.parallel.cp.ring import LoopbackRing, ring_attention_with_lse

ROOT = Path(__file__).resolve().parents[2]


def shapes_from_recipe(path: Path, dry_run: bool) -> dict:
    cfg = load_config(path)
    m, p = cfg.model, cfg.parallel
    s = dict(batch=1, seq_len=cfg.train.seq_len, cp=p.cp, heads=m.n_heads // p.tp,
             kv_heads=max(m.n_kv_heads // p.tp, 1), d_qk=m.head_size, d_v=m.head_size,
             dtype="bfloat16" if cfg.precision.recipe != "fp32" else "float32", backend=m.attn_backend)
    if dry_run:  # tiny, CPU; keep the ring size and dtype, exercise GQA and D_v != D_qk
        s.update(seq_len=32 * p.cp, heads=4, kv_heads=2, d_qk=24, d_v=16)
    return s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run, inputs, device: torch.device, repeats: int) -> dict:
    """run(q, k, v) -> out; times forward and forward+backward; peak memory above the inputs."""
    q, k, v = (x.detach().requires_grad_() for x in inputs)
    dout = torch.randn((*q.shape[:3], v.shape[-1]), device=q.device, dtype=q.dtype)

    def fwd():
        with torch.no_grad():
            run(q, k, v)

    def fwd_bwd():
        out = run(q, k, v)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    result = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        fn()  # warm-up (kernel selection, allocator)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        result[f"{name}_s"] = statistics.median(times)
        result[f"{name}_peak_mem_bytes"] = (torch.cuda.max_memory_allocated(device) - base
                                            if device.type == "cuda" else None)
    return result


def causal_flops(s: dict, seq: int) -> float:
    """Forward FLOPs of causal attention over `seq` tokens (half of the full score matrix)."""
    return 2.0 * s["batch"] * seq * seq * s["heads"] * (s["d_qk"] + s["d_v"]) / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "moe16b_128k.toml"))
    ap.add_argument("--out", default="ring_attention_128k.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--skip-full", action="store_true", help="only the ring rank (if the full layer does not fit)")
    args = ap.parse_args(argv)

    s = shapes_from_recipe(Path(args.recipe), args.dry_run)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU: use --dry-run on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = getattr(torch, s["dtype"])
    backend = get_backend(s["backend"], device)
    scale = s["d_qk"] ** -0.5
    repeats = 2 if args.dry_run else args.repeats

    def make(seq):
        g = torch.Generator(device="cpu").manual_seed(0)
        shape = lambda h, d: (s["batch"], seq, h, d)  # noqa: E731
        return [torch.randn(shape(h, d), generator=g).to(device, dtype)
                for h, d in ((s["heads"], s["d_qk"]), (s["kv_heads"], s["d_qk"]), (s["kv_heads"], s["d_v"]))]

    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "backend": backend.name, "dry_run": args.dry_run, "shapes": s}
    if not args.skip_full:
        full = measure(lambda q, k, v: attention_with_lse(q, k, v, True, scale, backend)[0],
                       make(s["seq_len"]), device, repeats)
        flops = causal_flops(s, s["seq_len"])
        full.update(fwd_tflops=flops / full["fwd_s"] / 1e12, fwd_bwd_tflops=3.5 * flops / full["fwd_bwd_s"] / 1e12)
        report["full"] = full
    local = s["seq_len"] // s["cp"]
    report["ring_rank"] = {}
    for rank in sorted({0, s["cp"] - 1}):
        ring = LoopbackRing(rank, s["cp"])
        res = measure(lambda q, k, v: ring_attention_with_lse(q, k, v, scale, backend=backend, ring=ring)[0],
                      make(local), device, repeats)
        flops = causal_flops(s, s["seq_len"]) / s["cp"]  # each rank's equal share
        res.update(fwd_tflops=flops / res["fwd_s"] / 1e12, fwd_bwd_tflops=3.5 * flops / res["fwd_bwd_s"] / 1e12)
        report["ring_rank"][str(rank)] = res
    if "full" in report:
        slowest = max(report["ring_rank"].values(), key=lambda r: r["fwd_bwd_s"])
        report["ring_compute_efficiency"] = {
            "fwd": report["full"]["fwd_s"] / (s["cp"] * slowest["fwd_s"]),
            "fwd_bwd": report["full"]["fwd_bwd_s"] / (s["cp"] * slowest["fwd_bwd_s"])}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
