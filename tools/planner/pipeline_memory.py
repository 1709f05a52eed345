"""A pipeline rank through its schedule: what the planner (tools/plan.py) adds to the per-stage figures
of tools/planner/activation_memory.py and tools/planner/block_trace.py once stages run as the pipeline runtime runs
them (moe_lc/parallel/pipeline/runtime.py, overlap.py). Memory: the phases each stage's forward is cut
into, counted from its built model, and what a split backward keeps for its W, traced. Traffic: how
many micro-batches the rank runs through each stage and how many tensors it sends, read off the
schedule's actions (the schedule is data: schedule_ir.py). Held to traced steps by tools/dryrun.py.
"""

from __future__ import annotations

from collections import Counter

import torch

from moe_lc.config import Config
from moe_lc.parallel.build import pipeline_plan
from moe_lc.parallel.pipeline.schedule_ir import FB, SEND_B, SEND_F, B, CommGroup, F, W, compute_parts
from .block_trace import block_kind, trace_parts


def pipeline_schedule(cfg: Config, deg):
    """The recipe's schedule as the trainer builds it (None without PP)."""
    return pipeline_plan(cfg, cfg.train.microbatches(deg.dp))[0]


def stage_forwards(schedule, rank: int) -> Counter:
    """{stage id: micro-batches `rank` runs through that stage per step} (F and the F of an F&B; each
    one's backward runs on the same rank): under DualPipe each micro-batch meets one of the rank's two
    stages."""
    return Counter(schedule.stage_of(rank, part.chunk, part.mb) for a in schedule.actions[rank]
                   if not isinstance(a, CommGroup) for part in compute_parts(a) if isinstance(part, F))


def stage_sends(schedule, rank: int) -> int:
    """Tensors `rank` sends per step: a stage's output for each SEND_F, an input gradient for each SEND_B
    (a hand-over between two stages of the rank sends nothing)."""
    return sum(op.op in (SEND_F, SEND_B) for a in schedule.actions[rank] if isinstance(a, CommGroup) for op in a.ops)


def stage_sizes(stages: list[dict], per_stage: list) -> dict[int, float]:
    """{stage id: saved bytes of one micro-batch through it}. The runtime runs a stage phase by phase
    (overlap.py) but keeps a phase boundary's tensor only where a phase saves it anyway, so a pipeline
    stage saves what the same layers save outside one (the experts' outputs, which only combine's
    all-to-all reads, are freed once combine has run)."""
    return {st["id"]: e.total for st, e in zip(stages, per_stage)}


def phase_count(stage: dict) -> int:
    """Phases of a stage's forward, as its model (the stage's chunk of the rank's built model) chains
    them (`Transformer.phases`): the embedding, each block's (`Block.phases`), the head, within which the
    MTP modules run."""
    return len(stage["module"].phases(torch.arange(1, device="meta")))


def rank_saved_peak(schedule, rank: int, stages: list[dict], per_stage: list) -> float:
    """Most bytes of the estimates `per_stage` (one micro-batch through each of `rank`'s stages) the rank
    holds at once: its micro-batches through its stages in the schedule's order (`schedule_peak`), or one
    micro-batch's without a pipeline."""
    if schedule is None:
        return per_stage[0].total
    return schedule_peak(schedule, rank, stage_sizes(stages, per_stage), {st["id"]: phase_count(st) for st in stages})[0]


