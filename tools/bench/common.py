"""Shared pieces of the benchmark suite (`tools/bench/run.py`): timing, device facts, peak FLOP/s, results.

Timing (`time_fn`): `warmup` untimed calls, then up to `iters` timed calls, stopping early once `max_s`
seconds have been spent (after at least `min_iters`). On a GPU each call is bracketed by CUDA events
(device time of the work the call enqueues, launch gaps included); on CPU by time.perf_counter. We
report the median (and min / mean / n): robust to the odd slow call (allocator growth, clock ramp).

Throughput: TFLOP/s = FLOPs / median seconds / 1e12, with each part's FLOP formula in its docstring.
Peaks are NVIDIA's dense (no sparsity) datasheet figures, from the trainer's table
(`moe_lc.job.metrics.PEAK_TFLOPS`): H100 SXM / H800 / H200 989 TFLOP/s bf16, 1979 fp8; H100 PCIe 756;
H100 / H200 NVL 835.

Results: every measurement is one entry (a flat dict) with `status` "ok", "error" (OOM, unsupported
kernel, ...: `error` holds the reason and the run goes on) or "skipped" (`reason`). `Recorder` prints
one progress line per measurement; `write_json` / `write_markdown` write the results.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moe_lc.job.metrics import peak_tflops_of

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

def peak_tflops(device_name: str) -> dict[str, float] | None:
    """{"bf16": ..., "fp8": ...} dense TFLOP/s for a GPU name (the trainer's MFU table,
    moe_lc.job.metrics.PEAK_TFLOPS: SXM / PCIe / NVL told apart), None when unknown (CPU)."""
    table = peak_tflops_of(device_name)
    return None if table is None else {"bf16": table["bf16"], "fp8": table["fp8"]}


@dataclass
class Timing:
    warmup: int = 3
    iters: int = 20
    min_iters: int = 3
    max_s: float = 2.0


@dataclass
class Context:
    """What every part needs: device, mode, timing settings, recipes and the peak FLOP/s table."""

    device: torch.device
    dry_run: bool = False
    quick: bool = False
    profile: bool = False
    timing: Timing = field(default_factory=Timing)
    recipes: list[str] = field(default_factory=list)
    model_sets: list[str] = field(default_factory=list)
    peak: dict[str, float] | None = None
    work_dir: Path | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, timing: Timing) -> dict:
    """Median seconds of fn() (see the module docstring) -> {"s", "min_s", "mean_s", "n"}."""
    for _ in range(timing.warmup):
        fn()
    sync(device)
    times: list[float] = []
    spent, n_max = 0.0, max(timing.iters, timing.min_iters)
    while len(times) < n_max and (len(times) < timing.min_iters or spent < timing.max_s):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return {"s": statistics.median(times), "min_s": min(times), "mean_s": statistics.fmean(times), "n": len(times)}


def memory_mark(device: torch.device) -> int:
    """Reset the peak counter; returns the bytes allocated now (0 on CPU)."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_bytes_since(device: torch.device, mark: int) -> int | None:
    """Peak bytes allocated above `mark` since memory_mark (None on CPU)."""
    return torch.cuda.max_memory_allocated(device) - mark if device.type == "cuda" else None


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 else float("nan")


def is_oom(exc: BaseException) -> bool:
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    return isinstance(exc, oom_types) or "out of memory" in str(exc).lower() or "ALLOC_FAILED" in str(exc)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ device facts


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({platform.processor() or 'unknown'})"


