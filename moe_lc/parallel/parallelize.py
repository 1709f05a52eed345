"""Apply parallelism to a plain single-device model: resolve its layer plan, apply it in one pass, then
split it into this rank's pipeline stages (ZeRO-1 lives in the optimizer).

The model arrives either fully initialized (tests; every rank holds the same values and keeps its
slices) or built on the meta device (the trainer). The layer plan (layer_plan.py) decides, from the
recipe and the layout, what every module does: the one Linear's TP role, GEMMs, kept input and deferred
weight gradient, vocab-parallel embedding and loss, an all-to-all token dispatcher, ring attention,
recomputation and FP8 caching seams; the parameter shards go into a `Placements` table beside it.
Then `materialize` allocates and initializes only this rank's slices, with the same name-seeded values
a single device would have. The result, `Parallelized`, carries the model, its pipeline chunks, the
plan and a placement per parameter (grad group, shards, grad-norm weight), which the optimizer,
checkpoints, final-state gathering and the planner read. The model code never imports this package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moe_lc.config.attention_kinds import attention_kind, load
from moe_lc.model.init import init_buffers, init_rules, normal_rows
from moe_lc.model.mtp import mtp_targets
from moe_lc.model.norm import RMSNorm
from moe_lc.ops.documents import Documents
from moe_lc.parallel import comm
from moe_lc.parallel.layer_plan import LayerPlanOptions, resolve_layer_plan
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Parallelized, Placements, gather_full, install_grad_hooks
from moe_lc.parallel.tie import tie_plan
from moe_lc.parallel.memory.trace_hooks import tell


@dataclass(frozen=True)
class ParallelizeOptions:
    """What `parallelize` reads of a recipe, derived from it once (`from_config`, in parallel/build.py) and
    handed down whole: the layer plan's options and what is applied after the pipeline split."""

    plan: LayerPlanOptions = field(default_factory=LayerPlanOptions)  # the layer plan's (parallel/layer_plan.py)
    offload: tuple[str, ...] = ()  # train.offload: whose saved tensors live on the host (parallel/memory/offload.py)

    @classmethod
    def from_config(cls, cfg, dp: int = 1) -> ParallelizeOptions:
        """The options of recipe `cfg` (moe_lc.config.Config) on `dp` data-parallel ranks."""
        return cls(LayerPlanOptions.from_config(cfg, dp), tuple(cfg.train.offload))


def parallelize(model: nn.Module, dims: ParallelDims, options: ParallelizeOptions | None = None, *, schedule=None,
                stage_layers: list[list[int]] | None = None, device: torch.device | None = None, route=None,
                defer_wgrad: bool | None = None) -> Parallelized:
    """Shard `model` for this rank's coordinates (see the module docstring), as `options` (the recipe's part;
    None: the defaults, one plain fp32 device) asks.

    Under pipeline parallelism (`schedule` given, with `stage_layers` from pipeline.stage) the result's
    module holds only this rank's stages, and `chunks` lists the chunk modules the runtime executes.
    `device` is where FP8 kernels will run. `route`: a router selection replacing the learned one (the dry
    run's balanced routing). `defer_wgrad`: give the deferring Linears the rank's weight-gradient store
    (default: under a pipeline schedule; the planner asks for it to measure what a split backward holds).
    Under train.compile the result's `compile_watch` counts the compiled regions.
    """
    options = options if options is not None else ParallelizeOptions()
    single_device_order = [name for name, _ in model.named_parameters()]
    placements = Placements()
    plan = resolve_layer_plan(model, dims, options.plan, placements, device=device, route=route,
                              pipelined=schedule is not None if defer_wgrad is None else defer_wgrad)
    model = plan.apply(model)
    if model.cfg.tie_embeddings:
        tie_plan(model, dims, schedule, placements)
    chunks, stage_ids = [], [0]
    if schedule is not None:
        from moe_lc.parallel.pipeline.stage import split_for_rank

        model, chunks, stage_ids = split_for_rank(model, schedule, dims.coords()["pp"], stage_layers)
    local = dict(model.named_parameters())
    named = [(name, local[name]) for name in single_device_order if name in local]
    result = Parallelized(model, placements.by_name(named), chunks, stage_ids, plan.wgrad_store, plan.describe(),
                          plan.compile_watch)
    if options.offload:  # after the split: hooks on this rank's modules only
        from moe_lc.parallel.memory.offload import ActivationOffload

        result.offload = ActivationOffload(model, options.offload, device if device is not None else "cpu")
    if not any(p.is_meta for _, p in named):  # a built model: its parameters are the live ones
        install_grad_hooks(model, result.placements)
    return result


