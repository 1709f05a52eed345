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
    aux_losses: {MoE layer: its sequence-wise balance loss (0-dim fp32, detached) of the latest forward
    that computed one}."""

    mtp_loss_sums: torch.Tensor | None = None
    aux_losses: dict = field(default_factory=dict)

    def add_mtp_losses(self, losses: list[torch.Tensor]) -> None:
        """Add one forward's per-depth summed MTP losses (D fp32 scalars)."""
        sums = torch.stack([x.detach().double() for x in losses])
        self.mtp_loss_sums = sums if self.mtp_loss_sums is None else self.mtp_loss_sums + sums
