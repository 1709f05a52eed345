"""Ablation runner: one training run per combination of grid values, then a table and loss curves.

    python tools/ablate.py RECIPE --grid KEY=V1,V2 [--grid KEY=...] [--set KEY=VALUE ...] --out DIR
                           [--nproc N] [--quiet] [--rerun-changed]

Every combination of the --grid values (the cartesian product, in the order given) runs
sequentially as `python -m moe_lc.train RECIPE --set ...` (through torchrun when --nproc > 1) with
its own output directory DIR/<run-name>/ (train.log, metrics.jsonl, checkpoints, ablate_run.json).
Afterwards DIR/results.csv and DIR/results.md list per run: status, steps, final and minimum loss,
median tokens/s and wall time; DIR/loss_curves.png overlays the loss curves.

Resumable: a combination whose metrics.jsonl already holds every step is skipped; an unfinished one
runs again with checkpoint.resume=true (continuing from its newest checkpoint, if it saved any; the
trainer restarts one that died before its first save). Each run's settings (recipe, grid point,
--set) are kept in its ablate_settings.json: rerun into the same DIR with other settings, the runs
they change are refused (exit status 2, one line naming them and the keys) unless --rerun-changed
moves them to DIR/_stale/ and trains them anew (tools/ablate_settings.py). So ablate never starts a
fresh run over a used directory, and never needs train.overwrite. A run that fails (bad value, a
feature the trainer refuses, a crash) is reported with its error and the others continue; the exit
status is 1 when any run failed. List values in a grid are written in brackets:
--grid data.synthetic_tasks=[passkey],[passkey,variable_tracking].
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/ablate.py` from a checkout: run as tools.ablate
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.ablate", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import csv
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from moe_lc.config import ConfigError, load_config

from . import ablate_settings as settings
from .ablate_plot import plot_losses
from moe_lc.job.out_path import out_dir

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = ("run", "status", "steps", "final_loss", "min_loss", "tokens_per_s", "wall_s", "error")


@dataclass
class Combo:
    """One grid point: its run name and the --set overrides it adds."""

    name: str
    values: dict[str, str]

    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values.items()]


@dataclass
class RunResult:
    combo: Combo
    status: str  # ok | failed | invalid | incomplete | not run
    steps: int = 0
    final_loss: float = math.nan
    min_loss: float = math.nan
    tokens_per_s: float = math.nan
    wall_s: float = math.nan
    error: str = ""
    losses: list[tuple[int, float]] = field(default_factory=list)

    def row(self) -> dict:
        return {"run": self.combo.name, **self.combo.values, "status": self.status, "steps": self.steps,
                "final_loss": self.final_loss, "min_loss": self.min_loss, "tokens_per_s": self.tokens_per_s,
                "wall_s": self.wall_s, "error": self.error}


# ---------------------------------------------------------------------------------------------
# grid


def split_values(text: str) -> list[str]:
    """'a,b' -> ['a', 'b']; commas inside [...] or quotes do not split ('[x,y],[z]' -> ['[x,y]', '[z]'])."""
    out, cur, depth, quote = [], "", 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """['train.lr=1e-3,3e-3', ...] -> [('train.lr', ['1e-3', '3e-3']), ...]; ValueError names the bad item."""
    grid, seen = [], set()
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        values = split_values(text) if sep else []
        if not sep or "." not in key or not all(values):
            raise ValueError(f"--grid {item!r}: expected SECTION.KEY=V1,V2,... (e.g. train.lr=1e-3,3e-3)")
        if key in seen:
            raise ValueError(f"--grid {item!r}: key {key} is given twice")
        seen.add(key)
        grid.append((key, values))
    return grid


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_") or "x"


def combinations(grid: list[tuple[str, list[str]]]) -> list[Combo]:
    """The cartesian product, first key outermost. Names use the last key component (the full key
    when two grid keys share it): 'lr=1e-3__score_func=softmax'."""
    if not grid:
        return [Combo("base", {})]
    short = [k.rsplit(".", 1)[-1] for k, _ in grid]
    labels = [s if short.count(s) == 1 else k for s, (k, _) in zip(short, grid)]
    out = []
    for values in itertools.product(*(v for _, v in grid)):
        name = "__".join(_safe(f"{label}={v}") for label, v in zip(labels, values))
        out.append(Combo(name, {k: v for (k, _), v in zip(grid, values)}))
    return out


# ---------------------------------------------------------------------------------------------
# running


def read_metrics(path: Path) -> dict[int, dict]:
    """{step: record} from a metrics.jsonl (a resumed run re-logs steps: the last record wins)."""
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                records[int(rec["step"])] = rec
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed run
    return records


def is_complete(run_dir: Path, steps: int) -> bool:
    return set(range(1, steps + 1)) <= set(read_metrics(run_dir / "metrics.jsonl"))


def command(recipe: str, overrides: list[str], nproc: int) -> list[str]:
    sets = [x for o in overrides for x in ("--set", o)]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "moe_lc.train", recipe, *sets]
    return [sys.executable, "-m", "moe_lc.train", recipe, *sets]


_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b:?.*)$")


def _error_line(log: str) -> str:
    """The most telling line of a failed run's output: the trainer's "error: ..." (a ConfigError
    lists its rules on the following "  - " lines), else the first exception raised in a rank (not
    torchrun's ChildFailedError summary), else the last line."""
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if re.match(r"error( \(rank \d+\))?:", ln):  # "error (rank 3): ..." after the process group exists
            rules = [x.strip()[2:] for x in lines[i + 1:] if x.strip().startswith("- ")]
            return " / ".join(rules) if rules else ln
    for ln in lines:
        m = _EXCEPTION.match(ln.strip())
        if m and "ChildFailedError" not in m.group(1):
            return m.group(1)
    return lines[-1].strip() if lines else "no output"


def run_one(recipe: str, combo: Combo, sets: list[str], out: Path, nproc: int, echo=print,
            timeout_s: float | None = None) -> str:
    """Run one combination unless it is complete; returns ok | skipped | failed | invalid."""
    run_dir = out / combo.name
    overrides = [*sets, *combo.overrides(), f"train.output_dir={run_dir}", "checkpoint.resume=true"]
    try:
        cfg = load_config(recipe, overrides, world_size=nproc)
    except ConfigError as exc:
        _write_status(run_dir, "invalid", None, 0.0, " / ".join(exc.errors), [])
        echo(f"    invalid: {' / '.join(exc.errors)}")
        return "invalid"
    settings.write(run_dir, settings.record(recipe, combo.values, sets, nproc))  # equal to any stored one
    if is_complete(run_dir, cfg.train.steps):
        echo(f"    skipped: complete ({cfg.train.steps} steps in {run_dir / 'metrics.jsonl'})")
        return "skipped"
    cmd = command(recipe, overrides, nproc)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith("step ") or line.startswith("error"):
                    echo(f"    {line.rstrip()}")
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
    wall = time.perf_counter() - start
    text = (run_dir / "train.log").read_text()
    if code == 0 and is_complete(run_dir, cfg.train.steps):
        _write_status(run_dir, "ok", code, wall, "", cmd)
        return "ok"
    error = _error_line(text) if code != 0 else f"exited 0 but metrics.jsonl lacks steps of {cfg.train.steps}"
    _write_status(run_dir, "failed", code, wall, error, cmd)
    echo(f"    FAILED (exit {code}): {error}  [log: {run_dir / 'train.log'}]")
    return "failed"


def _write_status(run_dir: Path, status: str, code, wall: float, error: str, cmd: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ablate_run.json").write_text(json.dumps(
        {"status": status, "returncode": code, "wall_s": wall, "error": error, "command": cmd}, indent=1))


