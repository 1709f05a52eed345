"""Benchmark part "model_step": one full training step of a ~1.7B-parameter MoE on one GPU.

    python tools/bench/run.py --parts model_step [--profile] [--set model.n_layers=4 ...] [--dry-run --out DIR]

Model: recipes/moe16b_128k.toml cut to 3 blocks (1 dense + 2 MoE with 64 routed experts, 2 shared,
top-6, YaRN), one process (pp = dp = cp = tp = ep = 1), bf16, selective recompute (norm, swiglu),
micro-batch 1, at S = 4K, 32K and 128K tokens; `--set` adds overrides (e.g. model.n_layers=4 for
~2.3B). Param counts (moe_lc.model.counting.param_counts) are printed and stored.

The step is the trainer's own: a `moe_lc.train.Trainer` built from that config (build_model ->
parallelize (the layer plan: recompute seams at world 1) -> ZeroOptimizer, the same code a run executes),
timed over `Trainer.train_step()` (forward, backward, ZeroOptimizer step (AdamW), router bias update, and the
host syncs the trainer does). Only its data loader is replaced, by fixed random tokens, so that
sample generation is not timed. `optimizer_ms` times ZeroOptimizer.step alone inside those steps.

FLOPs per step (B = 1 sequence of S tokens, L blocks, H query heads, Dqk/Dv head dims):
  model    = counting.train_flops_per_token(cfg, S) * B * S        (what the trainer's MFU uses)
           = 6 * N_act * B * S  +  L * 6 * B * H * S^2/2 * (Dqk + Dv)
           N_act = activated parameters without norms (embedding excluded, routed experts counted
           top-k / E; DeepSeek's convention); backward = 2x forward for matmuls and attention alike.
  hardware = model + recomputation: attention backward at 2.5x forward (flash kernels recompute
           the scores: FlashAttention-2, arXiv 2307.08691) instead of 2x, plus the forwards that `recompute` replays:
           norm / swiglu are elementwise (0 matmul FLOPs), selective "attention" replays the core
           (+1 attention forward), policy "full" replays each block's forward (+2 * N_blocks * B * S
           + 1 attention forward).
MFU = model / (step time * peak), HFU = hardware / (step time * peak), peak = dense bf16 (989 on
H100 SXM / H200). Peak memory = torch.cuda.max_memory_allocated over the timed steps.
With --profile, one more step runs under torch.profiler: the top 25 GPU kernels by self time, each
tagged attention / gemm / grouped_gemm / all_to_all / elementwise / other, the totals per tag, and
the GPU idle time (step time minus kernel time: host overhead, syncs, launch gaps).
"""

from __future__ import annotations

import dataclasses
import re
import time

import torch

from moe_lc.config import load_config
from moe_lc.model.counting import attention_core_flops, param_counts, train_flops_per_token
from .common import ROOT, Context, Recorder, Timing, free_memory, memory_mark, sync, time_fn

PART = "model_step"
DEFAULT_RECIPE = "recipes/moe16b_128k.toml"
SEQS = (4096, 32768, 131072)
LAYOUT = ["parallel.pp=1", "parallel.dp=1", "parallel.cp=1", "parallel.tp=1", "parallel.ep=1",
          "parallel.ranks_per_node=1", "train.global_batch=1", "train.micro_batch=1", "checkpoint.interval=0",
          "data.source=synthetic", "data.synthetic_weight=0.0", "precision.recipe=bf16",
          "recompute.policy=selective"]
MODEL = ["model.n_layers=3", "model.moe.n_dense_layers=1"]
DRY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=32",
             "model.ffn_dim=128", "model.moe.ffn_dim=32", "model.moe.n_routed_experts=4", "model.moe.n_shared_experts=1",
             "model.moe.topk=2", "model.moe.n_groups=1", "model.moe.topk_groups=1", "model.vocab_size=512"]
CATEGORIES = (  # first match wins; kernel names (CUDA) or aten op names (CPU)
    ("attention", r"flash|fmha|sdpa|attention|mha_|cudnn_generated"),
    ("grouped_gemm", r"GroupProblemShape|grouped|group_?gemm|PtrArray|ptr_array"),  # not "warpgroup"
    ("gemm", r"gemm|xmma|nvjet|cutlass|cublas|wgmma|aten::(mm|bmm|addmm|matmul|_scaled_mm|linear)\b"),
    ("all_to_all", r"all_?to_?all|nccl"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|copy|fill|index|scatter|gather|cat|sort|radix|"
                    r"softmax|norm|silu|mul|add|pow|sqrt|exp|cumsum|bincount|where|clamp|lerp|aten::"),
)

