"""Activation offloading (train.offload, moe_lc/parallel/memory/offload.py) under DeepSeek Sparse Attention.

Sparse stage: `attn_core` takes what the sparse attention's kernel call (the `sparse_core`) keeps for
backward: the roped queries, the latent key rows, the output and the selected positions (its LSE, 8 KiB
here, stays under MIN_BYTES). The output is also wo's input and the positions are also the indexer loss's:
those later saves share the host copy, so the device bytes drop by exactly the host bytes. The planner's
trace books the same bytes; training is bit for bit the run without offloading, on one process and on cp2.
Warm-up stage: the main attention is MLA's dense core, so `attn_core` takes what it takes under MLA (the
indexer's dense KL keeps its own copies, which are not the core's).

Shapes: the debug MoE with MLA and the indexer (tests/test_dsa_training.py), top-32 of 128 tokens, 4 rows a
micro-batch, fp32: per layer q 192 KiB, key rows 80 KiB, output 128 KiB, positions 64 KiB.
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import load_config
from tests.harness import FAST, RECIPES, run_layout
from tests.test_dsa_training import DSA
from tests.test_offload import _saved_bytes

RECIPE = RECIPES / "debug_cpu.toml"
SHAPE = ["model.dsa.index_topk=32", "train.seq_len=128", "train.micro_batch=4"]
CORE = ['train.offload=["attn_core"]']
WARMUP = ["model.dsa.stage=warmup", "model.dsa.indexer_lr=1e-2", "train.optimizer=sgd", "train.sgd_momentum=0.9"]
TRAIN = ["train.steps=3", "train.global_batch=8", "train.warmup_steps=1"]


def _sparse_core_bytes(cfg) -> int:
    """What one DSA layer's sparse core moves: q (B, S, H, Dn + Dr), the key rows (B, S, Ckv + Dr), the output
    (B, S, H, Dv) and the int32 positions (B, S, k), fp32 here; the LSE (B, H, S) is under MIN_BYTES."""
    m, t = cfg.model, cfg.train
    rows = t.micro_batch * t.seq_len
    per_row = (m.n_heads * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim) + m.mla.kv_lora_rank
               + m.mla.qk_rope_head_dim + m.n_heads * m.mla.v_head_dim) * 4 + m.dsa.index_topk * 4
    return rows * per_row


def test_sparse_core_offload_moves_its_tensors_and_the_planner_books_them():
    """One process, 2 layers: the host holds q, key rows, output and positions of each layer; the device's
    saved bytes drop by exactly that; the planner's host bytes and its activation drop are the measured ones."""
    from tools.planner.plan import plan

    base = FAST + DSA + SHAPE + ["model.n_layers=2"]
    kept_cfg, away_cfg = load_config(RECIPE, base), load_config(RECIPE, base + CORE)
    (device_kept, host_none), (device_away, host) = _saved_bytes(kept_cfg), _saved_bytes(away_cfg)
    assert host_none == 0
    assert host == 2 * _sparse_core_bytes(away_cfg) == 950272
    assert device_kept - device_away == host
    kept, away = plan(kept_cfg, 1).ranks[0], plan(away_cfg, 1).ranks[0]
    assert kept.host_activations == 0 and away.host_activations == host
    assert kept.memory["activations"] - away.memory["activations"] == device_kept - device_away


def test_sparse_core_offload_under_cp2_is_booked_by_the_planner():
    """Under cp2 the sparse core is the ring's (ParallelSparseCore): the planner's trace on cp2 moves each
    rank's q and output (its 64 rows; the key rows and positions fall under MIN_BYTES there)."""
    from tools.planner.plan import plan

    base = FAST + DSA + SHAPE + ["model.n_layers=2", "parallel.cp=2", "parallel.dp=1"]
    away = plan(load_config(RECIPE, base + CORE, world_size=2), 2).ranks[0]
    q_out = 4 * 64 * 4 * (16 + 8 + 16) * 4
    assert away.host_activations == 2 * q_out


