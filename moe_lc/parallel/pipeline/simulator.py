"""Time a pipeline schedule: makespan, per-rank busy time and bubble, peak activations, timeline.

Costs follow the DualPipe README notation, per action on one chunk:
    F   forward of one micro-batch through one chunk;
    B   FULL backward of one chunk (input and weight gradients);
    W   the weight-gradient part of B;
    FB  an overlapped forward + full backward pair (DualPipe's F&B); default F + B (no overlap).
So an action B(split=False) costs B, an input-grad-only B(split=True) costs B - W, a W costs W, an
FB costs FB (FB - W when its backward is split). Schedules without split backward (GPipe, 1F1B,
interleaved) only use B = full backward. `comm` is the latency of one cross-rank transfer.

Two execution models:
    "dataflow"    (default) the schedule as the published formulas see it: each rank runs its compute
                  actions in order; an action starts when the rank is free and its inputs have
                  arrived (producer end + comm). Sends never block. CommGroups are not consulted.
    "rendezvous"  the lists executed literally, as the runtime will: a CommGroup is posted when the
                  rank reaches it and completes when every op in it is matched by a posted partner
                  (+ comm); the rank waits for it. Shows stalls the comm placement costs.

Activation memory unit: one micro-batch's stashed activations for one chunk. They are live from the
start of its F until the end of its W when the backward is split, else until the end of its B.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_lc.parallel.pipeline.comm_insertion import ideal_timeline
from moe_lc.parallel.pipeline.schedule_ir import (
    B, F, FB, W, Action, CommGroup, Compute, Schedule, compute_parts, message_key,
)


@dataclass(frozen=True)
class Costs:
    """Per-chunk action durations (see module doc). FB=None means F + B (no overlap)."""
    F: float = 1.0
    B: float = 2.0
    W: float = 1.0
    FB: Optional[float] = None
    comm: float = 0.0

    def __post_init__(self):
        if not (self.F > 0 and self.B > self.W >= 0 and self.comm >= 0 and self.overlapped > self.W):
            raise ValueError(f"costs need F > 0, B > W >= 0, FB > W, comm >= 0; got {self}")

    @property
    def overlapped(self) -> float:
        """Duration of an overlapped forward + full backward pair (F&B)."""
        return self.F + self.B if self.FB is None else self.FB

    def duration(self, action: Compute) -> float:
        if isinstance(action, FB):
            return self.overlapped - (self.W if action.split else 0.0)
        if isinstance(action, B):
            return self.B - self.W if action.split else self.B
        return self.W if isinstance(action, W) else self.F

    @classmethod
    def parse(cls, text: str) -> "Costs":
        """Costs from "F=1,B=2,W=1,FB=2.5[,comm=0.1]"."""
        fields = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, _, value = item.partition("=")
            if key not in ("F", "B", "W", "FB", "comm"):
                raise ValueError(f"unknown cost {key!r} in {text!r}; use F, B, W, FB, comm")
            fields[key] = float(value)
        return cls(**fields)


@dataclass(frozen=True)
class Interval:
    """One action on one rank's timeline."""
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    """What `simulate` measured; per-rank tuples are indexed by pipeline rank.

    bubble[r] = makespan - busy[r]: idle time of rank r (comm waits included).
    published_bubble: the bubble as the published tables count it, one number per schedule: the idle
        time of the most idle rank. It equals every rank's idle time for GPipe, 1F1B, ZB-H1 and
        interleaved 1F1B; in DualPipe(V) ranks overlap a different number of F&B pairs, so their
        busy time differs while the makespan is shared, and the published (PP/2-1)(F&B+B-3W) is the
        idle time of the turning ranks (pp/2-1 and pp/2, DualPipeV: pp-1), which run their first
        F and B un-overlapped; the outer ranks idle less.
    bubble_fraction: published_bubble / (makespan - published_bubble), the idle share relative to
        that rank's compute, as Megatron's (1/v)(pp-1)/m.
    peak_activations[r]: micro-batch x chunk units (see module doc).
    param_copies: parameters per rank relative to 1F1B on the same number of ranks.
    timeline[r]: the rank's actions with start/end times (CommGroups too in "rendezvous").
    """
    name: str
    pp: int
    n_microbatches: int
    comm_model: str
    makespan: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    peak_activations: tuple[int, ...]
    param_copies: float
    timeline: tuple[tuple[Interval, ...], ...]

    @property
    def published_bubble(self) -> float:
        return max(self.bubble)

    @property
    def bubble_fraction(self) -> float:
        return self.published_bubble / (self.makespan - self.published_bubble)


