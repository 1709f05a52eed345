"""A run directory belongs to one run: `run.json`, the decision whether this invocation may write into
`train.output_dir`, and metrics.jsonl's truncation on resume.

Why: a new run in a used output_dir used to overwrite metrics.jsonl and train beside the old run's
checkpoints (a later resume continued the old run), and `checkpoint.resume = true` that found no
checkpoint (a mistyped checkpoint.dir, a deleted COMMITTED marker) restarted at step 0 over the old
metrics. Now every run writes `<output_dir>/run.json`:

    {"id": "20260101-120000-3f9a1c", "created": "2026-01-01T12:00:00", "fingerprint": {...},
     "checkpoint_root": "/abs/path", "last_checkpoint": {"step": 200, "path": "..."} | null}

The fingerprint is the model's tensor shapes (a digest, plus n_layers / dim / vocab_size / params to
name a difference): what must match for a checkpoint to continue the run. Steps, the LR schedule,
layout, precision, recompute, data and checkpoint settings may change on resume. Each committed
checkpoint's marker carries the run id, so a resume can tell another run's checkpoint.

`check(cfg)` decides, reading only the filesystem, so every rank of a torchrun job decides alike
before any process group exists (main() calls it after preflight; a ConfigError is printed once
with exit status 2). `prepare(plan)` acts on the decision on rank 0 only. With OUT = output_dir and
ROOT = the checkpoint root:

    resume = false, OUT unused               start a new run
    resume = false, OUT used (metrics.jsonl, run.json, or checkpoints under OUT)
                                             refuse; train.overwrite = true clears metrics.jsonl, tb/,
                                             wandb/, config.toml, data_mixture.json, run.json and the step
                                             directories of the checkpoint roots inside OUT, then starts a
                                             new run
    ROOT outside OUT holds committed checkpoints and resume = false
                                             refuse, even with overwrite: nothing outside OUT is deleted
    resume = true, ROOT has a checkpoint     resume it, unless its run id differs from run.json's, the
                                             recipe's model differs from run.json's fingerprint, its
                                             tensors do not fit the recipe (checkpoint.weight_errors), or
                                             its model.dsa.stage differs from OUT/config.toml's (a new
                                             stage is a new run, from checkpoint.init_from)
    resume = true, no checkpoint, OUT unused start a new run (how a restart-on-failure job starts)
    resume = true, no checkpoint, run.json says this run never committed one into ROOT
                                             restart it at step 0 (an earlier attempt died before its
                                             first save); its metrics.jsonl is emptied, with a message
    resume = true, no checkpoint, otherwise  refuse (mistyped checkpoint.dir, deleted marker, a run
                                             without run.json); overwrite = true starts over instead
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from moe_lc.job import checkpoint as ckpt
from moe_lc.config import Config, ConfigError

RUN_FILE = "run.json"
METRICS = "metrics.jsonl"
RUN_FILES = (METRICS, "tb", "wandb", "config.toml", "data_mixture.json", RUN_FILE)  # what `train.overwrite` clears in OUT


@dataclass(frozen=True)
class RunPlan:
    """What `check` decided (the same on every rank)."""

    action: str  # "fresh" | "overwrite" | "resume" | "restart"
    out: Path
    root: Path  # checkpoint root
    fingerprint: dict
    record: dict | None = None  # run.json as found
    checkpoint: Path | None = None  # resume: the committed step directory to load
    run_id: str | None = None  # the run continued (resume / restart); None: a new one
    note: str = ""  # a line for the console once training starts


def checkpoint_root(cfg: Config) -> Path:
    c = cfg.checkpoint
    return Path(c.dir) if c.dir else Path(cfg.train.output_dir) / "checkpoints"


def fingerprint(cfg: Config, shapes: dict[str, tuple[int, ...]]) -> dict:
    """What a checkpoint must match to continue this run: a digest of every tensor's shape (`shapes`:
    `state_shapes(cfg.model)`), and the main sizes to name a difference."""
    digest = hashlib.sha256("\n".join(f"{n}:{list(s)}" for n, s in sorted(shapes.items())).encode()).hexdigest()
    m = cfg.model
    return {"shapes": digest[:16], "n_layers": m.n_layers, "dim": m.dim, "vocab_size": m.vocab_size,
            "params": sum(math.prod(s) for s in shapes.values())}


def read_record(out: Path) -> dict | None:
    """run.json of OUT; None when absent; {"id": None} when unreadable (a run, but not one we can name)."""
    path = out / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"id": None}
    return record if isinstance(record, dict) else {"id": None}


def _inside(path: Path, out: Path) -> bool:
    return path.resolve().is_relative_to(out.resolve())


def _step_entries(root: Path) -> list[Path]:
    """Step directories and save debris (step_*, .tmp_step_*) under a checkpoint root."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(("step_", ".tmp_step_")))


def _own_roots(out: Path, root: Path) -> list[Path]:
    """Checkpoint roots a run in OUT owns: OUT/checkpoints and ROOT when it lies inside OUT."""
    return [out / "checkpoints"] + ([root] if _inside(root, out) and root != out / "checkpoints" else [])


