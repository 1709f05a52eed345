"""The CPU thread count (moe_lc/cpu_threads.py): an explicit count, then OMP_NUM_THREADS, then the idle
cores within the affinity and CPU quota, shared by the local ranks; said on the trainer's start-up line."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_lc import cpu_threads
from moe_lc.cpu_threads import auto_threads, choose_threads

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cores, busy, quota, ranks, want", [
    (2, 0.0, None, 1, 2), (2, 0.3, None, 1, 2),  # an idle laptop: every core
    (2, 1.0, None, 1, 1), (2, 0.6, None, 1, 1),  # one core busy (or most of one): one thread
    (2, 3.5, None, 1, 1),  # busier than it has cores: still one
    (16, 0.0, 2.0, 1, 2), (16, 0.0, 1.5, 1, 2),  # a container's CPU limit is the ceiling
    (16, 2.0, None, 4, 4), (16, 15.0, None, 4, 1),  # idle cores shared by 4 ranks on the machine
])
def test_auto_threads_takes_the_idle_cores(cores, busy, quota, ranks, want):
    assert auto_threads(cores, busy, quota, ranks) == want


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "allowed_cores", lambda: [0, 1])
    monkeypatch.setattr(cpu_threads, "cgroup_quota", lambda: None)


def test_explicit_count_then_omp_num_threads_then_auto(two_cores):
    one_busy = lambda cores: (1.0, "in a test")  # noqa: E731
    assert choose_threads(3, "train.threads", {"OMP_NUM_THREADS": "1"}, one_busy).describe() == \
        "threads 3 (set by train.threads)"
    assert choose_threads(0, "--threads", {"OMP_NUM_THREADS": "4"}, one_busy).describe() == \
        "threads 4 (from OMP_NUM_THREADS; set --threads to override)"
    for env in ({}, {"OMP_NUM_THREADS": ""}, {"OMP_NUM_THREADS": "0"}, {"OMP_NUM_THREADS": "4,2"}):
        assert choose_threads(0, "train.threads", env, one_busy).describe() == \
            "threads 1 (auto: 1 of 2 cores idle in a test; set train.threads to override)", env
    assert choose_threads(0, "train.threads", {"LOCAL_WORLD_SIZE": "2"}, lambda c: (0.0, "now")).describe() == \
        "threads 1 (auto: 2 of 2 cores idle now, 2 ranks on this machine; set train.threads to override)"


def test_cgroup_quota_reads_cpu_max(tmp_path):
    (tmp_path / "limited").write_text("150000 100000\n")
    (tmp_path / "unlimited").write_text("max 100000\n")
    assert cpu_threads.cgroup_quota(str(tmp_path / "limited")) == 1.5
    assert cpu_threads.cgroup_quota(str(tmp_path / "unlimited")) is None
    assert cpu_threads.cgroup_quota(str(tmp_path / "absent")) is None


@pytest.mark.skipif(not (Path("/proc/stat").exists() and hasattr(os, "sched_setaffinity")), reason="Linux only")
def test_a_core_kept_busy_is_measured_busy():
    core = max(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spinner.pid, {core})
        busy, how = cpu_threads.busy_cores.__wrapped__((core,), sample_s=0.3)  # measured now, not the cached
    finally:
        spinner.kill()
        spinner.wait()
    assert busy > 0.9 and how == "in a 0.3 s sample"


def test_threads_sleep_while_waiting_only_where_the_machine_was_busy(two_cores):
    one_busy, idle = (lambda cores: (1.0, "")), (lambda cores: (0.1, ""))  # noqa: E731
    env = {}
    assert cpu_threads.passive_wait_if_shared(env, one_busy, torch_loaded=False)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for env in ({}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_NUM_THREADS": "2"}):
        before = dict(env)
        assert not cpu_threads.passive_wait_if_shared(env, idle if not env else one_busy, torch_loaded=False)
        assert env == before
    assert not cpu_threads.passive_wait_if_shared({}, one_busy, torch_loaded=True)  # too late: OpenMP has read it


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="2 cores, Linux")
def test_the_trainer_beside_a_busy_core_sleeps_while_waiting_and_says_its_thread_count(tmp_path):
    """`python -m moe_lc.train` with one of its cores kept busy: OMP_WAIT_POLICY=PASSIVE set before torch
    loads, and the start-up line gives the thread count and why."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    train = ("import os, sys, moe_lc.train as t; print('policy', os.environ.get('OMP_WAIT_POLICY')); "
             "sys.exit(t.main(sys.argv[1:]))")
    args = ["recipes/debug_cpu.toml", "--set", "train.steps=1", "--set", f"train.output_dir={tmp_path}", "--set",
            "train.loggers=[]", "--set", "checkpoint.save_final=false"]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spinner.pid, {max(os.sched_getaffinity(0))})
        time.sleep(0.2)
        run = subprocess.run([sys.executable, "-c", train, *args], env=env, capture_output=True, text=True, cwd=ROOT,
                             timeout=300)
    finally:
        spinner.kill()
        spinner.wait()
    assert run.returncode == 0, run.stderr[-2000:]
    assert "policy PASSIVE\n" in run.stdout
    cores = len(os.sched_getaffinity(0))
    assert re.search(rf"\| threads \d+ \(auto: \d+ of {cores} cores idle in a 0\.1 s sample; set train\.threads to "
                     r"override\)\n", run.stdout), run.stdout


def test_eval_says_its_thread_count(tiny_run, tmp_path, capsys, monkeypatch):
    from eval import run as eval_run

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert eval_run.main([str(tiny_run), "--tasks", "passkey", "--lengths", "128", "--depths", "0", "--samples", "1",
                          "--out", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.search(r"cells \| threads \d+ \(auto: \d+ of \d+ cores idle (?:in a 0\.1 s sample|by load average); "
                     r"set --threads to override\)$", first), first
