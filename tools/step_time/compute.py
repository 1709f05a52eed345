"""Compute seconds of one micro-batch through a pipeline stage on one rank of a GPU cluster: its traced kernels
(tools/step_time/kernel_trace.py) at the kernel rates of their shapes (tools/step_time/kernel_rates.py).

Every GEMM, grouped GEMM and attention kernel the trainer's code launches is priced by its own FLOPs and bytes:

    seconds = launch_s + ((flops / rate)^p + (bytes / bandwidth)^p)^(1/p)

with the kind's constants (tools/step_time/clusters.py `EFFICIENCY`: fractions of the cluster's peaks, fitted on
an H100). The memory-bound work depends on the implementation (`--impl`):

    fused   what Megatron-Core / Transformer Engine, torchtitan's compiled blocks and DeepSeek's kernels move:
            fused norms, SwiGLU, RoPE, residual adds, MoE permutation and cross-entropy, at the bytes
            tools/step_time/work.py counts (2x in backward, plus what recomputation replays), one launch per
            GEMM or attention kernel beside them (its fused prologue or epilogue); an FP8 GEMM's operands cast
            from BF16 in them (each FP8 operand byte read as 2 and written as 1: 3x the operands' bytes)
    eager   this repo's trainer as it runs today: every other aten op the trace saw is a kernel of its own at its
            bytes (norms, RoPE, routing, the loss's fp32 copies, FP8 quantization, copies)

Host floor, under both: where the cluster gives a host cost per dispatched aten op (`host_op_us`), a phase takes
at least its traced ops x host_op_us (the excess booked as "host"). A dropless MoE step cannot let the host run a
phase ahead of the GPU: the dispatcher reads the per-expert token counts back to size the all-to-all and the grouped
GEMM, once per MoE layer (Megatron-Core's MoEAlltoAllTokenDispatcher.preprocess moves num_out_tokens and the
input splits to the CPU, megatron/core/transformer/moe/token_dispatcher.py; this repo's dispatch likewise), so a
phase whose kernels are shorter than their dispatch waits on the host. The trace's ops stand for the framework's
dispatch count: an approximation (a fused framework launches fewer kernels; its host work per module, Python and
Transformer Engine's per-expert quantizers, is of the same order but not measured here). It binds on small,
many-kernel phases: FP8 expert GEMMs run one per local expert with their own quantization (Megatron-Bridge's
FP8 Qwen3 runs; its Qwen3-30B-A3B on 16 H100 is 2.3x slower per GPU than the same model in BF16 under NeMo
AutoModel) and TP-split blocks; see docs/results/steptime/published.md's "host" terms.

F is the part's forward, W its weight-gradient GEMMs, B its full backward (input gradients, replays and W), and
attention_F / attention_B the attention kernels' share (context parallelism's ring hides behind them).
"""

from __future__ import annotations

from collections import Counter

from moe_lc.config import Config
from .clusters import Cluster, PRECISION
from .kernel_rates import kernel_seconds
from .kernel_trace import trace_kernels
from ..planner.block_kinds import block_kind
from .work import Seconds, part_work, tokens_per_rank



def kernel_rates(cfg: Config, cluster: Cluster, eff: dict[str, float]) -> dict[str, dict]:
    """{traced kind: {"flops_per_s", "bytes_per_s", "launch_s", "p"}} on `cluster` for `cfg`'s precision: each
    table kind's fractions times the cluster's peak of its precision (fp32 recipes: the fp32 peak for the 16-bit
    kinds) and HBM; a traced fp8 GEMM takes the recipe's scaling (tensorwise, else blockwise)."""
    fp32 = cfg.precision.recipe == "fp32"
    hbm = cluster.hbm_gbps * 1e9
    scaling = "tensorwise" if cfg.precision.fp8_scaling == "tensorwise" else "blockwise"
    table = {"gemm": "gemm", "gemm_fp8": f"gemm_fp8_{scaling}", "grouped_gemm": "grouped_gemm",
             "grouped_gemm_fp8": "grouped_gemm_fp8", "attention_fwd": "attention_fwd", "attention_bwd": "attention_bwd"}
    out = {"memory": {"flops_per_s": float("inf"), "bytes_per_s": eff["memory"] * hbm,
                      "launch_s": eff["memory.launch_us"] * 1e-6, "p": 1.0}}
    for traced, kind in table.items():
        precision = "fp32" if fp32 and PRECISION[kind] == "bf16" else PRECISION[kind]
        out[traced] = {"flops_per_s": eff[kind] * cluster.peak_tflops(precision) * 1e12,
                       "bytes_per_s": eff[f"{kind}.bw"] * hbm, "launch_s": eff[f"{kind}.launch_us"] * 1e-6,
                       "p": eff[f"{kind}.p"]}
    return out


