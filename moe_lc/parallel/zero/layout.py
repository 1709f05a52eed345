"""ZeRO's flat layout: which parameters share a bucket, each bucket's padded size and where each parameter
sits in it (moe_lc/parallel/zero/optimizer.py allocates it; the planner, tools/planner/layout.py, reads the same
functions). Buckets run over the parameters in reverse registration order, the order backward produces
gradients; see zero/optimizer.py's docstring for the rules (cut buckets, whole parameters packed per rank, ZeRO-3's
unit boundaries)."""

from __future__ import annotations

import itertools

from moe_lc.parallel.placement import Shard


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
