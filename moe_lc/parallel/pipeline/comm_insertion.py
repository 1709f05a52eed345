"""Communication insertion: derive every P2P transfer of a schedule from its compute actions.

One shared pass for all builders. Slot k of a rank is the (possibly empty) CommGroup right before
its compute action k; slot len(actions) trails the last one. Placement:

* a receive goes in the slot right before its consumer (as late as possible), or before the W's
  right before it (a W neither sends nor receives), as far back as the ideal timeline has its
  producer done by then (`_receive_slot`): its sender may then send it before its own next action
  rather than after it. ZB-H1's ranks run F B W F: the previous rank, which runs its next F before
  the B that waits for this rank's, sends that F's output before its B, so that a W shorter than F
  stalls nothing under either comm model of the simulator;
* a send goes in the *last* slot of the sender posted no later than the receiver's slot completes,
  both read off the ideal timeline (`ideal_timeline`: canonical costs, transfers instant and
  non-blocking). Posting it right after its producer instead can block the sender, under rendezvous
  semantics, on a receiver that is itself waiting for a later output of the sender: 1F1B deadlocks
  when sends sit in groups of their own; even when each send shares the next receives' group,
  interleaved 1F1B deadlocks and DualPipe crosses the message order on a rank pair (see the tests).
  DeepSeek's reference delays sends by hand the same way (DualPipe's warm-up sends an F0 output only
  after the following F1).

Why this never deadlocks. Let post(G) / done(G) be a slot's post / completion times on the ideal
timeline (a receive's slot completes when its consumer starts, a hoisted one when it is posted, which
is no earlier than its producer's end); post strictly increases along a rank (every compute has
positive cost). Suppose ranks block
in a cycle: group G_i waits for its partner H_i on another rank, which is stuck at an earlier group
G_{i+1}, so done(G_{i+1}) < post(H_i). If G_{i+1} waits on a send, every later slot of its rank posts
after done(H_{i+1}) >= post(H_{i+1}), so post(H_{i+1}) < post(H_i); if it waits on a receive,
post(H_{i+1}) <= done(G_{i+1}) < post(H_i). So post(H_i) strictly decreases around the cycle:
impossible. The same monotonicity (a later receive never has an earlier send) gives both ends of
each rank pair the same message order, so FIFO matching pairs every receive with its send.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

from moe_lc.parallel.pipeline.schedule_ir import (
    B, W, CommGroup, Compute, Route, Schedule, compute_parts, dependencies, message_key, part_key,
    transfers, validate,
)


def _canonical_cost(action: Compute) -> float:
    """Placement costs: F = 1, full B = 2, input-grad B = 1, W = 1, F&B = F + B."""
    return sum(1.0 if not isinstance(part, B) else (1.0 if part.split else 2.0)
               for part in compute_parts(action))


def ideal_timeline(schedule: Schedule, cost=_canonical_cost,
                   latency: float = 0.0) -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action when transfers never block the sender.

    Each rank runs its compute actions in order (CommGroups are ignored); an action starts when the
    rank is free and every part it depends on (previous stage's F, next stage's B, own F/B) has
    finished, plus `latency` when that part ran on another rank. Raises ValueError if some action
    can never start (a dependency cycle across ranks).
    """
    compute = [[a for a in acts if not isinstance(a, CommGroup)] for acts in schedule.actions]
    times: list[list[tuple[float, float]]] = [[] for _ in compute]
    finished: dict[tuple, tuple[float, int]] = {}  # part key -> (end time, rank)
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(compute):
            while len(times[rank]) < len(acts):
                action = acts[len(times[rank])]
                keys = [part_key(schedule, rank, part) for part in compute_parts(action)]
                needs = [d for k in keys for d in dependencies(schedule, k) if d not in keys]
                if any(d not in finished for d in needs):
                    break
                arrivals = [finished[d][0] + (latency if finished[d][1] != rank else 0.0) for d in needs]
                start = max([times[rank][-1][1] if times[rank] else 0.0] + arrivals)
                end = start + cost(action)
                times[rank].append((start, end))
                finished.update((k, (end, rank)) for k in keys)
                progress = True
    for rank, acts in enumerate(compute):
        if len(times[rank]) < len(acts):
            raise ValueError(f"{schedule.name}: rank {rank}, compute action {len(times[rank])} "
                             f"({acts[len(times[rank])]}) can never start: it waits on work that waits on it")
    return times


def _receive_slot(acts: list[Compute], posted: list[float], consumer: int, produced: float) -> int:
    """The slot of a receive consumed by acts[consumer]: before the W's right before the consumer, as far
    back as a slot the ideal timeline posts (`posted`) no earlier than the producer's end (`produced`)."""
    slot = consumer
    while slot > 0 and isinstance(acts[slot - 1], W) and posted[slot - 1] >= produced:
        slot -= 1
    return slot


def insert_comm(schedule: Schedule) -> Schedule:
    """Return `schedule` with CommGroups between its compute actions (existing groups are dropped)."""
    compute = [[a for a in acts if not isinstance(a, CommGroup)] for acts in schedule.actions]
    bare = Schedule(schedule.name, schedule.pp, schedule.n_microbatches, schedule.n_stages,
                    schedule.chunks_per_rank, schedule.routes, tuple(map(tuple, compute)))
    times = ideal_timeline(bare)
    posted = [[0.0] + [end for _, end in rank_times] for rank_times in times]  # slot k posts at end of k-1
    sends, recvs = {}, {}  # message key -> (rank, slot of producer + 1 / consumer, op)
    for rank, acts in enumerate(compute):
        for k, action in enumerate(acts):
            for part in compute_parts(action):
                before, after = transfers(bare, rank, part)
                recvs.update((message_key(bare, rank, op), (rank, k, op)) for op in before)
                sends.update((message_key(bare, rank, op), (rank, k + 1, op)) for op in after)
    slots: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for key, (src, earliest, send_op) in sends.items():
        if key not in recvs:
            continue  # a send nobody consumes: validate() reports it
        dst, consumer, recv_op = recvs[key]
        at = _receive_slot(compute[dst], posted[dst], consumer, posted[src][earliest])
        # the receive's slot completes when the consumer starts (hoisted: when it is posted)
        ready = times[dst][consumer][0] if at == consumer else posted[dst][at]
        slot = max(earliest, bisect_right(posted[src], ready) - 1)
        slots[(src, slot)].append(((0, dst, at, key), send_op))
        slots[(dst, at)].append(((1, src, slot, key), recv_op))
    actions = []
    for rank, acts in enumerate(compute):
        out = []
        for k in range(len(acts) + 1):
            if slots[(rank, k)]:
                out.append(CommGroup(tuple(op for _, op in sorted(slots[(rank, k)], key=lambda e: e[0]))))
            if k < len(acts):
                out.append(acts[k])
        actions.append(tuple(out))
    return Schedule(bare.name, bare.pp, bare.n_microbatches, bare.n_stages, bare.chunks_per_rank,
                    bare.routes, tuple(actions))


def assemble(name: str, pp: int, n_microbatches: int, n_stages: int, chunks_per_rank: int,
             routes: list[Route], compute: list[list[Compute]]) -> Schedule:
    """Builders' last step: wrap per-rank compute lists, insert communication, validate."""
    bare = Schedule(name, pp, n_microbatches, n_stages, chunks_per_rank, tuple(map(tuple, routes)),
                    tuple(tuple(acts) for acts in compute))
    schedule = insert_comm(bare)
    validate(schedule)
    return schedule
