"""One training step's timeline, per rank (`train.trace_step = N`): what computed when, and when every
collective was issued, done and waited for. Written to <output_dir>/timeline/rank<R>.json and drawn by
tools/timeline.py beside the pipeline simulator's prediction for the same measured costs.

File layout (times in seconds from the start of the traced step, time.perf_counter() based):

    rank, coords {pp, dp, cp, tp, ep}, step, schedule, overlap, link
    step      [start, end] of the whole optimizer step (data, forward/backward, optimizer)
    pipeline  [start, end] of the pipeline schedule's run (absent without a pipeline)
    phases    [kind "F" | "B" | "W", label "stage S mb M", "index:name" of the phase, start, end]: every forward and
              backward phase a pipeline ran (W: a deferred weight-gradient pass)
    actions   [kind "F" | "B" | "W" | "FB" | "CommGroup", trace entry, start, end]: the schedule's actions
    comm      [group, op, issued, done, wait start, wait end]: every collective of a CPU group (done
              includes the modelled link; a wait that ends after `done` only woke up late)
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path


@contextlib.contextmanager
def traced_step(trainer, on: bool):
    """Record the step run inside when `on` (every rank writes its own file)."""
    if not on:
        yield
        return
    counter, runtime = trainer.dims.counter, trainer.runtime
    counter.timeline = []
    if runtime is not None:
        runtime.timeline = []
    start = time.perf_counter()
    try:
        yield
        end = time.perf_counter()
        _write(trainer, start, end, counter.timeline, runtime.timeline if runtime is not None else None)
    finally:
        counter.timeline = None
        if runtime is not None:
            runtime.timeline = None


def _write(trainer, start: float, end: float, comm: list, pipeline: list | None) -> None:
    cfg = trainer.cfg
    rel = lambda t: round(t - start, 6)  # noqa: E731
    record = {"rank": trainer.dims.rank, "coords": trainer.dims.coords(), "step": trainer.step + 1,
              "schedule": cfg.parallel.pp_schedule if trainer.runtime is not None else None,
              "pp": cfg.parallel.pp, "microbatches": trainer.microbatches, "overlap": cfg.parallel.overlap,
              "link": cfg.parallel.link, "step_interval": [0.0, rel(end)],
              "comm": [[g, op, rel(a), rel(b), rel(c), rel(d)] for g, op, a, b, c, d in comm]}
    if pipeline is not None:
        record["phases"] = [[k, label, i, rel(a), rel(b)] for k, label, i, a, b in pipeline if k in "FBW"]
        record["actions"] = [[k, list(map(str, entry)), rel(a), rel(b)] for tag, k, entry, a, b in
                             (e for e in pipeline if e[0] == "action")]
        record["pipeline"] = next([rel(a), rel(b)] for tag, _, _, a, b in pipeline if tag == "step")
    out = Path(cfg.train.output_dir) / "timeline"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.dims.rank}.json").write_text(json.dumps(record))
