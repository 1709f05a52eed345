"""The settings that made each ablation run, so that a rerun into the same --out never passes an old
run off under new settings.

Why: tools/ablate.py skips complete runs and resumes unfinished ones. Rerun with another --set (say
train.steps=40 instead of 20), it used to skip or resume the old runs and list them under the new
settings. Now each run directory gets `ablate_settings.json` before its trainer starts:

    {"recipe": "/abs/recipes/debug_cpu.toml", "grid": {"train.lr": "1e-3"}, "set": ["train.steps=20"],
     "nproc": 1}

and a rerun compares the effective overrides (the recipe path, then --set, then the grid point, each
value parsed as the trainer parses it, so 1e-3 and 0.001 agree) with the stored ones. A run made with
other settings is refused (one line naming the run and the keys that differ) unless --rerun-changed,
which moves it to OUT/_stale/<time>/<run> and trains it anew. --nproc is recorded but not compared:
a run may resume on another layout. Runs made before this file existed are read from the command line
in their ablate_run.json; a directory with training output and neither file counts as changed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from moe_lc.config.loading import apply_overrides

SETTINGS = "ablate_settings.json"
OWN_KEYS = ("train.output_dir", "checkpoint.resume")  # ablate sets these per run, after the user's
RUN_OUTPUTS = ("metrics.jsonl", "run.json", "checkpoints", "train.log")  # a directory holding one was used
STALE_DIR = "_stale"


class ChangedRuns(ValueError):
    """Runs in --out trained with other settings than this invocation's (the message is one line)."""


def set_aside_changed(out: Path, records: dict[str, dict], rerun_changed: bool, echo=print) -> None:
    """Before any run starts: ChangedRuns naming every run in `out` whose stored settings differ from
    its new record in `records` (run name -> record), or, with `rerun_changed`, move those runs aside."""
    stale = {name: diffs for name, rec in records.items() if (diffs := changed(out / name, rec))}
    if stale and not rerun_changed:
        raise ChangedRuns(describe(out, stale))
    for name, diffs in stale.items():
        echo(f"{name}: settings changed ({', '.join(diffs)}); the old run moved to {move_aside(out, name)}")


def record(recipe: str, grid_values: dict[str, str], sets: list[str], nproc: int) -> dict:
    return {"recipe": str(Path(recipe).resolve()), "grid": dict(grid_values), "set": list(sets), "nproc": nproc}


def effective(rec: dict) -> dict[str, object]:
    """{"recipe": path, "section.key": parsed value, ...}: what the run trained with (grid over --set)."""
    overrides = [*rec.get("set", []), *(f"{k}={v}" for k, v in rec.get("grid", {}).items())]
    nested, _ = apply_overrides({}, overrides)  # malformed items are load_config's to report
    flat: dict[str, object] = {"recipe": rec.get("recipe")}

    def walk(table: dict, prefix: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif f"{prefix}{key}" not in OWN_KEYS:
                flat[f"{prefix}{key}"] = value

    walk(nested, "")
    return flat


def differences(old: dict, new: dict) -> list[str]:
    """['train.steps 20 -> 40', 'train.lr (unset) -> 0.003', ...] between two records."""
    a, b = effective(old), effective(new)
    shown = lambda d, k: repr(d[k]) if k in d else "(unset)"  # noqa: E731
    return [f"{k} {shown(a, k)} -> {shown(b, k)}" for k in dict.fromkeys([*a, *b])
            if k not in a or k not in b or a[k] != b[k]]


def stored(run_dir: Path) -> dict | None:
    """The record of the run in `run_dir`: its SETTINGS file, else rebuilt from the command line in
    ablate_run.json (runs made before SETTINGS existed), else None."""
    for name, read in ((SETTINGS, lambda d: d), ("ablate_run.json", _from_command)):
        try:
            rec = read(json.loads((run_dir / name).read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if isinstance(rec, dict) and rec.get("recipe"):
            return rec
    return None


def _from_command(status: dict) -> dict | None:
    """The record in an old ablate_run.json's command: [python, -m, moe_lc.train, RECIPE, --set, K=V, ...]."""
    cmd = status.get("command") or []
    if "moe_lc.train" not in cmd:
        return None
    rest = cmd[cmd.index("moe_lc.train") + 1:]
    sets = [rest[i + 1] for i in range(1, len(rest) - 1) if rest[i] == "--set"]
    return {"recipe": str(Path(rest[0]).resolve()), "grid": {}, "set": sets} if rest else None


def was_used(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_OUTPUTS)


def changed(run_dir: Path, new: dict) -> list[str] | None:
    """None when `run_dir` holds no run or one made with `new`'s settings; else what differs."""
    if not was_used(run_dir):
        return None
    old = stored(run_dir)
    if old is None:
        return [f"settings unknown (no {SETTINGS})"]
    return differences(old, new) or None


def write(run_dir: Path, rec: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SETTINGS).write_text(json.dumps(rec, indent=1))


def describe(out: Path, stale: dict[str, list[str]]) -> str:
    """One line: the changed runs grouped by what changed, and the way out."""
    groups: dict[str, list[str]] = {}
    for name, diffs in stale.items():
        groups.setdefault(", ".join(diffs), []).append(name)
    what = "; ".join(f"{', '.join(names)} ({diff})" for diff, names in groups.items())
    return (f"--out {out} holds {len(stale)} run(s) trained with other settings: {what}; pass --rerun-changed to "
            f"move them to {out / STALE_DIR} and train them anew, or give another --out")


def move_aside(out: Path, name: str) -> Path:
    """Move run `name` out of the way (OUT/_stale/<time>/<name>) and return where it went."""
    dest = out / STALE_DIR / time.strftime("%Y%m%d-%H%M%S") / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    (out / name).rename(dest)
    return dest