COLUMNS = [("seq", "S", "{:d}"), ("step_ms", "step ms", "{:.1f}"), ("optimizer_ms", "optimizer ms", "{:.1f}"),
           ("tokens_per_s", "tokens/s", "{:,.0f}"), ("model_tflops", "model TFLOP/s", "{:.1f}"),
           ("mfu_pct", "MFU %", "{:.1f}"), ("hfu_pct", "HFU %", "{:.1f}"),
           ("peak_mem_gib", "peak GiB", "{:.2f}"), ("static_mem_gib", "state GiB", "{:.2f}")]


def step_flops(model_cfg, recompute_cfg, seq: int, batch: int = 1) -> dict[str, float]:
    """{"model": ..., "hardware": ...} FLOPs of one training step (formulas in the module docstring)."""
    tokens = batch * seq
    model = train_flops_per_token(model_cfg, seq) * tokens
    attn_fwd = model_cfg.n_layers * attention_core_flops(model_cfg, seq) * tokens
    hardware = model + 0.5 * attn_fwd  # flash backward: 2.5x forward, not 2x
    items = set(recompute_cfg.selective) if recompute_cfg.policy == "selective" else set()
    if "attention" in items:
        hardware += attn_fwd
    if recompute_cfg.policy == "full":
        c = param_counts(model_cfg)
        block_matmul = c["activated"] - c["norms"] - c["head"]
        hardware += 2 * block_matmul * tokens + attn_fwd
    return {"model": model, "hardware": hardware}


def categorize(name: str) -> str:
    for category, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return category
    return "other"


class _FixedBatches:
    """Stands in for the trainer's StepLoader: the same random tokens every step, no data cost (one
    source, one document: what the trainer reads of a loader besides the batches)."""

    samples_consumed = 0
    dataset = None

    def __init__(self, seq: int, vocab: int):
        g = torch.Generator().manual_seed(seq)
        self.tokens = torch.randint(0, vocab, (1, seq + 1), generator=g)

    def next_step(self) -> list[dict]:
        return [{"tokens": self.tokens, "loss_mask": None, "documents": None}]


def build_trainer(ctx: Context):
    """(trainer, cfg) for this mode; the trainer is built once and reused for every length."""
    from moe_lc.train import Trainer

    out = (ctx.work_dir or ROOT / "runs") / "bench_model_step"
    device = "cpu" if ctx.dry_run else "cuda"
    overrides = LAYOUT + (DRY_MODEL if ctx.dry_run else MODEL) + [
        f"train.device={device}", f"train.output_dir={out.as_posix()}"] + list(ctx.model_sets)
    recipe = ctx.recipes[0] if ctx.recipes else DEFAULT_RECIPE
    cfg = load_config(ROOT / recipe, overrides, world_size=1)
    return Trainer(cfg), cfg


def run(ctx: Context, rec: Recorder) -> None:
    seqs = [64, 128, 256] if ctx.dry_run else ([4096, 32768] if ctx.quick else list(SEQS))
    built = {}
    entry = rec.measure({"what": "build"}, lambda: _build(ctx, built), lambda e: e["summary"])
    if entry["status"] != "ok":
        for seq in seqs:
            rec.skip({"seq": seq}, "the model or optimizer could not be built (see the build entry)")
        return
    trainer, cfg = built["trainer"], built["cfg"]
    timing = Timing(warmup=1, iters=2 if ctx.quick or ctx.dry_run else 3, min_iters=1 if ctx.dry_run else 2,
                    max_s=60.0)
    for seq in seqs:
        e = rec.measure({"seq": seq}, lambda: _measure_seq(ctx, trainer, cfg, seq, timing), _line)
        if e["status"] != "ok":
            trainer.optimizer.zero_grad()
            free_memory(ctx.device)


def _build(ctx: Context, built: dict) -> dict:
    t0 = time.perf_counter()
    trainer, cfg = build_trainer(ctx)
    built.update(trainer=trainer, cfg=cfg)
    c = param_counts(cfg.model)
    static = torch.cuda.memory_allocated(ctx.device) / 2**30 if ctx.cuda else None
    return {"build_s": time.perf_counter() - t0, "params": c, "static_mem_gib": static,
            "model": {**{k: getattr(cfg.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_size",
                                                          "vocab_size")},
                      "moe": dataclasses.asdict(cfg.model.moe)},
            "recompute": dataclasses.asdict(cfg.recompute), "precision": cfg.precision.recipe,
            "summary": f"{c['total'] / 1e6:,.1f}M params, {c['activated'] / 1e6:,.1f}M activated "
                       f"(embedding {c['embedding'] / 1e6:,.1f}M, routed experts {c['routed_experts'] / 1e6:,.1f}M), "
                       f"built in {time.perf_counter() - t0:.1f}s"}


