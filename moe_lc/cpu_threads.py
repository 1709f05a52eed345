"""How many CPU threads a process computes with: the trainer's `train.threads` and eval's `--threads`, 0 = auto.

torch's default is one intra-op thread per core, and its OpenMP threads spin while they wait for each other.
On a machine where another process keeps a core busy, every parallel op then waits for the thread that
shares that core to get its time slice: the debug recipe ran 15-50x slower on 2 cores with one busy
(moe_lc issue 44). So, in this order:

1. an explicit count (`train.threads`, `--threads`) wins;
2. else an explicit `OMP_NUM_THREADS` (torchrun sets 1 for each of several processes on a machine);
3. else auto: the idle cores among those this process may run on, shared among the machine's local ranks
   (LOCAL_WORLD_SIZE), at least 1. The ceiling is the process's CPU affinity (`os.sched_getaffinity`) and a
   cgroup v2 CPU quota (`/sys/fs/cgroup/cpu.max`, a container's CPU limit); busy cores are measured over
   0.1 s from /proc/stat on exactly those cores (no lag: the load average takes a minute to see a new
   load, and counts cores outside the affinity), or read from the 1-minute load average where there is no
   /proc/stat (macOS). Measured once per process, so runs in one process compute alike.

The count sets the order of some sums (the losses of 1 and 2 threads part in the last digits): a resumed
run repeats the interrupted one's losses bit for bit at the same count, which the start-up line gives;
set the count (`train.threads`) where a resume on a machine whose load changed must match exactly.

On a machine that was not idle at start-up (fewer threads than cores), `passive_wait_if_shared()` also makes
waiting OpenMP threads sleep instead of spin (OMP_WAIT_POLICY=PASSIVE), so a load that grows later costs
about one thread's speed rather than a spin behind a busy core (the debug recipe on 2 cores, one busy:
2.7 s a step spinning, 0.39 s sleeping, 0.31 s on 1 thread). On an idle machine spinning is faster (waking
a sleeping thread for each small op: 0.30 s a step vs 0.21 s), so the policy stays OpenMP's own there.
(Figures from a shared machine, indicative.) The OpenMP runtime reads the variable once, when torch
loads it: call this before `import torch`. A policy or OMP_NUM_THREADS the user set is left alone.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import dataclass

SAMPLE_S = 0.1


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # e.g. "auto: 1 of 2 cores idle; set train.threads to override"

    def describe(self) -> str:
        return f"threads {self.threads} ({self.reason})"


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity; every core where the OS has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cgroup_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """Cores' worth of CPU time the cgroup may use (a container's CPU limit), None without a limit."""
    try:
        quota, period = open(path).read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _proc_stat(cores: tuple[int, ...]) -> dict[int, tuple[int, int]] | None:
    """core -> (busy, total) jiffies from /proc/stat, None where unreadable."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out or None


@functools.cache  # once per process: runs in one process (tests, tools) compute alike, so give the same losses
def busy_cores(cores: tuple[int, ...], sample_s: float = SAMPLE_S) -> tuple[float, str]:
    """(busy cores among `cores`, how it was measured): a /proc/stat sample, else the load average."""
    before = _proc_stat(cores)
    if before is not None:
        time.sleep(sample_s)
        after = _proc_stat(cores) or {}
        busy = sum((after[c][0] - b[0]) / max(after[c][1] - b[1], 1) for c, b in before.items() if c in after)
        return busy, f"in a {sample_s:g} s sample"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return load * len(cores) / (os.cpu_count() or len(cores)), "by load average"


def auto_threads(cores: int, busy: float, quota: float | None = None, local_ranks: int = 1) -> int:
    """Idle cores (rounded to the nearest), within the quota, shared by the machine's local ranks; at least 1."""
    ceiling = min(cores, math.ceil(quota)) if quota else cores
    idle = min(ceiling, cores - busy)
    return max(1, int(idle / max(local_ranks, 1) + 0.5))


def choose_threads(requested: int, knob: str, env=os.environ, measure=busy_cores) -> ThreadChoice:
    """The thread count by the module's rule; `knob` names the setting that overrides it (train.threads)."""
    if requested > 0:
        return ThreadChoice(requested, f"set by {knob}")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), f"from OMP_NUM_THREADS; set {knob} to override")
    cores = allowed_cores()
    busy, how = measure(tuple(cores))
    quota, ranks = cgroup_quota(), int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    n = auto_threads(len(cores), busy, quota, ranks)
    idle = max(0, min(len(cores), int(len(cores) - busy + 0.5)))
    notes = (f", CPU quota {quota:g}" if quota else "") + (f", {ranks} ranks on this machine" if ranks > 1 else "")
    return ThreadChoice(n, f"auto: {idle} of {len(cores)} cores idle {how}{notes}; set {knob} to override")


def apply_threads(requested: int, knob: str) -> ThreadChoice:
    """Choose and set torch's intra-op thread count; returns the choice (for the start-up line)."""
    import torch

    choice = choose_threads(requested, knob)
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    return choice


def passive_wait_if_shared(env=os.environ, measure=None, torch_loaded: bool | None = None) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in `env` where auto would take fewer threads than this process has cores;
    whether it did. Nothing when torch is loaded already (too late) or the user set the policy or a count."""
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if torch_loaded or "OMP_WAIT_POLICY" in env or "OMP_NUM_THREADS" in env:
        return False
    cores = allowed_cores()
    busy, _ = (measure or busy_cores)(tuple(cores))
    if auto_threads(len(cores), busy, cgroup_quota()) >= len(cores):
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
