"""Stage split: which layers form each pipeline stage, and the modules a rank keeps.

The model's blocks are cut into `n_stages` contiguous stages (stage 0 also holds the embedding,
the last stage the final norm, the output head and the loss; with model.tie_embeddings the last stage
holds the embedding module too, unused, so that the tied parameter has one name, embed.weight, on every
rank: parallel/tie.py sums its gradient over the copies). By default the cut balances the
training FLOPs per token of each block (moe_lc.model.counting, MLA included) plus the head's on the
last stage; a recipe can fix it with `parallel.pp_stage_layers`.

Words: a *stage* is a contiguous run of layers (stage ids count along the pipeline); a *chunk* is the
module a rank runs for one stage it holds (DualPipe and interleaved 1F1B give a rank two or more).
A rank keeps one chunk module per stage it holds and one "union" module holding all of its chunks'
blocks (`split_for_rank`), through which the optimizer, checkpoints and metrics see the
parameters under their single-device names (`layers.5.attn.wqkv.weight`), whatever the layout.
Chunk modules share their submodules with the union module: nothing is copied.
"""

from __future__ import annotations

import copy

from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.counting import block_train_flops_per_token
from moe_lc.model.transformer import Transformer
from moe_lc.parallel.pipeline.schedule_ir import Schedule


def layer_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Training FLOPs per token of each block (moe_lc.model.counting), for balancing stages."""
    return [block_train_flops_per_token(cfg, i, seq_len) for i in range(cfg.n_layers)]


def balanced_split(costs: list[float], n_stages: int, last_extra: float = 0.0) -> list[int]:
    """Layers per stage: contiguous, >= 1 each, minimizing the most expensive stage (exact DP)."""
    n = len(costs)
    if n < n_stages:
        raise ValueError(f"{n} layers cannot fill {n_stages} pipeline stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max-cost splitting the first i layers into s stages; cut[s][i]: last cut
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            extra = last_extra if s == n_stages else 0.0
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    sizes, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def stage_layers(cfg: ModelConfig, n_stages: int, seq_len: int, override: list[int] | None = None) -> list[list[int]]:
    """Layer ids of each stage (override: layers per stage, as the recipe's rules checked them)."""
    if override:
        assert len(override) == n_stages and sum(override) == cfg.n_layers and min(override) >= 1, override
        sizes = list(override)
    else:
        head = 2 * 3 * cfg.dim * cfg.vocab_size
        sizes = balanced_split(layer_costs(cfg, seq_len), n_stages, last_extra=head)
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def _shell(full: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """A Transformer object sharing `full`'s submodules, keeping only the given blocks."""
    shell = copy.copy(full)
    shell._modules = dict(full._modules)
    shell._parameters, shell._buffers = dict(full._parameters), dict(full._buffers)
    shell.layers = nn.ModuleDict({str(i): full.layers[str(i)] for i in layer_ids})
    if not first:  # a tied last stage keeps the embedding for its parameter's name (the head reads it)
        shell.takes_tokens = False
        if not (last and full.cfg.tie_embeddings):
            shell.embed = None
    if not last:  # the residual stream's read-out (mHC's HyperHead) belongs to the head's stage too
        shell.head, shell.norm, shell.loss_fn, shell.mtp, shell.mtp_embed = None, None, None, None, None
        shell.stream_head = None
    return shell


def split_for_rank(full: Transformer, schedule: Schedule, rank: int, layers: list[list[int]]):
    """(union module, [chunk module per local chunk], [stage ids held]) for `rank` under `schedule`."""
    stages_of_chunk = {}
    for route in schedule.routes:
        for stage, (r, chunk) in enumerate(route):
            if r == rank:
                stages_of_chunk[chunk] = stage
    last = schedule.n_stages - 1
    chunks = [_shell(full, layers[s], s == 0, s == last) for _, s in sorted(stages_of_chunk.items())]
    mine = sorted(stages_of_chunk.values())
    union = _shell(full, [i for s in mine for i in layers[s]], 0 in mine, last in mine)
    return union, chunks, mine  # a chunk with MTP and no embedding borrows it (the layer plan's mtp_embed)

