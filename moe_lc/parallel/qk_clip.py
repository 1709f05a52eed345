"""QK-clip (Kimi K2, arXiv:2507.20534, section 2.1: MuonClip): after each optimizer step, every attention head
whose largest pre-softmax logit in the step exceeded tau gets its query / key weights rescaled by
gamma = tau / that max, so the same inputs would give at most tau. `train.qk_clip = tau` (0 = off); it
works with any update rule (K2 pairs it with Muon, whose updates grow logits fastest).

The statistic: each attention core already returns the log-sum-exp of every query's scaled scores (the
contract ring attention merges by), and lse >= the row's max logit, by at most log(keys the row sees). So
this file clips on the per-head max of lse over the step (`note_max_lse` in moe_lc/ops/attention.py
records it in the cores): a bound that is exact under every layout (the ring's merged lse is the full
row's), costs no extra pass, and clips a little early (up to log(S): 8.3 nats at 4K) rather than late.
The bound is what the metrics log (`attn/max_lse/layer<i>`, `attn/max_lse`).

Where the statistic lives: the cores of each rank record its local query heads (TP splits heads) over
its query rows (CP splits rows, DP splits batches); an all-reduce MAX over the attention parameters'
gradient group (dp x cp; DualPipe's mirror rank included) makes it the step's, so every replica rescales
alike. The rescaling is per kind (the attention registry's `qk_clip_rows`: GQA's and MLA's rules,
moe_lc/model/attention.py and mla.py): factors per row of the local weights, which ZeRO applies to
the fp32 master rows before its all-gather (moe_lc/parallel/zero/optimizer.py `row_scales`).

The rule reads the step's logits before its update, so the update can carry a head past tau until the
next step's clip; `train.qk_clip_guard` adds a guard that holds tau inside each forward
(moe_lc/parallel/qk_guard.py; its count of scaled (sample, head) pairs is `attn/qk_guard_hits`).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.config.attention_kinds import kind_of_module, load
from moe_lc.model.block import Block
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.qk_guard import GuardedCore, inner_core


def attention_sites(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer id, attention module) of every block in `model` (one rank's): `Block.layer_id`, the model's
    n_layers blocks and then its MTP blocks, the same on every pipeline stage."""
    return [(m.layer_id, m.attn) for m in model.modules() if isinstance(m, Block)]


def statistic_elems(model: nn.Module) -> int:
    """fp32 elements of the per-head statistic QK-clip all-reduces over dp x cp each step for `model` (one
    rank's modules): one per local query head of each attention module (the planner's bytes)."""
    return sum(m.n_heads for _, m in attention_sites(model))


class QKClip:
    """QK-clip over the attention modules of one rank's model (module docstring).

    Per step: `reset()` before the forward passes; `row_scales()` after backward, before the optimizer step,
    -> ({id(parameter): factor per row (rows,)} for ZeroOptimizer.step, metrics). group: the attention weights'
    gradient group; world: every rank (the per-layer metric); n_layers: the model's blocks (MTP after)."""

    def __init__(self, model: nn.Module, tau: float, group: Group, world: Group, n_layers: int, n_mtp: int = 0):
        self.tau, self.group, self.world = tau, group, world
        self.n_total = n_layers + n_mtp
        self.sites = []
        for layer, module in attention_sites(model):
            kind = kind_of_module(module)
            if kind.qk_clip_rows is None:
                raise ValueError(f"train.qk_clip: no rescaling rule for {kind.label} attention (layer {layer})")
            self.sites.append((layer, module, load(kind.qk_clip_rows)))
        for holder in self._holders():
            holder.max_lse_probe, holder.max_lse = True, None

    def _holders(self):
        """Where the step's lse is recorded: a module's core (dense attention, every ring), or the module
        itself (DeepSeek Sparse Attention's sparse stage calls its own kernel)."""
        for _, module, _ in self.sites:
            yield module
            yield inner_core(module)

    def _guards(self):
        """The forward guards of the sites (train.qk_clip_guard; moe_lc/parallel/qk_guard.py), if any: each on
        its guarded core (DSA's `logit_guard` is the same object)."""
        for _, module, _ in self.sites:
            if isinstance(module.core, GuardedCore):
                yield module.core.guard

    def reset(self) -> None:
        for holder in self._holders():
            holder.max_lse = None
        for guard in self._guards():
            guard.take_hits()

    def _site_max(self, module: nn.Module) -> torch.Tensor:
        """(H,) the per-head max lse this step recorded for `module` (-inf where it saw nothing)."""
        seen = [h.max_lse for h in (module, inner_core(module)) if h.max_lse is not None]
        if not seen:
            return torch.full((module.n_heads,), float("-inf"), device=module.wo.weight.device)
        return torch.stack(seen).amax(0)

    @torch.no_grad()
    def row_scales(self) -> tuple[dict, dict]:
        if not self.sites:
            return {}, {}
        stats = torch.stack([self._site_max(m) for _, m, _ in self.sites])  # (local layers, local heads)
        comm.all_reduce(stats, self.group, op=torch.distributed.ReduceOp.MAX)
        gamma = torch.where(stats > self.tau, self.tau / stats, torch.ones_like(stats))
        scales = {}  # every site's, factors of 1 included: exact (x * 1.0 == x), and no host sync to skip them
        for (_, module, rows), g in zip(self.sites, gamma):
            scales.update({id(p): f for p, f in rows(module, g).items()})
        per_layer = torch.full((self.n_total,), float("-inf"), device=stats.device)
        per_layer[[i for i, _, _ in self.sites]] = stats.amax(1)
        comm.all_reduce(per_layer, self.world, op=torch.distributed.ReduceOp.MAX)
        if per_layer.is_meta:  # the dry run counts the collectives, reads nothing
            return scales, {}
        values = per_layer.tolist()
        metrics = {f"attn/max_lse/layer{i}": v for i, v in enumerate(values)}
        metrics["attn/max_lse"] = max(values)
        guards = list(self._guards())
        if guards:  # this rank's count (a metric the logging rank writes), not reduced: no collective for it
            metrics["attn/qk_guard_hits"] = sum(g.take_hits() for g in guards)
        return scales, metrics
