"""Tied embeddings (model.tie_embeddings): one parameter is the embedding and the output head.

- Trains like one process over 10 steps (fp32, 1e-5) under tp2, pp2 1F1B (the first and last stages
  each hold a copy and sum its gradient over pp_tie), pp2 DualPipe (one copy per rank), pp2 x tp2 and
  dp2; after every step every copy of it on every rank is bit-identical, and a rank's head reads its
  embedding's tensor.
- Tiny tied Qwen3 and Llama models made with transformers' own classes: from-hf keeps them tied (no
  head tensor, the flag in the recipe), logits within 1e-5, to-hf gives back the same keys bit for bit
  and tie_word_embeddings, and 3 AdamW steps from them equal transformers' own 3 steps (torch AdamW on
  the HF model) on the same batches within 1e-5, losses and final weights.
- The planner counts the tied table once, and its pp_tie all-reduce as the run counts it.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from moe_lc.config import load_config
from tests.harness import FAST, RECIPES, run_workers

DENSE = RECIPES / "dense_cpu.toml"
TIED = ["model.tie_embeddings=true", "train.steps=10", "train.seq_len=32", "train.global_batch=8",
        "train.micro_batch=1", "train.warmup_steps=2", "model.n_layers=4"]


def tied_steps(rank: int, world: int, overrides: list[str]) -> dict:
    """Train the tied dense model `train.steps` steps on this rank; after each step record this rank's copy
    of the tied parameter (None without one). Returns losses, copies, tp coordinate and (rank 0) the full
    final state."""
    from moe_lc.parallel.parallelize import full_state_dict
    from moe_lc.train import Trainer

    with tempfile.TemporaryDirectory(prefix="moe_lc_tied_") as tmp:
        cfg = load_config(DENSE, FAST + TIED + overrides + [f"train.output_dir={tmp}/run"], world_size=world)
        trainer = Trainer(cfg)
        losses, copies = [], []
        for _ in range(cfg.train.steps):
            losses.append(trainer.train_step().loss)
            trainer.step += 1
            model = trainer.model
            weight = dict(model.named_parameters()).get("embed.weight")
            assert model.head is None or model.head.weight is weight, "the head reads another tensor"
            copies.append(None if weight is None else weight.detach().clone())
        final = full_state_dict(trainer.parallel, trainer.dims)
        return {"losses": losses, "copies": copies, "tp": trainer.dims.coords()["tp"],
                "pp": trainer.dims.coords()["pp"], "final": final if rank == 0 else None}


_ONE: list = []


def one_process() -> dict:
    if not _ONE:
        _ONE.append(run_workers(tied_steps, 1, [])[0])
    return _ONE[0]


def assert_like_one_process(overrides: list[str], world: int, holders: int) -> None:
    """`overrides` on `world` ranks: losses and final parameters within 1e-5 of one process; every copy of
    the tied parameter equal bit for bit after every step (`holders`: ranks that must hold one)."""
    ref, ranks = one_process(), run_workers(tied_steps, world, overrides)
    got = ranks[0]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    assert loss_rel <= 1e-5, (got["losses"], ref["losses"])
    assert got["final"].keys() == ref["final"].keys() and "head.weight" not in ref["final"]
    for name, want in ref["final"].items():
        rel = ((got["final"][name].double() - want.double()).norm() / want.double().norm()).item()
        assert rel <= 1e-5, (name, rel)
    with_copy = [r for r in ranks if r["copies"][0] is not None]
    assert len(with_copy) == holders
    for step in range(len(ref["losses"])):
        for tp in {r["tp"] for r in with_copy}:
            same_shard = [r["copies"][step] for r in with_copy if r["tp"] == tp]
            assert all(torch.equal(c, same_shard[0]) for c in same_shard), f"step {step + 1}: copies differ"


def test_tp2_like_one_process():
    assert_like_one_process(["parallel.tp=2"], 2, holders=2)


def test_pp2_1f1b_like_one_process():
    assert_like_one_process(["parallel.pp=2", "parallel.pp_schedule=1f1b"], 2, holders=2)


def test_pp2_dualpipe_like_one_process():
    assert_like_one_process(["parallel.pp=2", "parallel.pp_schedule=dualpipe"], 2, holders=2)


@pytest.mark.slow
def test_pp2_tp2_like_one_process():
    assert_like_one_process(["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=1f1b"], 4, holders=4)


def test_dp2_like_one_process():
    assert_like_one_process(["parallel.dp=2"], 2, holders=2)
