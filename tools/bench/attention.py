"""Benchmark part "attention": causal attention, head dims 128 and MLA's 192/128, forward and forward + backward vs length.

    python tools/bench/run.py --parts attention [--quick] [--dry-run --out DIR]

Grid: S in 4K, 8K, 16K, 32K, 64K, 128K with batch B = max(1, 32K / S) (a ~32K-token budget per
call), heads 16 q / 16 kv ("mha") and 16 q / 4 kv ("gqa") at D = 128, and MLA's expanded heads 16 / 16 at
D_qk = 192, D_v = 128 ("mla"; the raw kernels get v and dout zero-padded to 192 outside their timing,
the wrapper pads inside it), bf16, BSHD inputs as the model passes them. --quick: S = 4K, 32K, 128K.
Implementations, each timed forward (no grad) and forward + backward (autograd, `out.backward(dout)`):

  wrapper:<backend>  moe_lc.ops.attention.attention_with_lse with every backend of
                     available_backends(device) ("reference" only up to 8K and at B = 1: it
                     materializes S x S scores in fp32)
  raw:aten_flash     the kernel TorchBackend calls, called directly on the same (B, H, S, D)
                     transposed views: CUDA aten._scaled_dot_product_flash_attention (+ _backward),
                     CPU aten._scaled_dot_product_flash_attention_for_cpu (+ _backward); fwd + bwd =
                     the two calls back to back, no autograd (what the wrapper does, minus its glue)
  raw:sdpa_flash / raw:sdpa_cudnn (CUDA) / raw:sdpa (CPU)
                     torch.nn.functional.scaled_dot_product_attention forced onto one SDPA kernel
                     (enable_gqa=True for GQA): what torch's other fused kernels would give
                     (raw:sdpa_cudnn is wrapper:cudnn's raw kernel; for "mla" it gets the padded v, the
                     wrapper the native D_v = 128)
  raw:flash_attn     flash_attn.flash_attn_func, when the package is importable
  raw:flash_attn4    flash_attn.cute.flash_attn_func (PyPI flash-attn-4), when importable: the kernel
                     wrapper:flash_attn4 calls, through its own autograd Function

FLOPs (causal: half of the S x S score matrix, half of the dense 4*s^2*d*h, as FlashAttention-2 counts
it, arXiv 2307.08691):
    forward          = 4 * B * H * S^2 * D / 2 = 2 * B * H * S^2 * D     (D_qk = D_v = D)
                       in general B * H * S^2 * (D_qk + D_v)
    backward         = 2.5 x forward;  forward + backward = 3.5 x forward
H is the number of *query* heads (GQA shares k/v but does the same matmul work).
`overhead_*` = wrapper time / raw time of the kernel it calls; `speed_vs_raw` = raw / wrapper time
(fwd + bwd), the target being >= 0.95 (the wrapper at least 95% as fast as the kernel it calls).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from moe_lc.ops.attention import attention_with_lse, available_backends, get_backend
from .common import Context, Recorder, memory_mark, peak_bytes_since, tflops, time_fn

PART = "attention"
TOKEN_BUDGET = 32768
TARGET_SPEED_VS_RAW = 0.95
SEQ_LENS = (4096, 8192, 16384, 32768, 65536, 131072)
HEADS = {"mha": (16, 16, 128, 128), "gqa": (16, 4, 128, 128), "mla": (16, 16, 192, 128)}  # (H, H_kv, D_qk, D_v)
REFERENCE_MAX_SEQ = 8192
BWD_FACTOR = 2.5
aten = torch.ops.aten

COLUMNS = [("heads", "heads", None), ("seq", "S", "{:d}"), ("batch", "B", "{:d}"), ("impl", "impl", None),
           ("fwd_ms", "fwd ms", "{:.3f}"), ("fwd_tflops", "fwd TFLOP/s", "{:.1f}"),
           ("fwd_bwd_ms", "fwd+bwd ms", "{:.3f}"), ("fwd_bwd_tflops", "fwd+bwd TFLOP/s", "{:.1f}"),
           ("overhead_fwd", "wrapper/raw fwd", "{:.3f}"), ("overhead_fwd_bwd", "wrapper/raw f+b", "{:.3f}"),
           ("speed_vs_raw", "raw/wrapper f+b", "{:.3f}"),
           ("peak_mem_gib", "peak GiB", "{:.2f}")]


def causal_attention_flops(batch: int, heads: int, seq: int, d_qk: int, d_v: int | None = None) -> float:
    """Forward FLOPs of causal attention: QK^T (2*S*S*D_qk) and PV (2*S*S*D_v) per head, halved."""
    d_v = d_qk if d_v is None else d_v
    return 2.0 * batch * heads * seq * seq * (d_qk + d_v) / 2


def grid(ctx: Context) -> tuple[list[int], dict, int]:
    """(sequence lengths, head configs {name: (H, H_kv, D_qk, D_v)}, token budget) for this mode."""
    if ctx.dry_run:
        return [64, 128, 256], {"mha": (4, 4, 32, 32), "gqa": (4, 2, 32, 32), "mla": (4, 4, 48, 32)}, 256
    if ctx.quick:
        return [4096, 32768, 131072], dict(HEADS), TOKEN_BUDGET
    return list(SEQ_LENS), dict(HEADS), TOKEN_BUDGET


# ------------------------------------------------------------------------------ implementations
# Each maker returns run(q, k, v, dout, backward: bool) on BSHD tensors.


def _wrapper(backend_name: str, device, scale: float):
    backend = get_backend(backend_name, device)

    def run(q, k, v, dout, backward):
        out, _ = attention_with_lse(q, k, v, True, scale, backend)
        if backward:
            out.backward(dout)
    return run


def _raw_aten_flash(device, scale: float):
    """The exact aten kernel TorchBackend runs, on the transposed (B, H, S, D) views."""
    def run(q, k, v, dout, backward):
        q_, k_, v_ = (x.detach().transpose(1, 2) for x in (q, k, v))
        if device.type == "cuda":
            out, lse, *_ = aten._scaled_dot_product_flash_attention(q_, k_, v_, 0.0, True, False, scale=scale)
            if backward:
                no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
                aten._scaled_dot_product_flash_attention_backward(
                    dout.transpose(1, 2), q_, k_, v_, out, lse, None, None, q.shape[1], k.shape[1],
                    0.0, True, no_rng, no_rng, scale=scale)
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q_, k_, v_, 0.0, True, attn_mask=None,
                                                                        scale=scale)
            if backward:
                aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    dout.transpose(1, 2), q_, k_, v_, out, lse, 0.0, True, attn_mask=None, scale=scale)
    return run


def _raw_sdpa(kernel: str | None, scale: float):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

    def run(q, k, v, dout, backward):
        gqa = q.shape[2] != k.shape[2]
        q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))
        ctx = sdpa_kernel([backends[kernel]]) if kernel else nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=gqa)
        if backward:  # the kernel was chosen in forward; its backward node is fixed
            out.backward(dout.transpose(1, 2))
    return run


def _raw_flash_attn(scale: float):
    from flash_attn import flash_attn_func

    def run(q, k, v, dout, backward):
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
        if backward:
            out.backward(dout)
    return run


def _raw_flash_attn4(scale: float):
    from flash_attn.cute import flash_attn_func

    def run(q, k, v, dout, backward):
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        if backward:
            out.backward(dout)
    return run


def implementations(device, scale: float) -> list[tuple[str, object, str | None]]:
    """[(impl name, run, name of the wrapper it is the raw kernel of or None)]."""
    names = available_backends(device)
    impls = [(f"wrapper:{n}", _wrapper(n, device, scale), None) for n in names]
    if "torch" in names:
        impls.append(("raw:aten_flash", _raw_aten_flash(device, scale), "wrapper:torch"))
    if device.type == "cuda":
        impls += [(f"raw:sdpa_{kernel}", _raw_sdpa(kernel, scale), f"wrapper:{kernel}" if kernel in names else None)
                  for kernel in ("flash", "cudnn")]
    else:
        impls.append(("raw:sdpa", _raw_sdpa(None, scale), None))
    if "flash_attn" in names:
        impls.append(("raw:flash_attn", _raw_flash_attn(scale), "wrapper:flash_attn"))
    if "flash_attn4" in names:
        impls.append(("raw:flash_attn4", _raw_flash_attn4(scale), "wrapper:flash_attn4"))
    return impls


# ------------------------------------------------------------------------------ measuring


def _inputs(batch, seq, heads, kv_heads, d_qk, d_v, device, dtype):
    g = torch.Generator(device=device).manual_seed(seq + heads + kv_heads)
    shapes = [(batch, seq, heads, d_qk), (batch, seq, kv_heads, d_qk), (batch, seq, kv_heads, d_v),
              (batch, seq, heads, d_v)]
    return [torch.randn(s, generator=g, device=device, dtype=dtype) for s in shapes]


def measure_impl(run, inputs, ctx: Context, flops_fwd: float) -> dict:
    q, k, v, dout = inputs
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def fwd():
        with torch.no_grad():
            run(q, k, v, dout, False)

    def fwd_bwd():
        run(qg, kg, vg, dout, True)
        qg.grad = kg.grad = vg.grad = None

    mark = memory_mark(ctx.device)
    t_fwd = time_fn(fwd, ctx.device, ctx.timing)
    t_all = time_fn(fwd_bwd, ctx.device, ctx.timing)
    peak = peak_bytes_since(ctx.device, mark)
    return {"fwd_ms": t_fwd["s"] * 1e3, "fwd_tflops": tflops(flops_fwd, t_fwd["s"]),
            "fwd_bwd_ms": t_all["s"] * 1e3, "fwd_bwd_tflops": tflops((1 + BWD_FACTOR) * flops_fwd, t_all["s"]),
            "iters": t_all["n"], "peak_mem_gib": peak / 2**30 if peak is not None else None,
            "fwd_pct_peak": _pct(ctx, tflops(flops_fwd, t_fwd["s"]))}


def _pct(ctx: Context, value: float) -> float | None:
    return 100 * value / ctx.peak["bf16"] if ctx.peak else None


def _line(e: dict) -> str:
    return (f"fwd {e['fwd_ms']:.3f} ms {e['fwd_tflops']:.1f} TFLOP/s | fwd+bwd {e['fwd_bwd_ms']:.3f} ms "
            f"{e['fwd_bwd_tflops']:.1f} TFLOP/s")


def run(ctx: Context, rec: Recorder) -> None:
    seqs, heads, budget = grid(ctx)
    dtype = torch.bfloat16
    for head_name, (h, h_kv, d_qk, d_v) in heads.items():
        scale = d_qk ** -0.5
        for seq in seqs:
            batch = max(1, budget // seq)
            try:
                inputs = _inputs(batch, seq, h, h_kv, d_qk, d_v, ctx.device, dtype)
                # the raw kernels take one head dim: MLA's v and dout zero-padded to D_qk outside the timing,
                # as the wrapper pads them inside it (that copy is part of the wrapper's cost)
                padded = inputs[:2] + [F.pad(x, (0, d_qk - d_v)) for x in inputs[2:]] if d_v != d_qk else inputs
            except Exception as exc:  # noqa: BLE001 - e.g. OOM allocating the inputs
                rec.fail({"heads": head_name, "seq": seq, "batch": batch, "impl": "inputs"}, exc)
                continue
            use, done = None, {}
            for impl, fn, wrapper_of in implementations(ctx.device, scale):
                params = {"heads": head_name, "seq": seq, "batch": batch, "impl": impl}
                if impl == "wrapper:reference":
                    if seq > REFERENCE_MAX_SEQ:
                        rec.skip(params, f"reference materializes S x S scores; only run up to {REFERENCE_MAX_SEQ}")
                        continue
                    params["batch"] = 1
                flops = causal_attention_flops(params["batch"], h, seq, d_qk, d_v)
                use = inputs if impl.startswith("wrapper:") else padded
                use = [x[:1] for x in use] if impl == "wrapper:reference" else use
                entry = rec.measure(params, lambda: measure_impl(fn, use, ctx, flops), _line)
                entry.update(kv_heads=h_kv, q_heads=h, head_dim=d_qk, head_dim_v=d_v, flops_fwd=flops)
                done[impl] = entry
                if wrapper_of:
                    _overhead(rec, done.get(wrapper_of), entry)
            del inputs, padded, use  # free before the next shape allocates


def _overhead(rec: Recorder, wrapper: dict | None, raw: dict) -> None:
    """Write wrapper/raw time ratios onto the wrapper's entry (target: raw/wrapper >= 0.95 fwd+bwd)."""
    if not wrapper or wrapper.get("status") != "ok" or raw.get("status") != "ok":
        return
    for key in ("fwd", "fwd_bwd"):
        wrapper[f"overhead_{key}"] = wrapper[f"{key}_ms"] / raw[f"{key}_ms"]
    wrapper["raw_impl"] = raw["impl"]
    wrapper["speed_vs_raw"] = raw["fwd_bwd_ms"] / wrapper["fwd_bwd_ms"]
    wrapper["meets_target"] = wrapper["speed_vs_raw"] >= TARGET_SPEED_VS_RAW
    rec.note(f"  {wrapper['impl']} / {raw['impl']}: fwd x{wrapper['overhead_fwd']:.3f}, "
             f"fwd+bwd x{wrapper['overhead_fwd_bwd']:.3f} (speed {wrapper['speed_vs_raw']:.3f} of raw: "
             f"{'meets' if wrapper['meets_target'] else 'MISSES'} {TARGET_SPEED_VS_RAW})")


def extra_markdown(entries: list[dict]) -> list[str]:
    rows = [e for e in entries if "speed_vs_raw" in e]
    if not rows:
        return []
    lines = [f"Wrapper speed vs the raw kernel it calls (fwd+bwd, target >= {TARGET_SPEED_VS_RAW}):"]
    for impl in sorted({e["impl"] for e in rows}):
        mine = [e for e in rows if e["impl"] == impl]
        worst = min(mine, key=lambda e: e["speed_vs_raw"])
        lines.append(f"- {impl}: {sum(e['meets_target'] for e in mine)}/{len(mine)} shapes meet it; worst "
                     f"{worst['heads']} S={worst['seq']}: {worst['speed_vs_raw']:.3f} (fwd x{worst['overhead_fwd']:.3f} "
                     f"slower)")
    return lines
