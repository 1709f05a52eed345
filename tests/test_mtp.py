"""Multi-token prediction: targets, the loss terms on a hand-built case, causality, and training."""

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model.mtp import mtp_targets
from moe_lc.model.transformer import build_model
from moe_lc.train import run
from tests.harness import RECIPES, assert_equivalent, reference, run_layout

RECIPE = RECIPES / "debug_cpu.toml"


def test_targets_on_a_hand_built_sequence():
    # tokens a b c d e: inputs a b c d, labels b c d e
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    t = mtp_targets(tokens, None, depth=2)
    # depth 1 at position i: embeds t_(i+1), predicts t_(i+2)
    assert t["inputs"][0, 0].tolist() == [11, 12, 13, 14]
    assert t["labels"][0, 0].tolist() == [12, 13, 14, 0] and t["mask"][0, 0].tolist() == [1, 1, 1, 0]
    # depth 2: embeds t_(i+2), predicts t_(i+3)
    assert t["inputs"][0, 1].tolist() == [12, 13, 14, 0]
    assert t["labels"][0, 1].tolist() == [13, 14, 0, 0] and t["mask"][0, 1].tolist() == [1, 1, 0, 0]
    # a loss mask on the main targets carries over to the positions that predict the same tokens
    masked = mtp_targets(tokens, torch.tensor([[1.0, 0.0, 1.0, 1.0]]), depth=1)
    assert masked["mask"][0, 0].tolist() == [0, 1, 1, 0]  # position 0 predicts t_2, whose main mask is 0


def tiny(depth=2, **kw):
    overrides = [f"model.mtp.depth={depth}", "model.n_layers=2", "model.attn_backend=reference"]
    overrides += [f"model.{k}={v}" for k, v in kw.items()]
    return build_model(load_config(RECIPE, overrides).model, seed=0)


def test_loss_is_main_plus_weighted_depth_losses():
    torch.manual_seed(0)
    model = tiny(depth=2, **{"mtp.loss_weight": 0.5})
    tokens = torch.randint(0, 259, (2, 9))
    targets = mtp_targets(tokens, None, 2)
    main = model(tokens[:, :-1], labels=tokens[:, 1:])
    total = model(tokens[:, :-1], labels=tokens[:, 1:], mtp=targets)
    # hand computation of each depth through the modules' own pieces
    h = model.norm.__class__  # noqa: F841 (keep the names close to the formula)
    positions = torch.arange(8)
    cos, sin = model.rope(positions)
    trunk = model.embed(tokens[:, :-1])
    for block in model.layers.values():
        trunk = block(trunk, cos, sin)
    expect, h_prev = [], trunk
    for d, module in enumerate(model.mtp):
        emb = model.embed(targets["inputs"][:, d])
        x = module.eh_proj(torch.cat([module.hnorm(h_prev), module.enorm(emb)], -1))
        h_prev = module.block(x, cos, sin)
        logits = model.head(module.norm(h_prev)).float()
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets["labels"][:, d].flatten(), reduction="none")
        expect.append((ce * targets["mask"][:, d].flatten()).sum())
    torch.testing.assert_close(total, main + 0.5 / 2 * (expect[0] + expect[1]))
    assert targets["mask"][:, 0].sum() == 2 * 7 and targets["mask"][:, 1].sum() == 2 * 6


def test_depth_losses_see_no_token_beyond_their_target():
    """Depth d at position i may use tokens up to t_(i+d) and predict t_(i+d+1); changing a later
    token must leave that position's loss unchanged."""
    torch.manual_seed(0)
    model = tiny(depth=1)
    tokens = torch.randint(0, 259, (1, 9))

    def per_position_mtp_loss(tokens):
        targets = mtp_targets(tokens, None, 1)
        cos, sin = model.rope(torch.arange(8))
        h = model.embed(tokens[:, :-1])
        for block in model.layers.values():
            h = block(h, cos, sin)
        m = model.mtp[0]
        h = m(h, model.embed(targets["inputs"][:, 0]), cos, sin)
        logits = model.head(m.norm(h)).float()[0]
        return torch.nn.functional.cross_entropy(logits, targets["labels"][0, 0], reduction="none")

    base = per_position_mtp_loss(tokens)
    changed = tokens.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 259  # t_6: the target of position 4 at depth 1
    after = per_position_mtp_loss(changed)
    torch.testing.assert_close(after[:4], base[:4])  # positions 0..3 only see t_0..t_5
    assert not torch.allclose(after[4], base[4])


def test_mtp_trains_on_the_debug_recipe(tmp_path):
    result = run(load_config(RECIPE, ["model.mtp.depth=1", "train.steps=12", "train.seq_len=64", "train.global_batch=8",
                                      "train.warmup_steps=3", f"train.output_dir={tmp_path}", "train.log_interval=100"]))
    assert result.losses[-1] < 0.8 * result.losses[0]
    import json

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["mtp_loss/depth1"] < rows[0]["mtp_loss/depth1"]
    assert rows[-1]["loss_objective"] > rows[-1]["loss"]  # the objective adds the weighted MTP loss


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_mtp_under_pp2_matches_one_device(schedule):
    base = ["train.steps=3", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2",
            "train.micro_batch=1", "model.mtp.depth=1"]
    ref = reference(RECIPE, base)
    got = run_layout(RECIPE, base + ["parallel.pp=2", f"parallel.pp_schedule={schedule}"], world=2)
    assert_equivalent(ref, got, rtol=1e-5)


def test_mtp_with_1f1b_pipeline_is_refused():
    from moe_lc.config import ConfigError

    with pytest.raises(ConfigError, match="needs pp_schedule 'dualpipe' or 'dualpipev'"):
        load_config(RECIPE, ["model.mtp.depth=1", "parallel.pp=2"], world_size=2)


def test_dualpipe_rank_zero_holds_one_embedding_and_head_for_the_model_and_mtp():
    """DeepSeek-V3 3.2.1: with DualPipe the first and last stages share pipeline rank 0, so the MTP
    module uses the model's embedding and output head: one copy of their parameters (and so of their
    gradients and optimizer state), none on the middle ranks."""
    from tools.planner.layout import rank_layouts

    cfg = load_config(RECIPE, ["model.mtp.depth=1", "parallel.pp=2", "parallel.pp_schedule=dualpipe", "train.micro_batch=1",
                               "model.n_layers=4"], world_size=2)
    rank0 = rank_layouts(cfg, 2)[0]
    names = [name for name, _, _ in rank0.model.named_parameters()]
    shared = [n for n in names if n.split(".")[-2] in ("embed", "head")]
    assert shared == ["embed.weight", "head.weight"]
    assert any(n.startswith("mtp.") for n in names)  # the MTP module is here, without copies of its own
    vocab, dim = cfg.model.vocab_size, cfg.model.dim
    assert sum(p.numel() for _, p, _ in rank0.model.named_parameters() if p.shape == (vocab, dim)) == 2 * vocab * dim
