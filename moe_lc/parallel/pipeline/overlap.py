"""A forward run phase by phase, so that its backward can also run phase by phase, and two runs
interleaved so that one's communication hides behind the other's compute.

DualPipe's F&B step overlaps the forward of one micro-batch with the backward of another: while
one's tokens are in flight (expert dispatch / combine all-to-all), the other computes (DeepSeek-V3
report, section 3.2.1, figure 4). That needs both passes cut at the same places. `PhasedRun`
executes the chain of phases a model exposes (`Transformer.phases`: attention, dispatch, experts,
combine per MoE block) and cuts every tensor at each boundary from the graph before it, so each
phase owns a separate autograd graph whose backward can be called on its own, in reverse order,
interleaved with anything else.

Communication sits on the boundaries. A phase may hand rows on as a `Transfer` (an all-to-all,
moe_lc/model/seams.py): the run starts it right after the phase and finishes it (waits) at the
start of the next phase of the same run, so whatever runs in between -- the other micro-batch's
phase -- hides it. In backward the reverse transfer starts at the end of the later phase's backward
and is waited at the start of the earlier one's. `interleave` picks the order: after a phase that
left a transfer in flight it switches to the other run; after one that did not, it stays while the
other run has a transfer in flight, and alternates otherwise. It starts with the backward: a
backward's first phase (combine) starts the reverse combine while the forward's attention runs.

A boundary keeps a tensor alive only where a phase saves it for its own backward (Megatron-LM's
"deallocate_output_tensor", applied inside a stage): the next phase gets a detached alias whose
gradient lands in a box (`_Cut`), not a leaf that its AccumulateGrad node would hold for as long as
the graph lives, and the producing phase's output keeps only its graph, its data released. The
experts' outputs (top-k rows of D per token), which combine's all-to-all reads but does not save, are
then freed as soon as combine has run.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from moe_lc.model.seams import Transfer


class _Cut(torch.autograd.Function):
    """Identity on a detached tensor that starts a new graph; its backward puts the gradient in `box`.
    `anchor` (an empty tensor that requires grad) only makes the output require grad."""

    @staticmethod
    def forward(ctx, x, anchor, box: list):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.box.append(grad)
        return None, None, None


class _Handoff(torch.autograd.Function):
    """Identity whose output is a fresh alias only the runtime holds: its data can be released once the
    next phase has its own alias, whatever the producing phase saved (ops save their own aliases)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _handoff(t):
    return _Handoff.apply(t) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad else t


def _release(t) -> None:
    """Drop a handed-off output's data, keeping its graph: one element broadcast to its shape, so
    autograd's shape check on the gradient still passes."""
    if isinstance(t, torch.Tensor) and isinstance(t.grad_fn, _Handoff._backward_cls):
        t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


