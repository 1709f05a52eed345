"""Activation offloading (train.offload, moe_lc/parallel/memory/offload.py): what the named modules save goes to
host memory and comes back bit for bit, so training is ZeRO-1's without it, bit for bit, under dp2,
dp2 x ep2, dp2 x tp2 and pp2 DualPipe x dp2; a checkpoint saved without it resumes with it exactly;
the tensors really leave (the device-side saved bytes drop by what the host holds); the planner's trace
books them as host bytes; the recipe's rules refuse the combinations where nothing would be kept."""

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from tests.harness import FAST, RECIPES, interrupted_and_resumed, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
ALL = ['train.offload=["attn_core", "experts"]']
STEPS = ["train.steps=10", "train.seq_len=64", "train.global_batch=8", "train.warmup_steps=2"]
LAYOUTS = {  # overrides, world
    "dp2": (["parallel.dp=2", "train.micro_batch=2"], 2),
    "dp2_ep2": (["parallel.dp=2", "parallel.ep=2", "train.micro_batch=2"], 2),
    "dp2_tp2": (["parallel.dp=2", "parallel.tp=2", "train.micro_batch=2"], 4),
    "pp2_dualpipe_dp2": (["parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule=dualpipe", "train.micro_batch=1"], 4),
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if LAYOUTS[k][1] > 2 else [])
                                    for k in LAYOUTS])
def test_offloaded_activations_train_bit_for_bit_like_kept_ones(layout):
    extra, world = LAYOUTS[layout]
    kept = run_layout(RECIPE, STEPS + extra, world=world)
    away = run_layout(RECIPE, STEPS + extra + ALL, world=world)
    assert away.losses == kept.losses
    assert all(torch.equal(away.final_state[k], v) for k, v in kept.final_state.items())


def test_a_checkpoint_without_offload_resumes_with_it_exactly(tmp_path):
    full, resumed = interrupted_and_resumed(RECIPE, STEPS[1:] + ["parallel.dp=2", "train.micro_batch=2"], ALL,
                                            world=2, ckpt=tmp_path / "ckpt")
    assert resumed.losses == full.losses[3:]
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())


def _saved_bytes(cfg) -> tuple[int, int]:
    """(bytes autograd holds on the device for one micro-batch's backward, bytes the offload holds on the
    host), one process, measured with saved-tensor hooks around the whole forward."""
    from moe_lc.parallel.build import build_rank_model
    from moe_lc.parallel.mesh import ParallelDims

    torch.manual_seed(0)
    built = build_rank_model(cfg, ParallelDims.from_config(cfg.parallel, 1), "cpu", pipeline=(None, None))
    held = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            held[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = built.module(tokens, labels=tokens)
    host = built.offload.host_bytes if built.offload is not None else 0
    loss.backward()
    if built.offload is not None:
        assert built.offload.host_bytes == 0  # backward took every copy back
    return sum(held.values()), host


def test_offloaded_tensors_leave_the_device_and_come_back():
    """The tensors the hooks take are not among those autograd keeps on the device: the device's saved
    bytes drop by at least the host's (a host copy of each); after backward the host holds nothing."""
    base = FAST + ["train.seq_len=128", "train.micro_batch=4"]
    device_kept, host_none = _saved_bytes(load_config(RECIPE, base))
    device_away, host = _saved_bytes(load_config(RECIPE, base + ALL))
    assert host_none == 0 and host > 0
    assert device_away <= device_kept - host, (device_kept, device_away, host)


@pytest.mark.parametrize("items", [ALL, ['train.offload=["attn_core"]'], ['train.offload=["expert_fc1"]']],
                         ids=["attn_core+experts", "attn_core", "expert_fc1"])
def test_the_planner_books_offloaded_bytes_on_the_host_as_measured(items):
    """The planner's trace (meta tensors) books each offloaded tensor as host bytes: its host bytes equal
    the measured offload's, and its device saved bytes drop by exactly what the measured forward's drop."""
    from tools.planner.plan import plan

    base = FAST + ["train.seq_len=128", "train.micro_batch=4"]
    (device_kept, _), (device_away, host) = (_saved_bytes(load_config(RECIPE, base + extra)) for extra in ([], items))
    kept = plan(load_config(RECIPE, base), 1).ranks[0]
    away = plan(load_config(RECIPE, base + items), 1).ranks[0]
    assert kept.host_activations == 0 and away.host_activations == host > 0
    assert kept.memory["activations"] - away.memory["activations"] == device_kept - device_away


@pytest.mark.parametrize("extra, words", [
    (["recompute.policy=full"], "nothing to offload"),
    (["recompute.policy=selective", 'recompute.selective=["norm", "attention"]', 'train.offload=["attn_core"]'],
     "replayed in backward"),
    (["train.compile=true"], "train.compile is not built"),
    (["recompute.policy=selective", 'recompute.selective=["norm", "swiglu"]'], "offload 'expert_fc1' instead"),
])
def test_offload_refuses_what_would_keep_nothing(extra, words):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, ALL + extra)
    assert any(words in e for e in err.value.errors), err.value.errors


