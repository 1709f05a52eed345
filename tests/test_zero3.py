"""ZeRO-3 (parallel.placement.params = "sharded_gather", moe_lc/parallel/zero/param_gather.py): each rank keeps 1/N of the
parameters and gathers a unit (embedding, block, head) around its forward and its backward.

Equal to ZeRO-2, whose gradient rounds it uses, bit for bit under dp2, dp2 x ep2, cp2, pp2 1F1B x dp2 with a tied
embedding, Muon with QK-clip, DSA's warm-up, and with the optimizer and activations offloaded; within 1e-6 where
ZeRO-3's buckets, which end at unit boundaries where ZeRO-2's do not, change a sum's order: under dp2 x tp2 the
norms' and router's gradients are reduce-scattered over 4 ranks, and a ring sums an element in an order set by its
position in the bucket (over 2 ranks a + b is the same either way); under pp2 DualPipe a split backward's W passes
deliver gradients out of micro-batch order, so a round sums whichever gradients arrive before its bucket fills.
With one micro-batch per rank it is ZeRO-1 bit for bit, and a checkpoint resumes across ZeRO-1 and ZeRO-3 either
way exactly. Every step's counted bytes are the planner's; between units no parameter storage is held, and at
start-up no rank holds its whole model: the build draws nothing, ZeRO draws bucket by bucket."""

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from tests.harness import FAST, RECIPES, assert_bit_for_bit, compare, interrupted_and_resumed, run_layout
from tests.test_dsa_training import DSA

RECIPE = RECIPES / "debug_cpu.toml"
ZERO3 = ["parallel.placement.params=sharded_gather"]
ZERO2 = ["parallel.placement.grads=sharded"]
STEPS = ["train.steps=10", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2",
         "parallel.zero_bucket_mb=0.05", "train.grad_clip=0.5"]  # several buckets per unit; clipping on
LAYOUTS = {  # (overrides, world)
    "dp2": (["parallel.dp=2", "train.micro_batch=2"], 2),
    "dp2_offloads": (["parallel.dp=2", "train.micro_batch=2", "parallel.placement.optimizer=offloaded",
                      "train.offload=[\"expert_fc1\"]"], 2),
    "dp2_ep2": (["parallel.dp=2", "parallel.ep=2", "train.micro_batch=2"], 2),
    "dp2_muon_qk_clip": (["parallel.dp=2", "train.micro_batch=2", "train.optimizer=muon", "train.lr=0.02",
                          "train.qk_clip=2.0"], 2),
    "cp2": (["parallel.cp=2", "train.micro_batch=2"], 2),
    # the sparse attention's warm-up trains only its indexer, on a detached input: nodes that reach no chain input
    "dp2_dsa_warmup": (DSA + ["parallel.dp=2", "train.micro_batch=2", "model.dsa.stage=warmup"], 2),
    "dp2_tp2": (["parallel.dp=2", "parallel.tp=2", "train.micro_batch=2"], 4),
    "pp2_1f1b_dp2_tied": (["parallel.dp=2", "parallel.pp=2", "train.micro_batch=1", "model.tie_embeddings=true"], 4),
    "pp2_dualpipe_dp2": (["parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule=dualpipe", "train.micro_batch=1"],
                         4),
}
EXACT = {"dp2", "dp2_offloads", "dp2_ep2", "dp2_muon_qk_clip", "cp2", "pp2_1f1b_dp2_tied", "dp2_dsa_warmup"}
SLOW = {k for k, (_, world) in LAYOUTS.items() if world > 2} | {"dp2_ep2", "dp2_muon_qk_clip", "cp2", "dp2_dsa_warmup"}


def _planned_comm(overrides: list[str], world: int) -> dict:
    from tools.planner.plan import plan

    cfg = load_config(RECIPE, FAST + overrides, world_size=world)
    return plan(cfg, world).ranks[0].comm_per_step()


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if k in SLOW else []) for k in LAYOUTS])
def test_zero3_trains_like_zero2_and_sends_what_the_planner_says(layout):
    extra, world = LAYOUTS[layout]
    zero2 = run_layout(RECIPE, STEPS + extra + ZERO2, world=world)
    zero3 = run_layout(RECIPE, STEPS + extra + ZERO3, world=world)
    if layout not in EXACT:  # sums in another order (module docstring)
        report = compare(zero2, zero3)
        assert report.max_loss_rel < 1e-6 and report.max_param_rel < 1e-6, report
    else:
        assert_bit_for_bit(zero2, zero3)
    planned = _planned_comm(STEPS + extra + ZERO3, world)
    exact = {k: v for k, v in planned.items() if "all_to_all" not in k}  # EP's routed rows: an estimate
    for per_step in zero3.comm_per_rank[0]:
        assert {k: per_step.get(k, 0) for k in exact} == exact
    # the reduce-scatters are ZeRO-2's; the parameters travel as all-gathers per unit, not once after the step
    rs = {k: v for k, v in zero2.comm_per_rank[0][0].items() if "reduce_scatter" in k}
    assert {k: v for k, v in zero3.comm_per_rank[0][0].items() if "reduce_scatter" in k} == rs


