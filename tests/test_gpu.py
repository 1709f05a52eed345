"""The CUDA paths, each against the CPU reference it already has (`python -m pytest -m gpu` on a GPU).

Skipped with the reason where torch sees no CUDA device (tests/conftest.py). What runs here:
  - every CUDA attention backend (torch's fused flash kernel, flash-attn 2, flash-attn-4 where
    importable): out, lse and dq/dk/dv against an fp64 softmax of the same bf16 inputs, over MHA, GQA,
    MLA head dims (192 / 128) and non-causal blocks with S_q != S_k (the ring's off-diagonal blocks);
  - zig-zag ring attention with cp ranks emulated by threads on the one GPU (a thread-backed ring
    passes the real neighbour blocks), against one full-sequence call;
  - torch._grouped_mm (bf16, Hopper) against the per-expert loop, and the loop fallback taken for a
    misaligned weight view;
  - FP8 GEMMs through torch._scaled_mm / F.scaled_mm (tensorwise, blockwise) against the emulation;
  - 5 training steps of the debug recipe on cuda, bf16 and fp8, against the same steps on the CPU;
  - 5 fp32 steps on cuda of each path built after the first GPU run (torch's fused AdamW kernel, Muon,
    DSA's two stages, QK-clip, ZeRO-2's gradient rounds) against the CPU's steps, 1e-4 relative
    (Muon's bf16 Newton-Schulz on both sides 1e-2).

Tolerances are relative Frobenius errors ||got - ref|| / ||ref||: bf16 operands give 1e-3..1e-2
(METHOD: bf16 rounding of outputs and probabilities); fp8 GEMMs on the same quantized operands differ
from the emulation only by the order of fp32 sums (<= 1e-5 relative; 1e-4 allowed).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
import torch

from moe_lc.ops import fp8
from moe_lc.ops.attention import attention_with_lse, available_backends, get_backend
from tests.test_dsa_training import DSA

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
CUDA_BACKENDS = ("torch", "cudnn", "flash_attn", "flash_attn4")


def cuda_backend(name: str):
    """The backend, or a skip naming why it is not usable on this GPU."""
    if name not in available_backends("cuda"):
        pytest.skip(f"attention backend {name!r} is not usable here (flash_attn: flash-attn 2 built from source; "
                    "flash_attn4: pip install flash-attn-4, compute capability >= 9.0)")
    return get_backend(name, "cuda")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def naive_attention(q, k, v, causal: bool, scale: float):
    """fp64 softmax attention on the CPU with autograd -> (out (B,Q,H,Dv), lse (B,H,Q))."""
    group = q.shape[2] // k.shape[2]
    k_, v_ = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v_), torch.logsumexp(scores, dim=-1)


# (name, causal, S_q, S_k, H, H_kv, D_qk, D_v)
ATTENTION_CASES = [
    ("mha_causal_d128", True, 512, 512, 4, 4, 128, 128),
    ("gqa_causal_d64", True, 384, 384, 8, 2, 64, 64),
    ("mla_causal_192_128", True, 256, 256, 4, 4, 192, 128),
    ("gqa_block_d128", False, 256, 512, 4, 2, 128, 128),
]


@pytest.mark.parametrize("backend_name", CUDA_BACKENDS)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c[0])
def test_cuda_attention_matches_fp64_reference(backend_name, case):
    _, causal, s_q, s_k, h, h_kv, d_qk, d_v = case
    g = torch.Generator().manual_seed(s_q + h_kv + d_qk)
    q, k, v, dout = (torch.randn(*shape, generator=g).bfloat16() for shape in
                     ((2, s_q, h, d_qk), (2, s_k, h_kv, d_qk), (2, s_k, h_kv, d_v), (2, s_q, h, d_v)))
    scale = 0.7 * d_qk ** -0.5  # not the default: a backend that ignores `scale` fails
    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    out, lse = attention_with_lse(*leaves, causal=causal, scale=scale, backend=cuda_backend(backend_name))
    out.backward(dout.cuda())
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = naive_attention(*ref_leaves, causal, scale)
    ref_out.backward(dout.double())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, h, s_q)
    assert rel_err(out, ref_out) < 1e-2
    assert (lse.double().cpu() - ref_lse).abs().max().item() < 2e-3
    for got, ref, name in zip(leaves, ref_leaves, "qkv"):
        assert got.grad.shape == got.shape and rel_err(got.grad, ref.grad) < 2e-2, name


@pytest.mark.parametrize("backend_name", CUDA_BACKENDS)
@pytest.mark.parametrize("d_qk, d_v", [(128, 128), (192, 128)], ids=["gqa_d128", "mla_192_128"])
def test_cuda_packed_documents_match_fp64_masked_reference(backend_name, d_qk, d_v):
    """Attention over packed documents (moe_lc/ops/documents.py) on one device and on a cp-4 ring step
    whose query chunk meets two key chunks of one document (two varlen waves merged by LSE); the flash
    backends must take their varlen kernels (one call per wave), torch one call per piece."""
    from moe_lc.ops.documents import Documents

    backend = cuda_backend(backend_name)
    S, lengths = 1024, [[100, 3, 400, 77, 444], [1024]]
    docs = Documents(lengths, S)
    g = torch.Generator().manual_seed(d_qk)
    q, k, v, dout = (torch.randn(*shape, generator=g).bfloat16() for shape in
                     ((2, S, 8, d_qk), (2, S, 2, d_qk), (2, S, 2, d_v), (2, S, 8, d_v)))
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])
    mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    scale = 0.7 * d_qk ** -0.5
    calls = []
    if backend.varlen_forward is not None:
        inner = backend.varlen_forward
        backend = type(backend)()  # a fresh instance whose varlen_forward is counted
        backend.varlen_forward = lambda *a, **kw: calls.append(1) or inner(*a, **kw)
    C = S // 8  # cp 4: rank 0 holds chunks 0 and 7; rank 1's chunks 1 and 6 visit it
    cases = {"one_device": (torch.arange(S), torch.arange(S), ((0, S),), ((0, S),)),
             "ring_step": (torch.cat([torch.arange(0, C), torch.arange(7 * C, S)]),
                           torch.cat([torch.arange(C, 2 * C), torch.arange(6 * C, 7 * C)]),
                           ((0, C), (7 * C, S)), ((C, 2 * C), (6 * C, 7 * C)))}
    for name, (rows, cols, q_ranges, k_ranges) in cases.items():
        pieces = docs.pieces(q_ranges, k_ranges)
        leaves = [q[:, rows].cuda().requires_grad_(), k[:, cols].cuda().requires_grad_(), v[:, cols].cuda().requires_grad_()]
        out, lse = attention_with_lse(*leaves, scale=scale, backend=backend, pieces=pieces)
        out.backward(dout[:, rows].cuda())
        ref = [x.detach().double().requires_grad_() for x in (q[:, rows], k[:, cols], v[:, cols])]
        scores = torch.einsum("bqhd,bkhd->bhqk", ref[0], ref[1].repeat_interleave(4, 2)) * scale
        scores = scores.masked_fill(~mask[:, rows][:, :, cols][:, None], float("-inf"))
        ref_lse = scores.logsumexp(-1)
        seen = ref_lse > float("-inf")  # rows that see no key here: (0, -inf), as every partial does
        ref_out = torch.einsum("bhqk,bkhd->bqhd", (scores - ref_lse[..., None].where(seen[..., None], 0)).exp(),
                               ref[2].repeat_interleave(4, 2))
        ref_out.backward(dout[:, rows].double())
        assert rel_err(out, ref_out) < 1e-2, name
        assert torch.equal(lse.cpu() > float("-inf"), seen), name
        assert (lse.double().cpu()[seen] - ref_lse[seen]).abs().max().item() < 2e-3, name
        for got, want, t in zip(leaves, ref, "qkv"):
            assert rel_err(got.grad, want.grad) < 2e-2, (name, t)
    if backend.varlen_forward is not None:
        assert len(calls) == 1 + 2  # one wave on one device; the ring step: causal-free, two waves


def test_auto_takes_the_first_usable_cuda_backend():
    from moe_lc.ops.attention import AUTO_ORDER

    usable = available_backends("cuda")
    assert get_backend("auto", "cuda").name == next(n for n in AUTO_ORDER if n in usable)
    assert "torch" in usable, "torch's fused CUDA flash kernel should exist on any CUDA build"


# -- ring attention, cp ranks as threads --------------------------------------------------------------


class ThreadRing:
    """A ring of cp ranks that are threads of this process: shift() hands copies of the tensors to the
    next rank's mailbox and wait() takes what the previous rank sent (FIFO), as P2PRing does over NCCL.
    All threads enqueue on the same CUDA stream, so a receiver's kernels run after the sender's."""

    def __init__(self, rank: int, size: int, mailboxes: list[queue.Queue]):
        self.group, self.rank, self.size, self.mailboxes = None, rank, size, mailboxes

    def shift(self, tensors):
        self.mailboxes[(self.rank + 1) % self.size].put([t.clone() for t in tensors])
        return self

    def wait(self):
        return self.mailboxes[self.rank].get(timeout=120)


@pytest.mark.parametrize("backend_name", CUDA_BACKENDS)
def test_ring_attention_with_threads_as_cp_ranks_matches_one_call(backend_name):
    from moe_lc.parallel.comm import Group
    from moe_lc.parallel.cp.ring import KVBlocks, ring_backward, ring_forward, zigzag_shard

    backend = cuda_backend(backend_name)
    cp, seq, h, h_kv, d = 4, 1024, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(1, seq, heads, d, generator=g, device="cuda", dtype=torch.bfloat16)
                     for heads in (h, h_kv, h_kv, h))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_full, lse_full = attention_with_lse(*full, causal=True, scale=d ** -0.5, backend=backend)
    out_full.backward(dout)

    mailboxes = [queue.Queue() for _ in range(cp)]
    results, errors = [None] * cp, []

    def rank_main(r: int):
        try:
            grp = Group("cp", list(range(cp)), r)
            q_r, k_r, v_r = (zigzag_shard(x, grp, 1).contiguous() for x in (q, k, v))
            # the ring's own forward / backward, called without autograd: autograd runs all backwards of one
            # CUDA device on one engine thread, where ranks that wait on each other would deadlock
            out, lse, state = ring_forward(q_r, d ** -0.5, ThreadRing(r, cp, mailboxes), backend, "zigzag",
                                           KVBlocks(), None, (k_r, v_r))
            grads = ring_backward(zigzag_shard(dout, grp, 1).contiguous(), **state)
            results[r] = (grp, out, lse, grads)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            for box in mailboxes:  # unblock the other ranks
                box.put([])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[0]
    for grp, out, lse, grads in results:
        assert rel_err(out, zigzag_shard(out_full.detach(), grp, 1)) < 1e-2
        assert (lse - zigzag_shard(lse_full, grp, 2)).abs().max().item() < 1e-3
        for got, leaf, name in zip(grads, full, "qkv"):
            assert rel_err(got, zigzag_shard(leaf.grad, grp, 1)) < 2e-2, name


# -- grouped GEMM ---------------------------------------------------------------------------------------


def test_grouped_mm_kernel_matches_the_per_expert_loop():
    from moe_lc.ops.grouped_gemm import grouped_mm, grouped_mm_wgrad, use_grouped_mm
    from moe_lc.ops.linear import GroupedLinear

    torch.manual_seed(0)
    counts = torch.tensor([37, 0, 128, 5, 300, 64, 1, 90])
    E, K, N, T = len(counts), 256, 384, int(counts.sum())
    layer = GroupedLinear(E, K, N, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=K ** -0.5)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    w_EKN = layer.weight.detach().transpose(1, 2)
    assert use_grouped_mm(x, w_EKN), "torch._grouped_mm should take aligned bf16 operands on this GPU"
    layer(x, counts.cuda()).backward(dy)
    sizes = counts.tolist()
    ref_y = torch.cat([xe.float() @ we.float() for xe, we in zip(x.detach().split(sizes), w_EKN)])
    assert rel_err(grouped_mm(x.detach(), w_EKN, counts.cuda()), ref_y) < 1e-2
    ref_dx = torch.cat([de.float() @ we.float().t() for de, we in zip(dy.split(sizes), w_EKN)])
    assert rel_err(x.grad, ref_dx) < 1e-2
    ref_dw = torch.stack([xe.float().t() @ de.float() for xe, de in zip(x.detach().split(sizes), dy.split(sizes))])
    assert rel_err(grouped_mm_wgrad(x.detach(), dy, counts.cuda()), ref_dw) < 1e-2
    assert rel_err(layer.weight.grad.transpose(1, 2), ref_dw) < 1e-2
    assert layer.weight.grad[1].abs().sum() == 0  # an expert without tokens


def test_grouped_mm_falls_back_for_a_misaligned_weight_view():
    from moe_lc.ops import grouped_gemm
    from moe_lc.ops.grouped_gemm import grouped_mm, misalignment

    grouped_gemm._warned.clear()  # warned once per reason and process
    flat = torch.randn(1 + 4 * 64 * 32, device="cuda", dtype=torch.bfloat16)
    w_EKN = flat[1:].view(4, 64, 32)  # 2 bytes past an aligned start, as a ZeRO flat view can be
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([10, 0, 20, 10], device="cuda")
    assert misalignment(w_EKN) is not None
    with pytest.warns(RuntimeWarning, match="16-byte"):
        y = grouped_mm(x, w_EKN, counts)
    ref = torch.cat([x[:10].float() @ w_EKN[0].float(), x[10:30].float() @ w_EKN[2].float(),
                     x[30:].float() @ w_EKN[3].float()])
    assert rel_err(y, ref) < 1e-2


# -- FP8 GEMMs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_scaled_mm_kernels_match_the_emulation(recipe):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores below compute capability 8.9")
    if recipe == "blockwise" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("blockwise F.scaled_mm runs on SM90 only")
    assert fp8.scaled_mm_backend("cuda", recipe) == "native", "expected a real kernel on this GPU"
    torch.manual_seed(0)
    # M, N, K not multiples of 16 / 128: exercises the padding to the kernels' alignment
    x = torch.randn(200, 392, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(264, 392, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(200, 264, device="cuda", dtype=torch.bfloat16)
    cases = {"fprop": (fp8.fp8_linear_scaled_mm, fp8.fp8_linear_emulated, x, w),
             "dgrad": (fp8.fp8_dgrad_scaled_mm, fp8.fp8_dgrad_emulated, dy, w),
             "wgrad": (fp8.fp8_wgrad_scaled_mm, fp8.fp8_wgrad_emulated, dy, x)}
    for gemm, (kernel, emulated, a, b) in cases.items():
        got, want = kernel(a, b, recipe), emulated(a, b, recipe)
        # the kernels' fp32 accumulation order differs from the emulation's matmul: 1.25e-4 on an H100
        assert got.shape == want.shape and rel_err(got, want) < 5e-4, gemm
        assert kernel(a, b, recipe, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fp8_linear_auto_backend_runs_real_kernels_on_this_gpu():
    from moe_lc.ops.fp8_linear import Fp8Gemms

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores below compute capability 8.9")
    assert Fp8Gemms("blockwise", "auto").implementation(torch.device("cuda")) in ("te", "scaled_mm")
    assert Fp8Gemms("tensorwise", "auto").implementation(torch.device("cuda")) in ("te", "scaled_mm")


# -- training on cuda -----------------------------------------------------------------------------------


def _train(device: str, recipe: str, tmp_path: Path, tag: str, extra: tuple[str, ...] = ()) -> list[float]:
    from moe_lc.config import load_config
    from moe_lc.train import run

    overrides = ["train.steps=5", "train.warmup_steps=2", "train.log_interval=1", f"train.device={device}",
                 f"precision.recipe={recipe}", "data.synthetic_weight=0.5", "data.synthetic_tasks=passkey",
                 f"train.output_dir={tmp_path / tag}", *extra]
    return run(load_config(ROOT / "recipes" / "debug_cpu.toml", overrides)).losses


def test_five_steps_on_cuda_match_the_cpu_run(tmp_path):
    """bf16 on the GPU against bf16 on the CPU (same init, data and loss-mask path; rounding differs:
    measured within 1% per step), and fp8 on the GPU's real kernels against bf16 there."""
    cpu = _train("cpu", "bf16", tmp_path, "cpu_bf16")
    gpu = _train("cuda", "bf16", tmp_path, "cuda_bf16")
    gpu_fp8 = _train("cuda", "fp8", tmp_path, "cuda_fp8")
    for losses in (gpu, gpu_fp8):
        assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))
    assert max(abs(a - b) / b for a, b in zip(gpu, cpu)) < 0.02, (gpu, cpu)
    assert max(abs(a - b) / b for a, b in zip(gpu_fp8, gpu)) < 0.03, (gpu_fp8, gpu)
    assert gpu[-1] < gpu[0]


