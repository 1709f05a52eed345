"""One optimizer step's pieces without a Trainer: `forward_backward` on a plain model, the step's
`ForwardStats` (MTP and aux losses come back from the forwards; nothing is kept on the modules), and
the MTP and router metrics made from them."""

import copy

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.mtp import mtp_targets
from moe_lc.model.transformer import build_model
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.job.step import balance_routers, forward_backward, mtp_losses
from tests.harness import RECIPES

MTP_WEIGHT = 0.5


def _tiny_model():
    overrides = ["model.n_layers=2", "model.attn_backend=reference", "model.mtp.depth=1",
                 f"model.mtp.loss_weight={MTP_WEIGHT}", "model.moe.aux_loss_weight=0.01"]
    return build_model(load_config(RECIPES / "debug_cpu.toml", overrides).model, seed=0).train()


def _batch(tokens: torch.Tensor) -> dict:
    """What `prepare_batch` gives a single-device rank: tokens (B, S+1)."""
    return {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": None,
            "positions": torch.arange(tokens.shape[1] - 1), "mtp": mtp_targets(tokens, None, 1)}


def _single_rank() -> ParallelDims:
    dims = ParallelDims(pp=1, dp=1, cp=1, tp=1, ep=1, world=1, ranks_per_node=1)
    dims.init_groups()
    return dims


def test_forward_backward_and_the_step_metrics_without_a_trainer():
    model = _tiny_model()
    ref = copy.deepcopy(model)
    batches = [_batch(torch.randint(0, 259, (2, 17))) for _ in range(2)]
    n_tokens = 2 * 2 * 16
    loss_sum, stats = forward_backward(model, None, batches, 1.0 / n_tokens, n_tokens)

    # the same by hand: one summed objective, divided by the step's tokens
    objective = [ref(b["inputs"], positions=b["positions"], labels=b["labels"], mtp=b["mtp"]) for b in batches]
    (sum(objective) / n_tokens).backward()
    assert loss_sum.dtype == torch.float64 and not loss_sum.requires_grad
    torch.testing.assert_close(loss_sum, sum(objective).detach().double())
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)

    # the MTP sums: what the MTP term adds to the objective, per depth
    with torch.no_grad():
        main = [ref(b["inputs"], positions=b["positions"], labels=b["labels"]) for b in batches]
    mtp_sum = (sum(objective) - sum(main)).detach().double() / MTP_WEIGHT
    assert stats.mtp_loss_sums.shape == (1,)
    torch.testing.assert_close(stats.mtp_loss_sums[0], mtp_sum)
    dims = _single_rank()
    metrics, weighted = mtp_losses(stats.mtp_loss_sums, 1, MTP_WEIGHT, dims, n_tokens, torch.device("cpu"))
    assert metrics["mtp_loss/depth1"] == (stats.mtp_loss_sums[0] / n_tokens).item()
    assert weighted == (MTP_WEIGHT * stats.mtp_loss_sums[0]).item()

    # aux losses: one per MoE layer (the MTP module's block included), none kept on the modules
    moes = model.moe_layers()
    assert set(moes) == {"1", "mtp0"} and set(stats.aux_losses) == set(moes.values())
    assert not hasattr(model, "mtp_loss_sums") and not any(hasattr(m, "last_aux_loss") for m in moes.values())

    # the aux-loss metric: the step's sum of every forward's term times the micro-batch share (1 here)
    per_forward = {moe: [] for moe in moes.values()}
    for b in batches:
        seen = ForwardStats()
        ref(b["inputs"], positions=b["positions"], labels=b["labels"], mtp=b["mtp"], stats=seen)
        for moe_ref, moe in zip(ref.moe_layers().values(), moes.values()):
            per_forward[moe].append(seen.aux_losses[moe_ref].item())
    biases = {name: moe.router.expert_bias.clone() for name, moe in moes.items()}
    router_metrics = balance_routers(model, stats, dims)
    for name, moe in moes.items():
        assert router_metrics[f"moe/aux_loss/layer{name}"] == pytest.approx(sum(per_forward[moe]), rel=1e-6)
        assert sum(router_metrics[f"moe/load/layer{name}"]) == n_tokens * moe.router.topk  # each copy once
        load = stats.routing[moe.router]["loads"]  # the bias update took the step's loads
        assert torch.equal(moe.router.expert_bias - biases[name],
                           moe.router.bias_update_speed * torch.sign(load.mean() - load))
    assert router_metrics["moe/imbalance_max"] == max(router_metrics[f"moe/imbalance/layer{n}"] for n in moes)
