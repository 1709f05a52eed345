"""Pipeline schedules as data: actions, routes, the `Schedule` type and its validity checker.

A schedule is, per pipeline rank, an ordered list of actions. Builders (schedules.py, dualpipe.py)
write only the *compute* actions; `comm_insertion.insert_comm` derives every point-to-point
transfer from those lists and the micro-batch routes; `validate` proves the result executable. The
runtime executes the lists verbatim, the simulator times them, tools/schedule.py draws them.

Vocabulary
    stage   one of `n_stages` consecutive slices of the model (stage 0 holds the embedding).
    chunk   a stage as held by a rank, by local index 0, 1, ... (a rank may hold several).
    route   for one micro-batch, the (rank, chunk) that runs stage 0, 1, ..., n_stages-1 for it.
            DualPipe holds every stage twice (down and up copies), so routes differ per micro-batch.

Compute actions (executed by the rank that owns `chunk`)
    F(chunk, mb)             forward of `mb` through `chunk`; keeps its activations. On the last
                             stage it also computes the loss; on stage 0 its input is the data.
    B(chunk, mb, split)      backward of `mb` through `chunk`. split=False: the full backward (input
                             and weight gradients). split=True: input gradient only; the weight
                             gradient is computed later by W(chunk, mb) (zero-bubble split).
    W(chunk, mb)             weight-gradient part of a split B; frees the micro-batch's activations.
    FB(f_chunk, f_mb, b_chunk, b_mb, split)
                             DualPipe's "F&B": F(f_chunk, f_mb) and B(b_chunk, b_mb, split) run as
                             one overlapped step (e.g. one's all-to-all hidden behind the other's
                             compute). A runtime without overlap may run the F part then the B part.

Communication (inserted by `insert_comm`, never written by builders)
    P2P(op, peer, chunk, mb) with op one of
        SEND_F  send the output activation of F(chunk, mb) on this rank to `peer`
        RECV_F  receive from `peer` the input activation of F(chunk, mb) on this rank
        SEND_B  send the input gradient made by B(chunk, mb) on this rank to `peer`
        RECV_B  receive from `peer` the output gradient that B(chunk, mb) on this rank consumes
    CommGroup(ops): the P2P ops that sit between two compute actions. The runtime posts a group as
        ONE `batch_isend_irecv` and waits for all of its requests before the next action; a group
        completes only when every op in it is matched (a send needs its receive posted: rendezvous).
        Between any two ranks, sends and receives appear in the same order on both sides, so FIFO
        matching of NCCL/gloo pairs each receive with its send; `validate` checks this.
    A hand-over between two stages on the same rank (DualPipeV's turn at the last rank) is local:
    no P2P, the runtime passes the tensor from one chunk to the next (route order tells which).
    After the last action of every rank all transfers are complete: nothing is left in flight.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Union

Route = tuple[tuple[int, int], ...]  # per stage s: (rank, chunk) that runs stage s

SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"


@dataclass(frozen=True)
class F:
    """Forward of micro-batch `mb` through local chunk `chunk`."""
    chunk: int
    mb: int


@dataclass(frozen=True)
class B:
    """Backward of `mb` through `chunk`; `split` = input-gradient only (a W(chunk, mb) follows)."""
    chunk: int
    mb: int
    split: bool = False


@dataclass(frozen=True)
class W:
    """Weight-gradient part of the split backward B(chunk, mb, split=True)."""
    chunk: int
    mb: int


@dataclass(frozen=True)
class FB:
    """Overlapped F(f_chunk, f_mb) and B(b_chunk, b_mb, split): DualPipe's F&B step."""
    f_chunk: int
    f_mb: int
    b_chunk: int
    b_mb: int
    split: bool = False

    @property
    def forward(self) -> F:
        return F(self.f_chunk, self.f_mb)

    @property
    def backward(self) -> B:
        return B(self.b_chunk, self.b_mb, self.split)


@dataclass(frozen=True)
class P2P:
    """One point-to-point transfer seen from this rank; `chunk`/`mb` name the local tensor."""
    op: str
    peer: int
    chunk: int
    mb: int


@dataclass(frozen=True)
class CommGroup:
    """P2P ops posted together as one batch_isend_irecv; completes when all of them complete."""
    ops: tuple[P2P, ...]


