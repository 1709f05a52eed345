"""The Triton kernels (moe_lc/kernels/) against their torch references: on CPU under TRITON_INTERPRET=1 (set by
tests/conftest.py where torch sees no GPU), at small shapes with every edge (short tiles, -1 slots, a query row
with no key, heads and slots not a multiple of the block); and, marked `gpu`, compiled on CUDA at DeepSeek-V3's
shapes. FP8 quantization must be bit-identical; attention agrees to fp32 rounding (bf16 on the GPU)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from moe_lc.kernels import dsa_sparse_attention as sparse_kernel  # noqa: E402
from moe_lc.kernels import fp8_quantize  # noqa: E402
from moe_lc.ops import fp8, sparse_attention  # noqa: E402

on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter checks run where there is no GPU")


def test_the_kernels_run_interpreted_on_cpu():
    """Otherwise every CPU test below would die in triton's compiler (no GPU) with a less helpful message."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels compile")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(fp8_quantize._quantize_kernel).__name__ == "InterpretedFunction", \
        "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)"


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # bit patterns: -0.0 and NaN compare as themselves


def _awkward_activations(M: int, K: int, dtype) -> torch.Tensor:
    """Magnitudes over 11 decades along K (subnormal E4M3 codes in most tiles), an all-zero row, exact zeros and
    -0.0, an amax under the 1e-12 floor, and values that round up across an exponent boundary (127.9 -> 128)."""
    x = torch.randn(M, K) * torch.logspace(-8, 3, K)
    x[min(1, M - 1), :] = 0.0
    x[0, : min(K, 6)] = torch.tensor([448.0, 127.9, -127.9, 63.9, 1e-3, -0.0])[: min(K, 6)]
    x[-1, -1] = 1e-30
    return x.to(dtype)


@on_cpu
@pytest.mark.parametrize("M, K, dtype", [(130, 200, torch.float32), (256, 128, torch.bfloat16),
                                         (1, 300, torch.float16), (129, 1, torch.float32)])
def test_fp8_quantize_is_bit_identical_to_the_torch_reference(M, K, dtype):
    x = _awkward_activations(M, K, dtype)
    q, s, qt, st = fp8_quantize.quantize_tiles_and_transposed(x)
    ref_q, ref_s = fp8.quantize_rowwise_tiles(x)
    ref_qt, ref_st = fp8.quantize_rowwise_tiles(x.t())
    assert q.dtype == qt.dtype == fp8.FP8_DTYPE and q.shape == (M, K) and qt.shape == (K, M)
    assert torch.equal(_codes(q), _codes(ref_q)) and torch.equal(_codes(qt), _codes(ref_qt))
    assert torch.equal(s, ref_s) and torch.equal(st, ref_st)
    # column-major scales, the layout F.scaled_mm's BlockWise1x128 takes (fp8._cuda_blockwise_scale makes it)
    assert s.stride() == (1, M) and st.stride() == (1, K)
    assert torch.equal(fp8._cuda_blockwise_scale(ref_s, "tile", is_rhs=False), s)


@on_cpu
def test_fp8_single_output_modes_and_strided_input_match():
    """quantize_tiles / quantize_transposed_tiles alone, and a transposed view in (the wgrad operand x^T)."""
    x = _awkward_activations(200, 130, torch.float32)
    for got, ref in [(fp8_quantize.quantize_tiles(x), fp8.quantize_rowwise_tiles(x)),
                     (fp8_quantize.quantize_transposed_tiles(x), fp8.quantize_rowwise_tiles(x.t())),
                     (fp8_quantize.quantize_tiles(x.t()), fp8.quantize_rowwise_tiles(x.t()))]:
        assert torch.equal(_codes(got[0]), _codes(ref[0])) and torch.equal(got[1], ref[1])


