"""Optimizer offloading (parallel.placement.optimizer = "offloaded", moe_lc/parallel/zero/host_step.py)
against ZeRO-1's device placement: bit for bit (losses and every final parameter) under dp2, dp2 x ep2,
dp2 x tp2 and pp2 DualPipe x dp2, combined with ZeRO-2 and activation offloading, under Muon and QK-clip;
a checkpoint saved with the optimizer on the device resumes offloaded exactly; the master and the rule's
state live in host memory and the copies each way are the planner's bytes.

On a CPU the host is the device, so these hold the code path (the bucket-by-bucket update, the staging,
the all-gathers), not a memory saving; the CUDA path's copies are pinned and asynchronous."""

import pytest
import torch

from moe_lc.config import load_config
from tests.harness import FAST, RECIPES, assert_bit_for_bit, interrupted_and_resumed, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
OFFLOADED = ["parallel.placement.optimizer=offloaded"]
STEPS = ["train.steps=10", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2",
         "parallel.zero_bucket_mb=0.05", "train.grad_clip=0.5"]  # several buckets per group; clipping on
LAYOUTS = {  # (overrides, world)
    "dp2": (["parallel.dp=2", "train.micro_batch=2"], 2),
    "dp2_every_update_in_the_step": (["parallel.dp=2", "train.micro_batch=2",
                                      "parallel.placement.optimizer_overlap=false"], 2),
    "dp2_ep2": (["parallel.dp=2", "parallel.ep=2", "train.micro_batch=2"], 2),
    "dp2_zero2_activation_offload": (["parallel.dp=2", "train.micro_batch=2", "parallel.placement.grads=sharded",
                                      "train.offload=[\"expert_fc1\"]"], 2),
    "dp2_tp2": (["parallel.dp=2", "parallel.tp=2", "train.micro_batch=2"], 4),
    "dp2_tp2_muon_qk_clip": (["parallel.dp=2", "parallel.tp=2", "train.micro_batch=2", "train.optimizer=muon",
                              "train.lr=0.02", "train.qk_clip=2.0"], 4),
    "pp2_dualpipe_dp2": (["parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule=dualpipe", "train.micro_batch=1"],
                         4),
}


SLOW = {k for k, (_, world) in LAYOUTS.items() if world > 2} | {"dp2_ep2"}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if k in SLOW else []) for k in LAYOUTS])
def test_the_offloaded_optimizer_trains_bit_for_bit_like_the_device_one(layout):
    extra, world = LAYOUTS[layout]
    device = run_layout(RECIPE, STEPS + extra, world=world)
    offloaded = run_layout(RECIPE, STEPS + extra + OFFLOADED, world=world)
    assert_bit_for_bit(device, offloaded)
    # no collective changes: the same bytes on every group, every rank; the deferred updates' all-gathers run in
    # the next step's forward (parallel.placement.optimizer_overlap), so they count one step later
    if "parallel.placement.optimizer_overlap=false" in extra:
        assert offloaded.comm_per_rank == device.comm_per_rank
    else:
        assert [steps[1:] for steps in offloaded.comm_per_rank] == [steps[1:] for steps in device.comm_per_rank]
        zero_gathers = [k for steps in offloaded.comm_per_rank for k in steps[0]
                        if k.split("/")[1] in ("dp_cp", "dp_cp_tp", "edp") and "all_gather" in k]
        assert not zero_gathers  # the first step's updates are all still owed


def test_the_deferred_updates_run_as_the_next_forward_reaches_each_bucket(tmp_path, monkeypatch):
    """optimizer_overlap (the default): the step leaves every bucket's update pending; the next forward runs them
    in its own order (the buffer's last bucket, the embedding's, first) as each chain's parameters are needed, and
    ends with none pending; the parameters it computes with are the updated ones (the same logits as with every
    update done in the step)."""
    from moe_lc.parallel.zero import host_step
    from moe_lc.train import Trainer

    order = []
    monkeypatch.setattr(host_step.HostUpdate, "_update",
                        lambda self, index, event, original=host_step.HostUpdate._update:
                        (order.append(index), original(self, index, event)))
    logits = []
    for overlap in ("true", "false"):
        cfg = load_config(RECIPE, FAST + STEPS + OFFLOADED + ["train.micro_batch=4", f"train.output_dir={tmp_path}",
                                                              f"parallel.placement.optimizer_overlap={overlap}"])
        trainer = Trainer(cfg)
        trainer.train_step()
        hosts = [s.update_site for s in trainer.optimizer.shards]
        pending = sum(len(h.pending) for h in hosts)
        assert pending == (sum(len(h.shard.buckets) for h in hosts) if overlap == "true" else 0)
        order.clear()
        with torch.no_grad():
            logits.append(trainer.model(torch.arange(32).view(1, 32)))
        assert all(not h.pending and not h.works for h in hosts)
        if overlap == "true":
            dense = [i for i in order[:len(hosts[0].shard.buckets)]]
            assert order and dense[0] == len(hosts[0].shard.buckets) - 1  # the embedding's bucket first
    assert torch.equal(*logits)


def test_a_device_checkpoint_resumes_with_the_optimizer_offloaded_exactly(tmp_path):
    """Saved with the optimizer on the device at step 3, resumed offloaded: steps 4-6 are the uninterrupted
    device run's bit for bit (checkpoints hold the same master and state, wherever they lived)."""
    full, resumed = interrupted_and_resumed(RECIPE, STEPS[1:] + ["parallel.dp=2", "train.micro_batch=2"], OFFLOADED,
                                            world=2, ckpt=tmp_path / "ckpt")
    assert resumed.losses == full.losses[3:]
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())


