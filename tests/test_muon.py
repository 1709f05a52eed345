"""Muon (moe_lc/optim/muon.py): the Newton-Schulz step against its polynomial on the singular values,
the update's scale and RMS, which parameters take Muon and per which logical matrix, and the sharded
rule (each matrix whole on one owner, TP slices gathered) equal to one process under dp2, tp2, cp2,
ep2, pp2 DualPipe, dp2 x tp2 x ep2 and tp4, an exact resume and a resume resharded to tp2, and the tp gather's
counted bytes against the slices and the planner."""

import math
import shutil

import pytest
import torch
from torch import nn

from moe_lc.config import ConfigError, load_config, to_toml
from moe_lc.model.transformer import Transformer
from moe_lc.optim import RULES, Muon, recipe_rule
from moe_lc.optim import muon
from moe_lc.optim.muon import NS_COEFFICIENTS, newton_schulz
from moe_lc.parallel.comm import Group
from moe_lc.parallel.placement import ParamPlacement
from moe_lc.parallel.zero.optimizer import ZeroOptimizer
from tests.harness import (RECIPES, LayoutResult, assert_equivalent, compare, interrupted_and_resumed, reference,
                           run_layout)

RECIPE = RECIPES / "debug_cpu.toml"
# lr 0.01: at 0.02 the loss spikes at step 5 and dp2 x tp2 x ep2 ends 4e-5 from one process; so does one
# process with micro_batch 1 instead of 2 (1.2e-3 in one expert's w2: a routing flip that summation order
# decides, as the harness's seed note describes), so it measures that amplification, not the layout
MUON = ["train.optimizer=muon", "train.lr=0.01"]


# -- the math ------------------------------------------------------------------------------------------
def _polynomial_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """NS5 in exact terms: G = U S V^T -> U p^5(S / ||G||_F) V^T, p(x) = a x + b x^3 + c x^5 (fp64)."""
    a, b, c = NS_COEFFICIENTS
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = s / torch.linalg.matrix_norm(g.double(), keepdim=True).squeeze(-1)
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return u @ torch.diag_embed(x) @ vh


@pytest.mark.parametrize("shape", [(64, 160), (160, 64), (4, 48, 96)], ids=["wide", "tall", "experts"])
def test_newton_schulz_is_the_polynomial_on_singular_values_and_near_orthogonal(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    out = newton_schulz(g)
    assert out.shape == g.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _polynomial_reference(g), atol=2e-5, rtol=0)
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.67 and singular.max() < 1.14, (singular.min(), singular.max())
    assert torch.equal(newton_schulz(g.mT), out.mT)  # tall matrices run transposed


@pytest.mark.parametrize("shape", [(64, 160), (160, 64), (4, 48, 96)], ids=["wide", "tall", "experts"])
def test_newton_schulz_in_bf16_keeps_the_band_and_is_the_choice_on_cuda_only(shape):
    """bf16 iterations (train.muon_ns_dtype, CUDA's default) land each singular value in the same band as
    fp32's and the matrix within 5% of it (measured 2.4-3.1%); "auto" on a CPU tensor is fp32 exactly."""
    torch.manual_seed(0)
    g = torch.randn(shape)
    fp32, bf16 = newton_schulz(g), newton_schulz(g, dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)
    assert (bf16 - fp32).norm() / fp32.norm() < 0.05
    singular = torch.linalg.svdvals(bf16)
    assert singular.min() > 0.66 and singular.max() < 1.16, (singular.min(), singular.max())
    scale = 0.2 * math.sqrt(max(shape[-2:]))
    assert torch.equal(Muon(ns_dtype="auto").orthogonal_update("w", g), fp32 * scale)
    assert torch.equal(Muon(ns_dtype="bf16").orthogonal_update("w", g), bf16 * scale)


def _one_rank(name: str) -> Group:
    return Group(name, [0], 0)


