"""Executes one rank's pipeline schedule (see schedule_ir.py for the action semantics).

State is keyed by (stage, micro-batch):
    outputs[(s, mb)]      the stage's forward (a PhasedRun: its output is the hidden states, or the
                          summed loss on the last stage), kept with its autograd graphs until B
    acts[(s, mb)]         received (or locally handed-over) input activations waiting for F
    grads[(s, mb)]        received (or locally handed-over) output gradients waiting for B
    input_grads[(s, mb)]  input gradients made by B, waiting for SEND_B
    wqueue[(s, mb)]       deferred weight-gradient GEMMs of a split B, run by W

Every forward runs phase by phase (overlap.PhasedRun), so any backward can run phase by phase too.

Each CommGroup is posted as one batch_isend_irecv when the runtime reaches it (groups keep the
schedule's order, which `validate` proved matched on both sides), and nothing waits there: a
received tensor is waited for by the action that uses it, and a send only before the step ends,
its chunk output released as soon as the send is done. Under `overlap = False` every group is
waited for where it is posted (the same numbers, for comparison). An F&B step runs its forward and
its backward as interleaved phases (overlap.interleave), so that one half's expert all-to-all runs
while the other half computes.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from moe_lc.model.forward_stats import ForwardStats
from moe_lc.ops.linear import WeightGradStore
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.pipeline.overlap import PhasedRun, interleave
from moe_lc.parallel.pipeline.schedule_ir import (
    B, F, FB, RECV_B, RECV_F, SEND_B, SEND_F, W, CommGroup, Schedule,
)


class PipelineRuntime:
    """Runs `schedule.actions[rank]` over this rank's chunk modules, one optimizer step at a time.

    chunks: the rank's chunk modules (Transformer shells, see stage.py), indexed by local chunk.
    hidden_shape: (micro_batch, local sequence, *stream dims) of activations sent between stages: the stream's
    trailing dims are (dim,), or (hc_mult, dim) with mHC (moe_lc/model/residual_stream.py `stream_dims`).
    store: where the chunks' deferring Linears push their weight-gradient GEMMs (the layer plan's
    `wgrad_store`); a split B defers them there, W runs them.
    """

    def __init__(self, schedule: Schedule, rank: int, chunks: list[nn.Module], pp_group: Group,
                 hidden_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, overlap: bool = True,
                 store: WeightGradStore | None = None):
        self.schedule, self.rank, self.chunks = schedule, rank, chunks
        self.pp_group, self.hidden_shape, self.dtype, self.device = pp_group, hidden_shape, dtype, device
        self.overlap = overlap
        self.last_stage = schedule.n_stages - 1
        self.store = store if store is not None else WeightGradStore()  # None: nothing defers (tests)
        self.trace: list[tuple] = []  # what was executed, in order (compared with the schedule in tests)
        # when a list (train.trace_step): ("step" | "action", ...) and the phased runs' phase intervals
        self.timeline: list[tuple] | None = None

    def grad_arrivals(self) -> dict[int, int]:
        """{id(param): backward passes that deliver a gradient to it per step} (`grad_arrivals`)."""
        return grad_arrivals(self.schedule, self.rank, self.chunks)

    # -- one step -----------------------------------------------------------------------------------
    def step(self, batches: list[dict], loss_scale: float, stats: ForwardStats | None = None) -> torch.Tensor:
        """Run every action for one optimizer step. batches[mb]: prepare_batch() output (all ranks
        hold the data: stage 0 reads inputs, the last stage labels). Each micro-batch's summed loss is
        multiplied by loss_scale before backward; every forward adds to `stats` (the step's MTP and aux
        losses). Returns this rank's summed loss (fp64, detached)."""
        self.batches, self.loss_scale, self.stats = batches, loss_scale, stats
        self.outputs, self.acts, self.grads, self.input_grads, self.wqueue = {}, {}, {}, {}, {}
        self.sending: list[tuple] = []  # (handle, PhasedRun whose output it sends, or None)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.trace = []
        step_start = time.perf_counter()
        for action in self.schedule.actions[self.rank]:
            start = time.perf_counter()
            if isinstance(action, CommGroup):
                self._communicate(action)
            elif isinstance(action, F):
                self._forward(action.chunk, action.mb)
            elif isinstance(action, B):
                self._backward(action.chunk, action.mb, action.split)
            elif isinstance(action, W):
                self._weight_grad(action.chunk, action.mb)
            elif isinstance(action, FB):
                self._forward_backward(action)
            else:
                raise TypeError(f"unknown pipeline action {action!r}")
            self._sends_done(wait=False)
            if self.timeline is not None:
                self.timeline.append(("action", type(action).__name__, self.trace[-1][:6], start, time.perf_counter()))
        self._sends_done(wait=True)
        if self.timeline is not None:
            self.timeline.append(("step", "", (), step_start, time.perf_counter()))
        leftovers = [k for d in (self.outputs, self.acts, self.grads, self.input_grads, self.wqueue) for k in d]
        assert not leftovers, f"rank {self.rank}: state left after the step: {leftovers}"
        return self.loss_sum

    def _stage(self, chunk: int, mb: int) -> int:
        return self.schedule.stage_of(self.rank, chunk, mb)

    def _is_local(self, stage: int, mb: int) -> bool:
        return 0 <= stage <= self.last_stage and self.schedule.routes[mb][stage][0] == self.rank

    # -- compute ------------------------------------------------------------------------------------
    def _start_forward(self, chunk: int, mb: int) -> tuple[int, PhasedRun]:
        s = self._stage(chunk, mb)
        batch = self.batches[mb]
        x = batch["inputs"] if s == 0 else _arrived(self.acts.pop((s, mb))).detach().requires_grad_()
        last = s == self.last_stage
        phases = self.chunks[chunk].phases(batch["positions"], batch["labels"] if last else None,
                                           batch["loss_mask"] if last else None, batch.get("mtp") if last else None,
                                           self.stats, batch.get("docs"), batch.get("sources") if last else None,
                                           batch["inputs"])  # every stage's token ids: hash-routed MoE layers
        run = PhasedRun(phases, x)
        run.record, run.label = self.timeline, f"stage {s} mb {mb}"
        return s, run

    def _finish_forward(self, s: int, mb: int, run: PhasedRun) -> None:
        self.outputs[(s, mb)] = run
        if s == self.last_stage:
            self.loss_sum += run.output.detach().double()
        elif self._is_local(s + 1, mb):  # DualPipeV's turn: hand over to the next stage on this rank
            self.acts[(s + 1, mb)] = run.output.detach()
            run.release_output()  # the next stage's alias keeps the data

    def _forward(self, chunk: int, mb: int) -> None:
        s, run = self._start_forward(chunk, mb)
        self.trace.append(("F", s, mb))
        run.forward_all()
        self._finish_forward(s, mb, run)

    def _backward_args(self, chunk: int, mb: int):
        s = self._stage(chunk, mb)
        grad = None if s == self.last_stage else _arrived(self.grads.pop((s, mb)))
        return s, self.outputs.pop((s, mb)), grad

    def _finish_backward(self, s: int, mb: int, run: PhasedRun, split: bool) -> None:
        if split:
            self.wqueue[(s, mb)] = self.store.take()
        if s > 0 and self._is_local(s - 1, mb):
            self.grads[(s - 1, mb)] = run.input_grad
        elif s > 0:
            self.input_grads[(s, mb)] = run.input_grad  # for SEND_B

    def _backward(self, chunk: int, mb: int, split: bool) -> None:
        s, run, grad = self._backward_args(chunk, mb)
        self.trace.append(("B", s, mb, split))
        run.backward_all(grad, self.loss_scale, self.store if split else None)
        self._finish_backward(s, mb, run, split)

    def _weight_grad(self, chunk: int, mb: int) -> None:
        s = self._stage(chunk, mb)
        self.trace.append(("W", s, mb))
        start = time.perf_counter()
        WeightGradStore.run(self.wqueue.pop((s, mb)))
        if self.timeline is not None:
            self.timeline.append(("W", f"stage {s} mb {mb}", "W", start, time.perf_counter()))

    def _forward_backward(self, action: FB) -> None:
        """DualPipe's F&B: the forward phases of one micro-batch alternate with the backward phases
        of the other (attention / dispatch / experts / combine), see overlap.py."""
        fs, f_run = self._start_forward(action.f_chunk, action.f_mb)
        bs, b_run, grad = self._backward_args(action.b_chunk, action.b_mb)
        order = interleave(f_run, b_run, grad, self.loss_scale, self.store if action.split else None)
        self.trace.append(("FB", fs, action.f_mb, bs, action.b_mb, action.split, tuple(order)))
        self._finish_forward(fs, action.f_mb, f_run)
        self._finish_backward(bs, action.b_mb, b_run, action.split)

    # -- communication ------------------------------------------------------------------------------
    def _communicate(self, group: CommGroup) -> None:
        ops, landing, sent = [], [], []
        for p2p in group.ops:
            s = self._stage(p2p.chunk, p2p.mb)
            if p2p.op == SEND_F:
                sent.append(self.outputs[(s, p2p.mb)])
                ops.append(comm.p2p_op("send", sent[-1].output.detach().contiguous(), p2p.peer, self.pp_group))
            elif p2p.op == SEND_B:
                sent.append(None)
                ops.append(comm.p2p_op("send", self.input_grads.pop((s, p2p.mb)).contiguous(), p2p.peer, self.pp_group))
            elif p2p.op in (RECV_F, RECV_B):
                buf = torch.empty(self.hidden_shape, dtype=self.dtype, device=self.device)
                ops.append(comm.p2p_op("recv", buf, p2p.peer, self.pp_group))
                landing.append((self.acts if p2p.op == RECV_F else self.grads, (s, p2p.mb), buf))
            else:
                raise ValueError(f"unknown p2p op {p2p.op!r}")
        self.trace.append(("COMM", tuple((p.op, p.peer, self._stage(p.chunk, p.mb), p.mb) for p in group.ops)))
        handles = comm.batch_isend_irecv(ops, self.pp_group)
        is_send = [p.op in (SEND_F, SEND_B) for p in group.ops]
        if not self.overlap:
            for handle in handles:
                handle.wait()
        self.sending += list(zip([h for h, snd in zip(handles, is_send) if snd], sent))
        for (table, key, buf), handle in zip(landing, [h for h, snd in zip(handles, is_send) if not snd]):
            table[key] = _Landing(buf, handle)

    def _sends_done(self, wait: bool) -> None:
        """Release the chunk outputs whose sends are done (all of them, waiting, when `wait`)."""
        pending = []
        for handle, run in self.sending:
            if wait or handle.done():
                handle.wait()
                if run is not None:  # the peer has it now
                    run.release_output()
            else:
                pending.append((handle, run))
        self.sending = pending


class _Landing:
    """A received tensor's buffer and the handle of its receive: waited for where it is used."""

    def __init__(self, buf: torch.Tensor, handle):
        self.buf, self.handle = buf, handle


def _arrived(t):
    """A tensor handed over on this rank, or a received one once its receive is done."""
    if isinstance(t, _Landing):
        t.handle.wait()
        return t.buf
    return t


def grad_arrivals(schedule: Schedule, rank: int, chunks: list[nn.Module]) -> dict[int, int]:
    """{id(param): backward passes that deliver a gradient to it per step} on pipeline rank `rank` holding
    `chunks`: one per micro-batch through each chunk using it (the MTP modules of the last stage also use the
    embedding). What ZeroOptimizer.begin_step expects (the trainer; the planner's ZeRO trace)."""
    arrivals: dict[int, int] = {}
    for c, chunk in enumerate(chunks):
        n = sum(1 for route in schedule.routes if (rank, c) in route)
        params = {id(p) for p in chunk.parameters()}
        if chunk.mtp_embed is not None:
            params |= {id(p) for p in chunk.mtp_embed.module.parameters()}
        for pid in params:
            arrivals[pid] = arrivals.get(pid, 0) + n
    return arrivals
