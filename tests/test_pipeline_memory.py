"""What a pipeline rank holds through its schedule (tools/planner/pipeline_memory.py), and ZB-H1 within 1F1B's
memory (issue #63; moe_lc/parallel/pipeline/schedules.py `zb_h1`).

A split backward's B frees its micro-batch's graph and leaves its W what the W needs (M_W in the zero-bubble
paper's terms, against the M_B the micro-batch saved): the output gradients B made and the inputs from the
forward its deferring Linears keep, both traced and held to a real CPU backward here. ZB-H1 runs each W right
after its B: every rank holds 1F1B's in-flight micro-batches, and the planner plans no rank above 1F1B's
highest, where the paper's placement, deferring the last rank's W's, plans the last rank above it. What the
deferral would save in time is measured here too.
"""

import gc
import math

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.ops.linear import GroupedLinear, Linear, WeightGradStore
from moe_lc.parallel.pipeline import B, F, W, CommGroup, Costs, build_schedule, one_f_one_b, simulate
from moe_lc.parallel.pipeline.comm_insertion import assemble
from moe_lc.parallel.pipeline.schedule_ir import compute_parts
from moe_lc.parallel.pipeline.schedules import straight_routes
from tests.test_plan import RECIPE, _cpu_model, _cpu_step_inputs, _reachable_tensors, _storage_ptr
from tools.planner import plan as plan_module
from tools.planner.activation_memory import held_checkpoint_inputs
from tools.planner.block_trace import block_kind, trace_parts
from tools.planner.pipeline_memory import schedule_peak

PP4 = ["parallel.pp=4"]  # recipes/debug_cpu.toml: 4 layers, one a stage; 4 micro-batches a step


def _all_equal(values, target):
    return all(math.isclose(v, target, abs_tol=1e-9) for v in values)


# ---------------------------------------------------------------- the schedule: time and micro-batches held

def _deferring_zbh1(pp: int, m: int, last_defers: bool):
    """The paper's ZB-H1 placement (the builder before issue #63): a W (oldest first) follows a steady B
    once the rank holds pp micro-batches in flight (F done, W not), so rank r defers its first r W's
    (the last rank none unless `last_defers`: it runs each W right after its B); in the cool-down one W
    follows each B, the rest at the end."""
    compute = []
    for rank in range(pp):
        cap = pp if rank < pp - 1 or last_defers else 1
        warmup = min(pp - 1 - rank, m)
        acts, waiting = [F(0, i) for i in range(warmup)], []
        for i in range(m):
            steady = warmup + i < m
            acts += ([F(0, warmup + i)] if steady else []) + [B(0, i, True)]
            waiting.append(i)
            if not steady or (warmup + i + 1) - (i + 1 - len(waiting)) >= cap:
                acts.append(W(0, waiting.pop(0)))
        compute.append(acts + [W(0, mb) for mb in waiting])
    return assemble("zbh1", pp, m, pp, 1, straight_routes(pp, m), compute)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zbh1_bubble_for_any_costs_and_what_deferring_would_save(pp):
    """(pp-1)(F+B-W) for any costs. Deferring W's as the paper does saves time only where the last rank
    defers too: (pp-1)(F + (B-W) - min(W, F, B-W)), but the last rank then holds pp micro-batches in
    flight (1F1B: 1) beside the loss head. With the last rank's W's right after its B's, deferring
    on the others saves nothing and, where W > B - W, loses (pp-2)(W - (B-W))."""
    for f, b_in, w in [(1, 1, 1), (1, 1, 0.5), (3, 1, 2), (1, 2, 2), (2, 3, 3), (1, 1, 4), (2, 1, 3)]:
        costs = Costs(F=f, B=b_in + w, W=w)
        for m in (pp, 2 * pp + 1):
            ours = simulate(build_schedule("zbh1", pp, m), costs)
            assert _all_equal(ours.bubble, (pp - 1) * (f + b_in)), (costs, m)
            paper = simulate(_deferring_zbh1(pp, m, last_defers=True), costs)
            assert _all_equal(paper.bubble, (pp - 1) * (f + b_in - min(w, f, b_in))), (costs, m)
            assert paper.peak_activations[-1] == pp
            others = simulate(_deferring_zbh1(pp, m, last_defers=False), costs)
            assert _all_equal(others.bubble, (pp - 1) * (f + b_in) + (pp - 2) * max(0, w - b_in)), (costs, m)


def _held_at_most(schedule, ratio: float) -> list[float]:
    """Per rank, the most it holds at once in units of one micro-batch's saved activations M_B: those
    F done and B not, `ratio` = M_W/M_B for each waiting for its W (B done), and while a split B runs,
    its W's M_W beside its M_B (it keeps its Linears' output gradients; a full B frees them as it goes)."""
    peaks = []
    for acts in schedule.actions:
        full = waiting = most = 0
        for part in (p for a in acts if not isinstance(a, CommGroup) for p in compute_parts(a)):
            split = isinstance(part, B) and part.split
            full += isinstance(part, F)
            most = max(most, full + ratio * (waiting + split))
            full -= isinstance(part, B)
            waiting += split - isinstance(part, W)
        peaks.append(most)
    return peaks


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zbh1_holds_no_more_than_1f1b(pp):
    """Issue #63 (the paper's claim for ZB-H1): no rank holds more than 1F1B's most loaded one, rank 0
    (pp micro-batches). In flight (F done, W not) every rank holds 1F1B's own count; in bytes, with
    M_W/M_B <= 1 and stages that save alike, at most one M_W more than 1F1B's own on ranks >= 1
    (none on rank 0), which stays within pp."""
    for m in (pp, 2 * pp, 3 * pp + 1):
        ours, theirs = build_schedule("zbh1", pp, m), one_f_one_b(pp, m)
        assert simulate(ours).peak_activations == simulate(theirs).peak_activations, m
        assert max(simulate(theirs).peak_activations) == min(pp, m)
        for ratio in (0.0, 0.5, 0.9, 1.0):
            held, own = _held_at_most(ours, ratio), _held_at_most(theirs, ratio)
            assert held[0] == own[0] == pp and max(held) <= pp, (m, ratio, held)
            assert all(h <= o + ratio for h, o in zip(held, own)), (m, ratio, held, own)