Compute = Union[F, B, W, FB]
Action = Union[F, B, W, FB, CommGroup]


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: routes plus, per rank, the ordered actions (with comm after insert_comm).

    Attributes:
        name: builder name ("1f1b", "dualpipe", ...).
        pp: number of pipeline ranks.
        n_microbatches: micro-batches per step (all directions together).
        n_stages: consecutive model slices; each is 1/n_stages of the layers.
        chunks_per_rank: chunks (stage copies) each rank holds.
        routes: routes[mb] = (rank, chunk) per stage for micro-batch mb.
        actions: actions[rank] = the rank's ordered actions.
    """
    name: str
    pp: int
    n_microbatches: int
    n_stages: int
    chunks_per_rank: int
    routes: tuple[Route, ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def split_backward(self) -> bool:
        """Whether any backward is split into B (input grad) + W (weight grad)."""
        return any(isinstance(a, W) for acts in self.actions for a in acts)

    @property
    def param_copies(self) -> float:
        """Parameters per rank relative to 1F1B on the same pp ranks (DualPipe 2, others 1)."""
        return self.chunks_per_rank * self.pp / self.n_stages

    def stage_of(self, rank: int, chunk: int, mb: int) -> int:
        """The stage (rank, chunk) runs for `mb`; ValueError if it is not on mb's route."""
        try:
            return self.routes[mb].index((rank, chunk))
        except (ValueError, IndexError):
            raise ValueError(f"(rank {rank}, chunk {chunk}) is not on the route of micro-batch {mb}") from None


def compute_parts(action: Compute) -> tuple[Union[F, B, W], ...]:
    """The elementary F/B/W parts of a compute action (an FB has two)."""
    return (action.forward, action.backward) if isinstance(action, FB) else (action,)


def part_key(schedule: Schedule, rank: int, part: Union[F, B, W]) -> tuple[str, int, int]:
    """("F"|"B"|"W", stage, mb): what an elementary part does, independent of where it runs."""
    return type(part).__name__, schedule.stage_of(rank, part.chunk, part.mb), part.mb


def dependencies(schedule: Schedule, key: tuple[str, int, int]) -> list[tuple[str, int, int]]:
    """Part keys whose results `key` consumes: the previous stage's F, the next stage's B, own F/B."""
    kind, stage, mb = key
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "B":
        return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < schedule.n_stages - 1 else [])
    return [("B", stage, mb)]


def transfers(schedule: Schedule, rank: int, part: Union[F, B, W]) -> tuple[list[P2P], list[P2P]]:
    """(receives needed before, sends produced after) one elementary part on `rank`."""
    if isinstance(part, W):
        return [], []
    route = schedule.routes[part.mb]
    s = schedule.stage_of(rank, part.chunk, part.mb)
    before = s - 1 if isinstance(part, F) else s + 1  # where the input comes from
    after = s + 1 if isinstance(part, F) else s - 1   # where the output goes
    recv_op, send_op = (RECV_F, SEND_F) if isinstance(part, F) else (RECV_B, SEND_B)
    recvs, sends = [], []
    if 0 <= before < schedule.n_stages and route[before][0] != rank:
        recvs.append(P2P(recv_op, route[before][0], part.chunk, part.mb))
    if 0 <= after < schedule.n_stages and route[after][0] != rank:
        sends.append(P2P(send_op, route[after][0], part.chunk, part.mb))
    return recvs, sends


def message_key(schedule: Schedule, rank: int, op: P2P) -> tuple:
    """Identity of the transfer an op belongs to: (sender, receiver, "F"|"B", mb, sender's stage)."""
    stage = schedule.stage_of(rank, op.chunk, op.mb)
    if op.op in (SEND_F, SEND_B):
        return rank, op.peer, op.op[-1], op.mb, stage
    return op.peer, rank, op.op[-1], op.mb, stage - 1 if op.op == RECV_F else stage + 1


def validate(schedule: Schedule) -> None:
    """Check that `schedule` is complete, ordered, matched and deadlock-free; ValueError otherwise.

    Checked in this order, the first violation is reported with its rank and action index:
      1. routes: one (rank, chunk) per stage, each (rank, chunk) always holds the same stage;
      2. coverage: every (stage, mb) has exactly one F and one B, and one W iff its B is split;
      3. order on a rank: F before B before W of the same (stage, mb); same-rank route hand-overs
         in route order (F of stage s before F of s+1, B of s+1 before B of s);
      4. comm: every cross-rank hand-over has exactly one send after its producer and one receive
         before its consumer, with the right peers, in the same order on both ends of a rank pair;
      5. progress: executing all ranks with rendezvous groups (see module doc) terminates.
    """
    _check_routes(schedule)
    positions = _check_coverage(schedule)
    _check_order(schedule, positions)
    ends = _check_comm(schedule, positions)
    _check_progress(schedule, ends)


