"""Test-wide fixtures, and the `gpu` marker's skip where torch sees no CUDA device."""

import pytest
import torch


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
