"""The one Linear: every weight matmul of the model goes through `Linear` or `GroupedLinear`.

Parallel and precision features plug in here instead of wrapping modules again and again:
- `tp`     : a tensor-parallel role object (set by `moe_lc.parallel.tp.mappings`), whose `enter(x)` runs
             before the GEMM (e.g. all-gather of the sequence shards for a column-parallel layer) and
             `exit(y)` after it (e.g. reduce-scatter for a row-parallel layer); both are autograd
             functions with their collectives in the open; `keep(x, keep)` may change how the input is
             kept (a column-parallel layer under SP keeps the sequence shard and gathers it again in
             backward). None = not tensor parallel.
- `gemms`  : the three GEMMs of a linear layer (forward, input-grad, weight-grad); `PlainGemms`
             runs them in the compute dtype, an FP8 recipe (`moe_lc.ops.fp8`) quantizes their inputs
             (`gemms.weight` gives the weight operand: an FP8 recipe's copy kept per optimizer step).
- `wgrad_store`: when it is deferring, the weight-gradient GEMM is queued instead of run, for a
             later "W" action of a zero-bubble / DualPipe schedule (`WeightGradStore`).
- `keep_input`: how the input is kept for the weight-gradient GEMM (`KeepInput`: as is by default;
             FP8 activation caching keeps it quantized, `moe_lc.ops.fp8_linear.KeepFp8ForWgrad`); a
             caller that already keeps the input in another form passes its own to `forward`.

Compute dtype = the input's dtype; the weight is cast to it (bf16 weights with fp32 input compute in
fp32, which the router uses). Weight gradients come back in the weight's dtype.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from moe_lc.ops.grouped_gemm import grouped_mm, grouped_mm_wgrad


class PlainGemms:
    """The GEMMs of y = x W^T in the compute dtype. x: (T, in), W: (out, in), dy: (T, out)."""

    name = "plain"

    def weight(self, weight, param, dtype):
        """The weight operand of fprop / dgrad: the weight in the compute dtype (an FP8 recipe may give its
        cached FP8 copy, quantized once per optimizer step: `Fp8Gemms.weight`)."""
        return weight.to(dtype)

    def fprop(self, x, w):
        return x @ w.t()

    def dgrad(self, dy, w):
        return dy @ w

    def wgrad(self, dy, x):
        return dy.t() @ x

    # grouped (experts): W: (E, out, in), rows of x grouped by `counts`
    def grouped_fprop(self, x, w, counts):
        return grouped_mm(x, w.transpose(-1, -2), counts)

    def grouped_dgrad(self, dy, w, counts):
        return grouped_mm(dy, w, counts)

    def grouped_wgrad(self, dy, x, counts):
        return grouped_mm_wgrad(dy, x, counts)


PLAIN = PlainGemms()


class WeightGradStore:
    """Deferred weight-gradient GEMMs: the backward of a split schedule runs B now, W later.

    Inside `with store.deferring():` every Linear that uses this store queues its weight-gradient
    closure instead of running it; `flush()` runs the queue and accumulates into `param.grad`,
    firing the parameter's post-accumulate-grad hooks exactly as autograd would (the ZeRO-1 gradient
    buffer listens to those hooks).
    """

    def __init__(self):
        self._deferring = False
        self._queue: list[tuple[nn.Parameter, Callable[[], torch.Tensor]]] = []

    @contextmanager
    def deferring(self):
        prev, self._deferring = self._deferring, True
        try:
            yield self
        finally:
            self._deferring = prev

    @property
    def is_deferring(self) -> bool:
        return self._deferring

    def push(self, param: nn.Parameter, compute: Callable[[], torch.Tensor]) -> None:
        self._queue.append((param, compute))

    def __len__(self) -> int:
        return len(self._queue)

    def take(self) -> list[tuple[nn.Parameter, Callable[[], torch.Tensor]]]:
        """Remove and return the queued closures (a pipeline keeps them per micro-batch)."""
        queue, self._queue = self._queue, []
        return queue

    @staticmethod
    @torch.no_grad()
    def run(queue) -> None:
        """Compute queued weight gradients and accumulate them (the "W" action). Like autograd's own
        backward: no graph, and one accumulation per parameter (a weight used twice in the pass, such
        as the output head shared with MTP, gets the sum of its closures, so its hooks fire once)."""
        grads: dict[int, list] = {}
        for param, compute in queue:
            entry = grads.setdefault(id(param), [param, None])
            g = compute()  # a fresh tensor: summed in place, so a weight used twice costs two, not three
            entry[1] = g if entry[1] is None else entry[1].add_(g)
        for param, grad in grads.values():
            accumulate_grad(param, grad)

    def flush(self) -> None:
        self.run(self.take())


def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Param's tensor hooks on grad, param.grad += grad, then its post-accumulate-grad hooks (what
    autograd itself does; e.g. tensor parallelism sums replicated rows' gradients in a tensor hook)."""
    for hook in (getattr(param, "_backward_hooks", None) or {}).values():
        out = hook(grad)
        grad = grad if out is None else out
    param.grad = grad if param.grad is None else param.grad + grad
    # torch keeps these hooks in a private dict; there is no public way to fire them by hand.
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


