"""The planner's FP8 weight cache (`precision.fp8_weight_cache`, moe_lc/ops/fp8_weights.py): each FP8 weight's
copy in 1-byte E4M3 plus its fp32 scales, made at its first GEMM of a step and kept through it.

Bytes are those of the tensors the cache makes (`moe_lc.ops.fp8_weights.cache_bytes`: no padding; one fp32
scale per 128 x 128 block, edge blocks short, or one per tensor; per expert), of the weights of this rank's
model whose GEMMs cache them (`Fp8Gemms.weights`; not under delayed scaling or the te backend). Where parameters
stay whole (ZeRO-1, 2) the copies live through the step: their own placement row, "fp8 weight cache", placed
like the parameters they copy. Under ZeRO-3 a unit's copies come and go with its gather (quantized once per
gather): a transient beside the gathered units (`gathered_cache_bytes`).
"""

from __future__ import annotations

from collections import Counter

from moe_lc.config import Config
from moe_lc.ops.fp8_linear import Fp8Gemms
from moe_lc.ops.fp8_weights import cache_bytes
from moe_lc.ops.linear import GroupedLinear, Linear
from moe_lc.parallel.parallelize import grad_group_of_zero, param_lr_scale, tie_group_of_zero, zero_group_of
from moe_lc.parallel.zero.param_gather import unit_of
from .layout import zero_placement
from .placement_semantics import StatePlacement, model_shard_dims

STATE = "fp8 weight cache"


def caches_weights(cfg: Config) -> bool:
    """Whether the recipe's FP8 GEMMs keep their weights' FP8 copies (te quantizes for itself)."""
    p = cfg.precision
    return p.recipe == "fp8" and p.fp8_weight_cache and p.fp8_scaling != "delayed" and p.fp8_backend != "te"


def cached_weights(cfg: Config, layout) -> list[tuple[str, object, int]]:
    """[(single-device name, placement, bytes of its FP8 copy)] of each weight of `layout`'s model (a
    RankLayout) whose GEMMs cache it."""
    if not caches_weights(cfg):
        return []
    named = {id(p): (n, place) for n, p, place in layout.model.named_parameters()}
    out = []
    for m in layout.model.module.modules():
        if isinstance(m, (Linear, GroupedLinear)) and isinstance(m.gemms, Fp8Gemms) and m.gemms.weights is not None:
            name, place = named[id(m.weight)]
            out.append((name, place, cache_bytes(tuple(m.weight.shape), m.gemms.recipe)))
    return out


def cache_rows(cfg: Config, layout) -> list[StatePlacement]:
    """One "fp8 weight cache" row per ZeRO part with cached weights (dense, tp-replicated, experts), placed on
    the model dims as its parameters are (pp; tp for dense, ep for experts) and replicated over the group that
    shares them; none under ZeRO-3 (`gathered_cache_bytes`)."""
    if zero_placement(cfg).params_gathered:
        return []
    dims, by_group = layout.dims, Counter()
    for name, place, nbytes in cached_weights(cfg, layout):
        by_group[zero_group_of(name, place.grad_group, param_lr_scale(cfg), place.tie_group)[0]] += nbytes
    parts = {"dp_cp": "dense", "dp_cp_tp": "tp-replicated", "edp": "experts"}
    rows: dict[str, list] = {}
    for zero_group, nbytes in sorted(by_group.items()):
        group = grad_group_of_zero(zero_group)
        model_dims, scale = model_shard_dims(dims, group, tie_group_of_zero(zero_group) is not None)
        key = parts[group]
        rows.setdefault(key, [0, {**model_dims, group: (dims[group].size, "R")}])[0] += nbytes * scale
    return [StatePlacement(STATE, part, numel, 1, "fp8 e4m3 + fp32 scales", on,
                           "each FP8 weight quantized once per step, kept through it (1 B an element + scales)")
            for part, (numel, on) in rows.items()]


def gathered_cache_bytes(cfg: Config, layout, schedule) -> float:
    """ZeRO-3: the FP8 copies of the units gathered at once, as plan.py's "gathered units" bounds them (the
    two largest units' copies, four under DualPipe / DualPipeV); 0 where parameters stay whole."""
    if not zero_placement(cfg).params_gathered:
        return 0.0
    by_unit = Counter()
    for name, _, nbytes in cached_weights(cfg, layout):
        by_unit[unit_of(name)] += nbytes
    held = 4 if schedule is not None and cfg.parallel.pp_schedule in ("dualpipe", "dualpipev") else 2
    return float(sum(sorted(by_unit.values(), reverse=True)[:held]))
