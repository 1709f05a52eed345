"""ZeRO-1 data parallelism: equivalence to one device, counted traffic and state bytes by formula."""

import math
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moe_lc.config import load_config
from moe_lc.model.counting import param_counts
from moe_lc.parallel.comm import Group
from moe_lc.parallel.placement import ParamPlacement
from moe_lc.parallel.zero.optimizer import GRAD_NORM_CHUNK, ZeroOptimizer
from tests.harness import RECIPES, TOLERANCE, assert_equivalent, reference, run_layout, run_workers

RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=5", "train.seq_len=64", "train.global_batch=8", "train.warmup_steps=2"]


def zero_buckets_padded(numels_in_order, bucket_elems, n):
    """Independent restatement of ZeRO-1's layout: greedy buckets, each padded to a multiple of n."""
    sizes, cur = [], 0
    for k in numels_in_order:
        if cur and cur + k > bucket_elems:
            sizes.append(cur)
            cur = 0
        cur += k
    sizes.append(cur)
    return sum(-(-s // n) * n for s in sizes)


@pytest.mark.parametrize("dp, micro", [(2, 2), (4, 1)])
def test_zero1_matches_one_device(dp, micro):
    """fp32, 5 steps, 2 micro-batches per rank (gradient accumulation) vs 1 process (4 or 8)."""
    overrides = BASE + [f"train.micro_batch={micro}"]
    ref = reference(RECIPE, overrides)
    got = run_layout(RECIPE, overrides + [f"parallel.dp={dp}"], world=dp)
    report = assert_equivalent(ref, got, rtol=1e-5)
    # The global clipping norm agrees too. Looser than the losses: a near-tie in top-k routing can flip
    # one token's expert under a reordered fp32 sum, which moves that step's gradient by ~1e-5 while
    # the loss moves by ~1e-8 (one process with micro_batch 1 vs 2 shows the same effect).
    assert max(abs(a - b) / b for a, b in zip(got.grad_norms, ref.grad_norms)) < 1e-4
    print(f"dp={dp}: max loss rel diff {report.max_loss_rel:.1e}, max param rel diff {report.max_param_rel:.1e}")

    # Counted bytes per step = formula: reduce-scatter of fp32 gradients + all-gather of parameters,
    # each (N-1)/N x psi x bytes, per ZeRO group (dense over dp, experts over edp = dp here).
    counts = param_counts(load_config(RECIPE).model)
    psi = {"dp_cp": counts["total"] - counts["routed_experts"], "edp": counts["routed_experts"]}
    for group, n_params in psi.items():
        assert n_params % dp == 0  # one bucket per group, no padding for these sizes
        expected = (dp - 1) * n_params * 4 // dp
        for rank in range(dp):
            for step in got.comm_per_rank[rank]:
                assert step[f"comm/{group}/reduce_scatter_bytes"] == expected
                assert step[f"comm/{group}/all_gather_bytes"] == expected
    # Optimizer state per rank: fp32 master + two fp32 moments = 12 psi / N
    assert got.optimizer_state_bytes == [12 * counts["total"] // dp] * dp
    assert ref.optimizer_state_bytes == [12 * counts["total"]]


def test_uneven_sharding_pads_each_bucket():
    """dp=3 with small buckets: every bucket padded to a multiple of 3; bytes follow the padded psi."""
    bucket_mb = 0.05
    overrides = BASE + ["train.global_batch=6", "train.micro_batch=1", "train.steps=2",
                        f"parallel.zero_bucket_mb={bucket_mb}", "parallel.dp=3"]
    got = run_layout(RECIPE, overrides, world=3)
    from moe_lc.model.transformer import Transformer

    model = Transformer(load_config(RECIPE).model)
    named = list(model.named_parameters())
    bucket_elems = int(bucket_mb * 2**20 / 4)
    dense = [p.numel() for n, p in reversed(named) if ".experts." not in n]
    expert = [p.numel() for n, p in reversed(named) if ".experts." in n]
    padded = {"dp_cp": zero_buckets_padded(dense, bucket_elems, 3), "edp": zero_buckets_padded(expert, bucket_elems, 3)}
    assert padded["dp_cp"] > sum(dense)  # this layout really pads
    for group, psi in padded.items():
        for rank in range(3):
            step = got.comm_per_rank[rank][0]
            assert step[f"comm/{group}/reduce_scatter_bytes"] == 2 * psi * 4 // 3
            assert step[f"comm/{group}/all_gather_bytes"] == 2 * psi * 4 // 3
    assert got.optimizer_state_bytes == [12 * (padded["dp_cp"] + padded["edp"]) // 3] * 3


def _overlap_worker(rank, world):
    """Record when gradient buckets are launched relative to the end of backward, whether each reduces in place
    (its output a slice of its input, the main-grad buffer) and the reduced shards' bytes through backward."""
    from moe_lc.config import model_config, ParallelConfig
    from moe_lc.model.transformer import build_model
    from moe_lc.parallel import comm
    from moe_lc.parallel.mesh import ParallelDims
    from moe_lc.parallel.parallelize import parallelize, zero_param_groups
    from moe_lc.parallel.zero.optimizer import ZeroOptimizer, ZeroOptions

    d = ParallelDims.from_config(ParallelConfig(), world, rank)
    d.init_groups()
    parallel = parallelize(build_model(model_config(attn_backend="reference"), seed=0), d)
    model = parallel.module
    opt = ZeroOptimizer(zero_param_groups(parallel, d), d["world"], options=ZeroOptions(bucket_mb=0.05))
    events = []
    real = comm.reduce_scatter
    same = lambda out, inp: out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
    comm.reduce_scatter = lambda out, inp, *a, **k: (events.append("launch" if same(out, inp) else "copy"),
                                                     real(out, inp, *a, **k))[1]
    shard_bytes = lambda: sum(s.grad_shard.untyped_storage().nbytes() for s in opt.shards)
    tokens = torch.randint(0, 259, (2, 33))
    opt.begin_step(2)
    for micro in range(2):  # gradient accumulation: nothing is sent on the first micro-step
        h = model.embed(tokens[:, :-1])
        h.register_hook(lambda g: events.append(f"embed-grad, shards {shard_bytes()} B"))  # the end of backward
        loss = model.loss_fn(model.head(model.norm(_blocks(model, h))), tokens[:, 1:])
        loss.backward()
        events.append(f"end-micro{micro}")
    full = sum(s.grad_shard.numel() * 4 for s in opt.shards)
    norm = opt.shards[-1].grad_sq_sum  # runs once every group's sync finished
    opt.shards[-1].grad_sq_sum = lambda: (events.append(f"finished, shards {shard_bytes()} B of {full}"), norm())[1]
    opt.step(lr=1e-3)
    events.append(f"stepped, shards {shard_bytes()} B")
    return events


def _blocks(model, h):
    cos, sin = model.rope(torch.arange(h.shape[1]))
    for block in model.layers.values():
        h = block(h, cos, sin)
    return h


def test_reduce_scatter_overlaps_backward_and_skips_accumulation_steps():
    events = run_workers(_overlap_worker, 2)[0]
    first_end = events.index("end-micro0")
    assert "launch" not in events[:first_end]  # no communication on a non-final micro-step
    last = events[first_end:]
    assert last.count("launch") >= 3 and "copy" not in events  # every bucket reduced in place
    # buckets of late layers are launched while earlier layers are still in backward
    assert last.index("launch") < last.index("embed-grad, shards 0 B")
    # the reduced shards take memory from the optimizer step's start to its end only
    finished = next(e for e in events if e.startswith("finished"))
    n = int(finished.split()[-1])
    assert n > 0 and finished == f"finished, shards {n} B of {n}" and events[-1] == "stepped, shards 0 B"


class LargestNewTensor(TorchDispatchMode):
    """Records the bytes of the largest storage any op makes while active (not views of its inputs)."""

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = lambda tree: [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
        made = [t.untyped_storage().nbytes() for t in tensors(out) if t.untyped_storage().data_ptr() not in inputs]
        self.max_bytes = max([self.max_bytes, *made])
        return out


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "norm_weight"])
def test_grad_norm_is_chunked_and_as_accurate_as_fp64(weighted):
    """grad_sq_sum on a shard of 2 weighting chunks and a bit (not a whole number of rows), gradients over
    1e-13..1e4 (rows counted at 1/3 where a norm weight applies): within 1e-6 of the fp64 sum of squares,
    no tensor over one chunk's fp32 made; a square past fp32's range or an inf gives a non-finite norm."""
    torch.manual_seed(0)
    rows, cols = 2 * GRAD_NORM_CHUNK // 1000 + 3, 1000
    g = torch.randn(rows, cols) * torch.exp(torch.empty(rows, cols).uniform_(-30, 10))
    weight = torch.where(torch.arange(rows) % 3 == 0, 1 / 3, 1.0).double()[:, None] if weighted else None
    w = nn.Parameter(torch.zeros(rows, cols))
    one = lambda name: Group(name, [0], 0)
    opt = ZeroOptimizer([("dp_cp", [("w", w, ParamPlacement(norm_weight=weight))], one("dp_cp"))], one("world"))
    shard = opt.shards[0]
    for case in ("wide", "past fp32", "inf"):
        if case != "wide":
            g[5, 7] = 1e25 if case == "past fp32" else float("inf")
        opt.begin_step(1)
        (w * g).sum().backward()  # w.grad = g, reduced into the shard by ZeRO's hook
        shard.finish_grad_sync()
        want = (g.double().pow(2) * (1.0 if weight is None else weight)).sum().item()
        with LargestNewTensor() as mode:
            got = shard.grad_sq_sum().item()
        assert mode.max_bytes <= 4 * GRAD_NORM_CHUNK < 4 * g.numel()  # fp32 squares (or weights) of one chunk
        if case == "wide":
            assert abs(got - want) / want < 1e-6, (got, want)
        else:  # ZeroOptimizer.step skips the update on it
            assert not math.isfinite(got)
        opt.zero_grad()


def test_bf16_zero1_within_documented_tolerance():
    overrides = BASE + ["train.micro_batch=2", "precision.recipe=bf16"]
    ref = reference(RECIPE, overrides)
    got = run_layout(RECIPE, overrides + ["parallel.dp=2"], world=2)
    report = assert_equivalent(ref, got, rtol=TOLERANCE["bf16"])
    print(f"bf16 dp=2: loss rel {report.max_loss_rel:.1e}, param rel {report.max_param_rel:.1e}")


def test_bf16_adam_moments_halve_moment_memory_and_still_train():
    overrides = BASE + ["train.micro_batch=4"]
    fp32 = reference(RECIPE, overrides)
    bf16 = run_layout(RECIPE, overrides + ["precision.adam_moments=bf16"], world=1)
    psi = param_counts(load_config(RECIPE).model)["total"]
    assert bf16.optimizer_state_bytes == [(4 + 2 + 2) * psi]
    assert bf16.losses[-1] < bf16.losses[0]
    assert max(abs(a - b) / b for a, b in zip(bf16.losses, fp32.losses)) < 1e-2


def test_multi_rank_checkpoint_resume_is_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    overrides = BASE + ["train.steps=6", "train.micro_batch=2", "parallel.dp=2", "checkpoint.interval=3",
                        f"checkpoint.dir={ckpt}"]
    full = run_layout(RECIPE, overrides, world=2)
    shutil.rmtree(ckpt / "step_00000006")
    resumed = run_layout(RECIPE, overrides + ["checkpoint.resume=true"], world=2)
    assert resumed.losses == full.losses[3:]
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())


def test_torchrun_dp4_on_cpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "moe_lc.train",
           str(RECIPE), "--set", "parallel.dp=4", "--set", "train.steps=3", "--set", f"train.output_dir={tmp_path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp=4" in out.stdout and "step 3/3" in out.stdout
