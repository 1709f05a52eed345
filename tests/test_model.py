"""Model pieces: RoPE/YaRN against the published formula, the one Linear, counters vs meta models."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_lc.config import ModelConfig, load_config
from moe_lc.model.counting import param_counts, train_flops_per_token
from moe_lc.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq, yarn_get_mscale
from moe_lc.model.transformer import Transformer, build_model
from moe_lc.ops.linear import GroupedLinear, Linear, WeightGradStore

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


# -- RoPE / YaRN --------------------------------------------------------------------------------------

def yarn_reference(d, b, s, L, beta_fast, beta_slow):
    """The YaRN reference code (jquesnelle/yarn `find_correction_range` + `linear_ramp_mask`, copied by
    DeepSeek-V3's inference code), transcribed in float64: a ramp linear over the pair index between
    floor / ceil of the correction dims."""
    def correction_dim(rotations):
        return (d * math.log(L / (rotations * 2 * math.pi))) / (2 * math.log(b))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    out = []
    for i in range(d // 2):
        theta = b ** (-2 * i / d)
        ramp = min(max((i - low) / max(high - low, 0.001), 0.0), 1.0)  # 0 below low (kept), 1 above high
        out.append(theta / s * ramp + theta * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("d, b, s, L", [(64, 10000.0, 32.0, 4096), (128, 10000.0, 40.0, 4096), (64, 500000.0, 8.0, 8192)])
def test_yarn_frequencies_follow_the_reference_code(d, b, s, L):
    got = rope_inv_freq(d, b, "yarn", s, L, 32.0, 1.0)
    assert got.dtype == torch.float32  # the reference code's dtype: a checkpoint trained with it sees these
    torch.testing.assert_close(got.double(), yarn_reference(d, b, s, L, 32.0, 1.0), rtol=1e-6, atol=0)
    plain = rope_inv_freq(d, b)
    assert got[0] == plain[0]  # highest frequency untouched
    torch.testing.assert_close(got[-1], plain[-1] / s)  # lowest frequency interpolated by 1/s


def test_yarn_differs_from_a_ramp_linear_in_rotations():
    """The reading of the YaRN paper this file once implemented (gamma linear in r = L / lambda) moves
    many frequencies of a 4K -> 128K model; the reference code's are what checkpoints are trained with."""
    d, b, s, L = 128, 10000.0, 32.0, 4096
    i = torch.arange(d // 2, dtype=torch.float64)
    theta = b ** (-2 * i / d)
    gamma = ((L * theta / (2 * math.pi) - 1.0) / (32.0 - 1.0)).clamp(0, 1)
    linear_in_r = (1 - gamma) * theta / s + gamma * theta
    rel = ((rope_inv_freq(d, b, "yarn", s, L).double() - linear_in_r) / linear_in_r).abs()
    assert (rel > 1e-3).sum() >= 20 and rel.max() > 0.5


def test_yarn_attention_factor():
    assert yarn_get_mscale(1.0) == 1.0
    assert yarn_get_mscale(40.0) == pytest.approx(0.1 * math.log(40.0) + 1)
    assert yarn_get_mscale(40.0, 0.707) == pytest.approx(0.0707 * math.log(40.0) + 1)
    # transformers' convention: the ratio when both are set, else m(s, 1); cos and sin carry it
    rope = RotaryEmbedding(16, 10000.0, "yarn", 4.0, 64, mscale=1.0, mscale_all_dim=0.8)
    assert rope.attention_factor == pytest.approx(yarn_get_mscale(4.0, 1.0) / yarn_get_mscale(4.0, 0.8))
    assert RotaryEmbedding(16, 10000.0, "yarn", 4.0, 64).attention_factor == pytest.approx(yarn_get_mscale(4.0))
    cos, sin = rope(torch.arange(5))
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, rope.attention_factor ** 2))