@on_cpu
def test_fp8_cast_rounds_every_e4m3_tie_to_even():
    """Every E4M3 magnitude, the midpoints between neighbours (ties: round to even), and a hair either side of
    each midpoint, both signs, with scale exactly 1 (each row starts at 448): the integer cast against torch's."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(fp8.FP8_DTYPE).float()  # 0 .. 448, every code
    mids = (values[1:] + values[:-1]) / 2
    hair = mids * 2.0 ** -20 + 2.0 ** -30
    every = torch.cat([values, mids, mids - hair, mids + hair, torch.tensor([2.0 ** -10, 3 * 2.0 ** -11])])
    every = torch.cat([every, -every, torch.tensor([-0.0])])
    every = torch.cat([every, torch.zeros(-every.numel() % 127)]).view(-1, 127)
    x = torch.cat([torch.full((every.shape[0], 1), 448.0), every], dim=1)
    q, s = fp8_quantize.quantize_tiles(x)
    assert torch.equal(s, torch.ones_like(s))
    assert torch.equal(_codes(q), _codes(fp8.quantize_rowwise_tiles(x)[0]))


@on_cpu
def test_fp8_quantize_rejects_what_it_cannot_take_and_cpu_keeps_the_torch_path(monkeypatch):
    with pytest.raises(ValueError, match="2-D x"):
        fp8_quantize.quantize_tiles(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="float x"):
        fp8_quantize.quantize_tiles(torch.zeros(2, 3, dtype=torch.int32))
    def boom(x):
        raise AssertionError("the CPU path called the Triton kernel")

    monkeypatch.setattr(fp8, "triton_quantize_tiles", boom)
    _, scale = fp8.quantize_rowwise_tiles(torch.randn(4, 256))
    assert scale.is_contiguous()  # the torch ops' row-major scale: the CPU path's numbers and layout unchanged


def _causal_case(B=2, Q=7, T=23, H=3, Dn=8, R=8, C=24, Dv=8, m=40, seed=0):
    """Inputs of latent_forward with every edge: query row t sits at key row T - Q + t and selects up to m
    rows at or before it (fewer near the start: -1 past the causal edge), duplicates allowed; row (0, 0)
    selects nothing; C = 24 and R = 8 are not powers of two, H = 3 and m = 40 not multiples of the blocks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, H, Dn + R, generator=g)
    kv = torch.randn(B, T, C + R, generator=g)
    w_uk = torch.randn(H, Dn, C, generator=g) * 0.3
    w_uv = torch.randn(H, Dv, C, generator=g) * 0.3
    pos = torch.arange(T - Q, T)
    idx = torch.randint(0, T, (B, Q, m), generator=g)
    idx = torch.where(idx <= pos[None, :, None], idx, -1)
    idx[0, 0] = -1
    idx[-1, 1, :3] = T - Q + 1  # a row picked three times: its gradient sums
    return q, kv, idx, w_uk, w_uv, (Dn + R) ** -0.5


@on_cpu
def test_sparse_attention_forward_matches_the_reference():
    q, kv, idx, w_uk, w_uv, scale = _causal_case()
    out, lse = sparse_kernel.latent_forward(q, kv, idx, w_uk, w_uv, scale)
    ref_out, ref_lse = sparse_attention.latent_forward(q, kv, idx, w_uk, w_uv, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # equal infinities included
    assert torch.isneginf(lse[0, :, 0]).all() and (out[0, 0] == 0).all()  # no key: out 0, lse -inf


@on_cpu
def test_sparse_attention_gradients_match_the_reference():
    q, kv, idx, w_uk, w_uv, scale = _causal_case(seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, kv, w_uk, w_uv)]
    out, lse = sparse_kernel.sparse_latent_attention(leaves[0], leaves[1], idx, leaves[2], leaves[3], scale)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref_lse = sparse_attention.latent_forward(q, kv, idx, w_uk, w_uv, scale)
    ref = sparse_attention.latent_backward(dout, q, kv, idx, ref_out, ref_lse, w_uk, w_uv, scale)
    for name, leaf, want in zip(("dq", "dkv", "dW_UK", "dW_UV"), leaves, ref):
        torch.testing.assert_close(leaf.grad, want, rtol=1e-5, atol=1e-5, msg=name)
    unselected = torch.ones(kv.shape[:2], dtype=torch.bool)
    for b in range(kv.shape[0]):
        unselected[b, idx[b][idx[b] >= 0]] = False
    assert unselected.any() and (leaves[1].grad[unselected] == 0).all()


@on_cpu
def test_sparse_attention_backward_takes_a_merged_lse():
    """The ring calls latent_backward with the final out and lse of every block merged, not the block's own:
    p = exp(s - lse) under that lse, as the reference does."""
    q, kv, idx, w_uk, w_uv, scale = _causal_case(B=1, Q=4, seed=2)
    out, lse = sparse_attention.latent_forward(q, kv, idx, w_uk, w_uv, scale)
    lse = torch.logaddexp(lse, torch.full_like(lse, 0.5))  # another block's share of the softmax
    dout = torch.randn_like(out)
    got = sparse_kernel.latent_backward(dout, q, kv, idx, out, lse, w_uk, w_uv, scale)
    want = sparse_attention.latent_backward(dout, q, kv, idx, out, lse, w_uk, w_uv, scale)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_sparse_attention_rejects_mismatched_shapes():
    q, kv, idx, w_uk, w_uv, scale = _causal_case(B=1, Q=2)
    with pytest.raises(ValueError, match="sparse attention needs"):
        sparse_kernel.latent_forward(q, kv[..., :-1], idx, w_uk, w_uv, scale)