def phase_seconds(kernels: Counter, rates: dict[str, dict], impl: str) -> dict[str, float]:
    """{kind: seconds} of one part's phase; under "fused" the traced memory-bound ops are left out (`part_seconds`
    adds the fused bytes) and the launches of the fused kernels are booked under "memory"."""
    out: dict[str, float] = {}
    launches = 0
    cast = 0.0
    for k, n in kernels.items():
        if k.kind == "memory" and impl == "fused":
            continue
        out[k.kind] = out.get(k.kind, 0.0) + n * kernel_seconds(k.flops, k.bytes, rates[k.kind])
        launches += n
        cast += n * 3 * k.operands if k.kind.endswith("_fp8") else 0.0
    if impl == "fused":
        out["memory"] = launches * rates["memory"]["launch_s"] + cast / rates["memory"]["bytes_per_s"]
    return out


def part_seconds(cfg: Config, part: str, layer_id: int, cluster: Cluster, eff: dict[str, float],
                 impl: str) -> dict[str, dict[str, float]]:
    """{phase: {kind: seconds}} of one micro-batch through one part on one rank (phases F, B, W; B without W)."""
    traced = trace_kernels(cfg)
    rates = kernel_rates(cfg, cluster, eff)
    out = {phase: phase_seconds(traced.of(part, phase), rates, impl) for phase in ("F", "B", "W")}
    if impl == "fused":
        w = part_work(cfg, part, layer_id)
        bw = rates["memory"]["bytes_per_s"]
        tokens = tokens_per_rank(cfg)
        replay = w.recomputed.memory if w.recomputed else 0.0
        out["F"]["memory"] += w.memory * tokens / bw
        out["B"]["memory"] += (2 * w.memory + replay) * tokens / bw
    if cluster.host_op_us:  # the host floor, under both implementations (module docstring)
        for phase, kinds in out.items():
            host = traced.ops.get(part, {}).get(phase, 0) * cluster.host_op_us * 1e-6
            if host > sum(kinds.values()):
                kinds["host"] = host - sum(kinds.values())
    return out


def stage_parts(cfg: Config, layers: list[int], first: bool, last: bool) -> list[tuple[str, int]]:
    """(part, layer id) of every part a stage runs: the embedding, its blocks, the head."""
    m = cfg.model
    blocks = [(block_kind(m, i), i) for i in layers]  # the kinds kernel_trace books under (V4: "csa moe", ...)
    return [("embed", 0)] * first + blocks + [("head", m.n_layers - 1)] * last


def stage_seconds(cfg: Config, layers: list[int], first: bool, last: bool, cluster: Cluster,
                  eff: dict[str, float], impl: str = "fused") -> tuple[Seconds, dict[str, float]]:
    """(Seconds of one micro-batch through the stage, {kind: seconds} of F + B over its kernels)."""
    total = {"F": 0.0, "B": 0.0, "W": 0.0}
    by_kind: dict[str, float] = {}
    attention = {"F": 0.0, "B": 0.0}
    cache: dict[tuple[str, int], dict] = {}
    for part, layer in stage_parts(cfg, layers, first, last):
        key = (part, layer if part == "head" else 0)
        if key not in cache:
            cache[key] = part_seconds(cfg, part, layer, cluster, eff, impl)
        for phase, kinds in cache[key].items():
            total[phase] += sum(kinds.values())
            for kind, s in kinds.items():
                by_kind[kind] = by_kind.get(kind, 0.0) + s
        attention["F"] += cache[key]["F"].get("attention_fwd", 0.0)
        attention["B"] += cache[key]["B"].get("attention_bwd", 0.0)
    sec = Seconds(total["F"], total["B"] + total["W"], total["W"], attention["F"], attention["B"])
    return sec, by_kind
