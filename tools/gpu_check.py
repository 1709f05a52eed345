"""GPU bring-up in one command: what the machine has, install what it lacks, the `gpu` tests, the benchmarks.

    python -m tools.gpu_check [--out DIR] [--wheels DIR | --bundle DIR] [--parts attention,gemm,...] [--quick]
    python -m tools.gpu_check --dry-run [--out DIR]     # on a CPU: proves the whole sequence runs

Steps, each logged to DIR and summarized in DIR/summary.md (a failed step is recorded and the next runs):
  1. env        GPU (nvidia-smi), torch / CUDA / cuDNN, compute capability, which optional kernels import
                (flash-attn 2, flash-attn-4, Transformer Engine) -> env.json
  2. install    flash-attn-4 where it is missing: `pip install flash-attn-4` (wheels only, no compiler), or
                from local wheels with --wheels DIR (for machines without a registry), or from a bundle of
                tools/gpu_bundle.py with --bundle DIR (no registry and a 64 MiB transfer limit). Transformer
                Engine is not installed here: its torch part compiles from source (DEVELOPERS.md says how).
  3. tests      python -m pytest -m gpu -rs                                 -> gpu_tests.log
  4. bench      python tools/bench/run.py --out DIR [--parts ...] [--quick] -> <device>-<date>.{json,md}, bench.log
Step times are printed as they finish; `--steps` picks a subset (e.g. --steps env,tests). The dry run
skips the install and runs the tests (which skip without CUDA, each with its reason) and the benchmark's
--dry-run on tiny CPU shapes.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/gpu_check.py` from a checkout: run as tools.gpu_check
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.gpu_check", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import datetime as _dt
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from moe_lc.job.out_path import out_dir

ROOT = Path(__file__).resolve().parents[1]  # the checkout, or the folder pip installed the packages into
STEPS = ("env", "install", "tests", "bench")
OPTIONAL = {"flash_attn": "flash_attn", "flash_attn4": "flash_attn.cute", "transformer_engine": "transformer_engine"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default runs/gpu_check-<date>)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--wheels", default=None, help="install flash-attn-4 from the wheels in this folder (no registry)")
    ap.add_argument("--bundle", default=None, help="install flash-attn-4 from a tools/gpu_bundle.py bundle")
    ap.add_argument("--parts", default=None, help="benchmark parts (default: all; see tools/bench/run.py)")
    ap.add_argument("--quick", action="store_true", help="the benchmarks' smaller grids")
    ap.add_argument("--bench-arg", action="append", default=[], help="extra argument for tools/bench/run.py")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: tests skip, benchmarks on tiny CPU shapes")
    args = ap.parse_args(argv)
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    return args


def argument_errors(args) -> list[str]:
    """Every mistake in the arguments, found before any step runs: the env and install steps take
    minutes (and install packages) before the benchmark step would have read a bad --parts."""
    from .bench.run import PARTS

    errors = []
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown or not args.steps:
        errors.append(f"--steps: unknown step(s) {', '.join(unknown) or '(none given)'}; "
                      f"choose from {', '.join(STEPS)}")
    parts = [p.strip() for p in (args.parts or "").split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or (args.parts is not None and not parts):
        errors.append(f"--parts: unknown part(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(PARTS)}")
    for flag, folder in (("--wheels", args.wheels), ("--bundle", args.bundle)):
        if folder is not None and not Path(folder).is_dir():
            errors.append(f"{flag} {folder}: not a directory")
    if args.wheels and args.bundle:
        errors.append("--wheels and --bundle: give one of them")
    bench = _bench_argument_error(_bench_argv(args, Path(".")))
    if bench and not bad:
        errors.append(f"--bench-arg: {bench}")
    return errors


def _bench_argument_error(argv: list[str]) -> str | None:
    """The benchmark runner's own complaint about `argv` (its parser, quietly), or None."""
    import contextlib
    import io

    from .bench.run import parse_args as bench_parse_args

    text = io.StringIO()
    try:
        with contextlib.redirect_stderr(text):
            bench_parse_args(argv)
    except SystemExit:
        lines = [ln for ln in text.getvalue().splitlines() if "error:" in ln]
        return lines[-1].split("error:", 1)[1].strip() if lines else text.getvalue().strip()
    return None