@torch.no_grad()
def materialize(result: Parallelized, dims: ParallelDims, seed: int, std: float, n_layers: int,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                deferred: bool = False) -> Parallelized:
    """Allocate this rank's parameters of a model built on the meta device and fill them with its slice
    of the single-device init (moe_lc/model/init.py), drawn in row chunks: no full tensor of a sharded
    parameter is ever held. Buffers are allocated on `device` and recomputed. On the meta device (the dry
    run) nothing is drawn. `result.initial_value(name)` gives any parameter's initial local tensor again.

    deferred (ZeRO-3, parallel.placement.params = "sharded_gather"): each parameter gets its shape, dtype and
    device but no storage (nothing allocated, nothing drawn); ZeRO draws each bucket's parameters through
    `initial_value` when it builds that bucket, keeps its own shard and frees the rest, so no rank ever
    holds its whole local model."""
    module = result.module
    rules = init_rules(module, std, n_layers)
    meta = torch.device(device).type == "meta"
    shapes = {name: p.shape for name, p in module.named_parameters()}

    def initial_value(name: str) -> torch.Tensor:
        place, rule, shape = result.placements[name], rules[name], shapes[name]
        if meta:  # the dry run: shapes only, no values to draw
            return torch.empty(shape, dtype=dtype, device=device)
        if rule.kind != "normal":
            return torch.full(shape, 1.0 if rule.kind == "ones" else 0.0, dtype=dtype, device=device)
        local = _local_normal(place.full_shape(shape, dims.groups), place.shards, dims, seed, name) * rule.std
        return local.to(dtype).to(device)

    if deferred:  # buffers allocated; parameters (new objects, as to_empty makes) of no storage
        made = {}
        for sub in module.modules():
            for key, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[key] = torch.empty_like(buf, device=device)
            for key, param in sub._parameters.items():
                if param is not None and id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                   param.requires_grad)
                    made[id(param)].untyped_storage().resize_(0)
                    tell("resized", made[id(param)])  # the dry run's trace: freed as soon as made
                if param is not None:
                    sub._parameters[key] = made[id(param)]
    else:
        module.to_empty(device=device)  # new Parameter objects (look them up after), buffers allocated
    module.tie_head_()  # one object again for a tied embedding and head
    params = dict(module.named_parameters())
    init_buffers(module)
    if not deferred:
        for name in result.placements:
            params[name].data = initial_value(name)
    result.initial_value = initial_value
    install_grad_hooks(module, result.placements)
    return result


def _local_normal(full_shape, shards, dims: ParallelDims, seed: int, name: str) -> torch.Tensor:
    """This rank's slice of the seeded standard-normal full tensor, assembled chunk by chunk."""
    if not shards:
        return torch.cat([rows for _, rows in normal_rows(full_shape, seed, name)])
    (shard,) = shards  # every parallel technique shards a parameter at most once
    group = dims[shard.group]
    if shard.dim > 0:  # every row contributes its columns
        return torch.cat([shard.local_slice(rows, group.rank, group.size) for _, rows in normal_rows(full_shape, seed, name)])
    keep = shard.local_ranges(full_shape[0], group.rank, group.size)  # row ranges, ascending
    parts = []
    for start, rows in normal_rows(full_shape, seed, name):
        stop = start + rows.shape[0]
        parts += [rows[max(a, start) - start:min(b, stop) - start] for a, b in keep if a < stop and b > start]
        if stop >= keep[-1][1]:
            break  # the rest of the stream holds no row of ours
    return torch.cat(parts)


def prepare_batch(tokens: torch.Tensor, loss_mask: torch.Tensor | None, dims: ParallelDims,
                  mtp_depth: int = 0, documents=None, document_mask: bool = False,
                  document_positions: bool = False, cp_layout: str = "zigzag") -> dict:
    """Model inputs for this rank from a micro-batch of full sequences.

    tokens: (B, S+1) int64 (inputs + shifted labels), loss_mask: (B, S) or None, documents: the
    loader's per-row document lengths over the S inputs (collate's "documents"; None: one document
    per row). Returns {"inputs" (B, S_local), "labels" (B, S_local), "loss_mask", "positions"
    (S_local,) or (B, S_local) with document_positions (each document counts from 0), "mtp", "docs"}:
    the whole sequence on one device, this rank's zig-zag chunks under context parallelism. "mtp"
    holds the multi-token-prediction targets (built before sharding) or None; "docs" the `Documents`
    attention stays inside with document_mask (over the full sequence: the ring plans from it), or None.
    cp_layout "balanced" (with document_mask): this micro-batch's chunks are placed on cp ranks by
    `Documents.balanced_chunks`, recorded in "docs" for the ring. parallel.cp_a2a > 1: the hybrid
    placement (`moe_lc.parallel.cp.ulysses.hybrid_chunk_ids`). cp_layout "contiguous": chunks (2r, 2r+1), rank r's
    one span of S / cp rows.
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    B, S = inputs.shape
    docs = Documents.from_batch(documents, B, S) if document_mask or document_positions else None
    positions = docs.positions().to(tokens.device) if document_positions else torch.arange(S, device=tokens.device)
    mtp = mtp_targets(tokens, loss_mask, mtp_depth) if mtp_depth else None
    if dims.cp > 1:
        from moe_lc.parallel.cp.ring import zigzag_shard

        group, mine = dims["cp"], None
        if cp_layout == "balanced" and document_mask:
            docs.chunks = docs.balanced_chunks(dims.cp)
            mine = docs.chunks[group.rank]
        elif cp_layout == "contiguous":  # one span per rank (the kinds that build it: DeepSeek-V4's attention)
            from moe_lc.parallel.cp.ring import chunk_ids

            mine = chunk_ids(group.rank, dims.cp, "contiguous")
        elif dims.cp_a2a > 1:  # hybrid cp: the chunks whose all-to-all gives the ring its zig-zag (ulysses.py)
            from moe_lc.parallel.cp.ulysses import hybrid_chunk_ids

            mine = hybrid_chunk_ids(group.rank, dims.cp, dims.cp_a2a)
        inputs, labels, positions = (zigzag_shard(t, group, d, mine)
                                     for t, d in ((inputs, 1), (labels, 1), (positions, positions.dim() - 1)))
        loss_mask = zigzag_shard(loss_mask, group, 1, mine) if loss_mask is not None else None
        if mtp is not None:
            mtp = {k: zigzag_shard(v, group, 2, mine) for k, v in mtp.items()}
    return {"inputs": inputs, "labels": labels, "loss_mask": loss_mask, "positions": positions, "mtp": mtp,
            "docs": docs if document_mask else None}


def param_lr_scale(cfg):
    """name -> the learning-rate scale of that parameter under the recipe (moe_lc.config.Config), or None
    when every parameter takes train.lr: the attention kind's `lr_scales` (moe_lc/config/attention_kinds.py;
    DeepSeek Sparse Attention's indexer rate and warm-up freeze)."""
    kind = attention_kind(cfg.model)
    return load(kind.lr_scales)(cfg.model, cfg.train.lr) if kind.lr_scales is not None else None


