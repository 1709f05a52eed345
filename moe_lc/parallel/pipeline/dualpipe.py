"""DualPipe and DualPipeV (DeepSeek-V3) as pure schedule builders.

Both follow the step structure of DeepSeek's reference (github.com/deepseek-ai/DualPipe,
`DualPipe.step` / `DualPipeV.step`): eight named phases over four primitives, forward, backward
(full or input-grad only), weight (the oldest deferred weight gradient, FIFO as WeightGradStore)
and overlapped forward+backward. Phases are written in terms of the reference's *phase* 0/1;
`_RankProgram` maps a phase to a local chunk and hands out micro-batches in FIFO order per chunk.

DualPipe (pp even, m even, m >= 2 pp): n_stages = pp and every stage exists twice. Rank r holds
    chunk 0 = stage r of the "down" pipeline and chunk 1 = stage pp-1-r of the "up" pipeline.
    Micro-batches 0..m/2-1 go down [(0,0), (1,0), ..., (pp-1,0)], m/2..m-1 go up
    [(pp-1,1), ..., (0,1)]. In the reference, phase 0 is the down direction on the first half of
    the ranks and the up direction on the second half (chunk = phase XOR (r >= pp/2)). Down
    micro-batches enter at rank 0 and take their loss on rank pp-1, up ones the reverse. The runtime
    must sum the gradients of the two copies of each stage (rank r chunk 0 and rank pp-1-r chunk 1)
    before the optimizer step.
DualPipeV (m >= 2 pp): n_stages = 2 pp, rank r holds stage r (chunk 0) and stage 2pp-1-r
    (chunk 1); every micro-batch runs the V [(0,0), ..., (pp-1,0), (pp-1,1), ..., (0,1)], turning
    locally on rank pp-1. Phase = chunk. It is DualPipe "cut in half": the same phases with
    (ranks per half, half rank, micro-batches per direction) -> (pp, rank, m).
"""
from __future__ import annotations

from collections import deque

from moe_lc.config.rules import schedule_shape_errors
from moe_lc.parallel.pipeline.comm_insertion import assemble
from moe_lc.parallel.pipeline.schedule_ir import B, FB, Compute, F, Route, Schedule, W


class _RankProgram:
    """Accumulates one rank's compute actions from phase-level primitives."""

    def __init__(self, chunk_of_phase: tuple[int, int], mbs_of_chunk: tuple[list[int], list[int]]):
        self.actions: list[Compute] = []
        self._chunk_of_phase = chunk_of_phase
        self._mbs_of_chunk = mbs_of_chunk
        self._next = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        self._deferred_weights: deque[tuple[int, int]] = deque()  # split B's awaiting W, oldest first

    def _take(self, kind: str, phase: int) -> tuple[int, int]:
        chunk = self._chunk_of_phase[phase]
        mb = self._mbs_of_chunk[chunk][self._next[(kind, chunk)]]
        self._next[(kind, chunk)] += 1
        return chunk, mb

    def forward(self, phase: int) -> None:
        self.actions.append(F(*self._take("F", phase)))

    def backward(self, phase: int, split: bool = False) -> None:
        """Backward of the next micro-batch; `split` defers its weight gradient to a later W."""
        chunk, mb = self._take("B", phase)
        self.actions.append(B(chunk, mb, split))
        if split:
            self._deferred_weights.append((chunk, mb))

    def weight(self) -> None:
        self.actions.append(W(*self._deferred_weights.popleft()))

    def forward_backward(self, f_phase: int, b_phase: int) -> None:
        """Overlapped forward (phase f_phase) and full backward (phase b_phase), as F&B."""
        self.actions.append(FB(*self._take("F", f_phase), *self._take("B", b_phase)))


# The eight phases. n: ranks in the (half) pipeline, i: this rank's position in it, m: micro-batches
# per direction. Names follow the reference's comments (0/1 are phases).

def _phase1_forwards(p: _RankProgram, n: int, i: int) -> None:
    """nF0: fill the pipeline of phase 0; earlier ranks run more warm-up forwards."""
    for _ in range((n - i - 1) * 2):
        p.forward(0)


def _phase2_forwards_both(p: _RankProgram, n: int, i: int) -> None:
    """nF0F1: alternate forwards of both phases until the first phase-1 backward can start."""
    for _ in range(i + 1):
        p.forward(0)
        p.forward(1)


