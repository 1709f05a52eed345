"""FP8 backend "te" (moe_lc.ops.fp8_te): clear errors where TE cannot run, our operand mapping checked
against a stand-in for TE on CPU, and the real TE path against the emulation wherever TE imports on a GPU.

The stand-in implements what we read in TE 2.x (see the fp8_te module docstring): rowwise quantizers
whose decoding scale is amax/448 per 1x128 tile (block_scaling_dim=1), per 128x128 block (=2) or per
tensor, and ``general_gemm(A, B, layout="TN") -> (B @ A^T, ...)``. What it checks is ours: which operand
goes where, which granularity each gets, the transposes of dgrad and wgrad, delayed scaling's amax.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.ops import fp8, fp8_te
from moe_lc.ops.fp8_linear import Fp8Gemms
from moe_lc.ops.linear import GroupedLinear, Linear
from moe_lc.train import run

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "debug_cpu.toml"


class _Quantized:
    def __init__(self, deq):
        self.deq = deq


class _BlockQuantizer:
    def __init__(self, fp8_dtype, *, rowwise, columnwise, amax_epsilon, force_pow_2_scales, block_scaling_dim):
        assert rowwise and not columnwise and not force_pow_2_scales and amax_epsilon == 0.0
        self.dim = block_scaling_dim

    def __call__(self, t):
        assert t.dim() == 2 and t.is_contiguous() and t.shape[0] % 16 == 0 and t.shape[1] % 16 == 0
        if self.dim == 1:
            return _Quantized(fp8.dequantize_rowwise_tiles(*fp8.quantize_rowwise_tiles(t)))
        return _Quantized(fp8.dequantize_blocks(*fp8.quantize_blocks(t)))


class _CurrentQuantizer:
    def __init__(self, fp8_dtype, device, *, rowwise, columnwise, force_pow_2_scales, amax_epsilon):
        assert rowwise and not columnwise and not force_pow_2_scales

    def __call__(self, t):
        return _Quantized(fp8.dequantize_tensorwise(*fp8.quantize_tensorwise(t)))


class _DelayedQuantizer:
    """TE's Float8Quantizer: `scale` multiplies on the way in (an encoding scale), 1/scale decodes."""

    def __init__(self, scale, amax, fp8_dtype, *, rowwise, columnwise):
        assert scale.shape == (1,) and rowwise and not columnwise
        self.scale = scale

    def __call__(self, t):
        q = (t.float() * self.scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
        return _Quantized(q.float() / self.scale)


def _general_gemm(a, b, workspace=None, out_dtype=None, layout="TN", use_split_accumulator=False):
    assert layout == "TN" and use_split_accumulator
    return (b.deq @ a.deq.t()).to(out_dtype), None, None, None


@pytest.fixture
def stand_in_te(monkeypatch):
    te = SimpleNamespace(TE_DType={fp8.FP8_DTYPE: "kFloat8E4M3"}, general_gemm=_general_gemm, get_workspace=None,
                         Float8BlockQuantizer=_BlockQuantizer, Float8CurrentScalingQuantizer=_CurrentQuantizer,
                         Float8Quantizer=_DelayedQuantizer, fp8_ok=lambda: True, block_ok=lambda: True)
    monkeypatch.setattr(fp8_te, "load_te", lambda: te)
    # the stand-in runs on CPU, which the real check refuses
    monkeypatch.setattr(fp8_te, "unsupported_reason", lambda device, recipe: None)
    return te


def _heavy_tailed(*shape):
    """Log-normal row and column magnitudes: a wrong tile direction or granularity changes the result."""
    return torch.randn(*shape) * torch.exp(torch.randn(shape[0], 1)) * torch.exp(torch.randn(1, shape[-1]))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_te_mapping_matches_emulation(stand_in_te, recipe):
    torch.manual_seed(0)
    x, w, dy = _heavy_tailed(300, 200), _heavy_tailed(136, 200), _heavy_tailed(300, 136)
    cases = {"fprop": (x, w, fp8.fp8_linear_emulated), "dgrad": (dy, w, fp8.fp8_dgrad_emulated),
             "wgrad": (dy, x, fp8.fp8_wgrad_emulated)}
    for gemm, (a, b, emulated) in cases.items():
        got = fp8_te.te_gemm(gemm, a, b, recipe)
        want = emulated(a, b, recipe)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        if recipe == "blockwise":  # the check is sharp: tensorwise numbers are far from blockwise ones
            other = emulated(a, b, "tensorwise")
            assert (other - want).abs().max() > 100 * 1e-5 * want.abs().max()


def test_te_backend_in_linear_matches_emulate_including_delayed_scaling(stand_in_te):
    """Through Fp8Gemms: forward, dX and dW over two steps (delayed scaling reads step 1's amaxes in step 2),
    plain and grouped (experts) layers."""
    torch.manual_seed(0)
    for scaling in ("blockwise", "tensorwise", "delayed"):
        te_gemms, emu_gemms = Fp8Gemms(scaling, "te"), Fp8Gemms(scaling, "emulate")
        assert te_gemms.implementation("cpu") == "te" and Fp8Gemms(scaling, "auto").implementation("cpu") == "te"
        for make, args in ((lambda: Linear(200, 72), ()), (lambda: GroupedLinear(3, 130, 64), (torch.tensor([50, 0, 90]),))):
            a, b = make(), make()
            torch.nn.init.normal_(a.weight, std=0.05)
            b.weight.data.copy_(a.weight.data)
            a.gemms, b.gemms = te_gemms, emu_gemms
            for step in range(2):
                x = (torch.randn(140, a.weight.shape[-1]) * (1 + 3 * step)).requires_grad_()
                xb = x.detach().clone().requires_grad_()
                dy = torch.randn(140, a.weight.shape[-2])
                a.weight.grad = b.weight.grad = None
                ya, yb = a(x, *args), b(xb, *args)
                ya.backward(dy)
                yb.backward(dy)
                for got, want in ((ya, yb), (x.grad, xb.grad), (a.weight.grad, b.weight.grad)):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(fp8_te.load_te() is not None, reason="Transformer Engine is installed here")
def test_te_backend_refused_with_reason_where_te_is_missing():
    assert fp8_te.unsupported_reason("cpu", "blockwise").startswith("Transformer Engine is not importable")
    assert Fp8Gemms("blockwise", "auto").implementation("cpu") != "te"
    with pytest.raises(ValueError, match="fp8 backend 'te': Transformer Engine is not importable"):
        lin = Linear(8, 4)
        lin.gemms = Fp8Gemms("blockwise", "te")
        lin(torch.randn(2, 8))


def test_trainer_refuses_te_backend_before_any_step(tmp_path):
    if fp8_te.unsupported_reason("cuda" if torch.cuda.is_available() else "cpu", "blockwise") is None:
        pytest.skip("Transformer Engine runs here")
    cfg = load_config(RECIPE, ["precision.recipe=fp8", "precision.fp8_backend=te", "train.steps=1",
                               f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"precision.fp8_backend='te': Transformer Engine"):
        run(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_te.load_te() is not None),
                    reason="needs Transformer Engine on a CUDA GPU")
@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_real_te_matches_emulation_on_gpu(recipe):
    """TE's quantization multiplies by 448/amax where ours divides by amax/448: an element may round to the
    neighbouring FP8 value, so the bound is a few FP8 half-ulps spread over the sum, not fp32 rounding."""
    if fp8_te.unsupported_reason("cuda", recipe) is not None:
        pytest.skip(fp8_te.unsupported_reason("cuda", recipe))
    torch.manual_seed(0)
    x, w, dy = (_heavy_tailed(*s).cuda().bfloat16() for s in ((512, 384), (256, 384), (512, 256)))
    cases = {"fprop": (x, w, fp8.fp8_linear_emulated), "dgrad": (dy, w, fp8.fp8_dgrad_emulated),
             "wgrad": (dy, x, fp8.fp8_wgrad_emulated)}
    for gemm, (a, b, emulated) in cases.items():
        got = fp8_te.te_gemm(gemm, a, b, recipe)
        want = emulated(a, b, recipe)
        assert ((got - want).norm() / want.norm()).item() < 2e-3, gemm