def collect(combo: Combo, out: Path, steps: int | None) -> RunResult:
    """Summary of one run directory (whatever state it is in)."""
    run_dir = out / combo.name
    status_file = run_dir / "ablate_run.json"
    info = json.loads(status_file.read_text()) if status_file.is_file() else {}
    records = read_metrics(run_dir / "metrics.jsonl")
    done = steps is not None and set(range(1, steps + 1)) <= set(records)
    status = "ok" if done else info.get("status", "not run")
    if status == "ok" and not done:
        status = "incomplete"
    result = RunResult(combo, status, error=info.get("error", ""), wall_s=info.get("wall_s", math.nan))
    if records:
        ordered = sorted(records.items())
        result.losses = [(s, float(r["loss"])) for s, r in ordered]
        result.steps = len(ordered)
        result.final_loss = result.losses[-1][1]
        finite = [v for _, v in result.losses if math.isfinite(v)]
        result.min_loss = min(finite) if finite else math.nan
        speeds = [float(r["tokens_per_s"]) for s, r in ordered[1:] or ordered if "tokens_per_s" in r]
        result.tokens_per_s = statistics.median(speeds) if speeds else math.nan
        if not math.isfinite(result.wall_s):
            result.wall_s = sum(float(r.get("step_time", 0.0)) for _, r in ordered)
    return result


