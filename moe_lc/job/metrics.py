"""Run metrics: metrics.jsonl (every step), the same scalars to the loggers of `train.loggers`
(TensorBoard, Weights & Biases), a console progress line, MFU.

Only the logging rank (global rank 0) writes; the others keep a no-op logger. metrics.jsonl is the
record; a logger is a sink with `log(step, scalars)` and `close()`, built by `make_sinks`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from moe_lc.model.counting import train_flops_per_token, train_flops_with_documents

# Dense (no sparsity) peak TFLOP/s per GPU and compute precision, from NVIDIA's datasheets (their
# sparse figures halved); "fp32" is the TF32 tensor-core rate an fp32 run's matmuls get. Matched as
# fragments of torch.cuda.get_device_name, most specific first: a PCIe or NVL H100 / H200 has lower
# clocks and power than the SXM part ("NVIDIA H100 80GB HBM3"), and "H20" is a prefix of "H200".
PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "fp32": 378.0}),
    ("H100 NVL", {"bf16": 835.0, "fp8": 1671.0, "fp32": 418.0}),
    ("H200 NVL", {"bf16": 835.0, "fp8": 1671.0, "fp32": 418.0}),
    ("GH200", {"bf16": 989.0, "fp8": 1979.0, "fp32": 494.0}),
    ("H200", {"bf16": 989.0, "fp8": 1979.0, "fp32": 494.0}),
    ("H100", {"bf16": 989.0, "fp8": 1979.0, "fp32": 494.0}),  # SXM
    ("H800", {"bf16": 989.0, "fp8": 1979.0, "fp32": 494.0}),
    ("H20", {"bf16": 148.0, "fp8": 296.0, "fp32": 74.0}),
    ("A100", {"bf16": 312.0, "fp8": 312.0, "fp32": 156.0}),  # no FP8 units: fp8 recipes run bf16 math
    ("B200", {"bf16": 2250.0, "fp8": 4500.0, "fp32": 1100.0}),
)


def peak_tflops_of(device_name: str) -> dict[str, float] | None:
    """{"bf16", "fp8", "fp32"} dense TFLOP/s for a GPU name, None when unknown."""
    for fragment, table in PEAK_TFLOPS:
        if fragment in device_name:
            return dict(table)
    return None


def peak_flops(device: torch.device, recipe: str, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device for MFU; None when unknown (CPU without an override)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    table = peak_tflops_of(torch.cuda.get_device_name(device))
    return None if table is None else table[recipe] * 1e12


class StepRow:
    """The trainer's own metrics of one optimizer step, before the step's (`StepResult.metrics`): loss, lr,
    grad norm, throughput, the skipped-update count and, where the device's peak FLOPs are known, MFU over
    the world (under packed documents with the attention work the step really did, "attn/doc_work")."""

    def __init__(self, cfg, device: torch.device, world: int):
        t = cfg.train
        self.model_cfg, self.seq_len, self.tokens, self.world = cfg.model, t.seq_len, t.global_batch * t.seq_len, world
        self.flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
        self.peak = peak_flops(device, cfg.precision.recipe, t.peak_tflops)

    def __call__(self, step, lr: float, elapsed: float, skipped: int) -> dict:
        """step: the StepResult (moe_lc/job/step.py); elapsed: its seconds; skipped: updates skipped so far."""
        metrics = {"loss": step.loss, "lr": lr, "grad_norm": step.grad_norm, "tokens_per_s": self.tokens / elapsed,
                   "step_time": elapsed, "skipped_steps": skipped}
        if self.peak:
            work = step.metrics.get("attn/doc_work")
            flops = (self.flops_per_token * self.tokens if work is None else
                     train_flops_with_documents(self.model_cfg, self.seq_len, self.tokens, work))
            metrics["mfu"] = flops / elapsed / (self.peak * self.world)
        metrics.update(step.metrics)
        return metrics


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class TensorBoardSink:
    """<dir>/tb/ event files. `purge_step` (a resumed run's first step) hides the events an interrupted
    run logged from that step on, as metrics.jsonl drops them."""

    def __init__(self, out: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tb"), purge_step=purge_step)

    def log(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def import_wandb():
    """The wandb module, imported only when a recipe asks for it; ConfigError naming the extra if absent."""
    from moe_lc.config import ConfigError

    try:
        import wandb
    except ImportError as exc:
        raise ConfigError([(f"train.loggers includes 'wandb', but the wandb package is not importable ({exc}): "
                            "pip install -e '.[wandb]'")]) from None
    return wandb


class WandbSink:
    """A Weights & Biases run: the same scalars as metrics.jsonl each step, the resolved recipe as its
    config, named after output_dir, its files in output_dir/wandb/. Its id is the run directory's run id,
    so a resumed run continues the same W&B run (W&B ignores steps below the newest it holds: steps run
    again after a resume keep their first values there; metrics.jsonl is the record)."""

    def __init__(self, out: Path, train_cfg, recipe: dict, run_id: str | None):
        self.wandb = wandb = import_wandb()
        mode = os.environ.get("WANDB_MODE") or train_cfg.wandb_mode
        self.run = wandb.init(project=train_cfg.wandb_project, name=out.resolve().name, dir=str(out),
                              config=recipe, id=run_id, resume="allow" if run_id else None, mode=mode)

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        if hasattr(self.wandb, "teardown"):  # flush and stop W&B's service now: a torchrun rank leaves by os._exit
            self.wandb.teardown()


LOGGERS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}  # keys: TrainConfig.loggers' choices


def make_sinks(train_cfg, out: Path, recipe: dict, run_id: str | None, purge_step: int | None) -> list:
    """The loggers of `train.loggers` for the logging rank (`recipe`: the resolved recipe as a dict)."""
    out.mkdir(parents=True, exist_ok=True)
    sinks = []
    for name in dict.fromkeys(train_cfg.loggers):
        if name == "wandb":
            sinks.append(WandbSink(out, train_cfg, recipe, run_id))
        else:
            sinks.append(LOGGERS[name](out, purge_step))
    return sinks


class MetricsLogger:
    """Writes one JSON object per step to <dir>/metrics.jsonl and the same scalars to each sink
    (default: TensorBoard in <dir>/tb/). `resume` appends to metrics.jsonl instead of replacing it."""

    def __init__(self, output_dir: str | Path, enabled: bool, total_steps: int, log_interval: int,
                 resume: bool = False, sinks: list | None = None):
        self.enabled, self.total_steps, self.log_interval = enabled, total_steps, log_interval
        self.sinks, self.file = [], None
        self.start = time.perf_counter()
        self.first_step: int | None = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.sinks = [TensorBoardSink(out)] if sinks is None else list(sinks)
        self.file = open(out / "metrics.jsonl", "a" if resume else "w")

    def log(self, step: int, metrics: dict) -> None:
        """`step` is 1-based (the number of optimizer steps done)."""
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.start = step - 1, time.perf_counter() - metrics.get("step_time", 0.0)
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for sink in self.sinks:
            sink.log(step, scalars)
        if step % self.log_interval == 0 or step == self.total_steps or step == 1:
            self._print(step, record)

    def _print(self, step: int, r: dict) -> None:
        done = step - (self.first_step or 0)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}",
                 f"gnorm {r['grad_norm']:.3f}", f"{r['tokens_per_s']:,.0f} tok/s"]
        if r.get("mfu") is not None:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        if r.get("moe/imbalance_max") is not None:
            parts.append(f"moe max/mean {r['moe/imbalance_max']:.2f}")
        if r.get("moe/dropped_fraction_max") is not None:  # model.moe.capacity_factor: the worst layer's share
            parts.append(f"dropped {r['moe/dropped_fraction_max']:.1%}")
        parts += [f"{r['step_time']:.2f} s/step", f"eta {_fmt_duration(eta)}"]
        print(" | ".join(parts), file=sys.stdout, flush=True)

    def event(self, text: str) -> None:
        """A one-off line (checkpoint saved, resumed, skipped step) on the console."""
        if self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        """Close metrics.jsonl and every sink (idempotent: an interrupted run closes in a finally)."""
        if self.enabled and self.file is not None and not self.file.closed:
            self.file.close()
            for sink in self.sinks:
                sink.close()


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    return v
