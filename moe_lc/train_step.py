"""One optimizer step of one rank: micro-batches through the model (or the pipeline runtime), the loss
reduced over the mesh, the ZeRO-1 update, the routers' bias update, and the step's metrics.

Every micro-batch loss is the summed token loss divided by the step's token count (over every
data-parallel rank), so losses and gradients are the same under any valid layout. The result is a
`StepResult`; nothing is stashed on modules or on the trainer for the logger to read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_lc.parallel import comm
from moe_lc.parallel.mesh import ParallelDims


@dataclass
class StepResult:
    loss: float  # next-token loss per token over the whole step (the MTP objective excluded)
    grad_norm: float
    applied: bool  # False: a non-finite loss or norm skipped the update
    metrics: dict = field(default_factory=dict)  # MTP losses, MoE balance and EP dispatch, by metric name


def step_token_count(micro: list[dict], global_tokens: int, dims: ParallelDims, device: torch.device) -> float:
    """Tokens whose loss counts this step, over every data-parallel rank (loss masks subtract)."""
    if all(mb["loss_mask"] is None for mb in micro):
        return float(global_tokens)
    local = sum(float(mb["loss_mask"].sum()) if mb["loss_mask"] is not None else mb["tokens"][:, 1:].numel()
                for mb in micro)
    count = torch.tensor(local, dtype=torch.float64, device=device)
    comm.all_reduce(count, dims["dp"])
    return max(count.item(), 1.0)


def mtp_losses(chunks: list, depth: int, weight: float, dims: ParallelDims, n_tokens: float,
               device: torch.device) -> tuple[dict, float]:
    """({"mtp_loss/depth{d}": per-token loss}, the weighted MTP sum to take out of the objective), from the
    sums the chunks holding MTP modules accumulated this step (reduced like the main loss)."""
    if not depth:
        return {}, 0.0
    sums = torch.zeros(depth, dtype=torch.float64, device=device)
    for m in (c for c in chunks if c.mtp is not None):
        if m.mtp_loss_sums is not None:
            sums += m.mtp_loss_sums
        m.mtp_loss_sums = None
    comm.all_reduce(sums, dims["world"])
    sums /= dims.tp
    host = (sums / n_tokens).tolist()
    return {f"mtp_loss/depth{d + 1}": v for d, v in enumerate(host)}, (weight / depth * sums.sum()).item()


@torch.no_grad()
def balance_routers(model, dims: ParallelDims) -> dict:
    """Sum expert loads over every router replica (one all-reduce), nudge each bias, and return the MoE
    metrics (plus the EP dispatchers' counters when ep > 1), brought to the host in one transfer."""
    moes = model.moe_layers()
    if not moes:
        return {}
    stats = {}
    if dims.ep > 1:  # dispatcher counters: load per expert and ep rank, nodes per token
        from moe_lc.parallel.expert import expert_parallel_metrics

        stats.update(expert_parallel_metrics(model, dims))
    loads = torch.stack([m.router.expert_load for m in moes.values()])
    comm.all_reduce(loads, dims["dp_cp_tp"])
    scalars = {}  # metric -> 0-dim device tensor
    for (name, moe), load in zip(moes.items(), loads):
        scalars[f"moe/imbalance/layer{name}"] = load.max() / load.mean().clamp_min(1e-9)
        moe.router.update_bias(load)
        bias = moe.router.expert_bias
        scalars[f"moe/bias_range/layer{name}"] = bias.max() - bias.min()
        if moe.last_aux_loss is not None:
            scalars[f"moe/aux_loss/layer{name}"] = moe.last_aux_loss
    host = torch.cat([torch.stack([v.float() for v in scalars.values()]), loads.float().flatten()]).tolist()
    stats.update(zip(scalars, host))
    n_experts = loads.shape[1]
    for i, name in enumerate(moes):
        start = len(scalars) + i * n_experts
        stats.setdefault(f"moe/load/layer{name}", host[start:start + n_experts])
    stats["moe/imbalance_max"] = max(v for k, v in stats.items() if k.startswith("moe/imbalance/"))
    return stats


def forward_backward(trainer, batches: list[dict], scale: float, n_tokens: float) -> torch.Tensor:
    """Every micro-batch forward and backward (the pipeline runtime's schedule under PP); returns this
    rank's summed token loss (fp64, detached), before any reduction over the mesh."""
    if trainer.runtime is not None:
        trainer.optimizer.begin_step(trainer.runtime.grad_arrivals())
        return trainer.runtime.step(batches, scale) * (scale * n_tokens)
    trainer.optimizer.begin_step(len(batches))
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    for batch in batches:
        loss = trainer.model(batch["inputs"], positions=batch["positions"], labels=batch["labels"],
                             loss_mask=batch["loss_mask"], mtp=batch["mtp"])
        (loss * scale).backward()
        loss_sum += loss.detach().double() * (scale * n_tokens)
    return loss_sum
