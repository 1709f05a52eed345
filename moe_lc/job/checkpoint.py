"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, reshardable, optionally asynchronous.

Layout under the checkpoint root:

    step_00000100/          a complete checkpoint: DCP shards + .metadata + COMMITTED
    .tmp_step_00000200/     a save in progress (or one that was killed): never read

A save writes into the temporary directory; after every rank's data and DCP's .metadata are on
disk the writer rank adds the COMMITTED marker (fsync) and renames the directory into place (fsync
of the root). A save killed at any moment leaves the previous checkpoints untouched and loadable;
`latest_checkpoint` only considers committed ones.

Contents: "model" and "optim" hold every parameter and optimizer state as boxes of the full tensors
(`moe_lc.job.checkpoint_state`), so any layout loads any other's checkpoint; "train" holds the
step, the skipped-step count and the data position (one global sample counter, which carries over
when the data-parallel size changes); "rng" every rank's generator states (restored when the world
size is unchanged).

Asynchronous saves snapshot the state (a copy of this rank's boxes) before returning, so training
never overwrites tensors being written; the write runs in a thread on a dedicated gloo group and
is committed by the writer when DCP finishes. The next save, or `wait()`, joins it first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from moe_lc import faults
from moe_lc.parallel.tie import tie_mismatch, untied_head

from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

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


def why_no_checkpoint(root: str | Path) -> str:
    """Why `latest_checkpoint(root)` found nothing, in words (for the resume message)."""
    root = Path(root)
    if not root.exists():
        return f"{root} does not exist"
    if not root.is_dir():
        return f"{root} is not a directory"
    started = [p.name for p in root.iterdir() if _STEP_DIR.match(p.name) or p.name.startswith(".tmp")]
    if not started:
        return f"{root} holds no checkpoint"
    return f"{root} holds only incomplete saves ({', '.join(sorted(started)[:3])})"


def uncommitted_steps(root: str | Path) -> list[str]:
    """step_XXXXXXXX directories under root without their COMMITTED marker: damaged (a marker deleted by
    hand), never a save in progress (that is .tmp_step_*; the rename comes after the marker)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _STEP_DIR.match(p.name) and not (p / MARKER).is_file())


def commit_info(step_dir: str | Path) -> dict:
    """The COMMITTED marker: {"step", "time"} and, for a training run's save, "run" (its run.json id)."""
    try:
        info = json.loads((Path(step_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def find_checkpoint(path: str | Path) -> Path:
    """The committed step directory a user's path names: the step itself, or the newest under a checkpoint
    root, a run directory (<output_dir>/checkpoints) or a `python -m moe_lc.convert from-hf` directory
    (<dir>/checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run or checkpoint directory")
    if (path / MARKER).is_file():
        return path
    for root in (path, path / "checkpoints", path / "checkpoint"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise CheckpointError(f"{path}: no committed checkpoint (looked for step_XXXXXXXX/{MARKER} in it, checkpoints/ "
                          "and checkpoint/); train with checkpoint.interval > 0")


def recipe_beside(step_dir: Path) -> Path | None:
    """The recipe a checkpoint belongs with: <run>/config.toml (a training run's resolved recipe) or
    <dir>/recipe.toml (a from-hf directory), looked for up to three levels above the step directory."""
    for directory in [step_dir, *step_dir.parents][:4]:
        for name in ("config.toml", "recipe.toml"):
            if (directory / name).is_file():
                return directory / name
    return None


def weight_errors(path: Path, shapes: dict[str, tuple[int, ...]], fresh: str | None = None,
                  untie: bool = False) -> list[str]:
    """Why the checkpoint at `path` cannot give a model of these full `shapes` its weights; [] if it can.
    Both directions count: a tensor of the model the checkpoint lacks, and a tensor of the checkpoint's
    model the recipe lacks (a 4-layer checkpoint into 3 layers would otherwise drop layers.3.* without a
    word). Key-set differences come first, one line each, naming the first few and the count. A missing
    router bias is allowed (DeepSeek-V2 checkpoints have none: it stays zero), and so are tensors whose name
    holds `fresh` when the checkpoint has none of them (a module the run adds and initializes: DeepSeek
    Sparse Attention's indexer, new in the warm-up stage from a dense model). Tied against untied is one
    line naming model.tie_embeddings, or allowed one way with `untie` (parallel/tie.py: `tie_mismatch`)."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:
        return [f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})"]
    saved = {key[len("model."):]: m for key, m in meta.items() if key.startswith("model.")}
    errors, told = tie_mismatch(path, set(saved), set(shapes), untie)
    missing = [n for n in shapes if n not in saved and not n.endswith("expert_bias") and n not in told]
    if fresh and not any(fresh in n for n in saved):
        missing = [n for n in missing if fresh not in n]
    extra = [n for n in saved if n not in shapes and n not in told]
    if missing:
        errors.append(f"{path} lacks {_some(missing)} of the recipe's model")
    if extra:
        errors.append(f"{path} holds {_some(extra)} that the recipe's model lacks")
    for name, shape in shapes.items():
        if name in saved and tuple(saved[name].size) != tuple(shape):
            errors.append(f"{name} is {tuple(saved[name].size)} in {path} but {tuple(shape)} in the recipe")
    return errors


def _some(names: list[str], first: int = 4) -> str:
    """'3 tensors: a, b, c' / '40 tensors: a, b, c, d, ... (+36 more)'."""
    shown = ", ".join(names[:first]) + (f", ... (+{len(names) - first} more)" if len(names) > first else "")
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''}: {shown}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(root: Path, tmp: Path, final: Path, step: int, keep: int, run_id: str | None = None) -> None:
    """Writer rank only: marker (with the run id, so a resume can tell another run's checkpoint), rename
    into place, prune old checkpoints."""
    with open(tmp / MARKER, "w") as fh:
        json.dump({"step": step, "time": time.time(), **({"run": run_id} if run_id else {})}, fh)
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


def _dcp_save(state: dict, path: Path, group=None, file_per_tensor: bool = False) -> None:
    # file_per_tensor: DCP's writer keeps every tensor of a file alive until the file is done, so a
    # streaming writer (the converter's lazily read boxes) wants one file per box
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=not file_per_tensor)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")  # single-process notice
        try:
            dcp.save(state, storage_writer=writer, process_group=group)
        except CheckpointException as exc:
            _reraise_interrupt(exc)
            raise


def save_checkpoint(root: str | Path, step: int, state: dict, *, is_writer: bool,
                    barrier=lambda: None, keep: int = 0, rank: int = 0, file_per_tensor: bool = False,
                    run_id: str | None = None) -> Path:
    """Save `state` for `step` synchronously; collective over all ranks. Returns the committed dir."""
    root = Path(root)
    final, tmp = step_dir(root, step), root / f".tmp_step_{step:08d}"
    if is_writer:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a killed save
        tmp.mkdir()
    barrier()
    _dcp_save(state, tmp, file_per_tensor=file_per_tensor)
    faults.maybe_kill_in_save(step, rank)
    if is_writer:  # DCP wrote .metadata after every rank's data: the checkpoint is complete
        _commit(root, tmp, final, step, keep, run_id)
    barrier()
    return final


def checkpoint_keys(path: str | Path) -> set[str]:
    """Flattened keys present in a checkpoint ("model.layers.0.attn.wo.weight", "train.step", ...)."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from None
    return set(meta.state_dict_metadata)


def load_checkpoint(path: str | Path, state: dict) -> dict:
    """Load in place into `state` (its tensors give shapes, dtypes and boxes); returns it."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path}: not a committed checkpoint (no {MARKER} marker)")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:
        _reraise_interrupt(exc)
        raise CheckpointError(f"{path}: cannot load ({type(exc).__name__}: {_first_line(exc)})") from None
    return state


class Checkpointer:
    """Saves and restores one run's training state (see the module docstring). `run_id` goes into each
    COMMITTED marker; `on_commit(step, path)` runs on the writer rank after each commit (the trainer
    records the newest checkpoint in run.json), in the save thread for asynchronous saves."""

    def __init__(self, root: str | Path, dims, *, keep: int = 0, async_save: bool = False):
        self.root, self.dims, self.keep, self.async_save = Path(root), dims, keep, async_save
        self.is_writer = dims.rank == 0
        self.run_id: str | None = None
        self.on_commit = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group = None
        if async_save and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # checkpoint traffic off the training group

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def state(self, parallel, optimizer, train: dict) -> dict:
        """parallel: the trainer's `Parallelized` model (its placements say how to box each tensor)."""
        from moe_lc.job.checkpoint_state import model_state, optimizer_state

        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"model": model_state(parallel, self.dims), "optim": optimizer_state(optimizer, parallel, self.dims),
                "train": dict(train, world=self.dims.world), "rng": {f"rank{self.dims.rank}": rng}}

    def save(self, step: int, parallel, optimizer, train: dict) -> Path:
        """Save (or, with async_save, start saving) the state after `step` optimizer steps."""
        self.wait()
        state = self.state(parallel, optimizer, train)
        if not self.async_save:
            path = save_checkpoint(self.root, step, state, is_writer=self.is_writer, barrier=self._barrier,
                                   keep=self.keep, rank=self.dims.rank, run_id=self.run_id)
            self._committed(step, path)
            return path
        final, tmp = step_dir(self.root, step), self.root / f".tmp_step_{step:08d}"
        if self.is_writer:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        snapshot = _snapshot(state)  # from here on training may change the live buffers

        def write():
            try:
                _dcp_save(snapshot, tmp, self._group)
                faults.maybe_kill_in_save(step, self.dims.rank)
                if self.is_writer:
                    _commit(self.root, tmp, final, step, self.keep, self.run_id)
                self._committed(step, final)
            except BaseException as exc:  # surfaced by wait()
                self._error = exc

        self._thread = threading.Thread(target=write, name=f"checkpoint-step{step}", daemon=True)
        self._thread.start()
        return final

    def _committed(self, step: int, path: Path) -> None:
        if self.is_writer and self.on_commit is not None:
            self.on_commit(step, path)

    @property
    def saving(self) -> bool:  # an asynchronous save is still being written
        return self._thread is not None and self._thread.is_alive()

    def load_weights(self, path: Path, parallel, optimizer) -> None:
        """`checkpoint.init_from`: the model's weights (and persistent buffers) from the committed checkpoint
        `path` under any layout, nothing else; `init_from_errors` has vetted it on every rank alike. The
        fp32 ZeRO master shards are filled (from the checkpoint's fp32 masters when it has them, else from
        its model tensors) and published to the parameters, so a bf16 run started from fp32 weights keeps
        them exactly. A tied checkpoint into an untied model (`untied_head`): the head's boxes read the
        saved embedding, in a second load (DCP reads one entry into one set of boxes), on every rank."""
        from moe_lc.job.checkpoint_state import model_state, optimizer_state

        keys = checkpoint_keys(path)
        untie = untied_head(keys, parallel.module.cfg.tie_embeddings)
        masters = optimizer_state(optimizer, parallel, self.dims)["params"]
        state: dict = {"model": {}, "optim": {"params": {}}}
        head: dict = {"model": {}, "optim": {"params": {}}}
        for name, value in model_state(parallel, self.dims).items():
            source, into = ("embed.weight", head) if untie and name == "head.weight" else (name, state)
            if f"model.{source}" not in keys:
                continue  # a router bias the source never had (DeepSeek-V2): stays zero
            if name in masters:
                if f"optim.params.{source}.master" in keys:
                    into["optim"]["params"][source] = {"master": masters[name]["master"]}
                else:
                    into["model"][source] = masters[name]["master"]  # fp32 boxes read the model entry
            elif name not in parallel.placements:  # a buffer
                into["model"][source] = value
            # else: a parameter whose ZeRO slices all live on other ranks: gather_params brings it
        load_checkpoint(path, state)
        if untie:  # collective: every rank, with or without a piece of the head
            load_checkpoint(path, head)
            if self.is_writer:
                print(f"checkpoint.init_from: {path} is tied (model.tie_embeddings = true) and this recipe is not: "
                      "the head starts as a copy of the embedding", flush=True)
        for shard in optimizer.shards:
            shard.gather_params()
        if optimizer.ema is not None:  # weights only: the EMA starts from them
            optimizer.ema.reset([s.master for s in optimizer.shards])

    def wait(self, barrier: bool = True) -> None:
        """Join a running asynchronous save (and re-raise its error); barrier=False after an interrupt,
        when the other ranks may be gone."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if barrier:
                self._barrier()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"asynchronous checkpoint save failed: {error}") from error

    def resume(self, parallel, optimizer, train_template: dict, path: Path | None = None) -> tuple[Path | None, dict]:
        """Load `path` (default: the newest committed checkpoint) into model and optimizer; returns
        (path, train state)."""
        path = path or latest_checkpoint(self.root)
        if path is None:
            return None, train_template
        from moe_lc.job.checkpoint_state import rule_resume_error

        keys = checkpoint_keys(path)
        saved_rule = load_checkpoint(path, {"optim": {"rule": ""}})["optim"]["rule"] if "optim.rule" in keys else None
        error = rule_resume_error(path, keys, saved_rule, optimizer)
        if error:
            raise CheckpointError(error)
        train = load_checkpoint(path, {"train": dict(train_template, world=0)})["train"]
        state = self.state(parallel, optimizer, train_template)
        state.pop("train")
        state["optim"].pop("rule")  # checked above (and absent from older checkpoints)
        if train["world"] != self.dims.world or f"rng.rank{self.dims.rank}.torch" not in keys:
            state.pop("rng")  # another layout: generator states do not map rank to rank
        fresh_ema = optimizer.ema is not None and not any(k.endswith(".ema") for k in keys)
        if fresh_ema:  # train.ema_decay turned on after this checkpoint: the EMA starts from its weights
            for entry in state["optim"]["params"].values():
                entry.pop("ema", None)
        load_checkpoint(path, state)
        if fresh_ema:
            optimizer.ema.reset([s.master for s in optimizer.shards])
        optimizer.step_count = int(state["optim"]["step"])
        if "rng" in state:
            rng = state["rng"][f"rank{self.dims.rank}"]
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        train.pop("world")
        return path, train


def _reraise_interrupt(exc: BaseException) -> None:
    """DCP reports a Ctrl-C (or a SIGTERM a caller turned into one) as one of its failures: keep it that
    KeyboardInterrupt, not a failed save or load. The interrupt may sit under the failure it caused: a
    Ctrl-C inside torch.save's zip writer surfaces as the writer's "unexpected pos" RuntimeError, whose
    context is the KeyboardInterrupt."""
    for e, _ in getattr(exc, "failures", {}).values():
        seen = set()
        while e is not None and id(e) not in seen:
            if isinstance(e, KeyboardInterrupt):
                raise e.with_traceback(None) from None
            seen.add(id(e))
            e = e.__cause__ or e.__context__


def _first_line(exc: BaseException) -> str:
    """DCP wraps per-rank failures in long reports; keep the innermost error's message."""
    text = str(exc)
    for marker in ("Error: ", "Exception: "):
        if marker in text:
            text = text.rsplit(marker, 1)[-1]
    return text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__


def _snapshot(state):
    """A deep copy of a checkpoint state's tensors (Chunks boxes included)."""
    from moe_lc.job.checkpoint_state import Chunks

    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, Chunks):
        return state.cloned()
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state
