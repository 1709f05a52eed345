"""Achieved kernel rates by shape, fitted to a GPU's benchmark tables: what one kernel of given FLOPs and bytes costs.

    python -m tools.step_time.kernel_rates [--bench FILE ...] [--out tools/step_time/kernel_rates_h100.json]

Per kernel kind, a roofline with a per-launch cost, smoothed where the two bounds meet:

    seconds = launch_s + ((flops / rate)^p + (bytes / bandwidth)^p)^(1/p)

`rate` (FLOP/s) and `bandwidth` (B/s) are what large kernels of the kind reach, `launch_s` what every launch
costs on top (a kernel's ramp and tail, the cuBLAS / cuDNN set-up between kernels), and p how sharply the two
bounds meet (p -> infinity is max(), p = 1 their sum). A small GEMM pays launch_s and its operands' bytes on
fewer FLOPs, so it is slower per FLOP than a large one. Fitted kinds and their rows (tools/bench/run.py's
results JSON; every row with status "ok"):

    gemm                 gemm part, variant bf16 (torch.matmul): flops 2 M K N, bytes 2 (M K + K N + M N)
    gemm_fp8_tensorwise  gemm part, raw_tensorwise (torch._scaled_mm, one scale per tensor): operands 1 byte
    gemm_fp8_blockwise   gemm part, raw_blockwise (F.scaled_mm, 1x128 / 128x128 scales, DeepSeek's recipe)
    grouped_gemm         grouped_gemm part, impl grouped (torch._grouped_mm): the forward, and its backward's
                         two GEMMs of the same FLOPs ((fwd+bwd - fwd) / 2 each); bytes 2 (T K + E K N + T N)
    attention_fwd/_bwd   attention part, the fastest implementation per shape (cuDNN on the H100): forward, and
                         backward = fwd+bwd - fwd at 2.5x the forward's FLOPs
    attention_fa2_fwd/_bwd  the same part's FlashAttention-2 rows (torch's own flash kernel, impl raw:aten_flash):
                         what a stack without cuDNN's or FA3's Hopper kernels reaches (tools/step_time/attention_impls.py)
    memory               gemm part, fp8_tensorwise: this repo's FP8 Linear quantizes both operands in unfused aten
                         ops (abs, amax, scale, divide, clamp, cast) before the kernel; the bench's `quant_ms` (the
                         wrapper's time less the raw kernel's) against those ops traced on the meta device
                         (tools/step_time/kernel_trace.py: their bytes and launches) gives the memory-bound
                         kernels' bandwidth and launch cost (p = 1: a launch, then the bytes). The blockwise
                         wrapper's rows are left out: its 128-wide scale blocks are strided reductions and layout
                         copies, several times slower per byte than the contiguous elementwise ops the trainer runs

`fit_kernel_rates` minimizes the squared log error (soft-L1 beyond 10%, so one noisy row does not pull a kind)
with scipy; without quantization rows the memory-bound kind falls back to MEMORY_EFFICIENCY below.
The fitted constants are committed as data (kernel_rates_h100.json, with the command that made them); a
device run that adds rows refits them with the command above, or per prediction with tools/plan.py --bench.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/step_time/kernel_rates.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.step_time.kernel_rates", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import math
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMMITTED = HERE / "kernel_rates_h100.json"
BENCH_FILES = ("tools/bench/results/nvidia-h100-80gb-hbm3-2026-11-27.json", "docs/results/gpu-h100/run2/bench_call1.json")
COMMAND = "python -m tools.step_time.kernel_rates --bench " + " --bench ".join(BENCH_FILES)
# The memory-bound kind, not in the bench tables: torch's fused AdamW kernel on the H100 moved 28 bytes per
# parameter (master, gradient and both moments read, three written) for 1.68B parameters in 18.2 ms
# (docs/results/gpu-h100/run2/README.md: the kernel's own time in the profile) = 2.58 TB/s = 0.77 of the
# 3.35 TB/s HBM; its launch cost is the fitted GEMMs' (the smallest of the fitted kinds').
MEMORY_EFFICIENCY = 1.68e9 * 28 / 18.2e-3 / 3.35e12
# a launch costs between 1 and 20 us (the bound keeps the fit from spending a shape trend on a huge launch cost)
LAUNCH_S = (1e-6, 2e-5)
GEMM_VARIANTS = {"bf16": "gemm", "raw_tensorwise": "gemm_fp8_tensorwise", "raw_blockwise": "gemm_fp8_blockwise"}


def kernel_seconds(flops: float, nbytes: float, rate: dict) -> float:
    """One kernel's seconds under a kind's fitted `rate` {"flops_per_s", "bytes_per_s", "launch_s", "p"}."""
    p = rate["p"]
    compute, memory = flops / rate["flops_per_s"], nbytes / rate["bytes_per_s"]
    if not compute or not memory:
        return rate["launch_s"] + compute + memory
    big = max(compute, memory)  # (scaled: p up to 8 on tiny ratios stays finite)
    return rate["launch_s"] + big * ((compute / big) ** p + (memory / big) ** p) ** (1 / p)


def bench_rows(data: dict) -> dict[str, list[tuple[float, float, float]]]:
    """{kind: [(flops, bytes, seconds)]} of one bench results JSON (module docstring)."""
    rows: dict[str, list] = {}
    parts = data.get("parts", {})
    for key, body in parts.items():
        part = key.split("[")[0]
        if part != key:  # a part run with --set overrides (compile, another optimizer): not a kernel table
            continue
        entries = [e for e in body.get("entries", []) if e.get("status") == "ok"]
        if part == "gemm":
            rows.setdefault("memory", []).extend(quantization_rows(entries))
            for e in entries:
                kind = GEMM_VARIANTS.get(e.get("variant"))
                if kind and e.get("ms"):
                    size = 2 if kind == "gemm" else 1
                    m, k, n = e["M"], e["K"], e["N"]
                    rows.setdefault(kind, []).append((2.0 * m * k * n, size * (m * k + k * n) + 2 * m * n, e["ms"] / 1e3))
        elif part == "grouped_gemm":
            for e in (e for e in entries if e.get("impl") == "grouped"):
                t, k, n, experts = e["tokens"], e["K"], e["N"], e["experts"]
                nbytes = 2 * (t * k + experts * k * n + t * n)
                rows.setdefault("grouped_gemm", []).append((e["flops_fwd"], nbytes, e["fwd_ms"] / 1e3))
                rows["grouped_gemm"].append((e["flops_fwd"], nbytes, (e["fwd_bwd_ms"] - e["fwd_ms"]) / 2e3))
        elif part == "attention":
            _attention_rows(entries, rows)
    return rows


def quantization_rows(entries: list[dict]) -> list[tuple[float, float, float]]:
    """(launches, bytes, seconds) of the FP8 wrappers' quantization per gemm row that has `quant_ms`: the ops
    of moe_lc.ops.fp8's fprop on (M, K) x (N, K) bf16 operands, traced on the meta device as an H100's."""
    rows = []
    for e in entries:
        scaling = {"fp8_tensorwise": "tensorwise"}.get(e.get("variant"))
        if scaling and e.get("quant_ms") and e["quant_ms"] > 0:
            launches, nbytes = _quantization_ops(e["M"], e["K"], e["N"], scaling)
            rows.append((launches, nbytes, e["quant_ms"] / 1e3))
    return rows


_QUANT: dict[tuple, tuple[int, float]] = {}


def _quantization_ops(m: int, k: int, n: int, scaling: str) -> tuple[int, float]:
    """(memory-bound kernels, their bytes) of one FP8 fprop's quantization (every kernel but the GEMM)."""
    key = (m, k, n, scaling)
    if key not in _QUANT:
        import torch

        from moe_lc.ops import fp8
        from moe_lc.ops.device import GpuSpec, meta_as_gpu
        from .kernel_trace import KernelRecorder, TracedKernels

        into = TracedKernels()
        with meta_as_gpu(GpuSpec()):  # (no host read in the quantization: plain meta tensors suffice)
            x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
            w = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
            with KernelRecorder(into):
                fp8.fp8_linear_scaled_mm(x, w, scaling, out_dtype=torch.bfloat16)
        ops = [(kern, c) for kern, c in into.of("embed", "F").items() if kern.kind == "memory"]
        _QUANT[key] = (sum(c for _, c in ops), float(sum(kern.bytes * c for kern, c in ops)))
    return _QUANT[key]