def test_rope_is_a_rotation_and_relative():
    rope = RotaryEmbedding(16, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        ci, si = rope(torch.tensor([i]))
        cj, sj = rope(torch.tensor([j]))
        return (apply_rope(q, ci, si) * apply_rope(k, cj, sj)).sum()

    c, s = rope(torch.tensor([5]))
    assert torch.allclose(apply_rope(q, c, s).norm(), q.norm())
    assert torch.allclose(score(7, 3), score(104, 100), atol=1e-5)  # depends on i - j only


# -- the one Linear -----------------------------------------------------------------------------------

def test_linear_backward_matches_autograd_and_deferral_gives_same_grad():
    torch.manual_seed(0)
    lin = Linear(6, 5, bias=True)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(3, 4, 6, requires_grad=True)
    dy = torch.randn(3, 4, 5)
    lin(x).backward(dy)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = lin.weight.detach().clone().requires_grad_()
    (torch.nn.functional.linear(x_ref, w_ref, lin.bias.detach())).backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(lin.weight.grad, w_ref.grad)
    torch.testing.assert_close(lin.bias.grad, dy.sum((0, 1)))

    # deferred: B gives dx only, W later gives the same dW and fires the post-accumulate hooks
    fired = []
    lin.weight.grad = None
    # autograd fires the hook at B time too, with no gradient (B returned None for the weight)
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad) if p.grad is not None else None)
    lin.wgrad_store = WeightGradStore()
    x.grad = None
    with lin.wgrad_store.deferring():
        lin(x).backward(dy)
    assert lin.weight.grad is None and len(lin.wgrad_store) == 1
    torch.testing.assert_close(x.grad, x_ref.grad)
    lin.wgrad_store.flush()
    torch.testing.assert_close(lin.weight.grad, w_ref.grad)
    assert len(fired) == 1 and len(lin.wgrad_store) == 0


def test_linear_casts_weight_to_input_dtype():
    lin = Linear(8, 4).to(torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(2, 8)
    y = lin(x)  # fp32 input: fp32 compute (the router does this)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert lin.weight.grad.dtype == torch.bfloat16


def test_grouped_linear_matches_per_expert_loop():
    torch.manual_seed(0)
    g = GroupedLinear(4, 6, 5)
    torch.nn.init.normal_(g.weight)
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(9, 6, requires_grad=True)
    dy = torch.randn(9, 5)
    g(x, counts).backward(dy)
    xr = x.detach().clone().requires_grad_()
    wr = g.weight.detach().clone().requires_grad_()
    parts = xr.split(counts.tolist())
    torch.cat([p @ wr[e].t() for e, p in enumerate(parts)]).backward(dy)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(g.weight.grad, wr.grad)
    assert g.weight.grad[1].abs().sum() == 0  # expert without tokens gets a zero gradient


def test_grouped_mm_takes_the_loop_for_a_misaligned_weight_view():
    """A weight viewed out of a flat buffer at an odd offset (as a ZeRO bucket can place it) is refused by
    torch._grouped_mm (16-byte data_ptr); grouped_mm must take the per-expert loop and give the same result."""
    from moe_lc.ops.grouped_gemm import grouped_mm, misalignment, use_grouped_mm

    flat = torch.randn(1 + 3 * 8 * 4)
    w_EKN = flat[1:].view(3, 8, 4)  # data_ptr 4 bytes past an aligned one
    x = torch.randn(7, 8)
    counts = torch.tensor([2, 0, 5])
    assert "16-byte" in misalignment(w_EKN) and not use_grouped_mm(x, w_EKN)
    aligned = w_EKN.clone()
    assert misalignment(aligned) is None and misalignment(aligned.transpose(1, 2)) is None
    expected = torch.cat([x[:2] @ aligned[0], x[2:7] @ aligned[2]])
    torch.testing.assert_close(grouped_mm(x, w_EKN, counts), expected)
    torch.testing.assert_close(grouped_mm(x, aligned, counts), expected)


# -- counters -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.toml")), ids=lambda p: p.name)
def test_param_counter_matches_meta_model(recipe):
    cfg = load_config(recipe).model
    with torch.device("meta"):
        model = Transformer(cfg)
    counts = param_counts(cfg)
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert counts["mtp"] == mtp
    assert counts["total"] == sum(p.numel() for p in model.parameters()) - mtp
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and not n.startswith("mtp."))
    assert counts["routed_experts"] == routed
    embedding = model.embed.weight.numel()
    assert counts["activated"] == counts["total"] - embedding - routed + routed * cfg.moe.topk // max(cfg.moe.n_routed_experts, 1)


