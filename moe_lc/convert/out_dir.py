"""Where a conversion writes. `--out` is checked before anything is read, the result is written to a
directory beside it and swapped in whole, so a refused, failed or killed conversion never mixes into,
or loses, what was there:

    from-hf --out   absent or empty: written. An earlier conversion (from-hf's recipe.toml, checkpoint/,
                    tokenizer/ and nothing else): replaced with --overwrite. Anything else (a training
                    run: config.toml, metrics.jsonl, checkpoints/): refused, --overwrite or not.
    to-hf --out     absent or empty: written. A Hugging Face model directory (config.json, no
                    subdirectories): replaced with --overwrite. Anything else: refused.

Creating the staging directory is also the writability check: a read-only --out fails in one line
before the first weight is read, not after an hour of conversion.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

from moe_lc.convert.hf_config import ConvertError

CONVERSION_HEAD = "# Converted from "  # the first line of every recipe.toml from-hf writes
CONVERSION_ENTRIES = {"recipe.toml", "checkpoint", "tokenizer"}


def listing(path: Path, most: int = 6) -> str:
    """'a.txt, b/, c.json (+3 more)': what a directory holds, for a refusal."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")


def is_conversion(path: Path) -> bool:
    """An earlier from-hf output, and nothing else: a run trained into it would have added files."""
    recipe = path / "recipe.toml"
    if not recipe.is_file() or not {p.name for p in path.iterdir()} <= CONVERSION_ENTRIES:
        return False
    with open(recipe, encoding="utf-8", errors="replace") as fh:
        return fh.read(len(CONVERSION_HEAD)) == CONVERSION_HEAD


def is_hf_model_dir(path: Path) -> bool:
    """A Hugging Face model directory as to-hf writes it (and save_pretrained): flat, with config.json."""
    return (path / "config.json").is_file() and not any(p.is_dir() for p in path.iterdir())


def check_out(out: Path, *, overwrite: bool, kind: str, replaceable: Callable[[Path], bool],
              inputs: tuple[Path, ...] = ()) -> None:
    """ConvertError unless `out` may be written (see the module docstring); `kind` names what
    `replaceable` accepts, `inputs` are directories the conversion reads (never replaced)."""
    for src in inputs:
        if src.is_relative_to(out):
            raise ConvertError(f"--out {out} {'is' if src == out else 'holds'} the input {src}: choose another "
                               "directory")
    if not out.exists():
        return
    if not out.is_dir():
        raise ConvertError(f"--out {out} is a file, not a directory")
    try:
        if not any(out.iterdir()):
            return
    except OSError as exc:
        raise ConvertError(f"--out {out}: cannot list it ({exc.strerror})") from None
    if not replaceable(out):
        raise ConvertError(f"--out {out} is not empty and not {kind} (it holds {listing(out)}): choose another "
                           f"directory (--overwrite replaces only {kind})")
    if not overwrite:
        raise ConvertError(f"--out {out} is {kind} (it holds {listing(out)}): pass --overwrite to replace it")


def _swap(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`. An absent or empty `out` is replaced by the one rename (atomic); a full
    one is moved aside first and removed after: between the renames `out` is absent, never mixed."""
    if not (out.is_dir() and any(out.iterdir())):
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(3)}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged(out: Path, command: str, check: Callable[[], None]):
    """Run `check` (a refusal raises before anything is created), yield a new directory beside `out` to
    write into, then `check` again (something may have appeared at `out` meanwhile) and swap it in.
    On any failure the staging directory is removed and `out` is left as it was."""
    check()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConvertError(f"--out {out}: cannot create {exc.filename or out.parent} ({exc.strerror})") from None
    tmp = out.parent / f".{out.name}.{command}-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        tmp.mkdir()
    except OSError as exc:
        raise ConvertError(f"--out {out}: cannot write in {out.parent} ({exc.strerror})") from None
    try:
        yield tmp
        check()
        _swap(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
