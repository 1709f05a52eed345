"""DeepSeek-style MoE FFN: shared experts + fine-grained routed experts, group-limited routing,
aux-loss-free balancing, optional auxiliary losses (sequence-wise or global-batch balance, router
z-loss: balance_losses.py). No token dropping unless an expert capacity is set (capacity.py).

Legend: T tokens (B*S flattened), D model dim, E routed experts, G expert groups, K experts per token,
F expert hidden dim. Tokens reach experts through a `TokenDispatcher`: `LocalDispatcher` here (all
experts on this device); expert parallelism swaps in an all-to-all dispatcher from outside
(`moe_lc.parallel.ep.dispatch`) without touching this file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.balance_losses import TokenShards, balance_loss_shares, enabled_losses
from moe_lc.model.capacity import dropped_copies, drop_over_capacity, expert_capacity
from moe_lc.model.ffn import SwiGLU, clamp_gate_up, swiglu_then
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.model.seams import run_now, through
from moe_lc.ops.fp8_storage import FP8Rounded
from moe_lc.ops.linear import GroupedLinear, Linear
from moe_lc.ops.regions import region


def route(scores_TE: torch.Tensor, bias_E: torch.Tensor, n_groups: int, topk_groups: int, topk: int,
          group_score: str = "top2_sum") -> torch.Tensor:
    """Group-limited top-k selection on bias-adjusted affinities -> expert ids (T, K) int64.

    Experts are split into `n_groups` contiguous groups (one per node under EP). A group's score is
    the sum of its top-2 adjusted affinities (DeepSeek-V3) or its best one ("max", DeepSeek-V2's
    group-limited greedy); each token keeps its `topk_groups` best groups and picks its top-k experts
    inside them. The bias steers selection only (gate weights never see it).
    """
    sel_TE = scores_TE + bias_E
    if n_groups > 1 and topk_groups < n_groups:
        T, E = sel_TE.shape
        grouped = sel_TE.view(T, n_groups, E // n_groups)
        group_score_TG = grouped.topk(2, dim=-1).values.sum(-1) if group_score == "top2_sum" else grouped.amax(-1)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_score_TG.topk(topk_groups, dim=-1).indices, True)
        sel_TE = sel_TE.masked_fill(~keep_TG.repeat_interleave(E // n_groups, dim=1), float("-inf"))
    return sel_TE.topk(topk, dim=-1).indices


def expert_counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `idx` -> (n,) int64. `torch.bincount` with the same result,
    except that its output size is static: bincount sizes its output by max(idx) + 1, which costs a
    device-to-host sync on CUDA and has no shape on the meta device (the dry run)."""
    flat = idx.flatten()
    return torch.zeros(n, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


SCORE_FUNCS = {"sigmoid": torch.sigmoid, "softmax": lambda logits: logits.softmax(dim=-1),
               "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt()}  # model.moe.score_func (V4: sqrtsoftplus)


@region
def score_and_route(logits_TE: torch.Tensor, bias_E: torch.Tensor, select, score_func: str, n_groups: int,
                    topk_groups: int, topk: int, group_score: str, norm_topk_prob: bool, scaling: float):
    """The router after its gate: fp32 logits (T, E) -> idx (T, K) int64 from `select` (`route`'s signature,
    on the detached affinities), gate weights (T, K) fp32, affinities (T, E) fp32 (pre-bias), and the
    count of each expert's copies (E,) int64."""
    scores_TE = SCORE_FUNCS[score_func](logits_TE)
    idx_TK = select(scores_TE.detach(), bias_E, n_groups, topk_groups, topk, group_score)
    weights_TK = scores_TE.gather(1, idx_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return idx_TK, weights_TK * scaling, scores_TE, expert_counts(idx_TK, bias_E.shape[0])


def each_forward(ctx: dict) -> bool:
    """The router's default `count_loads` seam: every training forward books what it routed."""
    return True


def fp32_logits(gate, x_TD: torch.Tensor) -> torch.Tensor:
    """The router's `logits` seam: gate(x) in fp32 (the gate's Linear keeps the fp32 copy for backward)."""
    return gate(x_TD.float())


class Router(nn.Module):
    """Affinities, selection and gate weights.  gate: (E, D), computed in fp32 (never FP8).

    Buffer: `expert_bias` (E,) fp32, the aux-loss-free balancing bias (checkpointed), nudged after each
    step by `update_bias` from the step's loads. What a training forward routes is booked in the step's
    `ForwardStats` (forward_stats.py), never kept here: the tokens routed to each expert (the one count
    of expert loads: the bias update and the load metrics read it), the weighted auxiliary losses' shares
    (balance_losses.LOSS_NAMES order) and the copies dropped over capacity.
    Seam `select`: (scores, bias, n_groups, topk_groups, topk, group_score) -> idx (T, K), `route` by
    default (the dry run swaps in a balanced choice it knows the values of). Seam `logits`: (gate, x) ->
    fp32 logits, `fp32_logits` by default (recomputation rebuilds the fp32 copy instead of keeping it).
    `token_shards`: how a micro-batch's tokens are split over ranks, for the balance losses' sums
    (balance_losses.TokenShards; a parallel layout swaps in the mesh's). Seam `count_loads`: (the MoE
    layer's phase state of one micro-batch forward) -> whether this run of the forward books its counts:
    `each_forward` by default; under full recomputation, whose replays run the router again in backward,
    the layer plan plugs in one that books the first run only (moe_lc/model/recompute.py). Seam
    `run_region` runs its compiled regions (moe_lc/model/seams.py).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.topk = cfg.moe.n_routed_experts, cfg.moe.topk
        self.n_groups, self.topk_groups = cfg.moe.n_groups, cfg.moe.topk_groups
        self.score_func, self.scaling = cfg.moe.score_func, cfg.moe.routed_scaling_factor
        self.group_score, self.norm_topk_prob = cfg.moe.group_score, cfg.moe.norm_topk_prob
        self.bias_update_speed = cfg.moe.bias_update_speed
        self.z_loss_weight, self.global_aux_loss_weight = cfg.moe.z_loss_weight, cfg.moe.global_aux_loss_weight
        self.capacity_factor, self.drop_policy = cfg.moe.capacity_factor, cfg.moe.drop_policy
        self.gate = Linear(cfg.dim, cfg.moe.n_routed_experts)
        self.gate.fp8_eligible = False
        # its W is a GEMM of E rows: deferring it to a zero-bubble W fills no bubble, and would hold the
        # fp32 copy of the input and the logits' gradient from B until W
        self.gate.defer_wgrad = False
        self.register_buffer("expert_bias", torch.zeros(cfg.moe.n_routed_experts, dtype=torch.float32))
        self.token_shards = TokenShards()
        self.count_loads = each_forward
        self.select = route
        self.logits = fp32_logits
        self.run_region = run_now

    def init_buffers(self) -> None:
        """Zero the balancing bias (after the model was built on the meta device)."""
        self.expert_bias.zero_()

    def forward(self, x_TD: torch.Tensor):
        """-> idx (T, K) int64, weights (T, K) fp32, scores (T, E) fp32 (pre-bias affinities)."""
        return self.route_and_score(x_TD)[:3]

    def route_and_score(self, x_TD: torch.Tensor, stats: ForwardStats | None = None, tokens=None):
        """`forward`'s three, and the fp32 logits (T, E) the z-loss reads. stats: where this forward books
        the tokens it routed to each expert (None: it books nothing). tokens: the token ids, which only a
        hash router reads (hash_router.py)."""
        logits_TE = self.logits(self.gate, x_TD)
        idx_TK, weights_TK, scores_TE, counts_E = self.run_region(
            score_and_route, logits_TE, self.expert_bias, self.select, self.score_func, self.n_groups,
            self.topk_groups, self.topk, self.group_score, self.norm_topk_prob, self.scaling)
        if stats is not None:
            stats.add_routing(self, loads=counts_E.float())
        return idx_TK, weights_TK, scores_TE, logits_TE

    def drop_over_capacity(self, idx_TK: torch.Tensor, scores_TE: torch.Tensor,
                           stats: ForwardStats | None = None) -> torch.Tensor:
        """idx (T, K) -> the copies sent to experts: idx itself without a capacity, else with the copies
        over each expert's capacity (T tokens of this call) set to the phantom id E (capacity.py), whose
        number this forward books in `stats` (None: nowhere)."""
        if self.capacity_factor <= 0:
            return idx_TK
        capacity = expert_capacity(idx_TK.shape[0], self.topk, self.n_experts, self.capacity_factor)
        sent_TK = drop_over_capacity(idx_TK, scores_TE, capacity, self.drop_policy)
        if stats is not None:
            stats.add_routing(self, dropped=dropped_copies(sent_TK, self.n_experts))
        return sent_TK

    def balance_losses(self, aux_loss_weight: float, logits_TE, scores_TE, idx_TK, n_seqs: int,
                       stats: ForwardStats | None = None):
        """The enabled auxiliary losses' weighted shares summed (0-dim fp32, to attach to the output), or
        None when none is on; their detached values (3,) fp32 in LOSS_NAMES order, zero where a loss is
        off, are booked in `stats` (None: nowhere)."""
        weights = {"aux_loss": aux_loss_weight, "z_loss": self.z_loss_weight,
                   "global_aux_loss": self.global_aux_loss_weight}
        names = enabled_losses(*weights.values())
        if not names:
            return None
        shares = balance_loss_shares(weights, logits_TE, scores_TE, idx_TK, n_seqs, self.token_shards,
                                     self.run_region)
        if stats is not None:
            with torch.no_grad():
                sums = torch.zeros(len(weights), dtype=torch.float32, device=shares.device)
                sums[[list(weights).index(n) for n in names]] += shares.detach()
            stats.add_routing(self, losses=sums)
        return shares.sum()

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor, frozen: bool = False) -> None:
        """bias_e += speed * sign(mean load - load_e) (not when `frozen`: a stage that trains other parts
        only). `load_E` (E,) is the step's load summed over every replica of this router and every
        micro-batch (the trainer sums the step's `ForwardStats` over data/context/tensor parallelism)."""
        if self.bias_update_speed > 0 and not frozen:  # (an all-zero load moves nothing: sign(0) = 0; no host sync to ask)
            self.expert_bias += self.bias_update_speed * torch.sign(load_E.mean() - load_E)


class RoutedExperts(nn.Module):
    """E SwiGLU experts as grouped GEMMs.  w13: (E, 2F, D), w2: (E, D, F); sharded on dim 0 under EP.
    Seams `activation`, `run_region` as SwiGLU's (moe_lc/model/seams.py); limit: SwiGLU's clamp (ffn.py)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, limit: float = 0.0):
        super().__init__()
        self.w13 = GroupedLinear(n_experts, dim, 2 * hidden)
        self.w2 = GroupedLinear(n_experts, hidden, dim)
        self.limit = limit
        self.activation = swiglu_then
        self.run_region = run_now

    def forward(self, x_TD: torch.Tensor, counts_E: torch.Tensor, weight_T: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, D) rows sorted by local expert; counts: (E_local,); weight: (T,) fp32 gate weight of each
        row, applied to the SwiGLU output (weighted_swiglu), or None -> (T, D)."""
        return self.activation(self.w2, clamp_gate_up(self.w13(x_TD, counts_E), self.limit), counts_E,
                               weight=weight_T, run_region=self.run_region)


class TokenDispatcher:
    """Moves routed token copies to their experts and back. Strategies: local, all-to-all, hierarchical.
    `fp8_tokens`: token copies reach the experts FP8-rounded (precision.fp8_dispatch); `run_region`: the
    seam that runs its compiled regions (the layer plan's, as a module's).

    The trip is cut where the MoE layer's phases are cut (dispatch | experts | combine), so that a
    pipeline can run other work while rows are in flight: `dispatch` and `return_rows` may hand back
    a `Transfer` (seams.py) instead of a tensor, which arrives before the next phase; `arrange` then
    groups the arrived rows by local expert. Local dispatch moves nothing and returns tensors."""

    fp8_tokens = False
    run_region = staticmethod(run_now)

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, n_experts: int, dropping: bool = False):
        """-> (rows for this rank's experts (tensor or Transfer), counts (E_local,), handle). `dropping`:
        idx may hold the phantom id n_experts (a copy dropped over capacity), which is not sent."""
        raise NotImplementedError

    def sort_weights(self, weights_TK: torch.Tensor, handle):
        """Gate weights (T, K) -> (T',) travelling as the dispatched rows do (tensor or Transfer)."""
        raise NotImplementedError

    def spread(self, idx_TK: torch.Tensor) -> torch.Tensor | None:
        """How the routed copies idx (T, K) spread over ranks and nodes, for the step's metrics (a counter
        vector the MoE layer books in the step's ForwardStats), or None where nothing spreads (local)."""
        return None

    def arrange(self, rows: torch.Tensor, handle) -> torch.Tensor:
        """Arrived rows (or their gate weights) -> grouped by local expert, as counts says."""
        return rows

    def return_rows(self, y_sorted: torch.Tensor, handle):
        """Expert outputs (T', D) -> on their way back to their tokens' ranks (tensor or Transfer)."""
        return y_sorted

    def combine(self, y_back: torch.Tensor, weights_TK: torch.Tensor | None, handle) -> torch.Tensor:
        """Returned expert outputs -> token order, summed over each token's K experts by gate weight
        (None: already weighted, weighted_swiglu) -> (T, D)."""
        raise NotImplementedError

    # the whole trip at once (tests, and callers without phases)
    def dispatch_now(self, x_TD, idx_TK, n_experts):
        rows, counts, handle = self.dispatch(x_TD, idx_TK, n_experts)
        return self.arrange(through((rows,))[0], handle), counts, handle

    def sort_weights_now(self, weights_TK, handle):
        return self.arrange(through((self.sort_weights(weights_TK, handle),))[0], handle)

    def combine_now(self, y_sorted, weights_TK, handle):
        return self.combine(through((self.return_rows(y_sorted, handle),))[0], weights_TK, handle)


@region
def sort_by_expert(x_TD: torch.Tensor, idx_TK: torch.Tensor, n_experts: int, dropping: bool = False):
    """Token copies grouped by expert: rows (T*K, D) = x's copies in a stable order by expert id, counts
    (E,) int64, and order (T*K,): position in that order -> flat (token, slot) index. `dropping`: idx may
    hold the phantom id E of a dropped copy (capacity.py), which sorts last and is left out of the rows
    (one host sync for their number)."""
    flat = idx_TK.flatten()
    order = flat.argsort(stable=True)
    if not dropping:
        return x_TD[order // idx_TK.shape[1]], expert_counts(flat, n_experts), order
    counts = expert_counts(flat, n_experts + 1)[:n_experts]
    kept = order[:int(counts.sum())]
    return x_TD[kept // idx_TK.shape[1]], counts, order


def pad_dropped(y_rows: torch.Tensor, n_copies: int) -> torch.Tensor:
    """Expert outputs of the sent copies (n, D), by-expert order -> (n_copies, D): zero rows for the
    dropped copies, which sort last (a dropped copy adds nothing to its token)."""
    if y_rows.shape[0] == n_copies:
        return y_rows
    return torch.cat([y_rows, y_rows.new_zeros(n_copies - y_rows.shape[0], y_rows.shape[1])])


@region
def unsort_and_sum(y_sorted: torch.Tensor, order: torch.Tensor, weights_TK: torch.Tensor | None, T: int, K: int):
    """Inverse of `sort_by_expert`'s order, then `weighted_sum`: expert outputs (T*K, D) -> (T, D)."""
    return weighted_sum(y_sorted[order.argsort()].view(T, K, y_sorted.shape[-1]), weights_TK)


def weighted_sum(y_TKD: torch.Tensor, weights_TK: torch.Tensor | None) -> torch.Tensor:
    """(T, K, D) -> (T, D): over K, weighted by the gates unless the experts applied them. A sum in token
    order: deterministic, unlike a scatter-add. Weighted, autograd keeps y for the gates' gradient."""
    if weights_TK is None:
        return y_TKD.sum(1)
    return (y_TKD * weights_TK.to(y_TKD.dtype).unsqueeze(-1)).sum(1)


class LocalDispatcher(TokenDispatcher):
    """All experts on this device: a stable sort by expert id, and its inverse."""

    def dispatch(self, x_TD, idx_TK, n_experts, dropping: bool = False):
        T, K = idx_TK.shape
        rows, counts, order = self.run_region(sort_by_expert, x_TD, idx_TK, n_experts, dropping)
        return FP8Rounded.apply(rows) if self.fp8_tokens else rows, counts, (order, T, K, rows.shape[0])

    def sort_weights(self, weights_TK, handle):
        order, _, _, n_rows = handle
        return weights_TK.flatten()[order[:n_rows]]

    def combine(self, y_back, weights_TK, handle):
        order, T, K, _ = handle
        return self.run_region(unsort_and_sum, pad_dropped(y_back, T * K), order, weights_TK, T, K)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out` whose backward also sends d(aux)/d(aux) = scale into the aux-loss graph,
    so the balance loss trains without being threaded to the loss (and works per pipeline stage)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, grad_out.new_full((), ctx.scale, dtype=torch.float32), None


class MoE(nn.Module):
    """x (B, S, D) -> shared(x) + sum_k gate_k * expert_k(x); with model.moe.shared_expert_gate (Qwen2-MoE)
    shared(x) is scaled per token by sigmoid(x shared_gate^T), shared_gate: (1, D), replicated under TP.
    router: the block's router kind (hash_router.router_for), a learned `Router` by default."""

    def __init__(self, cfg: ModelConfig, router: Router | None = None):
        super().__init__()
        self.n_experts, limit = cfg.moe.n_routed_experts, cfg.moe.swiglu_limit
        self.router = router if router is not None else Router(cfg)
        self.experts = RoutedExperts(cfg.moe.n_routed_experts, cfg.dim, cfg.moe.ffn_dim, limit)
        self.shared = SwiGLU(cfg.dim, cfg.moe.shared_hidden, limit) if cfg.moe.n_shared_experts else None
        self.shared_gate = Linear(cfg.dim, 1) if cfg.moe.shared_expert_gate else None
        if self.shared_gate is not None:  # a GEMM of one row: neither FP8 nor worth deferring
            self.shared_gate.fp8_eligible = self.shared_gate.defer_wgrad = False
        self.dispatcher: TokenDispatcher = LocalDispatcher()
        self.aux_loss_weight = cfg.moe.aux_loss_weight
        self.weighted_swiglu = cfg.moe.weighted_swiglu
        self.aux_loss_scale = 1.0  # share of this micro-batch in the step's loss (set by the trainer)

    def forward(self, x_BSD: torch.Tensor, stats: ForwardStats | None = None, tokens=None) -> torch.Tensor:
        ctx = {}
        state = through(self.expert_phase(ctx, *through(self.dispatch_phase(ctx, x_BSD, stats, tokens))))
        return self.combine_phase(ctx, *state, stats=stats)

    # The forward in three phases (route + dispatch, experts, combine + shared), so that a pipeline
    # can interleave two micro-batches' phases and hide one's token exchange behind the other's
    # compute (DualPipe's F&B): rows leave at the end of a phase and arrive at the start of the next
    # (as `Transfer`s under expert parallelism). Tensors flow through the arguments (a phased run
    # detaches them at every boundary); `ctx` carries only non-differentiable routing state, dispatch
    # books the routing and combine records the aux loss in the step's `stats` when given one.
    def dispatch_phase(self, ctx: dict, x_BSD: torch.Tensor, stats: ForwardStats | None = None, tokens=None):
        """x (B, S, D) -> (x, rows for this rank's experts, gate weights (T, K), or (T',) travelling with
        the rows under weighted_swiglu[, aux loss]). A training forward books its routing in the step's
        `stats` (the expert loads, aux-loss shares, dropped copies and the dispatcher's spread), once per
        micro-batch: a replay of this phase (full recomputation) runs with the forward's `ctx` and the
        router's `count_loads` seam tells it apart. tokens: the micro-batch's token ids (B, S), which a hash
        router reads (None elsewhere)."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        book = stats if stats is not None and self.training and self.router.count_loads(ctx) else None
        idx_TK, weights_TK, scores_TE, logits_TE = self.router.route_and_score(x_TD, book, tokens)
        sent_TK = self.router.drop_over_capacity(idx_TK, scores_TE, book)
        spread = self.dispatcher.spread(sent_TK) if book is not None else None
        if spread is not None:
            book.add_routing(self.router, spread=spread)
        rows, ctx["counts"], ctx["handle"] = self.dispatcher.dispatch(x_TD, sent_TK, self.n_experts,
                                                                      dropping=sent_TK is not idx_TK)
        if self.weighted_swiglu:
            weights_TK = self.dispatcher.sort_weights(weights_TK, ctx["handle"])
        if self.training and torch.is_grad_enabled():
            aux = self.router.balance_losses(self.aux_loss_weight, logits_TE, scores_TE, idx_TK, B, book)
            if aux is not None:
                return x_BSD, rows, weights_TK, aux
        return x_BSD, rows, weights_TK

    def expert_phase(self, ctx: dict, x_BSD, rows, weights, *aux):
        d, handle = self.dispatcher, ctx["handle"]
        x_sorted = d.arrange(rows, handle)
        if self.weighted_swiglu:  # the rows' weights are applied here; combine only sums
            y_sorted = self.experts(x_sorted, ctx["counts"], d.arrange(weights, handle))
            return (x_BSD, d.return_rows(y_sorted, handle), None, *aux)
        return (x_BSD, d.return_rows(self.experts(x_sorted, ctx["counts"]), handle), weights, *aux)

    def combine_phase(self, ctx: dict, x_BSD, y_back, weights_TK, aux=None,
                      stats: ForwardStats | None = None) -> torch.Tensor:
        y_BSD = self.dispatcher.combine(y_back, weights_TK, ctx["handle"]).view_as(x_BSD)
        if self.shared_gate is not None:
            y_BSD = y_BSD + torch.sigmoid(self.shared_gate(x_BSD)) * self.shared(x_BSD)
        elif self.shared is not None:
            y_BSD = y_BSD + self.shared(x_BSD)
        if aux is not None:
            if stats is not None:
                stats.aux_losses[self] = aux.detach()
            y_BSD = _AttachAuxLoss.apply(y_BSD, aux, self.aux_loss_scale)
        return y_BSD