# ---- on a GPU: the compiled kernels at DeepSeek-V3's shapes (python -m pytest -m gpu) ----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("hw_cast", [False, True])
def test_gpu_fp8_quantize_at_v3_shapes(hw_cast):
    """M = 8192 tokens x K = 7168 (V3's hidden), bf16, and a ragged 8191 x 7000: bit-identical to the torch ops
    on the CPU, both outputs; the integer cast and the hardware one (cvt.rn.satfinite) alike."""
    for M, K in [(8192, 7168), (8191, 7000)]:
        x = (torch.randn(M, K, device="cuda") * torch.logspace(-6, 2, K, device="cuda")).bfloat16()
        q, s, qt, st = fp8_quantize.quantize_tiles_and_transposed(x, hw_cast=hw_cast)
        ref_q, ref_s = fp8.quantize_rowwise_tiles(x.cpu())
        ref_qt, ref_st = fp8.quantize_rowwise_tiles(x.cpu().t())
        assert torch.equal(_codes(q).cpu(), _codes(ref_q)) and torch.equal(s.cpu(), ref_s)
        assert torch.equal(_codes(qt).cpu(), _codes(ref_qt)) and torch.equal(st.cpu(), ref_st)


@pytest.mark.gpu
def test_gpu_fp8_activation_quantization_dispatches_to_the_kernel():
    x = torch.randn(300, 1000, device="cuda")
    q, s = fp8.quantize_rowwise_tiles(x)
    assert s.stride() == (1, 300), "the CUDA path did not run the Triton kernel (its scales are column-major)"
    ref_q, ref_s = fp8.quantize_rowwise_tiles(x.cpu())
    assert torch.equal(_codes(q).cpu(), _codes(ref_q)) and torch.equal(s.cpu(), ref_s)


@pytest.mark.gpu
def test_gpu_sparse_attention_at_v3_shapes():
    """128 heads, kv_lora 512, rope 64, nope 128, v 128, k = 2048 of T = 4096 keys, 1024 query rows (causal),
    bf16 inputs: the kernels (bf16 tensor cores) against the reference's fp32 math on the same inputs."""
    B, Q, T, H, Dn, R, C, Dv, k = 1, 1024, 4096, 128, 128, 64, 512, 128, 2048
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, Q, H, Dn + R, device=dev).bfloat16()
    kv = torch.randn(B, T, C + R, device=dev).bfloat16()
    w_uk = (torch.randn(H, Dn, C, device=dev) * C ** -0.5).bfloat16()
    w_uv = (torch.randn(H, Dv, C, device=dev) * C ** -0.5).bfloat16()
    pos = torch.arange(T - Q, T, device=dev)
    idx = torch.rand(B, Q, T, device=dev).masked_fill_(torch.arange(T, device=dev) > pos[:, None], -1).topk(k).indices
    idx = torch.where(idx <= pos[None, :, None], idx, -1)
    scale = (Dn + R) ** -0.5
    out, lse = sparse_kernel.latent_forward(q, kv, idx, w_uk, w_uv, scale)
    ref_out, ref_lse = sparse_attention.latent_forward(q, kv, idx, w_uk, w_uv, scale)
    _close(out, ref_out, "out")
    _close(lse, ref_lse, "lse")
    dout = torch.randn_like(ref_out)
    got = sparse_kernel.latent_backward(dout, q, kv, idx, ref_out, ref_lse, w_uk, w_uv, scale)
    want = sparse_attention.latent_backward(dout, q, kv, idx, ref_out, ref_lse, w_uk, w_uv, scale)
    for name, g, w in zip(("dq", "dkv", "dW_UK", "dW_UV"), got, want):
        _close(g, w, name)


def _close(got: torch.Tensor, want: torch.Tensor, name: str, tol: float = 2e-2) -> None:
    """bf16 operands (8 bits of mantissa) against fp32: the error relative to the tensor's largest entry."""
    err = (got.float() - want.float()).nan_to_num(0.0).abs().max() / want.float().nan_to_num(0.0).abs().max()
    assert err < tol, f"{name}: max error {err:.2e} of the largest entry"
