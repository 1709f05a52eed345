"""Rows between two phases of an MoE layer: the expert all-to-all, issued in one phase and waited in the
next, so that a pipeline's other micro-batch computes while the rows are in flight (DualPipe's F&B;
moe_lc/parallel/pipeline/overlap.py). The dispatchers in ep/dispatch.py hand these out as the layer's
`Transfer`s (moe_lc/model/seams.py).
"""

from __future__ import annotations

import torch

from moe_lc.model.seams import Transfer
from moe_lc.ops.fp8_storage import pack_fp8_rows, unpack_fp8_rows
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group


class RowTransfer(Transfer):
    """Rows of x (sum(send), ...) to ep ranks 0..R-1 by `send`, arriving as (sum(recv), ...) in
    source-rank order: the all-to-all between two of an MoE layer's phases (seams.Transfer). The
    collective is issued in `start` and waited in `finish` (at once under parallel.overlap = false);
    in backward the gradient's reverse all-to-all is issued in finish's backward and waited in
    start's. With `fp8`, rows travel as FP8 1 x 128 tiles plus fp32 scales (DeepSeek-V3's dispatch,
    `pack_fp8_rows`) and are dequantized to x's dtype on arrival; gradients return in x's dtype.
    Both sides are sharded over ep (each rank its own rows)."""

    def __init__(self, x: torch.Tensor, recv: list[int], send: list[int], group: Group, overlap: bool = True,
                 fp8: bool = False):
        self.x, self.recv, self.send, self.group, self.overlap, self.fp8 = x, recv, send, group, overlap, fp8
        self.work = self.buffers = self.grad_work = self.grad_buffer = None

    def start(self) -> torch.Tensor:
        x, self.x = self.x, None
        return _StartRows.apply(x, self)

    def finish(self, stand_in: torch.Tensor) -> torch.Tensor:
        return _FinishRows.apply(stand_in, self)

    # -- the collectives (called by the autograd functions below) --------------------------------------
    def _issue(self, x: torch.Tensor) -> None:
        self.dtype, self.width = x.dtype, x.shape[-1]
        payload = pack_fp8_rows(x) if self.fp8 else x.contiguous()
        received = payload.new_empty((sum(self.recv), *payload.shape[1:]))
        self.work = comm.all_to_all(received, payload, self.recv, self.send, self.group, async_op=True)
        self.buffers = (payload, received)  # the payload must live until the op is done
        if not self.overlap:
            self._wait(self.work)

    @staticmethod
    def _wait(work) -> None:
        if work is not None:  # None: a group of one copied at once
            work.wait()

    def _arrived(self) -> torch.Tensor:
        self._wait(self.work)
        (_, received), self.buffers, self.work = self.buffers, None, None
        return unpack_fp8_rows(received, self.width, self.dtype) if self.fp8 else received

    def _issue_grad(self, grad: torch.Tensor) -> None:
        grad = grad.contiguous()
        self.grad_buffer = grad.new_empty((sum(self.send), *grad.shape[1:]))
        self.grad_work = comm.all_to_all(self.grad_buffer, grad, self.send, self.recv, self.group, async_op=True)
        self.grad_payload = grad
        if not self.overlap:
            self._wait(self.grad_work)

    def _grad_arrived(self) -> torch.Tensor:
        self._wait(self.grad_work)
        grad, self.grad_buffer, self.grad_work, self.grad_payload = self.grad_buffer, None, None, None
        return grad


class _StartRows(torch.autograd.Function):
    """Issues a RowTransfer; returns a stand-in of the received rows' shape with no data. Backward:
    waits for the reverse transfer `_FinishRows.backward` issued and returns what it brought."""

    @staticmethod
    def forward(ctx, x, transfer: RowTransfer):
        ctx.transfer = transfer
        transfer._issue(x)
        return x.new_empty(()).expand(sum(transfer.recv), *x.shape[1:])

    @staticmethod
    def backward(ctx, _stand_in_grad):
        return ctx.transfer._grad_arrived(), None


class _FinishRows(torch.autograd.Function):
    """Waits for a RowTransfer and returns the received rows. Backward: issues the reverse transfer of
    the gradient; the gradient it hands on (to the stand-in) only carries the edge to `_StartRows`."""

    @staticmethod
    def forward(ctx, stand_in, transfer: RowTransfer):
        ctx.transfer = transfer
        return transfer._arrived()

    @staticmethod
    def backward(ctx, grad):
        ctx.transfer._issue_grad(grad)
        return grad, None
