"""Test-wide fixtures, the `gpu` marker's skip where torch sees no CUDA device, and how the suite shares
the machine's cores between pytest-xdist's workers (`-n auto --dist loadfile` in pyproject.toml)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under its interpreter (tests/test_triton_kernels.py). Triton reads this
    # when it decorates a function, its own library's included, so it must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_lc.config import load_config
from moe_lc.train import run
from tests.harness import RECIPES


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each layout test starts up to 8 gloo processes of its own)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # one intra-op thread per worker's share of the cores: two workers each running two threads on two
    # cores spin against each other (the multi-process tests already run one thread per rank)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch sees none here): run `python -m pytest -m gpu` "
                                   "on a GPU machine, or `python -m tools.gpu_check` for the whole bring-up")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same global RNG state, whatever ran before it in the process."""
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 1-step debug checkpoint (4 layers), one per test module: enough to load and score."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    run(load_config(RECIPES / "debug_cpu.toml", [
        "train.steps=1", "train.seq_len=64", "train.global_batch=4", "train.micro_batch=4", "train.warmup_steps=1",
        "checkpoint.interval=1", "train.log_interval=100", "train.threads=1", f"train.output_dir={out}"]))
    return out
