"""A forward run phase by phase, so that its backward can also run phase by phase.

DualPipe's F&B step overlaps the forward of one micro-batch with the backward of another: while
one's tokens are in flight (expert dispatch / combine all-to-all), the other computes. That needs
both passes cut at the same places. `PhasedRun` executes the chain of phases a model exposes
(`Transformer.phases`: attention, dispatch, experts, combine per MoE block) and cuts every tensor at
each boundary from the graph before it, so each phase owns a separate autograd graph whose backward
can be called on its own, in reverse order, interleaved with anything else.

A boundary keeps a tensor alive only where a phase saves it for its own backward (Megatron-LM's
"deallocate_output_tensor", applied inside a stage): the next phase gets a detached alias whose
gradient lands in a box (`_Cut`), not a leaf that its AccumulateGrad node would hold for as long as
the graph lives, and the producing phase's output keeps only its graph, its data released. The
experts' outputs (top-k rows of D per token), which combine's all-to-all reads but does not save, are
then freed as soon as combine has run.

`interleave(f_run, b_run, grad, ...)` alternates one forward phase of f_run with one backward phase
of b_run (DualPipe's schedule within an F&B). On CPU this is only a different, equally correct
order; on GPU the communication of one half can hide behind the compute of the other.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


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
        self._next = (x,)
        self._anchor = torch.empty(0, requires_grad=True)

    # -- forward ----------------------------------------------------------------------------------
    def forward_done(self) -> bool:
        return len(self.outputs) == len(self.phases)

    def _cut(self, t):
        """A boundary tensor as the next phase's input, and the box of its gradient."""
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            box = []
            return _Cut.apply(t.detach(), self._anchor, box), box
        return (t.detach() if isinstance(t, torch.Tensor) else t), None

    def forward_phase(self) -> None:
        k = len(self.outputs)
        if k == 0:
            ins, boxes = self._next, ()
        else:
            ins, boxes = zip(*(self._cut(t) for t in self._next)) if self._next else ((), ())
            for t in self._next:  # the next phase holds its own aliases now
                _release(t)
        out = tuple(_handoff(t) for t in self.phases[k](*ins))
        self.boxes.append(tuple(boxes))
        self.outputs.append(out)
        self._next = out

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
        deallocate_output_tensor)."""
        _release(self.output)

    # -- backward ---------------------------------------------------------------------------------
    def start_backward(self, grad: torch.Tensor | None, scale: float = 1.0) -> None:
        """grad: gradient of the chunk output; None when the output is the loss (scaled by `scale`)."""
        self._grads = None if grad is None else (grad,)
        self._scale = scale
        self._k = len(self.phases) - 1

    def backward_done(self) -> bool:
        return self._k < 0

    def backward_phase(self) -> None:
        k = self._k
        outs = self.outputs[k]
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

    def backward_all(self, grad, scale: float = 1.0, store=None) -> None:
        self.start_backward(grad, scale)
        while not self.backward_done():
            with store.deferring() if store is not None else nullcontext():
                self.backward_phase()

    @property
    def input_grad(self) -> torch.Tensor | None:
        """Gradient of the chunk's input (valid once the backward is done)."""
        return self._grads[0] if self._grads else None


def interleave(f_run: PhasedRun, b_run: PhasedRun, b_grad, b_scale: float, b_store=None) -> list[str]:
    """Alternate forward phases of f_run with backward phases of b_run until both finish.
    Returns the order taken ("F<k>" / "B<k>"), which the runtime records in its trace."""
    order = []
    b_run.start_backward(b_grad, b_scale)
    while not (f_run.forward_done() and b_run.backward_done()):
        if not f_run.forward_done():
            order.append(f"F{len(f_run.outputs)}")
            f_run.forward_phase()
        if not b_run.backward_done():
            order.append(f"B{b_run._k}")
            with b_store.deferring() if b_store is not None else nullcontext():
                b_run.backward_phase()
    return order
