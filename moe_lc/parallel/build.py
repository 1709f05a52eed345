"""This rank's model from a recipe, the one way the trainer, the planner and one-process builds make
it: the Transformer on the meta device (no memory), parallelized for the rank's coordinates, then
(unless asked not to) its own shards materialized with the single-device init.
"""

from __future__ import annotations

import torch

from moe_lc.config import Config, ConfigError
from moe_lc.model.transformer import Transformer
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.parallelize import ParallelizeOptions, materialize, parallelize
from moe_lc.parallel.placement import Parallelized


def pipeline_plan(cfg: Config, microbatches: int):
    """(schedule, layers per stage) for pp > 1, else (None, None); ConfigError on impossible plans,
    before any process group exists (the recipe's rules normally caught them already)."""
    from moe_lc.parallel.pipeline import build_schedule
    from moe_lc.parallel.pipeline.stage import stage_layers

    p = cfg.parallel
    if p.pp == 1:
        return None, None
    try:
        schedule = build_schedule(p.pp_schedule, p.pp, microbatches,
                                  p.pp_chunks if p.pp_schedule == "interleaved_1f1b" else None)
        layers = stage_layers(cfg.model, schedule.n_stages, cfg.train.seq_len, p.pp_stage_layers or None)
    except ValueError as exc:
        raise ConfigError([f"parallel.pp_schedule={p.pp_schedule!r} with pp={p.pp} and {microbatches} "
                           f"micro-batches: {exc}"]) from None
    return schedule, layers


def build_rank_model(cfg: Config, dims: ParallelDims, device: torch.device | str = "cpu", *,
                     pipeline=None, materialized: bool = True, route=None,
                     defer_wgrad: bool | None = None, defer_params: bool = False) -> Parallelized:
    """cfg's model for dims.rank: built on meta, parallelized (PP, TP, EP, CP, FP8, recompute) as the recipe's
    `ParallelizeOptions` (derived here, once) ask, and with `materialized` its local shards allocated on
    `device` and initialized (seed `train.seed`).
    pipeline: (schedule, stage layers) from `pipeline_plan` (computed here when None); route: a router
    selection replacing the learned one (the dry run's balanced routing); defer_wgrad: see `parallelize`;
    defer_params: parameters left without storage for ZeRO-3 to draw bucket by bucket (`materialize`)."""
    schedule, layers = pipeline if pipeline is not None else pipeline_plan(cfg, cfg.train.microbatches(dims.dp))
    with torch.device("meta"):  # no full model on any rank: each materializes only its shards
        model = Transformer(cfg.model)
    result = parallelize(model, dims, ParallelizeOptions.from_config(cfg, dims.dp), schedule=schedule,
                         stage_layers=layers, device=torch.device(device), route=route, defer_wgrad=defer_wgrad)
    if materialized:
        materialize(result, dims, cfg.train.seed, cfg.model.init_std, cfg.model.n_layers, device,
                    cfg.precision.compute_dtype, deferred=defer_params)
    return result
