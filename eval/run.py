"""Long-context eval of a checkpoint: retrieval tasks by length (and depth), perplexity by length.

    python -m eval RUN_DIR_or_CHECKPOINT [--recipe RECIPE] [--set KEY=VALUE ...]
        [--tasks passkey,multikey_needle,variable_tracking,perplexity | ruler | niah_single_1,...]
        [--lengths 128,256,512] [--depths 0,0.25,0.5,0.75,1] [--samples N] [--seed S]
        [--task-param TASK.NAME=VALUE ...] [--haystack TEXT_FILE_or_TOKEN_FILE] [--squad JSONL]
        [--hotpotqa JSONL] [--gen-tokens N] [--ppl-tokens N] [--stride N] [--batch-size N] [--threads N]
        [--device auto|cpu|cuda] [--out DIR] [--overwrite]
    torchrun --nproc-per-node N -m eval ...      # context parallel: zig-zag ring attention over N ranks

Writes DIR/results.json (every number, the chance levels, the checkpoint, haystack and settings, and
the summary table), DIR/summary.png (that table), DIR/<task>_heatmap.png (exact match over needle depth x
length, passkey and multikey_needle), DIR/accuracy_by_length.png and DIR/perplexity.png. --samples is
per (length, depth) cell for needle tasks and per length for the others. Default DIR: <run
dir>/eval/step_XXXXXXXX. RULER's tasks (eval/ruler.py; `ruler` = all 13) are scored by string match
over a greedy generation with a KV cache (eval/ruler_run.py, moe_lc/model/decode.py); under torchrun the
prompt runs through the ring and every rank decodes on the gathered cache.

A DIR that holds an earlier eval's outputs is refused (nothing is loaded); --overwrite replaces them,
removing the earlier results.json and figures once the new numbers exist (eval/outputs.py). Every
mistake a user can fix (flags, paths, recipe, checkpoint vs recipe, device) is one `error:` line and
exit status 2, reported before the model is built (eval/inputs.py). One progress line per (task,
length) as it finishes: `[done/total elapsed] task length L: scores`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moe_lc.cpu_threads import apply_threads, passive_wait_if_shared

passive_wait_if_shared()  # before torch loads the OpenMP runtime, which reads the policy once (cpu_threads.py)
import torch  # noqa: E402

from . import perplexity, plots, ruler_run, tasks
from .haystack import load_haystack
from .inputs import ALL_TASKS, Inputs, UsageError, check_inputs
from .ruler import NEEDS_HAYSTACK, RULER_TASKS
from .summary import markdown, summary_table
from .model_io import check_fit, checkpoint_step, eval_dims, load_eval_config, load_model, resolve_checkpoint
from .outputs import clear_earlier, earlier_outputs, open_output, write_results
from moe_lc.job.checkpoint import CheckpointError
from moe_lc.config import ConfigError
from moe_lc.data import load_tokenizer
from moe_lc.parallel.mesh import exit_process
from moe_lc.job.preflight import resolve_device

DEFAULT_TASKS = (*tasks.RETRIEVAL_TASKS, "perplexity")


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one `error:` line (UsageError), like every other mistake here,
    instead of the usage block and a SystemExit from inside parse_args."""

    def error(self, message):
        raise UsageError([f"{message} (see python -m eval --help)"])


