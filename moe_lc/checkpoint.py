"""Checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout under the checkpoint root:

    step_00000100/          a complete checkpoint: DCP shards + .metadata + COMMITTED
    .tmp_step_00000200/     a save in progress (or one that was killed): never read

A save writes into the temporary directory, then the writer rank adds the COMMITTED marker (fsync)
and renames the directory into place (fsync of the root), so a save killed at any moment leaves the
previous checkpoints untouched and loadable. `latest_checkpoint` only considers committed ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable

import torch.distributed.checkpoint as dcp

MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (corrupt, incomplete, or not a moe_lc checkpoint)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def committed_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and (path / MARKER).is_file() and (path / ".metadata").is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = committed_checkpoints(root)
    return found[-1][1] if found else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: str | Path, step: int, state: dict, *, is_writer: bool,
                    barrier: Callable[[], None] = lambda: None, keep: int = 0) -> Path:
    """Save `state` (nested dicts of tensors / DTensors / plain values) for `step`; collective over all
    ranks (every rank calls it). Returns the committed directory."""
    root = Path(root)
    final, tmp = step_dir(root, step), root / f".tmp_step_{step:08d}"
    if is_writer:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a killed save
        tmp.mkdir()
    barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # single-process notice
        dcp.save(state, checkpoint_id=str(tmp))
    barrier()
    if is_writer:
        marker = tmp / MARKER
        with open(marker, "w") as fh:
            json.dump({"step": step, "time": time.time()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (after a resume) replaces it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        if keep > 0:
            for _, old in committed_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def checkpoint_keys(path: str | Path) -> set[str]:
    """Top-level keys present in a checkpoint (used to skip per-rank entries a new layout lacks)."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from None
    return {key.split(".", 1)[0] for key in meta.state_dict_metadata}


def load_checkpoint(path: str | Path, state: dict) -> dict:
    """Load in place into `state` (its tensors give shapes, dtypes and shardings); returns it."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path}: not a committed checkpoint (no {MARKER} marker)")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load ({type(exc).__name__}: {str(exc)[:500]})") from None
    return state