def earlier_run(out: Path, root: Path) -> str:
    """What of an earlier run OUT holds, in words ('' when OUT is unused)."""
    found = []
    if (out / METRICS).is_file():
        with open(out / METRICS, "rb") as fh:
            found.append(f"{METRICS} with {sum(1 for _ in fh)} lines")
    if (out / RUN_FILE).is_file():
        found.append(RUN_FILE)
    steps = [p for r in _own_roots(out, root) for p in _step_entries(r)]
    if steps:
        found.append(f"checkpoints up to {steps[-1].name}" if steps[-1].name.startswith("step_")
                     else f"{len(steps)} checkpoint directories")
    return ", ".join(found)


def _differs(a: dict, b: dict) -> str:
    """'n_layers 4 -> 3, params ...' between two fingerprints."""
    keys = [k for k in ("n_layers", "dim", "vocab_size", "params") if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in keys) or "tensor shapes differ"


def check(cfg: Config) -> RunPlan:
    """What this invocation does with its run directory (module docstring); ConfigError when it would
    mix or lose another run's data. Reads the filesystem only, so every rank decides alike."""
    from moe_lc.model.transformer import state_shapes

    shapes = state_shapes(cfg.model)
    out, root = Path(cfg.train.output_dir), checkpoint_root(cfg)
    plan = RunPlan("fresh", out, root, fingerprint(cfg, shapes), read_record(out))
    if not cfg.checkpoint.resume:
        return _fresh(cfg, plan)
    found = ckpt.committed_checkpoints(root)
    if found:
        return _resume(cfg, plan, found[-1][1], shapes)
    return _no_checkpoint(cfg, plan)


def _fresh(cfg: Config, plan: RunPlan) -> RunPlan:
    out, root, errors = plan.out, plan.root, []
    found = ckpt.committed_checkpoints(root)
    if found and not _inside(root, out):
        errors.append(f"checkpoint.dir={root} already holds checkpoints (newest {found[-1][1].name}) and lies outside "
                      "train.output_dir, so train.overwrite never clears it: set checkpoint.resume=true to continue "
                      "that run, or choose another checkpoint.dir (or delete it yourself)")
    earlier = earlier_run(out, root)
    if earlier and not cfg.train.overwrite:
        errors.append(f"train.output_dir={out} holds an earlier run ({earlier}): set --set train.overwrite=true to "
                      "replace it, or a new train.output_dir, or checkpoint.resume=true to continue it")
    if errors:
        raise ConfigError(errors)
    if earlier:
        return replace(plan, action="overwrite", note=f"train.overwrite = true: cleared the earlier run in {out} ({earlier})")
    return plan


def _resume(cfg: Config, plan: RunPlan, path: Path, shapes: dict) -> RunPlan:
    """Resume the committed checkpoint `path` if it belongs to this run and fits the recipe."""
    record, info, errors = plan.record or {}, ckpt.commit_info(path), []
    if record.get("id") and info.get("run") and info["run"] != record["id"]:
        errors.append(f"checkpoint.resume: {path} belongs to run {info['run']}, but {plan.out / RUN_FILE} is run "
                      f"{record['id']}: checkpoint.dir holds another run's checkpoints; point it at this run's, or use "
                      "a new train.output_dir")
    errors += _fingerprint_errors(plan) + _stage_errors(cfg, plan, path)
    errors += [f"checkpoint.resume: cannot load {path.name} into the recipe's model: {e}"
               for e in ckpt.weight_errors(path, shapes)]
    if errors:
        raise ConfigError(errors[:6] + ([f"... and {len(errors) - 6} more"] if len(errors) > 6 else []))
    last, note = record.get("last_checkpoint") or {}, ""
    if last.get("step", 0) > _step_of(path):
        note = (f"resuming {path}, though {RUN_FILE} records a newer checkpoint (step {last['step']}) that is gone "
                "or incomplete")
    return replace(plan, action="resume", checkpoint=path, run_id=record.get("id") or info.get("run"), note=note)


