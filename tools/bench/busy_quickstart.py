"""The README's quick start on a busy machine: `python -m moe_lc.train recipes/debug_cpu.toml` while another
process keeps one core busy, then the same alone; wall time and steps/s of each.

    python -m tools.bench.busy_quickstart                       # busy (one core), then idle; 200 steps each
    python -m tools.bench.busy_quickstart --only busy --pin -- --set train.threads=2   # a forced thread count

The busy process is a Python busy loop (`while True: pass`) started `--lead` seconds before training;
`--pin` pins it to the last core of this process's affinity (Linux), else the kernel places it. The
training command is the quick start as written plus `--set train.output_dir=<a temporary folder>` (the
README's run directory may be in use) and anything after `--`. A run past `--timeout` seconds is killed
and reported with the steps it finished. Prints one line per run, with the run's start-up `threads`
line; `--out DIR` also writes results.json.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/busy_quickstart.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.busy_quickstart", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICK_START = [sys.executable, "-m", "moe_lc.train", "recipes/debug_cpu.toml"]


@contextlib.contextmanager
def busy_core(pin: bool, lead_s: float):
    """A process spinning on one core for the duration of the block (started lead_s seconds before)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        if pin and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
        time.sleep(lead_s)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def steps_done(out: Path) -> int:
    log = out / "metrics.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def run_quickstart(extra: list[str], timeout_s: float) -> dict:
    """The quick start in a fresh process: wall seconds, steps finished, first and last loss, its threads line."""
    with tempfile.TemporaryDirectory(prefix="moe_lc_busy_") as tmp:
        out = Path(tmp) / "run"
        cmd = QUICK_START + ["--set", f"train.output_dir={out}", *extra]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = "killed", exc.stdout or "", exc.stderr or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
            if (out / "metrics.jsonl").exists() else []
    threads = next((line.split(" | ")[-1] for line in stdout.splitlines() if "| threads " in line), "?")
    step_s = sum(r["step_time"] for r in rows)
    return {"rc": rc, "wall_s": round(wall, 1), "steps": len(rows), "steps_per_s": round(len(rows) / step_s, 2)
            if step_s else 0.0, "first_loss": rows[0]["loss"] if rows else None,
            "last_loss": rows[-1]["loss"] if rows else None, "threads_line": threads, "command": cmd,
            "stderr_tail": stderr[-400:] if rc not in (0, "killed") else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.busy_quickstart", description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("busy", "idle"), help="one of the two runs (default: busy, then idle)")
    ap.add_argument("--pin", action="store_true", help="pin the busy process to one core (Linux)")
    ap.add_argument("--lead", type=float, default=2.0, help="seconds the busy process runs before training")
    ap.add_argument("--timeout", type=float, default=600.0, help="kill a run after this many seconds")
    ap.add_argument("--out", help="write results.json here")
    ap.add_argument("extra", nargs="*", help="after --: more arguments for the training command")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    results = {"cores": cores, "load_before": os.getloadavg(), "runs": []}
    for mode in ("busy", "idle") if args.only is None else (args.only,):
        busy = busy_core(args.pin, args.lead) if mode == "busy" else contextlib.nullcontext()
        with busy:
            r = dict(mode=mode, pinned=args.pin and mode == "busy", load_at_start=os.getloadavg()[0],
                     **run_quickstart(args.extra, args.timeout))
        results["runs"].append(r)
        print(f"{mode:4s}: {r['wall_s']:.1f} s wall, {r['steps']} steps at {r['steps_per_s']} steps/s, rc {r['rc']}, "
              f"loss {r['first_loss']} -> {r['last_loss']} | {r['threads_line']} | load {r['load_at_start']:.2f} "
              f"at start, {cores} cores{r['stderr_tail'] and chr(10) + r['stderr_tail']}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
