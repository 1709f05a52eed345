"""GPU benchmark suite for moe_lc: attention, GEMM (bf16 / FP8), grouped GEMM, a full training step.

    python tools/bench/run.py                                   # every part on the GPU
    python tools/bench/run.py --quick                           # a smaller grid of every part
    python tools/bench/run.py --parts attention,gemm --quick    # some parts; results merge into one file
    python tools/bench/run.py --parts model_step --profile      # + a torch.profiler kernel table
    python tools/bench/run.py --dry-run --out DIR               # tiny shapes on CPU: proves the script runs

What each part measures, and its FLOP formula, is in the docstring of tools/bench/<part>.py.
Results: tools/bench/results/<device-slug>-<YYYY-MM-DD>.json and a markdown table (.md) beside it,
naming device, torch / CUDA / cuDNN versions, date and the backends available (flash-attn and
Transformer Engine are used only when importable). Running some parts again on the same day
replaces those parts in the file and keeps the others (--fresh starts a new file). The file is
rewritten after every measurement (the .md after every part), so a run cut short keeps what it
finished (a part cut short is marked "partial"). A measurement that fails
(OOM, an unsupported kernel) is stored as an error entry and the run goes on; after an OOM the CUDA
cache is emptied. --dry-run writes to --out (default: a new temporary directory), never to results/;
installed without a checkout (`moe-bench`), the default --out is ./bench_results and the recipes the
parts read (gemm, layer, model_step) are given with --recipe.
Long-sequence model steps fragment memory less with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(not set here: the trainer does not set it either). Run times are not measured yet; under a
per-command time limit, run the parts one by one (they merge into the same file).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/run.py` from a checkout: run as tools.bench.run
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.run", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_lc.job.out_path import out_dir
from .common import (
    RESULTS_DIR, Context, Recorder, Timing, device_facts, free_memory, slug, write_json, write_markdown)

ROOT = Path(__file__).resolve().parents[2]

PARTS = ("attention", "gemm", "grouped_gemm", "model_step", "layer", "dsa_attention", "fp8_linear", "moe_layer")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python tools/bench/run.py", description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, 1 warm-up + 1 timed call")
    ap.add_argument("--out", default=None, help="results directory (default tools/bench/results; dry run: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="a smaller grid of each part")
    ap.add_argument("--profile", action="store_true", help="model_step: torch.profiler top-25 kernel table")
    ap.add_argument("--recipe", action="append", default=[],
                    help="recipe(s) for gemm shapes and model_step (repeatable; model_step takes the first)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="model_step: extra recipe override, e.g. --set model.n_layers=4 (repeatable)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per measurement (default 3)")
    ap.add_argument("--iters", type=int, default=None, help="max timed calls per measurement (default 20)")
    ap.add_argument("--max-s", type=float, default=None, help="stop timing a measurement after this many s (1.0)")
    ap.add_argument("--fresh", action="store_true", help="do not merge into an existing results file of the day")
    args = ap.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    # a recipe named from where the command runs; the parts read the rest from the checkout (ROOT)
    args.recipe = [str(Path(r).resolve()) if Path(r).is_file() else r for r in args.recipe]
    return args


def recipe_error(args) -> str | None:
    """The first recipe a chosen part would read that is not there (the defaults live in the checkout's
    recipes/, which an installed package does not have), as one line naming --recipe."""
    from . import gemm, layer, model_step

    defaults = {"gemm": list(gemm.DEFAULT_RECIPES[:1] if args.dry_run else gemm.DEFAULT_RECIPES),
                "layer": [layer.DEFAULT_RECIPE], "model_step": [model_step.DEFAULT_RECIPE]}
    for part in (p for p in args.parts if p in defaults):
        for recipe in (args.recipe[:1] if part != "gemm" else args.recipe) or defaults[part]:
            if not (ROOT / recipe).is_file():
                why = "" if args.recipe else " (a default: the recipes ship with the moe_lc checkout, not the package)"
                return f"--parts {part} reads {recipe}, which is not there{why}; give --recipe PATH"
    return None


def make_context(args) -> Context:
    if args.dry_run:
        timing = Timing(warmup=1, iters=1, min_iters=1, max_s=0.0)
        device = torch.device("cpu")
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    else:
        timing = Timing(warmup=3, iters=20, min_iters=3, max_s=1.0)
        device = torch.device("cuda", torch.cuda.current_device())
    for name in ("warmup", "iters", "max_s"):
        if getattr(args, name) is not None:
            setattr(timing, name, getattr(args, name))
    return Context(device=device, dry_run=args.dry_run, quick=args.quick, profile=args.profile, timing=timing,
                   recipes=list(args.recipe), model_sets=list(args.set))


def output_paths(args, facts: dict) -> tuple[Path, Path]:
    """(results JSON, markdown) in --out, made; ValueError (OutPathError too) naming --out."""
    if args.dry_run:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="moe_lc_bench_"))
        if out.resolve().is_relative_to(RESULTS_DIR.resolve()):
            raise ValueError(f"--dry-run must not write into {RESULTS_DIR} (dry-run numbers are meaningless)")
    else:  # the checkout's results folder, or (an installed package) one where the command runs
        out = Path(args.out) if args.out else RESULTS_DIR if (ROOT / "recipes").is_dir() else Path("bench_results")
    out = out_dir("--out", out)
    stem = f"{slug(facts['device'])}-{facts['date']}" + ("-dry-run" if args.dry_run else "")
    return out / f"{stem}.json", out / f"{stem}.md"


def part_key(part: str, args) -> str:
    """Where a part's results go: its name, plus the recipe / --set options that change what it measures
    (so e.g. a model_step re-run with another vocabulary sits beside the default one)."""
    options = ([f"recipe={r}" for r in args.recipe] if part in ("gemm", "model_step", "layer") else []) + \
        ([f"set={s}" for s in args.set] if part == "model_step" else [])
    return f"{part}[{';'.join(options)}]" if options else part


def load_previous(path: Path, fresh: bool) -> dict:
    if fresh or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU here: run with --dry-run (tiny shapes on CPU) to check the script", file=sys.stderr)
        return 2
    problem = recipe_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    ctx = make_context(args)
    facts = device_facts(ctx.device)
    ctx.peak = facts["peak_tflops"]
    try:
        json_path, md_path = output_paths(args, facts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ctx.work_dir = json_path.parent / "work" if args.dry_run else Path(tempfile.mkdtemp(prefix="moe_lc_bench_"))
    previous = load_previous(json_path, args.fresh)
    results = {"meta": {**facts, "dry_run": args.dry_run, "quick": args.quick, "argv": sys.argv[1:] if argv is None
                        else list(argv), "timing": vars(ctx.timing),
                        "runs": previous.get("meta", {}).get("runs", [])},
               "parts": previous.get("parts", {})}
    print(f"moe_lc bench | {facts['device']} | torch {facts['torch']} CUDA {facts['cuda']} | backends "
          f"{facts['backends']} | peak {facts['peak_tflops']} | parts {','.join(args.parts)} | -> {json_path}",
          flush=True)
    t_start = time.perf_counter()
    for part in args.parts:
        key = part_key(part, args)
        body = {"entries": [], "partial": True}
        results["parts"][key] = body

        # the JSON after every measurement: a run killed mid-part keeps what it measured
        rec = Recorder(key, ctx.device, on_entry=lambda: write_json(json_path, results))
        body["entries"] = rec.entries
        t0 = time.perf_counter()
        try:
            importlib.import_module(f"{__package__}.{part}").run(ctx, rec)
        except Exception as exc:  # noqa: BLE001 - a broken part must not lose the others
            body["error"] = f"{type(exc).__name__}: {str(exc).strip()[:1000]}"
            print(f"[{key}] PART FAILED: {body['error']}", flush=True)
        free_memory(ctx.device)
        body.pop("partial")
        body.update(wall_s=time.perf_counter() - t0, quick=args.quick, date=facts["started"])
        _write(results, json_path, md_path)
        n_err = sum(e.get("status") == "error" for e in rec.entries)
        print(f"[{key}] done: {len(rec.entries)} measurements, {n_err} errors, {body['wall_s']:.1f}s", flush=True)
    results["meta"]["runs"].append({"parts": args.parts, "started": facts["started"], "quick": args.quick,
                                    "wall_s": time.perf_counter() - t_start})
    _write(results, json_path, md_path)
    print(f"wrote {json_path} and {md_path} ({time.perf_counter() - t_start:.1f}s)", flush=True)
    return 0


def _write(results: dict, json_path: Path, md_path: Path) -> None:
    write_json(json_path, results)
    renderers = {}
    for key in results["parts"]:
        try:
            mod = importlib.import_module(f"{__package__}.{key.split('[')[0]}")
            renderers[key] = (mod.COLUMNS, getattr(mod, "extra_markdown", None))
        except Exception:  # noqa: BLE001 - the JSON is already written; the table is a convenience
            renderers[key] = (None, None)
    write_markdown(md_path, results, renderers)


if __name__ == "__main__":
    sys.exit(main())
