"""FP8 activation caching under sequence parallelism (issue #63): a column-parallel Linear keeps the FP8 copy
of its input's sequence shard and all-gathers the FP8 data and scales again in backward. The weight-gradient
GEMM must see exactly the operand the gathered input's FP8 copy gave it: outputs and every gradient bit for
bit against that keep, with the weight gradient now or deferred (ZB-H1 / DualPipe's W), for batch > 1 (the
shards' tokens interleave per batch row in the GEMM's token order). Saved bytes: 1/N of the gathered copy;
counted bytes: the forward gather (+ the tensorwise amax's all-reduce), backward's reduce-scatter and the
FP8 re-gathers. A shard whose 1 x 128 tiles would straddle shards keeps the gathered copy, as before.
The whole model at tp2 trains bit for bit as without the cache, and its plan equals a real run's counters
and saved bytes."""

import pytest
import torch

from tests.harness import RECIPES, run_layout, run_workers

N, D, F = 2, 160, 96  # tp, in-features (not a multiple of 128: tiles run along the tokens), out-features
CASES = [  # (scaling, backend, batch, gathered sequence, the shard is kept)
    ("blockwise", "emulate", 2, 256, True),
    ("blockwise", "scaled_mm", 3, 512, True),
    ("blockwise", "emulate", 2, 192, False),  # s = 96: a tile straddles two shards
    ("tensorwise", "emulate", 2, 96, True),  # one scale: any s
    ("tensorwise", "scaled_mm", 3, 64, True),
]


def _gathered_copy_role(group):
    """The column-parallel role as it was: an FP8 cache is kept as made, the gathered input's copy."""
    from moe_lc.ops.fp8_linear import KeepFp8ForWgrad
    from moe_lc.parallel.tp.mappings import ColumnParallel

    class GatheredCopy(ColumnParallel):
        def keep(self, x_BsD, keep):
            return keep if isinstance(keep, KeepFp8ForWgrad) else super().keep(x_BsD, keep)

    return GatheredCopy(group)


def _run(linear, x_BsD, dy_BSo, store, defer):
    """Forward + backward of one Linear: (y, dx, dW, saved bytes of the input's keep, counted fwd, bwd)."""
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() != linear.weight.untyped_storage().data_ptr():
            saved.append(t.untyped_storage().nbytes())
        return t

    counter = linear.tp.group.counter
    x = x_BsD.clone().requires_grad_()
    linear.weight.grad = None
    counter.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = linear(x)
    fwd = dict(counter.bytes)
    counter.reset()
    with store.deferring() if defer else torch.enable_grad():
        y.backward(dy_BSo)
    store.flush()
    return y.detach(), x.grad, linear.weight.grad, sum(saved), fwd, dict(counter.bytes)