def _importable(module: str) -> str | None:
    """The module's (or its top package's) version if it imports, else None."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return None
    top = importlib.import_module(module.split(".")[0])
    return str(getattr(mod, "__version__", None) or getattr(top, "__version__", None) or "present")


def device_facts(device: torch.device) -> dict:
    """Device, software versions and which fast backends this process can use."""
    from moe_lc.ops import fp8
    from moe_lc.ops.attention import available_backends

    facts = {"device": device_name(device), "device_type": device.type, "torch": torch.__version__,
             "cuda": torch.version.cuda, "python": platform.python_version(),
             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
             "date": _dt.date.today().isoformat(), "started": _dt.datetime.now().isoformat(timespec="seconds"),
             "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                     memory_gib=round(props.total_memory / 2**30, 1))
    facts["backends"] = {"attention": available_backends(device), "flash_attn": _importable("flash_attn.flash_attn_interface"),
                         "flash_attn4": _importable("flash_attn.cute"),
                         "transformer_engine": _importable("transformer_engine"),
                         "fp8_tensorwise": fp8.scaled_mm_backend(device, "tensorwise"),
                         "fp8_blockwise": fp8.scaled_mm_backend(device, "blockwise"),
                         "torch._grouped_mm": hasattr(torch, "_grouped_mm")}
    facts["peak_tflops"] = peak_tflops(facts["device"]) if device.type == "cuda" else None
    return facts


# ------------------------------------------------------------------------------ recording


class Recorder:
    """Collects one part's entries; `measure` runs one measurement, guarded, and prints its line.
    `on_entry()` runs after every entry (run.py rewrites the JSON there)."""

    def __init__(self, part: str, device: torch.device, on_entry: Callable[[], None] | None = None):
        self.part, self.device, self.on_entry = part, device, on_entry
        self.entries: list[dict] = []
        self.start = time.perf_counter()
        self._dirty = False  # an error was recorded inside a caller's except block: free memory later

    def note(self, text: str) -> None:
        print(f"[{self.part} {time.perf_counter() - self.start:6.1f}s] {text}", flush=True)

    def _add(self, params: dict, entry: dict, text: str) -> dict:
        self.entries.append(entry)
        self.note(" ".join(f"{k}={v}" for k, v in params.items()) + f" | {text}")
        if self.on_entry is not None:
            self.on_entry()
        return entry

    @staticmethod
    def _error(params: dict, exc: BaseException) -> dict:
        return {**params, "status": "error", "error": f"{type(exc).__name__}: {str(exc).strip()[:500]}",
                "error_where": _where(exc), "oom": is_oom(exc)}

    def measure(self, params: dict, fn: Callable[[], dict], line: Callable[[dict], str] | None = None) -> dict:
        """entry = params + fn()'s metrics, status "ok"; any exception becomes status "error"."""
        if self._dirty:
            free_memory(self.device)
            self._dirty = False
        try:
            entry = {**params, **fn(), "status": "ok"}
        except Exception as exc:  # noqa: BLE001 - one failure must not end the run
            entry = self._error(params, exc)
        if entry["status"] == "error":  # out of the except block: the failed frames are gone
            free_memory(self.device)
            return self._add(params, entry, f"ERROR {entry['error'][:200]}")
        return self._add(params, entry, line(entry) if line else "ok")

    def fail(self, params: dict, exc: BaseException) -> dict:
        """Record an exception the caller caught (e.g. allocating a part's inputs) as an error entry."""
        self._dirty = True
        entry = self._error(params, exc)
        return self._add(params, entry, f"ERROR {entry['error'][:200]}")

    def skip(self, params: dict, reason: str) -> dict:
        return self._add(params, {**params, "status": "skipped", "reason": reason}, f"skipped: {reason}")


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame in our code (moe_lc or tools), for error entries."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "moe_lc" in f.filename or "tools" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno}"


# ------------------------------------------------------------------------------ writing


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    return value


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as a bench's meta records them before and after its runs."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def write_json(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(results), indent=1))
    tmp.replace(path)


def _fmt(value, spec: str | None) -> str:
    if value is None:
        return ""
    if spec and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return spec.format(value)
        except (ValueError, TypeError):
            pass
    return str(value).replace("|", "/")


def markdown_table(entries: list[dict], columns: list[tuple[str, str, str | None]]) -> list[str]:
    """Rows of `entries` under `columns` (key, header, format spec); a status column at the end."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " | status |",
             "|" + "---|" * (len(columns) + 1)]
    for e in entries:
        status = e.get("status", "?")
        if status == "error":
            status = "ERROR " + str(e.get("error", ""))[:90].replace("|", "/").replace("\n", " ")
        elif status == "skipped":
            status = "skipped: " + str(e.get("reason", ""))[:90].replace("|", "/")
        lines.append("| " + " | ".join(_fmt(e.get(k), spec) for k, _, spec in columns) + f" | {status} |")
    return lines


def write_markdown(path: Path, results: dict, renderers: dict) -> None:
    """renderers: part -> (columns, extra(entries) -> list of markdown lines, or None)."""
    m, b = results["meta"], results["meta"].get("backends", {})
    gpu = f" (sm {m['capability']}, {m['sm_count']} SMs, {m['memory_gib']} GiB)" if "capability" in m else ""
    dry = " -- DRY RUN, tiny shapes on CPU: the numbers mean nothing" if m.get("dry_run") else ""
    lines = [f"# moe_lc benchmarks: {m['device']}", "", f"- device: {m['device']}{gpu}",
             f"- torch {m['torch']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, Python {m['python']}",
             f"- date: {m['date']} (started {m['started']}){dry}",
             f"- attention backends: {', '.join(b.get('attention', []))}; flash-attn 2: "
             f"{b.get('flash_attn') or 'absent'}; flash-attn-4: {b.get('flash_attn4') or 'absent'}; "
             f"Transformer Engine: {b.get('transformer_engine') or 'absent'}",
             f"- fp8 tensorwise: {b.get('fp8_tensorwise')}; fp8 blockwise: {b.get('fp8_blockwise')}; "
             f"torch._grouped_mm: {b.get('torch._grouped_mm')}",
             f"- peak dense TFLOP/s used for %-of-peak and MFU: {m.get('peak_tflops')}", ""]
    for part, body in results["parts"].items():
        entries = body.get("entries", [])
        n_err = sum(e.get("status") == "error" for e in entries)
        state = "PARTIAL (cut short), " if body.get("partial") else ""
        lines += [f"## {part}", "", f"{state}{len(entries)} measurements, {n_err} errors, "
                  f"{body.get('wall_s', 0):.0f} s.", ""]
        if body.get("error"):
            lines += [f"**part failed:** {body['error']}", ""]
        columns, extra = renderers.get(part, (None, None))
        if columns:
            lines += markdown_table(entries, columns) + [""]
        if extra:
            lines += extra(entries) + [""]
    path.write_text("\n".join(lines))
