"""ZeRO's flat layout: which parameters share a bucket, each bucket's padded size and where each parameter
sits in it (`Bucket`, `build_buckets`: what moe_lc/parallel/zero/optimizer.py's groups and their strategies
index; the planner, tools/planner/layout.py, reads the same functions), which parameters a rank's shard holds
and their grad-norm weights. Buckets run over the parameters in reverse registration order, the order backward
produces gradients; see zero/optimizer.py's docstring for the rules (cut buckets, whole parameters packed per
rank, ZeRO-3's unit boundaries)."""

from __future__ import annotations

import itertools

import torch

from moe_lc.optim.rule import OwnedParam
from moe_lc.parallel.placement import Shard


class Bucket:
    """One bucket of a ZeRO group's flat layout: elements [start, start + size) of the group's (P,) buffers,
    padded to a multiple of N; rank r owns [r * size/N, (r+1) * size/N) of it, elements [shard_start,
    shard_start + size/N) of the rank's (P/N,) shard tensors."""

    def __init__(self, index: int, start: int, size: int, params: list, shard_start: int, n: int,
                 unit: str | None = None):
        self.index, self.start, self.size = index, start, size  # index: in its group's buckets
        self.params = params  # [(param, offset in the group's buffer)]
        self.shard_start, self.shard_size = shard_start, size // n
        self.unit = unit  # ZeRO-3: the gather unit its parameters belong to (param_gather.py)
        # (size,) compute dtype, where its parameters' views point: the flat param buffer's slice, or (ZeRO-3) a
        # storage of its own, holding them only while its unit is gathered (zero/param_store.py)
        self.full: torch.Tensor | None = None

    def part(self, shard: torch.Tensor) -> torch.Tensor:
        """This bucket's slice of a (P/N,) shard tensor (master, state, reduced gradients)."""
        return shard[self.shard_start:self.shard_start + self.shard_size]

    def own(self, flat: torch.Tensor, rank: int, start: int | None = None) -> torch.Tensor:
        """Rank `rank`'s 1/N of this bucket inside a (P,) buffer (start = 0: inside the bucket's own (size,))."""
        lo = (self.start if start is None else start) + rank * self.shard_size
        return flat[lo:lo + self.shard_size]


def build_buckets(params: list, bucket_elems: int, n: int, whole: list[bool],
                  units: list[str] | None = None) -> list[Bucket]:
    """The buckets of parameters in buffer order (`bucket_layout`'s rules; `units`: ZeRO-3's gather units)."""
    out, start, shard_start, i = [], 0, 0, 0
    for size, offsets in bucket_layout([p.numel() for p in params], bucket_elems, n, whole, units):
        mine = [(p, start + off) for p, off in zip(params[i:i + len(offsets)], offsets)]
        out.append(Bucket(len(out), start, size, mine, shard_start, n, units[i] if units is not None else None))
        start, shard_start, i = start + size, shard_start + size // n, i + len(offsets)
    return out


def _runs(numels: list[int], whole: list[bool], bucket_elems: int,
          units: list[str] | None = None) -> list[tuple[int, int, bool]]:
    """(first parameter, count, whole) of each bucket: greedy over buffer order, a parameter never
    straddles two buckets, whole and cut parameters never share one, nor (ZeRO-3) two gather units."""
    kind = list(zip(whole, units)) if units is not None else whole
    out, cur, first = [], 0, 0
    for i, k in enumerate(numels):
        if i > first and (cur + k > bucket_elems or kind[i] != kind[first]):
            out.append((first, i - first, whole[first]))
            cur, first = 0, i
        cur += k
    return out + [(first, len(numels) - first, whole[first] if numels else False)]


def _pack_whole(numels: list[int], n: int, loads: list[int]) -> tuple[int, list[int]]:
    """Whole parameters into n bins, one per rank: largest first onto the emptiest bin (ties: the rank
    with the fewest elements over earlier buckets, `loads`, updated). -> (bucket size = n x the fullest
    bin, each parameter's offset from the bucket's start)."""
    fill, place = [0] * n, {}
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(n), key=lambda r: (fill[r], loads[r], r))
        place[i] = (r, fill[r])
        fill[r] += numels[i]
    width = max(fill)
    for r in range(n):
        loads[r] += fill[r]
    return n * width, [r * width + at for r, at in (place[i] for i in range(len(numels)))]