def _no_checkpoint(cfg: Config, plan: RunPlan) -> RunPlan:
    """resume = true without a committed checkpoint: start, restart this run, or refuse."""
    out, root, record = plan.out, plan.root, plan.record or {}
    why, damaged, earlier = ckpt.why_no_checkpoint(root), ckpt.uncommitted_steps(root), earlier_run(out, root)
    start = "starting from checkpoint.init_from" if cfg.checkpoint.init_from else "starting from step 0"
    if not earlier and not damaged:
        return replace(plan, note=f"checkpoint.resume = true, but {why}: {start}")
    same_root = record.get("checkpoint_root") == str(root.resolve())
    if record.get("id") and same_root and not record.get("last_checkpoint") and not damaged:
        errors = _fingerprint_errors(plan)
        if errors and not cfg.train.overwrite:
            raise ConfigError(errors)
        if not errors:
            return replace(plan, action="restart", run_id=record["id"],
                            note=f"checkpoint.resume = true, but {why} (run {record['id']} had saved none yet): "
                                 f"{start}; {METRICS} starts over")
    if cfg.train.overwrite:
        return replace(plan, action="overwrite", note=f"checkpoint.resume = true, but {why}; train.overwrite = true: "
                                                        f"cleared the earlier run in {out} ({earlier}), {start}")
    hints = [f"{damaged[-1]} lacks its {ckpt.MARKER} marker (deleted?)"] if damaged else []
    if record.get("last_checkpoint"):
        hints.append(f"{RUN_FILE} records a checkpoint at step {record['last_checkpoint'].get('step')}")
    if record.get("checkpoint_root") and not same_root:
        hints.append(f"{RUN_FILE} says its checkpoints are in {record['checkpoint_root']}")
    if earlier:
        hints.append(f"train.output_dir={out} holds an earlier run ({earlier})")
    raise ConfigError([f"checkpoint.resume=true, but {why}" + "".join(f"; {h}" for h in hints)
                       + ": not restarting at step 0 over it; fix checkpoint.dir, or set --set train.overwrite=true "
                       "to start over, or use a new train.output_dir"])


def _fingerprint_errors(plan: RunPlan) -> list[str]:
    have = (plan.record or {}).get("fingerprint")
    if not isinstance(have, dict) or have.get("shapes") == plan.fingerprint["shapes"]:
        return []
    return [(f"checkpoint.resume: the recipe's model differs from the run's in {plan.out / RUN_FILE} "
             f"({_differs(have, plan.fingerprint)}); resume with the run's model shape, or start a new run "
             "(a new train.output_dir, or train.overwrite=true)")]


def _stage_errors(cfg: Config, plan: RunPlan, path: Path) -> list[str]:
    """A DeepSeek Sparse Attention stage other than the run's: the tensors fit (the stages share them), but the
    run's config.toml, rewritten at start, would then describe the steps already taken by the new stage."""
    d, recorded = cfg.model.dsa, plan.out / "config.toml"
    try:
        old = tomllib.loads(recorded.read_text(encoding="utf-8")).get("model", {}).get("dsa", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        return []  # no record to contradict
    was = old.get("stage") if isinstance(old, dict) and old.get("enabled") is True else None
    if not d.enabled or was is None or was == d.stage:
        return []
    return [f"checkpoint.resume: {recorded} records this run as DeepSeek Sparse Attention's {was!r} stage, but the "
            f"recipe sets model.dsa.stage={d.stage!r}: resuming would rewrite config.toml, and the run's record would "
            f"say its {was} steps were {d.stage} ones; start the {d.stage} stage as a new run instead (a new "
            f"train.output_dir) with checkpoint.init_from = '{path}', this run's newest checkpoint"]


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


# -- rank 0 only: acting on the plan -----------------------------------------------------------------


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def prepare(plan: RunPlan) -> str:
    """Rank 0: clear an overwritten run's files (inside OUT only) and write run.json; returns the run id."""
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    if plan.action == "overwrite":
        for path in [out / name for name in RUN_FILES] + [p for r in _own_roots(out, plan.root) for p in _step_entries(r)]:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    old = plan.record or {}
    kept = plan.run_id is not None and old.get("id") == plan.run_id
    record = {"id": plan.run_id or new_run_id(),
              "created": old.get("created") if kept else time.strftime("%Y-%m-%dT%H:%M:%S"),
              "fingerprint": plan.fingerprint, "checkpoint_root": str(plan.root.resolve()),
              "last_checkpoint": old.get("last_checkpoint") if kept else None}
    if plan.checkpoint is not None:
        record["last_checkpoint"] = {"step": _step_of(plan.checkpoint), "path": str(plan.checkpoint)}
    _write_json(out / RUN_FILE, record)
    return record["id"]


def record_checkpoint(out: Path, step: int, path: Path) -> None:
    """Rank 0, after each commit: run.json names the newest checkpoint (a resume that finds none can then
    tell a deleted marker or a mistyped checkpoint.dir from a run that never saved)."""
    record = read_record(out) or {}
    record["last_checkpoint"] = {"step": step, "path": str(path)}
    _write_json(out / RUN_FILE, record)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def truncate_metrics(out: Path, step: int) -> int:
    """Keep metrics.jsonl's records of steps <= `step` (the step resumed): the steps after it run again
    and log again, so each step keeps one record. Streams into a temporary file and renames it over the
    old one (a crash leaves either file whole). Returns the number of lines dropped (a line cut short by
    a killed run counts)."""
    path = out / METRICS
    if not path.is_file():
        return 0
    tmp, dropped = path.with_name(METRICS + ".tmp"), 0
    with open(path) as src, open(tmp, "w") as dst:
        for line in src:
            try:
                keep = line.endswith("\n") and int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                dst.write(line)
            else:
                dropped += 1
    if dropped:
        os.replace(tmp, path)
    else:
        tmp.unlink()
    return dropped
