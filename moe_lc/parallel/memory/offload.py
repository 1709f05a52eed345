"""Activation offloading (`train.offload`): what named modules save for backward lives in host memory
between their forward and their backward.

Items (moe_lc/config/choices.py `OffloadItem`), each the modules whose forward's saved tensors move:

    attn_core    every attention module's core (the kernel call, or the ring under context parallelism;
                 DeepSeek Sparse Attention's `sparse_core` in its sparse stage): q, k, v (DSA: q and the
                 latent key rows), the output and the LSE it keeps (DSA: and the selected positions)
    expert_fc1   the routed experts' up projection (w13): its input rows, kept for w13's weight gradient
    experts      everything the routed experts keep: w13's input, the SwiGLU's gate|up (and its output
                 unless recompute's "swiglu" replays it), w2's input

How: each item's modules (the sources) run inside a scope: attn_core's is the attention module around its
core, the experts items' the source itself. Forward pre / post hooks on the scope enter and leave
autograd's saved-tensor hooks. Inside a source's forward each tensor saved (parameters and tensors under
`MIN_BYTES` excepted) is copied to host memory and the device copy dropped; later in the scope, a tensor
saved again on a storage already moved (the core's output that wo keeps for its weight gradient, DSA's
selection that its indexer loss keeps) shares that host copy, so the device storage really goes; every
other saved tensor passes to the saved-tensor hooks around (a checkpoint, the memory tools) as if these
were not there. Backward copies each back. On a GPU the copies run on a stream of their own into pinned
memory, and when backward first reaches a scope call's tensors it starts copying back the call saved just
before it (the next backward needs them), so transfers overlap compute. On a CPU the same code copies into
fresh host tensors (no memory is saved: the host is the device; the tests hold the path to bit-exactness),
and on the meta device (the planner's trace, the dry run) only the shape is kept (the bytes told to
trace_hooks' `offloaded` watchers instead of the trace's device bytes) and backward gets a fresh tensor,
allocated where the copy back would be.

Values are unchanged: a tensor comes back bit for bit, with its strides. The recipe's rules refuse it where
it would move nothing or only copies of what stays on the device: recompute policy "full", attn_core
beside the "attention" replay, experts beside the SwiGLU replay or FP8 cache, and train.compile.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from moe_lc.model.moe import RoutedExperts
from moe_lc.model.saved_tensors import enclosing_hooks
from moe_lc.parallel.memory.trace_hooks import tell

MIN_BYTES = 64 * 1024  # smaller saved tensors (routing counts, scalars) stay: a copy costs more than they hold


def offloaded_modules(model: nn.Module, items) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(scope, sources) of every module `items` name: the tensors saved inside a source's forward move to
    the host, and within the scope's forward later saves of their storages share the host copies."""
    from moe_lc.config.attention_kinds import module_kinds

    kinds, out = tuple(module_kinds()), []
    for module in model.modules():
        if "attn_core" in items and isinstance(module, kinds):
            cores = [m for m in (getattr(module, "core", None), getattr(module, "sparse_core", None))
                     if isinstance(m, nn.Module)]
            out.append((module, cores))
        elif isinstance(module, RoutedExperts):
            if "experts" in items:
                out.append((module, [module]))
            elif "expert_fc1" in items:
                out.append((module.w13, [module.w13]))
    return out


class _Saved:
    """One saved tensor while it is away: its host copy (on meta, its (shape, stride, dtype)), and once
    fetched its device copy with the event that says it has landed."""

    __slots__ = ("host", "device", "ready", "used", "__weakref__")

    def __init__(self, host: torch.Tensor):
        self.host, self.device, self.ready, self.used = host, None, None, False


class _View:
    """A later save of a moved storage: the _Saved that holds it (its whole storage) and this tensor's view."""

    __slots__ = ("saved", "shape", "stride", "offset")

    def __init__(self, saved: _Saved, t: torch.Tensor):
        self.saved, self.shape, self.stride, self.offset = saved, t.shape, t.stride(), t.storage_offset()