def simulate(schedule: Schedule, costs: Costs = Costs(), comm_model: str = "dataflow") -> SimResult:
    """Time `schedule` under `costs` (see module doc for the two comm models)."""
    if comm_model == "dataflow":
        times = ideal_timeline(schedule, costs.duration, costs.comm)
        compute = [[a for a in acts if not isinstance(a, CommGroup)] for acts in schedule.actions]
        timeline = [[Interval(s, e, a) for (s, e), a in zip(t, acts)] for t, acts in zip(times, compute)]
    elif comm_model == "rendezvous":
        timeline = _rendezvous_timeline(schedule, costs)
    else:
        raise ValueError(f"comm_model must be 'dataflow' or 'rendezvous', got {comm_model!r}")
    makespan = max((iv.end for rank in timeline for iv in rank), default=0.0)
    busy = tuple(sum(iv.end - iv.start for iv in rank if not isinstance(iv.action, CommGroup))
                 for rank in timeline)
    return SimResult(
        name=schedule.name, pp=schedule.pp, n_microbatches=schedule.n_microbatches, comm_model=comm_model,
        makespan=makespan, busy=busy, bubble=tuple(makespan - b for b in busy),
        peak_activations=peak_activations(schedule), param_copies=schedule.param_copies,
        timeline=tuple(map(tuple, timeline)))


def _rendezvous_timeline(schedule: Schedule, costs: Costs) -> list[list[Interval]]:
    """Execute the lists literally: a group ends once every op's partner group is posted, + comm."""
    where: dict[tuple, tuple[int, int]] = {}  # (message key, is_send) -> (rank, action index)
    for rank, acts in enumerate(schedule.actions):
        for i, action in enumerate(acts):
            for op in action.ops if isinstance(action, CommGroup) else ():
                where[(message_key(schedule, rank, op), op.op.startswith("SEND"))] = (rank, i)
    posted: dict[tuple[int, int], float] = {}
    timeline: list[list[Interval]] = [[] for _ in schedule.actions]
    clock = [0.0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(schedule.actions):
            while len(timeline[rank]) < len(acts):
                i = len(timeline[rank])
                action, start = acts[i], clock[rank]
                if isinstance(action, CommGroup):
                    posted.setdefault((rank, i), start)
                    partners = [where[(message_key(schedule, rank, op), not op.op.startswith("SEND"))]
                                for op in action.ops]
                    if any(p not in posted for p in partners):
                        break
                    end = max(max(start, posted[p]) + costs.comm for p in partners)
                else:
                    end = start + costs.duration(action)
                timeline[rank].append(Interval(start, end, action))
                clock[rank] = end
                progress = True
    stuck = [r for r, acts in enumerate(schedule.actions) if len(timeline[r]) < len(acts)]
    if stuck:
        raise ValueError(f"{schedule.name}: deadlock in rendezvous execution at rank {stuck[0]}, "
                         f"action {len(timeline[stuck[0]])}; run validate() for details")
    return timeline


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most micro-batch x chunk activations alive at once (F start .. W/full-B end)."""
    peaks = []
    for acts in schedule.actions:
        live, peak = 0, 0
        for action in acts:
            parts = () if isinstance(action, CommGroup) else compute_parts(action)
            live += sum(1 for p in parts if isinstance(p, F))
            peak = max(peak, live)
            live -= sum(1 for p in parts if isinstance(p, W) or (isinstance(p, B) and not p.split))
        peaks.append(peak)
    return tuple(peaks)


@dataclass(frozen=True)
class Published:
    """The published figures for a schedule, in this module's units, and when they hold."""
    bubble: float             # idle time of the most idle rank (see SimResult.published_bubble)
    peak_activations: int     # micro-batch x chunk units, on the rank holding the most
    param_copies: float       # parameters per rank relative to 1F1B on the same ranks
    holds_when: str


def published_figures(schedule: Schedule, costs: Costs) -> Published:
    """The README / paper formulas evaluated for `schedule` (DualPipe README notation); ZB-H1's is
    the paper's plus the (pp-1)W that keeping within 1F1B's memory costs (schedules.zb_h1).

    DualPipeV is tabulated with PP = its number of stages (2 pp) on PP/2 devices, so its bubble is
    (PP/2-1)(F&B+B-3W) = (pp-1)(F&B+B-3W) and its activations PP+1 = 2pp+1 chunks. The README's "2x
    parameters" for it compares with 1F1B on 2pp devices; on the same pp devices it holds 1x.
    """
    pp, m, v = schedule.pp, schedule.n_microbatches, schedule.chunks_per_rank
    f, b, w, fb = costs.F, costs.B, costs.W, costs.overlapped
    name = schedule.name
    if name in ("gpipe", "1f1b"):
        return Published((pp - 1) * (f + b), m if name == "gpipe" else min(pp, m), 1.0, "always")
    if name == "zbh1":  # the paper's (pp-1)(F+B-2W) + (pp-1)W: ours runs each W right after its B (schedules.py)
        return Published((pp - 1) * (f + b - w), min(pp, m), 1.0, "always")
    if name == "interleaved_1f1b":  # fraction (1/v)(pp-1)/m of the m*v*(F+B) compute, F/B per chunk
        return Published((pp - 1) * (f + b), min(v * pp + pp - 1, m * v), 1.0, "always (m divisible by pp)")
    if name in ("dualpipe", "dualpipev"):
        stages = schedule.n_stages
        return Published((stages / 2 - 1) * (fb + b - 3 * w), stages + 1, float(schedule.param_copies),
                         "F = B - W >= W (forward as long as the input-grad backward, W no longer)")
    raise ValueError(f"no published figures for schedule {name!r}")
