"""Benchmark part "grouped_gemm": MoE expert GEMMs, one grouped kernel vs a Python loop over experts.

    python tools/bench/run.py --parts grouped_gemm [--quick] [--dry-run --out DIR]

Shapes: local experts E in 8, 16, 32, 64; (hidden D, expert hidden F) = (2048, 1408) (moe16b_128k) and
(7168, 2048) (DeepSeek-V3); both expert GEMMs, w13 (K = D -> N = 2F) and w2 (K = F -> N = D); mean
tokens per expert 512 and 2048. Per-expert counts are uneven, drawn from a seeded log-normal
(sigma 0.6: max/mean ~ 2-3, like a router early in training), summing to E * mean ("uneven"); the
"uneven_a16" variant rounds every count up to a multiple of 16 (what torchtitan pads to), which
shows whether the kernel prefers aligned group offsets. x: (T, K) rows sorted by expert, bf16.

  grouped  fwd: moe_lc.ops.grouped_gemm.grouped_mm(x, w.transpose(-1, -2), counts), w: (E, N, K) as
           GroupedLinear stores it; fwd + bwd: GroupedLinear(x, counts).backward(dy), i.e. the model's
           grouped fprop, dgrad and wgrad (grouped_mm_wgrad); `kernel` says whether torch._grouped_mm ran
  loop     torch.cat([x_e @ w_e for each expert]) on split sizes known on the host (the best a loop
           can do: no .tolist() sync in the timed region); fwd + bwd through autograd
  dense    one x (T, K) @ w (K, N) of the same FLOPs (what the grouped kernel could at best reach);
           fwd + bwd through autograd (dgrad + wgrad)

FLOPs: forward 2 * T * K * N (T = sum of counts), forward + backward 3x that (dgrad + wgrad).
`speedup` = loop time / grouped time (the issue asks >= 2x for >= 16 experts); `vs_dense` = dense
time / grouped time (target >= 0.8 for >= 16 experts: the grouped kernel at least 80% of a dense GEMM's
throughput); `max_rel_err` compares the two forward outputs once per shape.
"""

from __future__ import annotations

import torch

from moe_lc.ops.grouped_gemm import grouped_mm, use_grouped_mm
from moe_lc.ops.linear import GroupedLinear
from .common import Context, Recorder, tflops, time_fn

PART = "grouped_gemm"
MODELS = {"moe16b": (2048, 1408), "dsv3": (7168, 2048)}
EXPERTS = (8, 16, 32, 64)
MEAN_TOKENS = (512, 2048)
COUNTS = {"uneven": 1, "uneven_a16": 16}
BWD_FACTOR = 2.0
TARGET_VS_DENSE = 0.8

COLUMNS = [("model", "model", None), ("gemm", "gemm", None), ("experts", "E", "{:d}"), ("K", "K", "{:d}"),
           ("N", "N", "{:d}"), ("tokens", "T", "{:d}"), ("counts", "counts", None), ("impl", "impl", None),
           ("fwd_ms", "fwd ms", "{:.3f}"), ("fwd_tflops", "fwd TFLOP/s", "{:.1f}"),
           ("fwd_bwd_ms", "fwd+bwd ms", "{:.3f}"), ("fwd_bwd_tflops", "fwd+bwd TFLOP/s", "{:.1f}"),
           ("speedup_fwd", "speedup fwd", "{:.2f}"), ("speedup_fwd_bwd", "speedup f+b", "{:.2f}"),
           ("vs_dense_fwd", "vs dense fwd", "{:.2f}"), ("vs_dense_fwd_bwd", "vs dense f+b", "{:.2f}"),
           ("kernel", "kernel", None)]


