"""FP8 activation caching (precision.fp8_cache, DeepSeek-V3 section 3.3.3): "linear" keeps FP8 GEMM inputs
as their weight gradient quantizes them (no number changes), "swiglu" and "attn_out" keep the SwiGLU
inputs and the attention output in FP8 tiles (backward reads them rounded). Saved bytes fall by what
the planner predicts, to the byte; the caches compose with DualPipe, EP and DP."""

import pytest
import torch

from moe_lc.config import ConfigError, PrecisionConfig, RecomputeConfig, load_config
from moe_lc.model.mtp import mtp_targets
from moe_lc.model.transformer import Transformer
from moe_lc.ops import fp8
from moe_lc.ops.fp8_linear import Fp8Gemms, KeepFp8ForWgrad
from moe_lc.ops.fp8_storage import Fp8Tiles
from moe_lc.ops.linear import KEEP_AS_IS, GroupedLinear, Linear, WeightGradStore
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from tests.harness import RECIPES, TOLERANCE, assert_equivalent, reference, run_layout
from tools.planner.activation_memory import estimate, measure_saved_bytes
from tools.dry_run.trace import balanced_select

RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=4", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=1", "train.warmup_steps=2"]
FP8 = BASE + ["precision.recipe=fp8"]
MLA = ["model.attention=mla", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=32",
       "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=32"]


def _weight_grads(layer, x, counts=None, defer=False):
    layer.weight.grad = None
    store = layer.wgrad_store = WeightGradStore()
    with store.deferring() if defer else torch.enable_grad():
        y = layer(x) if counts is None else layer(x, counts)
        y.float().square().sum().backward()
    store.flush()
    return layer.weight.grad.clone()


@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise"])
@pytest.mark.parametrize("backend", ["emulate", "scaled_mm"])
def test_linear_input_cache_gives_the_same_weight_gradients_bit_for_bit(scaling, backend):
    torch.manual_seed(0)
    dense = Linear(256, 96).to(torch.bfloat16)
    experts = GroupedLinear(4, 256, 96).to(torch.bfloat16)
    for layer in (dense, experts):
        torch.nn.init.normal_(layer.weight)
        layer.gemms = Fp8Gemms(scaling, backend)
    x = torch.randn(3, 100, 256, dtype=torch.bfloat16)
    rows, counts = torch.randn(300, 256, dtype=torch.bfloat16), torch.tensor([100, 0, 150, 50])  # an empty expert
    for defer in (False, True):  # a deferred W (ZB-H1, DualPipe) holds dy quantized as well
        want = _weight_grads(dense, x, defer=defer), _weight_grads(experts, rows, counts, defer=defer)
        dense.keep_input = experts.keep_input = KeepFp8ForWgrad()
        got = _weight_grads(dense, x, defer=defer), _weight_grads(experts, rows, counts, defer=defer)
        dense.keep_input = experts.keep_input = KEEP_AS_IS
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_the_kept_input_is_the_wgrad_operand_at_half_the_bytes():
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    op = fp8.wgrad_operand(x, "blockwise")
    assert op.data.dtype == fp8.FP8_DTYPE and op.data.shape == (256, 512) and op.scale.shape == (256, 4)
    assert op.data.nbytes + op.scale.nbytes == x.nbytes // 2 + x.nbytes // 64  # 1 byte + 4 per 128 tokens
    dy = torch.randn(512, 96, dtype=torch.bfloat16)
    assert torch.equal(fp8.fp8_wgrad_emulated(dy, op, "blockwise"), fp8.fp8_wgrad_emulated(dy, x, "blockwise"))
    assert torch.equal(fp8.fp8_wgrad_scaled_mm(dy, op, "blockwise"), fp8.fp8_wgrad_scaled_mm(dy, x, "blockwise"))


def test_power_of_two_tiles_dequantize_exactly_in_bf16():
    """The attention output's tiles: scales 2^k, so FP8 value x scale is a bf16 number (wo's weight
    gradient requantizes exactly what the core's backward reads)."""
    x = torch.randn(4, 64, 3, 160, dtype=torch.bfloat16) * torch.logspace(-4, 4, 160).to(torch.bfloat16)
    tiles = Fp8Tiles.quantize(x, pow2=True)
    assert torch.equal(tiles.scale, torch.exp2(torch.log2(tiles.scale).round()))
    assert torch.equal(tiles.dequantize().float(), fp8.dequantize_rowwise_tiles(tiles.data, tiles.scale))
    rel = ((tiles.dequantize().float() - x.float()).abs().amax(-1) / x.float().abs().amax(-1)).max()
    assert 0 < rel <= 2 ** -3  # e4m3 rounding, at most one bit lost to the power-of-two scale


def test_linear_cache_trains_bit_identically():
    plain, cached = reference(RECIPE, FP8), reference(RECIPE, FP8 + ["precision.fp8_cache=linear"])
    assert cached.losses == plain.losses
    assert all(torch.equal(cached.final_state[k], v) for k, v in plain.final_state.items())