def _phase3_zero_bubble_start(p: _RankProgram, n: int, i: int) -> None:
    """nB1W1F1: input-grad backward, its weight gradient, a forward (zero-bubble fill)."""
    for _ in range(n - i - 1):
        p.backward(1, split=True)
        p.weight()
        p.forward(1)


def _phase4_main(p: _RankProgram, n: int, i: int, m: int) -> None:
    """nF0B1F1B0: the steady state, two overlapped F&B steps per iteration.

    On the turning rank (i == n-1) the first F0 and B1 run separately, as in the reference
    ("we don't overlap these two chunks to further reduce bubble size").
    """
    for step in range(m - 2 * n + i + 1):
        if step == 0 and i == n - 1:
            p.forward(0)
            p.backward(1)
        else:
            p.forward_backward(0, 1)
        p.forward_backward(1, 0)


def _phase5_drain_forwards(p: _RankProgram, n: int, i: int) -> None:
    """nB1F1B0: the last phase-1 forwards, overlapped with phase-0 backwards."""
    for _ in range(n - i - 1):
        p.backward(1)
        p.forward_backward(1, 0)


def _phase6_backwards_both(p: _RankProgram, n: int, i: int) -> None:
    """nB1B0: backwards of both phases; from the middle on they defer W (zero bubble)."""
    split = False
    for step in range(i + 1):
        if step == (i + 1) // 2 and i % 2 == 1:
            split = True
        p.backward(1, split)
        if step == (i + 1) // 2 and i % 2 == 0:
            split = True
        p.backward(0, split)


def _phase7_weights_and_backwards(p: _RankProgram, n: int, i: int) -> None:
    """nWB0: a deferred weight gradient, then an input-grad phase-0 backward."""
    for _ in range(n - i - 1):
        p.weight()
        p.backward(0, split=True)


def _phase8_weights(p: _RankProgram, n: int, i: int) -> None:
    """nW: flush the remaining deferred weight gradients."""
    for _ in range(i + 1):
        p.weight()


def _dualpipe_phases(p: _RankProgram, n: int, i: int, m: int) -> list[Compute]:
    _phase1_forwards(p, n, i)
    _phase2_forwards_both(p, n, i)
    _phase3_zero_bubble_start(p, n, i)
    _phase4_main(p, n, i, m)
    _phase5_drain_forwards(p, n, i)
    _phase6_backwards_both(p, n, i)
    _phase7_weights_and_backwards(p, n, i)
    _phase8_weights(p, n, i)
    return p.actions


def check_shape(name: str, pp: int, m: int, v: int | None = None) -> None:
    """ValueError with the recipe rule's words (moe_lc.config.rules) when a schedule cannot run this shape."""
    errors = schedule_shape_errors(name, pp, m, v)
    if errors:
        raise ValueError(errors[0])


def dualpipe(pp: int, m: int) -> Schedule:
    """DualPipe: two pipelines in opposite directions over the same pp ranks (2x parameters).

    Bubble (pp/2-1)(F&B+B-3W) when F = B-W >= W, peak activations pp+1 micro-batch-chunks
    (see simulator.py and the tests for what holds otherwise).
    """
    check_shape("dualpipe", pp, m)
    half = m // 2
    down, up = list(range(half)), list(range(half, m))
    routes: list[Route] = ([tuple((s, 0) for s in range(pp))] * half
                           + [tuple((pp - 1 - s, 1) for s in range(pp))] * half)
    compute = []
    for rank in range(pp):
        second_half = int(rank >= pp // 2)
        program = _RankProgram((second_half, 1 - second_half), (down, up))
        compute.append(_dualpipe_phases(program, pp // 2, min(rank, pp - 1 - rank), half))
    return assemble("dualpipe", pp, m, pp, 2, routes, compute)


def dualpipev(pp: int, m: int) -> Schedule:
    """DualPipeV: one V-shaped pipeline of 2pp stages on pp ranks (2 stages per rank).

    The published figures use PP = number of stages = 2pp: bubble (PP/2-1)(F&B+B-3W) =
    (pp-1)(F&B+B-3W), peak activations PP+1 = 2pp+1 micro-batch-chunks.
    """
    check_shape("dualpipev", pp, m)
    mbs = list(range(m))
    routes: list[Route] = [tuple([(s, 0) for s in range(pp)] + [(pp - 1 - s, 1) for s in range(pp)])] * m
    compute = [_dualpipe_phases(_RankProgram((0, 1), (mbs, mbs)), pp, rank, m) for rank in range(pp)]
    return assemble("dualpipev", pp, m, 2 * pp, 2, routes, compute)
