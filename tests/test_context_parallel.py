"""Zig-zag ring context parallelism: layout, schedule, the attention function on real rings, and
training equivalence with one device.

The multi-rank attention checks share one 8-process gloo job (`ring_results`, module scope): it
builds cp = 2, 4 and 8 groups and runs, on every rank,
  fp32: ring attention (reference and torch backends; GQA; D_v != D_qk) vs fp64 full causal
        attention, output, LSE and dq/dk/dv gathered back with zigzag_unshard;
  the backend calls the ring really made (counted by a wrapping backend) and the bytes comm.py
        counted on the "cp" group in forward and backward;
  bf16: the same inputs (rounded to bf16) at cp = 2 and cp = 8, errors vs fp64 truth;
  the whole debug model (MoE and dense), one forward/backward, cp = 2, 4, 8 vs one device.
Training equivalence (tests/harness.py) then runs 5 steps per layout, losses and parameters within
1e-5 (see TRAIN for the seed). Slow-marked layouts (run with -m slow): dense cp=2, cp=2 x dp=2 and
cp=2 x tp=2 (the MoE model covers those layouts in the fast set).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lc.config import ConfigError, ParallelConfig, load_config, model_config
from moe_lc.model.transformer import build_model
from moe_lc.ops.attention import AttentionBackend, attention_with_lse, get_backend
from moe_lc.parallel.comm import Group
from moe_lc.parallel.cp.ring import (attention_work, chunk_ids, ring_attention_with_lse,
                                     ring_schedule, zigzag_shard, zigzag_unshard)
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.layer_plan import apply_layer_plan
from moe_lc.parallel.parallelize import prepare_batch
from tests.harness import RECIPES, compare, reference, run_layout, run_workers

RECIPE = RECIPES / "debug_cpu.toml"
DENSE = RECIPES / "dense_cpu.toml"
BASE = ["train.steps=5", "train.seq_len=64", "train.global_batch=8", "train.warmup_steps=2"]
ROOT = Path(__file__).resolve().parents[1]


def fake_dims(cp: int, rank: int) -> ParallelDims:
    """cp-only dims whose "cp" group has no process group (enough for sharding, which is local)."""
    group = Group("cp", list(range(cp)), rank)
    return ParallelDims(1, 1, cp, 1, 1, cp, cp, rank, groups={"cp": group})


# --------------------------------------------------------------------------- layout and schedule (no processes)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_shard_moves_tokens_labels_and_positions_together(cp):
    S = 8 * cp
    tokens = torch.randint(0, 500, (3, S + 1))
    mask = torch.rand(3, S) > 0.3
    held = []
    for rank in range(cp):
        batch = prepare_batch(tokens, mask, fake_dims(cp, rank))
        pos = batch["positions"]
        a, b = chunk_ids(rank, cp)
        C = S // (2 * cp)
        assert pos.tolist() == list(range(a * C, (a + 1) * C)) + list(range(b * C, (b + 1) * C))
        assert torch.equal(batch["inputs"], tokens[:, pos]) and torch.equal(batch["labels"], tokens[:, pos + 1])
        assert torch.equal(batch["loss_mask"], mask[:, pos])
        held += pos.tolist()
    assert sorted(held) == list(range(S))  # every token on exactly one rank
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        zigzag_shard(torch.zeros(2, 4 * cp + 2), fake_dims(cp, 0)["cp"], dim=1)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_schedule_is_the_standard_scheme(cp):
    """Derived from chunk positions only, the plan is: step 0 the local causal diagonal; a block from
    an earlier rank: all queries x its first chunk; from a later rank: second query chunk x all keys."""
    for rank in range(cp):
        for step, block in enumerate(ring_schedule(rank, cp)):
            src = (rank - step) % cp
            q, kv, causal = block.q, block.kv, block.causal
            if src == rank:
                assert (q, kv, causal) == ((0, 2), (0, 2), True)
            elif src < rank:
                assert (q, kv, causal) == ((0, 2), (0, 1), False)
            else:
                assert (q, kv, causal) == ((1, 2), (0, 2), False)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_attention_work_and_contiguous_split_does_not(cp):
    total = (2 * cp) ** 2 / 2  # causal attention over 2cp chunks, in chunk-pairs
    zigzag, contiguous = attention_work(cp, "zigzag"), attention_work(cp, "contiguous")
    assert sum(zigzag) == sum(contiguous) == total
    assert zigzag == [2.0 * cp] * cp
    assert contiguous == [2.0 + 4 * r for r in range(cp)]  # the last rank does 2cp-1 times the first's
    print(f"cp={cp}: work per rank zig-zag {zigzag}, contiguous {contiguous}")


def test_cp_swaps_every_attention_core():
    # (the sequence-wise aux loss runs under cp: tests/test_balance_knobs.py)
    model = build_model(model_config(attn_backend="reference"), seed=0)
    apply_layer_plan(model, fake_dims(2, 0))
    cores = [layer.attn.core for layer in model.layers.values()]
    assert all(type(c).__name__ == "RingAttention" and c.backend_name == "reference" for c in cores)


def test_128k_recipe_validates():
    cfg = load_config(ROOT / "recipes" / "moe16b_128k.toml", world_size=64)
    assert (cfg.parallel.cp, cfg.train.seq_len, cfg.model.rope.scaling) == (8, 131072, "yarn")
    assert cfg.train.seq_len % (2 * cfg.parallel.cp * cfg.parallel.tp) == 0


# --------------------------------------------------------------------------- ring attention on 8 gloo ranks


class CountingBackend(AttentionBackend):
    """Wraps a backend and records every call: (phase, S_q, S_k, causal)."""

    def __init__(self, inner: AttentionBackend):
        self.inner, self.calls, self.name = inner, [], inner.name

    def forward(self, q, k, v, causal, scale):
        self.calls.append(("fwd", q.shape[1], k.shape[1], causal))
        return self.inner.forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        self.calls.append(("bwd", q.shape[1], k.shape[1], causal))
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale)


FP32_CASES = {  # name: (B, S, H, J, D_qk, D_v)
    "gqa": (2, 64, 4, 2, 16, 16),
    "mla_dv_lt_dqk": (1, 64, 4, 4, 24, 16),
    "gqa_dv_gt_dqk": (1, 64, 4, 1, 16, 24),
}
BF16_CASE = (1, 1024, 4, 2, 32, 32)
SCALE = 0.3


def _inputs(shape, dtype, seed=0):
    B, S, H, J, Dqk, Dv = shape
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return make(B, S, H, Dqk), make(B, S, J, Dqk) * 2, make(B, S, J, Dv), make(B, S, H, Dv)


def _truth(q, k, v, dout):
    """fp64 full causal attention on exactly these (possibly bf16-rounded) values."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = attention_with_lse(q, k, v, True, SCALE, "reference")
    out.backward(dout.double())
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _ring(q, k, v, dout, group, backend):
    """Shard, run ring attention forward/backward, gather everything back; plus counted bytes."""
    counter = group.counter
    q, k, v = (zigzag_shard(x, group, 1).clone().requires_grad_() for x in (q, k, v))
    counter.reset()
    out, lse = ring_attention_with_lse(q, k, v, SCALE, group, backend)
    fwd_bytes = counter.total("cp", "send")
    out.backward(zigzag_shard(dout, group, 1))
    bwd_bytes = counter.total("cp", "send") - fwd_bytes
    e, n_kv = k.element_size(), k.numel() + v.numel()
    cp = group.size
    expected = ((cp - 1) * n_kv * e, (cp - 1) * n_kv * e + cp * n_kv * 4)
    got = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    full = {name: zigzag_unshard(t, group, 2 if name == "lse" else 1) for name, t in got.items()}
    return full, (fwd_bytes, bwd_bytes), expected