class KeepInput:
    """How a Linear keeps its input x2 (T, in) for the weight gradient: `save` -> the tensors autograd
    saves, `restore` -> the wgrad GEMM's operand again; `hold_dy` / `hold_input` -> what a deferred W
    holds of the output gradient and of the input from B until W. This one keeps all as they are."""

    def save(self, x2, counts, gemms) -> tuple:
        return (x2,)

    def restore(self, saved, counts, gemms):
        return saved[0]

    def hold_dy(self, dy2, counts, gemms):
        return dy2

    def hold_input(self, saved, counts, gemms):
        return self.restore(saved, counts, gemms)

    def begin_restore(self, saved, counts, gemms) -> Callable[[], torch.Tensor]:
        """`restore` started before the input-gradient GEMM and finished after it: a keep whose restore
        communicates (a sequence shard's all-gather) overlaps it with that GEMM. Returns the finisher."""
        return lambda: self.restore(saved, counts, gemms)


KEEP_AS_IS = KeepInput()


class _LinearFn(torch.autograd.Function):
    """y = x W^T (+ b) with an explicit backward so that W's gradient can be deferred or quantized.

    x: (..., in) compute dtype; weight: (out, in) or grouped (E, out, in) with `counts` (E,) giving
    rows of x per expert; bias: (out,) or None; keep: a `KeepInput`. Returns (..., out) in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, counts, gemms, store, param, keep):
        w = gemms.weight(weight, param, x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        y = gemms.fprop(x2, w) if counts is None else gemms.grouped_fprop(x2, w, counts)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(weight, counts, *keep.save(x2, counts, gemms))
        ctx.gemms, ctx.store, ctx.keep, ctx.has_bias = gemms, store, keep, bias is not None
        ctx.x_shape, ctx.dtype = x.shape, x.dtype
        # The Parameter itself, for a deferred W: what ctx.saved_tensors returns under saved-tensor
        # hooks (activation checkpointing) is an alias, and a gradient set on it would be lost.
        ctx.param = param
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        weight, counts, *kept = ctx.saved_tensors
        gemms, keep, dtype = ctx.gemms, ctx.keep, ctx.dtype
        dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype)
        w = gemms.weight(weight, ctx.param, dtype)  # the Parameter: a recomputed region hits its FP8 copy too
        deferring = ctx.store is not None and ctx.store.is_deferring
        wgrad_now = ctx.needs_input_grad[1] and not deferring
        x_w = keep.begin_restore(kept, counts, gemms) if wgrad_now else None  # beside the dgrad GEMM
        dx = gemms.dgrad(dy2, w) if counts is None else gemms.grouped_dgrad(dy2, w, counts)

        def weight_grad(dy_w, x_w):
            g = gemms.wgrad(dy_w, x_w) if counts is None else gemms.grouped_wgrad(dy_w, x_w, counts)
            return g.to(weight.dtype)

        dw = None
        if wgrad_now:
            dw = weight_grad(dy2, x_w())
        elif ctx.needs_input_grad[1]:  # W later: hold dy and x in the form `keep` asks (FP8 caching: quantized now)
            held = keep.hold_dy(dy2, counts, gemms), keep.hold_input(kept, counts, gemms)
            ctx.store.push(ctx.param, lambda: weight_grad(*held))
        db = dy2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx.view(ctx.x_shape), dw, db, None, None, None, None, None


class Linear(nn.Module):
    """y = x W^T (+ b).  weight: (out_features, in_features); sharding (if any) is set from outside."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.tp = None
        self.gemms = PLAIN
        self.fp8_eligible = True  # the precision step quantizes only eligible layers
        self.wgrad_store: WeightGradStore | None = None
        self.defer_wgrad = True  # a split-backward schedule may defer its W (False: always in B)
        self.keep_input: KeepInput = KEEP_AS_IS

    def forward(self, x: torch.Tensor, keep: KeepInput | None = None) -> torch.Tensor:
        """x (..., in) -> (..., out). `keep`: how to keep x for the weight gradient, if not `keep_input`
        (it must describe x as the GEMM sees it: the TP role's `enter` may not change it)."""
        keep = keep or self.keep_input
        if self.tp is not None:
            entered = self.tp.enter(x)
            assert keep is self.keep_input or entered is x, "a kept input must be the GEMM's input"
            keep = self.tp.keep(x, keep)  # sequence parallelism: the shard, gathered again in backward
            x = entered
        # a role that sums the ranks' outputs (row-parallel) adds the replicated bias once, after the sum
        bias_after = self.bias is not None and getattr(self.tp, "sums_outputs", False)
        y = _LinearFn.apply(x, self.weight, None if bias_after else self.bias, None, self.gemms, self.wgrad_store,
                            self.weight, keep)
        y = self.tp.exit(y) if self.tp is not None else y
        return y + self.bias.to(y.dtype) if bias_after else y

    def extra_repr(self) -> str:
        tp = f", tp={self.tp}" if self.tp is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, gemms={self.gemms.name}{tp}"


class GroupedLinear(nn.Module):
    """Per-expert y_e = x_e W_e^T over expert-sorted rows.  weight: (n_experts, out, in)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, *, device=None, dtype=None):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features, device=device, dtype=dtype))
        self.gemms = PLAIN
        self.fp8_eligible = True
        self.wgrad_store: WeightGradStore | None = None
        self.defer_wgrad = True
        self.keep_input: KeepInput = KEEP_AS_IS

    def forward(self, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x: (T, in) rows sorted by expert, counts: (n_experts,) int64 -> (T, out)."""
        return _LinearFn.apply(x_TD, self.weight, None, counts_E, self.gemms, self.wgrad_store, self.weight,
                               self.keep_input)

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, in={self.in_features}, out={self.out_features}, gemms={self.gemms.name}"

