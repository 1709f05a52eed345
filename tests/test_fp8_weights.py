"""The FP8 weight cache (moe_lc/ops/fp8_weights.py, `precision.fp8_weight_cache`): the same numbers as
quantizing the weight at every GEMM, bit for bit; one quantization per weight per optimizer step (per gather
under ZeRO-3), recomputed regions included; a fresh copy after every write (an in-place update, ZeRO's publish
and gather); the bytes the planner counts."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_lc.config import load_config
from moe_lc.ops import fp8, fp8_weights
from moe_lc.ops.fp8_linear import Fp8Gemms
from moe_lc.ops.linear import GroupedLinear, Linear
from moe_lc.parallel.comm import Group
from moe_lc.parallel.zero.layout import build_buckets
from moe_lc.parallel.zero.param_store import FlatParams, GatheredParams
from tests.harness import FAST, RECIPES, run_workers

COUNTS = torch.tensor([50, 0, 77])  # grouped rows per expert: one expert without tokens
RECIPE = RECIPES / "debug_cpu.toml"
TRAIN = FAST + ["train.steps=2", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=1",
                "train.warmup_steps=1", "precision.recipe=fp8"]


def _model(scaling: str, backend: str, cache: bool, dtype=torch.float32) -> torch.nn.ModuleList:
    """Linears with short tiles and blocks (K = 200, N = 136) and aligned ones, and a 3-expert GroupedLinear."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Linear(200, 136, dtype=dtype), Linear(136, 256, dtype=dtype),
                                  GroupedLinear(3, 256, 130, dtype=dtype)])
    gemms = Fp8Gemms(scaling, backend, cache_weights=cache)
    for layer in layers:
        torch.nn.init.normal_(layer.weight, std=0.05)
        layer.gemms = gemms
    return layers


def _forward(layers, x: torch.Tensor, recompute: bool = False) -> torch.Tensor:
    """x (127, 200) -> (127, 130); `recompute`: the two Linears in a checkpointed (recomputed) region."""
    run = lambda t: layers[1](layers[0](t))  # noqa: E731
    h = checkpoint(run, x, use_reentrant=False) if recompute else run(x)
    return layers[2](h, COUNTS)


def _train(layers, steps: int = 3, micro_batches: int = 2, recompute: bool = False) -> list[torch.Tensor]:
    """`steps` AdamW steps of `micro_batches` each -> every output, input gradient and weight gradient."""
    torch.manual_seed(1)
    opt, seen = torch.optim.AdamW(layers.parameters(), lr=1e-2), []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(127, 200, dtype=layers[0].weight.dtype, requires_grad=True)
            y = _forward(layers, x, recompute)
            y.backward(torch.randn_like(y))
            seen += [y, x.grad]
        seen += [p.grad.clone() for p in layers.parameters()]
        opt.step()
        opt.zero_grad()
    return seen


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t


@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise"])
@pytest.mark.parametrize("backend", ["emulate", "scaled_mm"])
def test_the_cache_changes_no_number(scaling, backend):
    """Outputs and gradients over three AdamW steps of two micro-batches, recomputed region included, bit for
    bit against quantizing the weight at every GEMM; each weight quantized once per step."""
    cached = _model(scaling, backend, True)
    got, want = _train(cached, recompute=True), _train(_model(scaling, backend, False), recompute=True)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert cached[0].gemms.weights.quantizations == 3 * 3  # steps x weights: not per micro-batch, GEMM or replay


