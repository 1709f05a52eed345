"""Run every README command block as written, in this checkout (CI: a fresh clone, just installed).

    python .ci/readme_check.py [--list] [--block N ...] [--timeout-s 1200]

Each ```bash block of README.md is preceded by a marker comment:

    <!-- ci: run -->                       run every command of the block, in order, from the repo root
    <!-- ci: run; setup: CMD -->           run CMD first (e.g. make a tiny model where the block reads one)
    <!-- ci: skip (why) -->                not run here: the reason says why (a GPU, a cluster, hours)

A block without a marker is an error, so a new block cannot go unchecked. The README's test command
(`python -m pytest -q`) is CI's own step and is not run twice. Exit status 1 if any block fails.
Run it in a fresh clone, as CI does: the blocks train into runs/ as a new user would, and a second
pass over the same runs/ is refused by the trainer (a run directory holds one run).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*ci:\s*(run|skip)\b(.*?)-->")
TEST_COMMAND = "python -m pytest -q"


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    mode: str  # "run" | "skip"
    note: str
    setup: str
    commands: list[str]


def blocks(readme: str) -> list[Block]:
    """Every bash block with its marker; ValueError names a block without one."""
    lines, out, i = readme.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = MARKER.search(lines[j]) if j >= 0 else None
        if marker is None:
            raise ValueError(f"README.md:{i + 1}: a bash block without a <!-- ci: run|skip (why) --> marker")
        end = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
        note = marker.group(2).strip()
        setup = note.split("setup:", 1)[1].strip() if "setup:" in note else ""
        if marker.group(1) == "skip" and not note:
            raise ValueError(f"README.md:{i + 1}: a skipped block must say why")
        out.append(Block(i + 1, marker.group(1), note, setup, _commands(lines[i + 1:end])))
        i = end + 1
    return out


def _commands(body: list[str]) -> list[str]:
    """Shell commands of a block: continuation lines joined, comment-only lines dropped."""
    commands, current = [], ""
    for raw in body:
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


def run(block: Block, timeout_s: float) -> bool:
    commands = ([block.setup] if block.setup else []) + [c for c in block.commands if c.strip() != TEST_COMMAND]
    for command in commands:
        print(f"[README.md:{block.line}] $ {command}", flush=True)
        start = time.perf_counter()
        try:
            code = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"[README.md:{block.line}] timed out after {timeout_s:.0f} s", flush=True)
            return False
        print(f"[README.md:{block.line}] exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
        if code != 0:
            return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the blocks and what CI does with each")
    ap.add_argument("--block", type=int, action="append", default=[], help="only the block at this README line")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per command")
    args = ap.parse_args(argv)
    try:
        found = blocks((ROOT / "README.md").read_text())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.list:
        for b in found:
            print(f"README.md:{b.line}: {b.mode} {b.note}".rstrip())
        return 0
    failed = []
    for b in found:
        if args.block and b.line not in args.block:
            continue
        if b.mode == "skip":
            print(f"[README.md:{b.line}] skipped {b.note}", flush=True)
        elif not run(b, args.timeout_s):
            failed.append(b.line)
    if failed:
        print(f"README blocks failed: {', '.join(f'README.md:{n}' for n in failed)}", file=sys.stderr)
        return 1
    print("every README block that runs here ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
