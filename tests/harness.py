"""Equivalence harness: run a recipe on 1 process and on W gloo processes, compare step by step.

    ref = run_layout(recipe, overrides, world=1)
    got = run_layout(recipe, overrides + ["parallel.dp=2"], world=2)
    report = assert_equivalent(ref, got, rtol=1e-5)

`run_layout` starts W processes (torch.multiprocessing, forkserver) that each call `moe_lc.train.run`
with the rendezvous environment torchrun would set, and collects from every rank: per-step losses
and grad norms, counted communication per step, optimizer-state bytes, and (rank 0) the unsharded
final parameters. Single-process references are cached per (recipe, overrides) for the session.
"""

from __future__ import annotations

import json
import shutil
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

from moe_lc.parallel.mesh import exit_process

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
# Workers fork from one server process that imported torch and moe_lc once per test session: a spawned
# worker spends 3-6 s of this 2-core machine importing them again, for every rank of every layout test.
# The server's environment is the one at its start: workers get theirs through arguments, not os.environ.
# It also imports what a training run imports lazily (its sys.modules after a 1-step run: the TensorBoard
# writer, dynamo, the meta-device init's reference ops, DSA, the pipeline stage, checkpoint state; 580
# modules): 0.7 s that every worker process paid again.
START_METHOD = "forkserver"
multiprocessing.set_forkserver_preload([
    "torch", "torch.distributed", "moe_lc.train", "moe_lc.config", "tests.harness", "torch.utils.tensorboard",
    "torch._dynamo", "torch._refs", "moe_lc.job.checkpoint_state", "moe_lc.model.dsa", "moe_lc.parallel.ep.balance_plan",
    "moe_lc.parallel.pipeline.stage"])

# small, fast defaults for every multi-rank test (one thread per process: W processes share 2 cores).
# Seed 1: with seed 0 the debug MoE model has a top-k routing near-tie (layer 1, step 3 at the test
# shapes) that flips under any reordering of fp32 sums -- even on one device when only the attention
# kernel changes -- and moves two experts by ~1e-5..1e-3. That is discrete routing, not a layout
# error; seed 1 has no tie at these shapes, so every layout is held to 1e-5.
# Adam eps 1e-6: elements whose gradient is ~0 take lr-sized steps whose sign follows 1-ulp rounding
# when eps = 1e-8, which turns any reordering of fp32 sums (TP, CP, EP, PP all reorder) into ~1e-5
# parameter differences after a few steps while every gradient agrees to ~1e-7. With eps 1e-6 the
# comparison measures the layout, not that amplification (tensor parallelism: 1.2e-5 -> 1.2-4.7e-6).
# No TensorBoard writer and no save after the last step: a layout's result comes back in memory (a test
# that checkpoints sets checkpoint.interval, or save_final again).
FAST = ["train.threads=1", "train.log_interval=1000", "parallel.timeout_s=120", "train.seed=1", "train.eps=1e-6",
        "train.loggers=[]", "checkpoint.save_final=false"]

# Tolerances: fp32 layouts reorder sums (reduce-scatter, split attention, ...) -> 1e-5 relative.
# bf16 rounds every activation; different reduction orders move the loss by up to ~1e-2 relative.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp8": 2e-2}


@dataclass
class LayoutResult:
    losses: list[float]
    grad_norms: list[float]
    final_state: dict[str, torch.Tensor]  # from rank 0
    comm_per_rank: list[list[dict]]  # [rank][step] -> {"comm/<group>/<op>_bytes": n}
    optimizer_state_bytes: list[int]  # per rank
    world: int
    compile_per_rank: list[list[dict]] = field(default_factory=list)  # [rank][step] -> CompileWatch counts (train.compile)
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl, a dict per step (written by rank 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, recipe: str, overrides: list[str], out_dir: str,
            ranks_per_node: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_lc.config import load_config
    from moe_lc.train import run

    cfg = load_config(recipe, overrides, world_size=world)
    result = run(cfg, keep_final_state=True)
    torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "comm": result.comm_per_step,
                "state_bytes": result.optimizer_state_bytes, "compile": result.compile_per_step,
                "final_state": result.final_state if rank == 0 else None}, Path(out_dir) / f"rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    exit_process(0)  # see exit_process: gloo teardown can abort a finished worker


