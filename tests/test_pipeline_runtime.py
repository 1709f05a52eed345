"""Pipeline runtime: every schedule trains like one device; the executed trace is the simulated one."""

import os

import pytest
import torch

from moe_lc.config import ConfigError, ModelConfig, load_config
from moe_lc.parallel.pipeline import Costs, build_schedule, simulate
from moe_lc.parallel.pipeline.schedule_ir import B, F, FB, W, CommGroup
from moe_lc.parallel.pipeline.stage import balanced_split, layer_costs, stage_layers
from tests.harness import RECIPES, assert_equivalent, reference, run_layout, run_workers

RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=3", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2", "train.micro_batch=1"]
DEEP = ["model.n_layers=8"]  # enough blocks for 8 stages (pp=4 interleaved / DualPipeV)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbh1", "dualpipe", "dualpipev"])
def test_pp2_matches_one_device(schedule):
    ref = reference(RECIPE, BASE)
    got = run_layout(RECIPE, BASE + ["parallel.pp=2", f"parallel.pp_schedule={schedule}"], world=2)
    report = assert_equivalent(ref, got, rtol=1e-5)
    print(f"pp=2 {schedule}: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e}")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbh1", "dualpipe", "dualpipev"])
def test_pp4_matches_one_device(schedule):
    ref = reference(RECIPE, BASE + DEEP)
    got = run_layout(RECIPE, BASE + DEEP + ["parallel.pp=4", f"parallel.pp_schedule={schedule}"], world=4)
    report = assert_equivalent(ref, got, rtol=1e-5)
    print(f"pp=4 {schedule}: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e}")


def test_dualpipe_pp2_dp2_zero1():
    ref = reference(RECIPE, BASE)
    got = run_layout(RECIPE, BASE + ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=dualpipe"], world=4)
    assert_equivalent(ref, got, rtol=1e-5)


def test_dualpipe_pp2_dp2_ep2():
    """DeepSeek-V3's composition: PP (DualPipe) x ZeRO-1 DP x EP folded into DP."""
    ref = reference(RECIPE, BASE)
    got = run_layout(RECIPE, BASE + ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
                                     "parallel.pp_schedule=dualpipe"], world=4)
    assert_equivalent(ref, got, rtol=1e-5)


def _trace_worker(rank, world, schedule_name):
    from moe_lc.train import Trainer

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    cfg = load_config(RECIPE, BASE + ["train.steps=1", "train.threads=1", f"parallel.pp={world}",
                                      f"parallel.pp_schedule={schedule_name}", "train.output_dir=/tmp/unused"],
                      world_size=world)
    trainer = Trainer(cfg)
    trainer.dims.counter.reset()
    trainer.train_step()
    return {"trace": trainer.runtime.trace, "pp_send_bytes": trainer.dims.counter.bytes.get(("pp", "send"), 0)}


def _sim_order(schedule, rank):
    """The simulator's execution order on `rank`, in the runtime's trace vocabulary."""
    result = simulate(schedule, Costs(F=1, B=2, W=1, FB=2.5), comm_model="rendezvous")
    out = []
    for iv in sorted(result.timeline[rank], key=lambda iv: iv.start):
        a = iv.action
        st = lambda chunk, mb: schedule.stage_of(rank, chunk, mb)  # noqa: E731
        if isinstance(a, CommGroup):
            out.append(("COMM", tuple((p.op, p.peer, st(p.chunk, p.mb), p.mb) for p in a.ops)))
        elif isinstance(a, F):
            out.append(("F", st(a.chunk, a.mb), a.mb))
        elif isinstance(a, B):
            out.append(("B", st(a.chunk, a.mb), a.mb, a.split))
        elif isinstance(a, W):
            out.append(("W", st(a.chunk, a.mb), a.mb))
        elif isinstance(a, FB):
            out.append(("FB", st(a.f_chunk, a.f_mb), a.f_mb, st(a.b_chunk, a.b_mb), a.b_mb, a.split))
    return out


@pytest.mark.parametrize("schedule_name", ["1f1b", "dualpipe"])
def test_executed_trace_equals_simulated_schedule(schedule_name):
    results = run_workers(_trace_worker, 2, schedule_name)
    schedule = build_schedule(schedule_name, 2, 8)
    for rank, r in enumerate(results):
        executed = [t[:6] if t[0] == "FB" else t for t in r["trace"]]
        assert executed == _sim_order(schedule, rank)
        for t in r["trace"]:
            if t[0] == "FB":  # the forward and backward phases really interleave, backward first
                order = t[6]
                assert order[0].startswith("B") and "F0" in order[1:3] and len(order) > 4
                assert sum(a[0] != b[0] for a, b in zip(order, order[1:])) >= len(order) // 3
    # 1F1B: each of the 8 micro-batches crosses the one stage boundary once each way
    if schedule_name == "1f1b":
        hidden = 1 * 32 * 128 * 4  # micro_batch x seq_len x dim x fp32
        assert results[0]["pp_send_bytes"] == 8 * hidden and results[1]["pp_send_bytes"] == 8 * hidden