def fit_memory(rows: list[tuple[float, float, float]], hbm_bytes_per_s: float) -> dict:
    """The memory-bound kind from (launches, bytes, seconds) rows: seconds = launches x launch_s + bytes /
    bandwidth, least squares in log time (as `fit_kind`)."""
    from scipy.optimize import least_squares

    n, b, t = (np.array(c, dtype=float) for c in zip(*rows))

    def residual(x):
        return np.log((n * math.exp(x[0]) + b / math.exp(x[1])) / t)

    lower = [math.log(LAUNCH_S[0]), math.log(0.1 * hbm_bytes_per_s)]
    upper = [math.log(LAUNCH_S[1]), math.log(hbm_bytes_per_s)]
    fit = least_squares(residual, [math.log(5e-6), math.log(0.5 * hbm_bytes_per_s)], bounds=(lower, upper),
                        loss="soft_l1", f_scale=0.1)
    return {"flops_per_s": float("inf"), "bytes_per_s": math.exp(fit.x[1]), "launch_s": math.exp(fit.x[0]), "p": 1.0,
            "rows": len(rows), "rms_log_error": float(np.sqrt(np.mean(residual(fit.x) ** 2)))}


def _attention_rows(entries: list[dict], rows: dict) -> None:
    """The fastest implementation per shape (reference math excluded): "attention_fwd" / "attention_bwd" rows; and
    torch's FlashAttention-2 kernel (impl "raw:aten_flash") per shape: "attention_fa2_fwd" / "attention_fa2_bwd"."""
    best: dict[tuple, dict] = {}
    for e in entries:
        if e.get("impl", "").endswith("reference") or not e.get("fwd_bwd_ms"):
            continue
        shape = (e["heads"], e["seq"], e["batch"])
        if shape not in best or e["fwd_bwd_ms"] < best[shape]["fwd_bwd_ms"]:
            best[shape] = e
    for e in best.values():
        _attention_row(e, "attention", rows)
    for e in entries:
        if e.get("impl") == "raw:aten_flash" and e.get("fwd_bwd_ms"):
            _attention_row(e, "attention_fa2", rows)


