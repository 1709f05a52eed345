"""Stop as a cluster stops a job: SIGTERM, or SIGUSR1 sent ahead of time, ends training after the step in
progress with a checkpoint, every rank after the same step.

SLURM (at a job's time limit, on preemption or scancel), Kubernetes (pod deletion, then SIGKILL after
terminationGracePeriodSeconds) and `timeout` send SIGTERM before the kill; SLURM sends SIGUSR1 (or any
signal) a set time ahead with `--signal`. The handler only records the signal. After each optimizer step
every rank all-reduces (max) the recorded signal's number over the world, one int32, so the ranks agree
on the step to stop after even when the signal reaches them at different moments or reaches only some
of them (torchrun forwards what it receives to every worker; `kill` of one worker reaches that one).

The trainer then writes a checkpoint, prints one line naming it, and the process exits with 128 + the
signal's number (143 for SIGTERM, 138 for SIGUSR1), the status a process killed by that signal reports,
so nothing reads the stop as a finished run: torchrun restarts a job whose worker exits non-zero while
restarts are left (with checkpoint.resume the restart continues from that checkpoint), and a torchrun
that received the signal itself stops its workers and does not restart; SLURM requeues by the job's own
policy (`scontrol requeue`, docs/launch/slurm.sbatch). Ctrl-C (SIGINT) stays KeyboardInterrupt, which the
trainer turns into `Interrupted` once a save in flight is done (`interrupted_line`).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch

from moe_lc.job import checkpoint as ckpt
from moe_lc.parallel import comm

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """The stop signal this process received (0: none), while `installed()`."""

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame) -> None:
        self.signum = self.signum or signum

    def install(self) -> None:
        """Record STOP_SIGNALS instead of dying of them (main thread only: Python runs handlers there)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def agreed(self, world: comm.Group, device: torch.device) -> int:
        """The signal every rank stops for after this step (the largest number any rank received), 0 = go on.
        A collective: every rank calls it once per step."""
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        comm.all_reduce(flag, world, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())


def stop_line(signum: int, step: int, checkpoint) -> str:
    """The one line for the user: which signal, after which step, the checkpoint to resume from."""
    return (f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint} "
            f"(resume with --set checkpoint.resume=true); exit status {128 + signum}")


class Stopped(Exception):
    """Training stopped for a signal after a step, with a checkpoint; the message is the one line for the user."""

    def __init__(self, signum: int, step: int, checkpoint):
        super().__init__(stop_line(signum, step, checkpoint))
        self.signum = signum


class Interrupted(Exception):
    """Ctrl-C during training; the message is the one line for the user (`interrupted_line`; main() exits 130)."""


def interrupted_line(checkpointer, root: Path, step: int, logger) -> str:
    """Ctrl-C at `step`: wait for `checkpointer`'s asynchronous save in flight (a second Ctrl-C abandons it: its
    .tmp directory is never read); the one line for the user, naming the newest checkpoint under `root`."""
    abandoned = ""
    if checkpointer.saving:
        logger.event("interrupted: waiting for the checkpoint being saved (Ctrl-C again to abandon it)")
        try:
            checkpointer.wait(barrier=False)
        except (KeyboardInterrupt, ckpt.CheckpointError):
            abandoned = "; the checkpoint being saved was abandoned"
    latest = ckpt.latest_checkpoint(root)
    where = (f"last checkpoint: {latest} (resume with --set checkpoint.resume=true)" if latest
             else "no checkpoint saved (set checkpoint.interval)")
    return f"interrupted at step {step}; {where}{abandoned}"