def test_zero3_with_one_micro_batch_is_zero1_bit_for_bit():
    """One micro-batch per rank: one gradient round per bucket, summed as ZeRO-1 sums it."""
    one = STEPS + ["parallel.dp=2", "train.micro_batch=4"]
    assert_bit_for_bit(run_layout(RECIPE, one, world=2), run_layout(RECIPE, one + ZERO3, world=2))


@pytest.mark.parametrize("saved, resumed_as", [([], ZERO3), (ZERO3, ["parallel.placement.params=replicated"])],
                         ids=["zero1_to_zero3", "zero3_to_zero1"])
def test_a_checkpoint_resumes_across_zero1_and_zero3_exactly(tmp_path, saved, resumed_as):
    """Saved at step 3 under one placement, resumed under the other (one micro-batch per rank: the two train
    alike bit for bit): steps 4-6 are the uninterrupted run's. ZeRO-3 writes the gathered parameters."""
    overrides = STEPS[1:] + ["parallel.dp=2", "train.micro_batch=4"] + saved
    full, resumed = interrupted_and_resumed(RECIPE, overrides, resumed_as, world=2, ckpt=tmp_path / "ckpt")
    assert resumed.losses == full.losses[3:]
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())


def test_parameters_are_present_only_around_their_unit(tmp_path, monkeypatch):
    """One process, tied embedding and MTP (the head's chain reads the embedding), 2 micro-batches, 2 steps: after
    each step no bucket storage is held; each unit is gathered as often as the planner counts (its run of ZeRO,
    `trace_zero`: twice per micro-batch, the embedding once plus twice for the head); at most the running
    and the prefetched units (here three: the head's two and a prefetched block) are gathered at once, within
    the planner's "gathered units"; the kept shards are the planner's parameter bytes."""
    from moe_lc.parallel.zero import param_gather
    from moe_lc.train import Trainer
    from tools.planner.plan import plan
    from tools.planner.layout import rank_layouts
    from tools.planner.zero_trace import trace_zero

    overrides = FAST + STEPS + ZERO3 + ["train.micro_batch=4", "train.steps=2", f"train.output_dir={tmp_path}",
                                        "model.tie_embeddings=true", "model.mtp.depth=1"]
    cfg = load_config(RECIPE, overrides)
    trainer = Trainer(cfg)
    gather = trainer.param_gather
    held, most = set(), [0, 0]

    def ref(self, u, original=param_gather.ParamGather._ref):
        original(self, u)
        held.add(u.key)
        most[0] = max(most[0], len(held))
        most[1] = max(most[1], sum(self.units[k].elements() for k in held) * 4)

    def free(self, u, original=param_gather.ParamGather._free):
        original(self, u)
        held.discard(u.key)

    monkeypatch.setattr(param_gather.ParamGather, "_ref", ref)
    monkeypatch.setattr(param_gather.ParamGather, "_free", free)
    for step in range(2):
        trainer.train_step()
        assert not held
        assert all(b.full.untyped_storage().nbytes() == 0 for s in trainer.optimizer.shards for b in s.buckets)
    per_micro_batch = trace_zero(cfg, rank_layouts(cfg)[0], None).unit_gathers[0]
    assert per_micro_batch["embed"] == 3 and per_micro_batch["head"] == 2
    assert gather.gathers == 2 * 2 * sum(per_micro_batch.values())
    assert most[0] == 3
    rank = plan(cfg, 1).ranks[0]
    assert most[1] <= rank.transients["gathered units"]
    assert rank.memory["params"] == sum(s.param_store.shard.numel() * 4 for s in trainer.optimizer.shards)
    with trainer.params_present():  # what checkpoints and final-state gathering read
        assert all(p.untyped_storage().nbytes() > 0 for p in trainer.model.parameters())
    assert not held


def test_no_rank_ever_holds_its_whole_model(tmp_path, monkeypatch):
    """Start-up included: the build leaves every parameter without storage (nothing drawn), and ZeRO builds its
    buckets one at a time, each drawn through `initial_value`, its shard kept and the rest freed before the next;
    the shards hold the same values as a whole build's (tied embedding and MTP, 2 groups: dense and experts)."""
    from moe_lc.parallel.zero import optimizer as zero, param_store
    from moe_lc.parallel.build import build_rank_model
    from moe_lc.parallel.mesh import ParallelDims
    from moe_lc.train import Trainer

    cfg = load_config(RECIPE, FAST + STEPS + ZERO3 + [f"train.output_dir={tmp_path}", "model.tie_embeddings=true",
                                                      "model.mtp.depth=1"])
    dims = ParallelDims.from_config(cfg.parallel, 1, 0, "cpu")
    deferred = build_rank_model(cfg, dims, defer_params=True)
    assert all(p.untyped_storage().nbytes() == 0 for p in deferred.module.parameters())
    whole = dict(build_rank_model(cfg, dims).module.named_parameters())
    assert all(torch.equal(deferred.initial_value(n), p) for n, p in whole.items())
    others_held = []  # at each bucket's free during the build: how many other buckets hold storage

    def free(self, b, original=param_store.GatheredParams.free):
        buckets = [x for group in {*made, self} for x in group.buckets if x is not b and x.full is not None]
        others_held.append(sum(x.full.untyped_storage().nbytes() > 0 for x in buckets))
        original(self, b)

    made = []
    init = zero.ShardedParams.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(param_store.GatheredParams, "free", free)
    monkeypatch.setattr(zero.ShardedParams, "__init__", remember)
    trainer = Trainer(cfg)
    assert len(made) == 2 and len(others_held) == sum(len(group.buckets) for group in made) > 8
    assert not any(others_held)
    with trainer.params_present():
        assert all(torch.equal(p, whole[n]) for n, p in trainer.model.named_parameters())


