"""The output folder of an eval: never silently replace an earlier eval's results.

Why: `python -m eval RUN` writes to <run>/eval/<step>/ by default, so a second eval of the same
checkpoint (other tasks, other lengths) used to replace the first one's results.json and leave the
first one's heatmaps beside the new ones, as if they belonged to it. Now a folder that holds outputs
of an earlier eval (results.json, or a PNG this harness writes) is refused, naming --overwrite and
--out, before the checkpoint is loaded. With --overwrite those outputs are deleted, but only once the
new eval has its numbers: an eval that fails midway leaves the earlier results in place. Other files
in the folder (tools/extend.py's eval.log, a user's notes) are left alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_lc.job.out_path import unwritable

from .tasks import DEPTH_TASKS

RESULTS = "results.json"
FIGURES = ("accuracy_by_length.png", "perplexity.png", "summary.png", *(f"{kind}_heatmap.png" for kind in DEPTH_TASKS))


def earlier_outputs(out: Path) -> list[Path]:
    """The files of an earlier eval in `out`: results.json, the figures this harness writes, and any
    other file the earlier results.json lists as its own (figures of tasks since renamed)."""
    if not out.is_dir():
        return []
    names = {RESULTS, *FIGURES}
    try:
        names |= {Path(f).name for f in json.loads((out / RESULTS).read_text()).get("files", [])
                  if str(f).endswith(".png")}
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # no (readable) earlier results.json: the fixed names only
    return sorted((out / n for n in names if (out / n).is_file()), key=lambda p: (p.name != RESULTS, p.name))


def _make(out: Path) -> str | None:
    """Make `out` now, or say why it cannot be: a folder that cannot exist (a file in the way, no
    permission, a read-only or kernel filesystem) must fail in the first second, not after the eval."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"{out} is a file, not a folder"
    except OSError as exc:
        return f"cannot make {out}: {exc.strerror or exc}"
    return unwritable(out)


def open_output(out: Path, overwrite: bool) -> str | None:
    """Make the output folder and check it may be written: one line when not (None when it may)."""
    problem = _make(out)
    if problem:
        return f"output folder: {problem}"
    found = earlier_outputs(out)
    if found and not overwrite:
        names = ", ".join(p.name for p in found[:3]) + (f", +{len(found) - 3} more" if len(found) > 3 else "")
        return (f"{out} already holds an earlier eval ({names}); pass --overwrite to replace it, "
                "or --out DIR to write elsewhere")
    return None


def clear_earlier(out: Path) -> list[Path]:
    """Delete an earlier eval's outputs from `out` (--overwrite), so no stale figure survives; returns them."""
    found = earlier_outputs(out)
    for path in found:
        path.unlink()
    return found


def write_results(out: Path, results: dict) -> Path:
    """results.json, written whole or not at all (a temporary file renamed into place)."""
    path, tmp = out / RESULTS, out / f".{RESULTS}.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)
    return path
