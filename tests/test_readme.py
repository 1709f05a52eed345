"""The documents' command blocks (README.md, docs/guide/*.md, docs/ARCHITECTURE.md): each says whether CI
runs it (.ci/readme_check.py), each parses as bash, they run in an order where no block reads what a later
one writes, every link between the documents resolves, and the SLURM launcher parses too. CI runs the
blocks themselves after the test suite."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

from readme_check import README, TEST_COMMAND, all_blocks, blocks, documents, main  # noqa: E402

README_MAX_LINES = 350  # the front door, not the notebook: detail goes to a guide


def test_every_block_of_every_document_is_marked_and_parses():
    found = all_blocks()
    assert {b.doc for b in found} >= {README, "docs/guide/eval.md", "docs/ARCHITECTURE.md"}
    assert len([b for b in found if b.mode == "run"]) >= 5
    for b in found:
        script = "\n".join(([b.setup] if b.setup else []) + b.commands)
        out = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert out.returncode == 0, (b.where, out.stderr)


def test_the_documents_run_readme_first_then_the_guides_by_name():
    docs = documents()
    guides = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "guide").glob("*.md"))
    assert docs == [README, *guides, "docs/ARCHITECTURE.md"]
    assert len(guides) >= 10


def test_the_quick_start_and_ci_run_the_same_test_command():
    readme = (ROOT / README).read_text()
    assert TEST_COMMAND in blocks(readme)[0].commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci and "python .ci/readme_check.py" in ci


def test_a_block_without_a_marker_is_refused_with_its_file_and_line():
    with pytest.raises(ValueError, match="without a <!-- ci"):
        blocks("text\n\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match=r"^docs/guide/x\.md:3: a bash block without"):
        blocks("text\n\n```bash\necho hi\n```\n", "docs/guide/x.md")
    with pytest.raises(ValueError, match="must say why"):
        blocks("<!-- ci: skip -->\n```bash\necho hi\n```\n")


def test_list_names_every_document_with_blocks(capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith(f"{README}:") and "run" in listed[0]
    assert {line.split(":", 1)[0] for line in listed} == {b.doc for b in all_blocks()}
    assert main(["--block", "docs/guide/nope.md:1"]) == 2


def _runs_folders(block) -> set[str]:
    text = " ".join(([block.setup] if block.setup else []) + block.commands)
    return {m.group(1) for m in re.finditer(r"(?<![\w/.-])runs/([\w.-]+)", text)}


def test_no_document_reads_another_guides_runs():
    """The README runs first; a guide may read the README's runs (the quick start's runs/debug_cpu), but a
    runs/ folder that two later documents both name means a block depends on another document's block (or
    two would write one run directory): keep them in one document, in order."""
    runs = [b for b in all_blocks() if b.mode == "run"]
    readme = set().union(*(_runs_folders(b) for b in runs if b.doc == README))
    assert "debug_cpu" in readme
    owner: dict[str, str] = {}
    for b in runs:
        if b.doc == README:
            continue
        for folder in _runs_folders(b) - readme:
            assert owner.setdefault(folder, b.doc) == b.doc, f"runs/{folder}: {owner[folder]} and {b.where}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            slug = _slug(m.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_link_in_the_documents_resolves():
    """Links are relative to their document (a guide's results are ../results/...), and an anchor names a
    heading of its target."""
    broken = []
    for doc in [*documents(), "DEVELOPERS.md"]:
        text = (ROOT / doc).read_text()
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / doc).parent / path if path else ROOT / doc
            if not file.exists():
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{doc}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_anchor_rule_is_githubs():
    assert _slug("ZeRO-2: `parallel.placement.grads = \"sharded\"`") == "zero-2-parallelplacementgrads--sharded"
    assert _slug("How fast will it run?") == "how-fast-will-it-run"
    assert _anchors("# A\n```\n# not a heading\n```\n# A\n") == {"a", "a-1"}


def test_the_readme_is_the_front_door():
    readme = (ROOT / README).read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    headings = re.findall(r"^## (.+)$", readme, flags=re.MULTILINE)
    assert headings[:2] == ["Install", "Quick start"], headings
    assert {"Status", "Where to read on"} <= set(headings), headings
    linked = set(re.findall(r"\]\(docs/guide/([\w-]+\.md)", readme))
    guides = {p.name for p in (ROOT / "docs" / "guide").glob("*.md")}
    assert guides <= linked, sorted(guides - linked)


def test_the_slurm_launcher_parses():
    out = subprocess.run(["bash", "-n", str(ROOT / "docs" / "launch" / "slurm.sbatch")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