def _attention_row(e: dict, kind: str, rows: dict) -> None:
    """One bench entry as a forward row (its FLOPs, Q O K V bytes) and a backward row (2.5x the FLOPs, twice the
    bytes) of `kind`_fwd / `kind`_bwd."""
    b, s = e["batch"], e["seq"]
    qo = b * s * e["q_heads"] * (e["head_dim"] + e["head_dim_v"]) * 2
    kv = b * s * e["kv_heads"] * (e["head_dim"] + e["head_dim_v"]) * 2
    rows.setdefault(f"{kind}_fwd", []).append((e["flops_fwd"], qo + kv, e["fwd_ms"] / 1e3))
    rows.setdefault(f"{kind}_bwd", []).append((2.5 * e["flops_fwd"], 2 * (qo + kv), (e["fwd_bwd_ms"] - e["fwd_ms"]) / 1e3))


def fit_kind(rows: list[tuple[float, float, float]], hbm_bytes_per_s: float) -> dict:
    """{"flops_per_s", "bytes_per_s", "launch_s", "p", "rows", "rms_log_error"} of one kind's rows. The
    bandwidth is bounded by the HBM's; where no row is near the memory bound it stays at its start, 0.8 of it."""
    from scipy.optimize import least_squares

    f, b, t = (np.array(c, dtype=float) for c in zip(*rows))
    start = np.array([math.log(float(np.max(f / t))), math.log(0.8 * hbm_bytes_per_s), math.log(5e-6), math.log(2.0)])

    def predicted(x):
        rate = {"flops_per_s": math.exp(x[0]), "bytes_per_s": math.exp(x[1]), "launch_s": math.exp(x[2]),
                "p": math.exp(x[3])}
        return np.array([kernel_seconds(fi, bi, rate) for fi, bi in zip(f, b)]), rate

    def residual(x):
        return np.log(predicted(x)[0] / t)

    lower = [math.log(float(np.median(f / t)) * 0.5), math.log(0.2 * hbm_bytes_per_s), math.log(LAUNCH_S[0]), 0.0]
    upper = [math.log(float(np.max(f / t)) * 3), math.log(hbm_bytes_per_s), math.log(LAUNCH_S[1]), math.log(8.0)]
    x0 = np.clip(start, np.array(lower) + 1e-9, np.array(upper) - 1e-9)
    fit = least_squares(residual, x0, bounds=(lower, upper), loss="soft_l1", f_scale=0.1)
    _, rate = predicted(fit.x)
    rms = float(np.sqrt(np.mean(residual(fit.x) ** 2)))
    return {**{k: float(v) for k, v in rate.items()}, "rows": len(rows), "rms_log_error": rms}


