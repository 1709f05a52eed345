"""One optimizer step of one rank: micro-batches through the model (or the pipeline runtime), the loss
reduced over the mesh, the ZeRO-1 update, the routers' bias update, and the step's metrics.

Every micro-batch loss is the summed token loss divided by the step's token count (over every
data-parallel rank), so losses and gradients are the same under any valid layout. The forwards report
their MTP and aux losses and what their routers routed in the step's `ForwardStats`, and the result is a
`StepResult`; nothing is stashed on modules or on the trainer for the logger to read back, and no
counter is read off a module (tests/test_step_counts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from moe_lc.config.attention_kinds import attention_kind, load as load_piece
from moe_lc.model.balance_losses import LOSS_NAMES, enabled_losses
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.parallel import comm
from moe_lc.parallel.ep.dispatch import expert_parallel_metrics, spread_counters
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.pipeline.runtime import PipelineRuntime


@dataclass
class StepResult:
    loss: float  # next-token loss per token over the whole step (the MTP objective excluded)
    grad_norm: float
    applied: bool  # False: a non-finite loss or norm skipped the update
    metrics: dict = field(default_factory=dict)  # MTP losses, MoE balance and EP dispatch, by metric name


def tell_skipped(step: int, result: StepResult, skipped: int, limit: int, logger) -> None:
    """The non-finite guard, after optimizer step `step` (1-based) whose update was skipped, the `skipped`-th
    of the run: one event line; FloatingPointError past `limit` (train.max_nonfinite_steps)."""
    logger.event(f"step {step}: non-finite loss/grad norm ({result.loss}, {result.grad_norm}); update "
                 f"skipped ({skipped}/{limit})")
    if skipped > limit:
        raise FloatingPointError(f"stopping: {skipped} steps with a non-finite loss or grad norm "
                                 f"(train.max_nonfinite_steps={limit}); last checkpoint is intact")


def step_token_count(micro: list[dict], global_tokens: int, dims: ParallelDims, device: torch.device) -> float:
    """Tokens whose loss counts this step, over every data-parallel rank (loss masks subtract)."""
    if all(mb["loss_mask"] is None for mb in micro):
        return float(global_tokens)
    local = sum(float(mb["loss_mask"].sum()) if mb["loss_mask"] is not None else mb["tokens"][:, 1:].numel()
                for mb in micro)
    count = torch.tensor(local, dtype=torch.float64, device=device)
    comm.all_reduce(count, dims["dp"])
    return max(count.item(), 1.0)


def mtp_losses(mtp_loss_sums: torch.Tensor | None, depth: int, weight: float, dims: ParallelDims, n_tokens: float,
               device: torch.device) -> tuple[dict, float]:
    """({"mtp_loss/depth{d}": per-token loss}, the weighted MTP sum to take out of the objective), from this
    rank's per-depth sums of the step (`ForwardStats.mtp_loss_sums`; None where no stage of this rank holds
    the MTP modules), reduced like the main loss."""
    if not depth:
        return {}, 0.0
    sums = torch.zeros(depth, dtype=torch.float64, device=device)
    if mtp_loss_sums is not None:
        sums += mtp_loss_sums
    comm.all_reduce(sums, dims["world"])
    sums /= dims.tp
    host = (sums / n_tokens).tolist()
    return {f"mtp_loss/depth{d + 1}": v for d, v in enumerate(host)}, (weight / depth * sums.sum()).item()


def source_losses(stats: ForwardStats, names: list[str], dims: ParallelDims, device: torch.device) -> dict:
    """{"data/loss/<name>": next-token loss per token of that data source's rows this step} (a source
    with no token this step is left out), from the step's `ForwardStats.source_losses` summed over the
    world: each token's loss lives on one (pp, dp, cp) rank and on every tp rank alike, so tp counts
    both sums and token counts tp times and their ratio stays. names: the mixture's sources ([] for one
    source: nothing is booked)."""
    if not names:
        return {}
    both = torch.zeros(2, len(names), dtype=torch.float64, device=device)
    if stats.source_losses is not None:
        both += stats.source_losses
    comm.all_reduce(both, dims["world"])
    sums, counts = both.tolist()
    return {f"data/loss/{name}": s / n for name, s, n in zip(names, sums, counts) if n > 0}


@dataclass(frozen=True)
class KindTraining:
    """The attention kind's part of every training step, from its registry entry (moe_lc/config/attention_kinds.py)
    resolved once (`of`): whether the routers' biases stay (DSA's warm-up), and the kind's own metrics (DSA's
    indexer KL). Neutral for a kind without either."""

    routers_frozen: bool = False
    step_metrics: Callable | None = None  # (step's ForwardStats, dims, device) -> {metric: value}

    @classmethod
    def of(cls, m) -> KindTraining:
        """The part of the kind of [model] section `m`."""
        kind = attention_kind(m)
        frozen = kind.routers_frozen is not None and bool(load_piece(kind.routers_frozen)(m))
        return cls(frozen, partial(load_piece(kind.step_metrics), m) if kind.step_metrics is not None else None)

    def metrics(self, stats: ForwardStats, dims: ParallelDims, device: torch.device) -> dict:
        """The kind's metrics of the step ({} for none), reduced over the mesh (a collective on every rank)."""
        return self.step_metrics(stats, dims, device) if self.step_metrics is not None else {}


