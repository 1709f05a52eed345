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
    """1F1B order on one rank; with `split`, B is input-grad only and W's are placed ZB-H1 style.

    Warm-up: pp-1-rank forwards. Steady: one forward, one backward. Cool-down: the remaining
    backwards. ZB-H1 keeps at most pp micro-batches in flight (F done, W not yet) on every rank:
    a W (oldest first) follows a B only when the rank holds pp of them, so rank r defers its first
    r W's; in the cool-down each B is followed by one W, the rest are flushed at the end.
    """
    warmup = min(pp - 1 - rank, m)
    actions: list[Compute] = [F(0, i) for i in range(warmup)]
    n_forward, n_backward, waiting_w = warmup, 0, []

    def backward() -> None:
        nonlocal n_backward
        actions.append(B(0, n_backward, split))
        if split:
            waiting_w.append(n_backward)
        n_backward += 1

    for _ in range(m - warmup):                                     # steady 1F1B
        actions.append(F(0, n_forward))
        n_forward += 1
        backward()
        if split and n_forward - (n_backward - len(waiting_w)) >= pp:
            actions.append(W(0, waiting_w.pop(0)))
    while n_backward < m:                                           # cool-down
        backward()
        if split:
            actions.append(W(0, waiting_w.pop(0)))
    actions.extend(W(0, i) for i in waiting_w)                      # flush deferred W's
    return actions


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): bubble (pp-1)(F+B), at most pp micro-batches in flight on rank 0."""
    check_shape("1f1b", pp, m)
    compute = [_one_f_one_b_rank(pp, m, r, split=False) for r in range(pp)]
    return assemble("1f1b", pp, m, pp, 1, straight_routes(pp, m), compute)


def zb_h1(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with B split from W.

    Bubble (pp-1)(F+B-2W) in DualPipe notation (B = full backward) when m >= pp and
    W <= min(F, B-W) (tests/test_pipeline_schedules.py gives the general value); peak activations pp.
    """
    check_shape("zbh1", pp, m)
    compute = [_one_f_one_b_rank(pp, m, r, split=True) for r in range(pp)]
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
