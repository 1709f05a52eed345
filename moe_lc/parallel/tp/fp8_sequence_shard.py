"""FP8 activation caching under sequence parallelism: a column-parallel Linear keeps the FP8 copy of its
input's sequence shard, not of the gathered input, and all-gathers the FP8 data (and the scales) again in
backward, beside the input-gradient GEMM, as `KeepSequenceShard` (tp/mappings.py) does for a kept bf16
input. 1/N of the bytes of the gathered copy; the re-gather moves 1 byte an element plus the scales.

Legend: B batch, S = N*s tokens of the gathered sequence, s this rank's shard, N tp size, D in-features,
M = B*S the weight-gradient GEMM's contraction (token) dim, m = B*s this shard's tokens.

The weight-gradient GEMM reads x^T (D, M) quantized along the tokens (`fp8.wgrad_operand`), the columns in
x2's row order b*S + r*s + t (batch b, tp rank r, token t of the shard): shards interleave per batch row.

    tensorwise  one scale for the whole (D, M): the shard is quantized with the global amax (an all-reduce
                (max) over tp of the shard's amax, 4 bytes, in forward), which is the gathered tensor's, so
                every FP8 value is the one the gathered quantization gives; any s.
    blockwise   a 1 x 128 tile along M: tile k covers columns [128k, 128k + 128). With s % 128 == 0 every
                tile lies inside one (b, r) run of s columns, so it holds the same 128 values, in the same
                order, as one tile of this shard's own (D, m) quantization: the gathered operand is the
                shards' data and scales put back in (b, r) order, bit for bit. Otherwise some tile straddles
                two shards (its amax spans both), and the Linear keeps the gathered FP8 copy as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_lc.ops import fp8
from moe_lc.ops.fp8_linear import KeepFp8ForWgrad
from moe_lc.ops.linear import KeepInput
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group


def shard_quantizes_exactly(recipe: str, shard_tokens: int) -> bool:
    """Whether the FP8 wgrad operand of the gathered input can be put together from the shards' (module
    docstring): always under tensorwise scaling, under blockwise when 1 x 128 tiles never straddle shards."""
    return recipe == "tensorwise" or shard_tokens % fp8.BLOCK == 0


class KeepFp8SequenceShard(KeepInput):
    """A column-parallel Linear's FP8-cached input (`KeepFp8ForWgrad`, `precision.fp8_cache` "linear")
    kept as the FP8 wgrad operand of this rank's (B, s, D) shard: data (D, m) fp8 and scale (D, m/128) fp32
    (blockwise) or 0-dim (tensorwise, the global amax's). Backward all-gathers data and scales over tp and
    puts them in x2's (b, r, t) token order: exactly the operand the gathered input's cache holds. Where
    that is not exact (`shard_quantizes_exactly`) it saves and restores as `inner`, the gathered copy.
    One use: made per forward call for that call's shard, which `save` quantizes and forgets."""

    def __init__(self, shard_BsD: torch.Tensor, group: Group, inner: KeepFp8ForWgrad):
        self._shard, self.group, self.inner = shard_BsD, group, inner
        self.batch = shard_BsD.shape[0]
        self.sharded = True  # decided in `save`, where the GEMMs' recipe is known

    def save(self, x2, counts, gemms) -> tuple:
        assert counts is None, "column-parallel Linears are not grouped"
        assert gemms.history is None, "delayed scaling never caches (precision.fp8_cache rules)"
        shard_BsD, self._shard = self._shard, None
        self.sharded = shard_quantizes_exactly(gemms.recipe, shard_BsD.shape[1])
        if not self.sharded:
            return self.inner.save(x2, counts, gemms)
        x_mD = shard_BsD.reshape(-1, shard_BsD.shape[-1])
        if gemms.recipe == "blockwise":
            op = fp8.wgrad_operand(x_mD, gemms.recipe)
        else:  # the gathered tensor's amax: the max of the shards' (exact), so the same scale
            amax = x_mD.detach().abs().amax().float()
            comm.all_reduce(amax, self.group, op=dist.ReduceOp.MAX)
            op = fp8.Quantized(*fp8.quantize_tensorwise(x_mD.t(), amax), fp8.wgrad_granularity(gemms.recipe))
        return op.data, op.scale

    def begin_restore(self, saved, counts, gemms):
        if not self.sharded:
            return lambda: self.inner.restore(saved, counts, gemms)
        data_Dm, scale = saved
        data = _start_gather_tokens(data_Dm.view(torch.uint8), self.batch, self.group)  # gloo has no fp8
        scales = _start_gather_tokens(scale, self.batch, self.group) if scale.dim() else lambda: scale
        granularity = fp8.wgrad_granularity(gemms.recipe)
        return lambda: fp8.Quantized(data().view(data_Dm.dtype), scales(), granularity)

    def restore(self, saved, counts, gemms):
        return self.begin_restore(saved, counts, gemms)()

    def hold_dy(self, dy2, counts, gemms):
        return self.inner.hold_dy(dy2, counts, gemms)

    def hold_input(self, saved, counts, gemms):
        """A deferred W holds the gathered operand (gathered in B, as `KeepSequenceShard` does)."""
        return self.restore(saved, counts, gemms)


def _start_gather_tokens(t_Cm: torch.Tensor, batch: int, group: Group):
    """All-gather of a token-minor (C, B*s') tensor (fp8 codes as uint8, or per-tile scales) issued now;
    returns finish(), which waits and gives (C, B*N*s') in x2's token order: batch-major, then tp rank."""
    t_Cm = t_Cm.contiguous()  # a Triton quantizer's scales come column-major
    n, (c, m) = group.size, t_Cm.shape
    out = t_Cm.new_empty(n * t_Cm.numel())
    work = comm.all_gather(out, t_Cm.view(-1), group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out.view(n, c, batch, m // batch).permute(1, 2, 0, 3).reshape(c, n * m)

    return finish
