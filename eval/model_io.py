"""Find a checkpoint and its recipe, load the model weights, run the model: the eval side of I/O.

Accepted paths: a run directory (<output_dir> with config.toml and checkpoints/), a checkpoint root
(the step_XXXXXXXX directories), one committed step directory, or a `python -m moe_lc.convert
from-hf` directory. The recipe is the run's config.toml (the from-hf recipe.toml) unless --recipe
is given. Only the "model" entry of the DCP checkpoint is read.

Checkpoints of any layout load here: moe_lc saves every parameter as boxes of the full tensor
(reshardable checkpoints), so a tp / ep / pp / dp run's "model" entry fills one full model (checked
for a tp=2 run).

Context-parallel eval for long contexts: under `torchrun --nproc-per-node N -m eval ...` every rank
holds the full weights and the model runs zig-zag ring attention over N ranks (cp = N): each rank
feeds its two chunks of the sequence, and the logits are gathered back into sequence order on every
rank, so scoring is the same code as in one process (and gives the same numbers, tests/test_eval.py).
Inputs are padded at the end to a multiple of 2N; causal attention and per-token routing make the
padding invisible to the real positions.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from moe_lc.job.checkpoint import (CheckpointError, checkpoint_keys, find_checkpoint, load_checkpoint, recipe_beside,
                                   weight_errors)
from moe_lc.config import Config, ConfigError, load_config
from moe_lc.model.transformer import Transformer, state_shapes
from moe_lc.parallel.mesh import ParallelDims, init_distributed


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """(committed step directory, the recipe beside it or None) for a run, root, step or from-hf path."""
    step = find_checkpoint(path)
    return step, recipe_beside(step)


def load_eval_config(config_path: Path | None, recipe: str | None, overrides: list[str]) -> Config:
    """The recipe the model was trained with (--recipe wins over the run's config.toml). Only the
    model section must be valid here: the run's parallel layout does not apply to one eval process."""
    source = recipe or config_path
    if source is None:
        raise ConfigError(["no recipe: the checkpoint's run directory has no config.toml; pass --recipe"])
    cfg = load_config(source, overrides, check=False)
    errors = cfg.model.errors()
    if errors:
        raise ConfigError(errors)
    return cfg


def eval_dims(cfg: Config, device: torch.device) -> ParallelDims | None:
    """Under torchrun (WORLD_SIZE > 1): join the job and make every rank one cp rank; else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    rank, world = init_distributed(cfg.parallel.timeout_s, device.type)
    layout = dataclasses.replace(cfg.parallel, pp=1, dp=1, cp=world, cp_a2a=1, tp=1, ep=1,
                                 ranks_per_node=0)  # eval runs the plain ring whatever the run trained with
    dims = ParallelDims.from_config(layout, world, rank, device.type)
    dims.init_groups()
    return dims


class ContextParallelLM(nn.Module):
    """A model whose attention runs the zig-zag ring over `dims["cp"]`: tokens (B, S) -> logits (B, S, V),
    the same full tensors on every cp rank (each runs its zig-zag chunks; odd lengths are padded)."""

    def __init__(self, model: Transformer, dims: ParallelDims):
        super().__init__()
        self.model, self.dims = model, dims

    @property
    def parts(self) -> int:
        return self.dims["cp"].size

    def shard(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full tokens (B, S) -> this rank's zig-zag chunks and their positions, S padded at the end to a
        multiple of 2 cp (causal attention and per-token routing keep the padding out of real positions)."""
        from moe_lc.parallel.cp.ring import zigzag_shard

        group, S = self.dims["cp"], tokens_BS.shape[1]
        padded = -(-S // (2 * group.size)) * 2 * group.size
        tokens_BS = torch.nn.functional.pad(tokens_BS, (0, padded - S))
        positions = torch.arange(padded, device=tokens_BS.device)
        return zigzag_shard(tokens_BS, group, dim=1), zigzag_shard(positions, group, dim=0)

    def gather(self, t_BS: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's (B, S_local, ...) shard -> the full (B, length, ...) on every rank (padding cut)."""
        from moe_lc.parallel.cp.ring import zigzag_unshard

        return zigzag_unshard(t_BS.contiguous(), self.dims["cp"], dim=1)[:, :length]

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        local, positions = self.shard(tokens_BS)
        return self.gather(self.model(local, positions=positions).float(), tokens_BS.shape[1])


def check_fit(step_dir: Path, cfg: Config) -> None:
    """CheckpointError when the checkpoint's model and the recipe's differ: a tensor either lacks (a
    4-layer checkpoint under `--set model.n_layers=3` would otherwise drop layers.3.* without a word)
    or a shape. Read from the checkpoint's metadata and a meta-device build, before any weights exist."""
    errors = [e.replace(str(step_dir), "the checkpoint") for e in weight_errors(step_dir, state_shapes(cfg.model))]
    if errors:
        more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
        raise CheckpointError(f"{step_dir} does not fit the recipe's model (wrong --recipe or --set?): "
                              + "; ".join(errors[:3]) + more)


def load_model(step_dir: Path, cfg: Config, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, dims: ParallelDims | None = None) -> nn.Module:
    """The checkpoint's weights in a full model (eval mode, `dtype` parameters): tokens -> logits; with
    `dims` (cp > 1) its attention runs the zig-zag ring over the cp group (`ContextParallelLM`)."""
    check_fit(step_dir, cfg)
    model = Transformer(cfg.model)
    state = model.state_dict()
    keys = checkpoint_keys(step_dir)
    load_checkpoint(step_dir, {"model": {n: t for n, t in state.items() if f"model.{n}" in keys}})
    model.load_state_dict(state)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if dims is not None and dims.cp > 1:
        from moe_lc.parallel.parallelize import parallelize

        return ContextParallelLM(parallelize(model, dims).module, dims).to(device).eval()
    return model.to(device).eval()


@torch.no_grad()
def forward_logits(model: nn.Module, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Logits (B, S, V) in fp32 for token ids (B, S), on the model's device (`load_model`'s model)."""
    device = next(model.parameters()).device
    return model(tokens_BS.to(device)).float()


def checkpoint_step(step_dir: Path) -> int:
    return int(step_dir.name.rsplit("_", 1)[-1])
