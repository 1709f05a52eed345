"""Meta-device build: each rank materializes only its shards, with the values a single device would have.

The golden runs (tests/test_golden.py) hold the trainer's whole path to bit-identical losses; this file
checks the pieces (the chunked seeded draw, every kind of shard) and the reason for it all: the
671B recipe's pipeline rank 0 built in one CPU process allocates that rank's parameters, no more.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model.init import normal_rows, param_seed
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.parallelize import _local_normal
from moe_lc.parallel.placement import Shard

ROOT = Path(__file__).resolve().parents[1]


def full_draw(shape, seed, name):
    return torch.randn(shape, generator=torch.Generator().manual_seed(param_seed(seed, name)))


@pytest.mark.parametrize("shape", [(7,), (3, 5), (40, 24), (33, 10), (17, 3, 5), (100, 48), (1, 1000), (257, 7)])
@pytest.mark.parametrize("chunk", [16, 50, 1000, 1 << 20])
def test_chunked_draw_equals_one_draw(shape, chunk):
    got = torch.cat([rows for _, rows in normal_rows(shape, 3, "w", chunk_elems=chunk)])
    assert torch.equal(got, full_draw(shape, 3, "w"))


@pytest.mark.parametrize("shard, full_shape", [
    (Shard("tp", 0), (12, 20)), (Shard("tp", 1), (12, 20)), (Shard("ep", 0), (8, 6, 5)),
    (Shard("tp", 0, ((8, 4), (2, 2), (2, 2))), (12, 20)),  # wqkv: q split, kv heads replicated in pairs
    (Shard("tp", 0, ((8, 4), (4, 4))), (12, 3))])
def test_local_draw_equals_the_slice_of_the_full_draw(shard, full_shape):
    full = full_draw(full_shape, 0, "p")
    for rank in range(4):
        dims = ParallelDims(pp=1, dp=1, cp=1, tp=4, ep=4, world=4, ranks_per_node=4, rank=rank)
        dims.init_groups(virtual=True)
        got = _local_normal(full_shape, (shard,), dims, 0, "p")
        assert torch.equal(got, shard.local_slice(full, rank, 4)), rank


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_671b_pipeline_rank0_builds_only_its_shards():
    """DeepSeek-V3's layout (PP16 DualPipe x EP64 x ZeRO-1 over 2048 ranks), rank 0 built in this process
    on virtual groups: the parameters it allocates equal the planner's parameter bytes for pipeline rank 0
    (its two mirrored stages, 4 of 256 experts per MoE layer), and the process grows by about that."""
    from tools.planner.plan import plan

    cfg = load_config(ROOT / "recipes" / "deepseek_v3_671b.toml", world_size=2048)
    dims = ParallelDims.from_config(cfg.parallel, 2048, rank=0)
    dims.init_groups(virtual=True)
    from moe_lc.parallel.build import build_rank_model

    before, t0 = _rss_bytes(), time.perf_counter()
    built = build_rank_model(cfg, dims, "cpu")
    seconds, grown = time.perf_counter() - t0, _rss_bytes() - before
    local = sum(p.numel() * p.element_size() for p in built.module.parameters())
    planned = plan(cfg, 2048).ranks[0].memory["params"]
    print(f"671B rank 0: {local / 2**30:.2f} GiB of parameters built in {seconds:.0f} s (planner "
          f"{planned / 2**30:.2f} GiB); RSS grew {grown / 2**30:.2f} GiB; stages {built.stage_ids}")
    assert built.stage_ids == [0, 15]
    assert local == planned
    assert grown < 1.15 * local + 2**30  # no full tensor of a sharded parameter was ever held
