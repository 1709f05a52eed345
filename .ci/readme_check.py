"""Run every command block of the documents as written, in this checkout (CI: a fresh clone, just installed).

    python .ci/readme_check.py [--list] [--doc PATH ...] [--block PATH:LINE ...] [--timeout-s 1200]

The documents are README.md, every guide in docs/guide/ and docs/ARCHITECTURE.md, taken in that order:
the README first (its quick start trains runs/debug_cpu, which later blocks score), then the guides by
file name, then the architecture. Within a document, blocks run top to bottom. A block that reads what
another block wrote stays in the same document, after it, or reads only the README's runs
(tests/test_readme.py checks that two documents' blocks share no runs/ folder but the README's).

Each ```bash block is preceded by a marker comment:

    <!-- ci: run -->                       run every command of the block, in order, from the repo root
    <!-- ci: run; setup: CMD -->           run CMD first (e.g. make a tiny model where the block reads one)
    <!-- ci: skip (why) -->                not run here: the reason says why (a GPU, a cluster, hours)

A block without a marker is an error naming its file and line, so a new block cannot go unchecked. The
README's test command (`python -m pytest -q`) is CI's own step and is not run twice. Exit status 1 if any
block fails. Run it in a fresh clone, as CI does: the blocks train into runs/ as a new user would, and a
second pass over the same runs/ is refused by the trainer (a run directory holds one run).
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
README = "README.md"


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    mode: str  # "run" | "skip"
    note: str
    setup: str
    commands: list[str]
    doc: str = README  # the document's path from the repo root

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def documents(root: Path = ROOT) -> list[str]:
    """The documents whose blocks CI runs, in the order it runs them (paths from the repo root)."""
    guides = sorted(p.relative_to(root).as_posix() for p in (root / "docs" / "guide").glob("*.md"))
    architecture = ["docs/ARCHITECTURE.md"] if (root / "docs" / "ARCHITECTURE.md").is_file() else []
    return [README, *guides, *architecture]


def blocks(text: str, doc: str = README) -> list[Block]:
    """Every bash block of one document with its marker; ValueError names a block without one."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = MARKER.search(lines[j]) if j >= 0 else None
        if marker is None:
            raise ValueError(f"{doc}:{i + 1}: a bash block without a <!-- ci: run|skip (why) --> marker")
        end = next((k for k in range(i + 1, len(lines)) if lines[k].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{doc}:{i + 1}: a bash block that is never closed")
        note = marker.group(2).strip()
        setup = note.split("setup:", 1)[1].strip() if "setup:" in note else ""
        if marker.group(1) == "skip" and not note:
            raise ValueError(f"{doc}:{i + 1}: a skipped block must say why")
        out.append(Block(i + 1, marker.group(1), note, setup, _commands(lines[i + 1:end]), doc))
        i = end + 1
    return out


def all_blocks(root: Path = ROOT) -> list[Block]:
    """The blocks of every document, in the order CI runs them; ValueError names every unmarked block."""
    found, errors = [], []
    for doc in documents(root):
        try:
            found += blocks((root / doc).read_text(), doc)
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise ValueError("\n".join(errors))
    return found


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
        print(f"[{block.where}] $ {command}", flush=True)
        start = time.perf_counter()
        try:
            code = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"[{block.where}] timed out after {timeout_s:.0f} s", flush=True)
            return False
        print(f"[{block.where}] exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
        if code != 0:
            return False
    return True


def _wanted(spec: str) -> str:
    """`PATH:LINE`, or a bare LINE of the README."""
    return f"{README}:{spec}" if spec.isdigit() else spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the blocks and what CI does with each")
    ap.add_argument("--doc", action="append", default=[], help="only this document's blocks (e.g. docs/guide/data.md)")
    ap.add_argument("--block", action="append", default=[],
                    help="only the block at PATH:LINE (a bare LINE is the README's)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per command")
    args = ap.parse_args(argv)
    try:
        found = all_blocks()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    wanted_blocks = {_wanted(b) for b in args.block}
    unknown = sorted(wanted_blocks - {b.where for b in found}) + sorted(set(args.doc) - set(documents()))
    if unknown:
        print(f"error: no such block or document: {', '.join(unknown)} (--list shows them)", file=sys.stderr)
        return 2
    chosen = [b for b in found if (not args.doc or b.doc in args.doc) and (not wanted_blocks or b.where in wanted_blocks)]
    if args.list:
        for b in chosen:
            print(f"{b.where}: {b.mode} {b.note}".rstrip())
        return 0
    failed = []
    for b in chosen:
        if b.mode == "skip":
            print(f"[{b.where}] skipped {b.note}", flush=True)
        elif not run(b, args.timeout_s):
            failed.append(b.where)
    if failed:
        print(f"blocks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"every block that runs here ran ({len(chosen)} blocks in {len({b.doc for b in chosen})} documents)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