def _measure_seq(ctx: Context, trainer, cfg, seq: int, timing: Timing) -> dict:
    trainer.cfg = cfg.replace(train=dataclasses.replace(cfg.train, seq_len=seq))  # the loss scale uses it
    trainer.loader = _FixedBatches(seq, cfg.model.vocab_size)
    opt_times: list[float] = []
    inner = trainer.optimizer.step

    def timed_optimizer_step(*args, **kwargs):
        sync(ctx.device)
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        sync(ctx.device)
        opt_times.append(time.perf_counter() - t0)
        return out

    trainer.optimizer.step = timed_optimizer_step
    try:
        static = memory_mark(ctx.device)
        t = time_fn(trainer.train_step, ctx.device, timing)
        peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
        profile = _profile(ctx, trainer) if ctx.profile else None
    finally:
        del trainer.optimizer.step  # back to the class's method
    flops = step_flops(cfg.model, cfg.recompute, seq)
    peak_tf = ctx.peak["bf16"] * 1e12 if ctx.peak else None
    n_timed = len(opt_times) - timing.warmup - (1 if profile else 0)
    timed_opt = opt_times[timing.warmup:timing.warmup + max(n_timed, 1)]
    out = {"step_ms": t["s"] * 1e3, "iters": t["n"], "tokens": seq, "tokens_per_s": seq / t["s"],
           "optimizer_ms": 1e3 * sorted(timed_opt)[len(timed_opt) // 2] if timed_opt else None,
           "model_flops": flops["model"], "hardware_flops": flops["hardware"],
           "model_tflops": flops["model"] / t["s"] / 1e12,
           "mfu_pct": 100 * flops["model"] / t["s"] / peak_tf if peak_tf else None,
           "hfu_pct": 100 * flops["hardware"] / t["s"] / peak_tf if peak_tf else None,
           "peak_mem_gib": peak / 2**30 if peak is not None else None,
           "static_mem_gib": static / 2**30 if ctx.cuda else None,
           "activation_peak_gib": (peak - static) / 2**30 if peak is not None else None}
    if profile:
        out["profile"] = profile
    return out


def _line(e: dict) -> str:
    mfu = f" | MFU {e['mfu_pct']:.1f}% HFU {e['hfu_pct']:.1f}%" if e.get("mfu_pct") is not None else ""
    mem = f" | peak {e['peak_mem_gib']:.1f} GiB" if e.get("peak_mem_gib") is not None else ""
    return (f"step {e['step_ms']:.1f} ms (optimizer {e['optimizer_ms'] or 0:.1f} ms) | "
            f"{e['tokens_per_s']:,.0f} tok/s{mfu}{mem}")


def _profile(ctx: Context, trainer, top: int = 25) -> dict:
    """One step under torch.profiler -> top kernels by self time, totals per category, GPU idle time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    sync(ctx.device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.train_step()
        sync(ctx.device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    rows = []
    for evt in prof.key_averages():
        if ctx.cuda:
            if "CUDA" not in str(getattr(evt, "device_type", "")):
                continue
            self_us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        else:
            if not evt.key.startswith("aten::") or evt.key in ("aten::empty", "aten::empty_strided"):
                continue
            self_us = evt.self_cpu_time_total
        if self_us > 0:
            rows.append({"name": evt.key[:160], "category": categorize(evt.key), "self_ms": self_us / 1e3,
                         "calls": evt.count})
    total = sum(r["self_ms"] for r in rows)
    rows.sort(key=lambda r: -r["self_ms"])
    for r in rows:
        r["pct"] = 100 * r["self_ms"] / total if total else 0.0
    by_cat: dict[str, float] = {}
    for r in rows:
        by_cat[r["category"]] = by_cat.get(r["category"], 0.0) + r["self_ms"]
    return {"kind": "cuda kernels" if ctx.cuda else "cpu aten ops", "step_wall_ms": wall_ms,
            "kernel_ms": total, "idle_ms": wall_ms - total if ctx.cuda else None,
            "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])), "top": rows[:top]}


def extra_markdown(entries: list[dict]) -> list[str]:
    lines = []
    for e in entries:
        if e.get("what") == "build" and e.get("status") == "ok":
            lines += [f"Model: {e['summary']}; {e['model']}; recompute {e['recompute']}.", ""]
        p = e.get("profile")
        if not p:
            continue
        lines += [f"### profile, S={e['seq']} ({p['kind']}; step {p['step_wall_ms']:.1f} ms under the profiler, "
                  f"kernels {p['kernel_ms']:.1f} ms" + (f", GPU idle {p['idle_ms']:.1f} ms)" if p["idle_ms"] is not None
                                                         else ")"), "",
                  "| category | ms | % of kernel time |", "|---|---|---|"]
        lines += [f"| {c} | {ms:.2f} | {100 * ms / p['kernel_ms']:.1f} |" for c, ms in p["by_category_ms"].items()]
        lines += ["", "| kernel | category | self ms | calls | % |", "|---|---|---|---|---|"]
        lines += [f"| `{r['name'][:100].replace('|', '/')}` | {r['category']} | {r['self_ms']:.2f} | {r['calls']} | "
                  f"{r['pct']:.1f} |" for r in p["top"]]
        lines.append("")
    return lines