def test_flops_counter_matches_traced_matmuls():
    """Count forward matmul FLOPs of the debug model with torch's FLOP counter; x3 for training."""
    from torch.utils import flop_counter

    if torch.ops.aten._grouped_mm.default not in flop_counter.flop_registry:
        @flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)
        def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs):  # (T, K) x (E, K, N): each row meets one expert
            return 2 * a_shape[0] * a_shape[1] * b_shape[-1]

    cfg = load_config(RECIPES / "debug_cpu.toml", ["model.attn_backend=reference"]).model
    model = build_model(cfg, seed=0)
    S = 64
    with flop_counter.FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 259, (2, S)))
    counts = counter.get_flop_counts()["Global"]
    assert torch.ops.aten._grouped_mm in counts  # the experts really ran as grouped GEMMs
    traced = counter.get_total_flops() / (2 * S)
    # The reference backend computes the full S x S scores (no causal skipping): add the masked half.
    expected = train_flops_per_token(cfg, S) / 3
    masked_half = cfg.n_layers * cfg.n_heads * (S / 2) * 2 * (2 * cfg.head_size)
    assert traced == pytest.approx(expected + masked_half, rel=1e-9)


def test_build_model_is_seeded_and_dtype_aware():
    cfg = ModelConfig()
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=1)
    c = build_model(cfg, seed=2, dtype=torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight.float())
    assert all(p.dtype == torch.bfloat16 for p in c.parameters())
    assert c.layers["1"].ffn.router.expert_bias.dtype == torch.float32  # buffers keep their dtype


def test_deferred_weight_used_twice_accumulates_once():
    """A weight used twice in one backward (the output head shared with MTP): autograd accumulates
    once, and so must the W pass, or a ZeRO bucket would count two arrivals and launch early."""
    lin = Linear(4, 3)
    torch.nn.init.normal_(lin.weight)
    fired = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()) if p.grad is not None else None)
    lin.wgrad_store = WeightGradStore()
    x1, x2 = torch.randn(5, 4), torch.randn(2, 4)
    with lin.wgrad_store.deferring():
        (lin(x1).sum() + 2 * lin(x2).sum()).backward()
    lin.wgrad_store.flush()
    assert len(fired) == 1
    torch.testing.assert_close(fired[0], torch.ones(5, 3).t() @ x1 + 2 * torch.ones(2, 3).t() @ x2)


def test_16bit_cross_entropy_keeps_the_logits_not_an_fp32_log_softmax():
    """CrossEntropySum on bf16 logits: the loss of F.cross_entropy on their fp32 values (within fp32
    rounding), gradients within bf16 rounding, and what backward keeps is the logits themselves and one
    fp32 log-sum-exp per row (2V + 4 bytes a token, not 4V), in row chunks across the ROWS boundary."""
    from tools.planner.activation_memory import measure_saved_bytes

    from moe_lc.model.transformer import CrossEntropy16, CrossEntropySum

    torch.manual_seed(0)
    T, V = CrossEntropy16.ROWS + 300, 320
    logits = (torch.randn(1, T, V) * 3).to(torch.bfloat16).requires_grad_()
    labels, mask = torch.randint(0, V, (1, T)), (torch.rand(1, T) > 0.3).float()
    ref_logits = logits.detach().float().requires_grad_()
    ref = (F.cross_entropy(ref_logits[0], labels[0], reduction="none") * mask[0]).sum()
    loss = CrossEntropySum()(logits, labels, mask)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    (loss * 0.5).backward()
    (ref * 0.5).backward()
    assert logits.grad.dtype == torch.bfloat16
    assert (logits.grad.float() - ref_logits.grad).abs().max() <= 2 ** -9  # bf16 rounding of values <= 0.5
    module = torch.nn.Linear(1, 1)  # measure_saved_bytes wants a model; the loss is all that runs
    module.layers = torch.nn.ModuleDict()
    saved = measure_saved_bytes(module, lambda: CrossEntropySum()(logits, labels, mask))
    assert sum(saved.values()) == logits.nbytes + T * 4 + labels.nbytes + mask.nbytes
