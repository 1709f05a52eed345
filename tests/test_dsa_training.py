"""DeepSeek Sparse Attention trains like one process under every layout, in both of DeepSeek-V3.2's stages.

The debug MoE with MLA and the indexer (4 heads of 16), top-16 of 64 tokens so that most queries really
select, 5 fp32 steps. Sparse stage: cp2, cp4, cp2 x tp2, pp2 DualPipe x cp2, cp2 with packed documents
(and their positions), losses and every parameter within 1e-5 of one process, the indexer's KL logged alike
(within 1e-3: it is ~1e-4, a small difference of two fp32 sums, so it carries the ring's rounding).
Warm-up stage: the same on cp2 and cp2 x tp2, with every parameter and router bias outside the indexers
bit-unchanged after the steps, and the indexers trained. (With SGD: Adam's first steps turn a gradient
element that rounding leaves at +-1e-12 into a full +-lr step, and the indexer's dead-ReLU directions have
such elements, so under Adam the layouts agree in the loss but not to 1e-5 in those weights.) Plus: a top-k as long as the sequence is the dense model exactly.
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model.transformer import build_model
from tests.harness import FAST, RECIPES, assert_equivalent, reference, run_layout
from tests.test_documents_training import TRAIN as DOC_TRAIN
from tests.test_documents_training import corpus  # noqa: F401 (fixture)

RECIPE = RECIPES / "debug_cpu.toml"
DSA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16", "model.dsa.enabled=true", "model.dsa.index_topk=16",
       "model.dsa.index_n_heads=4", "model.dsa.index_head_dim=16"]
TRAIN = ["train.steps=5", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.warmup_steps=2"]

SPARSE_LAYOUTS = {
    "cp2": (["parallel.cp=2"], 2),
    "cp4": (["parallel.cp=4"], 4),
    "cp2_tp2": (["parallel.cp=2", "parallel.tp=2"], 4),
    "pp2_dualpipe_cp2": (["parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.cp=2", "train.micro_batch=2"], 4),
}


def _kl(result) -> list[float]:
    return [row["dsa/indexer_kl"] for row in result.metrics]


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in ("cp4", "cp2_tp2") else k
                                    for k in SPARSE_LAYOUTS])
def test_sparse_stage_trains_like_one_process(layout):
    extra, world = SPARSE_LAYOUTS[layout]
    micro = [o for o in extra if o.startswith("train.")]
    ref = reference(RECIPE, TRAIN + DSA + micro)
    got = run_layout(RECIPE, TRAIN + DSA + extra, world=world)
    report = assert_equivalent(ref, got, rtol=1e-5)
    assert got.metrics and len(_kl(got)) == 5
    assert _kl(got) == pytest.approx(_kl(ref), rel=1e-3)
    print(f"DSA sparse {layout}: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e}")


def test_sparse_stage_with_packed_documents_trains_like_one_process(corpus):  # noqa: F811
    ref = reference(RECIPE, DOC_TRAIN + corpus + DSA)
    got = run_layout(RECIPE, DOC_TRAIN + corpus + DSA + ["parallel.cp=2"], world=2)
    report = assert_equivalent(ref, got, rtol=1e-5)
    assert _kl(got) == pytest.approx(_kl(ref), rel=1e-3)
    print(f"DSA sparse cp2 documents: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e}")


WARMUP = DSA + ["model.dsa.stage=warmup", "model.dsa.indexer_lr=1e-2", "train.optimizer=sgd", "train.sgd_momentum=0.9"]


@pytest.mark.parametrize("layout, world", [(["parallel.cp=2"], 2),
                                           pytest.param(["parallel.cp=2", "parallel.tp=2"], 4, marks=pytest.mark.slow)],
                         ids=["cp2", "cp2_tp2"])
def test_warmup_stage_trains_only_the_indexer_like_one_process(layout, world):
    cfg = load_config(RECIPE, FAST + TRAIN + WARMUP)  # the harness's seed
    start = {k: v.float() for k, v in build_model(cfg.model, cfg.train.seed).state_dict().items()}
    ref = reference(RECIPE, TRAIN + WARMUP)
    got = run_layout(RECIPE, TRAIN + WARMUP + layout, world=world)
    assert_equivalent(ref, got, rtol=1e-5)
    for name, before in start.items():
        after = got.final_state[name]
        if ".indexer." in name:
            assert not torch.equal(after, before), f"{name} did not train"
        else:
            assert torch.equal(after, before), f"{name} changed in the warm-up"
    assert all(row["dsa/topk_mass"] > 0 for row in got.metrics)
    assert _kl(got) == pytest.approx(_kl(ref), rel=1e-3)


def test_the_warmup_starts_from_a_dense_mla_checkpoint_and_the_sparse_stage_does_not(tmp_path):
    """DeepSeek-V3.2's warm-up starts from the dense model: checkpoint.init_from a dense MLA run's checkpoint
    (no indexer tensors) is taken, the indexer starting from its init and every main weight the checkpoint's,
    bit for bit (frozen); the sparse stage from the same dense checkpoint is refused in one line naming the
    indexer (it needs the warm-up's)."""
    from moe_lc.config import ConfigError
    from moe_lc.job.preflight import init_from_checkpoint

    ckpt = tmp_path / "dense" / "checkpoints"
    dense = run_layout(RECIPE, TRAIN + DSA[:6] + ["train.steps=1", f"checkpoint.dir={ckpt}",
                                                "checkpoint.save_final=true"], world=1)
    warm = run_layout(RECIPE, TRAIN + WARMUP + ["train.steps=1", f"checkpoint.init_from={ckpt}"], world=1)
    assert {k for k in warm.final_state if k not in dense.final_state} == \
        {k for k in warm.final_state if ".indexer." in k} != set()
    assert all(torch.equal(warm.final_state[k], v) for k, v in dense.final_state.items())
    with pytest.raises(ConfigError, match=r"checkpoint.init_from: .* lacks 16 tensors: layers.0.attn.indexer"):
        init_from_checkpoint(load_config(RECIPE, TRAIN + DSA + [f"checkpoint.init_from={ckpt}"]))


def test_topk_as_long_as_the_sequence_is_the_dense_model():
    dense = reference(RECIPE, TRAIN + DSA[:6])
    full = run_layout(RECIPE, TRAIN + DSA + ["model.dsa.index_topk=64", "train.steps=2"], world=1)
    assert full.losses == pytest.approx(dense.losses[:2], rel=1e-6)


RECOMPUTE = {
    "full": ["recompute.policy=full"],
    "selective": ["recompute.policy=selective", "recompute.selective=['norm','attention','mla_up','router']"],
}


@pytest.mark.parametrize("policy", [pytest.param("full", marks=pytest.mark.slow), "selective"])
def test_sparse_stage_under_recomputation_on_cp2_trains_like_one_process(policy):
    """Full: the block's replay selects again (the same keys: the selection is exact) and books the indexer loss
    once (in backward). Selective "attention": the sparse attention is replayed from q, the latent rows and the
    kept selection."""
    ref = reference(RECIPE, TRAIN + DSA)
    got = run_layout(RECIPE, TRAIN + DSA + RECOMPUTE[policy] + ["parallel.cp=2"], world=2)
    assert_equivalent(ref, got, rtol=1e-5)
    assert _kl(got) == pytest.approx(_kl(ref), rel=1e-3)


@pytest.mark.slow
def test_sparse_stage_in_fp8_on_cp2_tracks_one_process():
    """FP8 GEMMs in every Linear (the indexer's included): cp2 within the fp8 tolerance of one process."""
    from tests.harness import TOLERANCE

    fp8 = ["precision.recipe=fp8", "precision.fp8_backend=emulate"]
    ref = reference(RECIPE, TRAIN + DSA + fp8)
    got = run_layout(RECIPE, TRAIN + DSA + fp8 + ["parallel.cp=2"], world=2)
    assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses)) <= TOLERANCE["fp8"]
