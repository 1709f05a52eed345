"""Test-wide fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same global RNG state, whatever ran before it in the process."""
    torch.manual_seed(0)
    yield
