"""ParallelDims (rank layout, groups, layout rules) and counted collectives on real gloo groups."""

import pytest
import torch

from moe_lc.config import ConfigError, ParallelConfig
from moe_lc.parallel import comm
from moe_lc.parallel.mesh import ParallelDims
from tests.harness import run_workers


def dims(world, **kw):
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_rank_layout_tp_innermost_and_coords_round_trip():
    d = dims(16, pp=2, dp=2, cp=2, tp=2, ep=4)
    assert (d.dp, d.edp) == (2, 2)
    for r in range(16):
        c = d.coords(r)
        assert d.rank_of(c["pp"], c["dp"], c["cp"], c["tp"]) == r
    assert d.coords(1)["tp"] == 1 and d.coords(2)["cp"] == 1 and d.coords(4)["dp"] == 1 and d.coords(8)["pp"] == 1


def test_groups_partition_each_stage():
    d = dims(16, pp=2, dp=2, cp=2, tp=2, ep=4)
    for name, size in [("tp", 2), ("cp", 2), ("dp", 2), ("dp_cp", 4), ("dp_cp_tp", 8), ("ep", 4), ("edp", 2), ("pp", 2)]:
        groups = d.group_ranks(name)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(16)), name  # every rank in exactly one group of each kind
        assert all(len(g) == size for g in groups), name
    assert d.group_ranks("tp")[0] == [0, 1]
    assert d.group_ranks("cp")[0] == [0, 2]
    assert d.group_ranks("dp")[0] == [0, 4]
    assert d.group_ranks("ep")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # consecutive ranks: EP stays in a node
    assert d.group_ranks("edp")[0] == [0, 4]
    assert d.group_ranks("pp")[0] == [0, 8]


@pytest.mark.parametrize("kw, world, message", [
    (dict(pp=3), 4, "parallel.pp*cp*tp=3 must divide the world size 4"),
    (dict(dp=3), 4, "parallel.pp*dp*cp*tp=3 must equal the world size 4"),
    (dict(tp=2, dp=3), 4, "parallel.pp*dp*cp*tp=6 must equal the world size 4"),
    (dict(ep=3), 4, "parallel.ep=3 must divide dp*cp*tp=4"),
    (dict(ep=4, pp=2), 4, "parallel.ep=4 must divide dp*cp*tp=2"),
    (dict(ranks_per_node=3), 6, None),  # 3 divides 6: fine
    (dict(ranks_per_node=4), 6, "parallel.ranks_per_node=4 must divide the world size 6"),
    (dict(tp=0), 4, "parallel degrees must be >= 1"),
])
def test_layout_rules_of_parallel_dims(kw, world, message):
    if message is None:
        dims(world, **kw)
        return
    with pytest.raises(ConfigError) as info:
        dims(world, **kw)
    assert any(message in e for e in info.value.errors), info.value.errors


def test_dp_zero_takes_the_rest():
    assert dims(8, tp=2).dp == 4 and dims(8, pp=2, cp=2).dp == 2


# -- counted collectives on real gloo groups ------------------------------------------------------

def _collectives(rank, world):
    d = ParallelDims.from_config(ParallelConfig(tp=2, ranks_per_node=2), world, rank)
    d.init_groups()
    dp, tp, world_g = d["dp"], d["tp"], d["world"]
    x = torch.full((12,), float(rank))
    comm.all_reduce(x, world_g)
    out = torch.empty(3)
    comm.reduce_scatter(out, torch.arange(12, dtype=torch.float32) * (rank + 1), world_g)
    gathered = torch.empty(8, 5)
    comm.all_gather(gathered, torch.full((2, 5), float(rank)), world_g)
    # all-to-all over the world with uneven splits: rank r sends (p+1) rows of width 3 to peer p
    in_splits = [p + 1 for p in range(world)]
    out_splits = [rank + 1] * world
    recv = torch.empty(sum(out_splits), 3)
    comm.all_to_all(recv, torch.full((sum(in_splits), 3), float(rank)), out_splits, in_splits, world_g)
    # tp pairs (0,1), (2,3) stay in a node; dp pairs (0,2), (1,3) cross nodes
    comm.all_reduce(torch.ones(10), tp)
    comm.all_reduce(torch.ones(10), dp)
    return {"x": x, "rs": out, "ag": gathered, "a2a": recv, "bytes": dict(d.counter.bytes),
            "inter": dict(d.counter.inter_node)}


