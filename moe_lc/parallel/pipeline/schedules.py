"""Single-direction pipeline schedules as pure functions: GPipe, 1F1B, interleaved 1F1B, ZB-H1.

Each builder returns a validated `Schedule` (see schedule_ir.py): per-rank compute actions in order,
communication inserted by the shared pass. `build_schedule(name, ...)` dispatches by name and also
reaches the bidirectional DualPipe family in dualpipe.py.

Notation: pp = pipeline ranks, m = micro-batches per step, v = chunks (virtual stages) per rank.
Micro-batches are numbered 0..m-1 and enter the pipeline in that order.
"""
from __future__ import annotations

from typing import Optional

from moe_lc.config.choices import PPSchedule, names
from moe_lc.parallel.pipeline.dualpipe import check_shape, dualpipe, dualpipev
from moe_lc.parallel.pipeline.comm_insertion import assemble
from moe_lc.parallel.pipeline.schedule_ir import B, Compute, F, Route, Schedule, W

SCHEDULE_NAMES = names(PPSchedule)


def straight_routes(pp: int, m: int) -> list[Route]:
    """Every micro-batch runs stage r on rank r, chunk 0."""
    return [tuple((r, 0) for r in range(pp))] * m


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe / all-forward-all-backward: every rank runs all m forwards, then all m backwards.

    Same bubble as 1F1B, (pp-1)(F+B), but every rank keeps m micro-batches of activations.
    """
    check_shape("gpipe", pp, m)
    compute = [[F(0, i) for i in range(m)] + [B(0, i) for i in range(m)] for _ in range(pp)]
    return assemble("gpipe", pp, m, pp, 1, straight_routes(pp, m), compute)


def _one_f_one_b_rank(pp: int, m: int, rank: int, split: bool) -> list[Compute]:
    """1F1B order on one rank; with `split`, each B is input-grad only and its W follows right after.

    Warm-up: pp-1-rank forwards. Steady: one forward, one backward. Cool-down: the remaining
    backwards.
    """
    warmup = min(pp - 1 - rank, m)
    order: list[Compute] = [F(0, i) for i in range(warmup)]
    for i in range(m - warmup):                                     # steady 1F1B
        order += [F(0, warmup + i), B(0, i)]
    order += [B(0, i) for i in range(m - warmup, m)]                # cool-down
    if not split:
        return order
    return [part for a in order for part in ((B(0, a.mb, True), W(0, a.mb)) if isinstance(a, B) else (a,))]


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): bubble (pp-1)(F+B), at most pp micro-batches in flight on rank 0."""
    check_shape("1f1b", pp, m)
    compute = [_one_f_one_b_rank(pp, m, r, split=False) for r in range(pp)]
    return assemble("1f1b", pp, m, pp, 1, straight_routes(pp, m), compute)


def zb_h1(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism") within 1F1B's memory: 1F1B with B split from
    W, each W right after its own B, rank 0's backward whole.

    Bubble (pp-1)(F+B-W) in DualPipe notation (B = full backward), any m and costs: every input
    gradient leaves W sooner than 1F1B's, at each of the pp-1 hops. The paper's ZB-H1 saves another
    W per hop, (pp-1)(F+B-2W) when W <= min(F, B-W), by deferring the last rank's W's (rank r defers
    r): then the last rank holds pp micro-batches in flight (F done, W not) where 1F1B holds 1, and
    the last stage also holds the loss head (its saved terms; the logits' gradient a W waits with),
    which no count of micro-batches bounds, so its peak can exceed 1F1B's highest (issue #63,
    recipes/debug_cpu.toml at pp 4: saved activations and transients of 26.0 MiB traced on the last
    rank against 21.6 on 1F1B's rank 0). Without that, deferring W's on the other ranks saves no time
    (tests/test_pipeline_memory.py), only adds to their peak.

    Memory: every rank holds 1F1B's in-flight micro-batches (pp - rank), plus, from a split B to its
    W, what that W needs (M_W, its Linears' inputs and output gradients: 0.8-0.9 of the micro-batch's
    saved M_B without recompute, traced) where 1F1B's backward frees them as it goes. So rank r >= 1
    peaks within 1F1B's rank 0 (pp M_B) if the stages save alike and M_W <= r M_B. Rank 0 sends no
    input gradient that a split could send sooner: its backward stays whole, its peak 1F1B's. Under
    full recompute B rebuilds the Linears' inputs and keeps them to W, M_W is 2.5-8 M_B, and ranks
    >= 1 can peak above 1F1B's highest (debug_cpu at pp 4: 10.3 MiB traced on rank 1 against 8.6).
    """
    check_shape("zbh1", pp, m)
    compute = [_one_f_one_b_rank(pp, m, r, split=r > 0) for r in range(pp)]
    return assemble("zbh1", pp, m, pp, 1, straight_routes(pp, m), compute)


def _interleaved_order(pp: int, m: int, v: int, k: int, backward: bool) -> tuple[int, int]:
    """(chunk, mb) of a rank's k-th forward (or backward) in Megatron's interleaved order.

    Micro-batches go in groups of pp: a group runs through chunk 0, then chunk 1, ... (backwards
    through chunk v-1 first), then the next group.
    """
    chunk = (k // pp) % v
    mb = (k // (pp * v)) * pp + k % pp
    return (v - 1 - chunk if backward else chunk), mb


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: v chunks per rank, stage s on rank s % pp, chunk s // pp.

    Rank r warms up with 2(pp-1-r) + (v-1)pp forwards, then alternates one forward and one
    backward, then drains. Bubble fraction (1/v)(pp-1)/m; needs m divisible by pp (as Megatron).
    """
    check_shape("interleaved_1f1b", pp, m, v)
    total = m * v
    compute = []
    for rank in range(pp):
        warmup = min(2 * (pp - 1 - rank) + (v - 1) * pp, total)
        acts: list[Compute] = [F(*_interleaved_order(pp, m, v, k, False)) for k in range(warmup)]
        for k in range(total - warmup):
            acts.append(F(*_interleaved_order(pp, m, v, warmup + k, False)))
            acts.append(B(*_interleaved_order(pp, m, v, k, True)))
        acts.extend(B(*_interleaved_order(pp, m, v, k, True)) for k in range(total - warmup, total))
        compute.append(acts)
    routes = [tuple((s % pp, s // pp) for s in range(v * pp))] * m
    return assemble("interleaved_1f1b", pp, m, v * pp, v, routes, compute)


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zbh1": zb_h1,
            "dualpipe": dualpipe, "dualpipev": dualpipev}


def build_schedule(name: str, pp: int, m: int, v: Optional[int] = None) -> Schedule:
    """Build the schedule called `name` (one of SCHEDULE_NAMES); `v` only for interleaved_1f1b."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, m, v)
    check_shape(name, pp, m, v)
    return BUILDERS[name](pp, m)