def _errors(got, want):
    """Relative norm error per tensor (lse: max absolute error)."""
    out = {}
    for name, w in want.items():
        g = got[name].double()
        out[name] = ((g - w).abs().max() if name == "lse" else (g - w).norm() / w.norm()).item()
    return out


def _ring_worker(rank, world):
    results = {"fp32": {}, "bytes": {}, "calls": {}, "bf16": {}}
    groups = {}
    for cp in (2, 4, 8):
        dims = ParallelDims.from_config(ParallelConfig(cp=cp), world, rank)
        dims.init_groups()
        groups[cp] = dims["cp"]
    for name, shape in FP32_CASES.items():
        q, k, v, dout = _inputs(shape, torch.float32)
        truth = _truth(q, k, v, dout)
        for cp in (2, 4):
            for backend_name in ("reference", "torch"):
                backend = CountingBackend(get_backend(backend_name))
                full, counted, expected = _ring(q, k, v, dout, groups[cp], backend)
                results["fp32"][(name, cp, backend_name)] = _errors(full, truth)
                results["bytes"][(name, cp, backend_name)] = (counted, expected)
                results["calls"][(name, cp, backend_name)] = backend.calls
    q, k, v, dout = _inputs(BF16_CASE, torch.bfloat16, seed=1)
    truth = _truth(q, k, v, dout)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = attention_with_lse(qs, ks, vs, True, SCALE, "torch")
    out.backward(dout)
    results["bf16"][1] = _errors({"out": out, "lse": lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}, truth)
    for cp in (2, 8):
        full, counted, expected = _ring(q, k, v, dout, groups[cp], get_backend("torch"))
        results["bf16"][cp] = _errors(full, truth)
        results["bytes"][("bf16", cp, "torch")] = (counted, expected)
    results["model_grads"] = {(recipe.stem, cp): r for recipe in (RECIPE, DENSE)
                              for cp, r in _model_grads(recipe, groups, seed=0).items()}
    return results


