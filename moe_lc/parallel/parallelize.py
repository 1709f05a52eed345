"""Apply parallelism to a plain single-device model, in one documented order:

    PP split -> TP/SP -> EP -> CP -> recompute -> (ZeRO-1 lives in the optimizer)

The model arrives fully initialized on every rank (same seed, so the same values everywhere); each
step swaps parallel-aware pieces into it (the one Linear's TP role, vocab-parallel embedding and
loss, an all-to-all token dispatcher, ring attention) and shards parameters with
`moe_lc.parallel.placement`. Every parameter ends up with two attributes:

    param._grad_group : the group its gradient is summed over, which ZeRO-1 also shards it over:
                        "dp_cp"    dense, unique per tp rank (sharded or tp = 1)
                        "dp_cp_tp" replicated over tp, each tp rank saw different tokens
                                   (norms and the router under sequence parallelism)
                        "edp"      routed experts (replicated over the expert-data-parallel group)
    param._placement  : [Shard, ...] to rebuild the full tensor (empty = not sharded)

The model code never imports this package.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.moe import RoutedExperts
from moe_lc.model.mtp import mtp_targets
from moe_lc.model.norm import RMSNorm
from moe_lc.parallel import comm
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import gather_full


def parallelize(model: nn.Module, dims: ParallelDims, expert_dispatch: str = "flat",
                schedule=None, stage_layers: list[list[int]] | None = None) -> nn.Module:
    """Shard `model` for this rank's coordinates (see the module docstring for the order).

    Under pipeline parallelism (`schedule` given, with `stage_layers` from pipeline.stage) the
    returned module holds only this rank's stages, and `model.pipeline_chunks` lists the chunk
    modules the pipeline runtime executes (they share the returned module's submodules).
    """
    for i, p in enumerate(model.parameters()):
        p._canonical_index = i  # single-device order: the same flat ZeRO layout on DualPipe mirrors
    if schedule is not None:
        from moe_lc.parallel.pipeline.stage import split_for_rank

        model, chunks = split_for_rank(model, schedule, dims.coords()["pp"], stage_layers)
        model.pipeline_chunks = chunks
    if dims.tp > 1:
        from moe_lc.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, dims)
    if dims.ep > 1 and any(isinstance(m, RoutedExperts) for m in model.modules()):
        from moe_lc.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, dims, expert_dispatch)
    if dims.cp > 1:
        from moe_lc.parallel.context import apply_context_parallel

        apply_context_parallel(model, dims)
    for chunk in getattr(model, "pipeline_chunks", []):
        if chunk.mtp is not None and chunk.embed is None:  # MTP shares the (parallelized) embedding
            chunk.__dict__["mtp_embed"] = model.embed
    for module in model.modules():
        is_expert = isinstance(module, RoutedExperts)
        for p in module.parameters(recurse=is_expert):
            if not hasattr(p, "_grad_group"):
                p._grad_group = "edp" if is_expert else "dp_cp"
            if not hasattr(p, "_placement"):
                p._placement = []
    return model


def prepare_batch(tokens: torch.Tensor, loss_mask: torch.Tensor | None, dims: ParallelDims,
                  mtp_depth: int = 0) -> dict:
    """Model inputs for this rank from a micro-batch of full sequences.

    tokens: (B, S+1) int64 (inputs + shifted labels), loss_mask: (B, S) or None. Returns
    {"inputs" (B, S_local), "labels" (B, S_local), "loss_mask", "positions" (S_local,), "mtp"}: the
    whole sequence on one device, this rank's zig-zag chunks under context parallelism. "mtp" holds
    the multi-token-prediction targets (built before sharding) or None.
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=tokens.device)
    mtp = mtp_targets(tokens, loss_mask, mtp_depth) if mtp_depth else None
    if dims.cp > 1:
        from moe_lc.parallel.context import zigzag_shard

        inputs, labels, positions = (zigzag_shard(t, dims["cp"], dim=d)
                                     for t, d in ((inputs, 1), (labels, 1), (positions, 0)))
        loss_mask = zigzag_shard(loss_mask, dims["cp"], dim=1) if loss_mask is not None else None
        if mtp is not None:
            mtp = {k: zigzag_shard(v, dims["cp"], dim=2) for k, v in mtp.items()}
    return {"inputs": inputs, "labels": labels, "loss_mask": loss_mask, "positions": positions, "mtp": mtp}


def zero_param_groups(model: nn.Module, dims: ParallelDims):
    """[(group name, [(param name, param)], Group)] for ZeroAdamW, one per gradient group."""
    by_group: dict[str, list] = {}
    named = sorted(model.named_parameters(), key=lambda item: getattr(item[1], "_canonical_index", 0))
    for name, p in named:
        if p.requires_grad:
            by_group.setdefault(getattr(p, "_grad_group", "dp_cp"), []).append((name, p))
    return [(g, params, dims[g]) for g, params in sorted(by_group.items())]


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Norm weights, biases and embedding tables are not decayed."""
    names = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, RMSNorm) or p_name == "bias" or "embed" in mod_name.rsplit(".", 1)[-1]:
                names.add(full)
    return names


@torch.no_grad()
def full_state_dict(model: nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Unsharded parameters and persistent buffers by name, fp32 on CPU (collective: every rank of
    the stage calls it; every rank gets the full tensors)."""
    out = {}
    params = dict(model.named_parameters())
    for name, value in model.state_dict().items():
        placement = getattr(params.get(name), "_placement", [])
        out[name] = gather_full(value.detach(), placement, dims.groups).float().cpu().clone()
    if dims.pp > 1:  # every stage's tensors (DualPipe's two copies of a stage are identical)
        for stage_state in comm.all_gather_object(out, dims["pp"]):
            out.update(stage_state)
    return out
