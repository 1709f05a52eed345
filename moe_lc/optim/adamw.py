"""AdamW (Loshchilov & Hutter, arXiv:1711.05101) on a ZeRO-1 shard: fp32 or bf16 moments, decoupled decay.

State per master element: exp_avg (m) and exp_avg_sq (v), fp32, or bf16 with precision.adam_moments =
"bf16" (DeepSeek-V3 3.3: the moments are updated in fp32 and stored rounded). One step, g the clipped
gradient, t the step:

    m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
    w = w (1 - lr wd)                    (not on the no-decay ranges)
    w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The state names are the checkpoint keys every moe_lc checkpoint has used (master / exp_avg / exp_avg_sq).

On CUDA with fp32 moments the step is torch's fused AdamW kernel (`_fused_adamw_`, the one
torch.optim.AdamW(fused=True) calls): one pass over master, grad and moments instead of about eight.
On an H100 the op-by-op step took 80 ms for 1.68B parameters (docs/results/gpu-h100). On CPU the
op-by-op formula stays the default (its results are the ones the CPU tests hold); `fused=True` runs
the kernel there too, which tests/test_optim.py holds to torch.optim.AdamW(fused=True) bit for bit.
"""

from __future__ import annotations

import math

import torch

from moe_lc.optim.rule import ShardView, StateSpec, UpdateRule, decay_


class AdamW(UpdateRule):
    name = "adamw"

    def __init__(self, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
                 moments_dtype: torch.dtype = torch.float32, fused: bool | None = None):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.moments_dtype = moments_dtype
        self.fused = fused  # None: the fused kernel on CUDA, the formula elsewhere
        # sqrt(v) and the denominator, alive together (the no-decay copy of the master is freed before them), and
        # fp32 copies of bf16 moments (the formula's temporaries; the fused kernel needs none, so on CUDA the
        # planner's figure is an upper bound)
        self.update_bytes_per_element = 8 + (8 if moments_dtype != torch.float32 else 0)

    @classmethod
    def from_config(cls, train, precision, model=None) -> "AdamW":
        return cls(train.beta1, train.beta2, train.eps, train.weight_decay,
                   torch.bfloat16 if precision.adam_moments == "bf16" else torch.float32)

    def states(self) -> tuple[StateSpec, ...]:
        return StateSpec("exp_avg", self.moments_dtype), StateSpec("exp_avg_sq", self.moments_dtype)

    @torch.no_grad()
    def update_(self, shard: ShardView, lr: float, step: int) -> None:
        fused = shard.master.is_cuda if self.fused is None else self.fused
        if fused and self.moments_dtype == torch.float32:
            return self._fused_update_(shard, lr, step)
        g, m, v = shard.grad, shard.state["exp_avg"], shard.state["exp_avg_sq"]
        beta1, beta2 = self.beta1, self.beta2
        if m.dtype == torch.float32:
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m32, v32 = m, v
        else:  # 16-bit moments: update in fp32, store rounded
            m32 = m.float().lerp_(g, 1 - beta1)
            v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m.copy_(m32), v.copy_(v32)
        decay_(shard.master, lr, self.weight_decay, shard.no_decay)
        denom = (v32.sqrt() / math.sqrt(1 - beta2 ** step)).add_(self.eps)
        shard.master.addcdiv_(m32, denom, value=-lr / (1 - beta1 ** step))

    def _fused_update_(self, shard: ShardView, lr: float, step: int) -> None:
        """The same step through torch's fused kernel: decayed and no-decay ranges as two lists of views."""
        n = shard.master.numel()
        keep = sorted((lo, hi) for lo, hi in shard.no_decay if hi > lo)
        decay, at = [], 0
        for lo, hi in keep:
            if lo > at:
                decay.append((at, lo))
            at = max(at, hi)
        if at < n:
            decay.append((at, n))
        step_t = torch.tensor(float(step), device=shard.master.device)  # the kernel reads it, never bumps it
        tensors = (shard.master, shard.grad, shard.state["exp_avg"], shard.state["exp_avg_sq"])
        for ranges, wd in ((decay, self.weight_decay), (keep, 0.0)):
            if ranges:
                p, g, m, v = ([t[lo:hi] for lo, hi in ranges] for t in tensors)
                torch._fused_adamw_(p, g, m, v, [], [step_t] * len(ranges), lr=lr, beta1=self.beta1,
                                    beta2=self.beta2, weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False)
