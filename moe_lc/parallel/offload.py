"""Activation offloading (`train.offload`): what named modules save for backward lives in host memory
between their forward and their backward.

Items (moe_lc/config/choices.py `OffloadItem`), each the modules whose forward's saved tensors move:

    attn_core    every attention module's core (the kernel call, or the ring under context parallelism):
                 q, k, v, the output and the LSE it keeps
    expert_fc1   the routed experts' up projection (w13): its input rows, kept for w13's weight gradient
    experts      everything the routed experts keep: w13's input, the SwiGLU's gate|up (and its output
                 unless recompute's "swiglu" replays it), w2's input

How: forward pre / post hooks on those modules enter and leave autograd's saved-tensor hooks, so that
each tensor the module saves (parameters and tensors under `MIN_BYTES` excepted) is copied to host
memory and the device copy dropped; backward copies it back. On a GPU the copies run on a stream of their
own into pinned memory, and when backward first reaches a module call's tensors it starts copying back
the call saved just before it (the next backward needs them), so transfers overlap compute. On a CPU
the same code copies into fresh host tensors (no memory is saved: the host is the device; the tests hold
the path to bit-exactness), and on the meta device (the planner's trace, the dry run) only the shape is
kept (the bytes told to trace_hooks' `offloaded` watchers instead of the trace's device bytes) and backward gets a fresh
tensor, allocated where the copy back would be.

Values are unchanged: a tensor comes back bit for bit, with its strides. The recipe's rules refuse it where
it would move nothing or only copies of what stays on the device: recompute policy "full", attn_core
beside the "attention" replay, experts beside the SwiGLU replay or FP8 cache, and train.compile.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from moe_lc.model.moe import RoutedExperts
from moe_lc.parallel.trace_hooks import tell

MIN_BYTES = 64 * 1024  # smaller saved tensors (routing counts, scalars) stay: a copy costs more than they hold


def offloaded_modules(model: nn.Module, items) -> list[nn.Module]:
    """The modules whose forwards' saved tensors `items` move to the host."""
    from moe_lc.config.attention_kinds import module_kinds

    kinds, out = tuple(module_kinds()), []
    for module in model.modules():
        if "attn_core" in items and isinstance(module, kinds):
            out += [m for m in (getattr(module, "core", None), getattr(module, "sparse_core", None))
                    if isinstance(m, nn.Module)]
        elif isinstance(module, RoutedExperts):
            if "experts" in items:
                out.append(module)
            elif "expert_fc1" in items:
                out.append(module.w13)
    return out


class _Saved:
    """One saved tensor while it is away: its host copy (on meta, its (shape, stride, dtype)), and once
    fetched its device copy with the event that says it has landed."""

    __slots__ = ("host", "device", "ready", "used", "__weakref__")

    def __init__(self, host: torch.Tensor):
        self.host, self.device, self.ready, self.used = host, None, None, False


def _empty_like(t: torch.Tensor, device, pin: bool) -> torch.Tensor:
    """An uninitialized tensor like t on `device`, with t's strides where they are dense (so that a kernel
    reading it back takes the same path), contiguous otherwise."""
    if _dense(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device, pin_memory=pin)
    return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its strided span exactly (contiguous, or a permutation of it)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.numel() > 0 and span == t.numel() and all(s > 0 for n, s in zip(t.shape, t.stride()) if n > 1)


class ActivationOffload:
    """The hooks on one rank's model, installed by the constructor (`remove` takes them off); host bytes
    held now and at most (`host_bytes`, `peak`)."""

    def __init__(self, model: nn.Module, items, device: torch.device | str):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.calls: list[list[weakref.ref]] = []  # each module call's saved tensors, in forward order
        self.host_bytes = self.peak = 0
        self.modules = offloaded_modules(model, items)
        self.handles = []
        for module in self.modules:
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))
        self._open: list = []

    # -- module hooks ---------------------------------------------------------------------------------
    def _enter(self, module, args):
        if not torch.is_grad_enabled():
            self._open.append(None)
            return
        call: list[weakref.ref] = []
        self.calls = [c for c in self.calls if any(r() is not None for r in c)]  # calls backward freed
        self.calls.append(call)
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, call), self._unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def _leave(self, module, args, output):
        hooks = self._open.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    # -- saved-tensor hooks ---------------------------------------------------------------------------
    def _pack(self, t, call: list):
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t  # weights (and their transposed views) stay where the optimizer updates them
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES:
            return t
        if t.device.type == "meta":  # the planner's trace or the dry run: nothing to copy, and t must go
            tell("offloaded", t)
            saved = _Saved((t.shape, t.stride(), t.dtype))
        elif self.stream is not None:
            host = _empty_like(t, "cpu", True)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # the allocator keeps t's memory until the copy has read it
            saved = _Saved(host)
            saved.ready = torch.cuda.Event()
            saved.ready.record(self.stream)
        else:
            host = _empty_like(t, "cpu", False)
            host.copy_(t)
            saved = _Saved(host)
        self._book(saved, nbytes)
        call.append(weakref.ref(saved))
        return saved

    def _book(self, saved: _Saved, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.peak = max(self.peak, self.host_bytes)
        weakref.finalize(saved, self._unbook, nbytes)

    def _unbook(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if isinstance(saved.host, tuple):  # meta: a fresh tensor, as backward would allocate the copy
            shape, stride, dtype = saved.host
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if self.stream is None:
            return saved.host  # a CPU rank: the host copy is already where backward runs
        if saved.device is None:
            self._prefetch_before(saved)
            if saved.device is None:
                self._fetch(saved)
        torch.cuda.current_stream(self.device).wait_event(saved.ready)
        out, saved.device, saved.used = saved.device, None, True
        return out

    def _fetch(self, saved: _Saved) -> None:
        """Start copying `saved` back to the device on the offload stream (after its D2H copy)."""
        dev = _empty_like(saved.host, self.device, False)  # allocated on the compute stream, which reads it
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dev.copy_(saved.host, non_blocking=True)
        saved.device, saved.ready = dev, torch.cuda.Event()
        saved.ready.record(self.stream)

    def _prefetch_before(self, saved: _Saved) -> None:
        """Backward has reached `saved`'s module call: fetch it and the whole call saved just before."""
        for i, call in enumerate(self.calls):
            if any(r() is saved for r in call):
                for group in (call, self.calls[i - 1] if i > 0 else []):
                    for r in group:
                        s = r()
                        if s is not None and s.device is None and not s.used and isinstance(s.host, torch.Tensor):
                            self._fetch(s)
                return

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
