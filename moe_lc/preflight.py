"""Checks of this machine against a recipe before any process group: paths, devices, memory, the
checkpoint a run starts from. The recipe's own rules ran in `load_config`; these depend on the
filesystem and the device. Each failure is a ConfigError naming the key."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moe_lc import checkpoint as ckpt
from moe_lc.config import Config, ConfigError
from moe_lc.model.counting import param_counts
from moe_lc.model.transformer import state_shapes


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_from_checkpoint(cfg: Config) -> Path:
    """The checkpoint `checkpoint.init_from` names, vetted against the recipe's model (ConfigError)."""
    try:
        path = ckpt.find_checkpoint(cfg.checkpoint.init_from)
    except (ckpt.CheckpointError, FileNotFoundError) as exc:
        raise ConfigError([f"checkpoint.init_from: {exc}"]) from None
    errors = [f"checkpoint.init_from: {e}" for e in ckpt.weight_errors(path, state_shapes(cfg.model))]
    if errors:
        raise ConfigError(errors[:8] + ([f"... and {len(errors) - 8} more"] if len(errors) > 8 else []))
    return path


def preflight(cfg: Config, world: int) -> None:
    """Checks of this machine against the recipe, before any process group: ConfigError naming the problem.
    (The recipe's own rules ran in load_config; these depend on the filesystem and the device.)"""
    errors = []
    for key, value in (("train.output_dir", cfg.train.output_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        clash = next((q for q in (Path(value), *Path(value).parents) if q.exists() and not q.is_dir()), None)
        if value and clash is not None:
            errors.append(f"{key}={value!r}: {clash} is a file, not a directory")
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        per_rank = torch.cuda.get_device_properties(device).total_memory
    else:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        per_rank = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(local_ranks, 1)
    counts = param_counts(cfg.model)
    n_params = counts["total"] + counts.get("mtp", 0)
    need = n_params * (4 if cfg.precision.recipe == "fp32" else 2) / world  # parameters alone, perfectly sharded
    if need > per_rank:
        errors.append(f"the model has {n_params:.3g} parameters: even spread evenly over {world} rank(s) they need "
                      f"{need / 2**30:,.1f} GiB per rank, more than the {per_rank / 2**30:,.1f} GiB this machine has per "
                      f"rank ({device.type}); check model sizes or use more ranks")
    if cfg.checkpoint.init_from:
        try:
            init_from_checkpoint(cfg)
        except ConfigError as exc:
            errors += exc.errors
    if errors:
        raise ConfigError(errors)