def run_layout(recipe: str | Path, overrides: list[str], world: int, *, timeout_s: float = 600,
               ranks_per_node: int | None = None) -> LayoutResult:
    """Train `recipe` with `overrides` on `world` gloo processes (1 = in this process, fresh state)."""
    recipe = str(recipe)
    with tempfile.TemporaryDirectory(prefix="moe_lc_eq_") as tmp:
        overrides = FAST + list(overrides) + [f"train.output_dir={tmp}/run"]
        port = _free_port()
        ctx = mp.start_processes(_worker, args=(world, port, recipe, overrides, tmp, ranks_per_node or world),
                                 nprocs=world, start_method=START_METHOD, join=False)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"layout {overrides} on {world} ranks did not finish in {timeout_s:.0f} s")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
        log = Path(tmp) / "run" / "metrics.jsonl"
        metrics = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return LayoutResult(ranks[0]["losses"], ranks[0]["grad_norms"], ranks[0]["final_state"],
                        [r["comm"] for r in ranks], [r["state_bytes"] for r in ranks], world,
                        [r["compile"] for r in ranks], metrics)


_REFERENCE_CACHE: dict[tuple, LayoutResult] = {}


def interrupted_and_resumed(recipe: str | Path, overrides: list[str], changed: list[str], world: int,
                            ckpt: Path) -> tuple[LayoutResult, LayoutResult]:
    """(6 uninterrupted steps of `overrides`, checkpointing into `ckpt` every 3; steps 4-6 again, resumed
    from the step-3 checkpoint with `changed` added): what a run interrupted after step 3 and restarted
    under another setting trains."""
    saving = list(overrides) + ["train.steps=6", "checkpoint.interval=3", f"checkpoint.dir={ckpt}"]
    full = run_layout(recipe, saving, world=world)
    shutil.rmtree(Path(ckpt) / "step_00000006")
    return full, run_layout(recipe, saving + list(changed) + ["checkpoint.resume=true"], world=world)


def assert_bit_for_bit(a: LayoutResult, b: LayoutResult) -> None:
    """The same losses and every final parameter identical (torch.equal)."""
    assert a.losses == b.losses
    assert a.final_state.keys() == b.final_state.keys()
    assert all(torch.equal(b.final_state[k], v) for k, v in a.final_state.items())


def reference(recipe: str | Path, overrides: list[str]) -> LayoutResult:
    """The single-process result for (recipe, overrides), computed once per test session."""
    key = (str(recipe), tuple(overrides))
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = run_layout(recipe, overrides, world=1)
    return _REFERENCE_CACHE[key]


@dataclass
class Report:
    max_loss_rel: float
    max_param_rel: float  # max over tensors of ||a - b|| / ||b||
    worst_param: str


def compare(ref: LayoutResult, got: LayoutResult) -> Report:
    assert len(ref.losses) == len(got.losses), (len(ref.losses), len(got.losses))
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses))
    assert ref.final_state.keys() == got.final_state.keys(), set(ref.final_state) ^ set(got.final_state)
    worst, worst_name = 0.0, ""
    for name, want in ref.final_state.items():
        have = got.final_state[name]
        assert have.shape == want.shape, (name, have.shape, want.shape)
        rel = ((have.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
        if rel > worst:
            worst, worst_name = rel, name
    return Report(loss_rel, worst, worst_name)


def assert_equivalent(ref: LayoutResult, got: LayoutResult, rtol: float = 1e-5) -> Report:
    """Per-step losses and every final parameter tensor agree within rtol (relative, norm-wise)."""
    report = compare(ref, got)
    assert report.max_loss_rel <= rtol, f"losses differ by {report.max_loss_rel:.2e} > {rtol}: {ref.losses} vs {got.losses}"
    assert report.max_param_rel <= rtol, f"parameter {report.worst_param} differs by {report.max_param_rel:.2e} > {rtol}"
    return report


def _fn_worker(rank: int, world: int, port: int, fn, args: tuple, out_dir: str, ranks_per_node: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()
    exit_process(0)


def run_workers(fn, world: int, *args, ranks_per_node: int | None = None, timeout_s: float = 300) -> list:
    """Run fn(rank, world, *args) on `world` gloo processes (process group initialized); returns each
    rank's return value. fn must be importable (module level): workers are started by forkserver."""
    with tempfile.TemporaryDirectory(prefix="moe_lc_fn_") as tmp:
        ctx = mp.start_processes(_fn_worker, args=(world, _free_port(), fn, args, tmp, ranks_per_node or world),
                                 nprocs=world, start_method=START_METHOD, join=False)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout_s:.0f} s")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def eval_alone_and_on_cp2(run: Path, args: list[str], out: Path) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """`python -m eval RUN ARGS` in one process and under torchrun with 2 ranks (context parallel), into
    out/one and out/cp; both must succeed. Returns (the cp run's process, one's results.json "tasks", cp's)."""
    base = ["-m", "eval", str(run), *args, "--out"]
    one = subprocess.run([sys.executable, *base, str(out / "one")], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    cp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         *base, str(out / "cp")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert cp.returncode == 0, cp.stderr[-3000:]
    a, b = (json.loads((out / d / "results.json").read_text())["tasks"] for d in ("one", "cp"))
    return cp, a, b