def parse_args(argv=None) -> argparse.Namespace:
    ap = _Parser(prog="python -m eval", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="run directory, checkpoint root, one step_XXXXXXXX directory, or a from-hf directory")
    ap.add_argument("--recipe", help="recipe the model was trained with (default: the run's config.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                    help=f"comma list of {', '.join(ALL_TASKS)}; ruler = RULER's 13 tasks")
    ap.add_argument("--lengths", default="128,256,512", help="context lengths in tokens")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths (0 = start of the context) of passkey and multikey_needle (RULER's tasks "
                         "draw RULER's depths)")
    ap.add_argument("--samples", type=int, default=20, help="samples per (length, depth) cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-param", action="append", default=[], metavar="TASK.NAME=VALUE",
                    help="task parameter, e.g. multikey_needle.n_keys=2")
    ap.add_argument("--haystack", help="text file or token-file prefix for the real-text haystack "
                                       "(default: the standard library's docstrings, eval/haystack.py)")
    ap.add_argument("--squad", help="SQuAD questions as JSON lines, for qa_1 (eval/ruler_qa.py); without it "
                                    "qa_1 is skipped")
    ap.add_argument("--hotpotqa", help="HotpotQA questions as JSON lines, for qa_2; without it qa_2 is skipped")
    ap.add_argument("--gen-tokens", type=int, default=0,
                    help="cap on the tokens generated per RULER sample (0 = RULER's budget: niah 128, vt 30, "
                         "cwe 120, fwe 50, qa 32)")
    ap.add_argument("--ppl-tokens", type=int, default=16384, help="held-out tokens for perplexity")
    ap.add_argument("--stride", type=int, default=256, help="sliding-window stride (capped at length/2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0 = auto: OMP_NUM_THREADS if set, else the idle cores; "
                         "moe_lc/cpu_threads.py)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="auto: cuda (cuda:LOCAL_RANK under torchrun) when available")
    ap.add_argument("--out", help="output directory (default: <run dir>/eval/<step dir name>)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier eval's results.json and figures in the output directory")
    return ap.parse_args(argv)


def say(line: str) -> None:
    """Print now: under a pipe (tools/extend.py) stdout is block-buffered and would sit silent for minutes."""
    print(line, flush=True)


class CellProgress:
    """Numbers the one line run_retrieval / run_perplexity give per (task, length) as it finishes:
    `[3/12 1m05s] passkey length 512: ...`, so a long eval shows how far it is."""

    def __init__(self, total: int, write=say):
        self.total, self.done, self.write, self.start = total, 0, write, time.perf_counter()

    def __call__(self, line: str) -> None:
        self.done += 1
        elapsed = int(time.perf_counter() - self.start)
        self.write(f"[{self.done}/{self.total} {elapsed // 60}m{elapsed % 60:02d}s] {line.strip()}")


def evaluate(args: argparse.Namespace, progress=say) -> dict:
    """Run the eval described by parsed arguments; returns the results (also written to the output
    folder). Every check that needs no model (arguments, checkpoint, recipe, output folder, the
    checkpoint's tensors against the recipe's) runs before the model is built."""
    inputs = check_inputs(args)
    threads = apply_threads(args.threads, "--threads")
    step_dir, config_path = resolve_checkpoint(args.checkpoint)
    cfg = load_eval_config(config_path, args.recipe, args.set)
    check_fit(step_dir, cfg)  # before a process group or a model exists (load_model checks again)
    out = Path(args.out) if args.out else step_dir.parent.parent / "eval" / step_dir.name
    problem = open_output(out, args.overwrite)
    if problem:
        raise UsageError([problem])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    device = resolve_device(args.device)
    # the multi-key needle as trained (data.needle_keys) unless --task-param says otherwise
    inputs.params.setdefault("multikey_needle", {}).setdefault("n_keys", cfg.data.needle_keys)
    dims = eval_dims(cfg, device)
    if dims is not None and dims.rank != 0:  # every cp rank computes; rank 0 reports and writes
        progress = lambda *a, **k: None  # noqa: E731
    cells = len(inputs.tasks) * len(inputs.lengths)
    progress(f"eval {step_dir} (step {checkpoint_step(step_dir)}) -> {out}: {len(inputs.tasks)} task(s) x "
             f"{len(inputs.lengths)} length(s) = {cells} cells | {threads.describe()}"
             + (f" | context parallel over {dims.cp} ranks" if dims is not None else ""))
    essay = [t for t in inputs.tasks if t in NEEDS_HAYSTACK or inputs.params.get(t, {}).get("type_haystack") == "essay"]
    haystack = load_haystack(args.haystack, tokenizer) if essay else None
    model = load_model(step_dir, cfg, device, dims=dims)
    start, cell = time.perf_counter(), CellProgress(cells, progress)
    results = {"checkpoint": str(step_dir), "step": checkpoint_step(step_dir),
               "recipe": str(args.recipe or config_path), "trained_seq_len": cfg.train.seq_len,
               "tokenizer": tokenizer.name, "seed": args.seed, "samples": args.samples,
               "lengths": inputs.lengths, "depths": inputs.depths,
               "scoring": "teacher-forced: mean log-prob of the answer tokens; exact = greedy argmax "
                          "reproduces every answer token; token_acc = fraction of answer tokens reproduced",
               "tasks": {}, "files": []}
    if any(t in RULER_TASKS for t in inputs.tasks):
        results["scoring_ruler"] = ("RULER tasks: string match (RULER's string_match_all, qa: string_match_part; "
                                    "0-1) of the greedy generation with a KV cache; teacher-forced exact match "
                                    "beside it where the answer is one fixed text (eval/ruler_run.py)")
        results["haystack"] = haystack.describe() if haystack is not None else None
        results["qa_data"] = {name: data.path for name, data in inputs.qa.items()}
    for kind in inputs.tasks:
        results["tasks"][kind] = _score(kind, model, inputs, args, cfg, tokenizer, cell, haystack)
    results["summary"] = summary_table(results["tasks"], inputs.lengths)
    results["elapsed_s"] = time.perf_counter() - start
    results["context_parallel"] = dims.cp if dims is not None else 1
    if dims is None or dims.rank == 0:
        _write(results, out, args.overwrite, progress)
    return results


def _score(kind: str, model, inputs: Inputs, args: argparse.Namespace, cfg, tokenizer, cell: CellProgress,
           haystack=None) -> dict:
    """One task over every length (`cell` is called once per length)."""
    if kind in RULER_TASKS:
        return ruler_run.run_ruler(model, kind, inputs.lengths, args.samples, args.seed, tokenizer, haystack, inputs.qa,
                                   args.batch_size, args.gen_tokens, cell, **inputs.params.get(kind, {}))
    if kind == "perplexity":
        held = perplexity.heldout_tokens(cfg.data, tokenizer, args.ppl_tokens)
        return perplexity.run_perplexity(model, held, inputs.lengths, args.stride, args.batch_size, cell)
    return tasks.run_retrieval(model, kind, inputs.lengths, inputs.depths, args.samples, args.seed, tokenizer,
                               args.batch_size, cell, **inputs.params.get(kind, {}))


def _free_sibling(out: Path) -> Path:
    """out_2, out_3, ...: the first that holds no eval."""
    k = 2
    while earlier_outputs(out.with_name(f"{out.name}_{k}")):
        k += 1
    return out.with_name(f"{out.name}_{k}")


def _write(results: dict, out: Path, overwrite: bool, say_line) -> None:
    """Figures, then results.json, into `out`; --overwrite first removes the earlier eval's outputs (only
    now, so a failed eval keeps them). An eval that landed in `out` while this one ran is kept too."""
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        removed = clear_earlier(out)
        if removed:
            say_line(f"--overwrite: removed the earlier eval's {', '.join(p.name for p in removed)} from {out}")
    elif earlier_outputs(out):
        moved = _free_sibling(out)
        say_line(f"{out} gained another eval's results while this one ran; writing to {moved} instead")
        out = moved
        out.mkdir(parents=True, exist_ok=True)
    results["files"] = _draw(results, out)
    path = write_results(out, results)
    if results["summary"]["rows"]:
        say_line(markdown(results["summary"]))
    say_line(f"wrote {', '.join([str(path), *(Path(f).name for f in results['files'])])}")


def _draw(results: dict, out: Path) -> list[str]:
    files, label = [], f"step {results['step']} of {Path(results['checkpoint']).parent.parent.name}"
    retrieval = {k: v for k, v in results["tasks"].items() if k in tasks.RETRIEVAL_TASKS}
    for kind, r in retrieval.items():
        if kind in tasks.DEPTH_TASKS and r["grid"]:
            files.append(plots.depth_length_heatmap(r, out / f"{kind}_heatmap.png", f"{kind}: exact match, {label}"))
    if any(r["by_length"] for r in retrieval.values()):
        files.append(plots.accuracy_by_length(retrieval, out / "accuracy_by_length.png", f"retrieval, {label}"))
    if results["summary"]["rows"]:
        files.append(plots.summary_figure(results["summary"], out / "summary.png", label))
    ppl = results["tasks"].get("perplexity")
    if ppl and ppl["by_length"]:
        files.append(plots.perplexity_plot(ppl, out / "perplexity.png", f"held-out perplexity, {label}",
                                           results["trained_seq_len"]))
    return [str(f) for f in files]


def main(argv=None) -> int:
    """Exit status 0, or 2 with one `error: ...` line per mistake (no traceback) for anything a user can fix."""
    try:
        evaluate(parse_args(argv))
    except (UsageError, ConfigError) as exc:  # several mistakes, one line each
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


def cli() -> None:
    """The `moe-eval` console script (as `python -m eval`)."""
    exit_process(main())
