"""Multi-head latent attention: shapes, a naive per-head reference, the absorbed (inference) form,
and DeepSeek's published parameter counts."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_lc.config import RopeConfig, model_config, load_config
from moe_lc.model.counting import param_counts
from moe_lc.model.mla import MLAttention
from moe_lc.model.rope import RotaryEmbedding, apply_rope, yarn_get_mscale

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def mla_cfg(**kw):
    base = dict(dim=64, n_heads=4, n_kv_heads=4, attention="mla", q_lora_rank=48, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, attn_backend="reference")
    base.update(kw)
    return model_config(**base)


def init(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0) + (0 if p.dim() > 1 else 1.0)
    return module


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def naive_mla(m: MLAttention, x, cos, sin):
    """Straightforward per-head loops with explicit softmax: the definition of MLA."""
    B, S, _ = x.shape
    H, Dn, Dr, Dv = m.n_heads, m.nope_dim, m.rope_dim, m.v_dim
    a = x @ m.wa.weight.t()
    if m.q_lora_rank:
        c_q, c_kv, k_r = a.split([m.q_lora_rank, m.kv_lora_rank, Dr], -1)
        q = rms(c_q, m.q_norm.weight) @ m.wq_b.weight.t()
    else:
        c_kv, k_r = a.split([m.kv_lora_rank, Dr], -1)
        q = x @ m.wq.weight.t()
    kv = rms(c_kv, m.kv_norm.weight) @ m.wkv_b.weight.t()
    k_r = apply_rope(k_r.view(B, S, 1, Dr), cos, sin)[:, :, 0]
    outs = []
    for h in range(H):
        qh = q.view(B, S, H, Dn + Dr)[:, :, h]
        qh = torch.cat([qh[..., :Dn], apply_rope(qh[..., Dn:].unsqueeze(2), cos, sin)[:, :, 0]], -1)
        kvh = kv.view(B, S, H, Dn + Dv)[:, :, h]
        kh = torch.cat([kvh[..., :Dn], k_r], -1)
        vh = kvh[..., Dn:]
        scores = qh @ kh.transpose(1, 2) * m.softmax_scale
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(scores, -1) @ vh)
    return torch.cat(outs, -1) @ m.wo.weight.t()


@pytest.mark.parametrize("q_lora_rank", [48, 0])
def test_mla_matches_naive_reference_forward_and_backward(q_lora_rank):
    torch.manual_seed(0)
    cfg = mla_cfg(q_lora_rank=q_lora_rank)
    m = init(MLAttention(cfg))
    rope = RotaryEmbedding(cfg.mla.qk_rope_head_dim, 10000.0)
    cos, sin = rope(torch.arange(12))
    x = torch.randn(2, 12, cfg.dim, requires_grad=True)
    out = m(x, cos, sin)
    assert out.shape == (2, 12, cfg.dim)
    xr = x.detach().clone().requires_grad_()
    ref = naive_mla(m, xr, cos, sin)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(m.parameters()), dy)
    ref_grads = torch.autograd.grad(ref, [xr] + list(m.parameters()), dy)
    for g, r in zip(grads, ref_grads):  # fp32 sums in another order: compare norm-wise
        assert (g - r).norm() / r.norm() < 1e-5


def test_decompressed_equals_absorbed_latent_form():
    """DeepSeek's inference form: fold W_UK into the query and W_UV into the output so attention
    runs over the kv latent (Ckv + Dr wide) instead of per-head keys/values."""
    torch.manual_seed(0)
    cfg = mla_cfg()
    m = init(MLAttention(cfg))
    S, H, Dn, Dr, Dv, C = 10, cfg.n_heads, 16, 8, 24, cfg.mla.kv_lora_rank
    cos, sin = RotaryEmbedding(Dr, 10000.0)(torch.arange(S))
    x = torch.randn(1, S, cfg.dim)
    with torch.no_grad():
        want = m(x, cos, sin)
        a = x @ m.wa.weight.t()
        c_q, c_kv, k_r = a.split([cfg.mla.q_lora_rank, C, Dr], -1)
        q = (rms(c_q, m.q_norm.weight) @ m.wq_b.weight.t()).view(1, S, H, Dn + Dr)
        q_nope, q_r = q[..., :Dn], apply_rope(q[..., Dn:], cos, sin)
        latent = rms(c_kv, m.kv_norm.weight)  # (1, S, C): the only thing an inference cache keeps
        k_r = apply_rope(k_r.view(1, S, 1, Dr), cos, sin)[:, :, 0]
        w_kv = m.wkv_b.weight.view(H, Dn + Dv, C)
        w_uk, w_uv = w_kv[:, :Dn], w_kv[:, Dn:]  # (H, Dn, C), (H, Dv, C)
        q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_uk)  # absorb W_UK into the query
        scores = (torch.einsum("bshc,btc->bhst", q_latent, latent)
                  + torch.einsum("bshr,btr->bhst", q_r, k_r)) * m.softmax_scale
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        ctx_latent = torch.einsum("bhst,btc->bshc", scores.softmax(-1), latent)
        out = torch.einsum("bshc,hvc->bshv", ctx_latent, w_uv).reshape(1, S, H * Dv) @ m.wo.weight.t()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_softmax_scale_includes_yarn_mscale_all_dim_squared():
    cfg = mla_cfg(rope=RopeConfig(scaling="yarn", factor=40.0, mscale_all_dim=0.707))
    m = MLAttention(cfg)
    assert m.softmax_scale == pytest.approx((16 + 8) ** -0.5 * yarn_get_mscale(40.0, 0.707) ** 2)
    assert MLAttention(mla_cfg(rope_scaling="yarn", rope_factor=40.0)).softmax_scale == pytest.approx(24 ** -0.5)
    assert MLAttention(mla_cfg()).softmax_scale == pytest.approx(24 ** -0.5)


def deepseek(**kw):
    base = dict(attention="mla", n_kv_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                kv_lora_rank=512, score_func="sigmoid")
    base.update(kw)
    return model_config(**base)


@pytest.mark.parametrize("name, cfg, total, activated, tol", [
    ("DeepSeek-V3", None, 671e9, 37e9, 0.0105),
    ("DeepSeek-V2", deepseek(vocab_size=102400, dim=5120, n_layers=60, n_heads=128, ffn_dim=12288, n_dense_layers=1,
                             n_routed_experts=160, n_shared_experts=2, moe_ffn_dim=1536, topk=6, n_groups=8,
                             topk_groups=3, q_lora_rank=1536), 236e9, 21e9, 0.01),
    ("DeepSeek-V2-Lite", deepseek(vocab_size=102400, dim=2048, n_layers=27, n_heads=16, ffn_dim=10944,
                                  n_dense_layers=1, n_routed_experts=64, n_shared_experts=2, moe_ffn_dim=1408, topk=6,
                                  n_groups=1, topk_groups=1, q_lora_rank=0), 15.7e9, 2.4e9, 0.025),
])
def test_parameter_counts_match_published_figures(name, cfg, total, activated, tol):
    """Published totals within 1%; activated (embedding lookup not counted, DeepSeek's convention)
    within the rounding of the published figure: V3 gives 36.63B for "37B" (1.0% under),
    V2 20.85B for "21B", V2-Lite 2.45B for "2.4B"."""
    cfg = cfg or load_config(RECIPES / "deepseek_v3_671b.toml").model
    counts = param_counts(cfg)
    assert abs(counts["total"] - total) / total < 0.01, counts["total"]
    assert abs(counts["activated"] - activated) / activated < tol, counts["activated"]


MLA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=24"]
TRAIN = ["train.steps=5", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.warmup_steps=2"]


@pytest.mark.parametrize("layout, world", [(["parallel.tp=2"], 2), (["parallel.cp=2"], 2),
                                           (["parallel.cp=2", "parallel.tp=2"], 4)])
def test_mla_parallel_layouts_match_one_device(layout, world):
    """MLA, whose K and V head dims differ (the open problem of MLA under CP elsewhere), under TP
    (heads split, one latent gather), the zig-zag ring, and both together."""
    from tests.harness import assert_equivalent, reference, run_layout

    overrides = TRAIN + MLA[:-1] + ["model.mla.v_head_dim=20"]  # Dqk = 24, Dv = 20
    ref = reference(RECIPES / "debug_cpu.toml", overrides)
    got = run_layout(RECIPES / "debug_cpu.toml", overrides + layout, world=world)
    report = assert_equivalent(ref, got, rtol=1e-5)
    print(f"MLA {layout}: loss {report.max_loss_rel:.1e} params {report.max_param_rel:.1e}")


def test_mla_and_mtp_under_tp():
    from tests.harness import assert_equivalent, reference, run_layout

    overrides = TRAIN + MLA + ["model.mtp.depth=1"]
    ref = reference(RECIPES / "debug_cpu.toml", overrides)
    got = run_layout(RECIPES / "debug_cpu.toml", overrides + ["parallel.tp=2"], world=2)
    assert_equivalent(ref, got, rtol=1e-5)


LATENT_LAYOUTS = {
    "cp4": (["parallel.cp=4"], 4),
    "cp2-mla_up-attention": (["parallel.cp=2", "recompute.policy=selective",
                              "recompute.selective=['norm','attention','mla_up']"], 2),
    "pp2-dualpipe-cp2": (["parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.cp=2", "train.micro_batch=2"], 4),
}


@pytest.mark.parametrize("case", [pytest.param(k, marks=pytest.mark.slow) if k == "pp2-dualpipe-cp2" else k
                                  for k in LATENT_LAYOUTS])
def test_mla_latent_ring_matches_one_device(case):
    """The latent ring (parallel.mla_ring = latent, the default; cp2 and cp2 x tp2 are in the test
    above) on more ranks, under selective recomputation of the up-projections, and inside DualPipe."""
    from tests.harness import assert_equivalent, reference, run_layout

    layout, world = LATENT_LAYOUTS[case]
    overrides = TRAIN + MLA[:-1] + ["model.mla.v_head_dim=16"]
    extra = [o for o in layout if o.startswith("train.")]
    ref = reference(RECIPES / "debug_cpu.toml", overrides + extra)
    got = run_layout(RECIPES / "debug_cpu.toml", overrides + layout, world=world)
    assert_equivalent(ref, got, rtol=1e-5)


def test_mla_latent_ring_under_fp8_tracks_one_device():
    """FP8 GEMMs (the latent ring up-projects with wkv_b's own FP8 GEMMs) with every FP8 cache item on
    cp2: losses within the fp8 tolerance of one device running the same recipe."""
    from tests.harness import TOLERANCE, reference, run_layout

    overrides = TRAIN + MLA[:-1] + ["model.mla.v_head_dim=16", "precision.recipe=fp8", "precision.fp8_backend=emulate",
                                    "precision.fp8_cache=['linear','swiglu','attn_out']"]
    ref = reference(RECIPES / "debug_cpu.toml", overrides)
    got = run_layout(RECIPES / "debug_cpu.toml", overrides + ["parallel.cp=2"], world=2)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses))
    assert worst <= TOLERANCE["fp8"], (got.losses, ref.losses)


def _ring_bytes_per_layer(values_per_token: int, tokens: int, cp: int) -> int:
    """One attention call's ring bytes on one rank, fp32 (moe_lc/parallel/cp/ring.py): forward
    (cp-1) blocks, backward (cp-1) blocks and cp fp32 gradient accumulators."""
    numel = tokens * values_per_token
    return (cp - 1) * numel * 4 + (cp - 1) * numel * 4 + cp * numel * 4


def test_mla_latent_ring_moves_the_latent_bytes_the_formula_gives():
    """Debug MLA dims, 4 heads x (Dqk 24 + Dv 16) = 160 values per token expanded, 32 + 8 = 40 latent:
    comm.py's counted cp bytes equal the formula and the planner's figure for both rings, 4x apart."""
    from tests.harness import run_layout
    from tools.planner.plan import plan

    cfg_over = TRAIN + MLA[:-1] + ["model.mla.v_head_dim=16", "parallel.cp=2"]
    cfg = load_config(RECIPES / "debug_cpu.toml", cfg_over, world_size=2)
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch * t.seq_len // 2
    counted = {}
    for ring, per_token in (("latent", 32 + 8), ("expanded", 4 * (24 + 16))):
        got = run_layout(RECIPES / "debug_cpu.toml", cfg_over + [f"parallel.mla_ring={ring}"], world=2)
        want = t.microbatches(1) * m.n_layers * _ring_bytes_per_layer(per_token, tokens, 2)
        counted[ring] = {step["comm/cp/send_bytes"] for rank in got.comm_per_rank for step in rank}
        assert counted[ring] == {want}, (ring, counted[ring], want)
        ring_cfg = load_config(RECIPES / "debug_cpu.toml", cfg_over + [f"parallel.mla_ring={ring}"], world_size=2)
        assert plan(ring_cfg, 2).ranks[0].comm_per_step()["comm/cp/send_bytes"] == want, ring
    assert counted["expanded"].pop() == 4 * counted["latent"].pop()


def test_latent_ring_codec_gradients_match_autograd_in_row_chunks():
    """The latent ring's up-projection backward, formed 128 rows at a time (as at 128K, 1024), equals
    autograd through its forward (fp32)."""
    from moe_lc.ops.linear import PLAIN
    from moe_lc.parallel.cp.latent_ring import LatentBlocks

    torch.manual_seed(0)
    H, Dn, Dv, Dr, C, B, S = 3, 8, 6, 4, 16, 2, 300
    c = torch.randn(B, S, C, requires_grad=True)
    k_r = torch.randn(B, S, Dr, requires_grad=True)
    w = torch.randn(H * (Dn + Dv), C, requires_grad=True)
    codec = LatentBlocks(PLAIN, H, Dn, Dv)
    cols = slice(0, S)
    k, v = codec.expand((c, k_r), (w,), cols)
    dk, dv = torch.randn_like(k), torch.randn_like(v)
    want = torch.autograd.grad((k, v), (c, k_r, w), (dk, dv))
    codec.ROWS = 128  # 600 rows: four whole chunks and a partial one
    (dc, dkr), (dw,) = codec.grads(dk, dv, (c.detach(), k_r.detach()), (w.detach(),), cols)
    for got, ref in zip((dc, dkr, dw), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
