"""Expert parallelism: routed experts sharded over the ep group, tokens moved by all-to-all.

Legend: T tokens on this rank, K experts per token, D model dim, E routed experts (global),
R = ep group size, El = E / R experts per rank, N nodes the ep group spans, P (token, node) pairs.

Placement: ep rank j holds experts [j*El, (j+1)*El) -- `Shard("ep", 0)` on w13 (E, 2F, D) and
w2 (E, D, F). Their gradients are summed (and ZeRO-1 sharded) over "edp", the ranks that hold the
same experts. A node is `ranks_per_node` consecutive global ranks; expert groups must map onto nodes
so that group-limited routing (`topk_groups`) is node-limited routing (checked at apply time).

Two dispatchers (a strategy choice: `parallel.expert_dispatch`):

  flat          every (token, slot) copy goes straight to its expert's rank: one all-to-all over ep
                each way. A token with several experts on one remote node crosses to it several times.
  hierarchical  (the DeepEP idea) stage 1 sends each token once to every node that holds one of its
                experts, to the rank there with the same local index as the sender (the "forwarder"),
                with its expert ids; stage 2 fans it out inside the node. Combine reverses it: the
                forwarder weights and sums the token's outputs from its node's experts, so one copy
                returns per (token, node). Gate weights travel sender -> forwarder inside combine.

Both keep the rows of an expert in (source rank, token) order, hand `RoutedExperts` the rows grouped
by local expert with counts (El,), and sum each token's K outputs deterministically. The all-to-alls
between the layer's phases travel as `RowTransfer`s (row_transfer.py): issued at the end of one
phase, waited at the start of the next, so a pipeline's F&B step computes the other micro-batch in
between. One host sync per dispatch brings the layout to the host (splits for the all-to-all, and the
per-expert counts the grouped GEMMs take without a sync of their own). All collectives
run on the ep group (stage 1 and stage 2 are all-to-alls with zero splits outside their peers), so
`comm` counts every byte, and the bytes whose receiver is on another node separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_lc.model.moe import MoE, TokenDispatcher, expert_counts, pad_dropped, unsort_and_sum
from moe_lc.ops.grouped_gemm import known_sizes
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.ep.row_transfer import RowTransfer
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Placements, Shard


# -- the collective -------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows of x (sum(in_splits), ...) go to ep ranks 0..R-1 by `in_splits`; returns the rows received,
    (sum(out_splits), ...), in source-rank order. Both sides are sharded over ep (each rank its own rows).

    Backward: the inverse all-to-all of the gradient (splits swapped), so each row's gradient
    returns to the rank the row came from.
    """

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group: Group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_out):
        return _all_to_all(grad_out, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


# -- where experts live ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertTopology:
    """Experts over the ep group and ep ranks over nodes.

    node_of_rank[j]: node (0..N-1, in the order they appear in the group) of ep rank j;
    local_index[j]: j's position among the ep ranks on its node.
    """

    n_experts: int
    size: int
    rank: int
    node_of_rank: tuple[int, ...]
    local_index: tuple[int, ...]

    @classmethod
    def of(cls, group: Group, n_experts: int) -> "ExpertTopology":
        if n_experts % group.size:
            raise ValueError(f"{n_experts} routed experts cannot be split over ep={group.size} ranks")
        physical = [group.node_of(j) for j in range(group.size)]
        node_ids = {n: i for i, n in enumerate(dict.fromkeys(physical))}
        nodes = tuple(node_ids[n] for n in physical)
        # dispatch orders rows by destination node and relies on that being ep-rank order
        assert list(nodes) == sorted(nodes), f"ep group {group.ranks} interleaves nodes"
        local = tuple(nodes[:j].count(nodes[j]) for j in range(group.size))
        return cls(n_experts, group.size, group.rank, nodes, local)

    @property
    def per_rank(self) -> int:
        return self.n_experts // self.size

    @property
    def n_nodes(self) -> int:
        return max(self.node_of_rank) + 1

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    def ranks_on(self, node: int) -> list[int]:
        return [j for j, n in enumerate(self.node_of_rank) if n == node]

    def forwarder(self, sender: int, node: int) -> int:
        """The ep rank on `node` that receives `sender`'s tokens in stage 1 (same local index)."""
        ranks = self.ranks_on(node)
        return ranks[self.local_index[sender] % len(ranks)]

    def node_of_expert(self, idx: torch.Tensor) -> torch.Tensor:
        nodes = torch.tensor(self.node_of_rank, device=idx.device)
        return nodes[idx // self.per_rank]

    def check_groups_map_to_nodes(self, n_groups: int, topk_groups: int) -> None:
        """Node-limited routing: with the group limit on and ep spanning nodes, each expert group's
        experts must live on one node, so a token's experts lie on at most `topk_groups` nodes."""
        if self.n_nodes == 1 or topk_groups >= n_groups:
            return
        per_group = self.n_experts // n_groups
        for g in range(n_groups):
            nodes = {self.node_of_rank[e // self.per_rank] for e in range(g * per_group, (g + 1) * per_group)}
            if len(nodes) > 1:
                raise ValueError(
                    f"expert group {g} (experts {g * per_group}..{(g + 1) * per_group - 1}) lies on ep nodes "
                    f"{sorted(nodes)}: node-limited routing needs every group inside one node; make "
                    f"model.moe.n_groups={n_groups} a multiple of the {self.n_nodes} nodes parallel.ep={self.size} "
                    f"spans and let ep blocks start at node boundaries (parallel.ranks_per_node)")


def _expert_major(recv_RL: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Rows arrive (source rank, local expert)-major with counts recv_RL (R, El), n_rows in all (known on
    the host: no sync to size the output); the permutation that groups them by local expert (stable:
    source rank, then arrival order, inside each)."""
    R, El = recv_RL.shape
    expert_of_row = torch.arange(El, device=recv_RL.device).repeat(R).repeat_interleave(
        recv_RL.flatten(), output_size=n_rows)
    return expert_of_row.argsort(stable=True)


# -- dispatchers ----------------------------------------------------------------------------------
def counter_elems(n_experts: int, n_nodes: int) -> int:
    """fp64 elements per MoE layer in the step's metrics all-reduce under EP: the router's load of each expert
    (the one count of it) and the dispatcher's `spread` (nodes-per-token histogram 0..N, tokens, slots, pairs)."""
    return n_experts + (n_nodes + 1) + 3


def named_counters(c, n_nodes: int) -> dict:
    """A dispatcher's counters (a (N + 4,) tensor or list, see `AllToAllDispatcher.spread`) by name."""
    return {"nodes_per_token": c[:n_nodes + 1], "tokens": c[n_nodes + 1], "inter_node_slots": c[n_nodes + 2],
            "inter_node_pairs": c[n_nodes + 3]}


class AllToAllDispatcher(TokenDispatcher):
    """Flat dispatch: one all-to-all over ep each way (see the module docstring).

    `spread` counts how a forward's tokens spread over ep ranks and nodes; the MoE layer books it in the
    step's ForwardStats beside the router's expert loads, and the trainer logs it (nothing is kept here).
    """

    def __init__(self, group: Group, topo: ExpertTopology, overlap: bool = True):
        self.group, self.topo, self.overlap = group, topo, overlap

    # -- metadata ---------------------------------------------------------------------------------
    def _gather(self, vec: torch.Tensor) -> torch.Tensor:
        """Every ep rank's int64 vector (n,) -> (R, n) (one small all-gather: the dispatch layout)."""
        out = vec.new_empty(self.group.size * vec.numel())
        comm.all_gather(out, vec, self.group)
        return out.view(self.group.size, -1)

    @torch.no_grad()
    def spread(self, idx_TK: torch.Tensor) -> torch.Tensor:
        """The routed copies idx (T, K) (the phantom id E for one dropped over capacity) counted, (N + 4,) fp64
        on idx's device (the step's metrics all-reduce it there; no host sync):

        nodes_per_token (N+1,)  histogram: tokens whose experts lie on n distinct nodes
        tokens ()               tokens routed
        inter_node_slots ()     (token, expert) copies whose expert is on another node (flat traffic)
        inter_node_pairs ()     (token, node) pairs with the node remote (hierarchical traffic)
        """
        topo, E, N = self.topo, self.topo.n_experts, self.topo.n_nodes  # a dropped copy (id E) goes to no node: N
        node_TK = topo.node_of_expert(idx_TK.clamp_max(E - 1)).masked_fill(idx_TK == E, N)
        has_TN = torch.zeros(len(idx_TK), N + 1, dtype=torch.bool, device=idx_TK.device).scatter_(1, node_TK, True)[:, :N]
        remote = has_TN.clone()
        remote[:, topo.node] = False
        hist = expert_counts(has_TN.sum(1), topo.n_nodes + 1)
        extra = torch.stack([((node_TK != topo.node) & (node_TK < N)).sum(), remote.sum()])
        tokens = torch.full((1,), idx_TK.shape[0], dtype=torch.float64, device=idx_TK.device)
        return torch.cat([hist.double(), tokens, extra.double()])

    # -- dispatch / combine -------------------------------------------------------------------------
    def dispatch(self, x_TD, idx_TK, n_experts, dropping: bool = False):
        """x (T, D), idx (T, K) -> rows for this rank's experts (a RowTransfer of T' rows), counts (El,), handle.
        `dropping`: copies with the phantom id E (dropped over capacity) sort last and are sent nowhere."""
        T, K = idx_TK.shape
        R, El, me = self.topo.size, self.topo.per_rank, self.topo.rank
        flat = idx_TK.flatten()
        order = flat.argsort(stable=True)  # (token, slot) copies sorted by expert = by destination rank
        counts_E = expert_counts(flat, n_experts + int(dropping))[:n_experts]
        recv_RL = self._gather(counts_E)[:, me * El:(me + 1) * El]  # (R, El): from each rank, per local expert
        # The one host sync of a dispatch: all_to_all_single takes its splits as host lists (NCCL must
        # know the sizes to post the transfers). Kernels that send into worst-case-sized buffers
        # (DeepEP) avoid it; torch's all-to-all cannot. The same copy gives the grouped GEMMs their
        # per-expert row counts (`known_sizes`), so they need no sync of their own.
        layout = torch.cat([counts_E.view(R, El).sum(1), recv_RL.flatten()]).tolist()
        send, recv_host = layout[:R], [layout[R + j * El:R + (j + 1) * El] for j in range(R)]
        recv = [sum(row) for row in recv_host]
        counts = known_sizes(recv_RL.sum(0), [sum(col) for col in zip(*recv_host)])
        rows = RowTransfer(x_TD[order[:sum(send)] // K], recv, send, self.group, self.overlap, self.fp8_tokens)
        regroup = _expert_major(recv_RL, sum(recv))
        return rows, counts, (order, regroup, send, recv, T, K)

    def sort_weights(self, weights_TK, handle):
        """Gate weights (T, K) -> the (T',) fp32 weights of the rows this rank's experts receive (one more
        all-to-all of 4 bytes per row; its backward returns the weights' gradients)."""
        order, regroup, send, recv, T, K = handle
        return RowTransfer(weights_TK.flatten()[order[:sum(send)]], recv, send, self.group, self.overlap)

    def arrange(self, rows, handle):
        return rows[handle[1]]

    def return_rows(self, y_sorted, handle):
        order, regroup, send, recv, T, K = handle
        return RowTransfer(y_sorted[regroup.argsort()], send, recv, self.group, self.overlap)

    def combine(self, y_back, weights_TK, handle):
        """Returned expert outputs (T*K, D) -> token order -> (weighted) sum over K -> (T, D)."""
        order, regroup, send, recv, T, K = handle
        return self.run_region(unsort_and_sum, pad_dropped(y_back, T * K), order, weights_TK, T, K)


@dataclass
class _HierHandle:
    pair_t: torch.Tensor  # (P,) token of each (token, node) pair this rank sent, node-major
    pair_n: torch.Tensor  # (P,) its node
    send1: list[int]  # stage 1 rows per ep rank (sender -> forwarder)
    recv1: list[int]
    slot_of_PK: torch.Tensor  # (P', K) at the forwarder: slot number of (pair, k) on this node, else n_slots
    order2: torch.Tensor  # forwarder's slots sorted by expert
    send2: list[int]  # stage 2 rows per ep rank (forwarder -> expert rank, same node)
    recv2: list[int]
    regroup: torch.Tensor
    slot_rows: torch.Tensor  # (n_slots,) forwarded row of each stage 2 slot, in expert order
    T: int


class HierarchicalDispatcher(AllToAllDispatcher):
    """Two-stage dispatch: across nodes once per (token, node), then inside the node (see the module
    docstring). The same `spread` as the flat dispatcher. Stage 1 (the inter-node crossing) travels as a
    RowTransfer between the dispatch and expert phases; stage 2 and the whole combine run inside their
    phases (intra-node, and the forwarders' sums need the gates)."""

    def dispatch(self, x_TD, idx_TK, n_experts, dropping: bool = False):
        assert not dropping, "model.moe.capacity_factor with the hierarchical dispatch is refused by the recipe rules"
        topo, R, El, me = self.topo, self.topo.size, self.topo.per_rank, self.topo.rank
        T, K = idx_TK.shape
        N = topo.n_nodes
        counts_E = expert_counts(idx_TK, n_experts)
        has_TN = torch.zeros(T, N, dtype=torch.bool, device=idx_TK.device)
        has_TN.scatter_(1, topo.node_of_expert(idx_TK), True)
        pair_n, pair_t = has_TN.t().nonzero(as_tuple=True)  # node-major, tokens in order
        pairs_N = has_TN.sum(0)
        layout = self._gather(torch.cat([counts_E, pairs_N]))  # (R, E + N)
        counts_RE, pairs_RN = layout[:, :n_experts].tolist(), layout[:, n_experts:].tolist()

        # stage 1: sender -> the forwarder on each destination node, with the tokens' expert ids
        send1, recv1 = [0] * R, [0] * R
        for b in range(N):
            send1[topo.forwarder(me, b)] += pairs_RN[me][b]
        for s in range(R):
            if topo.forwarder(s, topo.node) == me:
                recv1[s] = pairs_RN[s][topo.node]
        x_pairs = RowTransfer(x_TD[pair_t], recv1, send1, self.group, self.overlap)
        idx_PK = _all_to_all(idx_TK[pair_t].to(torch.int32), recv1, send1, self.group).long()

        # stage 2 (inside the node): forwarder -> expert ranks, one row per (token, expert on this node)
        on_node_PK = topo.node_of_expert(idx_PK) == topo.node
        slot_p, slot_k = on_node_PK.nonzero(as_tuple=True)
        n_slots = slot_p.numel()
        slot_of_PK = torch.full_like(idx_PK, n_slots)
        slot_of_PK[slot_p, slot_k] = torch.arange(n_slots, device=idx_PK.device)
        expert_S = idx_PK[slot_p, slot_k]
        order2 = expert_S.argsort(stable=True)
        send2 = expert_counts(expert_S // El, R).tolist()
        mine = slice(me * El, (me + 1) * El)
        recv2_RL = torch.zeros(R, El, dtype=torch.long, device=idx_TK.device)
        for s in range(R):  # sender s's copies for my experts come through its forwarder on my node
            recv2_RL[topo.forwarder(s, topo.node)] += torch.tensor(counts_RE[s][mine], device=idx_TK.device)
        recv2 = recv2_RL.sum(1).tolist()
        regroup = _expert_major(recv2_RL, sum(recv2))
        handle = _HierHandle(pair_t, pair_n, send1, recv1, slot_of_PK, order2, send2, recv2, regroup,
                             slot_p[order2], T)
        return x_pairs, recv2_RL.sum(0), handle

    def arrange(self, x_pairs, h: _HierHandle):
        """Stage 2: the forwarded pairs (P', D) -> this node's expert ranks -> grouped by local expert."""
        return AllToAll.apply(x_pairs[h.slot_rows], h.recv2, h.send2, self.group)[h.regroup]

    def return_rows(self, y_sorted, h: _HierHandle):
        return y_sorted  # combine takes the whole way back (the forwarders' sums need the gates)

    def sort_weights(self, weights_TK, handle):
        raise NotImplementedError("model.moe.weighted_swiglu with the hierarchical dispatch is not built")

    def combine(self, y_sorted, weights_TK, h: _HierHandle):
        """Expert rows -> forwarders (stage 2 inverse); each forwarder sums its node's weighted outputs
        per (token, node) pair; one row per pair returns to the sender (stage 1 inverse), which sums
        its token's pairs (node order) -> (T, D)."""
        y_fwd = AllToAll.apply(y_sorted[h.regroup.argsort()], h.send2, h.recv2, self.group)
        y_slots = y_fwd[h.order2.argsort()]
        w_PK = AllToAll.apply(weights_TK[h.pair_t], h.recv1, h.send1, self.group)  # gates to forwarders
        pad = torch.cat([y_slots, y_slots.new_zeros(1, y_slots.shape[1])])
        y_PKD = pad[h.slot_of_PK]  # (P', K, D): zeros for slots on other nodes
        z_pairs = (y_PKD * w_PK.to(y_PKD.dtype).unsqueeze(-1)).sum(1)
        z_back = AllToAll.apply(z_pairs, h.send1, h.recv1, self.group)  # (P, D), node-major
        P, N = z_back.shape[0], self.topo.n_nodes
        pair_of_TN = torch.full((h.T, N), P, dtype=torch.long, device=z_back.device)
        pair_of_TN[h.pair_t, h.pair_n] = torch.arange(P, device=z_back.device)
        pad = torch.cat([z_back, z_back.new_zeros(1, z_back.shape[1])])
        return pad[pair_of_TN].sum(1)


DISPATCHERS = {"flat": AllToAllDispatcher, "hierarchical": HierarchicalDispatcher}


# -- the layer plan's rule ------------------------------------------------------------------------
def expert_parallel_plan(model: nn.Module, dims: ParallelDims, expert_dispatch: str, placements: Placements,
                         plan) -> None:
    """Plan every MoE layer's routed experts sharded over ep (contiguous blocks of E/ep, into
    `placements`) and an all-to-all dispatcher (into the layer plan, moe_lc/parallel/layer_plan.py).
    Expert gradients are summed over edp (their placement's grad group)."""
    group = dims["ep"]
    for moe in model.modules():
        if not isinstance(moe, MoE):
            continue
        topo = ExpertTopology.of(group, moe.n_experts)
        topo.check_groups_map_to_nodes(moe.router.n_groups, moe.router.topk_groups)
        for linear in (moe.experts.w13, moe.experts.w2):
            placements.shard_(linear.weight, Shard("ep", 0), group)
            plan.set(linear, n_experts=topo.per_rank)
        plan.set(moe, dispatcher=DISPATCHERS[expert_dispatch](group, topo, overlap=dims.overlap))


def spread_counters(moes, routing: dict) -> torch.Tensor | None:
    """(L, N + 4) fp64: each MoE layer's dispatcher `spread` summed over the step, from the step's
    ForwardStats `routing` (zeros for a layer that routed nothing), rows in the order of `moes`; None when
    the layers have no expert-parallel dispatcher (ep = 1)."""
    dispatchers = [m.dispatcher for m in moes]
    if not any(isinstance(d, AllToAllDispatcher) for d in dispatchers):
        return None
    return torch.stack([routing.get(m.router, {}).get("spread", torch.zeros(
        d.topo.n_nodes + 4, dtype=torch.float64, device=d.group.device_type or "cpu"))
        for m, d in zip(moes, dispatchers)])  # expert parallelism swaps every layer's


def expert_parallel_metrics(moes: dict[str, MoE], loads: list[list[float]], counters: list[list[float]]) -> dict:
    """Metrics per MoE layer L from the step's expert loads (E per layer) and dispatcher counters
    (`spread_counters`), both summed over the stage's dp*cp*tp ranks and on the host, in `moes` order:

      moe/expert_imbalance/layer{L}         max / mean expert load
      moe/ep_rank_imbalance/layer{L}        max / mean tokens per ep rank (what bounds step time)
      moe/nodes_per_token_max/layer{L}      most nodes any token's experts lay on (<= topk_groups)
      moe/inter_node_tokens_per_token/layer{L}  token copies that crossed a node per routed token,
                                            for the active dispatcher (flat: slots, hierarchical: pairs)
    """
    out = {}
    for (name, moe), load, row in zip(moes.items(), loads, counters):
        d = moe.dispatcher
        E, R, c = d.topo.n_experts, d.topo.size, named_counters(row, d.topo.n_nodes)
        per_rank = [sum(load[j * E // R:(j + 1) * E // R]) for j in range(R)]
        out[f"moe/expert_imbalance/layer{name}"] = max(load) / max(sum(load) / E, 1e-9)
        out[f"moe/ep_rank_imbalance/layer{name}"] = max(per_rank) / max(sum(per_rank) / R, 1e-9)
        out[f"moe/nodes_per_token_max/layer{name}"] = max((n for n, h in enumerate(c["nodes_per_token"]) if h > 0),
                                                          default=0)
        crossed = c["inter_node_pairs"] if isinstance(d, HierarchicalDispatcher) else c["inter_node_slots"]
        out[f"moe/inter_node_tokens_per_token/layer{name}"] = crossed / max(c["tokens"], 1.0)
    return out