def test_bf16_weights_too():
    got, want = (_train(_model("blockwise", "scaled_mm", cache, torch.bfloat16), steps=2) for cache in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_dgrad_operand_is_the_transpose_quantized(recipe):
    """dgrad's w^T, transposed from fprop's copy, is what quantizing w^T gives, bit for bit (and an expert's
    of a grouped weight likewise)."""
    quantize = fp8.quantize_blocks if recipe == "blockwise" else fp8.quantize_tensorwise
    cache = fp8_weights.WeightCache(recipe)
    for w in (torch.nn.Parameter(torch.randn(300, 200)), torch.nn.Parameter(torch.randn(2, 130, 260))):
        weight = fp8_weights.CachedWeight(w, torch.float32, cache)
        for e in range(w.shape[0]) if w.dim() == 3 else [None]:
            one = weight if e is None else weight[e]
            values = w.detach() if e is None else w.detach()[e]
            for gemm, rhs in (("fprop", values), ("dgrad", values.t())):
                op, (data, scale) = one.operand(gemm), quantize(rhs)
                assert torch.equal(_bits(op.data), _bits(data)) and torch.equal(op.scale, scale)
                assert op.data.is_contiguous()  # as the GEMM's own quantization lays it out (cuBLASLt's layout)
    assert cache.quantizations == 2


def test_a_write_in_place_requantizes():
    """Never stale: an in-place write through the parameter (what an optimizer's step does) moves its version
    counter, so the next forward quantizes the new values; one through `.data` needs `forget` (ZeRO's stores
    call it)."""
    layer = _model("blockwise", "emulate", True)[0]
    x = torch.randn(8, 200)
    layer(x)
    with torch.no_grad():
        layer.weight.mul_(-3.0)
    assert torch.equal(layer(x), fp8.fp8_linear_emulated(x, layer.weight.detach(), "blockwise"))
    layer.weight.data.copy_(torch.randn(136, 200))
    fp8_weights.forget([layer.weight])
    assert torch.equal(layer(x), fp8.fp8_linear_emulated(x, layer.weight.detach(), "blockwise"))
    assert layer.gemms.weights.quantizations == 3


def test_only_stateless_scaling_off_te_caches():
    """Delayed scaling's weight scale follows an amax history every GEMM updates (a cached copy would change its
    numbers); Transformer Engine quantizes for itself."""
    assert Fp8Gemms("delayed", "emulate", cache_weights=True).weights is None
    assert not Fp8Gemms("blockwise", "te", cache_weights=True).caches_weights("cpu")
    assert Fp8Gemms("blockwise", "scaled_mm", cache_weights=True).caches_weights("cpu")
    assert not Fp8Gemms("blockwise", "scaled_mm").caches_weights("cpu")  # off unless asked (the recipe asks)
    assert load_config(RECIPE, ["precision.recipe=fp8"]).precision.fp8_weight_cache


def _zero_placed(layer: Linear, store_type):
    """layer's weight made a view into a one-rank ZeRO store, as ShardedParams._place does -> (store, bucket)."""
    p = layer.weight
    (bucket,) = build_buckets([p], 1 << 20, 1, [False])
    store = store_type([bucket], Group("dp", [0]), p.device, p.dtype)
    bucket.full = store.place(bucket)
    view = bucket.full[:p.numel()].view_as(p)
    view.copy_(p.data)
    p.data = view
    store.settle(bucket)
    return store, bucket


@pytest.mark.parametrize("store_type", [FlatParams, GatheredParams], ids=["zero1", "zero3"])
def test_zero_publish_and_gather_make_a_fresh_copy(store_type):
    """ZeRO writes a parameter's storage, not through the parameter: its version counter does not move, so the
    store forgets the FP8 copy when it publishes and gathers (and, ZeRO-3, frees); the next GEMM quantizes the
    new values."""
    layer = _model("blockwise", "emulate", True)[0]
    store, bucket = _zero_placed(layer, store_type)
    x = torch.randn(8, 200)
    for new_values in (None, torch.randn(bucket.size) * 0.05):
        if new_values is not None:
            version = layer.weight._version
            store.publish(bucket, new_values)
            assert layer.weight._version == version  # unseen by the counter: why the store must forget
        if store.gathered:
            store.gather(bucket)
        y = layer(x)
        assert fp8_weights.cached_bytes([layer.weight]) == fp8_weights.cache_bytes((136, 200), "blockwise")
        assert torch.equal(y, fp8.fp8_linear_emulated(x, layer.weight.detach(), "blockwise"))
        if store.gathered:
            store.free(bucket)
            assert fp8_weights.cached_bytes([layer.weight]) == 0  # freed with the gathered storage


def _trainer_counts(overrides: list[str], steps: int = 2) -> dict:
    """A Trainer of debug_cpu in this process: per step, the weight quantizations, the FP8 copies' bytes when
    the update begins, and the loss; the FP8 weights (the cache's shapes) and the planner's row."""
    from moe_lc.parallel.zero.optimizer import ZeroOptimizer
    from moe_lc.train import Trainer

    cfg = load_config(RECIPE, TRAIN + overrides)
    trainer = Trainer(cfg)
    gemms = {id(m.gemms): m.gemms for m in trainer.model.modules() if isinstance(getattr(m, "gemms", None), Fp8Gemms)}
    weights = [m.weight for m in trainer.model.modules() if isinstance(getattr(m, "gemms", None), Fp8Gemms)]
    at_update = []
    step = ZeroOptimizer.step

    def counted_step(self, *args, **kwargs):
        at_update.append(fp8_weights.cached_bytes(weights))
        return step(self, *args, **kwargs)

    out = {"quantizations": [], "losses": [], "weights": len(weights)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ZeroOptimizer, "step", counted_step)
        for _ in range(steps):
            before = sum(g.weights.quantizations for g in gemms.values() if g.weights is not None)
            out["losses"].append(trainer.train_step().loss)
            out["quantizations"].append(sum(g.weights.quantizations for g in gemms.values() if g.weights is not None)
                                        - before)
    out["cached_at_update"] = at_update
    with trainer.params_present():  # (ZeRO-3 keeps 1/N between its gathers)
        out["params"] = [p.detach().clone() for p in trainer.model.parameters()]
    return out


def test_a_training_step_quantizes_each_weight_once_and_holds_what_the_planner_counts(tmp_path):
    """debug_cpu in FP8, 4 micro-batches a step: each FP8 weight quantized once per step; at the update the FP8
    copies hold the planner's "fp8 weight cache" row to the byte; losses and weights bit for bit as without."""
    from tools.planner.plan import plan

    cached = _trainer_counts([f"train.output_dir={tmp_path / 'a'}"])
    plain = _trainer_counts([f"train.output_dir={tmp_path / 'b'}", "precision.fp8_weight_cache=false"])
    assert cached["quantizations"] == [cached["weights"]] * 2 and plain["quantizations"] == [0, 0]
    cfg = load_config(RECIPE, TRAIN + [f"train.output_dir={tmp_path}"])
    assert cached["cached_at_update"] == [plan(cfg, 1).ranks[0].memory["fp8 weight cache"]] * 2
    assert cached["losses"] == plain["losses"]
    assert all(torch.equal(a, b) for a, b in zip(cached["params"], plain["params"]))


def test_zero3_quantizes_once_per_gather_and_changes_no_number(tmp_path):
    """ZeRO-3 gathers a unit for each micro-batch's forward and again for its backward: each gather quantizes
    its weights once (2 per weight per micro-batch here); the copies go with the unit (none at the update);
    bit for bit as without the cache."""
    zero3 = ["parallel.placement.params=sharded_gather"]
    cached = _trainer_counts(zero3 + [f"train.output_dir={tmp_path / 'a'}"])
    plain = _trainer_counts(zero3 + [f"train.output_dir={tmp_path / 'b'}", "precision.fp8_weight_cache=false"])
    assert cached["quantizations"] == [2 * 4 * cached["weights"]] * 2
    assert cached["cached_at_update"] == [0, 0]
    assert cached["losses"] == plain["losses"]
    assert all(torch.equal(a, b) for a, b in zip(cached["params"], plain["params"]))


def _pp_rank_counts(rank: int, world: int, out_dir: str) -> dict:
    counts = _trainer_counts(["parallel.pp=2", "parallel.pp_schedule=1f1b", f"train.output_dir={out_dir}"])
    return {k: counts[k] for k in ("quantizations", "weights")}


def test_pp2_1f1b_quantizes_each_weight_once_per_step(tmp_path):
    """Under a pipeline (1F1B, 4 micro-batches in flight in turn) each stage's FP8 weights are quantized once a
    step, whatever the schedule's order of forwards and backwards."""
    for counts in run_workers(_pp_rank_counts, 2, str(tmp_path)):
        assert counts["weights"] > 0 and counts["quantizations"] == [counts["weights"]] * 2


@pytest.mark.gpu
def test_the_cache_changes_no_number_on_the_gpu_at_full_shapes():
    """M = 8192 tokens through a 7168 -> 2048 and a 2048 -> 7168 bf16 Linear (DeepSeek-V3's expert shapes) on
    the scaled_mm backend's real kernels (cuBLASLt's blockwise GEMM on SM90: the cached w and w^T in its
    layouts), two micro-batches: outputs and gradients bit for bit with and without the cache."""
    runs = []
    for cache in (True, False):
        torch.manual_seed(0)
        layers = torch.nn.Sequential(Linear(7168, 2048, device="cuda", dtype=torch.bfloat16),
                                     Linear(2048, 7168, device="cuda", dtype=torch.bfloat16))
        gemms = Fp8Gemms("blockwise", "scaled_mm", cache_weights=cache)
        for layer in layers:
            torch.nn.init.normal_(layer.weight, std=0.02)
            layer.gemms = gemms
        seen = []
        for _ in range(2):
            x = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = layers(x)
            y.backward(torch.randn_like(y))
            seen += [y, x.grad]
        runs.append(seen + [layer.weight.grad for layer in layers])
        assert gemms.weights is None if not cache else gemms.weights.quantizations == 2  # once each, not per call
    assert all(torch.equal(a, b) for a, b in zip(*runs))
