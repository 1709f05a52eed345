"""Pipeline schedules as data: builders, comm insertion, validation, simulator, drawing tool.

Published numbers (the DualPipe README, github.com/deepseek-ai/DualPipe, and its notation: F forward chunk,
B FULL backward chunk, W its weight-gradient part, F&B an overlapped pair) are asserted against the
simulator with zero comm cost. Where a formula holds only under a condition, the test says which
and asserts what the simulator shows outside it.
"""
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lc.parallel.pipeline import (
    B, F, FB, RECV_F, SEND_F, W, CommGroup, Costs, P2P, build_schedule, dualpipe, dualpipev,
    insert_comm, interleaved_1f1b, one_f_one_b, published_figures, simulate, validate,
)

REPO = Path(__file__).resolve().parents[1]

# F = B - W in all of these: the forward takes as long as the input-grad backward (see DualPipe tests).
COSTS = [Costs(F=1, B=2, W=1, FB=2.5), Costs(F=2, B=3, W=1, FB=4), Costs(F=1, B=1.5, W=0.5, FB=2),
         Costs(F=1.5, B=2, W=0.5, FB=3)]
PPS = [4, 8]


def _all_equal(values, target):
    return all(math.isclose(v, target, abs_tol=1e-9) for v in values)


# ---------------------------------------------------------------- builders produce valid schedules

GRID = (
    [(name, pp, m, None) for name in ("gpipe", "1f1b", "zbh1") for pp in (1, 2, 3, 4, 8)
     for m in (1, 2, pp, 2 * pp + 1)]
    + [("interleaved_1f1b", pp, m, v) for pp in (1, 2, 4, 8) for v in (2, 3) for m in (pp, 2 * pp, 3 * pp)]
    + [("dualpipe", pp, m, None) for pp in (2, 4, 6, 8) for m in (2 * pp, 2 * pp + 2, 3 * pp)]
    + [("dualpipev", pp, m, None) for pp in (1, 2, 3, 4, 8) for m in (2 * pp, 2 * pp + 1, 3 * pp)]
)


@pytest.mark.parametrize("name,pp,m,v", GRID)
def test_every_builder_output_validates(name, pp, m, v):
    schedule = build_schedule(name, pp, m, v)
    validate(schedule)  # builders validate too; check again on the returned object
    assert len(schedule.actions) == pp and len(schedule.routes) == m
    # Deterministic: a pure function of its arguments.
    assert build_schedule(name, pp, m, v) == schedule


@pytest.mark.parametrize("name,pp,m,v", [g for g in GRID if g[1] > 1])
def test_receives_sit_right_before_their_consumer(name, pp, m, v):
    """The comm pass puts every receive in the group just before the compute that consumes it, or
    before W's only (which neither send nor receive) right before it, and never leaves two groups
    side by side (one batch_isend_irecv between two computes)."""
    schedule = build_schedule(name, pp, m, v)
    for rank, acts in enumerate(schedule.actions):
        for i, action in enumerate(acts):
            for op in action.ops if isinstance(action, CommGroup) else ():
                if op.op.startswith("RECV"):
                    k = i + 1
                    while k < len(acts) and isinstance(acts[k], (W, CommGroup)):
                        k += 1
                    assert k < len(acts) and _consumes(acts[k], op), (rank, i, op)
        assert not any(isinstance(a, CommGroup) and isinstance(b, CommGroup) for a, b in zip(acts, acts[1:]))


@pytest.mark.parametrize("name,pp,m,v", [("1f1b", 4, 8, None), ("zbh1", 8, 16, None),
                                         ("dualpipe", 8, 20, None), ("dualpipev", 4, 10, None)])
@pytest.mark.parametrize("costs", COSTS[:3])
def test_comm_placement_costs_nothing_under_rendezvous(name, pp, m, v, costs):
    """Executing the groups literally (sends block until the receive is posted) loses no time here."""
    schedule = build_schedule(name, pp, m, v)
    assert simulate(schedule, costs, "rendezvous").makespan == simulate(schedule, costs).makespan


