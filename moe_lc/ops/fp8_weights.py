"""FP8 weights quantized once per optimizer step, not at every GEMM: the weight cache of `Fp8Gemms`
(`precision.fp8_weight_cache`).

Every micro-batch of a step multiplies by the same weight values, so the FP8 copy that fprop's GEMM makes of
them (128 x 128 blocks, or one tensorwise scale) is the same every time: made once, at the weight's first GEMM
after its values change, and kept until they change again. The numbers are those of quantizing at every GEMM,
bit for bit (the same call on the same values); only the recomputation is skipped.

What is kept, per Parameter: its FP8 copy in fprop's rhs layout, w (N, K) -- data (N, K) [or (E, N, K) for a
grouped weight] float8_e4m3fn, 1 byte an element, no padding, and scale (ceil(N/128), ceil(K/128)) [or
(E, ...)] fp32 (blockwise) or 0-dim [or (E,)] (tensorwise): `cache_bytes`, the planner's row. dgrad's rhs is
w^T (K, N) in the same blocks (a block of w^T holds the transposed block of w: same amax, same scale), so it
is this copy transposed -- made at each dgrad call (1 byte an element, freed after the GEMM), never quantized
again. Keeping it too would double the cache (2 bytes an element), which the shipped DeepSeek-V3 recipes
cannot hold (tools/plan.py).

When it is made again (never stale): an entry records the parameter's (``_version``, data_ptr, compute dtype,
recipe) and a lookup under any other starts afresh. ``_version`` counts in-place writes through the parameter
(any optimizer's ``p.add_``, ``load_state_dict``'s ``copy_``); data_ptr catches ``p.data = ...``. What writes
a parameter's storage around its counter must call `forget`: ZeRO's parameter stores do, whenever they publish
an update or gather a ZeRO-3 unit (moe_lc/parallel/zero/param_store.py; a checkpoint load and init_from
publish through them too), and a ZeRO-3 unit's copies are dropped when the unit is freed, so they are made
once per gather and never outlive it. A write through ``p.data`` (its own counter) needs `forget` too.

Only stateless scaling is cached. Delayed scaling quantizes w by an amax history that every GEMM call updates
(fprop and dgrad, each micro-batch), so the same weight gets different scales within one step: caching would
change its numbers (excluded). Transformer Engine quantizes for itself (not cached here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from moe_lc.ops import fp8

_ATTR = "_moe_lc_fp8_weight"  # the Parameter's attribute holding its `_Entry` (freed with the Parameter)


@dataclass
class _Entry:
    key: tuple  # (_version, data_ptr, dtype, recipe) of the values it was made from
    data: torch.Tensor  # (N, K) or (E, N, K) float8_e4m3fn
    scale: torch.Tensor  # blockwise (Nb, Kb) / (E, Nb, Kb); tensorwise () / (E,)
    granularity: str  # "block" or "tensor"


class WeightCache:
    """The FP8 copies of the weights one `Fp8Gemms` multiplies by, kept on their Parameters. ``quantizations``
    counts the weights quantized (one per Parameter per version; a grouped weight's experts count once)."""

    def __init__(self, recipe: str):
        fp8.check_recipe(recipe)
        self.recipe, self.quantizations = recipe, 0
        self.granularity = fp8.GEMM_GRANULARITY[recipe]["fprop"][1]  # "block" or "tensor"

    def entry(self, param: nn.Parameter, dtype: torch.dtype) -> _Entry:
        """param's FP8 copy for GEMMs in `dtype`, quantized now if its values changed since it was made."""
        key = (param._version, param.data_ptr(), dtype, self.recipe)
        entry = param.__dict__.get(_ATTR)
        if entry is None or entry.key != key:
            param.__dict__.pop(_ATTR, None)  # the stale copy goes before the new one is made
            entry = _Entry(key, *self._quantize(param, dtype), self.granularity)
            setattr(param, _ATTR, entry)
            self.quantizations += 1
        return entry

    def _quantize(self, param: nn.Parameter, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The call the GEMM makes on w cast to `dtype` (so the same numbers), expert by expert for a grouped
        weight (one expert's fp32 temporaries at a time)."""
        quantize = fp8.quantize_blocks if self.granularity == "block" else fp8.quantize_tensorwise
        with torch.no_grad():
            w = param.detach()
            if w.dim() == 2:  # kept: compact (quantize_blocks may return a view into its zero-padded blocks)
                data, scale = quantize(w.to(dtype))
                return data if data.untyped_storage().nbytes() == data.numel() else data.clone(), scale
            data = torch.empty(w.shape, dtype=fp8.FP8_DTYPE, device=w.device)
            scales = []
            for e in range(w.shape[0]):
                data[e], scale = quantize(w[e].to(dtype))
                scales.append(scale)
            return data, torch.stack(scales)


@dataclass(frozen=True)
class CachedWeight:
    """A weight as `Fp8Gemms` takes it from the cache: `operand(gemm)` is fprop's rhs w (N, K) or dgrad's
    w^T (K, N), expert `expert`'s of a grouped (E, N, K) weight (``w[e]`` selects it, as for a tensor)."""

    param: nn.Parameter
    dtype: torch.dtype
    cache: WeightCache
    expert: int | None = None

    @property
    def shape(self) -> torch.Size:
        return self.param.shape if self.expert is None else self.param.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.param.device

    def __getitem__(self, expert: int) -> CachedWeight:
        assert self.expert is None and self.param.dim() == 3, "an expert of a grouped weight"
        return replace(self, expert=expert)

    def operand(self, gemm: str) -> fp8.Quantized:
        e = self.cache.entry(self.param, self.dtype)
        data, scale = (e.data, e.scale) if self.expert is None else (e.data[self.expert], e.scale[self.expert])
        if gemm == "dgrad":  # w^T's blocks are w's transposed; contiguous, as quantizing w^T lays it out
            data = data.t().contiguous()
            scale = scale.t().contiguous() if e.granularity == "block" else scale
        return fp8.Quantized(data, scale, e.granularity)


def cache_bytes(shape: tuple[int, ...], recipe: str) -> int:
    """Bytes of the FP8 copy of a (N, K) or grouped (E, N, K) weight under `recipe`: 1 per element and the
    fp32 scales (one per 128 x 128 block, edge blocks short; or one per tensor), per expert."""
    *experts, n, k = shape
    e = experts[0] if experts else 1
    scales = -(-n // fp8.BLOCK) * -(-k // fp8.BLOCK) if fp8.GEMM_GRANULARITY[recipe]["fprop"][1] == "block" else 1
    return e * (n * k + 4 * scales)


def cached_bytes(params) -> int:
    """Bytes the FP8 copies of `params` hold now (the dry run's and the tests' count)."""
    entries = [p.__dict__.get(_ATTR) for p in params]
    return sum(e.data.untyped_storage().nbytes() + e.scale.untyped_storage().nbytes() for e in entries if e)


def forget(params) -> None:
    """Drop the FP8 copies of `params` (Parameters): their values changed where their version counter cannot
    see it, or their storage is being freed."""
    for p in params:
        p.__dict__.pop(_ATTR, None)
