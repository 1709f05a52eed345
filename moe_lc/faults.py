"""Fault injection for reliability tests: `MOE_LC_FAULT="kind@step[:rank],..."`.

Kinds (each fires once, on the given rank or on every rank, at optimizer step `step`):
    exit          the process exits with status 13 (a crashed rank; torchrun restarts the job)
    kill_in_save  SIGKILL while the checkpoint of that step is written (data and DCP metadata on
                  disk, commit marker and rename not yet done)
    nan_loss      the loss of that step becomes NaN before backward (non-finite guard)
    prepare_kill  tools/prepare_data.py is SIGKILLed right after publishing its `step`-th shard of a
                  split (the other split's open shard left half-written), to test resuming
    sigterm       the process sends itself SIGTERM during step `step` (after the update, before the ranks
                  agree whether to stop: moe_lc/job/stop_signal.py), as a scheduler stopping the job would
    sigusr1       the same with SIGUSR1 (a scheduler's signal sent ahead of the stop)
Under torchrun restarts a fault fires only in the first attempt (TORCHELASTIC_RESTART_COUNT = 0),
so the restarted job runs clean. Nothing happens unless the variable is set.
"""

from __future__ import annotations

import os
import signal

KINDS = ("exit", "kill_in_save", "nan_loss", "prepare_kill", "sigterm", "sigusr1")


def _faults() -> list[tuple[str, int, int | None]]:
    spec = os.environ.get("MOE_LC_FAULT", "").strip()
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []
    out = []
    for item in spec.split(","):
        kind, _, where = item.strip().partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"MOE_LC_FAULT item {item!r}: expected KIND@STEP[:RANK] with KIND in {KINDS}")
        out.append((kind, int(step), int(rank) if rank else None))
    return out


def armed(kind: str, step: int, rank: int) -> bool:
    """Whether fault `kind` is set for this step and rank."""
    return any(k == kind and s == step and r in (None, rank) for k, s, r in _faults())


def maybe_exit(step: int, rank: int) -> None:
    if armed("exit", step, rank):
        print(f"[fault injection] rank {rank} exits after step {step}", flush=True)
        os._exit(13)


def maybe_kill_in_save(step: int, rank: int) -> None:
    if armed("kill_in_save", step, rank):
        print(f"[fault injection] rank {rank} killed while saving step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill_after_shard(shards_written: int) -> None:
    if armed("prepare_kill", shards_written, 0):
        print(f"[fault injection] prepare_data killed after shard {shards_written}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_signal(step: int, rank: int) -> None:
    for kind, signum in (("sigterm", signal.SIGTERM), ("sigusr1", signal.SIGUSR1)):
        if armed(kind, step, rank):
            print(f"[fault injection] rank {rank} sends itself {signum.name} in step {step}", flush=True)
            os.kill(os.getpid(), signum)