def test_counted_bytes_match_the_ring_formulas_and_results_are_right():
    results = run_workers(_collectives, 4, ranks_per_node=2)
    N, f32 = 4, 4
    for rank, r in enumerate(results):
        assert torch.equal(r["x"], torch.full((12,), 6.0))
        assert torch.equal(r["rs"], torch.arange(12, dtype=torch.float32)[3 * rank:3 * rank + 3] * 10)
        assert torch.equal(r["ag"][:, 0], torch.tensor([0., 0, 1, 1, 2, 2, 3, 3]))
        assert torch.equal(r["a2a"][:, 0], torch.cat([torch.full((rank + 1,), float(p)) for p in range(N)]))
        b = r["bytes"]
        assert b[("world", "all_reduce")] == 2 * (N - 1) * 12 * f32 // N
        assert b[("world", "reduce_scatter")] == (N - 1) * 12 * f32 // N
        assert b[("world", "all_gather")] == (N - 1) * 8 * 5 * f32 // N
        assert b[("world", "all_to_all")] == sum((p + 1) * 3 * f32 for p in range(N) if p != rank)
        assert b[("tp", "all_reduce")] == b[("dp", "all_reduce")] == 2 * 1 * 10 * f32 // 2
        inter = r["inter"]
        assert inter.get(("tp", "all_reduce"), 0) == 0  # tp pairs are inside a node
        assert inter[("dp", "all_reduce")] == b[("dp", "all_reduce")]  # dp pairs cross nodes
        other_node = [p for p in range(N) if p // 2 != rank // 2]
        assert inter[("world", "all_to_all")] == sum((p + 1) * 3 * f32 for p in other_node)
        # the world ring crosses a node boundary after ranks 1 and 3
        assert inter.get(("world", "all_reduce"), 0) == (b[("world", "all_reduce")] if rank in (1, 3) else 0)


def test_size_one_groups_count_nothing():
    g = comm.single_group("dp")
    out = torch.empty(4)
    comm.reduce_scatter(out, torch.arange(4.0), g)
    comm.all_reduce(out, g)
    assert torch.equal(out, torch.arange(4.0)) and g.counter.total() == 0


def test_collectives_refuse_a_tensor_off_the_groups_device():
    """A CPU tensor handed to an NCCL group crashes only on a multi-GPU run; comm refuses it on any group
    size, naming the op, the group and both devices (the class of bug that broke EP metrics and the
    token count on GPUs)."""
    for ranks in ([0], [0, 1]):
        g = comm.Group("ep", ranks, 0, device_type="cuda")
        with pytest.raises(ValueError, match=r"all_reduce on group 'ep' got a tensor on cpu.*runs on cuda.*NCCL"):
            comm.all_reduce(torch.zeros(3), g)
        with pytest.raises(ValueError, match="all_to_all on group 'ep'"):
            comm.all_to_all(torch.zeros(2), torch.zeros(2), [2], [2], g)
        with pytest.raises(ValueError, match="all_gather"):
            comm.all_gather(torch.zeros(2), torch.zeros(2), g)
    dims = ParallelDims.from_config(ParallelConfig(), 1, 0, device_type="cuda")
    dims.init_groups()
    assert all(g.device_type == "cuda" for g in dims.groups.values())
    comm.all_reduce(torch.zeros(3), comm.single_group("dp", device_type="cpu"))  # a matching device passes