def expert_counts(n_experts: int, mean: int, seed: int, align: int = 1) -> torch.Tensor:
    """(E,) int64 uneven token counts summing to E * mean (before rounding each up to `align`)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(0.6 * torch.randn(n_experts, generator=g, dtype=torch.float64))
    counts = torch.floor(weights / weights.sum() * n_experts * mean).long()
    counts[0] += n_experts * mean - counts.sum()
    return (counts + align - 1) // align * align


def grouped_flops(tokens: int, k: int, n: int) -> float:
    return 2.0 * tokens * k * n


def grid(ctx: Context):
    """(models, experts, mean tokens, count variants) for this mode."""
    if ctx.dry_run:
        return {"tiny": (64, 32)}, (2, 4), (32,), dict(COUNTS)
    if ctx.quick:
        return dict(MODELS), (16, 64), (1024,), {"uneven": 1}
    return dict(MODELS), EXPERTS, MEAN_TOKENS, dict(COUNTS)


def _line(e: dict) -> str:
    return (f"fwd {e['fwd_ms']:.3f} ms {e['fwd_tflops']:.1f} TFLOP/s | fwd+bwd {e['fwd_bwd_ms']:.3f} ms "
            f"{e['fwd_bwd_tflops']:.1f} TFLOP/s" + (f" [{e['kernel']}]" if "kernel" in e else ""))


def run(ctx: Context, rec: Recorder) -> None:
    models, experts, means, count_variants = grid(ctx)
    for model, (dim, hidden) in models.items():
        for gemm, (k, n) in (("w13", (dim, 2 * hidden)), ("w2", (hidden, dim))):
            for n_exp in experts:
                for mean in means:
                    for counts_name, align in count_variants.items():
                        base = {"model": model, "gemm": gemm, "experts": n_exp, "K": k, "N": n,
                                "mean_tokens": mean, "counts": counts_name}
                        _measure_case(ctx, rec, base, expert_counts(n_exp, mean, seed=n_exp * 7 + mean, align=align))


def _measure_case(ctx: Context, rec: Recorder, base: dict, counts_cpu: torch.Tensor) -> None:
    device, k, n, n_exp = ctx.device, base["K"], base["N"], base["experts"]
    sizes = counts_cpu.tolist()
    tokens = sum(sizes)
    base = {**base, "tokens": tokens}
    try:
        g = torch.Generator(device=device).manual_seed(tokens + k)
        x = torch.randn(tokens, k, generator=g, device=device, dtype=torch.bfloat16)
        dy = torch.randn(tokens, n, generator=g, device=device, dtype=torch.bfloat16)
        layer = GroupedLinear(n_exp, k, n, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.normal_(0.0, k ** -0.5, generator=g)
        counts = counts_cpu.to(device)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM allocating operands
        rec.fail({**base, "impl": "inputs"}, exc)
        return
    w_ENK = layer.weight
    w_EKN = w_ENK.detach().transpose(-1, -2)
    xg = x.detach().requires_grad_()
    flops = grouped_flops(tokens, k, n)

    def grouped_fwd():
        with torch.no_grad():
            return grouped_mm(x, w_EKN, counts)

    def grouped_fwd_bwd():
        layer(xg, counts).backward(dy)
        xg.grad = layer.weight.grad = None

    def loop_fwd():
        with torch.no_grad():
            return torch.cat([xe @ we for xe, we in zip(x.split(sizes), w_EKN)])

    def loop_fwd_bwd():
        torch.cat([xe @ we for xe, we in zip(xg.split(sizes), w_ENK.transpose(-1, -2))]).backward(dy)
        xg.grad = layer.weight.grad = None

    w_dense = torch.randn(k, n, generator=g, device=device, dtype=torch.bfloat16).mul_(k ** -0.5).requires_grad_()

    def dense_fwd():
        with torch.no_grad():
            return x @ w_dense

    def dense_fwd_bwd():
        (xg @ w_dense).backward(dy)
        xg.grad = w_dense.grad = None

    kernel = "torch._grouped_mm" if use_grouped_mm(x, w_EKN) else "loop fallback"
    results = {}
    for impl, fwd, fwd_bwd in (("grouped", grouped_fwd, grouped_fwd_bwd), ("loop", loop_fwd, loop_fwd_bwd),
                               ("dense", dense_fwd, dense_fwd_bwd)):
        def measure(fwd=fwd, fwd_bwd=fwd_bwd, impl=impl):
            t_f = time_fn(fwd, device, ctx.timing)
            t_fb = time_fn(fwd_bwd, device, ctx.timing)
            out = {"fwd_ms": t_f["s"] * 1e3, "fwd_tflops": tflops(flops, t_f["s"]),
                   "fwd_bwd_ms": t_fb["s"] * 1e3, "fwd_bwd_tflops": tflops((1 + BWD_FACTOR) * flops, t_fb["s"]),
                   "iters": t_fb["n"], "flops_fwd": flops}
            if impl == "grouped":
                out["kernel"] = kernel
                ref, got = loop_fwd().float(), grouped_fwd().float()
                out["max_rel_err"] = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            return out

        results[impl] = rec.measure({**base, "impl": impl}, measure, _line)
    _compare(rec, results, n_exp)
    del x, dy, xg, layer, w_ENK, w_EKN, w_dense


def _compare(rec: Recorder, results: dict, n_exp: int) -> None:
    """The grouped kernel's entry gets its ratios to the dense GEMM and to the per-expert loop."""
    grouped, loop, dense = results["grouped"], results["loop"], results["dense"]
    if grouped["status"] == "ok" and dense["status"] == "ok":
        for key in ("fwd", "fwd_bwd"):
            grouped[f"vs_dense_{key}"] = dense[f"{key}_ms"] / grouped[f"{key}_ms"]
        if n_exp >= 16:
            grouped["meets_dense_target"] = min(grouped["vs_dense_fwd"], grouped["vs_dense_fwd_bwd"]) >= TARGET_VS_DENSE
    if grouped["status"] == "ok" and loop["status"] == "ok":
        for key in ("fwd", "fwd_bwd"):
            grouped[f"speedup_{key}"] = loop[f"{key}_ms"] / grouped[f"{key}_ms"]
        if n_exp >= 16:
            grouped["meets_2x"] = min(grouped["speedup_fwd"], grouped["speedup_fwd_bwd"]) >= 2.0
        rec.note(f"  grouped vs loop: fwd x{grouped['speedup_fwd']:.2f}, fwd+bwd x{grouped['speedup_fwd_bwd']:.2f}"
                 + (f" ({'meets' if grouped['meets_2x'] else 'MISSES'} 2x)" if "meets_2x" in grouped else ""))


