"""How a bad recipe ends a multi-process job: every rank finds the same error before any process group
exists, rank 0 prints it once, and every rank exits with status 2 (also under torchrun, whose agent
stops the other ranks as soon as one exits)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from moe_lc.config import ConfigError


def exit_on_recipe_error(exc: ConfigError, rank: int, world: int) -> int:
    """Every rank found the same error before any process group: rank 0 prints it once, and every rank
    leaves with status 2. torchrun stops the other ranks (SIGTERM) as soon as one exits, so under its
    agent store the others first report that they wait with a SIGTERM handler that exits with 2, and
    rank 0 prints and exits only then."""
    store = _launcher_store(world)
    if rank != 0:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
        if store is not None:
            store.add("moe_lc/recipe_error_waiting", 1)
        time.sleep(30.0 if store is not None else 3.0)  # ended by torchrun's SIGTERM once rank 0 has exited
        return 2
    if store is not None:
        deadline = time.monotonic() + 60.0
        while store.add("moe_lc/recipe_error_waiting", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"error: {exc}", file=sys.stderr, flush=True)
    return 2


def _launcher_store(world: int):
    """torchrun's agent TCPStore (a client of it), or None outside torchrun."""
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    try:
        store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                           is_master=False, timeout=timedelta(seconds=30))
    except (KeyError, RuntimeError, ValueError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch.distributed.PrefixStore(f"moe_lc/attempt_{attempt}", store)
