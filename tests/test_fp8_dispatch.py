"""FP8 dispatch (precision.fp8_dispatch, DeepSeek-V3 section 3.3): token rows cross the EP all-to-all
in FP8 with 1 x 128-tile scales; at ep = 1 they are rounded the same way, so every layout computes the
same numbers, and the dispatch's bytes fall by the FP8 ratio."""

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.ops.fp8_storage import FP8Rounded, fp8_row_bytes, pack_fp8_rows, unpack_fp8_rows
from tests.harness import RECIPES, TOLERANCE, assert_equivalent, compare, reference, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=4", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=1", "train.warmup_steps=2"]
FP8 = ["precision.fp8_dispatch=true"]
A2A = "comm/ep/all_to_all_bytes"


def test_packed_rows_round_like_fp8_tiles_and_carry_their_scales():
    x = torch.randn(6, 300, dtype=torch.bfloat16) * torch.logspace(-3, 3, 6).unsqueeze(1).to(torch.bfloat16)
    packed = pack_fp8_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (6, fp8_row_bytes(300)) == (6, 300 + 4 * 3)
    back = unpack_fp8_rows(packed, 300, torch.bfloat16)
    assert torch.equal(back, FP8Rounded.apply(x))  # the wire and the ep = 1 rounding agree bit for bit
    rel = ((back.float() - x.float()).abs() / x.float().abs().amax(dim=1, keepdim=True)).max()
    assert 0 < rel <= 2 ** -4  # e4m3: 3 mantissa bits, scaled per row tile (a rounding, not a copy)
    grad = torch.randn_like(x)
    x.requires_grad_(True)
    FP8Rounded.apply(x).backward(grad)
    assert torch.equal(x.grad, grad)  # straight through


def test_fp8_dispatch_trains_like_one_device_and_sends_fp8_rows():
    """fp32, ep2 = dp2 with fp8_dispatch against one process with it: losses within 1e-5, parameters within
    1e-3 (as under DualPipe below: the dp sum's order leaves a 1e-7 difference, which can round a token
    value at an FP8 boundary the other way; measured 1.14e-5 on an AVX2 AMD EPYC, under 1e-5 elsewhere).
    With one MoE layer (whose routing in step 1 FP8 cannot change), the dispatch rows cost D + 4 D/128
    bytes, not 4 D."""
    ref = reference(RECIPE, BASE + FP8)
    got = run_layout(RECIPE, BASE + FP8 + ["parallel.ep=2", "parallel.dp=2"], world=2)
    report = compare(ref, got)
    assert report.max_loss_rel <= 1e-5 and report.max_param_rel <= 1e-3, report
    one_moe = BASE + ["parallel.ep=2", "parallel.dp=2", "train.steps=1", "model.n_layers=2"]
    on, off = run_layout(RECIPE, one_moe + FP8, world=2), run_layout(RECIPE, one_moe, world=2)
    D, c = load_config(RECIPE).model.dim, 4
    # over both ranks, the four all-to-alls of a MoE layer (dispatch, combine, both backward) move the
    # same rows (a rank's combine returns what it received, not what it sent)
    sent_on, sent_off = (sum(r.comm_per_rank[rank][0][A2A] for rank in range(2)) for r in (on, off))
    assert sent_on * 4 * D * c == sent_off * (fp8_row_bytes(D) + 3 * D * c)
    assert sent_on < sent_off


def test_fp8_dispatch_moves_bf16_losses_within_the_fp8_tolerance():
    bf16 = BASE + ["precision.recipe=bf16"]
    plain, fp8 = reference(RECIPE, bf16), reference(RECIPE, bf16 + FP8)
    rel = max(abs(a - b) / abs(a) for a, b in zip(plain.losses, fp8.losses))
    assert 0 < rel <= TOLERANCE["fp8"], (plain.losses, fp8.losses)


def test_fp8_dispatch_composes_with_dualpipe_ep_and_dp():
    """pp2 DualPipe x dp2 with ep2 folded in (4 ranks), FP8 dispatch, against one process (fp32). Losses
    within 1e-5; parameters within 1e-3, not 1e-5: once the pipeline's reordered gradient sums leave
    a 1e-7 difference in the weights, a token value at an FP8 rounding boundary can round the other
    way (one FP8 step, ~6% of that element), and that expert's update follows it (measured 8.8e-5)."""
    ref = reference(RECIPE, BASE + FP8)
    got = run_layout(RECIPE, BASE + FP8 + ["parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.ep=2",
                                           "parallel.dp=2"], world=4)
    report = assert_equivalent(ref, got, rtol=1e-3)
    assert report.max_loss_rel <= 1e-5


def test_fp8_dispatch_is_refused_where_it_is_not_built():
    with pytest.raises(ConfigError, match="precision.fp8_dispatch with parallel.expert_dispatch='hierarchical'"):
        load_config(RECIPE, FP8 + ["parallel.expert_dispatch=hierarchical"])