class _Passed:
    """A saved tensor this offload leaves to the hooks around it: what their pack made, and their unpack."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack):
        self.packed, self.unpack = packed, unpack


class _Scope:
    """One call of a scope module while its forward runs: the saved tensors it moved (weak references, for
    the prefetch), how many sources' forwards are running inside it, the storages moved whole {storage
    key: (weak storage, _Saved)}, and the saved-tensor hooks around it (None: none)."""

    def __init__(self, outer):
        self.call: list[weakref.ref] = []
        self.depth, self.moved, self.outer, self.hooks = 0, {}, outer, None


def _empty_like(t: torch.Tensor, device, pin: bool) -> torch.Tensor:
    """An uninitialized tensor like t on `device`, with t's strides where they are dense (so that a kernel
    reading it back takes the same path), contiguous otherwise."""
    if _dense(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device, pin_memory=pin)
    return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)


def _movable(t: torch.Tensor) -> bool:
    """Whether a tensor saved inside a source goes to the host: not a weight (nor a view of one: they stay
    where the optimizer updates them), and at least MIN_BYTES."""
    return not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter) \
        and t.numel() * t.element_size() >= MIN_BYTES


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
        self.calls: list[list[weakref.ref]] = []  # each scope call's moved tensors, in forward order
        self.host_bytes = self.peak = 0
        scopes = offloaded_modules(model, items)
        self.modules = [m for _, sources in scopes for m in sources]
        self.handles = []
        for scope, sources in scopes:  # pre-hooks run in this order, post-hooks too: sources leave first
            self.handles.append(scope.register_forward_pre_hook(self._enter))
            for m in sources:
                self.handles.append(m.register_forward_pre_hook(self._source_enter))
                self.handles.append(m.register_forward_hook(self._source_leave, always_call=True))
            self.handles.append(scope.register_forward_hook(self._leave, always_call=True))
        self._open: list[_Scope | None] = []

    # -- module hooks ---------------------------------------------------------------------------------
    def _enter(self, module, args):
        if not torch.is_grad_enabled():
            self._open.append(None)
            return
        scope = _Scope(enclosing_hooks())
        self.calls = [c for c in self.calls if any(r() is not None for r in c)]  # calls backward freed
        self.calls.append(scope.call)
        scope.hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, scope), self._unpack)
        scope.hooks.__enter__()
        self._open.append(scope)

    def _leave(self, module, args, output):
        scope = self._open.pop()
        if scope is not None:
            scope.hooks.__exit__(None, None, None)
            scope.moved.clear()

    def _source_enter(self, module, args):
        if self._open and self._open[-1] is not None:
            self._open[-1].depth += 1

    def _source_leave(self, module, args, output):
        if self._open and self._open[-1] is not None:
            self._open[-1].depth -= 1

    # -- saved-tensor hooks ---------------------------------------------------------------------------
    def _pack(self, t, scope: _Scope):
        if isinstance(t, torch.Tensor):
            moved = scope.moved.get(t.untyped_storage()._cdata)
            if moved is not None and not moved[0].expired():
                return _View(moved[1], t)  # its storage is on the host already
            if scope.depth and _movable(t):
                return self._move(t, scope)
        return t if scope.outer is None else _Passed(scope.outer[0](t), scope.outer[1])

    def _move(self, t: torch.Tensor, scope: _Scope) -> _Saved:
        nbytes = t.numel() * t.element_size()
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
        scope.call.append(weakref.ref(saved))
        storage = t.untyped_storage()
        if t.storage_offset() == 0 and _dense(t) and nbytes == storage.nbytes():  # the whole storage, strides kept
            scope.moved[storage._cdata] = (StorageWeakRef(storage), saved)
        return saved

    def _book(self, saved: _Saved, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.peak = max(self.peak, self.host_bytes)
        weakref.finalize(saved, self._unbook, nbytes)

    def _unbook(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _unpack(self, saved):
        if isinstance(saved, _Passed):
            return saved.unpack(saved.packed)
        if isinstance(saved, _View):
            return self._unpack(saved.saved).as_strided(saved.shape, saved.stride, saved.offset)
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
