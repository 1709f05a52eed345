"""A forward run phase by phase, so that its backward can also run phase by phase.

DualPipe's F&B step overlaps the forward of one micro-batch with the backward of another: while
one's tokens are in flight (expert dispatch / combine all-to-all), the other computes. That needs
both passes cut at the same places. `PhasedRun` executes the chain of phases a model exposes
(`Transformer.phases`: attention, dispatch, experts, combine per MoE block) and detaches every
tensor at each boundary into a fresh leaf, so each phase owns a separate autograd graph whose
backward can be called on its own, in reverse order, interleaved with anything else.

`interleave(f_run, b_run, grad, ...)` alternates one forward phase of f_run with one backward phase
of b_run (DualPipe's schedule within an F&B). On CPU this is only a different, equally correct
order; on GPU the communication of one half can hide behind the compute of the other.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def _leaf(t):
    """A boundary: floating tensors continue as new leaves (keeping requires_grad); others pass."""
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().requires_grad_(t.requires_grad)
    return t


class PhasedRun:
    """One micro-batch through one chunk: phases[k] maps the tuple of tensors from phase k-1."""

    def __init__(self, phases: list, x):
        self.phases = phases
        self.first = x
        self.inputs: list[tuple] = []   # leaves each phase consumed
        self.outputs: list[tuple] = []  # what each phase produced (attached to its graph)
        self._next = (x,)

    # -- forward ----------------------------------------------------------------------------------
    def forward_done(self) -> bool:
        return len(self.outputs) == len(self.phases)

    def forward_phase(self) -> None:
        k = len(self.outputs)
        ins = self._next if k == 0 else tuple(_leaf(t) for t in self._next)
        out = self.phases[k](*ins)
        self.inputs.append(ins)
        self.outputs.append(out)
        self._next = out

    def forward_all(self):
        while not self.forward_done():
            self.forward_phase()
        return self.output

    @property
    def output(self) -> torch.Tensor:
        return self.outputs[-1][0]

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
        ins = self.inputs[k]
        self._grads = tuple(t.grad if isinstance(t, torch.Tensor) and t.is_floating_point() else None for t in ins)
        self.outputs[k] = self.inputs[k] = None  # free the phase's graph and boundary tensors
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
