"""How many micro-batches the dry run (tools/dryrun.py) traces: the fewest whose pipeline schedule reaches
every state the recipe's whole step reaches, so that the traced peak is the whole step's.

What a pipeline rank holds for backward at any moment is set by what its schedule has in flight: per stage,
the micro-batches run forward and not yet backward (their saved activations) and those a split backward
left waiting for their W (what the W needs), plus the action running (an F adds its stage's
bytes, DualPipe's F&B interleaves a forward and a backward phase by phase). A rank's *states* are these
counts at each of its actions, with the action's kind and stages: exactly the events at which
tools/planner/pipeline_memory.py's `schedule_peak` takes its maximum. After its warm-up a schedule repeats its
steady state, so a step of M micro-batches visits the same set of states as one of M' < M from some M' on
(DualPipe, pp 16: 32 of 120). Where every rank's set is the same, the peak is the same whatever each
stage's bytes are, and the dry run traces M' micro-batches.

What grows with M is not in that peak, and the dry run says so beside its figures: the step's inputs
(the loader hands the step all its micro-batches at once: `input_bytes`, kilobytes to megabytes each)
and the bytes sent per micro-batch (pipeline transfers, the expert all-to-alls, the context-parallel
ring); the ZeRO-1 collectives are per step. Without a pipeline (pp = 1) every
micro-batch is traced: there is no schedule to prove the count does not matter.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from moe_lc.config import Config
from moe_lc.parallel.pipeline import build_schedule
from moe_lc.parallel.pipeline.schedule_ir import FB, B, F, W


def rank_states(schedule, rank: int) -> frozenset:
    """The states `rank` passes through while it runs its actions in order (see the module docstring):
    ((saved micro-batches per stage), (waiting micro-batches per stage), event, stages...) tuples."""
    saved, waiting, states = Counter(), Counter(), set()

    def now() -> tuple:
        return tuple(sorted((+saved).items())), tuple(sorted((+waiting).items()))

    for a in schedule.actions[rank]:
        if isinstance(a, F):
            stage = schedule.stage_of(rank, a.chunk, a.mb)
            saved[stage] += 1
            states.add((*now(), "F", stage))  # schedule_peak: the stage's loss head spikes on top here
        elif isinstance(a, B):
            stage = schedule.stage_of(rank, a.chunk, a.mb)
            if a.split:
                waiting[stage] += 1
            else:
                saved[stage] -= 1
        elif isinstance(a, W):
            stage = schedule.stage_of(rank, a.chunk, a.mb)
            saved[stage] -= 1
            waiting[stage] -= 1
        elif isinstance(a, FB):
            f_stage, b_stage = schedule.stage_of(rank, a.f_chunk, a.f_mb), schedule.stage_of(rank, a.b_chunk, a.b_mb)
            states.add((*now(), "FB", f_stage, b_stage, a.split))  # its phases rise from the state before it
            saved[f_stage] += 1
            if a.split:
                waiting[b_stage] += 1
            else:
                saved[b_stage] -= 1
        states.add((*now(), "end"))
    return frozenset(states)


def _schedule(cfg: Config, microbatches: int):
    p = cfg.parallel
    try:
        return build_schedule(p.pp_schedule, p.pp, microbatches, p.pp_chunks if p.pp_schedule == "interleaved_1f1b"
                              else None)
    except ValueError:  # a count the schedule cannot take (DualPipe: even and >= 2 pp; interleaved: pp | m)
        return None


def fewest_microbatches(cfg: Config, microbatches: int) -> int:
    """The fewest micro-batches m <= `microbatches` whose schedule gives every pipeline rank the same set of
    states as `microbatches` do (`rank_states`); `microbatches` itself without a pipeline."""
    if cfg.parallel.pp == 1:
        return microbatches
    whole = _schedule(cfg, microbatches)
    wanted = [rank_states(whole, r) for r in range(cfg.parallel.pp)]
    for m in range(1, microbatches):
        schedule = _schedule(cfg, m)
        if schedule is not None and all(rank_states(schedule, r) == wanted[r] for r in range(cfg.parallel.pp)):
            return m
    return microbatches


def with_microbatches(cfg: Config, dp: int, microbatches: int) -> Config:
    """cfg whose step has `microbatches` micro-batches per pipeline (train.global_batch = microbatches x
    micro_batch x dp)."""
    train = replace(cfg.train, global_batch=microbatches * cfg.train.micro_batch * dp)
    return replace(cfg, train=train)


def input_bytes(cfg: Config, cp: int, microbatches: int) -> int:
    """Bytes of the inputs a step of `microbatches` micro-batches holds from its start to its end (the loader
    hands over all of them at once; moe_lc/parallel/parallelize.py's prepare_batch): per micro-batch the token
    ids (micro_batch, seq_len + 1) int64 and an fp32 loss mask when the data mix has one, then the positions
    (seq_len,) int64 ((micro_batch, seq_len) with data.document_positions), or under cp > 1 this rank's
    shards of the inputs, labels, positions and mask instead. Multi-token-prediction targets are not
    counted."""
    t, d = cfg.train, cfg.data
    tokens, positions = t.micro_batch * t.seq_len, (t.micro_batch if d.document_positions else 1) * t.seq_len
    mask = tokens * 4 if d.has_loss_mask else 0
    per = t.micro_batch * (t.seq_len + 1) * 8 + mask  # what the loader hands over, kept for the whole step
    per += positions * 8 if cp == 1 else (2 * tokens * 8 + positions * 8 + mask) // cp  # what the step prepares
    return microbatches * per