def test_zero3_with_compiled_regions_is_refused():
    load_config(RECIPE, ZERO3)  # valid alone
    with pytest.raises(ConfigError, match="sharded_gather' with train.compile"):
        load_config(RECIPE, ZERO3 + ["train.compile=true"])


@pytest.mark.slow  # a dry run under a pipeline, ~10 s
def test_the_dry_run_traces_zero3_as_the_planner_plans_it():
    """A traced step (tools/dryrun.py, meta tensors) under pp2 DualPipe x dp2 x ep2, bf16: the kept parameter
    shards are the planner's, and every exact collective's bytes too (the per-unit all-gathers included)."""
    from tests.test_dryrun import dryrun

    args = [str(RECIPE), "--ranks", "0", "--set=parallel.pp=2", "--set=parallel.pp_schedule=dualpipe",
            "--set=parallel.dp=2", "--set=parallel.ep=2", "--set=train.micro_batch=1", "--set=train.seq_len=256",
            "--set=precision.recipe=bf16", "--set=parallel.zero_bucket_mb=0.5",
            "--set=parallel.placement.params=sharded_gather"]
    rank = dryrun(*args)["ranks"][0]
    memory = rank["comparison"]["memory"]
    assert all(traced == planned for traced, planned in (memory[k] for k in ("params", "grads", "optimizer")))
    exact = {k: v[:2] for k, v in rank["comparison"]["comm"].items() if v[2] == "exact"}
    assert any("all_gather" in k for k in exact) and all(traced == planned for traced, planned in exact.values())
    assert rank["update_applied"] and not rank["problems"]


LLAMA_70B = ["model.dim=8192", "model.n_layers=80", "model.n_heads=64", "model.n_kv_heads=8", "model.ffn_dim=28672",
             "model.vocab_size=32000", "model.moe.n_dense_layers=80", "train.seq_len=4096", "train.micro_batch=1",
             "train.global_batch=16", "precision.recipe=bf16", "data.tokenizer=byte"]


def test_the_zero_table_of_70b_on_16_ranks_comes_from_the_planners_rows():
    """ZeRO's published table (Rajbhandari et al. 2020, mixed-precision Adam: 2 + 2 + 12 bytes per parameter;
    70B on N = 16: ZeRO-1 332.5, ZeRO-2 201.25, ZeRO-3 70 GB per rank) from the planner's rows for a Llama-2-70B
    shape (69.0B parameters, dense_cpu.toml's blocks) at dp 16 under each runtime placement: each state's row
    placed as the planner places it, at the table's bytes per element, scaled to 70B. At the runtime's own
    bytes (fp32 main gradients, as Megatron's distributed optimizer keeps them, reduced in place): 6.75, 3 and
    1.125 bytes per parameter, 472.5 / 210 / 78.75 GB."""
    from dataclasses import replace

    from tools.planner.placement_semantics import memory_by_state
    from tools.planner.plan import plan

    paper = {"params": 2, "grads": 2, "optimizer": 12}
    placements = {"ZeRO-1": [], "ZeRO-2": ZERO2, "ZeRO-3": ZERO3}
    table, ours = {}, {}
    for name, sets in placements.items():
        rank = plan(load_config(RECIPES / "dense_cpu.toml", LLAMA_70B + sets, world_size=16), 16).ranks[0]
        rows = [r for r in rank.table if r.state in paper]
        psi = sum(r.numel for r in rows if r.state == "params")
        assert 68.9e9 < psi < 69.1e9
        at_paper = memory_by_state([replace(r, bytes_per_elem=paper[r.state]) for r in rows])
        table[name] = round(sum(at_paper.values()) / psi * 70e9 / 1e9, 2)
        ours[name] = round(sum(rank.memory[s] for s in paper) / psi * 70e9 / 1e9, 2)
    assert table == {"ZeRO-1": 332.5, "ZeRO-2": 201.25, "ZeRO-3": 70.0}
    assert ours == {"ZeRO-1": 472.5, "ZeRO-2": 210.0, "ZeRO-3": 78.75}
