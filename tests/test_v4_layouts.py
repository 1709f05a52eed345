"""A V3-attention tiny model with DeepSeek-V4's other pieces on (mHC residual streams, two hash-routed MoE layers,
sqrt(softplus) scores with the sequence-wise loss and bias balancing, clamped SwiGLU) trains on the CPU with
V4's Muon, and equals itself under dp2 x ep2 (hash layers included: each rank routes its own tokens by their
ids) and cp2 (the ids arrive zig-zag sharded with the tokens); plus the layout it refuses (MTP), in one line.

The layouts are compared under SGD, not an update rule that normalizes each gradient (AdamW, Muon): some
gradients here are zero up to rounding, and such a rule turns their rounding into full-size steps that differ
by layout. The first mHC of the stack reads hc_mult identical copies of the embedding, so every doubly
stochastic residual map gives it the same output and its comb parameters' gradient is rounding noise (AdamW,
3 steps: layers.0.attn_res.bias 6e-5 apart under dp2 x ep2, every tensor but mHC's maps within 2e-6); the
SwiGLU clamp's gradient mask and the learned routing flip on 1e-7 differences near their edges, which Muon's
per-matrix normalization carries into whole experts (4e-4). Under SGD every tensor is within 6e-6."""

from __future__ import annotations

import pytest

from moe_lc.config import ConfigError, load_config
from tests.harness import RECIPES, assert_equivalent, reference, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
# swiglu_limit 0.05: the tiny model's gate / up values are ~0.1 at init, so the clamp acts on part of them
V4_BITS = ["model.residual=mhc", "model.mhc.sinkhorn_iters=20", "model.moe.score_func=sqrtsoftplus",
           "model.moe.n_groups=1", "model.moe.topk_groups=1", "model.moe.hash_layers=2",
           "model.moe.swiglu_limit=0.05", "model.moe.aux_loss_weight=1e-4", "model.moe.routed_scaling_factor=1.5",
           "train.steps=4", "train.warmup_steps=1", "train.seq_len=64"]
V4_MUON = ["train.optimizer=muon", "train.muon_ns=v4", "train.muon_update_rms=0.18", "train.lr=0.01"]
SGD = ["train.optimizer=sgd", "train.lr=0.05"]
BATCH = ["train.global_batch=4", "train.micro_batch=2"]


def test_v4_bits_train_on_one_process_with_v4_muon():
    ref = reference(RECIPE, V4_BITS + V4_MUON + BATCH)
    assert ref.losses[-1] < 0.7 * ref.losses[0], ref.losses
    names = ref.final_state.keys()
    assert "layers.1.ffn.router.tid2eid" in names and "layers.0.attn_res.fn.weight" in names
    assert "layers.3.ffn.router.tid2eid" not in names  # layers 1-2 hash-routed, 3 learned


@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.ep=2"], ["parallel.dp=1", "parallel.cp=2"]],
                         ids=["dp2_ep2", "cp2"])
def test_v4_bits_under_layouts_equal_one_process(layout):
    ref = reference(RECIPE, V4_BITS + SGD + BATCH)
    got = run_layout(RECIPE, V4_BITS + SGD + BATCH + layout, world=2)
    assert_equivalent(ref, got)


def test_refused_layouts_say_why():
    """MTP with 1F1B is refused in one line (tests/test_v4_mtp.py); tp and pp with mHC and hash layers are built
    (tests/test_v4_parallel.py)."""
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, V4_BITS + ["model.mtp.depth=1", "parallel.pp=2", "parallel.dp=1"], world_size=2)
    assert err.value.errors == ["model.mtp.depth=1 with parallel.pp=2 needs pp_schedule 'dualpipe' or 'dualpipev' (the "
                                "MTP modules share the embedding, which must sit on the last stage's rank)"]
    for layout in (["parallel.tp=2"], ["parallel.pp=2"], ["parallel.pp=2", "parallel.pp_schedule=dualpipe"]):
        load_config(RECIPE, V4_BITS + layout + ["parallel.dp=1"], world_size=2)
