"""ParallelDims: the degrees, their validation, and the named process groups of the mesh.

Global rank layout, tp innermost (consecutive ranks share a node first):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Expert parallelism is folded into the dp x cp x tp ranks of a pipeline stage (DeepSeek-V3 runs
EP64 over its data-parallel ranks): with j = (dp_i * cp + cp_i) * tp + tp_i, the ep group of a rank
is the block of `ep` consecutive j, and the expert-data-parallel (edp) group the ranks with the
same j % ep. A node is `ranks_per_node` consecutive global ranks.

Groups (each a `comm.Group` sharing one CommCounter): pp, dp, cp, tp, dp_cp (dense gradients),
dp_cp_tp (tp-replicated parameters' gradients), ep, edp, world. With `cp_a2a` = A > 1 (hybrid context
parallelism, parallel/cp/ulysses.py) also cp_a2a, the A consecutive cp ranks of an all-to-all, and cp_ring,
the cp / A ranks with the same index in theirs (cp indices a, A + a, 2A + a, ...).

With `pp_mirror` (DualPipe: pipeline ranks r and pp-1-r hold the same two stages), the gradient
groups dp_cp, dp_cp_tp and edp span both mirror ranks' groups (lower pp index first), so the two
copies of a stage sum their gradients and share one ZeRO-1 shard layout.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_lc.config import ConfigError, ParallelConfig, layout_errors
from moe_lc.parallel.comm import CommCounter, Group
from moe_lc.parallel.comm_timing import Link

GROUP_NAMES = ("pp", "dp", "cp", "tp", "dp_cp", "dp_cp_tp", "ep", "edp", "world")
MIRRORED = ("dp_cp", "dp_cp_tp", "edp")


@dataclass
class ParallelDims:
    """Degrees of one run (validated) and, after `init_groups`, its process groups."""

    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    world: int
    ranks_per_node: int
    rank: int = 0
    pp_mirror: bool = False
    device_type: str = "cpu"  # what the groups' backend moves: "cuda" (NCCL) or "cpu" (gloo); comm checks it
    groups: dict[str, Group] = field(default_factory=dict)
    virtual: bool = False  # groups without process groups (init_groups(virtual=True))
    counter: CommCounter = field(default_factory=CommCounter)
    overlap: bool = True  # parallel.overlap: wait for a transfer where its result is used, not where issued
    cp_a2a: int = 1  # parallel.cp_a2a: the cp group's all-to-all size (1: the ring alone)

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int, rank: int = 0, device_type: str = "cpu") -> "ParallelDims":
        """Degrees from [parallel] for this world size; ConfigError lists every violated layout rule (the
        recipe's own rules, `moe_lc.config.layout_errors`; model-dependent ones are checked there too)."""
        d, errors = layout_errors(p, world_size)
        if errors:
            raise ConfigError(errors)
        dims = cls(p.pp, d["dp"], p.cp, p.tp, p.ep, world_size, min(d["ranks_per_node"], world_size), rank,
                   pp_mirror=p.pp_schedule == "dualpipe" and p.pp > 1, device_type=device_type,
                   overlap=p.overlap, cp_a2a=p.cp_a2a)
        if p.link_model is not None:
            intra, inter = p.link_model
            dims.counter.link = Link(*intra, inter=Link(*inter) if inter != intra else None)
        return dims

    # -- coordinates ----------------------------------------------------------------------------
    @property
    def edp(self) -> int:
        return self.dp * self.cp * self.tp // self.ep

    def coords(self, rank: int | None = None) -> dict[str, int]:
        r = self.rank if rank is None else rank
        tp_i, r = r % self.tp, r // self.tp
        cp_i, r = r % self.cp, r // self.cp
        dp_i, pp_i = r % self.dp, r // self.dp
        j = (dp_i * self.cp + cp_i) * self.tp + tp_i
        return dict(pp=pp_i, dp=dp_i, cp=cp_i, tp=tp_i, ep=j % self.ep, edp=j // self.ep)

    def rank_of(self, pp: int, dp: int, cp: int, tp: int) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of this name, each as its global ranks in group order."""
        groups = self._stage_group_ranks(name)
        if not (self.pp_mirror and name in MIRRORED):
            return groups
        per_pp = len(groups) // self.pp  # groups are listed pp index by pp index
        merged = []
        for pp_i in range(self.pp // 2):
            lo, hi = groups[pp_i * per_pp:(pp_i + 1) * per_pp], groups[(self.pp - 1 - pp_i) * per_pp:][:per_pp]
            merged += [a + b for a, b in zip(lo, hi)]
        return merged

    def _stage_group_ranks(self, name: str) -> list[list[int]]:
        per_stage = self.dp * self.cp * self.tp
        if name == "world":
            return [list(range(self.world))]
        out = []
        for pp_i in range(self.pp):
            base = pp_i * per_stage
            if name == "pp":
                return [[s * per_stage + j for s in range(self.pp)] for j in range(per_stage)]
            if name == "tp":
                out += [[base + k * self.tp + t for t in range(self.tp)] for k in range(per_stage // self.tp)]
            elif name == "cp":
                out += [[self.rank_of(pp_i, d, c, t) for c in range(self.cp)] for d in range(self.dp) for t in range(self.tp)]
            elif name in ("cp_a2a", "cp_ring"):  # hybrid cp (made when cp_a2a > 1), see the module docstring
                A, R = self.cp_a2a, self.cp // self.cp_a2a
                cps = [[o * A + a for a in range(A)] for o in range(R)] if name == "cp_a2a" else \
                      [[o * A + a for o in range(R)] for a in range(A)]
                out += [[self.rank_of(pp_i, d, c, t) for c in cs] for d in range(self.dp) for t in range(self.tp)
                        for cs in cps]
            elif name == "dp":
                out += [[self.rank_of(pp_i, d, c, t) for d in range(self.dp)] for c in range(self.cp) for t in range(self.tp)]
            elif name == "dp_cp":
                out += [[self.rank_of(pp_i, d, c, t) for d in range(self.dp) for c in range(self.cp)] for t in range(self.tp)]
            elif name == "dp_cp_tp":
                out.append(list(range(base, base + per_stage)))
            elif name == "cp_tp":  # made on demand (balance_plan.py), not one of GROUP_NAMES
                out += [list(range(base + d * self.cp * self.tp, base + (d + 1) * self.cp * self.tp)) for d in range(self.dp)]
            elif name == "ep":
                out += [[base + b * self.ep + e for e in range(self.ep)] for b in range(self.edp)]
            elif name == "edp":
                out += [[base + b * self.ep + e for b in range(self.edp)] for e in range(self.ep)]
            else:
                raise ValueError(f"unknown group {name!r}; known: {', '.join(GROUP_NAMES)}")
        return out

    # -- process groups -----------------------------------------------------------------------------
    def init_groups(self, virtual: bool = False) -> dict[str, Group]:
        """Create every named group (collective: all ranks call it in the same order). `virtual`: no
        process groups, for building this rank's layout in one process (the planner); a collective on
        such a group raises."""
        self.virtual = virtual
        for name in GROUP_NAMES + (("cp_a2a", "cp_ring") if self.cp_a2a > 1 else ()):
            self.add_group(name, self.group_ranks(name))
        return self.groups

    def add_group(self, name: str, partition: list[list[int]]) -> Group:
        """Create one process group per rank list of `partition` and keep this rank's as `name`
        (collective: every rank calls it with the same partition). Parallel techniques use it for
        subgroups beyond the mesh axes, e.g. the tp ranks sharing a replicated kv head."""
        mine, pg = None, None
        for ranks in partition:
            new = None
            if self.world > 1 and len(ranks) > 1 and not self.virtual:
                new = dist.group.WORLD if len(ranks) == self.world else dist.new_group(ranks)
            if self.rank in ranks:
                mine, pg = ranks, new
        self.groups[name] = Group(name, mine, mine.index(self.rank), pg, self.ranks_per_node, self.counter,
                                  self.device_type, virtual=self.virtual)
        return self.groups[name]

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    def describe(self) -> str:
        return (f"world={self.world} pp={self.pp} dp={self.dp} cp={self.cp} tp={self.tp} ep={self.ep} "
                f"edp={self.edp} ranks_per_node={self.ranks_per_node}" + (f" cp_a2a={self.cp_a2a}" if self.cp_a2a > 1 else "") + (" (dualpipe mirror pairs)" if self.pp_mirror else ""))


def init_distributed(timeout_s: float, device_type: str) -> tuple[int, int]:
    """Join the torchrun job described by the environment, if any. Returns (rank, world_size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one TCPStore (same port) across restarts, so a restarted job would
        # read the failed attempt's process-group keys and connect to dead peers (pytorch#167288);
        # scope every key to this attempt.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"moe_lc/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def exit_process(code: int) -> None:
    """End an entry point. In a multi-process job (WORLD_SIZE > 1, as torchrun and the test harness
    set it) leave with os._exit, skipping interpreter finalization: a gloo worker thread can still hold
    a finished collective's tensors after wait() has returned, and if it frees them while Python
    finalizes it cannot take the GIL and the process aborts with "terminate called without an active
    exception" (about 1 run in 60 on a loaded CPU; pytorch#179291). Callers have written and closed
    everything (checkpoints, metrics, logs) by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(code)
    sys.exit(code)