def importable(module: str) -> str | None:
    """The module's version if it imports (the error's first line if it is present but broken), else None."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - installed but broken is worth saying
        return f"broken: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    version = getattr(mod, "__version__", None)
    if module == "flash_attn.cute":
        from importlib.metadata import PackageNotFoundError, version as dist_version
        try:
            version = dist_version("flash-attn-4")
        except PackageNotFoundError:
            pass
    return str(version or "present")


def env_report() -> dict:
    import torch

    report = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "python": sys.version.split()[0],
              "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
              "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
              "optional": {name: importable(mod) for name, mod in OPTIONAL.items()}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report.update(device=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                      sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
        from moe_lc.job.metrics import peak_tflops_of
        from moe_lc.ops.attention import available_backends, get_backend
        report["peak_tflops"] = peak_tflops_of(report["device"])
        report["attention_backends"] = available_backends("cuda")
        report["attention_auto"] = get_backend("auto", "cuda").name
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True)
        report["nvidia_smi"] = (out.stdout or out.stderr).strip()
    return report


def install(args, out: Path) -> dict:
    """flash-attn-4 where it is missing; returns what was done."""
    if importable("flash_attn.cute") and not importable("flash_attn.cute").startswith("broken"):
        return {"flash_attn4": "already importable"}
    te = "not installed (its torch part builds from source; see DEVELOPERS.md)"
    if args.bundle:
        from .gpu_bundle import unpack

        where = unpack(Path(args.bundle))
        importlib.invalidate_caches()
        return {"flash_attn4": f"unpacked into {where}: {importable('flash_attn.cute')}", "transformer_engine": te}
    cmd = [sys.executable, "-m", "pip", "install", "--progress-bar=off", "flash-attn-4"]
    if args.wheels:  # offline: flash-attn-4 and its dependencies from the folder
        cmd += ["--no-index", "--find-links", args.wheels]
    done = run_logged(cmd, out / "install.log")
    importlib.invalidate_caches()
    return {"flash_attn4": "installed" if done == 0 and importable("flash_attn.cute") else f"pip exit {done}",
            "transformer_engine": te}


def run_logged(cmd: list[str], log: Path, cwd: Path | None = None) -> int:
    """Run cmd (in the working folder unless `cwd`), stream its output to the console and to `log`; returns
    the exit code. The child imports the packages this tool runs from (the checkout, or the installed ones)."""
    print(f"$ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with log.open("w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
            f.flush()
        return proc.wait()


def main(argv=None) -> int:
    """Exit status 0, 1 when a step failed, 2 with one `error: ` line for bad arguments (nothing ran)."""
    args = parse_args(argv)
    try:
        errors = argument_errors(args)
        if errors:
            raise ValueError("; ".join(errors))
        out = out_dir("--out", args.out or Path("runs") / f"gpu_check-{_dt.date.today().isoformat()}").resolve()
    except ValueError as exc:  # OutPathError too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    summary, status = [f"# GPU bring-up ({'DRY RUN on CPU' if args.dry_run else 'GPU'}), {_dt.datetime.now():%Y-%m-%d %H:%M}", ""], 0
    for step in args.steps:
        t0 = time.perf_counter()
        print(f"\n==== gpu_check: {step} ====", flush=True)
        try:
            note = STEP_FUNCS[step](args, out)
        except Exception as exc:  # noqa: BLE001 - one broken step must not stop the others
            note, status = f"FAILED: {type(exc).__name__}: {exc}", 1
        if isinstance(note, str) and note.startswith("FAILED"):
            status = 1
        line = f"- {step}: {note} ({time.perf_counter() - t0:.0f} s)"
        summary.append(line)
        print(f"==== {line[2:]}", flush=True)
        (out / "summary.md").write_text("\n".join(summary) + "\n")
    print("\n" + "\n".join(summary), flush=True)
    return status


def _step_env(args, out: Path) -> str:
    report = env_report()
    (out / "env.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return f"{report.get('device', 'no GPU')}; torch {report['torch']} CUDA {report['cuda']}; optional {report['optional']}"


def _step_install(args, out: Path) -> str:
    if args.dry_run:
        return "skipped (dry run)"
    return str(install(args, out))


def _step_tests(args, out: Path) -> str:
    if not (ROOT / "tests" / "test_gpu.py").is_file():
        return "skipped: the gpu tests ship with the moe_lc checkout, not the installed package (run it in one)"
    # in the checkout: its tests with its pytest settings (pyproject.toml); -p no:cacheprovider writes nothing there
    code = run_logged([sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider"],
                      out / "gpu_tests.log", cwd=ROOT)
    tail = (out / "gpu_tests.log").read_text().strip().splitlines()[-1:]
    verdict = "passed" if code == 0 else f"FAILED (pytest exit {code})"
    return f"{verdict}: {tail[0] if tail else ''}"


def _bench_argv(args, out: Path) -> list[str]:
    argv = ["--out", str(out)] + (["--dry-run"] if args.dry_run else [])
    argv += ["--parts", args.parts] if args.parts else []
    argv += ["--quick"] if args.quick else []
    return argv + list(args.bench_arg)


def _step_bench(args, out: Path) -> str:
    # as a module of this package (tools.bench.run, or moe_lc_tools.bench.run when installed): no path
    # that holds only in a checkout
    cmd = [sys.executable, "-m", f"{__package__ or 'tools'}.bench.run", *_bench_argv(args, out)]
    code = run_logged(cmd, out / "bench.log")
    return "done" if code == 0 else f"FAILED (exit {code})"


STEP_FUNCS = {"env": _step_env, "install": _step_install, "tests": _step_tests, "bench": _step_bench}


if __name__ == "__main__":
    sys.exit(main())