def _model_grads(recipe, groups, seed):
    """One forward/backward of the whole model on (2, 64) tokens, on one device and under each cp
    ring (loss summed and gradients all-reduced over cp).
    -> {cp: (loss rel diff, {param: grad rel-norm diff})}."""
    from moe_lc.parallel import comm
    from moe_lc.parallel.parallelize import parallelize

    cfg = load_config(recipe, ["model.attn_backend=torch"]).model
    tokens = torch.randint(0, 259, (2, 65), generator=torch.Generator().manual_seed(seed))

    def loss_and_grads(model, dims):
        batch = prepare_batch(tokens, None, dims)
        loss = model(batch["inputs"], positions=batch["positions"], labels=batch["labels"]) / tokens[:, 1:].numel()
        loss.backward()
        loss, grads = loss.detach().clone(), [p.grad.clone() for p in model.parameters()]
        for t in [loss, *grads]:
            comm.all_reduce(t, dims["cp"])
        return loss, grads

    names = [name for name, _ in build_model(cfg).named_parameters()]
    want_loss, want = loss_and_grads(build_model(cfg, seed=0), fake_dims(1, 0))
    out = {}
    for cp, group in groups.items():
        dims = ParallelDims(1, 1, cp, 1, 1, cp, cp, group.rank, groups={"cp": group})
        loss, got = loss_and_grads(parallelize(build_model(cfg, seed=0), dims).module, dims)
        out[cp] = ((loss - want_loss).abs().item() / want_loss.item(),
                   {n: ((g - w).norm() / w.norm().clamp_min(1e-30)).item() for n, g, w in zip(names, got, want)})
    return out


@pytest.fixture(scope="module")
def ring_results():
    return run_workers(_ring_worker, 8)


@pytest.mark.parametrize("case", list(FP32_CASES))
def test_ring_attention_equals_full_causal_attention_fp32(ring_results, case):
    """Output, LSE and dq/dk/dv of the ring (gathered) vs fp64 full attention, every rank's view."""
    for rank, res in enumerate(ring_results):
        for (name, cp, backend), errs in res["fp32"].items():
            if name == case:
                assert max(errs.values()) < 1e-5, (rank, name, cp, backend, errs)
    print(case, {k[1:]: max(v.values()) for k, v in ring_results[0]["fp32"].items() if k[0] == case})


def test_ring_computes_the_balanced_schedule(ring_results):
    """The backend calls really made: the planned blocks, equal work on every rank."""
    for (name, cp, backend), _ in ring_results[0]["calls"].items():
        S_local = FP32_CASES[name][1] // cp
        C = S_local // 2
        work = []
        for rank, res in enumerate(ring_results[:cp]):
            calls = res["calls"][(name, cp, backend)]
            planned = [("fwd", (b.q[1] - b.q[0]) * C, (b.kv[1] - b.kv[0]) * C, b.causal)
                       for b in ring_schedule(rank, cp) if b is not None]
            assert calls == planned + [("bwd",) + c[1:] for c in planned], (rank, calls)
            work.append(sum(q * k / C**2 * (0.5 if causal else 1) for phase, q, k, causal in calls if phase == "fwd"))
        assert work == [2.0 * cp] * cp


def test_ring_traffic_matches_formula(ring_results):
    """Forward: (cp-1) K/V blocks sent per rank; backward: (cp-1) K/V blocks + cp fp32 dK/dV blocks."""
    for rank, res in enumerate(ring_results):
        for key, (counted, expected) in res["bytes"].items():
            assert counted == expected, (rank, key, counted, expected)
    print({k: v[0] for k, v in ring_results[0]["bytes"].items() if k[2] == "torch"})


def test_bf16_ring_error_does_not_grow_with_ring_size(ring_results):
    """Same bf16 inputs (S=1024), fp64 truth: the error at cp=8 is at most 1.5x the error at cp=2
    (partial outputs, LSE, dq and dK/dV accumulate in fp32). Also at most 1.5x the error of bf16
    attention on one device: with bf16 accumulators instead, cp=8 measured 1.47x cp=2 on `out`
    (passing the first bound by a hair) but 1.85x one device, which the second bound catches."""
    errs = ring_results[0]["bf16"]
    print("bf16 errors (rel. norm; lse max abs):",
          {cp: {k: f"{v:.2e}" for k, v in e.items()} for cp, e in errs.items()})
    for name in errs[2]:
        assert errs[8][name] <= 1.5 * errs[2][name], (name, errs[2][name], errs[8][name])
        assert errs[8][name] <= 1.5 * max(errs[1][name], 1e-6), (name, errs[1][name], errs[8][name])
    assert max(v for k, v in errs[8].items() if k != "lse") < 1e-2