def zero_group_of(name: str, grad_group: str, lr_scale=None, tie_group: str | None = None) -> tuple[str, float]:
    """(ZeRO group name, lr scale) of a parameter: its gradient group, split by learning-rate scale (a
    group of scale s != 1 is named "<gradient group>*s") and, for a tied parameter held on two pipeline
    stages, by its tie group ("<gradient group>+pp_tie": one layout on both, parallel/tie.py). The planner
    lays out the same groups."""
    scale = float(lr_scale(name)) if lr_scale is not None else 1.0
    group = grad_group if tie_group is None else f"{grad_group}+{tie_group}"
    return (group if scale == 1.0 else f"{group}*{scale:g}"), scale


def grad_group_of_zero(zero_group: str) -> str:
    """The gradient group a ZeRO group (`zero_group_of`'s name) shards over: "dp_cp+pp_tie*0.1" -> "dp_cp"."""
    return zero_group.split("*")[0].split("+")[0]


def tie_group_of_zero(zero_group: str) -> str | None:
    """The tie group in a ZeRO group's name, if any: "dp_cp+pp_tie*0.1" -> "pp_tie", "dp_cp" -> None."""
    _, _, tie = zero_group.split("*")[0].partition("+")
    return tie or None


def frozen_zero_group(zero_group: str) -> bool:
    """A ZeRO group of learning-rate scale 0 ("<group>*0"): it reduces and gathers nothing (zero/optimizer.py)."""
    return zero_group.partition("*")[2] == "0"


def zero_param_groups(result: Parallelized, dims: ParallelDims, lr_scale=None):
    """[(group name, [(param name, param, placement)], Group, lr scale, tie Group or None)] for ZeroOptimizer,
    one per gradient group, learning-rate scale (`lr_scale(param name) -> float`, `param_lr_scale`; default
    1 for all) and tie group (the tied embedding's copies on two pipeline stages: parallel/tie.py), each in
    single-device order (so DualPipe's mirror ranks lay out the same flat buffers)."""
    by_group: dict[tuple, list] = {}
    for name, p, place in result.named_parameters():
        if p.requires_grad:
            group, scale = zero_group_of(name, place.grad_group, lr_scale, place.tie_group)
            by_group.setdefault((group, scale, place.grad_group, place.tie_group), []).append((name, p, place))
    return [(g, params, dims[grad], s, dims[tie] if tie else None)
            for (g, s, grad, tie), params in sorted(by_group.items(), key=lambda kv: kv[0][:3])]


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Norm weights, biases and embedding tables are not decayed, nor what a module lists in its `no_weight_decay`
    (mHC's gain `scale`: a gain, like a norm's weight)."""
    names = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if (isinstance(module, RMSNorm) or p_name == "bias" or "embed" in mod_name.rsplit(".", 1)[-1]
                    or p_name in getattr(module, "no_weight_decay", ())):
                names.add(full)
    return names


@torch.no_grad()
def full_state_dict(result: Parallelized, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Unsharded parameters and persistent buffers by name, fp32 on CPU (collective: every rank of
    the stage calls it; every rank gets the full tensors)."""
    out = {}
    for name, value in result.module.state_dict().items():
        place = result.placements.get(name)
        shards = place.shards if place is not None else ()
        out[name] = gather_full(value.detach(), shards, dims.groups).float().cpu().clone()
    if dims.pp > 1:  # every stage's tensors (DualPipe's two copies of a stage are identical)
        for stage_state in comm.all_gather_object(out, dims["pp"]):
            out.update(stage_state)
    return out