def _fail(schedule: Schedule, rank: int, index: int, what: str) -> None:
    action = schedule.actions[rank][index] if index < len(schedule.actions[rank]) else None
    raise ValueError(f"{schedule.name}: rank {rank}, action {index} ({action}): {what}")


def _check_routes(schedule: Schedule) -> None:
    if len(schedule.actions) != schedule.pp or len(schedule.routes) != schedule.n_microbatches:
        raise ValueError(f"{schedule.name}: need {schedule.pp} action lists and {schedule.n_microbatches} "
                         f"routes, got {len(schedule.actions)} and {len(schedule.routes)}")
    holds: dict[tuple[int, int], int] = {}
    for mb, route in enumerate(schedule.routes):
        if len(route) != schedule.n_stages:
            raise ValueError(f"{schedule.name}: route of micro-batch {mb} has {len(route)} stages, "
                             f"expected {schedule.n_stages}")
        for stage, (rank, chunk) in enumerate(route):
            if not (0 <= rank < schedule.pp and 0 <= chunk < schedule.chunks_per_rank):
                raise ValueError(f"{schedule.name}: micro-batch {mb} stage {stage} is on invalid "
                                 f"(rank {rank}, chunk {chunk})")
            if holds.setdefault((rank, chunk), stage) != stage:
                raise ValueError(f"{schedule.name}: (rank {rank}, chunk {chunk}) runs stage {stage} for "
                                 f"micro-batch {mb} but stage {holds[(rank, chunk)]} for another")


def _check_coverage(schedule: Schedule) -> dict[tuple, tuple[int, int]]:
    """Map ("F"|"B"|"W", stage, mb) -> (rank, index) of the action doing it."""
    positions: dict[tuple, tuple[int, int]] = {}
    split: dict[tuple[int, int], bool] = {}
    for rank, acts in enumerate(schedule.actions):
        for i, action in enumerate(acts):
            if isinstance(action, CommGroup):
                continue
            if not isinstance(action, (F, B, W, FB)):
                _fail(schedule, rank, i, "unknown action type")
            for part in compute_parts(action):
                if not 0 <= part.mb < schedule.n_microbatches:
                    _fail(schedule, rank, i, f"micro-batch {part.mb} out of range")
                try:
                    stage = schedule.stage_of(rank, part.chunk, part.mb)
                except ValueError as err:
                    _fail(schedule, rank, i, str(err))
                key = (type(part).__name__, stage, part.mb)
                if key in positions:
                    _fail(schedule, rank, i, f"second {key[0]} of stage {stage}, micro-batch {part.mb} "
                                             f"(first at rank {positions[key][0]}, action {positions[key][1]})")
                positions[key] = (rank, i)
                if isinstance(part, B):
                    split[(stage, part.mb)] = part.split
    for mb, route in enumerate(schedule.routes):
        for stage, (rank, chunk) in enumerate(route):
            for kind in ("F", "B") + (("W",) if split.get((stage, mb)) else ()):
                if (kind, stage, mb) not in positions:
                    raise ValueError(f"{schedule.name}: rank {rank} never runs {kind}(chunk={chunk}, mb={mb}) "
                                     f"(stage {stage})")
            if ("W", stage, mb) in positions and not split.get((stage, mb)):
                _fail(schedule, *positions[("W", stage, mb)], "W of a backward that was not split")
    return positions


def _check_order(schedule: Schedule, positions: dict[tuple, tuple[int, int]]) -> None:
    last = schedule.n_stages - 1
    for (kind, stage, mb), (rank, i) in sorted(positions.items(), key=lambda kv: kv[1]):
        route = schedule.routes[mb]
        needs = []
        if kind == "B":
            needs.append(("F", stage, mb))
            if stage < last and route[stage + 1][0] == rank:
                needs.append(("B", stage + 1, mb))
        elif kind == "W":
            needs.append(("B", stage, mb))
        elif stage > 0 and route[stage - 1][0] == rank:
            needs.append(("F", stage - 1, mb))
        for need in needs:
            if positions[need][1] >= i:
                _fail(schedule, rank, i, f"{kind} of stage {stage}, mb {mb} runs before (or with) {need[0]} of "
                                         f"stage {need[1]}, which it needs (action {positions[need][1]})")