_DSA = tuple(DSA)  # the DSA tests' tiny MLA with a top-16 indexer
NEW_PATHS = {  # case: (overrides, rtol per step's loss); each built after the first GPU run
    "fused_adamw": ((), 1e-4),  # AdamW on a CUDA shard is torch's _fused_adamw_, the CPU's the op-by-op formula
    "muon": (("train.optimizer=muon", "train.lr=0.01", "train.muon_ns_dtype=fp32"), 1e-4),
    # bf16 Newton-Schulz on both sides (CUDA's default): bf16 rounding compounds over 5 steps
    "muon_bf16": (("train.optimizer=muon", "train.lr=0.01", "train.muon_ns_dtype=bf16"), 1e-2),
    "dsa_sparse": (_DSA, 1e-4),  # top-16 of up to 128 earlier tokens: selection really happens
    "dsa_warmup": (_DSA + ("model.dsa.stage=warmup", "model.dsa.indexer_lr=1e-2"), 1e-4),
    "qk_clip": (("train.qk_clip=1.0",), 1e-4),  # below every head's max lse: rows rescaled every step
    # and the forward guard: each call's bound read on the host, calls over tau run again with scaled queries
    "qk_clip_guard": (("train.qk_clip=1.0", "train.qk_clip_guard=true"), 1e-4),
    "zero2": (("parallel.placement.grads=sharded",), 1e-4),
    # the master and moments pinned in host memory, updated on the CPU bucket by bucket (never run on a GPU yet)
    "optimizer_offloaded": (("parallel.placement.optimizer=offloaded", "parallel.zero_bucket_mb=0.05"), 1e-4),
    "optimizer_offloaded_muon_bf16": (("parallel.placement.optimizer=offloaded", "train.optimizer=muon",
                                       "train.lr=0.01", "train.muon_ns_dtype=bf16"), 1e-2),
    # ZeRO-3: bucket storages resized to nothing between units, regathered around each use (never run on a GPU yet)
    "zero3": (("parallel.placement.params=sharded_gather", "parallel.zero_bucket_mb=0.05"), 1e-4),
}


@pytest.mark.parametrize("case", NEW_PATHS, ids=str)
def test_paths_built_since_the_first_gpu_run_match_the_cpu(case, tmp_path):
    """fp32 on both sides (TF32 off: torch's default for matmuls), so only summation order differs."""
    overrides, rtol = NEW_PATHS[case]
    cpu = _train("cpu", "fp32", tmp_path, "cpu", overrides)
    gpu = _train("cuda", "fp32", tmp_path, "cuda", overrides)
    print(f"{case}: cpu {cpu} cuda {gpu}")
    assert len(gpu) == 5 and all(torch.isfinite(torch.tensor(gpu)))
    assert max(abs(a - b) / abs(b) for a, b in zip(gpu, cpu)) < rtol, (gpu, cpu)


def test_offloaded_activations_on_cuda_train_bit_for_bit_like_kept_ones(tmp_path):
    """train.offload on CUDA (pinned host copies on a side stream, prefetch): the same losses, bit for bit."""
    offload = ('train.offload=["attn_core", "experts"]',)
    kept = _train("cuda", "fp32", tmp_path, "kept")
    away = _train("cuda", "fp32", tmp_path, "away", offload)
    assert away == kept, (away, kept)
