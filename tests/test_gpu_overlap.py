"""On a GPU: an F&B pair hides each micro-batch's transfers behind the other's compute on CUDA streams.

Two micro-batches of a toy MoE chain (attention -> dispatch -> experts -> combine, matmuls of known
size) run as one F&B pair (moe_lc.parallel.pipeline.overlap.interleave). The transfers are a fake
all-to-all of known duration: `torch.cuda._sleep` on a side stream, waited by an event where the
rows are used, as NCCL's own stream is, each sized to 0.8 of the compute phase beside it (measured first:
a fixed sleep outgrew an H100's compute 50x). Measured with CUDA events: the pair with its transfers takes
less than its compute plus half the transfers' time, and a pair whose transfers are waited at once
(parallel.overlap = false) takes about the sum. Skipped without a GPU (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.model.seams import Transfer

pytestmark = pytest.mark.gpu
PROBE_CYCLES = 20_000_000  # ~10 ms at ~2 GHz; the transfers are sized from it to the compute they hide behind


class _SleepTransfer(Transfer):
    def __init__(self, x, side: torch.cuda.Stream, wait_now: bool, cycles: int):
        self.x, self.side, self.wait_now, self.cycles = x, side, wait_now, cycles

    def start(self):
        x, self.x = self.x, None
        return _Start.apply(x, self)

    def finish(self, stand_in):
        return _Finish.apply(stand_in, self)

    def send(self, t):
        """'Transfer' t on the side stream; returns (copy, event)."""
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.cycles)
            out = t.clone()
            event = torch.cuda.Event()
            event.record()
        out.record_stream(main)
        if self.wait_now:
            main.wait_event(event)
        return out, event


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t):
        ctx.t = t
        t.out, t.event = t.send(x)
        return x.new_empty(()).expand_as(x)

    @staticmethod
    def backward(ctx, _):
        torch.cuda.current_stream().wait_event(ctx.t.grad_event)
        return ctx.t.grad, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stand_in, t):
        ctx.t = t
        torch.cuda.current_stream().wait_event(t.event)
        return t.out

    @staticmethod
    def backward(ctx, grad):
        ctx.t.grad, ctx.t.grad_event = ctx.t.send(grad)
        return grad, None


def _compute(x, w):
    for _ in range(4):
        x = torch.tanh(x @ w)
    return x


def _phases(w: torch.Tensor, side, wait_now: bool, cycles: int, blocks: int = 4):
    chain = []
    for _ in range(blocks):
        chain += [lambda x: (_compute(x, w),),
                  lambda x: (x, _SleepTransfer(_compute(x, w), side, wait_now, cycles)),
                  lambda x, rows: (x, _SleepTransfer(_compute(rows, w), side, wait_now, cycles)),
                  lambda x, rows: (x + rows,)]
    chain.append(lambda x: (x.float().square().mean(),))
    return chain


def _operands():
    torch.manual_seed(0)
    # ~1.6 ms of matmuls per compute phase on an H100: well above the host's launch time
    return (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64,
            torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16))


def _pair_ms(wait_now: bool, cycles: int) -> float:
    from moe_lc.parallel.pipeline.overlap import PhasedRun, interleave

    w, x = _operands()
    side = torch.cuda.Stream()
    b_run = PhasedRun(_phases(w, side, wait_now, cycles), x.clone().requires_grad_())
    b_run.forward_all()
    f_run = PhasedRun(_phases(w, side, wait_now, cycles), x.clone().requires_grad_())
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    interleave(f_run, b_run, None, 1.0)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def test_f_and_b_pair_hides_transfers_on_cuda_streams():
    w, x = _operands()
    _compute(x, w)  # warm-up
    compute_ms = min(_event_ms(lambda: _compute(x, w)) for _ in range(5))
    probe_ms = _event_ms(lambda: torch.cuda._sleep(PROBE_CYCLES))
    cycles = int(PROBE_CYCLES * 0.8 * compute_ms / probe_ms)  # each transfer ~0.8 of the phase beside it
    _pair_ms(True, cycles), _pair_ms(False, cycles)  # warm-up: kernels, allocator
    transfers = 4 * 2 * 2 * _event_ms(lambda: torch.cuda._sleep(cycles))  # 4 blocks x 2 x (F of one, B of other)
    serial, overlapped = _pair_ms(True, cycles), _pair_ms(False, cycles)
    print(f"F&B pair: transfers waited at once {serial:.1f} ms, overlapped {overlapped:.1f} ms "
          f"(transfers alone {transfers:.1f} ms)")
    assert overlapped < serial - 0.5 * transfers
