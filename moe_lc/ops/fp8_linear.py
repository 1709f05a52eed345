"""FP8 GEMMs for the one Linear: `Fp8Gemms` replaces `PlainGemms` on FP8-eligible layers.

Recipes (`precision.fp8_scaling`):
    blockwise   DeepSeek-V3: activations and output-grads per 1x128 tile, weights per 128x128 block
    tensorwise  one scale per tensor from its current amax (the common baseline)
    delayed     one scale per tensor from the amax history of the previous steps (per layer, per operand)
All E4M3 with fp32 accumulation; outputs return in the compute dtype, weight gradients in fp32 for
the master-weight path. Backends (`precision.fp8_backend`):
    te          Transformer Engine's quantizers and cuBLASLt FP8 GEMMs (`moe_lc.ops.fp8_te`); an error
                where TE is not importable or the device has no such GEMM
    scaled_mm   `torch._scaled_mm` where `moe_lc.ops.fp8.scaled_mm_support` finds a kernel, else emulate
    emulate     quantize and dequantize exactly, multiply in fp32 (the same numbers on any device)
    auto        te where it runs, else scaled_mm where it runs, else emulate
All use the same scales (amax/448 per tile, block or tensor), so they differ only by fp32 rounding.
Weights (`precision.fp8_weight_cache`): scaled_mm and emulate take fprop's and dgrad's weight from the
Parameter's FP8 copy, quantized once per optimizer step (`moe_lc.ops.fp8_weights`; blockwise and tensorwise).
The embedding, output head, router, norms and attention core never come here (fp8_eligible=False or
not a Linear), as in DeepSeek-V3.
"""

from __future__ import annotations

import torch

from moe_lc.config.choices import Fp8Backend, Fp8Scaling, names
from moe_lc.ops import fp8, fp8_te
from moe_lc.ops.fp8_weights import CachedWeight, WeightCache
from moe_lc.ops.grouped_gemm import host_sizes
from moe_lc.ops.linear import GroupedLinear, KeepInput, Linear

SCALINGS = names(Fp8Scaling)
BACKENDS = names(Fp8Backend)


def gemm_recipe(scaling: str) -> str:
    """The `moe_lc.ops.fp8` recipe a scaling runs: delayed is tensorwise with a history's amax."""
    return "blockwise" if scaling == "blockwise" else "tensorwise"


