"""Optimizer offloading (`parallel.placement.optimizer = "offloaded"`): ZeRO's fp32 master and the update
rule's state live in host memory and the update runs on the CPU.

Per ZeRO group of a rank (zero.py's ShardedParams, n = its shard's elements), in host memory (pinned on
a GPU machine, so the copies are asynchronous DMA):

    master, state[...]  (n,)  the rule's tensors, as on the device otherwise (checkpoints are unchanged)
    grad_host           (n,)  fp32: the reduced, clipped gradient shard, copied down each step
    param_host          (n,)  compute dtype: the updated master, cast, on its way up

The reduce-scatter's output (`grad_shard`) and the grad norm stay on the device. A step, bucket by bucket
in buffer order: every bucket's gradient shard is queued for the host at once (one event each); then for
each bucket: wait for its copy, the rule's update on its slice (`ShardView.part`) on the CPU's threads,
QK-clip's row factors, the cast into `param_host`, the copy into the device's parameter buffer, and the
bucket's all-gather launched. The CPU's update of bucket k thus overlaps bucket k+1's download and bucket
k-1's upload and all-gather. PCIe bytes per step: 4 B down and the compute dtype's bytes up per shard
element (`transfer_bytes`, what the planner books).

Values: the rule computes on the same fp32 numbers as on the device and an elementwise rule's parts are
its whole, so on a CPU the result is bit for bit the device placement's (tests/test_optimizer_offload.py);
on a GPU the CPU's AdamW formula replaces torch's fused CUDA kernel (fp32 rounding apart). Muon runs its
Newton-Schulz on the CPU too (fp32 there: `train.muon_ns_dtype` auto), gathering TP slices on the device.
Not done: overlapping the update with the next step's forward (DeepSpeed's ZeRO-Offload delays the
parameters by one step to do it, which changes the training math).

On the meta device (the planner's trace, the dry run) the host tensors are meta too; `host_work`
contexts let the trace count what the CPU update allocates as host memory, not the device's.
"""

from __future__ import annotations

import contextlib

import torch

_HOST_WORK: list = []  # context factories the dry run enters around host-side work (`host_work`)


@contextlib.contextmanager
def host_work(context_factory):
    """Within: each offloaded update's CPU work runs inside context_factory() (the dry run's trace)."""
    _HOST_WORK.append(context_factory)
    try:
        yield
    finally:
        _HOST_WORK.pop()


@contextlib.contextmanager
def _on_host():
    with contextlib.ExitStack() as stack:
        for factory in _HOST_WORK:
            stack.enter_context(factory())
        yield


def host_device(device: torch.device) -> torch.device:
    """Where host-memory state of parameters on `device` lives: the CPU, or meta in a trace."""
    return device if device.type == "meta" else torch.device("cpu")


def host_empty(n: int, dtype: torch.dtype, device: torch.device, fill: float | None = None) -> torch.Tensor:
    """(n,) host tensor for parameters on `device`: pinned when that is a GPU (asynchronous copies)."""
    out = torch.empty(n, dtype=dtype, device=host_device(device), pin_memory=device.type == "cuda")
    return out if fill is None else out.fill_(fill)


class HostOptimizer:
    """One ShardedParams group's host staging and its bucket-by-bucket step (module docstring)."""

    def __init__(self, shard, compute_dtype: torch.dtype):
        self.shard = shard
        device = shard.device
        n = shard.grad_shard.numel()
        self.grad_host = host_empty(n, torch.float32, device, fill=0.0)
        self.param_host = host_empty(n, compute_dtype, device)
        self.sent = {"d2h": 0, "h2d": 0}  # bytes copied each way since construction (tests, the planner)

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.grad_host, self.param_host))

    @torch.no_grad()
    def step_(self, rule, lr: float, step: int, row_scales: dict | None) -> None:
        """The step of a group whose reduced gradient shard is clipped (ShardedParams.step_)."""
        s = self.shard
        landed = []
        for b in s.buckets:
            part = slice(b.shard_start, b.shard_start + b.shard_size)
            self.grad_host[part].copy_(s.grad_shard[part], non_blocking=True)
            landed.append(_event_after_copy(s.grad_shard))
            self.sent["d2h"] += b.shard_size * 4
        works = []
        for b, event in zip(s.buckets, landed):
            if event is not None:
                event.synchronize()
            lo, hi = b.shard_start, b.shard_start + b.shard_size
            with _on_host():
                rule.update_(s.view.part(lo, hi), lr, step)
                if row_scales:
                    s.scale_bucket_rows_(b, row_scales)
                self.param_host[lo:hi].copy_(s.master[lo:hi])
            works.append(s.publish(b, self.param_host[lo:hi]))
            self.sent["h2d"] += b.shard_size * self.param_host.element_size()
        for w in works:
            if w is not None:
                w.wait()


def _event_after_copy(device_tensor: torch.Tensor):
    """A CUDA event recorded after the copy just queued on the current stream (None off CUDA: copies there
    are synchronous)."""
    if not device_tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def transfer_bytes(shard_elems: int, compute_bytes: int) -> dict[str, int]:
    """PCIe bytes per step of a group's offloaded optimizer: its fp32 gradient shard down, the updated
    parameters up in the compute dtype."""
    return {"d2h": 4 * shard_elems, "h2d": compute_bytes * shard_elems}