@torch.no_grad()
def document_attention_metrics(batches: list[dict], dims: ParallelDims, device: torch.device) -> dict:
    """Attention work under packed documents (batches' "docs"; {} when attention is not masked):
    attn/doc_work, the score elements one attention layer computed this step over the whole batch;
    attn/doc_work_fraction, that over the causal mask's without documents; attn/cp_imbalance, the
    busiest cp rank's work over the mean (the worst data-parallel replica's): what zig-zag's balance
    becomes when documents decide which blocks are computed."""
    docs = [b["docs"] for b in batches if b.get("docs") is not None]
    if not docs:
        return {}
    mine = torch.tensor([float(sum(d.call_work for d in docs))], dtype=torch.float64, device=device)
    per_cp = torch.zeros(dims.cp, dtype=torch.float64, device=device)
    comm.all_gather(per_cp, mine, dims["cp"])
    causal = sum(d.batch * d.seq_len * (d.seq_len + 1) / 2 for d in docs)
    both = torch.stack([per_cp.sum(), torch.tensor(causal, dtype=torch.float64, device=device)])
    comm.all_reduce(both, dims["dp"])
    imbalance = (per_cp.max() / per_cp.mean().clamp_min(1.0)).reshape(1)
    comm.all_reduce(imbalance, dims["dp"], op=torch.distributed.ReduceOp.MAX)
    work, causal = both.tolist()
    return {"attn/doc_work": work, "attn/doc_work_fraction": work / causal, "attn/cp_imbalance": imbalance.item()}


