"""A step's routing counts live in its ForwardStats (moe_lc/model/forward_stats.py), never on the modules:
the routers and dispatchers keep no counter a trainer reads and zeroes, `ForwardStats.routing` is read
only by the step (moe_lc/job/step.py), and a replayed router (full recomputation) books nothing twice."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from moe_lc.config import RecomputeConfig, load_config
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.mtp import mtp_targets
from moe_lc.model.transformer import build_model
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from moe_lc.job.step import forward_backward
from tests.harness import RECIPES

ROOT = Path(__file__).resolve().parents[1]
# what routers and dispatchers kept until issue #45: read and zeroed by the trainer
REMOVED = {"expert_load", "loss_sums", "dropped_load", "_counts"}
OWNER, READERS = "moe_lc/model/forward_stats.py", {"moe_lc/job/step.py"}  # of ForwardStats.routing


def counter_reads(source: str, rel: str) -> list[str]:
    """Attribute uses of a removed counter, a dispatcher's `.counters()`, and of `.routing` outside its owner
    and readers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in REMOVED:
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Attribute) and node.attr == "routing" and rel != OWNER and rel not in READERS:
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "counters":
            found.append(ast.unparse(node))
    return found


def test_the_scan_finds_planted_counter_reads():
    planted = ("loads = torch.stack([m.router.expert_load for m in moes])\nmoe.router.loss_sums.zero_()\n"
               "c = d.counters()\nrow = stats.routing[router]\nn = dynamo_utils.counters['stats']\n")
    assert sorted(counter_reads(planted, "moe_lc/somewhere.py")) == ["d.counters()", "m.router.expert_load",
                                                                      "moe.router.loss_sums", "stats.routing"]
    assert counter_reads(planted.splitlines()[3], "moe_lc/job/step.py") == []


def test_no_code_reads_a_counter_off_a_module():
    bad = []
    for top in ("moe_lc", "tools", "eval"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            bad += [f"{rel}: {read}" for read in counter_reads(path.read_text(), rel)]
    assert not bad, "counters read off modules (they belong in the step's ForwardStats):\n" + "\n".join(bad)


def _tensors(obj) -> dict[str, torch.Tensor]:
    """Every tensor a module tree keeps besides its parameters (buffers, and tensors in its modules' and
    dispatchers' attributes), cloned."""
    out = {name: b.clone() for name, b in obj.named_buffers()}
    for name, module in obj.named_modules():
        for holder, prefix in ((module, name), (getattr(module, "dispatcher", None), f"{name}.dispatcher")):
            for attr, value in (vars(holder).items() if holder is not None else ()):
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    out[f"{prefix}.{attr}"] = value.clone()
    return out


def test_a_training_step_books_its_routing_in_the_stats_and_keeps_nothing_on_the_modules():
    """Full recomputation (every block, and so every router, replayed in backward), an aux loss and a
    capacity: the step's forwards change no tensor the modules hold (the bias moves only in the update
    after the step), and every router's counts are in the stats once: each routed copy counted once, the
    dropped ones among them."""
    cfg = load_config(RECIPES / "debug_cpu.toml", ["model.moe.aux_loss_weight=0.01", "model.moe.capacity_factor=1.0",
                                                   "model.mtp.depth=1", "model.attn_backend=reference"]).model
    model = build_model(cfg, seed=0).train()
    apply_layer_plan(model, options=LayerPlanOptions(recompute=RecomputeConfig(policy="full")))
    tokens = torch.randint(0, 259, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": None, "positions": torch.arange(32),
             "mtp": mtp_targets(tokens, None, 1)}
    before = _tensors(model)
    _, stats = forward_backward(model, None, [batch, batch], 1.0 / 64, 64)
    after = _tensors(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    moes = model.moe_layers()
    assert set(moes) == {"1", "2", "3", "mtp0"} and set(stats.routing) == {m.router for m in moes.values()}
    for moe in moes.values():
        row = stats.routing[moe.router]
        assert row["loads"].sum() == 2 * 2 * 32 * cfg.moe.topk  # two micro-batches, each copy once
        assert 0 < row["dropped"] < row["loads"].sum() and row["losses"][0] > 0
    assert isinstance(stats, ForwardStats)