def test_balanced_split_prefers_cheap_stages_for_expensive_layers():
    assert balanced_split([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balanced_split([1, 1, 1, 1], 2, last_extra=2.0) == [3, 1]
    cfg = load_config(RECIPE).model
    costs = layer_costs(cfg, 128)
    assert costs[0] != costs[1]  # dense block 0 vs MoE blocks
    assert [len(s) for s in stage_layers(cfg, 4, 128)] == [1, 1, 1, 1]
    assert stage_layers(cfg, 2, 128, override=[3, 1]) == [[0, 1, 2], [3]]


def test_bad_pipeline_layouts_are_reported_before_launch():
    from moe_lc.parallel.build import pipeline_plan

    with pytest.raises(ConfigError, match="dualpipe needs pp even"):
        load_config(RECIPE, ["parallel.pp=3", "parallel.pp_schedule=dualpipe", "model.n_layers=6"], world_size=3)
    cfg = load_config(RECIPE, ["parallel.pp=3", "parallel.pp_schedule=dualpipe", "model.n_layers=6"], world_size=3,
                      check=False)
    with pytest.raises(ConfigError, match="dualpipe needs pp even"):  # the trainer's own plan says the same
        pipeline_plan(cfg, 4)
    errs = None
    try:
        load_config(RECIPE, ["parallel.pp=2", "parallel.pp_stage_layers=[1,1]"], world_size=2)
    except ConfigError as exc:
        errs = exc.errors
    assert errs and "parallel.pp_stage_layers=[1, 1] must list 2 positive block counts summing to model.n_layers=4" in errs[0]


def test_phased_run_gradients_equal_one_graph_and_boundaries_are_released():
    """Phases cut at every boundary give the gradients of one graph, through pass-through tensors, a
    0-dim output and an output the next phase reads but does not save, whose data is released once
    the next phase has its own alias (the experts' outputs before combine's all-to-all)."""
    from moe_lc.parallel.pipeline.overlap import PhasedRun

    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def forward(x):
        h = x @ w1
        big = torch.tanh(h) @ w2                   # read by the next phase, saved by nothing there
        aux = (h ** 2).mean()                      # a 0-dim output passed along
        return h, big, aux

    phases = [lambda x: forward(x), lambda h, big, aux: (h, big.roll(1, 0), aux),
              lambda h, y, aux: ((h * y).sum() + aux,)]
    run = PhasedRun(phases, x)
    run.forward_phase()
    assert run.outputs[0][1].untyped_storage().nbytes() == 4 * 8 * 4
    run.forward_phase()
    assert [t.untyped_storage().nbytes() for t in run.outputs[0]] == [4, 4, 4]  # one element each, graphs kept
    run.forward_all()
    run.backward_all(None)
    got = (w1.grad.clone(), w2.grad.clone())
    w1.grad = w2.grad = None
    phases[2](*phases[1](*forward(x)))[0].backward()
    assert torch.allclose(got[0], w1.grad) and torch.allclose(got[1], w2.grad)


def test_a_sent_chunk_output_keeps_no_data_and_its_backward_is_unchanged():
    """A chunk's output, once the next stage has it, is released (data one element, graph kept); the
    chunk's backward from the output gradient still gives the gradients of one graph."""
    from moe_lc.parallel.pipeline.overlap import PhasedRun

    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x, dy = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    phases = [lambda x: (x @ w,), lambda h: (torch.tanh(h) + h,)]  # tanh saves its output, not the sum
    run = PhasedRun(phases, x)
    sent = run.forward_all().detach().clone()
    run.release_output()
    assert run.output.untyped_storage().nbytes() == 4 and run.output.shape == (4, 8)
    run.backward_all(dy)
    got = (w.grad.clone(), run.input_grad.clone())
    w.grad = None
    x2 = x.detach().requires_grad_()
    y = phases[1](*phases[0](x2))[0]
    y.backward(dy)
    assert torch.equal(sent, y.detach())
    assert torch.allclose(got[0], w.grad) and torch.allclose(got[1], x2.grad)