def _linear_worker(rank, world):
    from moe_lc.config import ParallelConfig
    from moe_lc.ops.fp8_linear import Fp8Gemms, KeepFp8ForWgrad
    from moe_lc.ops.linear import Linear, WeightGradStore
    from moe_lc.parallel.mesh import ParallelDims
    from moe_lc.parallel.tp.mappings import ColumnParallel

    dims = ParallelDims.from_config(ParallelConfig(tp=world), world, rank)
    dims.init_groups()
    group = dims["tp"]
    out = []
    for scaling, backend, B, S, _ in CASES:
        g = torch.Generator().manual_seed(B * S)
        x_BSD = (torch.randn(B, S, D, generator=g) * torch.logspace(-2, 2, S)[:, None]).to(torch.bfloat16)
        dy = torch.randn(B, S, F // world, generator=g).to(torch.bfloat16)
        s = S // world
        linear = Linear(D, F // world).to(torch.bfloat16)
        torch.nn.init.normal_(linear.weight, generator=g)
        linear.gemms, linear.keep_input = Fp8Gemms(scaling, backend), KeepFp8ForWgrad()
        linear.wgrad_store = store = WeightGradStore()
        shard = x_BSD[:, rank * s:(rank + 1) * s].contiguous()
        for defer in (False, True):
            runs = {}
            for name, role in (("shard", ColumnParallel(group)), ("gathered", _gathered_copy_role(group))):
                linear.tp = role
                runs[name] = _run(linear, shard, dy, store, defer)
            out.append(((scaling, backend, B, S, defer), runs))
    return out


@pytest.fixture(scope="module")
def linear_runs():
    return run_workers(_linear_worker, N)


def test_outputs_and_gradients_equal_the_gathered_copys_bit_for_bit(linear_runs):
    for rank in linear_runs:
        for case, runs in rank:
            for got, want in zip(runs["shard"][:3], runs["gathered"][:3]):
                assert torch.equal(got, want), case


def test_the_shard_keeps_one_nth_of_the_bytes_and_counted_bytes_follow_the_formula(linear_runs):
    """Kept: FP8 data of the (B, s, D) shard plus its scales (one fp32 per 128 tokens, or one in all).
    Counted per rank (ring: (N-1)/N of the gathered bytes): forward the bf16 gather of x (+ 4 bytes of
    amax all-reduce under tensorwise), backward the bf16 reduce-scatter of dx plus the re-gathers of FP8
    data (1 byte an element) and blockwise scales; a straddling shard keeps the gathered copy and gathers
    nothing again."""
    ring = (N - 1) / N
    for rank in linear_runs:
        for (case, runs), (scaling, _, B, S, sharded) in zip(rank, [c for c in CASES for _ in (0, 1)]):
            s = S // N
            scales = 4 * D * (-(-B * s // 128)) if scaling == "blockwise" else 4  # bytes of one shard's scales
            gathered_scales = 4 * D * (-(-B * S // 128)) if scaling == "blockwise" else 4
            *_, kept, fwd, bwd = runs["shard"]
            *_, old_kept, old_fwd, old_bwd = runs["gathered"]
            assert old_kept == B * S * D + gathered_scales, case
            want_fwd = {("tp", "all_gather"): ring * B * S * D * 2}
            want_bwd = {("tp", "reduce_scatter"): ring * B * S * D * 2}
            assert old_fwd == want_fwd and old_bwd == want_bwd, case
            if not sharded:
                assert (kept, fwd, bwd) == (old_kept, old_fwd, old_bwd), case
                continue
            assert kept == B * s * D + scales, case
            if scaling == "tensorwise":
                want_fwd[("tp", "all_reduce")] = 2 * ring * 4
            want_bwd[("tp", "all_gather")] = ring * (B * S * D + (N * scales if scaling == "blockwise" else 0))
            assert fwd == want_fwd and bwd == want_bwd, case


# -- the whole model: trains as without the cache; counted = planned; traced saved bytes = measured ------
RECIPE = RECIPES / "debug_cpu.toml"
RUN = ["train.steps=2", "train.seq_len=256", "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=1",
       "precision.recipe=fp8"]


@pytest.mark.slow
@pytest.mark.parametrize("layout, world", [(["parallel.tp=2", "parallel.dp=1"], 2),
                                           (["parallel.tp=2", "parallel.pp=2", "parallel.dp=1",
                                             "parallel.pp_schedule=zbh1"], 4)], ids=["tp2", "tp2-pp2-zbh1"])
def test_the_model_trains_bit_for_bit_as_without_the_cache(layout, world):
    """s = 128: every dense block's wqkv and w13 (fp8_cache "linear") keep FP8 shards; without the
    cache the GEMM quantizes the re-gathered bf16 shard, the same numbers (the split backward's W too)."""
    plain = run_layout(RECIPE, RUN + layout, world=world)
    cached = run_layout(RECIPE, RUN + layout + ["precision.fp8_cache=linear"], world=world)
    assert cached.losses == plain.losses
    assert all(torch.equal(cached.final_state[k], v) for k, v in plain.final_state.items())


@pytest.mark.parametrize("scaling", ["blockwise", pytest.param("tensorwise", marks=pytest.mark.slow)])
def test_plan_equals_a_real_tp2_run_with_fp8_shards(scaling):
    """Every counter of a real run (the FP8 re-gathers; tensorwise: the amax all-reduces) and the saved bytes
    of a micro-batch, to the byte: the planner traces the same keep on the meta device."""
    from tests.test_plan import _check_layout

    layout = ["parallel.tp=2", "parallel.dp=1", "train.micro_batch=2", "train.seq_len=256", "precision.recipe=fp8",
              f"precision.fp8_scaling={scaling}", "precision.fp8_cache=linear"]
    _check_layout(f"tp2-fp8-{scaling}-cache", 2, layout, 0.0)