def test_attn_core_beside_the_mla_up_replay_moves_the_output_and_lse():
    """The mla_up replay rebuilds the core's q, k, v from the latents, so attn_core leaves them to it and moves
    the core's output and LSE (the output is also wo's input: one host copy serves both): every host byte is a
    device byte freed, and the recipe no longer warns."""
    from moe_lc.config.rules import recipe_warnings
    from tools.planner.plan import plan

    mla = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
           "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16", "recompute.policy=selective",
           'recompute.selective=["norm", "mla_up"]', "train.seq_len=512"]
    kept, away = (load_config(RECIPE, mla + extra) for extra in ([], ['train.offload=["attn_core"]']))
    assert not any("offload" in w for w in recipe_warnings(away))
    kept, away = plan(kept, 1).ranks[0], plan(away, 1).ranks[0]
    m = away.memory
    # micro-batch 4 x S x 4 heads x v_head_dim 16 fp32, 4 blocks (the LSE, 32 KiB a block, is under the offload's
    # 64 KiB floor and stays)
    out = 4 * 512 * 4 * 16 * 4 * 4
    assert away.host_activations == kept.memory["activations"] - m["activations"] == out


@pytest.mark.slow  # ~13 s; the mid-size DualPipe layout's dry run with offloading stays in the default run
def test_the_dry_run_sees_offloaded_bytes_leave_the_device_as_the_planner_does():
    """A traced step (tools/dryrun.py, meta tensors) with offloading under pp2 DualPipe x ep2: the host
    bytes at their most equal the planner's schedule walk of them; the saved activations are within the
    dry run's usual 5% of the planner's, and offloading moves the traced peak by what it moves the
    planner's (within 5%: at this tiny size the reference attention's S^2 temporaries, which the planner
    leaves out, already put the peak 8.6% over it without offloading)."""
    from tests.test_dryrun import dryrun

    args = [str(RECIPE), "--ranks", "0", "--set=parallel.pp=2", "--set=parallel.pp_schedule=dualpipe",
            "--set=parallel.dp=2", "--set=parallel.ep=2", "--set=train.micro_batch=1", "--set=train.seq_len=256"]
    kept = dryrun(*args)["ranks"][0]["comparison"]["memory"]
    away = dryrun(*args, '--set=train.offload=["attn_core", "experts"]')["ranks"][0]["comparison"]["memory"]
    traced, planned = away["host (offloaded)"]
    assert traced == planned > 0
    assert away["saved activations"][0] == pytest.approx(away["saved activations"][1], rel=0.05)
    assert away["saved activations"][0] < kept["saved activations"][0]
    (kept_traced, kept_planned), (away_traced, away_planned) = kept["peak"], away["peak"]
    assert away_traced - kept_traced == pytest.approx(away_planned - kept_planned, abs=0.05 * away_planned)
    assert away_traced < kept_traced


@pytest.mark.slow  # two plans of the 671B model at 128K: ~40 s
def test_the_671b_128k_layout_on_1024_gpus_fits_80gb_by_offloading_expert_inputs():
    """recipes/deepseek_v3_671b_128k_1024.toml: the planner puts pp 0 over an 80 GB GPU (74.5 GiB)
    without offloading and every pipeline rank under it with expert_fc1 offloaded, the host bytes stated
    (the dry run traces every role: docs/results/dryrun-671b-128k-1024)."""
    from tools.planner.plan import plan

    recipe = RECIPES / "deepseek_v3_671b_128k_1024.toml"
    gib80 = 80e9
    offloaded = plan(load_config(recipe, world_size=1024), 1024)
    kept = plan(load_config(recipe, ["train.offload=[]"], world_size=1024), 1024)
    assert offloaded.degrees["world"] == 1024 and offloaded.degrees["dp"] == 2
    assert max(r.peak_bytes() for r in kept.ranks) > gib80
    assert all(r.peak_bytes() < gib80 and r.host_activations > 0 for r in offloaded.ranks)


def test_mid_size_dualpipe_ep_tp_layout_with_offload_matches_the_planner():
    """The dry run's mid-size layout (16B widths, pp4 DualPipe x dp8 x tp2, ep8, 4K) with expert_fc1
    offloaded: states and traffic exact, saved activations and peak within 5% of the planner's, host bytes
    within 5% (measured: -3.3% and 0.0%). (On pp16 with 32 micro-batches the planner's peak runs up to 15%
    over the traced one on the deeper ranks: docs/results/dryrun-671b-128k-1024.)"""
    from tests.test_dryrun import MID, MID_RECIPE, assert_holds_the_planner_to_it, dryrun

    result = dryrun(MID_RECIPE, "--ranks", "0,16", *[f"--set={s}" for s in MID], '--set=train.offload=["expert_fc1"]')
    for report in result["ranks"]:
        assert_holds_the_planner_to_it(report)
        traced, planned = report["comparison"]["memory"]["host (offloaded)"]
        assert traced == pytest.approx(planned, rel=0.05) and planned > 0
