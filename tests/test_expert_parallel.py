"""Expert parallelism: dispatch/combine exactness, node-limited traffic by count, equivalence to one
device, and consistent aux-loss-free balancing under EP."""

import copy
import json
from pathlib import Path

import pytest
import torch

from moe_lc.config import model_config, ParallelConfig
from moe_lc.parallel.comm import Group
from moe_lc.parallel.ep.dispatch import ExpertTopology
from moe_lc.model.seams import through
from tests.harness import FAST, RECIPES, assert_equivalent, reference, run_layout, run_workers

RECIPE = RECIPES / "debug_cpu.toml"
BASE = ["train.steps=5", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=1", "train.warmup_steps=2"]


# -- topology ---------------------------------------------------------------------------------------
def _topo(ranks, rank, node_size, n_experts):
    return ExpertTopology.of(Group("ep", ranks, rank, node_size=node_size), n_experts)


def test_topology_nodes_forwarders_and_group_mapping():
    t = _topo(list(range(8, 16)), 3, 2, 16)  # ep block of ranks 8..15, 2 ranks per node
    assert t.node_of_rank == (0, 0, 1, 1, 2, 2, 3, 3) and t.local_index == (0, 1) * 4
    assert [t.forwarder(3, b) for b in range(4)] == [1, 3, 5, 7]  # same local index on every node
    assert t.node_of_expert(torch.tensor([0, 3, 4, 15])).tolist() == [0, 0, 1, 3]
    t.check_groups_map_to_nodes(n_groups=4, topk_groups=2)  # one group per node
    t.check_groups_map_to_nodes(n_groups=8, topk_groups=2)  # two groups per node
    with pytest.raises(ValueError, match="expert group 0 .* lies on ep nodes \\[0, 1\\]"):
        t.check_groups_map_to_nodes(n_groups=2, topk_groups=1)
    t.check_groups_map_to_nodes(n_groups=2, topk_groups=2)  # no group limit: nothing promised
    # an ep block that straddles a node boundary (ep=4 inside 6-rank nodes): its groups must still map
    s = _topo([4, 5, 6, 7], 0, 6, 8)
    assert s.node_of_rank == (0, 0, 1, 1)
    s.check_groups_map_to_nodes(n_groups=2, topk_groups=1)
    with pytest.raises(ValueError, match="node-limited routing"):
        _topo([3, 4, 5, 6], 0, 6, 8).check_groups_map_to_nodes(n_groups=2, topk_groups=1)


# -- dispatch + experts + combine vs one device ------------------------------------------------------
def _model_cfg(E, K, G, TG, D=32, F=24):
    return model_config(dim=D, n_heads=2, n_kv_heads=1, n_layers=2, n_dense_layers=1, n_routed_experts=E,
                       n_shared_experts=0, moe_ffn_dim=F, topk=K, n_groups=G, topk_groups=TG)


def _problem(sizes, E, K, G, TG, D, hot=0, seed=0):
    """The same global tokens, routing and gates on every rank; rank r owns the next sizes[r] tokens.
    hot: every token prefers experts [0, hot) (at most K of them, so it picks them all)."""
    from moe_lc.model.moe import route

    n = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    x[:, 0] = torch.arange(n) / 1024.0  # a token id, exact in fp32: lets ranks report arrivals
    scores = torch.rand(n, E, generator=g)
    scores[:, :hot] += 1.0
    idx = route(scores, torch.zeros(E), G, TG, K)
    w = torch.rand(n, K, generator=g) + 0.1
    return x, idx, w


def _ep_case(rank, dims, mode, sizes, shape, hot):
    """EP forward/backward of this rank's tokens vs the single-device result on all tokens, counted
    inter-node bytes per phase, and which token ids arrived at this rank."""
    from moe_lc.model.moe import LocalDispatcher, RoutedExperts
    from moe_lc.parallel.ep.dispatch import DISPATCHERS, ExpertTopology, named_counters
    from moe_lc.parallel.placement import Placements, Shard

    E, K, G, TG, D, F = shape
    x_all, idx_all, w_all = _problem(sizes, E, K, G, TG, D, hot)
    torch.manual_seed(1)
    experts = RoutedExperts(E, D, F)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    dy_all = torch.randn(sum(sizes), D, generator=torch.Generator().manual_seed(2))
    ep_experts = copy.deepcopy(experts)  # shard a fresh copy (autograd caches a leaf's shape)

    # one device, all tokens
    xr, wr = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    local = LocalDispatcher()
    xs, counts, h = local.dispatch_now(xr, idx_all, E)
    ref = local.combine_now(experts(xs, counts), wr, h)
    (ref * dy_all).sum().backward()
    ref_grads = [p.grad.clone() for p in experts.parameters()]

    # expert parallel, this rank's tokens
    ep, experts = dims["ep"], ep_experts
    for lin in (experts.w13, experts.w2):
        Placements().shard_(lin.weight, Shard("ep", 0), ep)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    x, w = x_all[mine].clone().requires_grad_(), w_all[mine].clone().requires_grad_()
    d = DISPATCHERS[mode](ep, ExpertTopology.of(ep, E))
    counter, phases = dims.counter, {}
    counter.reset()
    rows, counts, handle = d.dispatch(x, idx_all[mine], E)
    (arrived,) = through((rows,))  # hierarchical: the pairs this rank received as a forwarder
    xs = d.arrange(arrived, handle)
    phases["dispatch"] = dict(counter.inter_node)
    counter.reset()
    ys = experts(xs, counts)
    out = d.combine_now(ys, w, handle)
    phases["combine"] = dict(counter.inter_node)
    counter.reset()
    (out * dy_all[mine]).sum().backward()
    phases["backward"] = dict(counter.inter_node)
    El = E // ep.size
    errs = {"out": _rel(out, ref[mine]), "x_grad": _rel(x.grad, xr.grad[mine]), "w_grad": _rel(w.grad, wr.grad[mine]),
            "expert_grad": max(_rel(p.grad, g[rank * El:(rank + 1) * El])
                               for p, g in zip(experts.parameters(), ref_grads))}
    return {"errs": errs, "counts": counts.tolist(), "arrived": _ids(xs), "phases": phases,
            "pairs": _ids(arrived) if mode == "hierarchical" else None,
            "stats": named_counters(d.spread(idx_all[mine]), d.topo.n_nodes)}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def _ids(rows):
    """Token ids from column 0 of received rows (see `_problem`)."""
    return (rows[:, 0] * 1024).round().long().tolist()


def _dispatch_worker(rank, world, rpn, cases):
    from moe_lc.parallel.mesh import ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(ep=world, ranks_per_node=rpn), world, rank)
    dims.init_groups()
    return [_ep_case(rank, dims, *case) for case in cases]


