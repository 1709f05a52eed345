"""Which of a prediction's communication groups fit one NVLink domain yet straddle two: one warning each.

The step-time model prices a collective by where its ranks are (tools/step_time/model.py `link_seconds`): a
domain is `gpus_per_node` consecutive global ranks (8 on the DGX clusters, 72 on gb200), and a group with a
peer outside the rank's domain runs at the scale-out bandwidth (an all-to-all: its bytes to those peers). The
mesh (moe_lc/parallel/mesh.py) numbers ranks tp innermost, then cp, dp, pp, and ep is a block of `ep`
consecutive ranks of a pipeline stage, so a group that would fit a domain still straddles two when the
domain size does not line up with the blocks: on gb200 the 671B recipe's 128-rank stages put its EP64 group
of ranks 640-703 in domains 8 and 9, and the prediction falls to the H800's. Only such groups are warned
about: one whose ranks lie further apart than a domain (pp, edp, dp over the inner dims, a group larger than
a domain) spans several by the mesh order and its degrees, which the layout asked for.
"""

from __future__ import annotations

from moe_lc.config import Config
from moe_lc.parallel.mesh import ParallelDims
from .clusters import Cluster


def group_partition(dims: ParallelDims, group: str) -> list[list[int]]:
    """Every group of this name as its global ranks; a subgroup made on demand (e.g. "tp_kv": the tp ranks
    sharing a kv head) is placed as its mesh dim (the part of its name before "_")."""
    try:
        return dims.group_ranks(group)
    except ValueError:
        return dims.group_ranks(group.split("_")[0])


def straddling(partition: list[list[int]], domain: int) -> list[list[int]]:
    """The groups of `partition` whose ranks lie within a window of at most `domain` consecutive ranks (so the
    mesh could have kept them in one domain) but in more than one domain."""
    return [r for r in partition if max(r) - min(r) < domain and len({x // domain for x in r}) > 1]


def domain_warnings(dims: ParallelDims, groups: list[str], cluster: Cluster, priced_rank: int) -> list[str]:
    """One line per group name in `groups` (those the prediction prices) some of whose groups fit a domain but
    straddle two or more: the name, size, domain size, how many, whether `priced_rank` (the rank the step is
    predicted on) is in one, and the consequence."""
    out, domain = [], cluster.gpus_per_node
    for name in dict.fromkeys(groups):
        partition = group_partition(dims, name)
        split = straddling(partition, domain)
        if not split:
            continue
        ours = next((r for r in split if priced_rank in r), None)
        where = (f"the predicted rank's is one, ranks {min(ours)}-{max(ours)}" if ours else
                 f"not the predicted rank {priced_rank}'s: the prediction does not slow for them, those ranks will")
        out.append(f"{name}: {len(split)} of {len(partition)} {name} groups of {len(split[0])} ranks would fit one "
                   f"NVLink domain of {domain} GPUs but straddle two ({where}); their collectives are priced at the "
                   f"scale-out bandwidth ({cluster.net_gbps:g} GB/s per GPU, not NVLink's {cluster.nvlink_gbps:g}), "
                   "an all-to-all for its bytes to the peers across the boundary")
    return out


def plan_warnings(cfg: Config, plan, cluster: Cluster, pp_rank: int) -> list[str]:
    """`domain_warnings` of every group a rank of the plan sends over, the step predicted on the first rank
    of pipeline rank `pp_rank` (tools/step_time/model.py `rank_costs`)."""
    dims = ParallelDims.from_config(cfg.parallel, plan.degrees["world"])
    groups = [row.group for r in plan.ranks for row in r.traffic]
    return domain_warnings(dims, groups, cluster, dims.rank_of(pp_rank, 0, 0, 0))


def render_warnings(pred: dict) -> list[str]:
    """Text lines of the prediction's warnings."""
    return [f"  warning: {w}" for w in pred.get("warnings", [])]