@torch.no_grad()
def balance_routers(model, stats: ForwardStats, dims: ParallelDims, frozen: bool = False) -> dict:
    """Sum the step's expert loads (`stats.routing`, booked by the routers) over every router replica, nudge
    each bias, and return the MoE metrics: one all-reduce, which also carries each layer's
    `balance_columns` (the auxiliary losses' shares, the dropped copies) and under expert parallelism the
    dispatchers' spread (in fp64 then: counts are exact in either dtype), and one transfer to the host.
    Metrics per MoE layer L: moe/imbalance/layer{L} (max / mean load), moe/bias_range/layer{L},
    moe/load/layer{L} (E floats: token copies per expert, as routed, dropped ones included), each enabled
    loss's moe/{aux_loss,z_loss,global_aux_loss}/layer{L} (weighted: the term the step's objective holds,
    its mean over the step's tokens or sequences), moe/dropped_fraction/layer{L} with a capacity, the
    `expert_parallel_metrics` under EP; and moe/imbalance_max (moe/dropped_fraction_max). frozen: the biases
    stay (`KindTraining.routers_frozen`: DeepSeek Sparse Attention's warm-up trains the indexers only)."""
    moes = model.moe_layers()
    if not moes:
        return {}
    rows = [stats.routing.get(m.router, {}) for m in moes.values()]
    loads = torch.stack([row.get("loads", torch.zeros_like(m.router.expert_bias))
                         for m, row in zip(moes.values(), rows)])  # (L, E) fp32, this rank's
    n_experts = loads.shape[1]
    extra, names = balance_columns(moes, rows)  # (L, X) fp32
    loads = torch.cat([loads, extra], dim=1)
    counters = spread_counters(moes.values(), stats.routing)  # (L, N + 4) fp64, None without expert parallelism
    if counters is None:
        comm.all_reduce(loads, dims["dp_cp_tp"])
    else:
        both = torch.cat([loads.double(), counters], dim=1)
        comm.all_reduce(both, dims["dp_cp_tp"])
        loads, counters = both[:, :loads.shape[1]].float(), both[:, loads.shape[1]:]
    loads, extra = loads[:, :n_experts], loads[:, n_experts:]
    scalars = {}  # metric -> 0-dim device tensor
    for (name, moe), load, sums in zip(moes.items(), loads, extra):
        scalars[f"moe/imbalance/layer{name}"] = load.max() / load.mean().clamp_min(1e-9)
        moe.router.update_bias(load, frozen)
        bias = moe.router.expert_bias
        scalars[f"moe/bias_range/layer{name}"] = bias.max() - bias.min()
        for column, value in zip(names, sums):
            scalars[f"moe/{column}/layer{name}"] = (value / load.sum().clamp_min(1.0) if column == "dropped_fraction"
                                                    else value * moe.aux_loss_scale)
    parts = [torch.stack([v.double() for v in scalars.values()]), loads.double().flatten()]
    host = iter(torch.cat(parts + ([] if counters is None else [counters.flatten()])).tolist())
    metrics = {key: next(host) for key in scalars}
    host_loads = [[next(host) for _ in range(n_experts)] for _ in moes]
    metrics.update((f"moe/load/layer{name}", load) for name, load in zip(moes, host_loads))
    if counters is not None:
        host_counters = [[next(host) for _ in range(counters.shape[1])] for _ in moes]
        metrics.update(expert_parallel_metrics(moes, host_loads, host_counters))
    metrics["moe/imbalance_max"] = max(v for k, v in metrics.items() if k.startswith("moe/imbalance/"))
    if "dropped_fraction" in names:
        metrics["moe/dropped_fraction_max"] = max(v for k, v in metrics.items()
                                                  if k.startswith("moe/dropped_fraction/"))
    return metrics


def balance_columns(moes: dict, rows: list[dict]) -> tuple[torch.Tensor, list[str]]:
    """(L, X) fp32 of this rank's step sums per MoE layer, from its `ForwardStats.routing` row (`rows`, in
    `moes` order): each enabled auxiliary loss's weighted shares, and the copies dropped over capacity;
    and the X column names (X = `balance_losses.stat_columns` of the recipe's [model.moe])."""
    first = next(iter(moes.values()))
    names = enabled_losses(first.aux_loss_weight, first.router.z_loss_weight, first.router.global_aux_loss_weight)
    columns = [LOSS_NAMES.index(n) for n in names]
    capacity = int(first.router.capacity_factor > 0)
    out = []
    for moe, row in zip(moes.values(), rows):
        zero = torch.zeros((), dtype=torch.float32, device=moe.router.expert_bias.device)
        losses = row.get("losses", zero.expand(len(LOSS_NAMES)))
        out.append(torch.cat([losses[columns], row.get("dropped", zero).view(1)[:capacity]]))
    return torch.stack(out), names + ["dropped_fraction"] * capacity


def forward_backward(model, runtime: PipelineRuntime | None, batches: list[dict], scale: float,
                     n_tokens: float, n_sources: int = 0) -> tuple[torch.Tensor, ForwardStats]:
    """Every micro-batch forward and backward: through `model` (this rank's whole model), or the pipeline
    `runtime`'s schedule under PP. batches: `prepare_batch` outputs; each micro-batch's summed token loss is
    multiplied by `scale` (1 / the step's token count n_tokens) before backward. Returns this rank's
    summed token loss (fp64, detached), before any reduction over the mesh, and the step's `ForwardStats`
    (which books the loss by the batches' "sources" over n_sources data sources; 0: not booked)."""
    stats = ForwardStats(n_sources=n_sources)
    if runtime is not None:
        return runtime.step(batches, scale, stats) * (scale * n_tokens), stats
    loss_sum = torch.zeros((), dtype=torch.float64, device=batches[0]["inputs"].device)
    for batch in batches:
        loss = model(batch["inputs"], positions=batch["positions"], labels=batch["labels"],
                     loss_mask=batch["loss_mask"], mtp=batch["mtp"], stats=stats, docs=batch.get("docs"),
                     sources=batch.get("sources"))
        (loss * scale).backward()
        loss_sum += loss.detach().double() * (scale * n_tokens)
    return loss_sum, stats