class Fp8Gemms:
    """fprop / dgrad / wgrad (and their grouped forms) with FP8 inputs. x: (T, K), w: (N, K), dy: (T, N)."""

    def __init__(self, scaling: str = "blockwise", backend: str = "auto", cache_weights: bool = False):
        if scaling not in SCALINGS or backend not in BACKENDS:
            raise ValueError(f"fp8 scaling {scaling!r} / backend {backend!r}: expected one of {SCALINGS} / {BACKENDS}")
        self.scaling, self.backend = scaling, backend
        self.recipe = gemm_recipe(scaling)
        self.name = f"fp8-{scaling}"
        # delayed scaling keeps an amax history per operand role
        self.history = {role: fp8.DelayedScaling() for role in ("x", "w", "dy")} if scaling == "delayed" else None
        # the weights' FP8 copies, once per optimizer step (delayed scaling's weight scale changes at every GEMM)
        self.weights = WeightCache(self.recipe) if cache_weights and self.history is None else None

    def caches_weights(self, device) -> bool:
        """Whether fprop and dgrad on ``device`` take the weight from its FP8 copy (not under TE, which
        quantizes for itself)."""
        return self.weights is not None and self.implementation(device) != "te"

    def weight(self, weight: torch.Tensor, param, dtype: torch.dtype):
        """The weight operand of fprop / dgrad (`moe_lc.ops.linear`'s hook): ``param``'s cached FP8 copy where
        `caches_weights`, else ``weight`` cast to the compute dtype. ``param``: the Parameter itself (the saved
        ``weight`` may be an alias of it in backward, under saved-tensor hooks: recomputation, offloading)."""
        if isinstance(param, torch.nn.Parameter) and self.caches_weights(weight.device):
            return CachedWeight(param, dtype, self.weights)
        return weight.to(dtype)

    def implementation(self, device) -> str:
        """What runs on ``device``: "te", "scaled_mm" or "emulate" (see the module docstring)."""
        if self.backend == "emulate":
            return "emulate"
        if self.backend == "te" or (self.backend == "auto" and fp8_te.unsupported_reason(device, self.recipe) is None):
            return "te"
        return "scaled_mm" if fp8.scaled_mm_support(device, self.recipe) else "emulate"

    def _amax(self, role: str, t: torch.Tensor):
        """Delayed scaling: the history's amax (None on the first step), then record t's amax."""
        if self.history is None:
            return None
        assert not isinstance(t, fp8.Quantized), "delayed scaling quantizes at GEMM time (no FP8 input cache)"
        hist = self.history[role]
        amax = hist.scale_amax()
        hist.update(t.detach().abs().amax().float())
        return amax

    def _run(self, gemm: str, a: torch.Tensor, b: torch.Tensor, roles: tuple[str, str], out_dtype) -> torch.Tensor:
        """a, b: the 2-D inputs of `gemm`, (x, w) / (dy, w) / (dy, x); delayed scaling reads their roles' amaxes."""
        if isinstance(b, CachedWeight):  # fprop's w or dgrad's w^T, quantized once per optimizer step
            b = b.operand(gemm)
        amaxes = self._amax(roles[0], a), self._amax(roles[1], b)
        impl = self.implementation(a.device)
        if impl == "te":  # TE quantizes for itself: a cached wgrad operand goes in dequantized (M, .) fp32
            a, b = (t.dequantize().t() if isinstance(t, fp8.Quantized) else t for t in (a, b))
            out = fp8_te.te_gemm(gemm, a, b, self.recipe, *amaxes, out_dtype=out_dtype)
        elif impl == "scaled_mm":
            out = fp8.fp8_gemm_scaled_mm(gemm, a, b, self.recipe, *amaxes, out_dtype)
        else:
            out = fp8.fp8_gemm_emulated(gemm, a, b, self.recipe, *amaxes)
        return out.to(out_dtype)

    def fprop(self, x, w):
        return self._run("fprop", x, w, ("x", "w"), x.dtype)

    def dgrad(self, dy, w):
        return self._run("dgrad", dy, w, ("dy", "w"), dy.dtype)

    def wgrad(self, dy, x):
        return self._run("wgrad", dy, x, ("dy", "x"), torch.float32)

    # Experts: one FP8 GEMM per expert over its rows (weights are quantized per expert; activation
    # tiles never straddle two experts' tokens, as with a grouped FP8 kernel). The loop needs the
    # split sizes on the host: `host_sizes(counts)`, the dispatcher's host copy under expert
    # parallelism (no sync), else one sync per counts tensor shared by its forward, backward and W.
    def grouped_fprop(self, x, w, counts):
        return self._per_expert(lambda xe, e: self.fprop(xe, w[e]), x, counts, w.shape[1])

    def grouped_dgrad(self, dy, w, counts):
        return self._per_expert(lambda de, e: self.dgrad(de, w[e]), dy, counts, w.shape[2])

    def grouped_wgrad(self, dy, x, counts):
        """dy (T, N), x (T, K), or each a list of its experts' `Quantized` operands (KeepFp8ForWgrad)."""
        sizes = host_sizes(counts)
        dys = dy if isinstance(dy, list) else dy.split(sizes)
        xs = x if isinstance(x, list) else x.split(sizes)
        n, k = (t[0].shape[0] if isinstance(t, list) else t.shape[1] for t in (dy, x))
        device = (dy[0] if isinstance(dy, list) else dy).device
        return torch.stack([self.wgrad(d, xe) if rows else torch.zeros(n, k, dtype=torch.float32, device=device)
                            for d, xe, rows in zip(dys, xs, sizes)])

    @staticmethod
    def _per_expert(gemm, rows, counts, out_features):
        parts = [gemm(r, e) if len(r) else rows.new_zeros(0, out_features)
                 for e, r in enumerate(rows.split(host_sizes(counts)))]
        return torch.cat(parts)


