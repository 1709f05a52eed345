"""Saved activations of a pipeline rank through its schedule: what the planner (tools/plan.py) adds to
the per-stage estimates of tools/activation_memory.py once stages run as the pipeline runtime runs
them (moe_lc/parallel/pipeline/runtime.py, overlap.py). Held to traced steps by tools/dryrun.py.
"""

from __future__ import annotations

from moe_lc.config import Config
from moe_lc.parallel.build import pipeline_plan
from .plan_layout import microbatches, moe_blocks


def pipeline_schedule(cfg: Config, deg):
    """The recipe's schedule as the trainer builds it (None without PP)."""
    return pipeline_plan(cfg, microbatches(cfg, deg))[0]


def stage_sizes(stages: list[dict], per_stage: list) -> dict[int, float]:
    """{stage id: saved bytes of one micro-batch through it}. The runtime runs a stage phase by phase
    (overlap.py) but keeps a phase boundary's tensor only where a phase saves it anyway, so a pipeline
    stage saves what the same layers save outside one (the experts' outputs, which only combine's
    all-to-all reads, are freed once combine has run)."""
    return {st["id"]: e.total for st, e in zip(stages, per_stage)}


def phase_count(cfg: Config, stage: dict) -> int:
    """Phases of a stage's forward (Transformer.phases): embedding, 4 per MoE block (attention,
    dispatch, experts, combine), 2 per dense one, the output head."""
    moe = moe_blocks(cfg, {**stage, "last": False})  # the MTP blocks run inside the head's phase
    return int(stage["first"]) + 4 * moe + 2 * (len(stage["layers"]) - moe) + int(stage["last"])


def schedule_peak(schedule, rank: int, sizes: dict[int, float], phases: dict[int, int],
                  held: dict[int, float] | None = None, spikes: dict[int, float] | None = None) -> tuple[float, float]:
    """(most saved-activation bytes, most bytes in all) `rank` holds at once while it runs its actions
    in order: F adds its stage's saved bytes, B frees them (a split B keeps them and the output
    gradients `held` for its W, which frees both), and DualPipe's F&B alternates forward and backward
    phases (overlap.py), so it peaks at the largest of j/n_f of the forward's bytes minus (j-1)/n_b of
    the backward's, j = 1..n_f. `spikes`: a working set a stage's forward has at its end (the loss
    head's logits), on top of everything its forward saved."""
    from moe_lc.parallel.pipeline.schedule_ir import FB, B, F, W

    held, spikes = held or {}, spikes or {}
    saved, waiting = {}, {}  # (stage, mb) -> bytes
    now = extra = most = peak = 0.0
    for a in schedule.actions[rank]:
        if isinstance(a, F):
            key = (schedule.stage_of(rank, a.chunk, a.mb), a.mb)
            saved[key] = sizes[key[0]]
            now += saved[key]
            peak = max(peak, now + extra + spikes.get(key[0], 0.0))
        elif isinstance(a, B):
            key = (schedule.stage_of(rank, a.chunk, a.mb), a.mb)
            if a.split:
                waiting[key] = held.get(key[0], 0.0)
                extra += waiting[key]
            else:
                now -= saved.pop(key)
        elif isinstance(a, W):
            key = (schedule.stage_of(rank, a.chunk, a.mb), a.mb)
            now -= saved.pop(key)
            extra -= waiting.pop(key)
        elif isinstance(a, FB):
            f_key = (schedule.stage_of(rank, a.f_chunk, a.f_mb), a.f_mb)
            b_key = (schedule.stage_of(rank, a.b_chunk, a.b_mb), a.b_mb)
            f, b = sizes[f_key[0]], 0.0 if a.split else saved[b_key]
            n_f, n_b = phases[f_key[0]], phases[b_key[0]]
            rise = max(j * f / n_f - min(j - 1, n_b) * b / n_b for j in range(1, n_f + 1))
            end = now + f - (n_f - 1) * b / n_b + spikes.get(f_key[0], 0.0)
            most, peak = max(most, now + rise), max(peak, now + rise + extra, end + extra)
            saved[f_key] = f
            now += f - b
            if a.split:
                waiting[b_key] = held.get(b_key[0], 0.0)
                extra += waiting[b_key]
            else:
                saved.pop(b_key)
        most, peak = max(most, now), max(peak, now + extra)
    return most, peak


def wgrad_held_bytes(cfg: Config, deg, module) -> float:
    """Bytes a split backward (B) of one micro-batch through `module` keeps for its W: the output
    gradient of every Linear that defers its W (moe_lc/ops/linear.py; the router's does not), and the
    input of those whose input B rebuilt (recomputation: the down projections under a SwiGLU replay,
    MLA's up-projections under "mla_up", every Linear under full recomputation), in the compute dtype
    or, where FP8 caching holds them for the wgrad GEMM (`HoldFp8ForWgrad`), as an FP8 byte and an fp32
    scale per 128 tokens per element. Rows: the cp shard of the sequence (column/row-parallel layers see
    it whole under SP), the tp shard x top-k for experts."""
    from moe_lc.model.ffn import SwiGLU, swiglu_then
    from moe_lc.model.mla import MLAttention
    from moe_lc.model.moe import RoutedExperts
    from moe_lc.model.recompute import mla_up_replayed
    from moe_lc.ops.fp8_linear import HoldFp8ForWgrad
    from moe_lc.ops.linear import GroupedLinear, Linear

    m, t, c = cfg.model, cfg.train, cfg.precision.compute_dtype.itemsize
    tokens = t.micro_batch * t.seq_len // deg.cp
    rebuilt = set()
    for mod in module.modules():
        if isinstance(mod, (SwiGLU, RoutedExperts)) and mod.activation is not swiglu_then:
            rebuilt.add(id(mod.w2))
        if isinstance(mod, MLAttention) and mod.attend is mla_up_replayed:
            rebuilt |= {id(x) for x in (mod.wq_b, mod.wkv_b) if x is not None}
    total = 0.0
    for mod in module.modules():
        if not isinstance(mod, (Linear, GroupedLinear)) or not mod.defer_wgrad:
            continue
        per_elem = 1 + 4 / 128 if isinstance(mod.keep_input, HoldFp8ForWgrad) else c
        rows = tokens // deg.tp * m.moe.topk if isinstance(mod, GroupedLinear) else tokens
        total += rows * mod.weight.shape[-2] * per_elem
        if id(mod) in rebuilt or cfg.recompute.policy == "full":
            total += rows * mod.weight.shape[-1] * per_elem
    return total
