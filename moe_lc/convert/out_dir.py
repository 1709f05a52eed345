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

The staging directory is `.OUT.<command>-<host>-<pid>-<hex>` beside --out. A conversion that raises
or is interrupted (Ctrl-C; SIGTERM, which `python -m moe_lc.convert` unwinds the same way) removes it,
with SIGINT and SIGTERM ignored while it does and while the result is swapped in (a signal then is
lost: the conversion is complete a moment later). One killed outright (SIGKILL, a crash) leaves it; the
next conversion to the same --out removes it (`stale_copies`: named with this host, and its pid no
longer runs), never the copy of a running conversion or of one on another host sharing the filesystem.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from pathlib import Path
from typing import Callable

from moe_lc.convert.hf_config import ConvertError

CONVERSION_HEAD = "# Converted from "  # the first line of every recipe.toml from-hf writes
CONVERSION_ENTRIES = {"recipe.toml", "checkpoint", "tokenizer"}
COMMANDS = ("from-hf", "to-hf")
HOST = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


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


def _aside(out: Path, what: str) -> Path:
    """A new name beside `out` for this process: `.OUT.<what>-<host>-<pid>-<hex>` (see `stale_copies`)."""
    return out.parent / f".{out.name}.{what}-{HOST}-{os.getpid()}-{secrets.token_hex(3)}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale_copies(out: Path) -> list[Path]:
    """Staging copies of `out` (and old outputs set aside by a swap, while `out` exists) left by a
    conversion on this host whose process no longer runs. A name without a host (written before hosts
    were named) counts as this host's."""
    kinds = "|".join(map(re.escape, COMMANDS + ("old",) if out.is_dir() else COMMANDS))
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:{kinds})-(?:(.+)-)?(\d+)-[0-9a-f]{{6}}")
    found = []
    for p in out.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m and p.is_dir() and m.group(1) in (None, HOST) and not _running(int(m.group(2))):
            found.append(p)
    return sorted(found)


@contextlib.contextmanager
def signals_ignored():
    """SIGINT and SIGTERM ignored inside (main thread only: elsewhere Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(s, handler)


def _swap(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`. An absent or empty `out` is replaced by the one rename (atomic); a full
    one is moved aside first and removed after: between the renames `out` is absent, never mixed."""
    if not (out.is_dir() and any(out.iterdir())):
        os.replace(tmp, out)
        return
    old = _aside(out, "old")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged(out: Path, command: str, check: Callable[[], None], log=print):
    """Run `check` (a refusal raises before anything is created), remove stale copies of `out` left by
    killed conversions, yield a new directory beside `out` to write into, then `check` again (something
    may have appeared at `out` meanwhile) and swap it in. On any failure or interruption the staging
    directory is removed and `out` is left as it was (see the module docstring)."""
    assert command in COMMANDS, command
    check()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConvertError(f"--out {out}: cannot create {exc.filename or out.parent} ({exc.strerror})") from None
    tmp = _aside(out, command)
    try:
        tmp.mkdir()
    except OSError as exc:
        raise ConvertError(f"--out {out}: cannot write in {out.parent} ({exc.strerror})") from None
    stale = stale_copies(out)
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    if stale:
        log(f"{command}: removed what killed conversions left beside {out}: {', '.join(p.name for p in stale)}")
    try:
        yield tmp
        with signals_ignored():
            check()
            _swap(tmp, out)
    except BaseException:
        with signals_ignored():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