def fit_kernel_rates(results_json, hbm_gbps: float | None = None) -> dict:
    """Kernel rates fitted to one or more bench results files (a path, a list of paths, or loaded dicts):
    {"meta": {device, peak_tflops, hbm_gbps, sources}, "kinds": {kind: fitted constants}} (module docstring)."""
    sources = results_json if isinstance(results_json, (list, tuple)) else [results_json]
    rows: dict[str, list] = {}
    meta = {}
    names = []
    for src in sources:
        data = src if isinstance(src, dict) else json.loads(Path(src).read_text())
        names.append(src if isinstance(src, str) else str(src) if not isinstance(src, dict) else "(dict)")
        meta = meta or data.get("meta", {})
        for kind, r in bench_rows(data).items():
            rows.setdefault(kind, []).extend(r)
    if not meta.get("peak_tflops"):
        raise ValueError(f"{names}: the bench's meta has no peak_tflops (a CPU or dry run): no GPU rates to fit")
    hbm = (hbm_gbps or meta.get("hbm_gbps") or 3350.0) * 1e9
    memory = rows.pop("memory", [])
    kinds = {kind: fit_kind(r, hbm) for kind, r in sorted(rows.items()) if len(r) >= 4}
    if len(memory) >= 4:
        kinds["memory"] = fit_memory(memory, hbm)
    else:
        kinds["memory"] = {"flops_per_s": float("inf"), "bytes_per_s": MEMORY_EFFICIENCY * hbm, "p": 1.0,
                           "launch_s": min((k["launch_s"] for k in kinds.values()), default=5e-6), "rows": 0,
                           "rms_log_error": None}
    return {"meta": {"device": meta.get("device"), "peak_tflops": meta["peak_tflops"], "hbm_gbps": hbm / 1e9,
                     "sources": names}, "kinds": kinds}


def committed() -> dict:
    """The committed fit (kernel_rates_h100.json)."""
    return json.loads(COMMITTED.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", action="append", help=f"bench results JSON (repeatable; default: {', '.join(BENCH_FILES)})")
    ap.add_argument("--out", default=str(COMMITTED.relative_to(ROOT)))
    args = ap.parse_args(argv)
    fitted = fit_kernel_rates([str(ROOT / p) if not Path(p).is_absolute() else p for p in (args.bench or BENCH_FILES)])
    fitted["meta"]["sources"] = args.bench or list(BENCH_FILES)
    fitted["meta"]["command"] = COMMAND if not args.bench else "python -m tools.step_time.kernel_rates " + " ".join(
        f"--bench {b}" for b in args.bench)
    Path(args.out).write_text(json.dumps(fitted, indent=1) + "\n")
    for kind, k in fitted["kinds"].items():
        err = f"{k['rms_log_error']:.3f}" if k["rms_log_error"] is not None else "-"
        print(f"{kind:22s} {k['flops_per_s'] / 1e12:8.1f} TFLOP/s {k['bytes_per_s'] / 1e9:7.0f} GB/s "
              f"launch {k['launch_s'] * 1e6:5.1f} us p {k['p']:.2f} ({k['rows']} rows, rms log error {err})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
