"""Attention backends against an independent fp64 softmax implementation ("Attention returns LSE").

Every backend usable on CPU here (available_backends("cpu"): reference and torch) is checked over
causal / non-causal (S_q != S_k), GQA with H=4 and H_kv in {1, 2, 4}, and D_v == D_qk, D_v < D_qk,
D_v > D_qk, in fp32 and bf16.

Tolerances. The naive implementation runs in fp64 on exactly the (rounded) inputs the backend saw,
so only the backend's own arithmetic is measured; tolerances are torch.testing.assert_close's
|actual - expected| <= atol + rtol * |expected| with atol = rtol = tol.
  fp32: tol = 1e-5. The sums here have at most 16 terms of O(1) values, so fp32 round-off is ~1e-6;
        the largest errors seen were 2.9e-6 (dk) and 1.3e-6 (out), 7.8e-7 (lse).
  bf16: a bf16 value carries 8 significant bits (ulp 2^-8 ~= 3.9e-3 relative). The fused kernel
        rounds the probabilities to bf16 before P @ V (and P, dS in the backward) and the result is
        rounded once more, so errors are a few ulps of the largest terms in each sum.
        out: tol = 2e-2 (largest error seen 9.2e-3, at most 15% of the bound);
        grads: tol = 4e-2 (grads reach ~8; largest error seen 4.6e-2 on dv = 34% of the bound there,
        worst case 41% of the bound);
        lse stays float32, computed from the bf16 inputs: tol = 1e-3 (largest error seen 6.9e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lc.ops.attention import (
    AUTO_ORDER,
    BACKEND_NAMES,
    AttentionBackend,
    attention,
    attention_with_lse,
    available_backends,
    get_backend,
)
from moe_lc.ops.flash_attention import flash_attn4_interface

BACKENDS = available_backends("cpu")
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "debug_cpu.toml"
N_HEADS = 4
KV_HEADS = (1, 2, 4)
HEAD_DIMS = ((16, 16), (24, 16), (16, 24))  # (D_qk, D_v)
LENGTHS = ((True, 8, 8), (False, 6, 10))  # (causal, S_q, S_k): non-causal with S_q != S_k
DTYPES = (torch.float32, torch.bfloat16)
TOL = {
    torch.float32: {"out": 1e-5, "lse": 1e-5, "grad": 1e-5},
    torch.bfloat16: {"out": 2e-2, "lse": 1e-3, "grad": 4e-2},
}
SCALE = 0.37  # deliberately not 1/sqrt(D): a backend that ignores `scale` fails


def naive_attention(q, k, v, causal, scale):
    """fp64 softmax attention via repeat_interleave + torch.softmax; returns (out, lse) with autograd."""
    group = q.shape[2] // k.shape[2]
    k_BKHD = k.repeat_interleave(group, dim=2)  # query head h reads kv head h // group
    v_BKHD = v.repeat_interleave(group, dim=2)
    scores_BHQK = torch.einsum("bqhd,bkhd->bhqk", q, k_BKHD) * scale
    if causal:
        allowed_QK = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores_BHQK = scores_BHQK.masked_fill(~allowed_QK, float("-inf"))
    out_BQHD = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores_BHQK, dim=-1), v_BKHD)
    return out_BQHD, torch.logsumexp(scores_BHQK, dim=-1)


def naive_grads(q, k, v, dout, causal, scale):
    """(out, lse, (dq, dk, dv)) of the naive implementation in fp64, from the inputs' exact values."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = naive_attention(q64, k64, v64, causal, scale)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), lse.detach(), grads


def make_inputs(dtype, s_q, s_k, kv_heads, d_qk, d_v, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, s_q, N_HEADS, d_qk, generator=gen).to(dtype)
    k = torch.randn(2, s_k, kv_heads, d_qk, generator=gen).to(dtype)
    v = torch.randn(2, s_k, kv_heads, d_v, generator=gen).to(dtype)
    dout = torch.randn(2, s_q, N_HEADS, d_v, generator=gen).to(dtype)
    return q, k, v, dout


def assert_close(actual, expected, tol, what):
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