# ---------------------------------------------------------------------------------------------
# reports


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def write_reports(results: list[RunResult], grid_keys: list[str], out: Path, title: str) -> None:
    """results.csv, results.md and loss_curves.png in `out`."""
    fields = ["run", *grid_keys, *COLUMNS[1:]]
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in results:
            writer.writerow(r.row())
    lines = [f"# {title}", "", "| " + " | ".join(fields) + " |", "|" + " --- |" * len(fields)]
    for r in results:
        row = r.row()
        lines.append("| " + " | ".join(_fmt(row[f]).replace("|", "\\|") for f in fields) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot_losses(results, out / "loss_curves.png", title)


def run_ablation(recipe: str, grid: list[tuple[str, list[str]]], sets: list[str], out: Path, nproc: int = 1,
                 echo=print, timeout_s: float | None = None, rerun_changed: bool = False) -> list[RunResult]:
    """Run (or skip) every combination, then collect and write the reports; returns the results.
    settings.ChangedRuns, before anything runs, when `out` holds runs trained with other settings
    (moved aside instead with `rerun_changed`)."""
    out.mkdir(parents=True, exist_ok=True)
    combos = combinations(grid)
    records = {c.name: settings.record(recipe, c.values, sets, nproc) for c in combos}
    settings.set_aside_changed(out, records, rerun_changed, echo)
    for i, combo in enumerate(combos, 1):
        echo(f"[{i}/{len(combos)}] {combo.name}: {' '.join(combo.overrides()) or '(base recipe)'}")
        run_one(recipe, combo, sets, out, nproc, echo, timeout_s)
    results = []
    for combo in combos:
        try:
            steps = load_config(recipe, [*sets, *combo.overrides()], world_size=nproc).train.steps
        except ConfigError:
            steps = None
        results.append(collect(combo, out, steps))
    title = f"ablation of {recipe}" + (f" (--set {' '.join(sets)})" if sets else "")
    write_reports(results, [k for k, _ in grid], out, title)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/ablate.py", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a swept key (repeatable)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="fixed override (repeatable)")
    ap.add_argument("--out", required=True, help="ablation directory (one sub-directory per run)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun when > 1)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before a run is killed")
    ap.add_argument("--quiet", action="store_true", help="only one line per run")
    ap.add_argument("--rerun-changed", action="store_true",
                    help="runs in --out trained with other settings: move them to --out/_stale/ and train anew")
    args = ap.parse_args(argv)

    def echo(text: str) -> None:
        if not (args.quiet and text.startswith("    step")):
            print(text, flush=True)

    try:
        grid = parse_grid(args.grid)
        if args.nproc < 1:
            raise ValueError(f"--nproc={args.nproc} must be >= 1")
        out_dir("--out", args.out)
    except ValueError as exc:  # a bad --grid / --nproc / --out (OutPathError)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        results = run_ablation(args.recipe, grid, args.set, Path(args.out), args.nproc, echo, args.timeout,
                               args.rerun_changed)
    except settings.ChangedRuns as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"\n{Path(args.out) / 'results.md'}:")
    print((Path(args.out) / "results.md").read_text())
    bad = [r for r in results if r.status != "ok"]
    if bad:
        print(f"{len(bad)} of {len(results)} runs did not finish: " + ", ".join(f"{r.combo.name} ({r.status})" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
