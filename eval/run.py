"""Long-context eval of a checkpoint: retrieval tasks by length (and depth), perplexity by length.

    python -m eval RUN_DIR_or_CHECKPOINT [--recipe RECIPE] [--set KEY=VALUE ...]
        [--tasks passkey,multikey_needle,variable_tracking,perplexity] [--lengths 128,256,512]
        [--depths 0,0.25,0.5,0.75,1] [--samples N] [--seed S] [--task-param KIND.NAME=VALUE ...]
        [--ppl-tokens N] [--stride N] [--batch-size N] [--threads N] [--device auto|cpu|cuda] [--out DIR]
    torchrun --nproc-per-node N -m eval ...      # context parallel: zig-zag ring attention over N ranks

Writes DIR/results.json (every number, the chance levels, the checkpoint and settings),
DIR/<task>_heatmap.png (exact match over needle depth x length, passkey and multikey_needle),
DIR/accuracy_by_length.png and DIR/perplexity.png. --samples is per (length, depth) cell for needle
tasks and per length for variable tracking. Default DIR: <run dir>/eval/step_XXXXXXXX.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from . import perplexity, plots, tasks
from .model_io import checkpoint_step, eval_dims, load_eval_config, load_model, resolve_checkpoint
from moe_lc.checkpoint import CheckpointError
from moe_lc.config import ConfigError
from moe_lc.data import load_tokenizer
from moe_lc.parallel.mesh import exit_process
from moe_lc.preflight import resolve_device

ALL_TASKS = (*tasks.RETRIEVAL_TASKS, "perplexity")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _task_params(items: list[str]) -> dict[str, dict]:
    """['multikey_needle.n_keys=2'] -> {'multikey_needle': {'n_keys': 2}}."""
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        kind, dot, name = key.partition(".")
        if not sep or not dot or kind not in tasks.TASK_IDS:
            raise ValueError(f"--task-param {item!r}: expected KIND.NAME=VALUE with KIND one of {', '.join(tasks.TASK_IDS)}")
        for cast in (int, float):
            try:
                out.setdefault(kind, {})[name] = cast(value)
                break
            except ValueError:
                continue
        else:
            out.setdefault(kind, {})[name] = value
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m eval", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="run directory, checkpoint root, one step_XXXXXXXX directory, or a from-hf directory")
    ap.add_argument("--recipe", help="recipe the model was trained with (default: the run's config.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    ap.add_argument("--tasks", default=",".join(ALL_TASKS), help=f"comma list of {', '.join(ALL_TASKS)}")
    ap.add_argument("--lengths", default="128,256,512", help="context lengths in tokens")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths (0 = start of the context)")
    ap.add_argument("--samples", type=int, default=20, help="samples per (length, depth) cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-param", action="append", default=[], metavar="KIND.NAME=VALUE",
                    help="task parameter, e.g. multikey_needle.n_keys=2")
    ap.add_argument("--ppl-tokens", type=int, default=16384, help="held-out tokens for perplexity")
    ap.add_argument("--stride", type=int, default=256, help="sliding-window stride (capped at length/2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="auto: cuda (cuda:LOCAL_RANK under torchrun) when available")
    ap.add_argument("--out", help="output directory (default: <run dir>/eval/<step dir name>)")
    return ap.parse_args(argv)


def evaluate(args: argparse.Namespace, progress=print) -> dict:
    """Run the eval described by parsed arguments; returns the results (also written to --out)."""
    chosen = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(chosen) - set(ALL_TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(ALL_TASKS)}")
    lengths, depths = _ints(args.lengths), _floats(args.depths)
    if not lengths or min(lengths) < 2 or any(not 0 <= d <= 1 for d in depths) or args.samples < 1:
        raise ValueError("--lengths must be integers >= 2, --depths within [0, 1], --samples >= 1")
    params = _task_params(args.task_param)
    if args.threads:
        torch.set_num_threads(args.threads)
    step_dir, config_path = resolve_checkpoint(args.checkpoint)
    cfg = load_eval_config(config_path, args.recipe, args.set)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    device = resolve_device(args.device)
    # the multi-key needle as trained (data.needle_keys) unless --task-param says otherwise
    params.setdefault("multikey_needle", {}).setdefault("n_keys", cfg.data.needle_keys)
    dims = eval_dims(cfg, device)
    if dims is not None and dims.rank != 0:  # every cp rank computes; rank 0 reports and writes
        progress = lambda *a, **k: None  # noqa: E731
    model = load_model(step_dir, cfg, device, dims=dims)
    out = Path(args.out) if args.out else step_dir.parent.parent / "eval" / step_dir.name
    out.mkdir(parents=True, exist_ok=True)
    progress(f"eval {step_dir} (step {checkpoint_step(step_dir)}) -> {out}"
             + (f" | context parallel over {dims.cp} ranks" if dims is not None else ""))
    start = time.perf_counter()
    results = {"checkpoint": str(step_dir), "step": checkpoint_step(step_dir),
               "recipe": str(args.recipe or config_path), "trained_seq_len": cfg.train.seq_len,
               "tokenizer": tokenizer.name,
               "seed": args.seed, "samples": args.samples, "lengths": lengths, "depths": depths,
               "scoring": "teacher-forced: mean log-prob of the answer tokens; exact = greedy argmax "
                          "reproduces every answer token; token_acc = fraction of answer tokens reproduced",
               "tasks": {}, "files": []}
    for kind in chosen:
        if kind == "perplexity":
            held = perplexity.heldout_tokens(cfg.data, tokenizer, args.ppl_tokens)
            results["tasks"][kind] = perplexity.run_perplexity(model, held, lengths, args.stride, args.batch_size, progress)
        else:
            results["tasks"][kind] = tasks.run_retrieval(model, kind, lengths, depths, args.samples, args.seed,
                                                         tokenizer, args.batch_size, progress, **params.get(kind, {}))
    results["elapsed_s"] = time.perf_counter() - start
    results["context_parallel"] = dims.cp if dims is not None else 1
    if dims is None or dims.rank == 0:
        results["files"] = _draw(results, out)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        progress(f"wrote {out / 'results.json'} and {', '.join(Path(f).name for f in results['files'])}")
    return results


def _draw(results: dict, out: Path) -> list[str]:
    files, label = [], f"step {results['step']} of {Path(results['checkpoint']).parent.parent.name}"
    retrieval = {k: v for k, v in results["tasks"].items() if k in tasks.RETRIEVAL_TASKS}
    for kind, r in retrieval.items():
        if kind in tasks.DEPTH_TASKS and r["grid"]:
            files.append(plots.depth_length_heatmap(r, out / f"{kind}_heatmap.png", f"{kind}: exact match, {label}"))
    if any(r["by_length"] for r in retrieval.values()):
        files.append(plots.accuracy_by_length(retrieval, out / "accuracy_by_length.png", f"retrieval, {label}"))
    ppl = results["tasks"].get("perplexity")
    if ppl and ppl["by_length"]:
        files.append(plots.perplexity_plot(ppl, out / "perplexity.png", f"held-out perplexity, {label}",
                                           results["trained_seq_len"]))
    return [str(f) for f in files]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        evaluate(args)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


def cli() -> None:
    """The `moe-eval` console script (as `python -m eval`)."""
    exit_process(main())
