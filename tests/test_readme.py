"""The README's command blocks: each says whether CI runs it (.ci/readme_check.py), each parses as bash,
and the SLURM launcher parses too. CI runs the blocks themselves after the test suite."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

from readme_check import TEST_COMMAND, blocks  # noqa: E402


def test_every_block_is_marked_and_parses():
    found = blocks((ROOT / "README.md").read_text())
    assert len([b for b in found if b.mode == "run"]) >= 5
    for b in found:
        script = "\n".join(([b.setup] if b.setup else []) + b.commands)
        out = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert out.returncode == 0, (b.line, out.stderr)


def test_the_quick_start_and_ci_run_the_same_test_command():
    readme = (ROOT / "README.md").read_text()
    assert TEST_COMMAND in blocks(readme)[0].commands
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_a_block_without_a_marker_is_refused():
    import pytest

    with pytest.raises(ValueError, match="without a <!-- ci"):
        blocks("text\n\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="must say why"):
        blocks("<!-- ci: skip -->\n```bash\necho hi\n```\n")


def test_the_slurm_launcher_parses():
    out = subprocess.run(["bash", "-n", str(ROOT / "docs" / "launch" / "slurm.sbatch")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
