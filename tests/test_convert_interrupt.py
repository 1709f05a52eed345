"""An interrupted `python -m moe_lc.convert`, and what a killed one leaves (issue 61, item 5).

- SIGTERM (a scheduler, `timeout`) or Ctrl-C while from-hf writes its checkpoint, or while to-hf reads
  one: exit 143 / 130, one line on stderr (`interrupted by SIGTERM: nothing written to OUT`, no
  traceback), the staging copy removed, an earlier conversion at --out byte-identical. Each run stalls
  inside DCP at a known point (a patched read that writes a marker file and sleeps), so the signal
  lands mid-staging every time.
- Staging copies left by a process killed outright (SIGKILL) are removed by the next conversion to the
  same --out when their pid no longer runs on this host; a running process's copy, another host's,
  and another --out's are left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_lc.convert import from_hf
from moe_lc.convert.out_dir import HOST
from tests import hf_models
from tests.test_convert_errors import debris, snapshot

pytest.importorskip("transformers")  # a dev dependency: `pip install -e '.[dev]'`

ROOT = Path(__file__).resolve().parents[1]

# `python -m moe_lc.convert ARGS` with one read patched to write MARKER and sleep on its second call:
# from-hf's safetensors reads happen inside DCP's save, to-hf's checkpoint reads inside DCP's load.
DRIVER = """
import signal, sys, time
from pathlib import Path
import torch.distributed.checkpoint as dcp
from moe_lc.convert.__main__ import main
from moe_lc.convert.hf_files import HFWeights

marker, argv = Path(sys.argv[1]), sys.argv[2:]
owner, name = (HFWeights, "get") if argv[0] == "from-hf" else (dcp.FileSystemReader, "read_data")
real, calls = getattr(owner, name), []

def stalls(*args, **kw):
    calls.append(1)
    if len(calls) == 2:
        marker.write_text("staging")
        time.sleep(300)
    return real(*args, **kw)

setattr(owner, name, stalls)
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even when started in the background
sys.exit(main(argv))
"""


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama") / "hf"
    hf_models.save_model(hf_models.llama(), directory)
    return directory


@pytest.fixture(scope="module")
def conversion(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "ours"
    from_hf(source, out, log=quiet)
    return out


def interrupted(tmp_path: Path, signum: int, *argv) -> tuple[int, str]:
    """Run DRIVER with `argv`, send `signum` once it stalls mid-staging; (exit status, stderr)."""
    marker = tmp_path / "stalled"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(marker), *map(str, argv)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert marker.exists(), f"never reached the stall (exit {proc.returncode}): {err[-3000:]}"
    return proc.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_from_hf_interrupted_mid_checkpoint_leaves_nothing(source, conversion, tmp_path, signum):
    out = tmp_path / "ours"
    shutil.copytree(conversion, out)  # an earlier conversion, replaced only if the new one completes
    before = snapshot(out)
    rc, err = interrupted(tmp_path, signum, "from-hf", source, "--out", out, "--overwrite")
    name = signal.Signals(signum).name
    assert rc == 128 + signum, err
    assert err == f"interrupted by {name}: nothing written to {out}\n", err
    assert snapshot(out) == before and not debris(out)


def test_to_hf_interrupted_mid_read_leaves_nothing(conversion, tmp_path):
    out = tmp_path / "hf"
    rc, err = interrupted(tmp_path, signal.SIGTERM, "to-hf", conversion, "--out", out)
    assert rc == 143 and err == f"interrupted by SIGTERM: nothing written to {out}\n", err
    assert not out.exists() and not debris(out)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_copies_of_dead_processes_are_removed_live_ones_kept(source, conversion, tmp_path):
    out = tmp_path / "ours"
    shutil.copytree(conversion, out)
    dead = dead_pid()
    assert dead != os.getpid()
    stale = [f".ours.from-hf-{dead}-0a1b2c", f".ours.from-hf-{HOST}-{dead}-3d4e5f",
             f".ours.to-hf-{HOST}-{dead}-abcdef", f".ours.old-{HOST}-{dead}-123456"]
    kept = [f".ours.from-hf-{HOST}-{os.getpid()}-fedcba",  # a running conversion's
            f".ours.from-hf-other-host-{dead}-0f0f0f",     # another host's: its pid means nothing here
            f".ours2.from-hf-{HOST}-{dead}-777777",        # another --out's
            f".ours.from-hf-{HOST}-{dead}-notahex"]        # not a name staging writes
    for name in stale + kept:
        (tmp_path / name / "checkpoint").mkdir(parents=True)
        (tmp_path / name / "checkpoint" / "part").write_bytes(b"x" * 1000)
    lines = []
    from_hf(source, out, overwrite=True, log=lines.append)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == sorted(kept), left
    said = f"from-hf: removed what killed conversions left beside {out}: "
    removed = [line for line in lines if line.startswith(said)]
    assert len(removed) == 1 and all(name in removed[0] for name in stale), lines
    assert snapshot(out).keys() == snapshot(conversion).keys()


def test_a_set_aside_old_output_is_kept_while_out_is_missing(source, tmp_path):
    """Killed between a swap's two renames: `out` is absent and the set-aside copy is the only earlier
    output, so it is not stale."""
    out = tmp_path / "ours"
    old = tmp_path / f".ours.old-{HOST}-{dead_pid()}-aaaaaa"
    old.mkdir()
    from_hf(source, out, log=quiet)
    assert old.is_dir() and (out / "recipe.toml").is_file()