@pytest.mark.parametrize("shape", [(96, 256), (256, 96), (128, 128)])
def test_update_is_scaled_to_adamw_rms(shape):
    """One step from zero momentum: the update is lr x 0.2 sqrt(max(A, B)) x NS5(g (1 + mu)). Its RMS is
    0.2 lr x the RMS of NS5's singular values: exactly 0.2 lr (AdamW's typical RMS, Moonlight 2.2) were
    they all 1 (U V^T); the quintic leaves them in about [0.68, 1.2], RMS 0.85-0.90 on these Gaussian
    gradients, so the step is 10-15% below 0.2 lr (measured, not a 5% match)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(shape))  # the update alone, without the rounding of w - update
    before = w.detach().clone()
    g = torch.randn(shape)
    lr = 0.01
    opt = ZeroOptimizer([("dp_cp", [("layers.0.ffn.w2.weight", w, ParamPlacement())], _one_rank("dp_cp"))],
                        _one_rank("world"), Muon(momentum=0.95))
    opt.begin_step(1)
    (w * g).sum().backward()
    opt.step(lr)
    update = before - w.detach()
    want = lr * 0.2 * math.sqrt(max(shape)) * newton_schulz(g * 1.95)
    torch.testing.assert_close(update, want, atol=1e-7, rtol=1e-5)
    rms = update.pow(2).mean().sqrt().item()
    singular_rms = torch.linalg.svdvals(newton_schulz(g)).pow(2).mean().sqrt().item()
    assert rms / (0.2 * lr) == pytest.approx(singular_rms, rel=1e-4)
    assert 0.84 < singular_rms < 0.91, singular_rms


@pytest.mark.parametrize("shape", [(96, 256), (256, 96), (4, 64, 32)])
def test_exact_rms_makes_every_update_0_2_lr(shape):
    """train.muon_exact_rms: each logical matrix's update (each expert of a stacked weight its own) is
    0.2 lr NS5(u) / RMS(NS5(u)): its RMS is AdamW's 0.2 lr to 1e-5 (Moonlight's scale gives 0.84-0.90 of
    it, above), and it points where the default's does."""
    torch.manual_seed(0)
    g, lr = torch.randn(shape), 0.01
    name = "layers.1.ffn.experts.w2.weight" if len(shape) == 3 else "layers.0.ffn.w2.weight"
    updates = []
    for rule in (Muon(momentum=0.95, exact_rms=True), Muon(momentum=0.95)):
        w = nn.Parameter(torch.zeros(shape))
        opt = ZeroOptimizer([("dp_cp", [(name, w, ParamPlacement())], _one_rank("dp_cp"))], _one_rank("world"), rule)
        opt.begin_step(1)
        (w * g).sum().backward()
        opt.step(lr)
        updates.append(-w.detach())
    exact, moonlight = updates
    for e, m in zip(exact.reshape(-1, *shape[-2:]), moonlight.reshape(-1, *shape[-2:])):
        assert e.pow(2).mean().sqrt().item() == pytest.approx(0.2 * lr, rel=1e-5)
        assert 0.8 < m.pow(2).mean().sqrt().item() / (0.2 * lr) < 0.91
        torch.testing.assert_close(e / e.norm(), m / m.norm())


def test_each_expert_and_each_fused_section_is_its_own_matrix():
    torch.manual_seed(0)
    cfg = load_config(RECIPE).model
    rule = recipe_rule(load_config(RECIPE, MUON))
    q, kv = cfg.n_heads * cfg.head_size, cfg.n_kv_heads * cfg.head_size
    assert rule.rows_of("layers.0.attn.wqkv.weight", q + 2 * kv) == (q, kv, kv)
    experts = torch.randn(8, 192, 128)
    got = rule.orthogonal_update("layers.1.ffn.experts.w13.weight", experts)
    for e in range(8):  # w1 and w3 of each expert: (96, 128) each, scaled by 0.2 sqrt(128)
        want = torch.cat([0.2 * math.sqrt(128) * newton_schulz(h) for h in experts[e].split(96)])
        torch.testing.assert_close(got[e], want, atol=1e-6, rtol=1e-5)
    wqkv = torch.randn(q + 2 * kv, cfg.dim)
    got = rule.orthogonal_update("layers.0.attn.wqkv.weight", wqkv)
    want = torch.cat([0.2 * math.sqrt(max(r, cfg.dim)) * newton_schulz(part) for part, r in
                      zip(wqkv.split((q, kv, kv)), (q, kv, kv))])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _one_matrix_at_a_time(rule: Muon, name: str, u: torch.Tensor) -> torch.Tensor:
    """The scaled update of u as Muon computed it before batching: each logical matrix alone (each expert
    its own), NS5 as matmuls and elementwise terms."""
    a, b, c = NS_COEFFICIENTS
    out = torch.empty_like(u)
    rows = rule.rows_of(name, u.shape[-2])
    for block, dst in zip(u.split(rows, dim=-2), out.split(rows, dim=-2)):
        for g, d in zip(block.reshape(-1, *block.shape[-2:]), dst.view(-1, *dst.shape[-2:])):
            x = g.mT if g.shape[0] > g.shape[1] else g
            x = x / (x.norm() + 1e-7)
            for _ in range(5):
                gram = x @ x.mT
                x = a * x + (b * gram + c * (gram @ gram)) @ x
            x = x.mT if g.shape[0] > g.shape[1] else x
            d.copy_(x * (0.2 / x.pow(2).mean().sqrt() if rule.exact_rms else 0.2 * math.sqrt(max(g.shape))))
    return out


