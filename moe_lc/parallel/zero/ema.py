"""The exponential moving average of the fp32 master weights (`train.ema_decay`), kept in CPU memory."""

from __future__ import annotations

import torch


class CpuEMA:
    """Exponential moving average of the fp32 master shards, in CPU memory (DeepSeek-V3 3.2.3: no device
    memory, no time on the step's critical path).

    shards[i] (n_i,) fp32 on the CPU mirrors a ZeRO master shard (the same 1/N slice, sharded like it);
    after each applied step `update` copies the masters into CPU staging buffers (non-blocking from a
    GPU, pinned memory) and a background thread applies ema = decay * ema + (1 - decay) * master once
    the copy has landed. `wait()` before reading or saving `shards`. Starts equal to the masters
    (`reset`), as after a fresh start, a weights-only load or a checkpoint without an EMA.
    """

    def __init__(self, masters: list[torch.Tensor], decay: float):
        from concurrent.futures import ThreadPoolExecutor

        pin = masters[0].is_cuda if masters else False
        self.decay = decay
        self.shards = [torch.empty(m.shape, dtype=torch.float32, pin_memory=pin) for m in masters]
        self._staging = [torch.empty(m.shape, dtype=torch.float32, pin_memory=pin) for m in masters]
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema")
        self._pending = None
        self.reset(masters)

    def reset(self, masters: list[torch.Tensor]) -> None:
        """ema = masters (blocking)."""
        self.wait()
        for e, m in zip(self.shards, masters):
            e.copy_(m)

    def update(self, masters: list[torch.Tensor]) -> None:
        self.wait()  # the staging buffers are free again
        for staged, m in zip(self._staging, masters):
            staged.copy_(m, non_blocking=True)
        landed = None
        if masters and masters[0].is_cuda:
            landed = torch.cuda.Event()
            landed.record()
        self._pending = self._worker.submit(self._apply, landed)

    def _apply(self, landed) -> None:
        if landed is not None:
            landed.synchronize()
        for e, staged in zip(self.shards, self._staging):
            e.lerp_(staged, 1.0 - self.decay)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

