"""Where each parameter lives: `Shard` specs, the placement table the layer plan's rules fill, and
gathering a full tensor back.

A layer-plan rule that shards a parameter (tp/plan.py, ep/dispatch.py) records it in the `Placements` table (never on the
parameter): the full (single-device) tensor is rebuilt by undoing the shards in reverse order. One
table serves initialization (each rank materializes only its slice of the seeded full tensor),
ZeRO-1 (gradient groups and grad-norm weights), final-state gathering, checkpoints and the planner.

Shard(group="tp", dim=0): the full tensor is cut into `group size` equal pieces along `dim`;
the rank with index i in the group holds piece i.
Sections: a fused weight such as wqkv = [q; k; v] is cut per section: `sections` lists
(full length along dim, pieces) for each consecutive section; a section with fewer pieces than the
group size is replicated: rank i holds piece i * pieces // size (e.g. kv heads when n_kv < tp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group


@dataclass(frozen=True)
class Shard:
    group: str
    dim: int
    sections: tuple[tuple[int, int], ...] | None = None  # ((full length, pieces), ...) along dim

    def _sections(self, full_len: int, size: int) -> tuple[tuple[int, int], ...]:
        return self.sections if self.sections is not None else ((full_len, size),)

    def local_ranges(self, full_len: int, rank: int, size: int) -> list[tuple[int, int]]:
        """[start, stop) ranges of the full dim that this rank's piece consists of, in order."""
        out, start = [], 0
        for length, pieces in self._sections(full_len, size):
            if length % pieces:
                raise ValueError(f"cannot cut length {length} into {pieces} pieces along dim {self.dim}")
            piece = length // pieces
            index = rank * pieces // size
            out.append((start + index * piece, start + (index + 1) * piece))
            start += length
        return out

    def local_slice(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's piece of `full` (a view when there is a single section)."""
        parts = [full.narrow(self.dim, a, b - a) for a, b in self.local_ranges(full.shape[self.dim], rank, size)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def full_shape(self, local_shape: torch.Size, size: int) -> list[int]:
        shape = list(local_shape)
        if self.sections is None:
            shape[self.dim] *= size
        else:
            shape[self.dim] = sum(length for length, _ in self.sections)
        return shape

    def assemble(self, pieces_by_rank: list[torch.Tensor], size: int) -> torch.Tensor:
        """Inverse of local_slice, from every rank's local tensor (group order)."""
        local_len = pieces_by_rank[0].shape[self.dim]
        sections = self._sections(local_len * size, size)
        out, offset = [], 0
        for length, pieces in sections:
            piece = length // pieces
            for p in range(pieces):
                owner = -(-p * size // pieces)  # the first rank holding piece p
                out.append(pieces_by_rank[owner].narrow(self.dim, offset, piece))
            offset += piece
        return torch.cat(out, dim=self.dim)


@dataclass
class ParamPlacement:
    """One parameter's place in the layout.

    grad_group   the group its gradient is summed over, which ZeRO-1 also shards it over:
                 "dp_cp" dense and unique per tp rank (tp-sharded, or tp = 1); "dp_cp_tp" replicated
                 over tp while each tp rank saw other tokens (norms, router under sequence
                 parallelism); "edp" routed experts (replicated over the expert-data-parallel group)
    shards       how the local tensor is cut from the full one (empty: the full tensor)
    norm_weight  weight of its elements in the global grad norm, broadcastable to the parameter (None:
                 1), e.g. 1/copies for kv rows replicated over tp ranks outside its grad group
    grad_hooks   tensor hooks its gradient passes before accumulation (e.g. summing kv rows replicated
                 over tp), registered on the live parameter by `install_grad_hooks`
    tie_group    the group over which copies of it on other pipeline stages sum their reduced gradient
                 (the tied embedding's "pp_tie", moe_lc/parallel/tie.py); None: one copy
    """

    grad_group: str = "dp_cp"
    shards: tuple[Shard, ...] = ()
    norm_weight: torch.Tensor | None = None
    grad_hooks: tuple = ()
    tie_group: str | None = None

    def full_shape(self, local_shape, groups: dict[str, Group]) -> list[int]:
        shape = list(local_shape)
        for shard in self.shards:
            shape = shard.full_shape(torch.Size(shape), groups[shard.group].size)
        return shape


class Placements:
    """The table the layer plan's rules fill, keyed by the Parameter object (names can change as
    modules are swapped; the object does not)."""

    def __init__(self):
        self._table: dict[int, tuple[nn.Parameter, ParamPlacement]] = {}

    def of(self, param: nn.Parameter) -> ParamPlacement:
        return self._table.setdefault(id(param), (param, ParamPlacement()))[1]

    def shard_(self, param: nn.Parameter, shard: Shard, group: Group) -> None:
        """Replace a full parameter's data by this rank's piece and record the shard (meta tensors
        are cut too: a model built on the meta device gets its local shapes here)."""
        param.data = shard.local_slice(param.data, group.rank, group.size).clone()
        place = self.of(param)
        place.shards = (*place.shards, shard)

    def set_group(self, params, grad_group: str) -> None:
        for p in params:
            self.of(p).grad_group = grad_group

    def by_name(self, named_params) -> dict[str, ParamPlacement]:
        """{name: placement} for (name, param) pairs, in their order (unrecorded ones: the default)."""
        return {name: self.of(p) for name, p in named_params}


def install_grad_hooks(module: nn.Module, placements: dict[str, ParamPlacement]) -> None:
    """Register each placement's gradient hooks on the parameter of that name (once the parameters are
    the live ones: after materialization for a model built on the meta device)."""
    params = dict(module.named_parameters())
    for name, place in placements.items():
        for hook in place.grad_hooks:
            params[name].register_hook(hook)


@torch.no_grad()
def gather_full(local: torch.Tensor, shards: tuple[Shard, ...], groups: dict[str, Group]) -> torch.Tensor:
    """The full tensor from every rank's local piece (collective over each shard's group)."""
    full = local
    for shard in reversed(shards):
        group = groups[shard.group]
        if group.size == 1:
            continue
        flat = full.contiguous()
        buffer = torch.empty((group.size, *flat.shape), dtype=flat.dtype, device=flat.device)
        comm.all_gather(buffer.view(-1), flat.view(-1), group)
        full = shard.assemble(list(buffer.unbind(0)), group.size)
    return full


@dataclass
class Parallelized:
    """What `parallelize` returns: this rank's model and the layout the optimizer, checkpoints,
    final-state gathering and the planner read.

    module      this rank's model (under PP the union of its stages, single-device parameter names)
    placements  every parameter of `module` by name, in single-device registration order
    chunks      the modules a forward runs: under PP one per pipeline stage the rank holds (sharing
                `module`'s submodules, in local chunk order), else [module]
    stage_ids   the pipeline stage each chunk is ([0] without PP)
    wgrad_store where the chunks' deferring Linears push their weight gradients (pipelines; else None)
    decisions   the layer plan it was built from, one line per decision (moe_lc/parallel/layer_plan.py)
    compile_watch  what compiling its regions cost and broke (train.compile; else None: parallel/compile.py)
    offload     the rank's ActivationOffload (train.offload; else None: parallel/memory/offload.py)
    initial_value  name -> that parameter's initial local tensor (set by `materialize`; ZeRO-3 draws its
                deferred parameters through it, bucket by bucket)
    """

    module: nn.Module
    placements: dict[str, ParamPlacement]
    chunks: list[nn.Module] = field(default_factory=list)
    stage_ids: list[int] = field(default_factory=lambda: [0])
    wgrad_store: object = None
    decisions: list[str] = field(default_factory=list)
    compile_watch: object = None
    offload: object = None
    initial_value: object = None

    def __post_init__(self):
        self.chunks = self.chunks or [self.module]

    def named_parameters(self):
        """(name, param, placement) in single-device order (the same on DualPipe's mirror ranks)."""
        params = dict(self.module.named_parameters())
        return [(name, params[name], place) for name, place in self.placements.items()]