def schedule_peak(schedule, rank: int, sizes: dict[int, float], phases: dict[int, int],
                  held: dict[int, float] | None = None, spikes: dict[int, float] | None = None,
                  b_spikes: dict[int, float] | None = None) -> tuple[float, float]:
    """(most saved-activation bytes, most bytes in all) `rank` holds at once while it runs its actions
    in order: F adds its stage's saved bytes, B frees them, a split B too (its graph goes) but for what
    its W needs, `held` (`wgrad_held_bytes`: the Linears' inputs and output gradients), which waits
    beside the saved activations until the W, and DualPipe's F&B alternates forward and backward phases
    (overlap.py), so it peaks at the largest of j/n_f of the forward's bytes minus (j-1)/n_b of what the
    backward frees, j = 1..n_f. `spikes`: a working set a stage's forward has at its end (the loss head's
    logits), on top of everything its forward saved; `b_spikes`: one its backward has at its start, on
    top of everything the micro-batch saved there (`working_spikes`)."""
    held, spikes, b_spikes = held or {}, spikes or {}, b_spikes or {}
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
            peak = max(peak, now + extra + b_spikes.get(key[0], 0.0))
            now -= saved.pop(key)
            if a.split:
                waiting[key] = held.get(key[0], 0.0)
                extra += waiting[key]
        elif isinstance(a, W):
            extra -= waiting.pop((schedule.stage_of(rank, a.chunk, a.mb), a.mb))
        elif isinstance(a, FB):
            f_key = (schedule.stage_of(rank, a.f_chunk, a.f_mb), a.f_mb)
            b_key = (schedule.stage_of(rank, a.b_chunk, a.b_mb), a.b_mb)
            f, b = sizes[f_key[0]], saved.pop(b_key)
            w = held.get(b_key[0], 0.0) if a.split else 0.0  # grows as the backward's phases run
            n_f, n_b = phases[f_key[0]], phases[b_key[0]]
            rise = max(j * f / n_f - min(j - 1, n_b) * b / n_b for j in range(1, n_f + 1))
            rise_all = max(j * f / n_f - min(j - 1, n_b) * (b - w) / n_b for j in range(1, n_f + 1))
            peak = max(peak, now + extra + b_spikes.get(b_key[0], 0.0))  # the backward's first phase
            end = now + f - (n_f - 1) * (b - w) / n_b + spikes.get(f_key[0], 0.0)
            most, peak = max(most, now + rise), max(peak, now + rise_all + extra, end + extra)
            saved[f_key] = f
            now += f - b
            if a.split:
                waiting[b_key] = w
                extra += w
        most, peak = max(most, now), max(peak, now + extra)
    return most, peak


def wgrad_held_bytes(cfg: Config, stage: dict) -> float:
    """Bytes a split backward (B) of one micro-batch through `stage` keeps for its W (M_W in the zero-bubble
    paper's terms; its saved bytes are M_B), traced per block kind and for the head: what its W frees, the
    output gradients of the Linears that defer W and the inputs B rebuilt or quantized for them
    (`TracedParts.held`), and their inputs from the forward (`TracedParts.kept`), on one rank of cfg's
    layout under its policy and precision. Under recompute M_W can exceed M_B (B rebuilds the inputs)."""
    traced = trace_parts(cfg, cfg.data.has_loss_mask, backward=True)
    parts = [block_kind(cfg.model, i) for i in stage["layers"]] + (["head"] if stage["last"] else [])
    return float(sum(traced.held[part] + traced.kept.get(part, 0) for part in parts))


def working_spikes(cfg: Config, stage: dict) -> tuple[float, float]:
    """(forward, backward) working sets of one micro-batch through `stage`, on top of what it has saved when
    they occur, as `schedule_peak` adds them: the most any of its parts (embedding, blocks, head: their traced
    `TracedParts.working`) holds at once while running, less what the parts after it will still save (forward;
    relative to the stage's end) or what the parts before it in backward order have already freed (backward;
    relative to its start)."""
    traced = trace_parts(cfg, cfg.data.has_loss_mask, backward=True)
    parts = ((["embed"] if stage["first"] else []) + [block_kind(cfg.model, i) for i in stage["layers"]]
             + (["head"] if stage["last"] else []))
    later = still = 0.0
    fwd = bwd = 0.0
    for part in reversed(parts):  # forward: saved by the parts after this one is not saved yet
        fwd = max(fwd, traced.working["F"].get(part, 0) - later)
        later += traced.saved[part]
    for part in reversed(parts):  # backward runs the parts in reverse, each freeing what it saved
        bwd = max(bwd, traced.working["B"].get(part, 0) - still)
        still += traced.saved[part]
    return fwd, bwd
