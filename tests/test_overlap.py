"""Overlap changes when, never what: with `parallel.overlap` on (and a modelled link) or off, every layout
gives bit-identical losses, grad norms and parameters; the phase order of an F&B pair hides each
transfer behind the other half's compute; the modelled link's time is booked and really hidden."""

import time

import pytest
import torch

from moe_lc.parallel.comm_timing import IssuedWork, Link
from tests.harness import RECIPES, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=2", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=1", "train.micro_batch=1"]
LAYOUTS = {  # name -> (overrides, world, ranks_per_node)
    "pp2 dualpipe x ep2": (["parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.ep=2"], 4, None),
    "1f1b pp2 x ep2": (["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.ep=2"], 4, None),
    "hierarchical ep4 on 2 nodes": (["parallel.ep=4", "parallel.expert_dispatch=hierarchical",
                                     "parallel.ranks_per_node=2"], 4, 2),
    "pp4 dualpipev x dp2": (["parallel.pp=4", "parallel.pp_schedule=dualpipev", "model.n_layers=8",
                             "train.global_batch=16"], 8, None),
}
SLOW = {"pp4 dualpipev x dp2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_overlap_on_and_off_train_bit_identically(name):
    overrides, world, rpn = LAYOUTS[name]
    on = run_layout(RECIPE, BASE + overrides + ["parallel.link=20:1"], world=world, ranks_per_node=rpn)
    off = run_layout(RECIPE, BASE + overrides + ["parallel.overlap=false"], world=world, ranks_per_node=rpn)
    assert on.losses == off.losses and on.grad_norms == off.grad_norms
    assert on.final_state.keys() == off.final_state.keys()
    for key, value in on.final_state.items():
        assert torch.equal(value, off.final_state[key]), key


class _Done:
    """A torch Work that finished at once."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def test_a_modelled_transfer_hides_behind_work_done_before_its_wait():
    booked = []
    link = Link(latency_s=0.0, bytes_per_s=1e6)  # 50 ms for 50 kB
    hidden = IssuedWork(_Done(), True, link, 50_000, lambda *t: booked.append(t), RuntimeError)
    time.sleep(0.08)  # compute longer than the transfer
    start = time.perf_counter()
    hidden.wait()
    assert time.perf_counter() - start < 0.02
    exposed = IssuedWork(_Done(), True, link, 50_000, lambda *t: booked.append(t), RuntimeError)
    start = time.perf_counter()
    exposed.wait()
    assert time.perf_counter() - start >= 0.045
    for issued, done, wait_start, wait_end in booked:
        assert done - issued >= 0.05  # the op's own time, whatever the wait
    (i1, d1, s1, e1), (i2, d2, s2, e2) = booked
    assert e1 - s1 < 0.02 and e2 - s2 >= 0.045


def test_interleave_switches_after_each_transfer():
    """An F&B pair of MoE blocks (phases attention, dispatch -> experts -> combine, with a transfer after
    dispatch and after experts): every transfer of one half has a compute phase of the other between
    its start and its finish (DeepSeek-V3 figure 4)."""
    from moe_lc.parallel.pipeline.overlap import PhasedRun, interleave

    f_run = PhasedRun(_toy_moe_phases(), torch.ones(4, requires_grad=True))
    b_x = torch.arange(4.0, requires_grad=True)
    b_run = PhasedRun(_toy_moe_phases(), b_x)
    b_run.forward_all()
    order = interleave(f_run, b_run, None, 1.0)
    assert order[0].startswith("B")
    assert f_run.output.item() == 4 * (2 + 30)  # x*2 + x*2*3*5, summed
    assert torch.equal(b_run.input_grad, torch.full((4,), 32.0))  # through both transfers and back
    # forward phases 1 (dispatch) and 2 (experts) leave a transfer; backward phases 2 and 3 do
    issued_by = {"F1": "F2", "F2": "F3", "B3": "B2", "B2": "B1"}
    for start, finish in issued_by.items():
        between = order[order.index(start) + 1:order.index(finish)]
        assert any(p[0] != start[0] for p in between), (start, finish, order)


def _toy_moe_phases():
    """attention (x -> 2x), dispatch (rows 3x leave), experts (rows 5x leave), combine (x + rows, summed):
    the transfers go through a group of one (RowTransfer copies at once, the autograd edges are real)."""
    from moe_lc.parallel.comm import single_group
    from moe_lc.parallel.ep.row_transfer import RowTransfer

    group = single_group("ep")

    def attention(x):
        return (x * 2,)

    def dispatch(x):
        return (x, RowTransfer(x * 3, [4], [4], group))

    def experts(x, rows):
        return (x, RowTransfer(rows * 5, [4], [4], group))

    def combine(x, rows):
        return ((x + rows).sum(),)

    return [attention, dispatch, experts, combine]