def extra_markdown(entries: list[dict]) -> list[str]:
    lines = []
    dense = [e for e in entries if "meets_dense_target" in e]
    if dense:
        missed = [e for e in dense if not e["meets_dense_target"]]
        lines.append(f"Grouped >= {TARGET_VS_DENSE}x the time-throughput of one dense GEMM of the same FLOPs for >= 16 "
                     f"experts (fwd and fwd+bwd): {len(dense) - len(missed)}/{len(dense)} cases.")
        lines += [f"- misses: {e['model']} {e['gemm']} E={e['experts']} T={e['tokens']} {e['counts']}: "
                  f"fwd {e['vs_dense_fwd']:.2f}, fwd+bwd {e['vs_dense_fwd_bwd']:.2f}" for e in missed[:20]]
    rows = [e for e in entries if "meets_2x" in e]
    if rows:
        missed = [e for e in rows if not e["meets_2x"]]
        lines.append(f"Grouped >= 2x loop for >= 16 experts (fwd and fwd+bwd): {len(rows) - len(missed)}/{len(rows)} cases.")
        lines += [f"- misses: {e['model']} {e['gemm']} E={e['experts']} T={e['tokens']} {e['counts']}: "
                  f"fwd x{e['speedup_fwd']:.2f}, fwd+bwd x{e['speedup_fwd_bwd']:.2f}" for e in missed[:20]]
    return lines