CASES = pytest.mark.parametrize(
    "dtype, causal, s_q, s_k, kv_heads, d_qk, d_v",
    [pytest.param(dt, c, sq, sk, j, dq, dv, id=f"{str(dt)[6:]}-{'causal' if c else 'full'}-q{sq}k{sk}-kv{j}-d{dq}v{dv}")
     for dt in DTYPES for (c, sq, sk) in LENGTHS for j in KV_HEADS for (dq, dv) in HEAD_DIMS],
)


@pytest.mark.parametrize("backend_name", BACKENDS)
@CASES
def test_forward_out_and_lse_match_naive(backend_name, dtype, causal, s_q, s_k, kv_heads, d_qk, d_v):
    q, k, v, dout = make_inputs(dtype, s_q, s_k, kv_heads, d_qk, d_v)
    out, lse = get_backend(backend_name).forward(q, k, v, causal, SCALE)
    ref_out, ref_lse, _ = naive_grads(q, k, v, dout, causal, SCALE)

    assert out.shape == (2, s_q, N_HEADS, d_v) and out.dtype == dtype
    assert lse.shape == (2, N_HEADS, s_q) and lse.dtype == torch.float32
    assert_close(out, ref_out, TOL[dtype]["out"], "out")
    assert_close(lse, ref_lse, TOL[dtype]["lse"], "lse")


@pytest.mark.parametrize("backend_name", BACKENDS)
@CASES
def test_backward_matches_naive_autograd(backend_name, dtype, causal, s_q, s_k, kv_heads, d_qk, d_v):
    q, k, v, dout = make_inputs(dtype, s_q, s_k, kv_heads, d_qk, d_v, seed=1)
    backend = get_backend(backend_name)
    out, lse = backend.forward(q, k, v, causal, SCALE)
    grads = backend.backward(dout, q, k, v, out, lse, causal, SCALE)
    _, _, ref_grads = naive_grads(q, k, v, dout, causal, SCALE)

    for name, grad, ref, x in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert grad.shape == x.shape and grad.dtype == x.dtype, name
        assert_close(grad, ref, TOL[dtype]["grad"], name)


@pytest.mark.parametrize("backend_name", BACKENDS)
@CASES
def test_attention_autograd_matches_naive(backend_name, dtype, causal, s_q, s_k, kv_heads, d_qk, d_v):
    q, k, v, dout = make_inputs(dtype, s_q, s_k, kv_heads, d_qk, d_v, seed=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*leaves, causal=causal, backend=backend_name)  # default scale 1/sqrt(D_qk)
    (out.double() * dout.double()).sum().backward()
    ref_out, _, ref_grads = naive_grads(q, k, v, dout, causal, d_qk**-0.5)

    assert_close(out.detach(), ref_out, TOL[dtype]["out"], "out")
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, ref_grads):
        assert leaf.grad is not None and leaf.grad.dtype == dtype, name
        assert_close(leaf.grad, ref, TOL[dtype]["grad"], name)