# ---------------------------------------------------------------- bytes: the trace and the planner

@pytest.mark.parametrize("precision, policy, selective, extra", [
    ("fp32", "none", (), []), ("bf16", "selective", ("norm", "swiglu"), ["model.mtp.depth=1"]),
    ("bf16", "full", (), [])], ids=["fp32-none", "bf16-selective-mtp", "bf16-full"])
def test_split_backward_keeps_for_w_the_forward_tensors_the_trace_says(precision, policy, selective, extra):
    """What a real CPU model's queued W closures hold from before B (the forward's tensors: the deferring
    Linears' inputs; parameters aside) weighs the trace's `kept`, per block kind and head, summed (what B
    made for them is `held`: tests/test_plan.py)."""
    cfg = load_config(RECIPE, ["train.seq_len=64", f"precision.recipe={precision}", f"recompute.policy={policy}",
                               f"recompute.selective={','.join(selective) or 'norm'}", *extra])
    model, batch = _cpu_model(cfg, policy, selective), _cpu_step_inputs(cfg)
    store = WeightGradStore()
    for mod in model.modules():
        if isinstance(mod, (Linear, GroupedLinear)) and mod.defer_wgrad:
            mod.wgrad_store = store
    before = []  # the forward's saved tensors and every other tensor alive before B (held: no address reused)
    with held_checkpoint_inputs(before.append), torch.autograd.graph.saved_tensors_hooks(
            lambda t: before.append(t) or t, lambda t: t):
        loss = model(batch.pop("inputs"), **batch)
    before += [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]
    with store.deferring():
        loss.backward()
    reached: dict[int, int] = {}
    _reachable_tensors([compute for _, compute in store.take()], reached, set())
    known = {ptr for ptr in map(_storage_ptr, before) if ptr is not None}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in reached.items() if ptr in known and ptr not in params)
    traced = trace_parts(cfg, cfg.data.has_loss_mask, backward=True)
    parts = [block_kind(cfg.model, i) for i in range(cfg.model.n_layers)] + ["head"]
    assert measured == sum(traced.kept[part] for part in parts) > 0


def test_a_split_backward_frees_what_it_saved_and_holds_what_its_w_needs():
    """Saved 10 a micro-batch, 4 held for W: the paper's ZB-H1 on pp 2 has the last rank run F0 B0 F1 B1 W0
    F2 ...: at most one micro-batch in flight beside one waiting for its W, 10 + 4 (not 10 + 10 + 4)."""
    schedule = _deferring_zbh1(2, 4, last_defers=True)
    assert schedule_peak(schedule, 1, {1: 10.0}, {1: 1}, {1: 4.0}) == (10.0, 14.0)
    # ZB-H1 as built: every W right after its B, so the W's bytes never meet another micro-batch's
    assert schedule_peak(build_schedule("zbh1", 2, 4), 1, {1: 10.0}, {1: 1}, {1: 4.0}) == (10.0, 10.0)


def _planned(overrides, monkeypatch=None, schedule=None) -> list[tuple[float, float]]:
    """Per pipeline rank: (saved activations + the step's transient, peak) the planner gives, in bytes;
    `schedule` in place of the recipe's own."""
    if schedule is not None:
        monkeypatch.setattr(plan_module, "pipeline_schedule", lambda cfg, deg: schedule)
    ranks = plan_module.plan(load_config(RECIPE, overrides)).ranks
    return [(r.memory["activations"] + r.transients["step"], r.peak_bytes()) for r in ranks]


def test_zbh1_plans_no_more_than_1f1b_on_any_rank(monkeypatch):
    """Issue #63 on recipes/debug_cpu.toml at pp 4: ZB-H1's saved activations and step transient (what the
    schedule moves; parameters, gradients and optimizer state are the rank's under either) stay within
    1F1B's most loaded rank on every rank, and each rank's peak within 1F1B's on that rank. The paper's
    placement, whose last rank defers 3 W's, plans the last rank above 1F1B's highest (25.4 MiB against
    22.4)."""
    ones = _planned(PP4 + ["parallel.pp_schedule=1f1b"])
    ours = _planned(PP4 + ["parallel.pp_schedule=zbh1"])
    assert all(act <= max(a for a, _ in ones) for act, _ in ours), (ours, ones)
    assert all(peak <= one_peak for (_, peak), (_, one_peak) in zip(ours, ones)), (ours, ones)
    paper = _planned(PP4 + ["parallel.pp_schedule=zbh1"], monkeypatch, _deferring_zbh1(4, 4, last_defers=True))
    assert paper[-1][0] > 1.1 * max(a for a, _ in ones), (paper, ones)
