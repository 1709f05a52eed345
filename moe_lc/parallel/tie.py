"""Tied embeddings under a pipeline (model.tie_embeddings): the first and the last stage each hold the one
(V, D) parameter, named embed.weight on both (stage.py), and sum its gradient over a `pp_tie` group before
the optimizer, as Megatron-LM does for its shared word embeddings (`_allreduce_word_embedding_grads`).

The copies start equal (the same name-seeded init) and stay equal bit for bit: the ZeRO-1 optimizer keeps
the tied parameter in a ZeRO group of its own ("<grad group>+pp_tie", parallelize.zero_group_of), so its
flat layout and each data-parallel rank's shard are the same on both stages; after the data-parallel
reduce-scatter each rank all-reduces its reduced shard over pp_tie (moe_lc/parallel/zero/optimizer.py, counted by
comm.py: 2 x (n-1)/n x 4 bytes x the shard's elements), and both copies take the same update. The global
grad norm weighs each copy 1/n. Schedules whose first and last stage share the rank (DualPipe, DualPipeV,
one stage) hold one copy and need no group.

Checkpoints: a tied model saves embed.weight and no head.weight. checkpoint.init_from of a tied checkpoint
into an untied recipe (continued pre-training with a head of its own) starts the head as a copy of the
embedding (`untied_head`, read in Checkpointer.load_weights); the reverse is refused (`tie_mismatch`):
an untied model's head was trained apart from its embedding, and one tensor cannot be both.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.placement import Placements

TIE_GROUP = "pp_tie"


def tie_stages(schedule) -> list[int]:
    """The pipeline ranks that hold a copy of the tied parameter, ascending: those of the first and of the
    last stage when no rank holds both, else [] (one copy per rank: no sum needed)."""
    first = {route[0][0] for route in schedule.routes}
    last = {route[-1][0] for route in schedule.routes}
    if first & last:
        assert first == last, f"a schedule whose ends share some ranks and not others: {first}, {last}"
        return []
    return sorted(first | last)


def tie_plan(model: nn.Module, dims: ParallelDims, schedule, placements: Placements) -> None:
    """Create the pp_tie group (collective: every rank calls it) and mark the tied parameter's placement on
    the ranks holding a copy (its tie group and grad-norm weight 1/copies). `model`: the whole model,
    before the pipeline split."""
    holders = tie_stages(schedule) if schedule is not None else []
    if len(holders) < 2:
        return
    pairs, singles = [], []
    for r in range(dims.world):
        c = dims.coords(r)
        if c["pp"] == holders[0]:
            pairs.append([dims.rank_of(pp, c["dp"], c["cp"], c["tp"]) for pp in holders])
        elif c["pp"] not in holders:
            singles.append([r])
    dims.add_group(TIE_GROUP, pairs + singles)
    if dims.coords()["pp"] in holders:
        place = placements.of(model.embed.weight)
        place.tie_group, place.norm_weight = TIE_GROUP, torch.tensor(1.0 / len(holders))


def untied_head(keys: set[str], tie_embeddings: bool) -> bool:
    """A tied checkpoint (its flattened `keys`: an embedding and no head) loaded into an untied model: the
    head starts as a copy of the embedding (checkpoint.init_from)."""
    return not tie_embeddings and "model.embed.weight" in keys and "model.head.weight" not in keys


def tie_mismatch(path, saved: set[str], wanted: set[str], untie: bool) -> tuple[list[str], set[str]]:
    """A checkpoint at `path` (its model tensors `saved`) and a recipe (its model's `wanted`) that differ in
    model.tie_embeddings: (the error lines, the tensor names they account for, which the checkpoint's
    generic lacks / holds lines leave out). A tied checkpoint into an untied recipe is no error with `untie`."""
    if "embed.weight" in saved and "head.weight" not in saved and "head.weight" in wanted:
        return ([] if untie else [
            f"{path} holds a tied model (its embed.weight is also the head, no head.weight) but the recipe sets "
            "model.tie_embeddings = false: set it to true (checkpoint.init_from can untie one: it starts the head "
            "as a copy of the embedding)"]), {"head.weight"}
    if "head.weight" in saved and "embed.weight" in wanted and "head.weight" not in wanted:
        return [f"{path} holds an untied model (a head.weight trained apart from embed.weight) but the recipe sets "
                "model.tie_embeddings = true: one tensor cannot be both, and the two differ, so tying would throw "
                "one away; set model.tie_embeddings = false"], {"head.weight"}
    return [], set()
