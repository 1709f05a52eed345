"""How a parameter's local tensor relates to the full tensor: `Shard` specs, slicing and gathering.

A parallelize step that shards a parameter records `param._placement = [Shard(...), ...]`; the
full (single-device) tensor is rebuilt by undoing them in reverse order. One spec serves
initialization (slice the full, seeded tensor), final-state gathering (equivalence tests) and
checkpoints.

Shard(group="tp", dim=0): the full tensor is cut into `group size` equal pieces along `dim`;
the rank with index i in the group holds piece i.
Sections: a fused weight such as wqkv = [q; k; v] is cut per section: `sections` lists
(full length along dim, pieces) for each consecutive section; a section with fewer pieces than the
group size is replicated: rank i holds piece i * pieces // size (e.g. kv heads when n_kv < tp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group


@dataclass(frozen=True)
class Shard:
    group: str
    dim: int
    sections: tuple[tuple[int, int], ...] | None = None  # ((full length, pieces), ...) along dim

    def _sections(self, full_len: int, size: int) -> tuple[tuple[int, int], ...]:
        return self.sections if self.sections is not None else ((full_len, size),)

    def local_slice(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's piece of `full` (a view when there is a single section)."""
        parts, start = [], 0
        for length, pieces in self._sections(full.shape[self.dim], size):
            if length % pieces:
                raise ValueError(f"cannot cut length {length} into {pieces} pieces along dim {self.dim}")
            piece = length // pieces
            index = rank * pieces // size
            parts.append(full.narrow(self.dim, start + index * piece, piece))
            start += length
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


def shard_param_(param: torch.nn.Parameter, shard: Shard, group: Group) -> None:
    """Replace a full parameter's data by this rank's piece and record the placement."""
    param.data = shard.local_slice(param.data, group.rank, group.size).clone()
    param._placement = list(getattr(param, "_placement", [])) + [shard]


@torch.no_grad()
def gather_full(local: torch.Tensor, placement: list[Shard], groups: dict[str, Group]) -> torch.Tensor:
    """The full tensor from every rank's local piece (collective over each placement's group)."""
    full = local
    for shard in reversed(placement):
        group = groups[shard.group]
        if group.size == 1:
            continue
        flat = full.contiguous()
        buffer = torch.empty((group.size, *flat.shape), dtype=flat.dtype, device=flat.device)
        comm.all_gather(buffer.view(-1), flat.view(-1), group)
        full = shard.assemble(list(buffer.unbind(0)), group.size)
    return full
