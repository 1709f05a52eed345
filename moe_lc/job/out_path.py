"""Output paths of the tools and the eval harness (--out, --png): checked and made before the work starts.

Why: a drawing or a tokenized corpus that fails at the very end on a missing parent folder, on a
directory standing where the file should go, or on a read-only place throws the work away, with a
traceback. Here each such mistake is one line (an OutPathError naming the flag and the path) before
anything runs, and missing parent directories are created, as the trainer does for its output_dir.

Writability is probed by creating (and at once deleting) an unnamed temporary file in the folder:
os.access says yes to root everywhere, also on /proc and read-only mounts, where nothing can be written.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


class OutPathError(ValueError):
    """An output path that cannot be used; its message is one line that names the flag."""


def out_file(flag: str, path: str | Path, given: str | None = None) -> Path:
    """`path` ready to be written as a file: missing parent folders made; a directory at `path`, a
    file where a parent folder should be, or a folder that cannot be written -> OutPathError (naming
    `flag` and `given`, what the user typed; default `path`)."""
    p = Path(path).expanduser()
    if given and given != str(path) and p.is_dir():
        raise OutPathError(f"{flag} {given}: {path} is a directory, where the output file goes")
    given = given or str(path)
    if p.is_dir() or str(path).endswith(("/", "\\")):
        raise OutPathError(f"{flag} {given}: names a directory, expected a file (e.g. {p / _example(flag)})")
    _make_dir(flag, given, p.parent)
    _probe(flag, given, p.parent)
    return p


def out_dir(flag: str, path: str | Path) -> Path:
    """`path` ready to hold output files: made with its parents; a file there or above it, or a folder
    that cannot be written -> OutPathError."""
    given, p = str(path), Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise OutPathError(f"{flag} {given}: is a file, expected a directory")
    _make_dir(flag, given, p)
    _probe(flag, given, p)
    return p


def _example(flag: str) -> str:
    return "timeline.png" if "png" in flag else "out"


def _make_dir(flag: str, given: str, folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        clash = next((q for q in (folder, *folder.parents) if q.exists() and not q.is_dir()), folder)
        raise OutPathError(f"{flag} {given}: {clash} is a file, not a directory") from None
    except OSError as exc:
        raise OutPathError(f"{flag} {given}: cannot create directory {folder}: {exc.strerror}") from None


def unwritable(folder: Path) -> str | None:
    """Why nothing can be written in the existing `folder` (None when something can): a file made and
    deleted there, not os.access, which says yes to root everywhere."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"cannot write in {folder}: {exc.strerror}"
    return None


def _probe(flag: str, given: str, folder: Path) -> None:
    problem = unwritable(folder)
    if problem:
        raise OutPathError(f"{flag} {given}: {problem}")
