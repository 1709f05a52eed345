"""train.ema_decay: an EMA of the fp32 masters in CPU memory, updated in the background (DeepSeek-V3 3.2.3)."""

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.train import Trainer
from tests.harness import FAST, RECIPES

RECIPE = RECIPES / "debug_cpu.toml"
BASE = FAST + ["train.steps=3", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=1"]


def _trainer(tmp_path, *extra):
    return Trainer(load_config(RECIPE, BASE + [f"train.output_dir={tmp_path}/run", *extra]))


def test_ema_follows_the_masters_and_leaves_training_alone(tmp_path):
    decay = 0.9
    plain, with_ema = _trainer(tmp_path / "a"), _trainer(tmp_path / "b", f"train.ema_decay={decay}")
    assert plain.optimizer.ema is None
    ema = with_ema.optimizer.ema
    expected = [m.detach().clone() for m in (s.master for s in with_ema.optimizer.shards)]
    assert all(e.device.type == "cpu" for e in ema.shards)
    for _ in range(3):
        a, b = plain.train_step(), with_ema.train_step()
        assert a.loss == b.loss and a.grad_norm == b.grad_norm  # the EMA is not on the training path
        for ref, s in zip(expected, with_ema.optimizer.shards):
            ref.lerp_(s.master, 1 - decay)
    ema.wait()
    for ref, got in zip(expected, ema.shards):
        assert torch.equal(ref, got)
    assert not all(torch.equal(e, s.master) for e, s in zip(ema.shards, with_ema.optimizer.shards))


def test_ema_is_checkpointed_and_starts_from_the_weights_when_the_checkpoint_has_none(tmp_path):
    ckpt = ["checkpoint.interval=3", f"checkpoint.dir={tmp_path}/ckpt"]
    first = _trainer(tmp_path / "a", "train.ema_decay=0.5", *ckpt)
    first.fit()
    saved = [e.clone() for e in first.optimizer.ema.shards]
    resumed = _trainer(tmp_path / "b", "train.ema_decay=0.5", "checkpoint.resume=true", *ckpt)
    assert resumed.try_resume() is not None
    assert all(torch.equal(a, b) for a, b in zip(saved, resumed.optimizer.ema.shards))

    no_ema_dir = [f"checkpoint.dir={tmp_path}/plain", "checkpoint.interval=3"]
    _trainer(tmp_path / "c", *no_ema_dir).fit()
    later = _trainer(tmp_path / "d", "train.ema_decay=0.5", *no_ema_dir)
    assert later.try_resume() is not None
    assert all(torch.equal(e, s.master) for e, s in zip(later.optimizer.ema.shards, later.optimizer.shards))


def test_ema_decay_must_lie_in_zero_one():
    with pytest.raises(ConfigError, match=r"train.ema_decay=1.0 must lie in \[0, 1\)"):
        load_config(RECIPE, ["train.ema_decay=1.0"])
