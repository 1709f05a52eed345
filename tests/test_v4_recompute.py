"""Full recomputation of DeepSeek-V4 blocks (issues #63 / #67): one checkpoint per block, as Megatron-LM's full
recomputation does, so a block keeps only its input, mHC's widened stream (B, S, hc_mult, D), and none of
what its phases hand on (mHC's fp32 maps, the dispatched rows, the experts' outputs); it trains bit for bit as
without recomputation in fp32. DualPipe(V), which interleaves two micro-batches' block phases, replays each
phase apart instead.
"""

import pytest
import torch

from moe_lc.config import RecomputeConfig, load_config
from moe_lc.model.block import Block
from moe_lc.model.transformer import Transformer
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from moe_lc.train import run
from tests.harness import RECIPES, assert_equivalent, run_layout
from tools.dry_run.hash_routing import trace_tokens
from tools.planner.activation_memory import measure_saved_bytes, stage_estimate
from tools.planner.saved_table import REPLAY, saved_tables

TINY = RECIPES / "debug_v4_cpu.toml"
SHORT = ["train.steps=3", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=1",
         "train.log_interval=100"]


def test_full_recompute_trains_the_tiny_v4_model_bit_for_bit_as_without(tmp_path):
    """fp32, two micro-batches a step, Muon: the same losses, gradient norms and final state, bit for bit (the
    replay reruns the routers, hash and learned, on the same inputs and books their loads once)."""
    base = run(load_config(TINY, SHORT + [f"train.output_dir={tmp_path}/a"]), keep_final_state=True)
    full = run(load_config(TINY, SHORT + [f"train.output_dir={tmp_path}/b", "recompute.policy=full"]),
               keep_final_state=True)
    assert full.losses == base.losses
    assert full.grad_norms == base.grad_norms
    assert all(torch.equal(full.final_state[k], v) for k, v in base.final_state.items())


def _model(cfg, options: LayerPlanOptions) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg.model).train()
    apply_layer_plan(model, options=options)
    return model


def test_a_fully_recomputed_v4_block_keeps_its_input_stream_alone():
    """Measured on a real CPU forward and traced by the planner alike: each block keeps B S N D fp32 values,
    its input stream, and nothing else (before: every phase's inputs, 5.4x that at V4-Flash's shape)."""
    cfg = load_config(TINY, ["train.seq_len=64", "train.micro_batch=2", "recompute.policy=full"])
    m, B, S = cfg.model, cfg.train.micro_batch, cfg.train.seq_len
    stream = B * S * m.mhc.hc_mult * m.dim * 4
    model = _model(cfg, LayerPlanOptions(recompute=RecomputeConfig("full")))
    tokens = trace_tokens(m, (B, S + 1), torch.device("cpu"))
    measured = measure_saved_bytes(model, lambda: model(tokens[:, :-1], labels=tokens[:, 1:]))
    assert {k: v for k, v in measured.items() if k.startswith("layer")} == {f"layer{i}": stream for i in range(4)}
    assert set(stage_estimate(cfg).layers.values()) == {stream}
    for table in saved_tables(cfg):
        assert table.by_term == {REPLAY: stream}, (table.kind, table.by_term)


@pytest.mark.parametrize("schedule, pp, each_phase",
                         [("1f1b", 2, False), ("dualpipe", 2, True), ("dualpipev", 2, True), ("dualpipev", 1, False)])
def test_only_a_schedule_that_interleaves_block_phases_replays_them_apart(schedule, pp, each_phase):
    """Under full recomputation a block is one phase of the chain a pipeline runs (attention, dispatch, experts,
    combine inside its replay), but under DualPipe's F&B, which needs the phase boundaries to hide one
    micro-batch's all-to-all behind the other's compute; without recomputation the phases are always apart."""
    cfg = load_config(TINY, [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", "recompute.policy=full",
                             "train.global_batch=32", "train.micro_batch=1"])
    options = LayerPlanOptions.from_config(cfg)
    assert options.phase_overlap == each_phase
    cos_sin = (torch.arange(8), torch.arange(8))  # V4 blocks take positions (not read until a phase runs)
    for policy, phases in (("full", 4 if each_phase else 1), ("none", 4)):
        plan = LayerPlanOptions(recompute=RecomputeConfig(policy), phase_overlap=options.phase_overlap)
        block = next(b for b in _model(cfg, plan).modules() if isinstance(b, Block))
        assert block.replay_each_phase == (policy != "full" or each_phase)
        assert len(block.phases(*cos_sin)) == phases, policy


def test_full_recompute_replays_the_expert_all_to_alls_alike_under_dp2_ep2():
    """The block's replay runs its dispatch and combine all-to-alls again in backward, on every rank alike:
    dp2 x ep2 under full recomputation trains as the same layout without it, bit for bit. (Against one process
    the layout itself differs by 5e-4 in the tiny CSA compressor's position bias, recomputed or not.)"""
    layout = SHORT + ["parallel.dp=2", "parallel.ep=2"]
    ref = run_layout(TINY, layout, world=2)
    got = run_layout(TINY, layout + ["recompute.policy=full"], world=2)
    report = assert_equivalent(ref, got, rtol=0.0)
    assert got.losses == ref.losses, report
