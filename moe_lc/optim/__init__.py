"""Optimizer update rules on ZeRO-1's shards (moe_lc/parallel/zero/optimizer.py owns the buffers and collectives).

`RULES` maps train.optimizer's names to the rules; `build_rule` makes the recipe's. A new rule is one
file with an `UpdateRule` subclass (moe_lc/optim/rule.py says what it declares) plus its entry here and
its name in moe_lc/config/choices.py's `Optimizer`.
"""

from __future__ import annotations

from moe_lc.optim.adamw import AdamW
from moe_lc.optim.muon import Muon
from moe_lc.optim.rule import OwnedParam, ShardView, StateSpec, UpdateRule
from moe_lc.optim.sgd import SGD

__all__ = ["RULES", "AdamW", "Muon", "OwnedParam", "SGD", "ShardView", "StateSpec", "UpdateRule", "build_rule",
           "recipe_rule"]

RULES: dict[str, type[UpdateRule]] = {"adamw": AdamW, "sgd": SGD, "muon": Muon}


def build_rule(train, precision, model=None) -> UpdateRule:
    """The rule train.optimizer names, with its [train] hyperparameters (and precision.adam_moments; the
    [model] section gives Muon its fused weights' logical matrices)."""
    return RULES[train.optimizer].from_config(train, precision, model)


def recipe_rule(cfg) -> UpdateRule:
    """`build_rule` of a whole recipe (moe_lc.config.Config)."""
    return build_rule(cfg.train, cfg.precision, cfg.model)
