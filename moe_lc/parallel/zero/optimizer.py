"""ZeRO-1: FP32 master weights and optimizer state sharded over data-parallel ranks; the update rule apart.

Each `ShardedParams` holds the parameters whose gradients are summed over one group (dense parameters over
dp x cp [x tp for tp-replicated ones], expert parameters over edp). Its layout:

    param_buffer (P,) compute dtype  -- the model's parameters are views into it
    grad_buffer  (P,) fp32           -- each parameter's fp32 gradient, accumulated over micro-steps
    buckets      consecutive slices of both buffers, each padded to a multiple of N = group size;
                 rank r owns elements [r*size/N, (r+1)*size/N) of every bucket
    master, grad_shard, state[...]  (sum of bucket sizes / N,) -- this rank's shards; `state` holds the
                 tensors the update rule declares (moe_lc/optim/rule.py: AdamW's exp_avg, exp_avg_sq)

Parameters are laid out in reverse registration order so buckets fill in backward order. A bucket cuts
its parameters at any element offset, except where the rule asks for a parameter whole (`rule.whole`):
such parameters form buckets of their own, packed into N bins of equal width, one per rank (largest first
onto the emptiest bin), so each sits whole in its owner's 1/N and the rule sees it with its shape; the
bins are padded to the bucket's fullest (a matrix rule such as Muon gets a tensor-parallel parameter's
full matrix through `ShardView.to_full`: an all-gather over tp from the owners of its other slices).
When a bucket's last gradient of the step arrives (post-accumulate-grad hook), its reduce-scatter is
launched asynchronously and overlaps the rest of backward; earlier micro-steps only accumulate.
`ZeroOptimizer.step` sums the squared grad norm over the world, clips, lets the rule update each master
shard, and all-gathers each bucket's parameter shard back into param_buffer. On one device (N = 1) the
same code is a mixed-precision optimizer with no communication. With `parallel.placement.optimizer =
"offloaded"` the master and state live in host memory and the update runs on the CPU, bucket by bucket
(moe_lc/parallel/zero/host_step.py). With `parallel.placement.params = "sharded_gather"` (ZeRO-3) there
is no param_buffer: buckets end where a gather unit does (a block; param_gather.py), each bucket's
parameters are views into a storage of its own that is allocated and all-gathered while the unit is in
use and freed after, and the step writes only this rank's `param_shard` (P/N,).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_lc.optim.adamw import AdamW
from moe_lc.optim.rule import OwnedParam, ShardView, UpdateRule
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.zero.ema import CpuEMA
from moe_lc.parallel.zero.grad_rounds import GradRounds
from moe_lc.parallel.zero.host_step import HostOptimizer, host_empty
from moe_lc.parallel.zero.param_gather import resize_storage, unit_of
from moe_lc.parallel.placement import ParamPlacement, Shard, gather_full
from moe_lc.parallel.zero.layout import bucket_layout, bucket_elems, matrix_shards

GRAD_NORM_BYTES_PER_ELEMENT = 16  # the squared norm's fp64 copy and square of a gradient shard (`grad_sq_sum`)


class _Bucket:
    def __init__(self, start: int, size: int, params: list[tuple[nn.Parameter, int]], shard_start: int, n: int):
        self.start, self.size, self.params = start, size, params  # params: (param, offset in buffer)
        self.shard_start, self.shard_size = shard_start, size // n
        # (size,) compute dtype, where its parameters' views point: param_buffer's slice, or (ZeRO-3) a tensor of
        # its own whose storage holds them only while its gather unit (`unit`) is in use
        self.full: torch.Tensor | None = None
        self.unit: str | None = None
        self.index = 0  # in its group's buckets
        self.arrived = self.expected = 0
        self.launched = False
        self.work = None


class ShardedParams:
    """One ZeRO-1 group: flat buffers, buckets, shards, hooks.  See the module docstring."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter, ParamPlacement]], group: Group,
                 bucket_elems: int, no_decay: set[str], rule: UpdateRule, lr_scale: float = 1.0,
                 tie: Group | None = None, shard_groups: dict[str, Group] | None = None, grads_sharded: bool = False,
                 optimizer_offloaded: bool = False, unit_of=None, deferred: bool = False, initial_value=None):
        self.name, self.group, self.lr_scale, self.tie = name, group, lr_scale, tie
        self.names = {id(p): n for n, p, _ in named_params}
        self.placements = {n: place for n, _, place in named_params}
        self.shard_groups = shard_groups  # the mesh's groups by name: where a whole matrix's TP slices live
        norm_weights = {id(p): place.norm_weight for _, p, place in named_params if place.norm_weight is not None}
        params = [p for _, p, _ in reversed(named_params)]
        whole = [rule.whole(n, p.shape) for n, p, _ in reversed(named_params)]
        units = [unit_of(n) for n, _, _ in reversed(named_params)] if unit_of is not None else None
        device, dtype = params[0].device, params[0].dtype
        self.device, N = device, group.size
        self.buckets: list[_Bucket] = []
        start, shard_start, i = 0, 0, 0
        for size, offsets in bucket_layout([p.numel() for p in params], bucket_elems, N, whole, units):
            mine = params[i:i + len(offsets)]
            self.buckets.append(_Bucket(start, size, [(p, start + off) for p, off in zip(mine, offsets)],
                                        shard_start, N))
            self.buckets[-1].unit = units[i] if units is not None else None
            self.buckets[-1].index = len(self.buckets) - 1
            start, shard_start, i = start + size, shard_start + size // N, i + len(offsets)
        self.numel = start
        # ZeRO-3 (unit_of given: parameters sharded, gathered per unit, moe_lc/parallel/zero/param_gather.py):
        # no full parameter buffer; each bucket's parameters live in a storage of its own, freed between uses
        self.params_sharded = unit_of is not None
        self.param_buffer = None if self.params_sharded else torch.zeros(self.numel, device=device, dtype=dtype)
        self.param_shard = torch.empty(self.numel // N, device=device, dtype=dtype) if self.params_sharded else None
        # ZeRO-1 keeps a full-size fp32 main-grad buffer; ZeRO-2 (grads_sharded) only the shard and its rounds
        self.grad_buffer = None if grads_sharded else torch.zeros(self.numel, device=device, dtype=torch.float32)
        self._slot: dict[int, tuple[torch.Tensor, _Bucket]] = {}  # id(param) -> (fp32 grad view, bucket)
        offsets = {}  # id(param) -> (bucket index, offset in the bucket): where GradRounds stages it
        for index, b in enumerate(self.buckets):
            b.full = (torch.zeros(b.size, device=device, dtype=dtype) if self.params_sharded
                      else self.param_buffer[b.start:b.start + b.size])
            for p, off in b.params:
                view = b.full[off - b.start:off - b.start + p.numel()].view_as(p)
                unmade = initial_value is not None and not p.untyped_storage().nbytes()
                view.copy_(initial_value(self.names[id(p)]) if unmade else p.data)  # a deferred one drawn now
                p.data = view
                offsets[id(p)] = (index, off - b.start)
                if self.grad_buffer is not None:
                    self._slot[id(p)] = (self.grad_buffer[off:off + p.numel()].view_as(p), b)
                p.register_post_accumulate_grad_hook(self._on_grad)
            if self.params_sharded:  # one bucket whole at a time: this rank's shard kept, the rest freed
                self.own_params(b).copy_(self._own(b.full, b, 0))
                self.free_bucket(b)
        self.rounds = GradRounds(self, offsets) if grads_sharded else None
        shard = self.numel // N
        self.grad_shard = torch.zeros(shard, device=device, dtype=torch.float32)
        if optimizer_offloaded:  # master and state in host memory, the update on the CPU (zero/host_step.py)
            self.master = host_empty(shard, torch.float32, device)
            self.state = {spec.name: host_empty(shard, spec.dtype, device, fill=spec.init) for spec in rule.states()}
            self.host = HostOptimizer(self, dtype, deferred)
        else:
            self.master = torch.empty(shard, device=device, dtype=torch.float32)
            self.state = {spec.name: torch.full((shard,), spec.init, device=device, dtype=spec.dtype)
                          for spec in rule.states()}
            self.host = None
        for b in self.buckets:
            self._shard_slice(b, self.master).copy_(self.own_params(b))
        owned = self._owned_params()
        grad = self.grad_shard if self.host is None else self.host.grad_host  # what the rule reads
        self.view = ShardView(self.master, grad, self.state,
                              [(o.lo, o.hi) for o in owned if o.name in no_decay], owned, self._to_full, self._to_local)
        self.norm_weight = self._norm_weight_shard(norm_weights)
        self.sync = False

    # -- layout helpers ---------------------------------------------------------------------------
    def _own(self, buffer: torch.Tensor, b: _Bucket, start: int | None = None) -> torch.Tensor:
        """This rank's slice of bucket b inside a full (P,) buffer (or, start = 0, inside the bucket's own)."""
        lo = (b.start if start is None else start) + self.group.rank * b.shard_size
        return buffer[lo:lo + b.shard_size]

    def own_params(self, b: _Bucket) -> torch.Tensor:
        """(size / N,) compute dtype: this rank's parameter values of bucket b, what its all-gather sends."""
        if self.params_sharded:
            return self._shard_slice(b, self.param_shard)
        return self._own(self.param_buffer, b)

    @staticmethod
    def _shard_slice(b: _Bucket, shard: torch.Tensor) -> torch.Tensor:
        """Bucket b's part of a (P/N,) shard tensor."""
        return shard[b.shard_start:b.shard_start + b.shard_size]

    def _owned_params(self) -> list[OwnedParam]:
        """The parameters with elements in this rank's shard, bucket by bucket (module docstring)."""
        out = []
        for b in self.buckets:
            own_lo = b.start + self.group.rank * b.shard_size
            own_hi = own_lo + b.shard_size
            for p, off in b.params:
                lo, hi = max(off, own_lo), min(off + p.numel(), own_hi)
                if lo < hi:
                    out.append(OwnedParam(self.names[id(p)], p.shape, b.shard_start + lo - own_lo,
                                          b.shard_start + hi - own_lo, lo - off))
        return out

    def _norm_weight_shard(self, weights: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """(P/N,) weights of the squared grad norm from the placements' norm weights (broadcastable to the
        param; e.g. 1/copies for rows that several ranks outside this group hold, such as replicated kv
        heads under tensor parallelism); None when every element counts once."""
        if not weights:
            return None
        full = torch.ones(self.numel, device=self.device, dtype=torch.float64)
        for b in self.buckets:
            for p, off in b.params:
                if id(p) in weights:
                    full[off:off + p.numel()] = weights[id(p)].to(full.device).expand_as(p).reshape(-1)
        return torch.cat([self._own(full, b) for b in self.buckets])

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
        if not shards:
            return local
        return gather_full(local.to(self.device), shards, self.shard_groups).to(local.device)

    def _to_local(self, o: OwnedParam, full: torch.Tensor) -> torch.Tensor:
        """(ShardView.to_local) this rank's slice of a full tensor of a whole owned parameter."""
        for shard in self._matrix_shards(o):
            group = self.shard_groups[shard.group]
            full = shard.local_slice(full, group.rank, group.size)
        return full

    # -- gradient synchronization -------------------------------------------------------------------
    def begin_step(self, grads_per_param: int | dict[int, int]) -> None:
        """Expect this many gradient arrivals per parameter this step (its micro-batches); a dict
        gives them per id(param) (pipelines, where a parameter may serve several chunks)."""
        self.sync = True
        for b in self.buckets:
            b.arrived, b.launched, b.work = 0, False, None
            if isinstance(grads_per_param, dict):
                b.expected = sum(grads_per_param.get(id(p), 0) for p, _ in b.params)
            else:
                b.expected = len(b.params) * grads_per_param

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # a deferred weight gradient: its W pass delivers it (and calls us) later
            return
        if self.lr_scale == 0:  # frozen: its gradient is dropped, never reduced (nor the group's norm)
            p.grad = None
            return
        if self.rounds is not None:  # ZeRO-2: staged, reduce-scattered round by round (grad_rounds.py)
            self.rounds.add(p, p.grad)
            p.grad = None
            return
        main_grad, b = self._slot[id(p)]
        main_grad.add_(p.grad)
        p.grad = None
        b.arrived += 1
        if self.sync and b.arrived == b.expected:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        out = self._shard_slice(b, self.grad_shard)
        b.work = comm.reduce_scatter(out, self.grad_buffer[b.start:b.start + b.size], self.group, async_op=True)
        b.launched = True

    def finish_grad_sync(self) -> None:
        """Launch buckets whose gradients never all arrived (unused parameters), wait for all (a frozen
        group launches none); ZeRO-2: the open rounds, then fold every round in."""
        if self.rounds is not None:
            self.rounds.finish()
        else:
            for b in self.buckets:
                if not b.launched and self.lr_scale != 0:
                    self._launch(b)
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                b.launched, b.work = False, None
        if self.tie is not None and self.lr_scale != 0:  # a tied parameter's copies on two stages (parallel/tie.py)
            comm.all_reduce(self.grad_shard, self.tie)
        self.sync = False

    # -- update -----------------------------------------------------------------------------------
    def grad_sq_sum(self) -> torch.Tensor:
        sq = self.grad_shard.double().pow(2)
        return (sq if self.norm_weight is None else sq * self.norm_weight).sum()

    @torch.no_grad()
    def step_(self, rule: UpdateRule, lr: float, step: int, clip_coef: float, row_scales: dict | None) -> None:
        """Clip this rank's reduced gradients, the rule's step on the master shard, QK-clip's `row_scales`
        (`scale_bucket_rows_`), and every bucket's parameters all-gathered; with the optimizer offloaded,
        bucket by bucket on the host (zero/host_step.py)."""
        if clip_coef != 1.0:
            self.grad_shard.mul_(clip_coef)  # on the device either way: an offloaded step copies the clipped values
        if self.host is not None:
            return self.host.step_(rule, lr, step, row_scales)
        rule.update_(self.view, lr, step)
        for b in self.buckets if row_scales else ():
            self.scale_bucket_rows_(b, row_scales)
        self.gather_params()

    @torch.no_grad()
    def scale_bucket_rows_(self, b: _Bucket, row_scales: dict) -> None:
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

    def publish(self, b: _Bucket, shard: torch.Tensor):
        """Bucket b's updated shard values (cast into this rank's parameter slice; non-blocking from pinned
        host memory) and the bucket's all-gather launched -> its work (None: nothing to wait). ZeRO-3 gathers
        nothing here: the next forward does, unit by unit (param_gather.py)."""
        own = self.own_params(b)
        own.copy_(shard, non_blocking=True)
        return None if self.params_sharded else self.gather_bucket(b)

    def ready(self, b: _Bucket) -> None:
        """Bucket b's parameters updated and in place, where a deferring offloaded optimizer still owes them."""
        if self.host is not None:
            self.host.ready(b.index)

    def gather_bucket(self, b: _Bucket):
        """Bucket b's parameters all-gathered into its storage (ZeRO-3: allocated again first) -> the work."""
        if self.params_sharded:
            resize_storage(b.full, b.size * b.full.element_size())
        return comm.all_gather(b.full, self.own_params(b), self.group, async_op=True)

    def free_bucket(self, b: _Bucket) -> None:
        """ZeRO-3: release bucket b's gathered storage (its parameters' views stay, sized 0, until regathered)."""
        resize_storage(b.full, 0)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Write updated master shards (cast) into the param buffer and all-gather every bucket."""
        works = [self.publish(b, self._shard_slice(b, self.master)) for b in self.buckets]
        for w in works:
            if w is not None:
                w.wait()

    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        self.grad_shard.zero_()

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank (on the host when offloaded): the master and the rule's state
        (AdamW in fp32: 12 psi / N)."""
        return sum(t.numel() * t.element_size() for t in (self.master, *self.state.values()))


class ZeroOptimizer:
    """ZeRO-1 over several groups with one update rule; global grad-norm clipping across all shards and
    mesh dims. grads: "replicated" (ZeRO-1's full main-grad buffer) or "sharded" (ZeRO-2: only the reduced
    shard, moe_lc/parallel/zero/grad_rounds.py), `parallel.placement.grads`; optimizer: "device" or "offloaded"
    (master and state in host memory, moe_lc/parallel/zero/host_step.py), `parallel.placement.optimizer`;
    params: "replicated" or "sharded_gather" (ZeRO-3: each rank keeps its 1/N of the parameters, a
    `ParamGather` gathers them unit by unit around their use, moe_lc/parallel/zero/param_gather.py; implies
    sharded grads), `parallel.placement.params`.

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

    def __init__(self, groups, norm_group: Group, rule: UpdateRule | None = None, *, grad_clip=0.0,
                 bucket_mb=32.0, no_decay: set[str] = frozenset(), ema_decay: float = 0.0,
                 shard_groups: dict[str, Group] | None = None, grads: str = "replicated", optimizer: str = "device",
                 params: str = "replicated", optimizer_overlap: bool = False, initial_value=None):
        self.rule = rule if rule is not None else AdamW()
        sharded = params == "sharded_gather"  # ZeRO-3 shards the gradients too
        self.shards = [ShardedParams(n, ps, g, bucket_elems(bucket_mb), set(no_decay), self.rule,
                                     *(scale or [1.0]), shard_groups=shard_groups,
                                     grads_sharded=grads == "sharded" or sharded,
                                     optimizer_offloaded=optimizer == "offloaded", unit_of=unit_of if sharded else None,
                                     deferred=optimizer_overlap, initial_value=initial_value)
                       for n, ps, g, *scale in groups if ps]
        self.params_sharded = sharded
        self.deferred = optimizer == "offloaded" and optimizer_overlap  # updates run as the next forward needs them
        self.norm_group = norm_group
        self.grad_clip = grad_clip
        self.step_count = 0
        self.ema = CpuEMA([s.master for s in self.shards], ema_decay) if ema_decay > 0 else None

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
            if s.host is not None:
                s.host.flush()

    def state_bytes(self) -> int:
        return sum(s.state_bytes() for s in self.shards)

