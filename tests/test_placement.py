"""Shard specs: slicing a full tensor and assembling it back, incl. fused sections and replication."""

import pytest
import torch

from moe_lc.parallel.placement import Shard


@pytest.mark.parametrize("shard, shape, size", [
    (Shard("tp", 0), (8, 3), 4),
    (Shard("tp", 1), (3, 8), 2),
    (Shard("ep", 0), (8, 2, 3), 8),
    # fused q|k|v rows: q 8 rows in 4 pieces, k and v 2 rows each in 2 pieces (kv heads shared by 2 ranks)
    (Shard("tp", 0, ((8, 4), (2, 2), (2, 2))), (12, 5), 4),
    (Shard("tp", 0, ((6, 2), (6, 2))), (12, 5), 2),  # fused gate|up, each half split
])
def test_slice_then_assemble_is_identity(shard, shape, size):
    full = torch.randn(shape)
    pieces = [shard.local_slice(full, r, size) for r in range(size)]
    assert all(p.shape == pieces[0].shape for p in pieces)
    assert list(full.shape) == shard.full_shape(pieces[0].shape, size)
    assert torch.equal(shard.assemble(pieces, size), full)


def test_sections_split_each_part():
    full = torch.arange(12.0)[:, None]
    shard = Shard("tp", 0, ((8, 4), (2, 2), (2, 2)))
    assert shard.local_slice(full, 0, 4).flatten().tolist() == [0, 1, 8, 10]
    assert shard.local_slice(full, 1, 4).flatten().tolist() == [2, 3, 8, 10]  # shares kv piece 0 with rank 0
    assert shard.local_slice(full, 3, 4).flatten().tolist() == [6, 7, 9, 11]


def test_uneven_cut_is_an_error():
    with pytest.raises(ValueError, match="cannot cut length 5 into 2 pieces"):
        Shard("tp", 0).local_slice(torch.zeros(5), 0, 2)