def bucket_layout(numels: list[int], bucket_elems: int, n: int, whole: list[bool] | None = None,
                   units: list[str] | None = None) -> list[tuple[int, list[int]]]:
    """(padded size, each parameter's offset from the bucket's start) of each bucket over parameters of
    `numels` elements in buffer order; a cut bucket is padded to a multiple of n, a whole one packed;
    `units` (ZeRO-3): each parameter's gather unit, at whose changes a bucket ends."""
    whole = whole or [False] * len(numels)
    out, loads = [], [0] * n
    for first, count, is_whole in _runs(numels, whole, bucket_elems, units):
        mine = numels[first:first + count]
        if is_whole:
            out.append(_pack_whole(mine, n, loads))
        else:
            offsets = list(itertools.accumulate(mine[:-1], initial=0))[:count]
            out.append((-(-sum(mine) // n) * n, offsets))
    return out


def bucket_sizes(numels: list[int], bucket_elems: int, n: int, whole: list[bool] | None = None,
                 units: list[str] | None = None) -> list[int]:
    """Padded bucket sizes of one ZeRO-1 group whose parameters have `numels` elements in single-device
    order (the buffer runs in reverse order, the order backward produces gradients) and, where given,
    `whole` flags (the rule's `whole`) and gather units (ZeRO-3, `param_gather.unit_of`): what
    ShardedParams allocates, for the planner."""
    return [size for size, _ in bucket_units(numels, bucket_elems, n, whole, units)]


def bucket_units(numels: list[int], bucket_elems: int, n: int, whole: list[bool] | None = None,
                 units: list[str] | None = None) -> list[tuple[int, str | None]]:
    """(padded size, gather unit or None) of each bucket, in buffer order (`bucket_sizes`'s arguments)."""
    rev = list(reversed(whole)) if whole is not None else None
    rev_units = list(reversed(units)) if units is not None else None
    out, first = [], 0
    for size, offsets in bucket_layout(list(reversed(numels)), bucket_elems, n, rev, rev_units):
        out.append((size, rev_units[first] if rev_units is not None else None))
        first += len(offsets)
    return out


def owned_params(buckets: list[Bucket], rank: int, names: dict[int, str]) -> list[OwnedParam]:
    """The parameters with elements in rank `rank`'s shard, bucket by bucket, where in the (P/N,) shard they lie
    (`names`: id(param) -> name)."""
    out = []
    for b in buckets:
        own_lo = b.start + rank * b.shard_size
        for p, off in b.params:
            lo, hi = max(off, own_lo), min(off + p.numel(), own_lo + b.shard_size)
            if lo < hi:
                out.append(OwnedParam(names[id(p)], p.shape, b.shard_start + lo - own_lo, b.shard_start + hi - own_lo,
                                      lo - off))
    return out


def norm_weight_shard(buckets: list[Bucket], rank: int, weights: dict[int, torch.Tensor],
                      device: torch.device) -> torch.Tensor | None:
    """(P/N,) fp64 weights of rank `rank`'s squared grad norm from the parameters' norm weights (id(param) ->
    a tensor broadcastable to it; e.g. 1/copies for rows that several ranks outside the group hold, such as
    replicated kv heads under tensor parallelism); None when every element counts once."""
    if not weights:
        return None
    full = torch.ones(sum(b.size for b in buckets), device=device, dtype=torch.float64)
    for b in buckets:
        for p, off in b.params:
            if id(p) in weights:
                full[off:off + p.numel()] = weights[id(p)].to(full.device).expand_as(p).reshape(-1)
    return torch.cat([b.own(full, rank) for b in buckets])


def matrix_shards(shards: tuple[Shard, ...], ndim: int) -> tuple[Shard, ...]:
    """The placement shards that cut a parameter's matrices, its last two dims (EP's expert dim does not):
    the slices a matrix rule gathers (ShardedParams.to_full)."""
    return tuple(s for s in shards if s.dim >= ndim - 2)


def whole_owners(numels: list[int], bucket_elems: int, n: int, whole: list[bool],
                 units: list[str] | None = None) -> list[int | None]:
    """The group rank whose shard holds each whole parameter (None: a cut one), for parameters of
    `numels` elements and `whole` flags (and ZeRO-3's gather units) in single-device order, as
    ShardedParams lays them out (the planner: which rank orthogonalizes which matrix)."""
    rev_whole, owners = list(reversed(whole)), []
    rev_units = list(reversed(units)) if units is not None else None
    for size, offsets in bucket_layout(list(reversed(numels)), bucket_elems, n, rev_whole, rev_units):
        owners += [off // (size // n) if rev_whole[len(owners)] else None for off in offsets]
    return owners[::-1]


def bucket_elems(bucket_mb: float) -> int:
    """fp32 elements per bucket of `parallel.zero_bucket_mb` MiB."""
    return max(int(bucket_mb * 2**20 / 4), 1)