@pytest.mark.slow
def test_swiglu_and_attn_out_caches_stay_within_the_fp8_tolerance():
    """They round what backward reads (the SwiGLU input, the attention output): losses move, within the
    tolerance the fp8 recipe is held to against bf16; the forward of step 1 is untouched."""
    plain = reference(RECIPE, FP8)
    for items in ("swiglu", "attn_out", "linear,swiglu,attn_out"):
        cached = reference(RECIPE, FP8 + [f"precision.fp8_cache={items}"])
        assert cached.losses[0] == plain.losses[0]
        rel = max(abs(a - b) / abs(b) for a, b in zip(cached.losses, plain.losses))
        assert 0 < rel <= TOLERANCE["fp8"], (items, plain.losses, cached.losses)


CASES = {
    "gqa": ([], "selective", ["norm", "swiglu"]),
    "gqa-router": ([], "selective", ["norm", "swiglu", "router"]),
    "gqa-none-weighted": (["model.moe.weighted_swiglu=true"], "none", []),
    "mla-no-qlora": (MLA, "selective", ["norm", "swiglu"]),
    "mla-up-qlora-mtp": (MLA + ["model.mla.q_lora_rank=48", "model.mtp.depth=1"], "selective",
                         ["norm", "swiglu", "mla_up", "router"]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_saved_bytes_fall_by_what_the_planner_predicts(case):
    model_overrides, policy, selective = case
    cfg = load_config(RECIPE, ["train.seq_len=64", "precision.recipe=fp8", *model_overrides])
    B, S = cfg.train.micro_batch, cfg.train.seq_len
    tokens = torch.randint(0, 259, (B, S + 1))
    mtp = mtp_targets(tokens, None, cfg.model.mtp.depth) if cfg.model.mtp.depth else None
    measured = {}
    for items in ([], ["linear"], ["swiglu"], ["attn_out"], ["linear", "swiglu", "attn_out"]):
        torch.manual_seed(0)
        model = Transformer(cfg.model).to(torch.bfloat16).train()
        options = LayerPlanOptions(precision=PrecisionConfig(recipe="fp8", fp8_backend="emulate", fp8_cache=items),
                                   recompute=RecomputeConfig(policy=policy, selective=list(selective)))
        # the planner's routing: per-expert FP8 scale tiles follow it
        apply_layer_plan(model, options=options, route=balanced_select)
        got = measure_saved_bytes(model, lambda: model(tokens[:, :-1], labels=tokens[:, 1:], mtp=mtp))
        est = estimate(cfg.model, B, S, 2, policy=policy, selective=tuple(selective), fp8_cache=tuple(items))
        for i, predicted in est.layers.items():  # (1%: the experts' wgrad scales, one per 128 rows of
            assert got[f"layer{i}"] == pytest.approx(predicted, rel=1e-2), (items, i)  # each, follow routing)
        assert got["head"] == pytest.approx(est.head, rel=1e-3), items
        measured[tuple(items)] = sum(got.values())
    assert measured[("linear", "swiglu", "attn_out")] < min(v for k, v in measured.items() if len(k) < 3)


@pytest.mark.slow
def test_caches_compose_with_dualpipe_ep_and_dp():
    """pp2 DualPipe x dp2 with ep2 folded in (4 ranks) against one process, both with the caches that
    round (fp32: the equivalence harness's precision): losses within 1e-5, parameters within 1e-3 (a
    1e-7 difference from the pipeline's reordered sums can move a value across an FP8 rounding
    boundary, as with FP8 dispatch). "linear", under the fp8 recipe: the same layout without it gives
    the same numbers bit for bit (split backward and deferred W included)."""
    layout = ["parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.ep=2", "parallel.dp=2"]
    rounding = BASE + ["precision.fp8_cache=swiglu,attn_out", "recompute.policy=selective",
                       "recompute.selective=norm,swiglu,router"]
    report = assert_equivalent(reference(RECIPE, rounding), run_layout(RECIPE, rounding + layout, world=4), rtol=1e-3)
    assert report.max_loss_rel <= 1e-5
    plain = run_layout(RECIPE, FP8 + layout, world=4)
    cached = run_layout(RECIPE, FP8 + ["precision.fp8_cache=linear"] + layout, world=4)
    assert cached.losses == plain.losses
    assert all(torch.equal(cached.final_state[k], v) for k, v in plain.final_state.items())


def test_recipe_rules_for_the_cache():
    with pytest.raises(ConfigError, match="item 'linear' keeps FP8 GEMM inputs as their weight gradient quantizes"):
        load_config(RECIPE, ["precision.recipe=bf16", "precision.fp8_cache=linear"])
    with pytest.raises(ConfigError, match="delayed scaling quantizes at GEMM time"):
        load_config(RECIPE, ["precision.recipe=fp8", "precision.fp8_scaling=delayed", "precision.fp8_cache=linear"])
    with pytest.raises(ConfigError, match="with recompute.policy='full': full recomputation keeps only"):
        load_config(RECIPE, ["precision.fp8_cache=swiglu", "recompute.policy=full"])
    with pytest.raises(ConfigError, match="fp8_cache"):
        load_config(RECIPE, ["precision.fp8_cache=swiglu,norm"])
