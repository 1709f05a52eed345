"""Learning-rate schedules as pure functions of the step (nothing to checkpoint but the step)."""

from __future__ import annotations

import math

from moe_lc.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine / wsd / constant.

    cosine: lr -> lr * min_lr_ratio over the steps after warmup.
    wsd (warmup-stable-decay): flat at lr, then a linear decay to lr * min_lr_ratio over the last
    `wsd_decay_fraction` of the steps (so a run can be branched and cooled down from any point).
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    return SCHEDULES[cfg.lr_schedule](step, cfg, peak, floor)


def _constant(step: int, cfg: TrainConfig, peak: float, floor: float) -> float:
    return peak


def _cosine(step: int, cfg: TrainConfig, peak: float, floor: float) -> float:
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _wsd(step: int, cfg: TrainConfig, peak: float, floor: float) -> float:
    decay_steps = max(int(round(cfg.steps * cfg.wsd_decay_fraction)), 1)
    decay_start = cfg.steps - decay_steps
    if step < decay_start:
        return peak
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    return peak + (floor - peak) * progress


SCHEDULES = {"cosine": _cosine, "wsd": _wsd, "constant": _constant}  # keys: config.choices.LrSchedule