def merge_partials(out1, lse1, out2, lse2):
    """The LSE merge ring attention uses: lse = logaddexp, out = sum_i out_i * exp(lse_i - lse)."""
    lse = torch.logaddexp(lse1, lse2)
    weight1 = torch.exp(lse1 - lse).transpose(1, 2).unsqueeze(-1)  # (B, H, Q) -> (B, Q, H, 1)
    weight2 = torch.exp(lse2 - lse).transpose(1, 2).unsqueeze(-1)
    return out1.float() * weight1 + out2.float() * weight2, lse


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("d_qk, d_v", HEAD_DIMS)
def test_lse_merge_of_key_blocks_reproduces_full_attention(backend_name, dtype, kv_heads, d_qk, d_v):
    q, k, v, dout = make_inputs(dtype, 6, 10, kv_heads, d_qk, d_v, seed=3)
    backend = get_backend(backend_name)
    blocks = [(k[:, :4], v[:, :4]), (k[:, 4:], v[:, 4:])]
    (out1, lse1), (out2, lse2) = (backend.forward(q, kb, vb, False, SCALE) for kb, vb in blocks)
    out, lse = merge_partials(out1, lse1, out2, lse2)
    ref_out, ref_lse, ref_grads = naive_grads(q, k, v, dout, False, SCALE)
    assert_close(out, ref_out, TOL[dtype]["out"], "merged out")
    assert_close(lse, ref_lse, TOL[dtype]["lse"], "merged lse")

    # Ring backward: each block's backward with the *merged* (out, lse); the parts sum to the full grads.
    out = out.to(dtype)
    (dq1, dk1, dv1), (dq2, dk2, dv2) = (backend.backward(dout, q, kb, vb, out, lse, False, SCALE) for kb, vb in blocks)
    tol = TOL[dtype]["grad"]
    assert_close(dq1.double() + dq2.double(), ref_grads[0], tol, "dq")
    assert_close(torch.cat([dk1, dk2], dim=1), ref_grads[1], tol, "dk")
    assert_close(torch.cat([dv1, dv2], dim=1), ref_grads[2], tol, "dv")


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("d_qk, d_v", HEAD_DIMS)
def test_causal_ring_step_merges_diagonal_and_past_blocks(backend_name, kv_heads, d_qk, d_v):
    """Queries 4..7 of a causal S=8 problem = past keys 0..3 (no mask) merged with keys 4..7 (causal)."""
    q, k, v, dout = make_inputs(torch.float32, 8, 8, kv_heads, d_qk, d_v, seed=4)
    backend = get_backend(backend_name)
    q_late, dout_late = q[:, 4:], dout[:, 4:]
    past = backend.forward(q_late, k[:, :4], v[:, :4], False, SCALE)
    diagonal = backend.forward(q_late, k[:, 4:], v[:, 4:], True, SCALE)
    out, lse = merge_partials(*past, *diagonal)

    dout_masked = torch.cat([torch.zeros_like(dout[:, :4]), dout_late], dim=1)  # only late queries' loss
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = naive_grads(q, k, v, dout_masked, True, SCALE)
    tol = TOL[torch.float32]
    assert_close(out, ref_out[:, 4:], tol["out"], "out")
    assert_close(lse, ref_lse[:, :, 4:], tol["lse"], "lse")

    dq_p, dk_p, dv_p = backend.backward(dout_late, q_late, k[:, :4], v[:, :4], out, lse, False, SCALE)
    dq_d, dk_d, dv_d = backend.backward(dout_late, q_late, k[:, 4:], v[:, 4:], out, lse, True, SCALE)
    assert_close(dq_p + dq_d, ref_dq[:, 4:], tol["grad"], "dq")
    assert_close(torch.cat([dk_p, dk_d], dim=1), ref_dk, tol["grad"], "dk")
    assert_close(torch.cat([dv_p, dv_d], dim=1), ref_dv, tol["grad"], "dv")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_strided_views_of_a_fused_projection_are_accepted(backend_name):
    """q, k, v sliced out of one (B, S, H, 3D) tensor (non-contiguous rows) give the same results."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 8, 4, 48, generator=gen)
    q, k, v = qkv[..., :16], qkv[..., 16:32], qkv[..., 32:]
    dout = torch.randn(2, 8, 4, 16, generator=gen)
    backend = get_backend(backend_name)
    out, lse = backend.forward(q, k, v, True, SCALE)
    grads = backend.backward(dout, q, k, v, out, lse, True, SCALE)
    ref_out, ref_lse, ref_grads = naive_grads(q, k, v, dout, True, SCALE)
    assert_close(out, ref_out, 1e-5, "out")
    assert_close(lse, ref_lse, 1e-5, "lse")
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(grad, ref, 1e-5, name)


def test_attention_with_lse_returns_lse_without_grad():
    q, k, v, _ = make_inputs(torch.float32, 8, 8, 2, 16, 24)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention_with_lse(*leaves, causal=True, scale=SCALE, backend="reference")
    _, ref_lse, _ = naive_grads(q, k, v, torch.zeros(2, 8, 4, 24), True, SCALE)
    assert out.requires_grad and not lse.requires_grad
    assert_close(lse, ref_lse, 1e-5, "lse")


def test_backend_selection_on_cpu():
    assert BACKENDS[0] == "reference" and "torch" in BACKENDS and "auto" not in BACKENDS
    assert get_backend("auto", "cpu").name == "torch"
    for name in BACKENDS:
        backend = get_backend(name, torch.device("cpu"))
        assert isinstance(backend, AttentionBackend) and backend.name == name


def test_unknown_backend_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_backend("flash3")
    for name in BACKEND_NAMES:
        assert name in str(err.value)
    q, k, v, _ = make_inputs(torch.float32, 4, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="valid names"):
        attention(q, k, v, backend="sdpa")


@pytest.mark.skipif("flash_attn" in available_backends("cuda"), reason="flash-attn is importable here")
def test_flash_attn_unavailable_gives_clear_error():
    with pytest.raises(ImportError, match="flash-attn"):
        get_backend("flash_attn", "cpu")


@pytest.mark.skipif(flash_attn4_interface() is not None, reason="flash-attn-4 is importable here")
def test_flash_attn4_unavailable_gives_clear_error():
    with pytest.raises(ImportError, match="flash-attn-4"):
        get_backend("flash_attn4", "cpu")


def test_auto_order_and_config_choices_name_every_backend():
    from moe_lc.config import load_config

    assert set(AUTO_ORDER) == set(BACKEND_NAMES) - {"auto"}
    for name in BACKEND_NAMES:  # every backend name is a valid recipe value
        assert load_config(RECIPE, [f"model.attn_backend={name}"]).model.attn_backend == name


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_causal_with_unequal_lengths_raises(backend_name):
    q, k, v, _ = make_inputs(torch.float32, 6, 10, 2, 16, 16)
    with pytest.raises(ValueError, match="S_q == S_k"):
        get_backend(backend_name).forward(q, k, v, True, SCALE)
    with pytest.raises(ValueError, match="S_q == S_k"):
        attention(q, k, v, causal=True, backend=backend_name)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_query_heads_not_multiple_of_kv_heads_raises(backend_name):
    q, k, v, _ = make_inputs(torch.float32, 8, 8, 3, 16, 16)  # H=4, H_kv=3
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q, k, v, backend=backend_name)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        get_backend(backend_name).forward(q, k, v, False, SCALE)


def test_mismatched_shapes_and_dtypes_raise():
    q, k, v, _ = make_inputs(torch.float32, 8, 8, 2, 16, 16)
    with pytest.raises(ValueError, match="head dim"):
        attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="dtype"):
        attention(q, k.bfloat16(), v)


class _StandInFlashAttn4:
    """flash_attn.cute.interface's two private entry points as FlashAttn4Backend calls them, computed by
    the reference backend; checks what the real kernels require (one dtype of fp16/bf16, head dims that
    are multiples of 8, D_qk shared by q and k) and records the shapes it was given."""

    def __init__(self):
        self.seen = []

    def _flash_attn_fwd(self, q, k, v, *, softmax_scale, causal, return_lse):
        assert return_lse and q.dtype == torch.bfloat16 and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0
        self.seen.append(("fwd", q.shape[-1], v.shape[-1]))
        out, lse = get_backend("reference").forward(q, k, v, causal, softmax_scale)
        return out, lse, None, None, None  # 4.0.0b36 returns (out, lse, p, row_max, o_lo)

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False):
        assert lse.dtype == torch.float32 and lse.is_contiguous() and dout.shape == out.shape
        self.seen.append(("bwd", q.shape[-1], v.shape[-1]))
        return get_backend("reference").backward(dout, q, k, v, out, lse, causal, softmax_scale)


def test_flash_attn4_backend_glue_against_a_stand_in(monkeypatch):
    """Padding of head dims to multiples of 8 (D_qk != D_v kept apart), argument order of the private API
    (out before dout in its backward) and lse passing, on CPU with a stand-in for the CUDA kernels."""
    import moe_lc.ops.flash_attention as flash

    stand_in = _StandInFlashAttn4()
    monkeypatch.setattr(flash, "flash_attn4_interface", lambda: stand_in)
    monkeypatch.setattr(flash, "flash_attn4_device_ok", lambda device: True)
    backend = flash.FlashAttn4Backend()
    q, k, v, dout = make_inputs(torch.bfloat16, 8, 8, 2, 20, 12)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention_with_lse(*leaves, causal=True, scale=SCALE, backend=backend)
    out.backward(dout)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_with_lse(*ref, causal=True, scale=SCALE, backend="reference")
    ref_out.backward(dout)
    assert stand_in.seen == [("fwd", 24, 16), ("bwd", 24, 16)]
    assert out.shape == ref_out.shape and lse.shape == (2, 4, 8)
    assert_close(out, ref_out, 2e-2, "out")
    assert_close(lse, ref_lse, 1e-3, "lse")
    for got, want, name in zip(leaves, ref, "qkv"):
        assert got.grad.shape == got.shape
        assert_close(got.grad, want.grad, 4e-2, f"d{name}")
