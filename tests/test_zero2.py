"""ZeRO-2 (parallel.placement.grads = "sharded", moe_lc/parallel/zero/grad_rounds.py) against ZeRO-1: bit for bit
with one micro-batch per rank, to fp32 rounding (1e-6) with several (each micro-batch reduced, then summed)
under dp2, dp2 x ep2, dp2 x tp2, pp2 DualPipe x dp2, and tp2 with one kv head (its rows' grad-norm weights:
ZeRO-2 built them from the full-size buffer it does not have, and failed); a ZeRO-1 checkpoint resumed under ZeRO-2; counted
bytes (one reduce-scatter per micro-batch) equal to the planner's; the gradient state is the shard alone
and the staging is gone after each step."""

import pytest
import torch

from moe_lc.config import load_config
from tests.harness import FAST, RECIPES, assert_equivalent, interrupted_and_resumed, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
ZERO2 = ["parallel.placement.grads=sharded"]
STEPS = ["train.steps=10", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2",
         "parallel.zero_bucket_mb=0.05"]  # several buckets per group
LAYOUTS = {  # (overrides, world, rounds: micro-batches through each of a rank's stages a step)
    "dp2_one_microbatch": (["parallel.dp=2", "train.micro_batch=4"], 2, 1),
    "dp2": (["parallel.dp=2", "train.micro_batch=2"], 2, 2),
    "dp2_ep2": (["parallel.dp=2", "parallel.ep=2", "train.micro_batch=2"], 2, 2),
    "dp2_tp2": (["parallel.dp=2", "parallel.tp=2", "train.micro_batch=2"], 4, 2),
    # one kv head on two tp ranks: its rows' gradients summed over tp and weighted 1/2 in the grad norm
    "tp2_replicated_kv": (["parallel.tp=2", "model.n_kv_heads=1", "train.micro_batch=8"], 2, 1),
    # 4 micro-batches a pipeline, each stage's two copies (DualPipe's two directions) run 2 of them
    "pp2_dualpipe_dp2": (["parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule=dualpipe", "train.micro_batch=1"],
                         4, 2),
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if LAYOUTS[k][1] > 2 else [])
                                    for k in LAYOUTS])
def test_zero2_trains_like_zero1_and_sends_what_the_planner_says(layout):
    from tools.planner.plan import plan

    extra, world, micro = LAYOUTS[layout]
    zero1 = run_layout(RECIPE, STEPS + extra, world=world)
    zero2 = run_layout(RECIPE, STEPS + extra + ZERO2, world=world)
    if micro == 1:  # the same sums in the same order
        assert zero2.losses == zero1.losses
        assert all(torch.equal(zero2.final_state[k], v) for k, v in zero1.final_state.items())
    else:
        assert_equivalent(zero1, zero2, rtol=1e-6)
    cfg = load_config(RECIPE, FAST + STEPS + extra + ZERO2, world_size=world)
    the_plan = plan(cfg, world)
    last = world - 1
    for pp_rank, rank in ((0, 0), (the_plan.degrees["pp"] - 1, last)):
        want = the_plan.ranks[pp_rank].comm_per_step()
        exact = {k: v for k, v in want.items() if "all_to_all" not in k}  # EP's follow the routing (estimates)
        for step in zero2.comm_per_rank[rank]:
            assert {k: step[k] for k in exact} == exact, (step, exact)
    # each round is one reduce-scatter of the group's buckets: micro-batches x ZeRO-1's bytes
    for key in ("comm/dp_cp/reduce_scatter_bytes", "comm/edp/reduce_scatter_bytes"):
        if key in zero1.comm_per_rank[0][0]:
            assert zero2.comm_per_rank[0][0][key] == micro * zero1.comm_per_rank[0][0][key]


def test_a_zero1_checkpoint_resumes_under_zero2_exactly(tmp_path):
    """Checkpoints hold the master and the rule's state, no gradients: saved under ZeRO-1 at step 3,
    resumed under ZeRO-2 (one micro-batch per rank), steps 4-6 are the uninterrupted ZeRO-1 run's bit for bit."""
    full, resumed = interrupted_and_resumed(RECIPE, STEPS[1:] + ["parallel.dp=2", "train.micro_batch=4"], ZERO2,
                                            world=2, ckpt=tmp_path / "ckpt")
    assert resumed.losses == full.losses[3:]
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())


def test_the_gradient_state_is_the_shard_and_staging_ends_with_the_step(tmp_path):
    """One process, two micro-batches: no full-size main-grad buffer; each group made one round per
    micro-batch per bucket, and after the step no staging is held; the planner's gradient bytes are the
    shards' (and ZeRO-1's the buffer's instead: its shard lives at the optimizer step only)."""
    from moe_lc.train import Trainer
    from tools.planner.plan import plan

    overrides = FAST + STEPS + ["train.micro_batch=4", "train.steps=1", f"train.output_dir={tmp_path}"]
    cfg = load_config(RECIPE, overrides + ZERO2)
    trainer = Trainer(cfg)
    trainer.train_step()
    shards = trainer.optimizer.shards
    assert all(not s.grad_sync.full_buffer and s.grad_sync.live_bytes() == 0 for s in shards)
    rank = plan(cfg, 1).ranks[0]
    assert rank.memory["grads"] == sum(s.grad_shard.numel() * 4 for s in shards)
    zero1 = plan(load_config(RECIPE, overrides), 1).ranks[0]
    assert zero1.memory["grads"] == rank.memory["grads"]  # N = 1: the buffer is as large as the shard