def _assert_exact_and_complete(results, sizes, shape, hot=0):
    for r in results:
        assert max(r["errs"].values()) < 1e-5, r["errs"]
    _, idx, _ = _problem(sizes, *shape[:5], hot)
    El = shape[0] // len(results)
    for rank, r in enumerate(results):  # every (token, slot) copy arrived exactly once, at its expert's rank
        want = sorted(t for t in range(sum(sizes)) for e in idx[t].tolist() if e // El == rank)
        assert sorted(r["arrived"]) == want
        assert sum(r["counts"]) == len(want)


@pytest.mark.parametrize("rpn", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_dispatch_combine_match_one_device_forward_and_backward(rpn):
    """ep=4 over 2 (or 4) simulated nodes, uneven tokens per rank; a rank that routes no tokens, and
    ranks whose experts receive none (everything routed to ep rank 0's experts), still take part."""
    shape = (16, 4, 4, 2, 32, 24)  # E, K, n_groups, topk_groups, D, F
    sizes, empty = [24, 16, 24, 20], [0, 24, 20, 8]
    cases = [(m, sizes, shape, 0) for m in ("flat", "hierarchical")]
    cases += [(m, empty, shape, 4) for m in ("flat", "hierarchical")]
    results = run_workers(_dispatch_worker, 4, rpn, cases, ranks_per_node=rpn)
    for c, (mode, sz, shp, hot) in enumerate(cases):
        _assert_exact_and_complete([r[c] for r in results], sz, shp, hot)
    assert [sum(r[2]["counts"]) for r in results][1:] == [0, 0, 0]  # only ep rank 0's experts got tokens


# -- node-limited traffic, counted --------------------------------------------------------------------
def _expected_inter_node_bytes(sizes, idx, E, K, D, rpn):
    """Per rank, from the routing decisions alone: inter-node all-to-all bytes of each dispatcher's
    forward (dispatch, combine) with fp32 rows of D values, ep = world, ranks_per_node = rpn."""
    world = len(sizes)
    El, row, meta = E // world, 4 * D, 4 * K  # meta: int32 expert ids or fp32 gates per (token, node) pair
    owner = torch.repeat_interleave(torch.arange(world), torch.tensor(sizes))

    def node_of(rank):
        return rank // rpn

    flat = {"dispatch": [0] * world, "combine": [0] * world}
    hier = {"dispatch": [0] * world, "combine": [0] * world}
    for t, experts in enumerate(idx.tolist()):
        s = owner[t].item()
        for e in experts:
            if node_of(e // El) != node_of(s):
                flat["dispatch"][s] += row  # each (token, slot) copy crosses
                flat["combine"][e // El] += row  # and its output crosses back
        for b in {node_of(e // El) for e in experts} - {node_of(s)}:
            hier["dispatch"][s] += row + meta  # one copy (+ its expert ids) per remote node
            hier["combine"][s] += meta  # its gates, sent with combine
            hier["combine"][b * rpn + s % rpn] += row  # one summed row returns from s's forwarder on b
    return flat, hier


def test_node_limited_routing_and_hierarchical_traffic_by_count():
    """ep=8 over 4 simulated nodes (ranks_per_node=2), n_groups=4, topk_groups=2: each token reaches
    at most 2 nodes; hierarchical dispatch crosses to each of them once; inter-node bytes of both
    dispatchers equal the counts predicted from the routing decisions, hierarchical <= flat."""
    world, rpn = 8, 2
    shapes = {"16 experts, top-4": (16, 4, 4, 2, 32, 24), "debug_cpu: 8 experts, top-2": (8, 2, 4, 2, 128, 96)}
    sizes = [32] * world
    cases = [(m, sizes, shape, 0) for shape in shapes.values() for m in ("flat", "hierarchical")]
    results = run_workers(_dispatch_worker, world, rpn, cases, ranks_per_node=rpn)
    A2A = ("ep", "all_to_all")
    for i, (label, shape) in enumerate(shapes.items()):
        E, K, G, TG, D, _ = shape
        flat_r, hier_r = [r[2 * i] for r in results], [r[2 * i + 1] for r in results]
        _assert_exact_and_complete(flat_r, sizes, shape)
        _assert_exact_and_complete(hier_r, sizes, shape)
        _, idx, _ = _problem(sizes, *shape[:5])
        want_nodes = [{(e // (E // world)) // rpn for e in experts} for experts in idx.tolist()]
        assert max(len(n) for n in want_nodes) <= TG
        # flat: where each token's copies really arrived
        reached = [set() for _ in want_nodes]
        for rank, r in enumerate(flat_r):
            for t in r["arrived"]:
                reached[t].add(rank // rpn)
        assert reached == want_nodes
        # hierarchical: each token arrived at exactly one forwarder of each of its nodes
        pairs = sorted((t, rank // rpn) for rank, r in enumerate(hier_r) for t in r["pairs"])
        assert pairs == sorted((t, b) for t, nodes in enumerate(want_nodes) for b in nodes)
        # counted bytes = predicted bytes, per rank and phase
        flat, hier = _expected_inter_node_bytes(sizes, idx, E, K, D, rpn)
        for phase in ("dispatch", "combine"):
            assert [r["phases"][phase].get(A2A, 0) for r in flat_r] == flat[phase], (label, phase)
            assert [r["phases"][phase].get(A2A, 0) for r in hier_r] == hier[phase], (label, phase)
        # the dispatchers' own counters say the same, in token copies
        slots = sum(int(r["stats"]["inter_node_slots"]) for r in flat_r)
        n_pairs = sum(int(r["stats"]["inter_node_pairs"]) for r in hier_r)
        assert slots * 4 * D == sum(flat["dispatch"]) and n_pairs * (4 * D + 4 * K) == sum(hier["dispatch"])
        # backward = the inverse all-to-alls: the same totals, less the expert ids (no gradient)
        fwd_flat, fwd_hier = _phase_total(flat_r, "dispatch", "combine"), _phase_total(hier_r, "dispatch", "combine")
        assert _phase_total(flat_r, "backward") == fwd_flat
        assert _phase_total(hier_r, "backward") == fwd_hier - n_pairs * 4 * K
        assert sum(hier["dispatch"]) <= sum(flat["dispatch"]) and fwd_hier <= fwd_flat
        print(f"{label}: inter-node all-to-all bytes, forward (dispatch + combine) + backward: flat {fwd_flat} + "
              f"{_phase_total(flat_r, 'backward')}, hierarchical {fwd_hier} + {_phase_total(hier_r, 'backward')}; "
              f"copies crossing nodes per token: flat {slots / sum(sizes):.3f}, hierarchical {n_pairs / sum(sizes):.3f}")


def _phase_total(rank_results, *phases):
    return sum(r["phases"][p].get(("ep", "all_to_all"), 0) for r in rank_results for p in phases)


# -- equivalence with one device -----------------------------------------------------------------------
def _equivalent(overrides, world, ranks_per_node=None):
    ref = reference(RECIPE, BASE)
    got = run_layout(RECIPE, BASE + overrides, world=world, ranks_per_node=ranks_per_node)
    report = assert_equivalent(ref, got, rtol=1e-5)
    print(f"{overrides}: max loss rel diff {report.max_loss_rel:.1e}, max param rel diff "
          f"{report.max_param_rel:.1e} ({report.worst_param})")
    return got


@pytest.mark.parametrize("ep, dispatch, rpn", [
    pytest.param(2, "flat", None, marks=pytest.mark.slow),
    pytest.param(4, "flat", None, marks=pytest.mark.slow),
    pytest.param(4, "hierarchical", 2, marks=pytest.mark.slow),
    pytest.param(8, "flat", None, marks=pytest.mark.slow),
    pytest.param(8, "hierarchical", 2, marks=pytest.mark.slow),
])
def test_ep_folded_into_dp_trains_like_one_device(ep, dispatch, rpn):
    """fp32, 5 steps, ep = dp = world: losses and gathered parameters (experts, router biases) within 1e-5."""
    _equivalent([f"parallel.ep={ep}", f"parallel.expert_dispatch={dispatch}"], ep, rpn)


@pytest.mark.parametrize("dispatch", ["hierarchical", pytest.param("flat", marks=pytest.mark.slow)])
def test_ep_with_expert_data_parallel_zero_trains_like_one_device(dispatch):
    """ep=2 inside dp=4 (edp=2), ep spanning 2 nodes (ranks_per_node=1): expert gradients summed and
    ZeRO-1 sharded over edp, whose counted reduce-scatter / all-gather bytes follow the formula."""
    from moe_lc.config import load_config
    from moe_lc.model.counting import param_counts

    got = _equivalent(["parallel.ep=2", f"parallel.expert_dispatch={dispatch}"], 4, ranks_per_node=1)
    experts_local = param_counts(load_config(RECIPE).model)["routed_experts"] // 2  # this rank's half
    for rank in range(4):
        for step in got.comm_per_rank[rank]:
            assert step["comm/edp/reduce_scatter_bytes"] == experts_local * 4 // 2  # (edp-1)/edp x fp32
            assert step["comm/edp/all_gather_bytes"] == experts_local * 4 // 2


def test_ep_over_dp_and_tp_trains_like_one_device():
    _equivalent(["parallel.tp=2", "parallel.ep=4"], 4)


# -- balancing state under EP ---------------------------------------------------------------------------
def _skewed_bias_worker(rank, world, overrides, embed_skew=0.15, gate_skew=0.15):
    """Train with every token pulled toward experts 0 and 1 (a shared direction u in the embeddings and
    in those experts' gate rows); record per-step metrics and every rank's router biases."""
    import moe_lc.parallel.build as build
    import moe_lc.train as train
    from moe_lc.config import load_config

    materialize = build.materialize

    def skewed(parallel, *args, **kw):  # the initialized model, before the optimizer copies it
        materialize(parallel, *args, **kw)
        model = parallel.module
        u = torch.nn.functional.normalize(torch.randn(model.cfg.dim, generator=torch.Generator().manual_seed(7)), dim=0)
        with torch.no_grad():
            model.embed.weight += embed_skew * u
            for moe in model.moe_layers().values():
                moe.router.gate.weight[:2] += gate_skew * u
        return parallel

    build.materialize = skewed
    trainer = train.Trainer(load_config(RECIPE, FAST + overrides, world_size=world))
    trainer.fit()
    biases = torch.stack([m.router.expert_bias for m in trainer.model.moe_layers().values()])
    metrics = None
    if rank == 0:
        lines = (Path(trainer.cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
    return {"biases": biases, "metrics": metrics}


def test_skewed_router_is_balanced_by_bias_and_every_replica_holds_the_same_bias(tmp_path):
    """ep=4 over 2 nodes, hierarchical dispatch, 2 micro-batches per rank, tiny lr (the bias does the work)."""
    steps = 12
    overrides = BASE + [f"train.steps={steps}", "train.lr=1e-5", "model.moe.bias_update_speed=0.02",
                        "parallel.ep=4", "parallel.expert_dispatch=hierarchical", f"train.output_dir={tmp_path}"]
    results = run_workers(_skewed_bias_worker, 4, overrides, ranks_per_node=2)
    biases = [r["biases"] for r in results]
    assert all(torch.equal(b, biases[0]) for b in biases[1:])  # every replica, bit for bit
    assert (biases[0][:, :2].mean(1) < biases[0][:, 2:].mean(1)).all()  # the favoured experts were pushed down
    metrics = results[0]["metrics"]
    layers = sorted(k for k in metrics[0] if k.startswith("moe/imbalance/layer"))
    first = [metrics[0][k] for k in layers]
    last = [sum(m[k] for m in metrics[-3:]) / 3 for k in layers]
    assert min(first) > 2.5, first  # most tokens on experts 0 and 1 (max/mean 4 = all of them)
    assert all(b < 0.6 * a for a, b in zip(first, last)), (first, last)
    # the logged loads (summed over all ranks and micro-batches) count every routed copy once, and the
    # dispatchers' metrics come with them
    tokens = 8 * 64 * 2  # global_batch * seq_len * topk per step
    for step, m in enumerate(metrics):
        for k in layers:
            layer = k.rsplit("layer", 1)[1]
            assert sum(m[f"moe/load/layer{layer}"]) == tokens
            assert m[f"moe/expert_imbalance/layer{layer}"] == pytest.approx(m[k], rel=1e-6), step
            assert m[f"moe/nodes_per_token_max/layer{layer}"] <= 2
    print("imbalance (max/mean) per MoE layer, step 1 -> last 3 steps:", first, "->", last)