class PhasedRun:
    """One micro-batch through one chunk: phases[k] maps the tuple of tensors from phase k-1."""

    def __init__(self, phases: list, x):
        self.phases = phases
        self.first = x                  # the chunk input: a leaf (received activation) or token ids
        self.outputs: list[tuple] = []  # what each phase produced (attached to its graph)
        self.boxes: list[tuple] = []    # per phase after the first, per input: its gradient's box (or None)
        self.received: list[bool] = []  # per phase: its inputs included rows that arrived by a Transfer
        self._next = (x,)
        self._flying: dict[int, Transfer] = {}  # output index -> transfer started after the last phase
        self._anchor = torch.empty(0, requires_grad=True)
        self.record: list | None = None  # when a list: ("F"|"B", label, phase, start, end) per phase run
        self.label = ""

    # -- forward ----------------------------------------------------------------------------------
    def forward_done(self) -> bool:
        return len(self.outputs) == len(self.phases)

    def in_flight(self) -> bool:
        """The next forward phase starts by waiting for a transfer the last one started."""
        return bool(self._flying)

    def _cut(self, t):
        """A boundary tensor as the next phase's input, and the box of its gradient."""
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            box = []
            return _Cut.apply(t.detach(), self._anchor, box), box
        return (t.detach() if isinstance(t, torch.Tensor) else t), None

    def forward_phase(self) -> bool:
        """Run the next phase; True when it left a transfer in flight."""
        k = len(self.outputs)
        if k == 0:
            ins, boxes = self._next, ()
        else:
            ins, boxes = zip(*(self._cut(t) for t in self._next)) if self._next else ((), ())
            for t in self._next:  # the next phase holds its own aliases now
                _release(t)
            ins = tuple(self._flying[i].finish(t) if i in self._flying else t for i, t in enumerate(ins))
        self.received.append(bool(self._flying))
        start = time.perf_counter()
        raw = self.phases[k](*ins)
        self._flying = {i: t for i, t in enumerate(raw) if isinstance(t, Transfer)}
        out = tuple(_handoff(t.start() if isinstance(t, Transfer) else t) for t in raw)
        self.boxes.append(tuple(boxes))
        self.outputs.append(out)
        self._next = out
        if self.record is not None:
            self.record.append(("F", self.label, _name(self.phases[k], k), start, time.perf_counter()))
        return bool(self._flying)

    def forward_all(self):
        while not self.forward_done():
            self.forward_phase()
        return self.output

    @property
    def output(self) -> torch.Tensor:
        return self.outputs[-1][0]

    def release_output(self) -> None:
        """Drop the chunk output's data once the next stage has it (sent, or handed over on this rank):
        no phase of this chunk saves it, and its backward needs only its graph and shape (Megatron's
        deallocate_output_tensor). A no-op once the backward has freed the chunk's graph."""
        if self.outputs and self.outputs[-1] is not None:
            _release(self.output)

    # -- backward ---------------------------------------------------------------------------------
    def start_backward(self, grad: torch.Tensor | None, scale: float = 1.0) -> None:
        """grad: gradient of the chunk output; None when the output is the loss (scaled by `scale`)."""
        self._grads = None if grad is None else (grad,)
        self._scale = scale
        self._k = len(self.phases) - 1
        self._grad_flying = False

    def backward_done(self) -> bool:
        return self._k < 0

    def grad_in_flight(self) -> bool:
        """The next backward phase starts by waiting for a reverse transfer the last one started."""
        return self._grad_flying

    def backward_phase(self) -> bool:
        """Run the next phase's backward; True when it left a reverse transfer in flight."""
        k = self._k
        outs = self.outputs[k]
        start = time.perf_counter()
        if self._grads is None:
            torch.autograd.backward(outs[0] * self._scale)
        else:
            pairs = [(o, g) for o, g in zip(outs, self._grads)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if k == 0:
            x = self.first
            self._grads = (x.grad if isinstance(x, torch.Tensor) and x.is_floating_point() else None,)
        else:
            self._grads = tuple(box[0] if box else None for box in self.boxes[k])
        self.outputs[k] = self.boxes[k] = None  # free the phase's graph
        self._k -= 1
        self._grad_flying = self.received[k]  # its inputs' reverse transfers are on their way
        if self.record is not None:
            self.record.append(("B", self.label, _name(self.phases[k], k), start, time.perf_counter()))
        return self._grad_flying

    def backward_all(self, grad, scale: float = 1.0, store=None) -> None:
        self.start_backward(grad, scale)
        while not self.backward_done():
            with store.deferring() if store is not None else nullcontext():
                self.backward_phase()

    @property
    def input_grad(self) -> torch.Tensor | None:
        """Gradient of the chunk's input (valid once the backward is done)."""
        return self._grads[0] if self._grads else None


def _name(phase, k: int) -> str:
    return f"{k}:{getattr(phase, '__name__', 'phase')}"


def interleave(f_run: PhasedRun, b_run: PhasedRun, b_grad, b_scale: float, b_store=None) -> list[str]:
    """Run the forward phases of f_run and the backward phases of b_run in the order that hides each
    run's transfers behind the other's compute (see the module docstring). Returns the order taken
    ("F<k>" / "B<k>"), which the runtime records in its trace."""
    order = []
    b_run.start_backward(b_grad, b_scale)
    backward = True  # whose phase runs next
    while not (f_run.forward_done() and b_run.backward_done()):
        if backward and b_run.backward_done() or not backward and f_run.forward_done():
            backward = not backward
        if backward:
            order.append(f"B{b_run._k}")
            with b_store.deferring() if b_store is not None else nullcontext():
                left_flying = b_run.backward_phase()
            other_done, other_flying = f_run.forward_done(), f_run.in_flight()
        else:
            order.append(f"F{len(f_run.outputs)}")
            left_flying = f_run.forward_phase()
            other_done, other_flying = b_run.backward_done(), b_run.grad_in_flight()
        if not other_done and (left_flying or not other_flying):
            backward = not backward
    return order