@pytest.mark.parametrize("exact_rms", [False, True], ids=["moonlight", "exact_rms"])
@pytest.mark.parametrize("cap", [None, 3 * 96 * 128], ids=["default_cap", "3_matrices"])
def test_batched_newton_schulz_is_one_matrix_at_a_time(monkeypatch, cap, exact_rms):
    """`orthogonal_updates_` stacks every logical matrix of one shape across parameters (wide, tall, the
    halves of w13, tall w2 experts) into one Newton-Schulz chain per shape, cut at NS_BATCH_ELEMENTS (here
    also 3 matrices: stacks that split an expert tensor and span two), and equals each matrix alone as the
    unbatched matmuls computed it, within fp32 rounding."""
    if cap is not None:
        monkeypatch.setattr(muon, "NS_BATCH_ELEMENTS", cap)
    stacked: list[torch.Size] = []
    monkeypatch.setattr(muon, "newton_schulz", lambda g, **kw: (stacked.append(g.shape), newton_schulz(g, **kw))[1])
    torch.manual_seed(0)
    rule = Muon(exact_rms=exact_rms)
    named = [("layers.0.ffn.w2.weight", torch.randn(64, 160)), ("layers.1.ffn.w2.weight", torch.randn(64, 160)),
             ("layers.0.attn.wo.weight", torch.randn(160, 64)),
             ("layers.1.ffn.experts.w13.weight", torch.randn(8, 192, 128)),  # 16 matrices (96, 128): w1, w3
             ("layers.1.ffn.experts.w2.weight", torch.randn(8, 128, 96)),
             ("layers.2.ffn.experts.w13.weight", torch.randn(4, 192, 128))]  # 8 more (96, 128)
    want = [_one_matrix_at_a_time(rule, name, u) for name, u in named]
    got = [u.clone() for _, u in named]
    rule.orthogonal_updates_([(name, u) for (name, _), u in zip(named, got)])
    for (name, _), g, w in zip(named, got, want):  # norm-wise: 1.6e-6 measured, the baddbmm chain's rounding
        assert ((g - w).norm() / w.norm()).item() < 1e-5, name
    assert all(shape.numel() <= muon.NS_BATCH_ELEMENTS for shape in stacked)
    if cap is None:  # one stack per shape
        assert stacked == [(2, 64, 160), (1, 160, 64), (24, 96, 128), (8, 128, 96)]
    else:
        assert [s[0] for s in stacked] == [2, 1] + [3] * 8 + [3, 3, 2]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    rule = Muon()
    model = Transformer(load_config(RECIPE).model)
    adamw = sorted({n.split(".")[-2] if n.startswith("layers") else n for n, p in model.named_parameters()
                    if not rule.whole(n, p.shape)})
    assert adamw == ["attn_norm", "embed.weight", "ffn_norm", "head.weight", "norm.weight"]
    assert rule.whole("layers.1.ffn.experts.w2.weight", torch.Size([8, 128, 96]))
    assert rule.whole("layers.1.ffn.router.gate.weight", torch.Size([8, 128]))
    assert not rule.whole("layers.0.attn.wqkv.bias", torch.Size([256]))


def test_muon_is_a_recipe_choice_with_one_error_line():
    assert "muon" in RULES
    text = to_toml(load_config(RECIPE), docs=True)
    assert "adamw | sgd | muon" in text and "muon_momentum" in text
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, ["train.optimizer=lion"])
    assert err.value.errors == ["train.optimizer='lion' must be one of 'adamw', 'sgd', 'muon'"]
    with pytest.raises(ConfigError, match=r"train.muon_momentum=1.0 must lie in \[0, 1\)"):
        load_config(RECIPE, MUON + ["train.muon_momentum=1.0"])
    warned: list[str] = []
    load_config(RECIPE, ["train.muon_momentum=0.9"], warnings=warned)
    assert warned == ["train.muon_momentum=0.9 is set, but train.optimizer='adamw' does not read it"]


# -- sharded like ZeRO-1: equal to one process -------------------------------------------------------
BASE = MUON + ["train.steps=10", "train.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
               "train.warmup_steps=2", "parallel.zero_bucket_mb=0.05"]
