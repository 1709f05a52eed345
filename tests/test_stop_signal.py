"""SIGTERM and SIGUSR1 stop training after the step in progress, with a checkpoint written by every rank at
the same step and one line naming it (moe_lc/job/stop_signal.py); the resumed run continues to the
uninterrupted run's losses, bit for bit."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_lc.job.checkpoint import committed_checkpoints
from tests.test_reliability import RECIPE, ROOT, SMALL, losses, train_cli

STEPS = ["train.steps=10", "checkpoint.resume=true"]  # interval 0: only the stop writes a checkpoint before the end


def stop_line(signame: str, step: int, out: Path) -> str:
    return (f"stopped by {signame} after step {step}; checkpoint {out / 'checkpoints' / f'step_{step:08d}'} "
            f"(resume with --set checkpoint.resume=true); exit status {128 + signal.Signals[signame]}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """nproc -> step -> loss of the run that was never stopped (computed once per process count)."""
    done = {}

    def get(nproc: int) -> dict[int, float]:
        if nproc not in done:
            out = tmp_path_factory.mktemp(f"clean{nproc}")
            run = train_cli(out, *STEPS, nproc=nproc)
            assert run.returncode == 0, run.stderr[-3000:]
            done[nproc] = losses(out)
        return done[nproc]

    return get


def assert_checkpoint_of_every_rank_at(out: Path, step: int, world: int) -> None:
    """The only committed checkpoint is `step`'s, and every rank wrote its shard into it."""
    assert [s for s, _ in committed_checkpoints(out / "checkpoints")] == [step]
    written = sorted(p.name for p in (out / "checkpoints" / f"step_{step:08d}").glob("__*_0.distcp"))
    assert written == [f"__{r}_0.distcp" for r in range(world)]


def test_sigterm_in_one_process_checkpoints_and_resumes_exactly(tmp_path, uninterrupted):
    out = tmp_path / "run"
    stopped = train_cli(out, *STEPS, env={"MOE_LC_FAULT": "sigterm@3"})
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == stop_line("SIGTERM", 3, out)
    assert_checkpoint_of_every_rank_at(out, 3, 1)
    resumed = train_cli(out, *STEPS)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert losses(out) == uninterrupted(1)


def test_sigterm_to_torchrun_stops_both_ranks_at_one_step_and_resumes_exactly(tmp_path, uninterrupted):
    """SIGTERM to the torchrun agent (what SLURM and Kubernetes signal), mid-run: torchrun forwards it to
    both ranks, which stop after the same step with one checkpoint and one line naming it; torchrun does
    not restart a job it was told to stop. The resumed job continues to the uninterrupted losses."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "moe_lc.train", str(RECIPE)]
    for kv in [f"train.output_dir={out}", *SMALL, *STEPS]:
        cmd += ["--set", kv]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = out / "metrics.jsonl", time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= 2:  # mid-run: step 2 done, 8 to go
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=300)
    match = re.search(r"stopped by SIGTERM after step (\d+);", stderr)
    assert match, stderr[-3000:]
    step = int(match.group(1))
    assert 2 <= step < 10 and stop_line("SIGTERM", step, out) in stderr.splitlines()
    assert stdout.count("| threads ") == 1  # one start: no restart
    assert_checkpoint_of_every_rank_at(out, step, 2)
    resumed = train_cli(out, *STEPS, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{step:08d}'}" in resumed.stdout
    assert losses(out) == uninterrupted(2)


def test_a_signal_on_one_rank_stops_both_and_torchrun_restarts_from_its_checkpoint(tmp_path, uninterrupted):
    """SIGUSR1 reaches rank 1 alone during step 3: both ranks stop after step 3 (rank 0 learns it from the
    all-reduced flag), and exit 138; torchrun --max-restarts restarts the job, which resumes from that
    checkpoint and ends with the uninterrupted losses."""
    out = tmp_path / "run"
    run = train_cli(out, *STEPS, nproc=2, env={"MOE_LC_FAULT": "sigusr1@3:1"}, extra_torchrun=["--max-restarts=1"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[fault injection] rank 1 sends itself SIGUSR1 in step 3" in run.stdout
    assert "[fault injection] rank 0" not in run.stdout
    assert stop_line("SIGUSR1", 3, out) in run.stderr.splitlines()
    assert f"resumed from {out / 'checkpoints' / 'step_00000003'}" in run.stdout
    assert [s for s, _ in committed_checkpoints(out / "checkpoints")] == [3, 10]
    assert losses(out) == uninterrupted(2)


FAKE_SLURM = {  # stand-ins that record what docs/launch/slurm.sbatch asks of SLURM
    "srun": 'echo "$@" > "$FAKE/srun_args"\ntrap \'echo USR1 > "$FAKE/srun_stopped"; exit 138\' USR1\n'
            'echo $$ > "$FAKE/srun_pid"\nwhile true; do sleep 0.05; done\n',
    "scancel": 'echo "$@" >> "$FAKE/scancel.log"\nkill -USR1 "$(cat "$FAKE/srun_pid")"\n',
    "scontrol": 'if [ "$1" = show ]; then echo node1; else echo "$@" >> "$FAKE/scontrol.log"; fi\n',
}


def test_the_slurm_script_stops_the_step_before_the_limit_and_requeues(tmp_path):
    """SLURM's early SIGUSR1 (`--signal=B:USR1@...`) to the batch script: it passes SIGUSR1 to the training
    step (scancel), waits for the step to end, and requeues the job; torchrun is told to pass SIGUSR1 on."""
    for name, body in FAKE_SLURM.items():
        (tmp_path / name).write_text("#!/bin/bash\n" + body)
        (tmp_path / name).chmod(0o755)
    env = dict(os.environ, FAKE=str(tmp_path), PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_JOB_ID="42",
               SLURM_NNODES="1", SLURM_JOB_NODELIST="node1")
    job = subprocess.Popen(["bash", str(ROOT / "docs" / "launch" / "slurm.sbatch")], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "srun_pid").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    job.send_signal(signal.SIGUSR1)
    stdout, stderr = job.communicate(timeout=60)
    assert job.returncode == 138, stderr
    assert (tmp_path / "scancel.log").read_text() == "--signal=USR1 42\n"
    assert (tmp_path / "srun_stopped").read_text() == "USR1\n"
    assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"
    args = (tmp_path / "srun_args").read_text()
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in args and "--shutdown-timeout 170" in args