def test_model_gradients_under_cp_equal_one_device(ring_results):
    """The whole debug model (MoE and dense), one step, cp = 2, 4, 8: summed loss and every
    parameter's gradient (all-reduced over cp) equal the single-device ones up to fp32 rounding of
    the reordered attention sums (measured <= ~1e-6 relative norm)."""
    worst = {}
    for rank, res in enumerate(ring_results):
        for key, (loss_rel, grads) in res["model_grads"].items():
            assert loss_rel < 1e-6, (rank, key, loss_rel)
            name = max(grads, key=grads.get)
            assert grads[name] < 5e-6, (rank, key, name, grads[name])
            worst[key] = max(worst.get(key, 0.0), grads[name], loss_rel)
    print("max loss/grad rel diff per (recipe, cp):", {k: f"{v:.1e}" for k, v in worst.items()})


# --------------------------------------------------------------------------- training equivalence


def _assert_cp_traffic(got, cfg):
    """Per step and rank: n_micro x n_layers x (forward + backward ring bytes), by formula (fp32);
    under tp each rank rings its own kv heads (n_kv_heads / tp, at least one)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    n_micro = t.microbatches(got.world // (p.cp * p.tp))
    kv_heads = max(m.n_kv_heads // p.tp, 1)
    kv_numel = 2 * t.micro_batch * (t.seq_len // p.cp) * kv_heads * m.head_size  # local K and V
    per_layer = (p.cp - 1) * kv_numel * 4 + ((p.cp - 1) * kv_numel * 4 + p.cp * kv_numel * 4)
    for rank in range(got.world):
        for step in got.comm_per_rank[rank]:
            assert step["comm/cp/send_bytes"] == n_micro * m.n_layers * per_layer, (rank, step)


# Seed choice. Any reordering of the attention sums moves every gradient by ~6e-7 (relative norm):
# ring attention and, on one device, swapping the attention kernel (torch -> reference) alike
# (test_model_gradients_under_cp_equal_one_device). With train.seed=0, one token of the MoE model
# sits on a top-k routing near-tie at step 3 and flips under any such reordering (one device with
# the other kernel flips too), moving two experts by ~3e-3: a discontinuity of discrete routing, not
# a CP error. Seed 1 has no such tie, and every layout stays within 1e-5 (measured 3-9e-6).
TRAIN = BASE + ["train.micro_batch=2", "train.seed=1"]


def _equivalence(recipe, cp, dp, tp=1):
    ref = reference(recipe, TRAIN)
    layout = TRAIN + [f"parallel.cp={cp}", f"parallel.dp={dp}", f"parallel.tp={tp}"]
    got = run_layout(recipe, layout, world=cp * dp * tp)
    report = compare(ref, got)
    print(f"{recipe.stem} cp={cp} dp={dp} tp={tp}: max loss rel diff {report.max_loss_rel:.1e}, "
          f"max param rel diff {report.max_param_rel:.1e} ({report.worst_param})")
    _assert_cp_traffic(got, load_config(recipe, layout, world_size=cp * dp * tp))
    return ref, got, report


@pytest.mark.parametrize("cp, dp", [(2, 1), (4, 1), (2, 2)])
def test_cp_trains_moe_model_like_one_device(cp, dp):
    ref, got, report = _equivalence(RECIPE, cp, dp)
    assert report.max_loss_rel <= 1e-5, (ref.losses, got.losses)
    assert report.max_param_rel <= 1e-5, report


# the default run covers cp=2, cp=4 and cp=2 x dp=2 on the MoE model (whose first block is dense)
@pytest.mark.parametrize("cp, dp", [pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(4, 1, marks=pytest.mark.slow),
                                    pytest.param(2, 2, marks=pytest.mark.slow)])
def test_cp_trains_dense_model_like_one_device(cp, dp):
    ref, got, report = _equivalence(DENSE, cp, dp)
    assert report.max_loss_rel <= 1e-5, (ref.losses, got.losses)
    assert report.max_param_rel <= 1e-5, report


@pytest.mark.parametrize("recipe", [pytest.param(DENSE, marks=pytest.mark.slow), RECIPE])
def test_cp2_tp2_trains_like_one_device(recipe):
    ref, got, report = _equivalence(recipe, 2, 1, tp=2)
    assert report.max_loss_rel <= 1e-5, (ref.losses, got.losses)
    assert report.max_param_rel <= 1e-5, report