def test_sparse_stage_trains_bit_for_bit_with_its_core_offloaded():
    kept = run_layout(RECIPE, TRAIN + DSA + SHAPE, world=1)
    away = run_layout(RECIPE, TRAIN + DSA + SHAPE + CORE, world=1)
    assert away.losses == kept.losses
    assert all(torch.equal(away.final_state[k], v) for k, v in kept.final_state.items())


def test_sparse_stage_on_cp2_trains_bit_for_bit_with_its_core_offloaded():
    cp2 = ["parallel.cp=2"]
    kept = run_layout(RECIPE, TRAIN + DSA + SHAPE + cp2, world=2)
    away = run_layout(RECIPE, TRAIN + DSA + SHAPE + cp2 + CORE, world=2)
    assert away.losses == kept.losses
    assert all(torch.equal(away.final_state[k], v) for k, v in kept.final_state.items())


def test_warmup_stage_offloads_the_dense_core_as_mla_does():
    """The warm-up attends densely through MLA's core: attn_core moves what it moves under MLA at the same
    shape (q, k, v and the output of each layer), the device drop and the planner's are equal, and the
    warm-up's steps (main model frozen, indexer trained) are bit for bit the ones without offloading."""
    from tools.planner.plan import plan

    base = FAST + DSA + SHAPE + WARMUP + ["model.n_layers=2"]
    (device_kept, _), (device_away, host) = (_saved_bytes(load_config(RECIPE, base + e)) for e in ([], CORE))
    _, mla_host = _saved_bytes(load_config(RECIPE, FAST + DSA[:6] + SHAPE[1:] + ["model.n_layers=2"] + CORE))
    assert host == mla_host > 0
    kept, away = plan(load_config(RECIPE, base), 1).ranks[0], plan(load_config(RECIPE, base + CORE), 1).ranks[0]
    assert away.host_activations == host
    assert kept.memory["activations"] - away.memory["activations"] == device_kept - device_away >= host
    ref = run_layout(RECIPE, TRAIN + DSA + SHAPE + WARMUP, world=1)
    got = run_layout(RECIPE, TRAIN + DSA + SHAPE + WARMUP + CORE, world=1)
    assert got.losses == ref.losses
    assert all(torch.equal(got.final_state[k], v) for k, v in ref.final_state.items())


@pytest.mark.slow  # two dry runs and a plan, ~45 s
def test_offloading_the_sparse_core_lowers_the_dry_runs_peak_by_what_the_planner_predicts():
    """A traced step (tools/dryrun.py, meta tensors) of the sparse stage, 4 layers: the host bytes the dry
    run traces are the planner's, and offloading lowers the traced peak by exactly what it lowers the
    planner's: the host bytes less one layer's tensors, fetched back when backward reaches that layer (the
    planner's `offload fetch` term; the traced peak falls in that backward)."""
    from tests.test_dryrun import dryrun
    from tools.planner.plan import plan

    sets = DSA + SHAPE + ["parallel.dp=1", "train.global_batch=8"]
    args = [str(RECIPE), "--ranks", "0", *[f"--set={s}" for s in sets]]
    kept = dryrun(*args)["ranks"][0]["comparison"]["memory"]
    away = dryrun(*args, f"--set={CORE[0]}")["ranks"][0]["comparison"]["memory"]
    layer = _sparse_core_bytes(load_config(RECIPE, sets + CORE))
    traced_host, planned_host = away["host (offloaded)"]
    assert traced_host == planned_host == 4 * layer
    assert plan(load_config(RECIPE, sets + CORE), 1).ranks[0].transients["offload fetch"] == layer
    (kept_traced, kept_planned), (away_traced, away_planned) = kept["peak"], away["peak"]
    assert kept_traced - away_traced == kept_planned - away_planned == 3 * layer