class HoldFp8ForWgrad(KeepInput):
    """A deferred W (ZB-H1, DualPipe) of an FP8 Linear holds dy and x from B until W quantized now,
    exactly as its weight-gradient GEMM will quantize them (`fp8.wgrad_operand`: 1 x 128 tiles along
    the tokens, per expert for grouped layers): about half the bytes of bf16, no number changes. The
    input itself is kept as is (another part keeps or recomputes it). Blockwise and tensorwise
    (current) scaling only: delayed scaling's scale is known at GEMM time only."""

    def hold_dy(self, dy2, counts, gemms):
        return _operands(dy2, counts, gemms)

    def hold_input(self, saved, counts, gemms):
        return _operands(self.restore(saved, counts, gemms), counts, gemms)


def _operands(t: torch.Tensor, counts, gemms):
    if counts is None:
        return fp8.wgrad_operand(t, gemms.recipe)
    return [fp8.wgrad_operand(part, gemms.recipe) for part in t.split(host_sizes(counts))]


class KeepFp8ForWgrad(HoldFp8ForWgrad):
    """FP8 activation caching of a Linear's input (`precision.fp8_cache` item "linear"): keep x from
    forward on quantized as its weight-gradient GEMM will quantize it (see `HoldFp8ForWgrad`). A
    column-parallel Linear under sequence parallelism keeps its shard's copy instead (tensor parallelism's
    `KeepFp8SequenceShard`, moe_lc/parallel/tp/fp8_sequence_shard.py)."""

    def save(self, x2, counts, gemms):
        ops = _operands(x2, counts, gemms)
        return tuple(t for op in ([ops] if counts is None else ops) for t in (op.data, op.scale))

    def restore(self, saved, counts, gemms):
        granularity = fp8.wgrad_granularity(gemms.recipe)
        ops = [fp8.Quantized(saved[i], saved[i + 1], granularity) for i in range(0, len(saved), 2)]
        return ops[0] if counts is None else ops

    def hold_input(self, saved, counts, gemms):
        return self.restore(saved, counts, gemms)


class SharedFp8ForWgrad(KeepFp8ForWgrad):
    """`KeepFp8ForWgrad` for several Linears that read the same input in turn (DeepSeek Sparse Attention's
    wa and its indexer's wkw both read the normalized x): the input is quantized once and every one of them
    saves that copy. Only for stateless scaling (blockwise, tensorwise: the copy is the same whoever makes
    it), so the numbers are those of separate copies. The copy is remembered until a save of another input."""

    def __init__(self):
        self._last = None  # (the input's identity, its saved copy)

    def save(self, x2, counts, gemms):
        key = (x2.untyped_storage()._cdata, x2.storage_offset(), tuple(x2.shape), x2._version, counts is None)
        if self._last is not None and self._last[0] == key:
            saved, self._last = self._last[1], None
            return saved
        saved = super().save(x2, counts, gemms)
        self._last = (key, saved)
        return saved


def fp8_gemms(n: int, scaling: str = "blockwise", backend: str = "auto", device=None,
              cache_weights: bool = False) -> list[Fp8Gemms]:
    """FP8 GEMMs for `n` eligible Linears / GroupedLinears (the layer plan picks them,
    moe_lc/parallel/layer_plan.py): stateless recipes share one Fp8Gemms, delayed scaling gets one per
    layer (its amax histories). With ``device`` given, backend "te" is checked up front: ValueError with
    the reason if it cannot run. ``cache_weights``: `precision.fp8_weight_cache` (`Fp8Gemms.weights`)."""
    if backend == "te" and device is not None:
        reason = fp8_te.unsupported_reason(device, gemm_recipe(scaling))
        if reason is not None:
            raise ValueError(reason)
    if scaling == "delayed":
        return [Fp8Gemms(scaling, backend) for _ in range(n)]
    return [Fp8Gemms(scaling, backend, cache_weights)] * n


def quantize_weights_now(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every cached FP8 weight of `model` quantized now (for GEMMs in `dtype`), as after a step's first
    micro-batch: what the planner's traces measure the later micro-batches' working sets from. -> how many."""
    done = 0
    for m in model.modules():
        if isinstance(m, (Linear, GroupedLinear)) and isinstance(m.gemms, Fp8Gemms) \
                and m.gemms.caches_weights(m.weight.device):
            m.gemms.weights.entry(m.weight, dtype)
            done += 1
    return done
