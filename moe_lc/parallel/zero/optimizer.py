"""ZeRO: FP32 master weights and optimizer state sharded over data-parallel ranks; the update rule apart.

Each `ShardedParams` holds the parameters whose gradients are summed over one group (dense parameters over
dp x cp [x tp for tp-replicated ones], expert parameters over edp). Its layout (zero/layout.py):

    buckets      consecutive slices of the group's flat (P,) layout, each padded to a multiple of N = group size;
                 rank r owns elements [r*size/N, (r+1)*size/N) of every bucket
    grad_shard   (P/N,) fp32, this rank's reduced gradients; master, state[...] (P/N,) this rank's shards of the
                 fp32 master and of the tensors the update rule declares (moe_lc/optim/rule.py: AdamW's exp_avg,
                 exp_avg_sq)

Parameters are laid out in reverse registration order so buckets fill in backward order. A bucket cuts
its parameters at any element offset, except where the rule asks for a parameter whole (`rule.whole`):
such parameters form buckets of their own, packed into N bins of equal width, one per rank (largest first
onto the emptiest bin), so each sits whole in its owner's 1/N and the rule sees it with its shape; the
bins are padded to the bucket's fullest (a matrix rule such as Muon gets a tensor-parallel parameter's
full matrix through `ShardView.to_full`: an all-gather over tp from the owners of its other slices).

The rest is the placement's (`[parallel.placement]`, chosen once as a `ZeroPlacement`, zero/strategies.py): each
group composes three strategies and delegates to them:

    param_store  where parameters live: one flat buffer all-gathered after the update, or (ZeRO-3) 1/N kept
                 and units gathered around their use (zero/param_store.py, zero/param_gather.py)
    grad_sync    how gradients reach grad_shard: a full fp32 main-grad buffer reduce-scattered per bucket once a
                 step, launched as the bucket's last gradient arrives (post-accumulate-grad hook) and overlapping
                 the rest of backward, or (ZeRO-2) rounds per micro-batch (zero/grad_sync.py, zero/grad_rounds.py)
    update_site  where master, state and the update live: the device, or host memory with the update on the
                 CPU bucket by bucket (zero/update_site.py, zero/host_step.py)

`ZeroOptimizer.step` sums the squared grad norm over the world, clips, lets each group's update site step its
master shard and publish the parameters. On one device (N = 1) the same code is a mixed-precision optimizer
with no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moe_lc.optim import recipe_rule
from moe_lc.optim.adamw import AdamW
from moe_lc.optim.rule import OwnedParam, ShardView, UpdateRule
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.parallelize import no_weight_decay_names, param_lr_scale, zero_param_groups
from moe_lc.parallel.placement import ParamPlacement, Shard, gather_full
from moe_lc.parallel.zero.ema import CpuEMA
from moe_lc.parallel.zero.layout import (Bucket, bucket_elems, build_buckets, matrix_shards, norm_weight_shard,
                                         owned_params)
from moe_lc.parallel.zero.strategies import ZeroPlacement

# `grad_sq_sum`: elements per fp32 partial sum (vector_norm and dot accumulate serially in fp32 on a CPU: 1e-4
# off over 2^22 elements, 3e-7 over rows of 1024), and weighted elements squared at once (32 MiB of temporaries)
GRAD_NORM_ROW = 1024
GRAD_NORM_CHUNK = 2**22
# per element of one chunk (8 x min(GRAD_NORM_CHUNK, shard)): fp32 squares and weights; the unweighted pass's
# row norms (12 B per GRAD_NORM_ROW elements) stay below that up to shards of 2.8G elements
GRAD_NORM_BYTES_PER_ELEMENT = 8


@dataclass(frozen=True)
class ZeroOptions:
    """What ZeroOptimizer reads of a recipe, derived from it once (`from_config`)."""

    placement: ZeroPlacement = ZeroPlacement()  # [parallel.placement]: the strategies (zero/strategies.py)
    bucket_mb: float = 32.0  # parallel.zero_bucket_mb: MiB of fp32 gradients per bucket
    grad_clip: float = 0.0  # train.grad_clip: bound of the global gradient norm (0 = none)
    ema_decay: float = 0.0  # train.ema_decay: the masters' moving average in CPU memory (0 = none)

    @classmethod
    def from_config(cls, cfg) -> ZeroOptions:
        """The options of recipe `cfg` (moe_lc.config.Config)."""
        return cls(ZeroPlacement.from_config(cfg.parallel.placement), cfg.parallel.zero_bucket_mb,
                   cfg.train.grad_clip, cfg.train.ema_decay)


class ShardedParams:
    """One ZeRO group: its buckets and the placement's three strategies (module docstring). named_params:
    [(name, param, placement)] in single-device order; group: the ranks it shards over; lr_scale: its learning
    rate's scale (0: frozen, its gradients dropped as they arrive); tie: a group its reduced shard is summed
    over (a tied embedding's copies, parallel/tie.py); the rest as ZeroOptimizer's."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter, ParamPlacement]], group: Group,
                 rule: UpdateRule, options: ZeroOptions = ZeroOptions(), *, lr_scale: float = 1.0,
                 tie: Group | None = None, no_decay=frozenset(), shard_groups: dict[str, Group] | None = None,
                 initial_value=None):
        self.name, self.group, self.lr_scale, self.tie = name, group, lr_scale, tie
        self.names = {id(p): n for n, p, _ in named_params}
        self.placements = {n: place for n, _, place in named_params}
        self.shard_groups = shard_groups  # the mesh's groups by name: where a whole matrix's TP slices live
        z, ordered = options.placement, list(reversed(named_params))  # buffer order: backward's
        units = [z.params.unit_of(n) for n, _, _ in ordered] if z.params.unit_of is not None else None
        self.buckets = build_buckets([p for _, p, _ in ordered], bucket_elems(options.bucket_mb), group.size,
                                     [rule.whole(n, p.shape) for n, p, _ in ordered], units)
        self.device, self.param_dtype = ordered[0][1].device, ordered[0][1].dtype
        self.numel = sum(b.size for b in self.buckets)
        self.param_store = z.params(self.buckets, group, self.device, self.param_dtype)
        for b in self.buckets:
            self._place(b, initial_value)
        self.grad_shard = torch.zeros(self.numel // group.size, device=self.device, dtype=torch.float32)
        self.grad_sync = z.grads(self.buckets, group, self.grad_shard)
        self.update_site = z.optimizer(self, rule, z.overlap)
        self.master, self.state = self.update_site.master, self.update_site.state
        for b in self.buckets:
            b.part(self.master).copy_(self.param_store.own(b))
        owned = owned_params(self.buckets, group.rank, self.names)
        self.view = ShardView(self.master, self.update_site.grad, self.state,
                              [(o.lo, o.hi) for o in owned if o.name in no_decay], owned, self._to_full, self._to_local)
        self.norm_weight = norm_weight_shard(self.buckets, group.rank, {
            id(p): place.norm_weight for _, p, place in named_params if place.norm_weight is not None}, self.device)

    # -- layout -----------------------------------------------------------------------------------
    def _place(self, b: Bucket, initial_value) -> None:
        """Bucket b's tensor from the parameter store and its parameters made views into it, holding their
        values (a parameter without storage yet, ZeRO-3's deferred build, drawn now through `initial_value`),
        each with ZeRO's gradient hook."""
        b.full = self.param_store.place(b)
        for p, off in b.params:
            view = b.full[off - b.start:off - b.start + p.numel()].view_as(p)
            unmade = initial_value is not None and not p.untyped_storage().nbytes()
            view.copy_(initial_value(self.names[id(p)]) if unmade else p.data)
            p.data = view
            p.register_post_accumulate_grad_hook(self.on_grad)
        self.param_store.settle(b)

    def _matrix_shards(self, o: OwnedParam) -> tuple[Shard, ...]:
        """The placement's shards that cut a whole parameter's matrices (its last two dims; not EP's expert
        dim) over a group of more than one rank."""
        shards = matrix_shards(self.placements[o.name].shards, len(o.shape))
        if shards and self.shard_groups is None:
            raise ValueError(f"{o.name} is sharded over {shards[0].group}: ZeroOptimizer needs shard_groups")
        return tuple(s for s in shards if self.shard_groups[s.group].size > 1)

    def _to_full(self, o: OwnedParam, local: torch.Tensor) -> torch.Tensor:
        """(ShardView.to_full) a whole owned parameter's full matrices from every TP slice (all-gather; on
        the device, where the group's backend is, when the optimizer is offloaded)."""
        shards = self._matrix_shards(o)
        return gather_full(local.to(self.device), shards, self.shard_groups).to(local.device) if shards else local

    def _to_local(self, o: OwnedParam, full: torch.Tensor) -> torch.Tensor:
        """(ShardView.to_local) this rank's slice of a full tensor of a whole owned parameter."""
        for shard in self._matrix_shards(o):
            group = self.shard_groups[shard.group]
            full = shard.local_slice(full, group.rank, group.size)
        return full

    # -- gradients --------------------------------------------------------------------------------
    def begin_step(self, grads_per_param: int | dict[int, int]) -> None:
        """Expect this many gradient arrivals per parameter this step (its micro-batches); a dict
        gives them per id(param) (pipelines, where a parameter may serve several chunks)."""
        per = grads_per_param if isinstance(grads_per_param, dict) else None
        self.grad_sync.begin_step([sum(per.get(id(p), 0) for p, _ in b.params) if per is not None
                                   else len(b.params) * grads_per_param for b in self.buckets])

    def on_grad(self, p: nn.Parameter) -> None:
        """p's post-accumulate-grad hook: its gradient handed to the gradient sync."""
        if p.grad is None:  # a deferred weight gradient: its W pass delivers it (and calls us) later
            return
        grad, p.grad = p.grad, None
        if self.lr_scale != 0:  # frozen: its gradient is dropped, never reduced (nor the group's norm)
            self.grad_sync.add(p, grad)

    def finish_grad_sync(self) -> None:
        """Every gradient of the step reduced into grad_shard (a frozen group reduces none); a tied parameter's
        copies on two stages summed (parallel/tie.py)."""
        if self.lr_scale != 0:
            self.grad_sync.finish()
            if self.tie is not None:
                comm.all_reduce(self.grad_shard, self.tie)

    def grad_sq_sum(self) -> torch.Tensor:
        """() fp64: this rank's part of the squared global grad norm, the sum of grad_shard^2 (times norm_weight,
        where elements count partially: rows replicated over ranks outside the group). No full-size copy (an
        fp64 copy of the shard and its square cost ~15 ms a step on an H100): fp32 sums of GRAD_NORM_ROW
        squares each, added in fp64 (within 1e-6 of the fp64 sum). Without weights one pass, vector_norm over
        rows (the (n / GRAD_NORM_ROW,) row norms the only temporary, a launch for the whole shard); with
        them GRAD_NORM_CHUNK elements at a time (their fp32 squares and weights). A square past fp32's range
        (|g| > 1.8e19) makes the norm inf, a skipped step, where fp64 squares had clipped it."""
        g = self.grad_shard
        if self.norm_weight is None:
            body = g.numel() // GRAD_NORM_ROW * GRAD_NORM_ROW
            rows = torch.cat([torch.linalg.vector_norm(g[:body].view(-1, GRAD_NORM_ROW), dim=1),
                              torch.linalg.vector_norm(g[body:]).view(1)]).double()
            return torch.dot(rows, rows)
        total = torch.zeros((), dtype=torch.float64, device=g.device)
        for lo in range(0, g.numel(), GRAD_NORM_CHUNK):
            sq = g[lo:lo + GRAD_NORM_CHUNK].square()  # fp32: a mixed-dtype mul_ would copy both to fp64 on a CPU
            total += sq.mul_(self.norm_weight[lo:lo + GRAD_NORM_CHUNK].float()).sum()  # pairwise (CPU) or a tree
        return total

    def zero_grad(self) -> None:
        self.grad_sync.zero_grad()  # the shard too (ZeRO-1's is freed until the next step's `finish`)

    # -- update -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step_(self, rule: UpdateRule, lr: float, step: int, clip_coef: float, row_scales: dict | None) -> None:
        """Clip this rank's reduced gradients, then the update site's step: the rule on the master shard,
        QK-clip's `row_scales` (`scale_bucket_rows_`), every bucket's parameters published."""
        if clip_coef != 1.0:
            self.grad_shard.mul_(clip_coef)  # on the device either way: an offloaded step copies the clipped values
        self.update_site.step_(rule, lr, step, row_scales)

    @torch.no_grad()
    def scale_bucket_rows_(self, b: Bucket, row_scales: dict) -> None:
        """Master elements of bucket b's parameters in `row_scales` ({id(param): (rows,) factors over its dim
        0, the local param's}) times their row's factor, on whatever part of each this rank owns (QK-clip)."""
        own_lo = b.start + self.group.rank * b.shard_size
        for p, off in b.params:
            factors = row_scales.get(id(p))
            lo, hi = max(off, own_lo), min(off + p.numel(), own_lo + b.shard_size)
            if factors is None or lo >= hi:
                continue
            rows = torch.arange(lo - off, hi - off, device=self.master.device) // (p.numel() // p.shape[0])
            at = b.shard_start + lo - own_lo
            self.master[at:at + hi - lo].mul_(factors.to(self.master.device, torch.float32)[rows])

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every bucket's master shard published into the parameters (cast; all-gathered where they stay whole)."""
        works = [self.param_store.publish(b, b.part(self.master)) for b in self.buckets]
        for w in works:
            if w is not None:
                w.wait()

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank (on the host when offloaded): the master and the rule's state
        (AdamW in fp32: 12 psi / N)."""
        return sum(t.numel() * t.element_size() for t in (self.master, *self.state.values()))

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this group holds through a step, by memory category: params, grads, optimizer or host."""
        return {"params": self.param_store.tensors(), "grads": [*self.grad_sync.tensors(), self.grad_shard],
                **self.update_site.tensors()}


class ZeroOptimizer:
    """ZeRO over several groups with one update rule; global grad-norm clipping across all shards and mesh
    dims. The placement (`options.placement`, [parallel.placement]: ZeRO-1, 2, 3, the optimizer on the device or
    offloaded) is each group's strategies' (zero/strategies.py).

    groups: [(name, [(param name, param, placement)], Group[, lr scale[, tie Group]])]
    (parallelize.zero_param_groups): a group's learning rate is lr x its scale (default 1); a group with a
    tie group sums its reduced gradient shard over it (the tied embedding's copies: parallel/tie.py); a
    group of scale 0 is frozen: its gradients are dropped as they arrive (never reduced, out of the norm)
    and its master never updated, so neither its reduce-scatter nor its all-gather runs (DeepSeek Sparse
    Attention's warm-up trains only the indexer). `norm_group` spans every rank that owns a distinct shard
    of the model (the world), over which the squared norm is summed. rule: moe_lc.optim's (default AdamW
    with its defaults); no_decay: the names of parameters weight decay leaves alone; shard_groups: the
    mesh's groups by name (ParallelDims.groups), over which a rule's whole matrices are gathered from their
    tensor-parallel slices (Muon). initial_value: name -> a parameter's initial local tensor
    (`Parallelized.initial_value`), read for parameters that have no storage yet (ZeRO-3's deferred
    materialization: each bucket drawn, its shard kept and the rest freed before the next).
    """

    def __init__(self, groups, norm_group: Group, rule: UpdateRule | None = None, options: ZeroOptions = ZeroOptions(),
                 *, no_decay=frozenset(), shard_groups: dict[str, Group] | None = None, initial_value=None):
        self.rule = rule if rule is not None else AdamW()
        self.options, self.placement = options, options.placement
        self.shards = []
        for name, params, group, *rest in groups:
            lr_scale, tie = list(rest) + [1.0, None][len(rest):]
            if params:
                self.shards.append(ShardedParams(name, params, group, self.rule, options, lr_scale=lr_scale, tie=tie,
                                                 no_decay=set(no_decay), shard_groups=shard_groups,
                                                 initial_value=initial_value))
        self.norm_group, self.grad_clip = norm_group, options.grad_clip
        self.step_count = 0
        self.ema = CpuEMA([s.master for s in self.shards], options.ema_decay) if options.ema_decay > 0 else None

    @classmethod
    def from_config(cls, cfg, parallel, dims) -> ZeroOptimizer:
        """The optimizer of recipe `cfg` (moe_lc.config.Config: its update rule and `ZeroOptions`) over the
        rank's model `parallel` (`Parallelized`) on mesh `dims` (ParallelDims): its groups
        (`zero_param_groups`), the norm over the world, Muon's matrices gathered over the mesh's groups."""
        return cls(zero_param_groups(parallel, dims, param_lr_scale(cfg)), dims["world"], recipe_rule(cfg),
                   ZeroOptions.from_config(cfg), no_decay=no_weight_decay_names(parallel.module),
                   shard_groups=dims.groups, initial_value=parallel.initial_value)

    def begin_step(self, grads_per_param: int | dict[int, int]) -> None:
        for s in self.shards:
            s.begin_step(grads_per_param)

    @torch.no_grad()
    def step(self, lr: float, skip_if_nonfinite: bool = True, row_scales: dict | None = None) -> tuple[float, bool]:
        """Finish gradient sync, clip, update, re-gather parameters. Returns (grad_norm, applied).
        A non-finite norm skips the update (gradients are dropped) when skip_if_nonfinite. row_scales:
        {id(param): (rows,) factors} applied to the updated master rows before the all-gather (QK-clip,
        moe_lc/parallel/qk_clip.py); a frozen group's parameters are left as they are."""
        for s in self.shards:
            s.finish_grad_sync()
        sq = sum((s.grad_sq_sum() for s in self.shards if s.lr_scale), torch.zeros((), dtype=torch.float64,
                                                                                   device=self.shards[0].master.device))
        comm.all_reduce(sq, self.norm_group)
        norm = math.sqrt(sq.item()) if math.isfinite(sq.item()) else float("nan")
        if not math.isfinite(norm) and skip_if_nonfinite:
            self.zero_grad()
            return norm, False
        clip = min(1.0, self.grad_clip / (norm + 1e-6)) if self.grad_clip > 0 else 1.0
        self.step_count += 1
        for s in (s for s in self.shards if s.lr_scale):
            s.step_(self.rule, lr * s.lr_scale, self.step_count, clip, row_scales)
        self.zero_grad()
        if self.ema is not None:
            self.flush()  # the average reads every updated master now
            self.ema.update([s.master for s in self.shards])
        return norm, True

    def zero_grad(self) -> None:
        for s in self.shards:
            s.zero_grad()

    def flush(self) -> None:
        """Every update a deferring offloaded optimizer still owes done (before anything reads the masters or the
        parameters outside a forward: checkpoints, final states)."""
        for s in self.shards:
            s.update_site.flush()

    def state_bytes(self) -> int:
        return sum(s.state_bytes() for s in self.shards)