@pytest.mark.parametrize("name,pp,m,v", [g for g in GRID if g[1] > 1][::5])
def test_rendezvous_never_beats_dataflow(name, pp, m, v):
    schedule = build_schedule(name, pp, m, v)
    costs = Costs(F=2, B=3, W=1, FB=4, comm=0.25)
    assert simulate(schedule, costs, "rendezvous").makespan >= simulate(schedule, costs).makespan - 1e-9


# ---------------------------------------------------------------- published bubbles

@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("costs", COSTS)
def test_1f1b_and_gpipe_bubble(pp, costs):
    for m in (pp, 2 * pp, 3 * pp + 1):
        for name in ("1f1b", "gpipe"):
            result = simulate(build_schedule(name, pp, m), costs)
            assert _all_equal(result.bubble, (pp - 1) * (costs.F + costs.B)), (name, m, result.bubble)


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("costs", COSTS)
def test_zbh1_bubble(pp, costs):
    """(pp-1)(F+B-W), any m: each input gradient leaves W sooner than under 1F1B at each of the pp-1 hops.
    The paper's (pp-1)(F+B-2W) also defers the last rank's W's, which hold more than 1F1B does there
    (tests/test_pipeline_memory.py)."""
    formula = (pp - 1) * (costs.F + costs.B - costs.W)
    for m in (1, pp // 2, pp - 1, pp, 2 * pp, 3 * pp + 1):
        assert _all_equal(simulate(build_schedule("zbh1", pp, m), costs).bubble, formula), m
    assert formula < (pp - 1) * (costs.F + costs.B)
    assert math.isclose(published_figures(build_schedule("zbh1", pp, pp), costs).bubble, formula)


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_fraction(pp, costs, v):
    for m in (pp, 2 * pp, 4 * pp):
        result = simulate(interleaved_1f1b(pp, m, v), costs)  # F, B per chunk = 1/v of a stage
        assert _all_equal(result.bubble, (pp - 1) * (costs.F + costs.B))
        assert math.isclose(result.bubble_fraction, (pp - 1) / (v * m))


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("costs", COSTS)
def test_dualpipe_bubble(pp, costs):
    """(PP/2-1)(F&B+B-3W) is the idle time of the most idle ranks: the two middle ("turning") ranks.

    Ranks overlap different numbers of F&B pairs, so busy time differs per rank under a shared
    makespan; outer ranks run more un-overlapped F and B and idle less.
    """
    formula = (pp / 2 - 1) * (costs.overlapped + costs.B - 3 * costs.W)
    for m in (2 * pp, 2 * pp + 2, 4 * pp):
        result = simulate(dualpipe(pp, m), costs)
        assert math.isclose(result.published_bubble, formula), (m, result.bubble)
        assert math.isclose(result.bubble[pp // 2 - 1], formula) and math.isclose(result.bubble[pp // 2], formula)
        assert all(b <= formula + 1e-9 for b in result.bubble)
        assert math.isclose(published_figures(dualpipe(pp, m), costs).bubble, formula)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("costs", COSTS)
def test_dualpipev_bubble(pp, costs):
    """DualPipeV is tabulated with PP = number of stages = 2pp (on PP/2 devices): (pp-1)(F&B+B-3W).

    It is DualPipe cut in half, so its timing equals DualPipe on 2pp ranks (the V's lower half is
    DualPipe's mirror image).
    """
    formula = (pp - 1) * (costs.overlapped + costs.B - 3 * costs.W)
    for m in (2 * pp, 2 * pp + 1, 4 * pp):
        result = simulate(dualpipev(pp, m), costs)
        assert math.isclose(result.published_bubble, formula), (m, result.bubble)
        assert math.isclose(result.bubble[pp - 1], formula)
        if m % 2 == 0:
            assert math.isclose(result.makespan, simulate(dualpipe(2 * pp, 2 * m), costs).makespan)


@pytest.mark.parametrize("pp", PPS)
def test_dualpipe_formula_assumes_forward_equals_input_backward(pp):
    """The DualPipe formula counts warm-up and cool-down holes assuming a forward chunk lasts as long
    as an input-grad backward chunk (F = B - W, the zero-bubble paper's convention) and W <= F; all of
    COSTS satisfy that. Otherwise the chains of forwards and of input-grad backwards crossing the
    pipeline take different times and the holes no longer add up to the formula. Measured: a slower
    forward (or a W longer than F) leaves more idle time than the formula, a slower input-grad
    backward less.
    """
    slow_forward = Costs(F=3, B=3, W=1, FB=4)     # F = 3 > B - W = 2
    slow_backward = Costs(F=1, B=3, W=1, FB=3.5)  # F = 1 < B - W = 2
    long_weight = Costs(F=1, B=3, W=2, FB=3.5)    # F = B - W = 1 < W = 2
    for costs, sign in ((slow_forward, +1), (slow_backward, -1), (long_weight, +1)):
        formula = (pp / 2 - 1) * (costs.overlapped + costs.B - 3 * costs.W)
        measured = simulate(dualpipe(pp, 3 * pp), costs).published_bubble
        assert sign * (measured - formula) > 0, (costs, measured, formula)


# ---------------------------------------------------------------- memory and parameters

@pytest.mark.parametrize("pp", PPS)
def test_peak_activations(pp):
    """Unit: one micro-batch's stash for one chunk, live from F start to W end (or full-B end)."""
    m = 3 * pp
    assert simulate(one_f_one_b(pp, m)).peak_activations == tuple(pp - r for r in range(pp))
    assert simulate(build_schedule("zbh1", pp, m)).peak_activations == tuple(pp - r for r in range(pp))
    assert simulate(build_schedule("gpipe", pp, m)).peak_activations == (m,) * pp
    for v in (2, 3):  # chunk units; x(1 + (pp-1)/(pp v)) of 1F1B's pp*v chunk units
        peak0 = simulate(interleaved_1f1b(pp, m, v)).peak_activations[0]
        assert peak0 == v * pp + pp - 1
        assert math.isclose(peak0 / (v * pp), 1 + (pp - 1) / (pp * v))
    for mb in (2 * pp, 2 * pp + 2, 4 * pp):
        assert simulate(dualpipe(pp, mb)).peak_activations == (pp + 1,) * pp
    for mb in (2 * (pp // 2), 3 * (pp // 2)):  # DualPipeV on pp//2 ranks: PP+1 with PP = its 2*(pp//2) stages
        assert max(simulate(dualpipev(pp // 2, mb)).peak_activations) == pp + 1


def test_parameter_copies():
    assert simulate(dualpipe(8, 20)).param_copies == 2.0      # every stage held twice
    assert simulate(one_f_one_b(8, 20)).param_copies == 1.0
    assert simulate(interleaved_1f1b(4, 8, 2)).param_copies == 1.0
    # The README's "2x" for DualPipeV compares with 1F1B on PP = 2pp devices (same stage size): each
    # DualPipeV rank holds two stages. On the same pp ranks it holds as many parameters as 1F1B.
    v_sched = dualpipev(4, 8)
    assert v_sched.chunks_per_rank == 2 and v_sched.n_stages == 8 and v_sched.param_copies == 1.0


# ---------------------------------------------------------------- DualPipe follows the reference order

def _reference_dualpipe_steps(n, i, m, turning):
    """Tokens of deepseek-ai/DualPipe `step()` for one rank, transcribed loop by loop.

    n: ranks per half (DualPipeV: ranks), i: half_rank (DualPipeV: rank), m: chunks per direction.
    Tokens: ("F", phase), ("B", phase, zb), ("W",), ("FB", f_phase, b_phase).
    """
    out = []
    out += [("F", 0)] * ((n - i - 1) * 2)                                          # step 1
    for _ in range(i + 1):                                                          # step 2
        out += [("F", 0), ("F", 1)]
    for _ in range(n - i - 1):                                                      # step 3
        out += [("B", 1, True), ("W",), ("F", 1)]
    for k in range(m - 2 * n + i + 1):                                              # step 4
        out += [("F", 0), ("B", 1, False)] if (k == 0 and turning) else [("FB", 0, 1)]
        out += [("FB", 1, 0)]
    for _ in range(n - i - 1):                                                      # step 5
        out += [("B", 1, False), ("FB", 1, 0)]
    zb = False
    for k in range(i + 1):                                                          # step 6
        if k == (i + 1) // 2 and i % 2 == 1:
            zb = True
        out.append(("B", 1, zb))
        if k == (i + 1) // 2 and i % 2 == 0:
            zb = True
        out.append(("B", 0, zb))
    for _ in range(n - i - 1):                                                      # step 7
        out += [("W",), ("B", 0, True)]
    out += [("W",)] * (i + 1)                                                       # step 8
    return out


def _tokens(schedule, rank, phase_of_chunk):
    out = []
    for a in schedule.actions[rank]:
        if isinstance(a, F):
            out.append(("F", phase_of_chunk[a.chunk]))
        elif isinstance(a, B):
            out.append(("B", phase_of_chunk[a.chunk], a.split))
        elif isinstance(a, W):
            out.append(("W",))
        elif isinstance(a, FB):
            assert not a.split  # the reference never defers W inside an F&B
            out.append(("FB", phase_of_chunk[a.f_chunk], phase_of_chunk[a.b_chunk]))
    return out


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (6, 14), (8, 20), (8, 32)])
def test_dualpipe_matches_reference_order(pp, m):
    schedule = dualpipe(pp, m)
    for rank in range(pp):
        second_half = rank >= pp // 2
        half_rank = min(rank, pp - 1 - rank)
        expected = _reference_dualpipe_steps(pp // 2, half_rank, m // 2, half_rank == pp // 2 - 1)
        assert _tokens(schedule, rank, {0: int(second_half), 1: 1 - int(second_half)}) == expected, rank


@pytest.mark.parametrize("pp,m", [(1, 2), (2, 4), (4, 8), (4, 11), (8, 20)])
def test_dualpipev_matches_reference_order(pp, m):
    schedule = dualpipev(pp, m)
    for rank in range(pp):
        assert _tokens(schedule, rank, {0: 0, 1: 1}) == _reference_dualpipe_steps(pp, rank, m, rank == pp - 1)


@pytest.mark.parametrize("name,pp,m", [("dualpipe", 8, 20), ("dualpipev", 4, 10), ("zbh1", 4, 8)])
def test_micro_batches_fifo_per_chunk_and_weights_fifo(name, pp, m):
    """Forwards and backwards of a chunk take micro-batches in order; W's follow split B's FIFO."""
    schedule = build_schedule(name, pp, m)
    for acts in schedule.actions:
        parts = [p for a in acts if not isinstance(a, CommGroup)
                 for p in ((a.forward, a.backward) if isinstance(a, FB) else (a,))]
        for kind in (F, B):
            for chunk in range(schedule.chunks_per_rank):
                mbs = [p.mb for p in parts if isinstance(p, kind) and p.chunk == chunk]
                assert mbs == sorted(mbs)
        split = [(p.chunk, p.mb) for p in parts if isinstance(p, B) and p.split]
        assert [(p.chunk, p.mb) for p in parts if isinstance(p, W)] == split


def test_dualpipe_routes():
    schedule = dualpipe(4, 8)
    assert schedule.routes[0] == ((0, 0), (1, 0), (2, 0), (3, 0))
    assert schedule.routes[4] == ((3, 1), (2, 1), (1, 1), (0, 1))
    v_sched = dualpipev(3, 6)
    assert v_sched.routes[0] == ((0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1))
    # The turn at the last rank is local: no P2P between stage 2 and stage 3.
    assert not any(op.peer == 2 for a in v_sched.actions[2] if isinstance(a, CommGroup) for op in a.ops)


# ---------------------------------------------------------------- validation catches errors

def _replace_actions(schedule, rank, actions):
    new = list(schedule.actions)
    new[rank] = tuple(actions)
    return dataclasses.replace(schedule, actions=tuple(new))


def test_validate_catches_swapped_forward_and_backward():
    schedule = one_f_one_b(4, 8)
    acts = list(schedule.actions[3])  # last rank: F(0,0) then B(0,0) with nothing in between
    i, j = acts.index(F(0, 0)), acts.index(B(0, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ValueError, match=r"rank 3, action \d+ .*B of stage 3, mb 0 runs before"):
        validate(_replace_actions(schedule, 3, acts))


def test_validate_catches_missing_receive():
    schedule = one_f_one_b(4, 8)
    acts = list(schedule.actions[2])
    i = next(k for k, a in enumerate(acts) if isinstance(a, CommGroup) and any(op.op == RECV_F for op in a.ops))
    kept = tuple(op for op in acts[i].ops if op.op != RECV_F)
    acts[i:i + 1] = [CommGroup(kept)] if kept else []
    with pytest.raises(ValueError, match=r"no recv of its F output from rank 1 to rank 2"):
        validate(_replace_actions(schedule, 2, acts))


def test_validate_catches_missing_and_duplicate_work():
    schedule = build_schedule("zbh1", 4, 8)
    acts = list(schedule.actions[1])  # (rank 0 runs full backwards)
    w = next(k for k, a in enumerate(acts) if isinstance(a, W))
    with pytest.raises(ValueError, match="never runs W"):
        validate(_replace_actions(schedule, 1, acts[:w] + acts[w + 1:]))
    with pytest.raises(ValueError, match="second W"):
        validate(_replace_actions(schedule, 1, acts[:w + 1] + [acts[w]] + acts[w + 1:]))


def test_validate_catches_crossed_channel_order():
    """Two sends on one rank pair received in the other order would swap tensors (FIFO matching)."""
    schedule = one_f_one_b(2, 4)
    acts = list(schedule.actions[1])
    recvs = [k for k, a in enumerate(acts) if isinstance(a, CommGroup) and any(op.op == RECV_F for op in a.ops)]
    a, b = recvs[0], recvs[1]
    acts[a], acts[b] = (CommGroup(tuple(op if op.op != RECV_F else dataclasses.replace(op, mb=op.mb + 1)
                                        for op in acts[a].ops)),
                        CommGroup(tuple(op if op.op != RECV_F else dataclasses.replace(op, mb=op.mb - 1)
                                        for op in acts[b].ops)))
    with pytest.raises(ValueError, match="rank 1, action"):
        validate(_replace_actions(schedule, 1, acts))


def _naive_comm(schedule):
    """Every send right after its producer, in its own group before the next receives: deadlocks."""
    placed = insert_comm(schedule)
    out = []
    for acts in placed.actions:
        compute = [a for a in acts if not isinstance(a, CommGroup)]
        ops = [op for a in acts if isinstance(a, CommGroup) for op in a.ops]
        new = []
        for k, action in enumerate(compute):
            recv = [op for op in ops if op.op.startswith("RECV") and _consumes(action, op)]
            if recv:
                new.append(CommGroup(tuple(recv)))
            new.append(action)
            send = [op for op in ops if op.op.startswith("SEND") and _produces(action, op)]
            if send:
                new.append(CommGroup(tuple(send)))
        out.append(tuple(new))
    return dataclasses.replace(placed, actions=tuple(out))


def _send_with_next_receives(schedule):
    """Each send right after its producer, sharing a group with the next compute's receives."""
    placed = insert_comm(schedule)
    out = []
    for acts in placed.actions:
        compute = [a for a in acts if not isinstance(a, CommGroup)]
        ops = [op for a in acts if isinstance(a, CommGroup) for op in a.ops]
        new = []
        for k in range(len(compute) + 1):
            group = [op for op in ops if op.op.startswith("SEND") and k > 0 and _produces(compute[k - 1], op)]
            group += [op for op in ops if op.op.startswith("RECV") and k < len(compute) and _consumes(compute[k], op)]
            new += [CommGroup(tuple(group))] if group else []
            new += [compute[k]] if k < len(compute) else []
        out.append(tuple(new))
    return dataclasses.replace(placed, actions=tuple(out))


def _parts(action):
    return (action.forward, action.backward) if isinstance(action, FB) else (action,)


def _consumes(action, op):
    kind = F if op.op == "RECV_F" else B
    return any(isinstance(p, kind) and (p.chunk, p.mb) == (op.chunk, op.mb) for p in _parts(action))


def _produces(action, op):
    kind = F if op.op == "SEND_F" else B
    return any(isinstance(p, kind) and (p.chunk, p.mb) == (op.chunk, op.mb) for p in _parts(action))


@pytest.mark.parametrize("name,pp,m,v", [("1f1b", 2, 4, None), ("1f1b", 4, 8, None),
                                         ("interleaved_1f1b", 4, 8, 2)])
def test_validate_catches_deadlocking_comm_order(name, pp, m, v):
    """Blocking sends posted alone right after the producer wait for a receiver that waits for them."""
    with pytest.raises(ValueError, match="deadlock"):
        validate(_naive_comm(build_schedule(name, pp, m, v)))


@pytest.mark.parametrize("name,pp,m,v,error", [
    ("interleaved_1f1b", 4, 8, 2, "deadlock"),
    ("dualpipe", 8, 20, None, r"receives message \('B', 10\) from rank 0 as its #6 on that pair, but rank 0 sends"),
])
def test_sending_right_after_the_producer_is_not_enough(name, pp, m, v, error):
    """Why insert_comm delays sends: the eager placement fails even with sends grouped with receives."""
    with pytest.raises(ValueError, match=error):
        validate(_send_with_next_receives(build_schedule(name, pp, m, v)))


def test_validate_catches_comm_to_wrong_peer_and_local_handover():
    schedule = dualpipev(2, 4)
    acts = list(schedule.actions[0])
    i = next(k for k, a in enumerate(acts) if isinstance(a, CommGroup))
    bad = CommGroup(tuple(dataclasses.replace(op, peer=0) if k == 0 else op for k, op in enumerate(acts[i].ops)))
    with pytest.raises(ValueError, match=r"rank 0, action %d" % i):
        validate(_replace_actions(schedule, 0, acts[:i] + [bad] + acts[i + 1:]))
    # A P2P for DualPipeV's local turn (stage 1 -> 2 both on rank 1) is rejected.
    acts1 = list(schedule.actions[1])
    f = acts1.index(F(0, 0))
    extra = CommGroup((P2P(SEND_F, 0, 0, 0),))
    with pytest.raises(ValueError, match="does not cross"):
        validate(_replace_actions(schedule, 1, acts1[:f + 1] + [extra] + acts1[f + 1:]))


# ---------------------------------------------------------------- argument errors

@pytest.mark.parametrize("call,message", [
    (lambda: build_schedule("dualpipe", 3, 8), "dualpipe needs pp even and microbatches even, got pp=3"),
    (lambda: build_schedule("dualpipe", 4, 7), "dualpipe needs pp even and microbatches even"),
    (lambda: build_schedule("dualpipe", 4, 6), r"dualpipe needs microbatches >= 2\*pp, got microbatches=6, pp=4"),
    (lambda: build_schedule("dualpipev", 4, 7), r"dualpipev needs microbatches >= 2\*pp"),
    (lambda: build_schedule("interleaved_1f1b", 4, 6, 2), "divisible by pp, got microbatches=6, pp=4"),
    (lambda: build_schedule("interleaved_1f1b", 4, 8), "needs v >= 2"),
    (lambda: build_schedule("1f1b", 4, 8, 2), "only applies to interleaved_1f1b"),
    (lambda: build_schedule("pipedream", 4, 8), "unknown schedule 'pipedream'"),
    (lambda: build_schedule("1f1b", 0, 8), "needs pp >= 1"),
    (lambda: Costs(F=1, B=1, W=1), "B > W"),
    (lambda: Costs.parse("F=1,X=2"), "unknown cost 'X'"),
])
def test_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- the drawing tool

def test_tool_prints_json_and_draws(tmp_path):
    png = tmp_path / "dualpipe.png"
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "schedule.py"), "--schedule", "dualpipe", "--pp", "4",
         "--microbatches", "8", "--costs", "F=1,B=2,W=1,FB=2.5", "--png", str(png), "--json"],
        cwd=tmp_path, capture_output=True, text=True, check=True)
    summary = json.loads(out.stdout)
    assert summary["bubble"] == summary["bubble_formula"] == 1.5
    assert summary["peak_activations"] == summary["peak_activations_formula"] == 5
    assert summary["param_copies"] == 2.0 and len(summary["bubble_per_rank"]) == 4
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tool_reports_bad_arguments():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "schedule.py"), "--schedule", "dualpipe",
                          "--pp", "3", "--microbatches", "8"], capture_output=True, text=True)
    assert out.returncode != 0 and "dualpipe needs pp even" in out.stderr
