"""FP8 quantization and scaled matmul (moe_lc.ops.fp8): error bounds, tile directions, _scaled_mm agreement.

Round-trip error bound asserted below (per element, tile/block/tensor scale s = amax / 448):
  v = x / s has |v| <= 448. E4M3 has 3 mantissa bits, exponent bias 7, smallest normal 2^-6.
  - normal |v| in [2^e, 2^(e+1)), e >= -6: spacing 2^(e-3); round-to-nearest error <= 2^(e-4) <= 2^-4 |v|.
  - subnormal |v| < 2^-6: spacing 2^-9; error <= 2^-10 (absolute, in units of v).
  So |v - q| <= 2^-4 |v| + 2^-10, and multiplying by s: |x - s q| <= 2^-4 |x| + 2^-10 s.
  fp32 rounding of x / s and s * q adds ~2^-23 relative, covered by a (1 + 1e-5) factor; saturation at
  448 moves |v| <= 448 * 2^-22, far inside the half-ulp (16) at the top binade.
"""

import pytest
import torch

from moe_lc.ops import fp8

torch.manual_seed(0)


def _bound(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    return (2.0**-4 * x.abs() + 2.0**-10 * scale_full) * (1 + 1e-5)


def _rel_fro(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def _wide_range(*shape: int) -> torch.Tensor:
    """Gaussian times log-normal magnitudes: exercises normal and subnormal E4M3 in every tile."""
    return torch.randn(*shape) * torch.exp(2 * torch.randn(*shape))


def test_tile_round_trip_within_derived_bound():
    x = _wide_range(16, 200)  # K = 200: one full tile and a short (72-wide) last tile
    x_fp8, scale = fp8.quantize_rowwise_tiles(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == (16, 200)
    assert scale.dtype == torch.float32 and scale.shape == (16, 2)
    expected_scale = torch.stack([x[:, :128].abs().amax(1), x[:, 128:].abs().amax(1)], 1) / 448
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    err = (x - fp8.dequantize_rowwise_tiles(x_fp8, scale)).abs()
    ratio = err / _bound(x, scale.repeat_interleave(128, 1)[:, :200])
    assert ratio.max() <= 1.0
    assert ratio.max() > 0.5  # the bound is tight, not vacuous (measured 0.94)


def test_block_round_trip_within_derived_bound_and_shapes_not_divisible():
    w = _wide_range(72, 200)  # N = 72 and K = 200: short blocks in both dims
    w_fp8, scale = fp8.quantize_blocks(w)
    assert w_fp8.shape == (72, 200) and scale.shape == (1, 2)
    torch.testing.assert_close(scale[0, 1], w[:, 128:].abs().amax() / 448, rtol=1e-6, atol=0)
    scale_full = scale.repeat_interleave(128, 0)[:72].repeat_interleave(128, 1)[:, :200]
    err = (w - fp8.dequantize_blocks(w_fp8, scale)).abs()
    assert (err <= _bound(w, scale_full)).all()


def test_tensorwise_round_trip_within_derived_bound():
    x = _wide_range(33, 65)
    x_fp8, scale = fp8.quantize_tensorwise(x)
    assert scale.shape == () and scale.dtype == torch.float32
    err = (x - fp8.dequantize_tensorwise(x_fp8, scale)).abs()
    assert (err <= _bound(x, scale)).all()


def test_subnormal_region_error_is_absolute_in_units_of_scale():
    x = torch.tensor([[448.0, 1e-3, -3e-3, 5e-4]])  # scale 1: the small values are E4M3 subnormals
    x_fp8, scale = fp8.quantize_rowwise_tiles(x)
    assert scale.item() == 1.0
    err = (x - fp8.dequantize_rowwise_tiles(x_fp8, scale)).abs()
    assert (err[0, 1:] <= 2.0**-10).all()
    assert err[0, 1:].max() > 2.0**-4 * x[0, 1:].abs().max()  # relative bound alone would fail here


def test_weight_transpose_has_the_same_blocks():
    w = torch.randn(200, 300)
    w_fp8, scale = fp8.quantize_blocks(w)
    wt_fp8, scale_t = fp8.quantize_blocks(w.t())
    assert torch.equal(wt_fp8.float(), w_fp8.float().t()) and torch.equal(scale_t, scale.t())


def test_outlier_error_confined_to_its_tile_but_spread_by_tensorwise():
    x = torch.randn(4, 512)
    x_outlier = x.clone()
    x_outlier[0, 5] = 3e5
    others = torch.ones_like(x, dtype=torch.bool)
    others[0, :128] = False  # everything outside the outlier's tile
    tiled = fp8.dequantize_rowwise_tiles(*fp8.quantize_rowwise_tiles(x_outlier))
    tiled_clean = fp8.dequantize_rowwise_tiles(*fp8.quantize_rowwise_tiles(x))
    assert torch.equal(tiled[others], tiled_clean[others])  # other tiles do not see the outlier at all
    tensor = fp8.dequantize_tensorwise(*fp8.quantize_tensorwise(x_outlier))
    tile_err = _rel_fro(tiled[others], x[others])
    tensor_err = _rel_fro(tensor[others], x[others])
    assert tile_err < 0.035 and tensor_err > 10 * tile_err  # measured 0.026 vs 0.37


def test_zero_tile_negative_values_and_extremes():
    x = torch.zeros(3, 256)
    x[1, :128] = -torch.rand(128) - 0.5  # negative-only tile
    x[2, 128:] = torch.linspace(-7.0, 7.0, 128)  # +-amax at both ends
    x_fp8, scale = fp8.quantize_rowwise_tiles(x)
    assert scale[0, 0] == 1.0 and scale[0, 1] == 1.0 and scale[1, 1] == 1.0  # all-zero tiles
    assert (x_fp8.float()[0] == 0).all()
    assert x_fp8.float()[2, 128] == -448 and x_fp8.float()[2, 255] == 448
    deq = fp8.dequantize_rowwise_tiles(x_fp8, scale)
    assert torch.isfinite(deq).all() and (deq[0] == 0).all()
    torch.testing.assert_close(deq[2, [128, 255]], torch.tensor([-7.0, 7.0]), rtol=2e-7, atol=0)
    neg_fp8, _ = fp8.quantize_rowwise_tiles(-x)
    assert torch.equal(neg_fp8.float(), -x_fp8.float())  # symmetric rounding
    tiny = torch.full((1, 128), 1e-40)  # below the amax floor: no division by zero
    assert torch.isfinite(fp8.dequantize_rowwise_tiles(*fp8.quantize_rowwise_tiles(tiny))).all()


def test_bf16_inputs_quantize_like_their_fp32_values():
    x = _wide_range(8, 200).to(torch.bfloat16)
    for quantize in (fp8.quantize_rowwise_tiles, fp8.quantize_blocks, fp8.quantize_tensorwise):
        q_bf16, s_bf16 = quantize(x)
        q_fp32, s_fp32 = quantize(x.float())
        assert torch.equal(q_bf16.float(), q_fp32.float()) and torch.equal(s_bf16, s_fp32)
        assert s_bf16.dtype == torch.float32


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_emulated_gemms_close_to_fp32(recipe):
    x, w, dy = torch.randn(256, 512), 0.02 * torch.randn(384, 512), 1e-3 * torch.randn(256, 384)
    errors = {
        "fprop": _rel_fro(fp8.fp8_linear_emulated(x, w, recipe), x @ w.t()),
        "dgrad": _rel_fro(fp8.fp8_dgrad_emulated(dy, w, recipe), dy @ w),
        "wgrad": _rel_fro(fp8.fp8_wgrad_emulated(dy, x, recipe), dy.t() @ x),
    }
    # Gaussian inputs: per-operand rms relative error ~2.6%, so ~sqrt(2) * 2.6% = 3.7% on the product
    # (measured 3.6-3.8% for both recipes). Lower bound: the emulation really quantizes.
    for gemm, err in errors.items():
        assert 0.02 < err < 0.045, (gemm, err)


def test_emulated_gemms_keep_leading_dims_and_dtypes():
    x, w, dy = torch.randn(2, 3, 200).bfloat16(), torch.randn(72, 200).bfloat16(), torch.randn(2, 3, 72)
    assert fp8.fp8_linear_emulated(x, w, "blockwise").shape == (2, 3, 72)
    assert fp8.fp8_dgrad_emulated(dy, w, "blockwise").shape == (2, 3, 200)
    dw = fp8.fp8_wgrad_emulated(dy, x, "blockwise")
    assert dw.shape == (72, 200) and dw.dtype == torch.float32


def test_each_gemm_tiles_along_its_contraction_dim():
    """A 2^20 outlier in one token (fprop/dgrad) or one feature of dy or x (wgrad) only changes the output
    row/column it feeds, because tiles run along the contraction dim; tiling the other way would spread it."""
    x, w, dy = torch.randn(256, 256), torch.randn(256, 256), torch.randn(256, 256)
    big = 2.0**20
    cases = [  # (gemm on clean input, gemm on input with outlier, outlier input)
        (lambda a: fp8.fp8_linear_emulated(a, w, "blockwise"), x, 0),
        (lambda a: fp8.fp8_dgrad_emulated(a, w, "blockwise"), dy, 0),
        (lambda a: fp8.fp8_wgrad_emulated(a, x, "blockwise"), dy, 1),
        (lambda a: fp8.fp8_wgrad_emulated(dy, a, "blockwise").t(), x, 1),  # x feature 0 -> dw[:, 0]
    ]
    for gemm, clean, outlier_dim in cases:
        loud = clean.clone()
        loud.select(outlier_dim, 0).mul_(big)  # token 0 (dim 0) or output feature 0 (dim 1)
        torch.testing.assert_close(gemm(loud)[1:], gemm(clean)[1:], rtol=1e-6, atol=1e-5)
    # The wrong direction for wgrad (tiles along N, per token) lets feature 0 crush the other features.
    loud = dy.clone()
    loud[:, 0] *= big
    wrong = fp8.dequantize_rowwise_tiles(*fp8.quantize_rowwise_tiles(loud)).t() @ x
    assert _rel_fro(wrong[1:], (dy.t() @ x)[1:]) > 0.5


def test_blockwise_weight_scale_is_shared_by_128_output_rows():
    """fprop quantizes w in 128x128 blocks: an outlier in w[0, 0] coarsens output columns 0..127 (its
    block's rows) and leaves columns 128.. untouched."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(256, 256, generator=g)
    loud = w.clone()
    loud[0, 0] = 2.0**20  # an outlier whatever w[0, 0] was
    y_clean, y_loud = fp8.fp8_linear_emulated(x, w, "blockwise"), fp8.fp8_linear_emulated(x, loud, "blockwise")
    torch.testing.assert_close(y_loud[:, 128:], y_clean[:, 128:], rtol=1e-6, atol=1e-5)
    assert _rel_fro(y_loud[:, 1:128], x @ w[1:128].t()) > 0.5  # same block: precision crushed


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_scaled_mm_on_cpu_matches_emulation(recipe):
    assert fp8.scaled_mm_support("cpu", recipe)
    x, w, dy = torch.randn(64, 200), torch.randn(72, 200), torch.randn(64, 72)
    pairs = [
        (fp8.fp8_linear_scaled_mm(x, w, recipe), fp8.fp8_linear_emulated(x, w, recipe)),
        (fp8.fp8_dgrad_scaled_mm(dy, w, recipe), fp8.fp8_dgrad_emulated(dy, w, recipe)),
        (fp8.fp8_wgrad_scaled_mm(dy, x, recipe), fp8.fp8_wgrad_emulated(dy, x, recipe)),
    ]
    for kernel, emulated in pairs:
        # tensorwise: one _scaled_mm, measured bit-identical (0.0). blockwise: one rowwise _scaled_mm per
        # 128-chunk summed in fp32, a different summation order: measured <= 4.7e-7 of max |out|.
        assert (kernel - emulated).abs().max() <= 2e-6 * emulated.abs().max()
    assert fp8.fp8_linear_scaled_mm(x, w, recipe, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_scaled_mm_backend_reports_fallbacks():
    assert fp8.scaled_mm_backend("cpu", "tensorwise") == "native"
    assert fp8.scaled_mm_backend("cpu", "blockwise") == "chunked_rowwise"
    assert fp8.scaled_mm_backend("meta", "blockwise") == "emulated"
    if not torch.cuda.is_available():
        assert not fp8.scaled_mm_support("cuda", "blockwise")
    with pytest.raises(ValueError, match="recipe='fp16'"):
        fp8.scaled_mm_support("cpu", "fp16")


def test_invalid_arguments_raise():
    x, w = torch.randn(4, 128), torch.randn(8, 128)
    with pytest.raises(ValueError, match="recipe"):
        fp8.fp8_linear_emulated(x, w, "bf16")
    with pytest.raises(ValueError, match="tensorwise recipe only"):
        fp8.fp8_linear_emulated(x, w, "blockwise", x_amax=1.0)
    with pytest.raises(ValueError, match="fprop needs"):
        fp8.fp8_linear_emulated(x, torch.randn(8, 64), "tensorwise")
    with pytest.raises(ValueError, match="history_len"):
        fp8.DelayedScaling(history_len=0)


def test_delayed_scaling_history_max_and_rolling():
    state = fp8.DelayedScaling(history_len=3)
    assert state.scale_amax() is None
    for amax in (5.0, 1.0, 2.0):
        state.update(torch.tensor(amax))
    assert state.scale_amax().item() == 5.0
    state.update(1.5)  # 5.0 drops out of the 3-long window
    assert state.scale_amax().item() == 2.0


def test_delayed_scaling_quantize_uses_history_then_records():
    state = fp8.DelayedScaling(history_len=16)
    first = torch.tensor([0.5, -1.0])
    _, scale = state.quantize(first)  # empty history: current scaling
    assert scale.item() == pytest.approx(1.0 / 448)
    x = torch.tensor([1.0, -1.0, 10.0, -float("inf"), 0.25])
    x_fp8, scale = state.quantize(x)  # history amax 1.0: 10 and -inf saturate
    assert scale.item() == pytest.approx(1.0 / 448)
    deq = fp8.dequantize_tensorwise(x_fp8, scale)
    assert torch.isfinite(deq).all()
    torch.testing.assert_close(deq, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.25]), rtol=1e-6, atol=0)
    assert x_fp8.float().abs().max() == 448
    assert state.scale_amax().item() == 1.0  # the -inf step was recorded as the history max, not inf
    state.update(float("nan"))
    assert state.scale_amax().item() == 1.0


def test_delayed_amax_in_linear_saturates_without_nan():
    x, w = 100 * torch.randn(16, 128), torch.randn(8, 128)
    y = fp8.fp8_linear_emulated(x, w, "tensorwise", x_amax=torch.tensor(1.0))
    assert torch.isfinite(y).all()
    x_clamped = x.clamp(-1, 1)
    assert _rel_fro(y, fp8.fp8_linear_emulated(x_clamped, w, "tensorwise", x_amax=1.0)) == 0.0