LAYOUTS = {
    "dp2": (["parallel.dp=2"], 2),
    "tp2": (["parallel.tp=2"], 2),
    "ep2": (["parallel.dp=2", "parallel.ep=2"], 2),
    "cp2": (["parallel.cp=2"], 2),
    "pp2_dualpipe": (["parallel.pp=2", "parallel.pp_schedule=dualpipe", "train.micro_batch=1"], 2),
    "dp2_tp2_ep2": (["parallel.dp=2", "parallel.tp=2", "parallel.ep=2"], 4),
    "tp4_kv_replicated": (["parallel.tp=4"], 4),  # 2 kv heads on 4 ranks: wqkv's k, v sections replicated
}
FOUR_RANKS = {"dp2_tp2_ep2", "tp4_kv_replicated"}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if k in FOUR_RANKS else [])
                                    for k in LAYOUTS])
def test_muon_layouts_train_like_one_process(layout):
    extra, world = LAYOUTS[layout]
    ref = reference(RECIPE, BASE + [o for o in extra if o == "train.micro_batch=1"])
    got = run_layout(RECIPE, BASE + extra, world=world)
    assert_equivalent(ref, got, rtol=1e-5)
    assert got.losses[-1] < got.losses[0] - 0.5


def test_muon_resumes_exactly_and_reshards_to_tp2(tmp_path):
    """dp2: checkpoint at step 3, resume to 6 equal bit for bit to the uninterrupted run (Muon's momentum
    and AdamW's moments travel in the checkpoint); the same checkpoint resumed under tp2 (momentum cut
    into TP slices, matrices on other owners) continues within 1e-5."""
    ckpt_dir = tmp_path / "ckpt"
    common = MUON + ["train.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=2"]
    full, resumed = interrupted_and_resumed(RECIPE, common + ["parallel.dp=2"], [], world=2, ckpt=ckpt_dir)
    assert resumed.losses == full.losses[3:]
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())
    shutil.rmtree(ckpt_dir / "step_00000006")
    on_tp = run_layout(RECIPE, common + ["parallel.tp=2", "train.steps=6", "checkpoint.interval=3",
                                         f"checkpoint.dir={ckpt_dir}", "checkpoint.resume=true"], world=2)
    assert on_tp.losses == pytest.approx(full.losses[3:], rel=1e-5)
    report = compare(full, LayoutResult(full.losses[:3] + on_tp.losses, on_tp.grad_norms, on_tp.final_state, [], [], 2))
    assert report.max_param_rel < 1e-5, report


def test_tp_gather_bytes_are_counted_partition_the_matrices_and_equal_the_plan():
    """dp 2 x tp 2: Muon's tp all-gather bytes per step, counted by moe_lc.parallel.comm, are AdamW's (the
    activations' SP gathers) plus (tp - 1) x the fp32 bytes of each matrix slice the rank owns (a slice
    whose Shard cuts a matrix dim); the two dp ranks' owners split the matrices between them (together:
    every slice of the planner's placement table once), tp peers own the same ones, and the planner's
    figures for dp rank 0 are its counted ones, every key."""
    from tools.planner.plan import plan
    from tools.planner.layout import rank_layouts

    steps = ["train.steps=2", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
             "train.warmup_steps=1", "parallel.dp=2", "parallel.tp=2", "parallel.zero_bucket_mb=0.05"]
    muon = run_layout(RECIPE, MUON + steps, world=4)
    adamw = run_layout(RECIPE, ["train.lr=0.01"] + steps, world=4)
    cfg = load_config(RECIPE, MUON + steps, world_size=4)
    rule = recipe_rule(cfg)
    slices = sum(p.numel() for name, p, place in rank_layouts(cfg, 4)[0].model.named_parameters()
                 if rule.whole(name, p.shape) and any(s.group == "tp" and s.dim >= p.dim() - 2 for s in place.shards))
    key = "comm/tp/all_gather_bytes"
    extra = [{got[key] - base[key] for got, base in zip(muon.comm_per_rank[r], adamw.comm_per_rank[r])}
             for r in range(4)]
    assert all(len(e) == 1 for e in extra), extra  # the same every step
    (dp0_tp0,), (dp0_tp1,), (dp1_tp0,), (dp1_tp1,) = extra
    assert dp0_tp0 == dp0_tp1 > 0 and dp1_tp0 == dp1_tp1 > 0
    assert dp0_tp0 + dp1_tp0 == (2 - 1) * 4 * slices
    want = plan(cfg, 4).ranks[0].comm_per_step()
    assert all(step == want for r in (0, 1) for step in muon.comm_per_rank[r]), (want, muon.comm_per_rank[0])
