"""Apply parallelism to a plain single-device model, in one documented order:

    PP split -> TP/SP -> EP -> CP -> recompute -> (ZeRO-1 lives in the optimizer)

Each step swaps parallel-aware pieces into the model (the one Linear's TP role, ring attention,
an all-to-all token dispatcher) and records, per parameter, how it is placed:

    param._grad_group : name of the group its gradient is summed over (and ZeRO-1 shards it over):
                        "dp_cp" (dense, sharded or unique per tp rank), "dp_cp_tp" (replicated over
                        tp, e.g. norms under sequence parallelism), "edp" (routed experts)
    param._placement  : [(group name, tensor dim, sections)] to rebuild the full tensor from shards

The model code never imports this package.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.moe import RoutedExperts
from moe_lc.parallel.mesh import ParallelDims


def parallelize(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Shard `model` (fully initialized on every rank, same seed) for this rank's coordinates."""
    unsupported = {k: getattr(dims, k) for k in ("pp", "cp", "tp", "ep") if getattr(dims, k) > 1}
    if unsupported:
        raise NotImplementedError(f"parallel degrees not implemented yet: {unsupported}")
    for module in model.modules():
        is_expert = isinstance(module, RoutedExperts)
        for p in module.parameters(recurse=is_expert):
            if not hasattr(p, "_grad_group"):
                p._grad_group = "edp" if is_expert else "dp_cp"
                p._placement = []
    return model


def zero_param_groups(model: nn.Module, dims: ParallelDims):
    """[(group name, [(param name, param)], Group)] for ZeroAdamW, one per gradient group."""
    by_group: dict[str, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_group.setdefault(getattr(p, "_grad_group", "dp_cp"), []).append((name, p))
    return [(g, params, dims[g]) for g, params in sorted(by_group.items())]


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Norm weights, biases and embeddings are not decayed."""
    from moe_lc.model.norm import RMSNorm

    names = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, (RMSNorm, nn.Embedding)) or p_name == "bias":
                names.add(full)
    return names


@torch.no_grad()
def full_state_dict(model: nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Unsharded parameters and persistent buffers by name (on every rank; fp32, CPU)."""
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