def test_the_state_lives_on_the_host_and_the_copies_are_the_planners(tmp_path):
    """One process, three steps: master and state are host tensors apart from the device's gradient shard;
    the bytes copied down (fp32 gradient shards) and up (parameters in the compute dtype) per step are the
    planner's `host_transfers`; the planner moves the optimizer row (and the staging) to the host and its
    device optimizer bytes to 0, its host bytes equal to what the groups hold."""
    from moe_lc.train import Trainer
    from tools.planner.plan import plan

    overrides = FAST + STEPS + ["train.micro_batch=4", "train.steps=3", f"train.output_dir={tmp_path}"]
    cfg = load_config(RECIPE, overrides + OFFLOADED + ["precision.recipe=bf16"])
    trainer = Trainer(cfg)
    for _ in range(3):
        trainer.train_step()
    trainer.optimizer.flush()  # the third step's updates wait for a next forward (optimizer_overlap)
    shards = trainer.optimizer.shards
    for s in shards:
        assert s.master.device.type == "cpu" and s.master.data_ptr() != s.grad_shard.data_ptr()
        assert s.view.grad is s.update_site.grad_host and s.update_site.param_host.dtype == torch.bfloat16
    rank = plan(cfg, 1).ranks[0]
    sent = {k: sum(s.update_site.sent[k] for s in shards) for k in ("d2h", "h2d")}
    assert sent == {k: 3 * v for k, v in rank.host_transfers.items()}
    assert rank.host_transfers["h2d"] * 2 == rank.host_transfers["d2h"]  # bf16 up, fp32 down
    assert rank.memory["optimizer"] == 0
    host = sum(s.state_bytes() + s.update_site.staging_bytes() for s in shards)
    assert rank.host_memory["optimizer"] + rank.host_memory["grads"] + rank.host_memory["params"] == host
    device = plan(load_config(RECIPE, overrides + ["precision.recipe=bf16"]), 1).ranks[0]
    assert device.memory["optimizer"] == rank.host_memory["optimizer"] == sum(s.state_bytes() for s in shards)
    assert device.host_transfers == {} and sum(device.host_memory.values()) == 0


@pytest.mark.slow  # two dry runs, ~12 s; the planner's host bytes are held to the runtime's in the default run
def test_the_dry_run_sees_the_optimizer_leave_the_device_as_the_planner_does():
    """A traced step (tools/dryrun.py, meta tensors) under pp2 DualPipe x dp2 x ep2, bf16: the optimizer's
    device bytes are 0 in trace and plan, the host bytes (master, state, both stagings) equal, every
    collective's bytes still the planner's and the same as with the optimizer on the device, and the traced
    peak drops by what the planner's drops (within 5%; at this tiny size the reference attention's S^2
    temporaries, which the planner leaves out, put both peaks ~9% over the planner's)."""
    from tests.test_dryrun import dryrun

    args = [str(RECIPE), "--ranks", "0", "--set=parallel.pp=2", "--set=parallel.pp_schedule=dualpipe",
            "--set=parallel.dp=2", "--set=parallel.ep=2", "--set=train.micro_batch=1", "--set=train.seq_len=256",
            "--set=precision.recipe=bf16"]
    device = dryrun(*args)["ranks"][0]
    offloaded = dryrun(*args, "--set=parallel.placement.optimizer=offloaded")["ranks"][0]
    memory = offloaded["comparison"]["memory"]
    assert all(traced == planned for traced, planned in (memory[k] for k in ("params", "grads", "optimizer")))
    assert memory["optimizer"] == [0, 0] and offloaded["update_applied"] and not offloaded["problems"]
    exact = {k: v[:2] for k, v in offloaded["comparison"]["comm"].items() if v[2] == "exact"}
    assert exact and all(traced == planned for traced, planned in exact.values())
    assert offloaded["comm"] == device["comm"]
    traced, planned = memory["host (optimizer)"]
    # per shard element: master + AdamW's two fp32 moments (12 B), the fp32 gradient (4) and bf16 parameter (2)
    assert traced == planned == device["comparison"]["memory"]["optimizer"][0] * (12 + 4 + 2) // 12
    (kept_traced, kept_planned), (away_traced, away_planned) = device["comparison"]["memory"]["peak"], memory["peak"]
    assert away_traced < kept_traced
    assert kept_traced - away_traced == pytest.approx(kept_planned - away_planned, rel=0.05)


def test_an_offloaded_optimizer_on_torchruns_one_thread_warns():
    """torchrun sets OMP_NUM_THREADS=1 where it starts several processes per machine, and the offloaded update
    runs on the process's CPU threads: with train.threads left at auto on a GPU run under torchrun, the recipe
    warns once; set threads, a CPU run, or one process without torchrun (auto takes the idle cores), it does not."""
    from moe_lc.config.rules import recipe_warnings

    torchrun = {"TORCHELASTIC_RUN_ID": "test", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "8"}

    def warned(*extra, env=torchrun):
        cfg = load_config(RECIPE, OFFLOADED + list(extra))
        return [w for w in recipe_warnings(cfg, env=env) if "offloaded" in w]

    assert len(warned("train.threads=0", "train.device=cuda")) == 1
    assert "set train.threads" in warned("train.threads=0", "train.device=auto")[0]
    assert warned("train.threads=8", "train.device=cuda") == warned("train.threads=0", "train.device=cpu") == []
    assert warned("train.threads=0", "train.device=auto", env={}) == []
