"""What a step's training forwards report besides the loss, for the step's metrics.

The trainer makes one `ForwardStats` per optimizer step and passes it to every forward (`Transformer`
forward or phases, down to the blocks and MTP modules); the forwards add to it, and the trainer reads it
once the backward is done. Nothing is kept on the modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardStats:
    """mtp_loss_sums: (D,) fp64, detached: each MTP depth's summed token loss over the step's micro-batches
    on this rank (None until a forward with MTP targets ran).
    aux_losses: {MoE layer: its weighted auxiliary losses summed (0-dim fp32, detached; this rank's share,
    balance_losses.py) of the latest forward that computed one}. The step's metrics of each loss come
    from `routing`, summed over the step and the mesh.
    routing: {Router: {count: this rank's sum over the step's micro-batches}}, detached, on the router's
    device, booked once per micro-batch forward (moe.py, `MoE.dispatch_phase`): "loads" (E,) fp32 token
    copies routed to each expert (dropped ones included), "losses" (3,) fp32 the weighted auxiliary losses'
    shares (balance_losses.LOSS_NAMES order, zero where off), "dropped" () fp32 the copies dropped over
    capacity, "spread" (N + 4,) fp64 the expert-parallel dispatcher's counters (parallel/ep/dispatch.py); a
    count a forward did not make is absent. The trainer reads them after the backward
    (moe_lc/job/step.py: the load metrics and the routers' bias update).
    n_sources: data sources to book the next-token loss by (0: not booked); source_losses: (2, n_sources)
    fp64, each source's summed token loss and its token count over this rank's rows (zeros on a rank
    without the head).
    dsa: (3,) fp64, the DeepSeek Sparse Attention indexer losses of the step on this rank: summed per-token KL,
    summed attention mass on the indexer's top-k (warm-up stage), query tokens x layers; each rank's share
    (1/tp on tp ranks that hold the same rows); booked in backward (moe_lc/model/dsa.py)."""

    mtp_loss_sums: torch.Tensor | None = None
    dsa: torch.Tensor | None = None
    aux_losses: dict = field(default_factory=dict)
    routing: dict = field(default_factory=dict)
    n_sources: int = 0
    source_losses: torch.Tensor | None = None

    def add_mtp_losses(self, losses: list[torch.Tensor]) -> None:
        """Add one forward's per-depth summed MTP losses (D fp32 scalars)."""
        sums = torch.stack([x.detach().double() for x in losses])
        self.mtp_loss_sums = sums if self.mtp_loss_sums is None else self.mtp_loss_sums + sums

    def add_routing(self, router, **counts: torch.Tensor) -> None:
        """Add one forward's routing counts of `router` (names and shapes: see `routing`)."""
        row = self.routing.setdefault(router, {})
        for name, value in counts.items():
            row[name] = value if name not in row else row[name] + value

    def add_dsa(self, kl_sum: torch.Tensor, mass_sum: torch.Tensor, count: float) -> None:
        """Add one DSA layer's indexer-loss sums of one micro-batch (see `dsa`; on their device: no host sync)."""
        row = torch.stack([kl_sum.double(), mass_sum.double(), torch.full((), float(count), dtype=torch.float64,
                                                                         device=kl_sum.device)])
        self.dsa = row if self.dsa is None else self.dsa + row

    def add_source_losses(self, loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor | None,
                          sources_B: torch.Tensor) -> None:
        """Book one forward's per-token losses (B, S_local) by their rows' source (B,) int64."""
        if not self.n_sources:
            return
        weight_BS = torch.ones_like(loss_BS) if loss_mask_BS is None else loss_mask_BS.to(loss_BS.dtype)
        rows_2B = torch.stack([(loss_BS * weight_BS).sum(1), weight_BS.sum(1)]).double()
        if self.source_losses is None:
            self.source_losses = torch.zeros(2, self.n_sources, dtype=torch.float64, device=loss_BS.device)
        self.source_losses.index_add_(1, sources_B.to(loss_BS.device), rows_2B)