def _check_comm(schedule: Schedule, positions: dict[tuple, tuple[int, int]]) -> dict[tuple, tuple[int, int]]:
    """Check sends/receives; return message end -> (rank, index of its group) for both ends."""
    ends: dict[tuple, tuple[int, int]] = {}
    channels: dict[tuple, list[tuple]] = defaultdict(list)  # (src, dst, "send"|"recv") -> keys in order
    for rank, acts in enumerate(schedule.actions):
        for i, action in enumerate(acts):
            for op in action.ops if isinstance(action, CommGroup) else ():
                is_send = op.op in (SEND_F, SEND_B)
                if op.op not in (SEND_F, RECV_F, SEND_B, RECV_B) or not 0 <= op.peer < schedule.pp:
                    _fail(schedule, rank, i, f"malformed {op}")
                try:
                    key = message_key(schedule, rank, op)
                except ValueError as err:
                    _fail(schedule, rank, i, f"{op}: {err}")
                _, _, kind, mb, src_stage = key
                dst_stage = src_stage + 1 if kind == "F" else src_stage - 1
                route = schedule.routes[mb]
                if not 0 <= dst_stage < schedule.n_stages or route[dst_stage][0] == route[src_stage][0] \
                        or route[dst_stage if is_send else src_stage][0] != op.peer:
                    _fail(schedule, rank, i, f"{op} does not cross to the neighbouring stage's rank")
                local_stage, verb = (src_stage, "producer") if is_send else (dst_stage, "consumer")
                at = positions[(kind, local_stage, mb)][1]
                if (at >= i) if is_send else (at <= i):
                    _fail(schedule, rank, i, f"{op} is placed {'before' if is_send else 'after'} its {verb} "
                                             f"(action {at})")
                end = key + (("send",) if is_send else ("recv",))
                if end in ends:
                    _fail(schedule, rank, i, f"duplicate {op}")
                ends[end] = (rank, i)
                channels[key[:2] + end[-1:]].append(key)
    for mb, route in enumerate(schedule.routes):
        for s in range(schedule.n_stages - 1):
            (a, _), (b, _) = route[s], route[s + 1]
            for key in ((a, b, "F", mb, s), (b, a, "B", mb, s + 1)):
                for side in ("send", "recv"):
                    if a != b and key + (side,) not in ends:
                        producer = positions[(key[2], key[4], mb)]
                        _fail(schedule, *producer, f"no {side} of its {key[2]} output from rank {key[0]} to rank "
                                                   f"{key[1]} (stage {key[4]}, micro-batch {mb})")
    for (src, dst, side), keys in channels.items():
        if side == "send":
            for n, (sent, received) in enumerate(zip(keys, channels[(src, dst, "recv")])):
                if sent != received:
                    _fail(schedule, *ends[received + ("recv",)], f"receives message {received[2:4]} from rank "
                          f"{src} as its #{n} on that pair, but rank {src} sends {sent[2:4]} as #{n}")
    return ends


def _check_progress(schedule: Schedule, ends: dict[tuple, tuple[int, int]]) -> None:
    """Run all ranks with blocking groups; a group proceeds once every partner group is posted."""
    partner = {end: ends[end[:-1] + ("recv" if end[-1] == "send" else "send",)] for end in ends}
    waits: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for end, where in ends.items():
        waits[where].append(partner[end])
    pos, posted = [0] * schedule.pp, set()
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(schedule.actions):
            while pos[rank] < len(acts):
                here = (rank, pos[rank])
                if isinstance(acts[pos[rank]], CommGroup):
                    posted.add(here)
                    if not all(w in posted for w in waits[here]):
                        break
                pos[rank] += 1
                progress = True
    for rank, acts in enumerate(schedule.actions):
        if pos[rank] < len(acts):
            missing = [w for w in waits[(rank, pos[rank])] if w not in posted]
            _fail(schedule, rank, pos[rank], "deadlock: this group waits for partner groups that are never "
                  f"posted: " + ", ".join(f"rank {r} action {i} (rank {r} is stuck at action {pos[r]})"
                                           for r, i in missing))

