"""FP8 activation caching (`precision.fp8_cache`, DeepSeek-V3 report section 3.3.3): activations kept for
backward in FP8, plugged into the model's seams by the layer plan (moe_lc/parallel/layer_plan.py holds
the rules, this file the pieces; the model never imports it). Items:

    linear    every FP8 Linear keeps its input for the weight gradient quantized exactly as that GEMM
              will quantize it (moe_lc/ops/fp8_linear.py `KeepFp8ForWgrad`): half the bytes, no number
              changes. Not where another part keeps the same input in the compute dtype anyway (an FP8
              copy would only add): wo (the attention core keeps its output; "attn_out" shares one FP8
              copy), a down projection whose input is recomputed (selective "swiglu", or "swiglu" here),
              the shared experts' up projection while the router's replay keeps their common input
              (every policy but full). Every FP8 Linear's deferred W (ZB-H1, DualPipe) holds dy and x in
              that form from B until W (`HoldFp8ForWgrad`).
    swiglu    every SwiGLU (dense FFN, shared and routed experts) keeps only gate|up, in FP8 (1 x 128
              tiles); the SwiGLU's backward and the down projection's weight gradient read its output
              recomputed from that copy ("cache its input and recompute its output", as DeepSeek-V3).
    attn_out  the attention output, which the core's backward and wo's weight gradient both read, kept
              once in FP8 (1 x 128 tiles per head) with power-of-two scales, so that wo's weight-gradient
              GEMM requantizes it in its own tiles without error of its own (DeepSeek-V3 keeps it in a
              custom E5M6 format; E4M3 here).

The forward is unchanged by every item; "swiglu" and "attn_out" round what backward reads.
"""

from __future__ import annotations

import torch

from moe_lc.model.ffn import swiglu, swiglu_then
from moe_lc.model.saved_tensors import enclosing_hooks, recompute_from
from moe_lc.model.seams import project_now, run_now
from moe_lc.ops.fp8_storage import Fp8Tiles
from moe_lc.ops.linear import KeepInput


class _SwiGLUFromFp8(torch.autograd.Function):
    """h = swiglu(gate_up, weight), computed from gate_up itself; backward reads gate_up from its FP8
    tiles (data, scale), saved instead of it. weight: (T,) fp32 gates or None; run_region: the module's
    seam that runs swiglu."""

    @staticmethod
    def forward(ctx, run_region, gate_up, weight, data, scale):
        ctx.save_for_backward(data, scale, weight)
        ctx.dtype, ctx.run_region = gate_up.dtype, run_region
        return run_region(swiglu, gate_up, weight)

    @staticmethod
    def backward(ctx, dh):
        data, scale, weight = ctx.saved_tensors
        with torch.enable_grad():
            g = Fp8Tiles(data, scale, ctx.dtype).dequantize().requires_grad_()
            w = weight.detach().requires_grad_() if weight is not None and ctx.needs_input_grad[2] else weight
            inputs = [g] + ([w] if w is not weight else [])
            grads = torch.autograd.grad(ctx.run_region(swiglu, g, w), inputs, dh)
        return None, grads[0], grads[1] if len(grads) > 1 else None, None, None


def swiglu_fp8_cached(down, gate_up: torch.Tensor, *args, weight: torch.Tensor | None = None,
                      run_region=run_now) -> torch.Tensor:
    """The `activation` seam under item "swiglu": down(swiglu(gate_up, weight), *args) keeping gate|up
    only as FP8 tiles; the copy of the SwiGLU output `down` would save is rebuilt from them in backward."""
    if not torch.is_grad_enabled():
        return swiglu_then(down, gate_up, *args, weight=weight, run_region=run_region)
    tiles, dtype = Fp8Tiles.quantize(gate_up), gate_up.dtype
    h = _SwiGLUFromFp8.apply(run_region, gate_up, weight, *tiles.tensors)

    def remake(data, scale, w=None):
        return (run_region(swiglu, Fp8Tiles(data, scale, dtype).dequantize(), w),)

    sources = tiles.tensors + ((weight,) if weight is not None else ())
    return recompute_from(sources, (h,), remake, down, *args)


class KeepTiles(KeepInput):
    """wo's input kept as the attention output's FP8 tiles (shared with the core's saved output):
    restored (dequantized, exact under power-of-two scales) as the (T, H*Dv) the GEMM read."""

    def __init__(self, tiles: Fp8Tiles, hold: KeepInput):
        self.tiles, self.dtype, self.hold = tiles, tiles.dtype, hold  # hold: wo's own (what a deferred W holds)

    def save(self, x2, counts, gemms):
        tensors, self.tiles = self.tiles.tensors, None  # autograd holds them from here
        return tensors

    def restore(self, saved, counts, gemms):
        out = Fp8Tiles(saved[0], saved[1], self.dtype).dequantize()
        return out.reshape(-1, out.shape[-2] * out.shape[-1])

    def hold_dy(self, dy2, counts, gemms):
        return self.hold.hold_dy(dy2, counts, gemms)

    def hold_input(self, saved, counts, gemms):
        return self.hold.hold_input((self.restore(saved, counts, gemms),), counts, gemms)


class _Held:
    """A tensor the attention saved, held until the output is known: then either a view of the output's
    FP8 copy (same storage as the output) or handed to the saved-tensor hooks around us."""

    def __init__(self, t: torch.Tensor):
        self.t, self.packed, self.view, self.copy = t, None, None, None

    def settle(self, storage: int | None, copy, outer) -> None:
        """storage: the identity of the output's storage (None: the output does not cover one)."""
        t, self.t = self.t, None
        if storage is not None and t.untyped_storage()._cdata == storage:
            self.view, self.copy = (t.shape, t.stride(), t.storage_offset()), copy
        else:
            self.packed = t if outer is None else outer[0](t)

    def get(self, outer) -> torch.Tensor:
        if self.copy is not None:
            return self.copy.dequantize().as_strided(*self.view)
        return self.packed if outer is None else outer[1](self.packed)


class _OutCopy:
    """The output's FP8 tiles as the hooks around us keep them (packed once for every holder)."""

    def __init__(self, tiles: Fp8Tiles, outer):
        self.dtype, self.outer = tiles.dtype, outer
        self.packed = tiles.tensors if outer is None else tuple(outer[0](t) for t in tiles.tensors)

    def dequantize(self) -> torch.Tensor:
        data, scale = self.packed if self.outer is None else (self.outer[1](p) for p in self.packed)
        return Fp8Tiles(data, scale, self.dtype).dequantize()


def attn_out_fp8_cached(wo, attend) -> torch.Tensor:
    """The `out_proj` seam under item "attn_out": wo(attend()) where every copy of the attention output
    that backward keeps (the core's, and wo's input, a view of it) is one FP8 copy. What attend saves is
    held until its output is known, then settled (as `recompute_from` nests its hooks)."""
    if not torch.is_grad_enabled():
        return project_now(wo, attend)
    outer, held = enclosing_hooks(), []

    def pack(t):
        held.append(_Held(t))
        return held[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.get(outer)):
        out = attend()
    tiles = Fp8Tiles.quantize(out, pow2=True)
    copy = _OutCopy(tiles, outer)
    # the storages' identity, not their data_ptr (0 for every meta tensor in the dry run)
    covers = out.is_contiguous() and out.storage_offset() == 0 and \
        out.untyped_storage().nbytes() == out.numel() * out.element_size()
    for h in held:
        h.settle(out.untyped_storage()._cdata if covers else None, copy, outer)
    return wo(out.flatten(2), keep=KeepTiles(tiles, wo.keep_input))
