"""Staged long-context extension, end to end: train each stage from the previous one, eval after each.

    python tools/extend.py [STAGE.toml ...] [--runs DIR] [--out DIR] [--set KEY=VALUE ...]
                           [--lengths 128,...,8192] [--samples N] [--eval-only] [--reuse-scores]
                           [--no-yarn-inference]

Default stages: the checkout's recipes/longctx/base.toml -> extend_2k.toml -> extend_4k.toml (256 -> 2K ->
4K tokens on CPU, DeepSeek-V3's 4K -> 32K -> 128K recipe in miniature); an installed package has no
recipes/, so there the stages are given. Paths are the user's: STAGE, --runs and --out relative to the
working folder, and the trainer and the eval run in that folder, so a recipe's or a --set's relative
paths (data.path, ...) resolve there as under moe-train (`extends` relative to the recipe's own folder).
For each stage, in order:
  1. train: `python -m moe_lc.train STAGE` (through torchrun with pp x cp x tp x dp ranks) with
     train.output_dir = RUNS/<stage name> and, after the first, checkpoint.init_from = the previous
     stage's checkpoints: weights only, fresh optimizer, step and data, as DeepSeek-V3's extension
     phases start. A stage whose metrics.jsonl already holds every step is not trained again (its
     logged step times are summed for the summary).
  2. eval: `python -m eval RUNS/<stage>` over --lengths (passkey and the multi-key needle over needle
     depths, held-out perplexity) into OUT/<stage>/. With --reuse-scores, a stage whose results.json
     already scores its final checkpoint with the same lengths, samples and tasks is not scored again
     (a chain restarted after an interruption re-scores only what changed).
After the first stage, the same checkpoint is also scored with the last stage's YaRN factor and no
training ("YaRN at inference", as in the YaRN paper's figures) into OUT/<first stage>_yarn_x<factor>/.
Finally OUT/longctx.png (passkey exact match by length for every stage, the last stage's depth x
length heatmap, perplexity by length) and OUT/summary.md (the numbers, wall times, commands).

Stopped (Ctrl-C, SIGTERM) the running step is stopped too (SIGTERM: the trainer checkpoints after its
step), a log that received nothing is removed with the folders made for it, and the exit status is 130 or
143; the same command continues the chain (finished stages are skipped, a stage resumes its checkpoint).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/extend.py` from a checkout: run as tools.extend
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.extend", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import importlib

from moe_lc.config import ConfigError, load_config
from moe_lc.job.out_path import OutPathError, unwritable

from .ablate import command, is_complete

ROOT = Path(__file__).resolve().parents[1]  # the checkout, or the folder pip installed the packages into
# the eval harness beside this package: `eval` in a checkout, `moe_lc_eval` where pip installed the tools
EVAL = "eval" if __package__ == "tools" else "moe_lc_eval"
plots = importlib.import_module(f"{EVAL}.plots")

DEFAULT_STAGES = tuple(str(ROOT / "recipes" / "longctx" / f) for f in ("base.toml", "extend_2k.toml", "extend_4k.toml"))
DEFAULT_LENGTHS = "128,256,512,1024,2048,4096,8192"
STOP_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as a process killed by it reports


class Stopped(Exception):
    """SIGTERM arrived: raised where the chain is, so the running step is stopped and cleaned up (`_run`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Stage:
    """One training stage: its recipe, overrides (the chain's output_dir and init_from) and eval output."""

    name: str
    recipe: str
    overrides: list[str]
    nproc: int
    steps: int
    seq_len: int
    rope: dict
    run_dir: Path
    eval_dir: Path
    wall_s: dict = field(default_factory=dict)


def plan_stages(recipes: list[str], runs: Path, out: Path, sets: list[str]) -> list[Stage]:
    """The chain: each stage's overrides, rank count and directories; ConfigError names a bad recipe."""
    stages: list[Stage] = []
    for recipe in recipes:
        name = Path(recipe).stem
        # resume: a stage stopped half-way continues from its checkpoint (or starts over from init_from)
        overrides = [*sets, f"train.output_dir={runs / name}", "checkpoint.resume=true"]
        if stages:
            overrides.append(f"checkpoint.init_from={stages[-1].run_dir / 'checkpoints'}")
        raw = load_config(recipe, overrides, check=False).parallel
        nproc = raw.pp * raw.cp * raw.tp * max(raw.dp, 1)
        cfg = load_config(recipe, overrides, world_size=nproc)
        if cfg.checkpoint.interval == 0 or cfg.train.steps % cfg.checkpoint.interval:
            raise ConfigError([f"{recipe}: checkpoint.interval={cfg.checkpoint.interval} must divide "
                               f"train.steps={cfg.train.steps}: the next stage starts from the final checkpoint"])
        rope = {"scaling": cfg.model.rope.scaling, "factor": cfg.model.rope.factor,
                "original_seq_len": cfg.model.rope.original_seq_len}
        stages.append(Stage(name, recipe, overrides, nproc, cfg.train.steps, cfg.train.seq_len, rope,
                            runs / name, out / name))
    return stages


def eval_command(checkpoint: Path, out: Path, args, sets: list[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", EVAL, str(checkpoint), "--out", str(out), "--overwrite", "--lengths", args.lengths,
           "--samples", str(args.samples), "--tasks", args.tasks, "--ppl-tokens", str(args.ppl_tokens)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def yarn_inference_sets(first: Stage, last: Stage) -> list[str]:
    """Score the first stage's weights with the last stage's YaRN (factor and original length)."""
    return ["model.rope.scaling=yarn", f"model.rope.factor={last.rope['factor']}",
            f"model.rope.original_seq_len={last.rope['original_seq_len']}"]


def _run(cmd: list[str], log: Path, echo) -> float:
    """Run cmd in the working folder with its output teed to log and to the console; raises on failure;
    returns wall seconds. Stopped (KeyboardInterrupt, Stopped), the child is stopped too, and a log that
    received nothing is removed with the folders made for it."""
    echo("$ " + " ".join(cmd))
    made = _missing_dirs(log.parent)
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # the children import the moe_lc (and eval) this tool runs from: the checkout, or the installed packages
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        with open(log, "w") as f, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True) as proc:
            try:
                for line in proc.stdout:
                    f.write(line)
                    echo("  " + line.rstrip())
            except BaseException:
                _stop(proc)
                raise
    except BaseException:
        _remove_empty(log, made)
        raise
    if proc.returncode:
        raise RuntimeError(f"{cmd[2] if len(cmd) > 2 else cmd[0]} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start


def _stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """End a child this tool was stopped in the middle of: SIGTERM (the trainer saves a checkpoint after
    its step and exits; torchrun passes it to every rank), then SIGKILL after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _missing_dirs(folder: Path) -> list[Path]:
    """The folders `folder.mkdir(parents=True)` would make, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty(log: Path, made: list[Path]) -> None:
    """What a step stopped before it wrote anything leaves: its empty log and the folders made for it."""
    if log.is_file() and log.stat().st_size == 0:
        log.unlink()
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # something was written there
            break


def _write(path: Path, text: str) -> None:
    """path's new text in one step (a temporary beside it, renamed over it): a stop leaves the old or the new."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_pipeline(stages: list[Stage], out: Path, args, echo=print) -> dict:
    """Train and eval every stage; returns the summary written to OUT/summary.json."""
    summary = {"stages": [], "commands": []}
    yarn_dir = None
    for i, stage in enumerate(stages):
        cmd = command(stage.recipe, stage.overrides, stage.nproc)
        summary["commands"].append(shown(cmd))
        if not args.eval_only and not is_complete(stage.run_dir, stage.steps):
            stage.wall_s["train"] = _run(cmd, stage.run_dir / "train.log", echo)
        else:  # trained before: its own step times
            stage.wall_s["train (sum of step times)"] = train_seconds(stage.run_dir)
        cmd = eval_command(stage.run_dir, stage.eval_dir, args)
        if args.reuse_scores and scored(stage, args):
            echo(f"{stage.name}: {stage.eval_dir / 'results.json'} scores step {stage.steps} already (--reuse-scores)")
            stage.wall_s["eval (earlier)"] = _results(stage.eval_dir)["elapsed_s"]
        else:
            stage.wall_s["eval"] = _run(cmd, stage.eval_dir / "eval.log", echo)
        summary["commands"].append(shown(cmd))
        if i == 0 and len(stages) > 1 and args.yarn_inference:
            yarn_dir = out / f"{stage.name}_yarn_x{stages[-1].rope['factor']:g}"
            cmd = eval_command(stage.run_dir, yarn_dir, args, yarn_inference_sets(stage, stages[-1]))
            stage.wall_s["eval_yarn_inference"] = _run(cmd, yarn_dir / "eval.log", echo)
            summary["commands"].append(shown(cmd))
        summary["stages"].append({"name": stage.name, "recipe": stage.recipe, "seq_len": stage.seq_len,
                                  "nproc": stage.nproc, "steps": stage.steps, "rope": stage.rope,
                                  "wall_s": stage.wall_s, "eval_dir": str(stage.eval_dir)})
    curves = {f"{s.name} (trained at {s.seq_len})": _results(s.eval_dir) for s in stages}
    if yarn_dir is not None:
        curves[f"{stages[0].name} + YaRN x{stages[-1].rope['factor']:g}, no training"] = _results(yarn_dir)
    trained = [s.seq_len for s in stages]
    figure = plots.extension_figure(curves, out / "longctx.png", trained)
    summary["figure"] = str(figure)
    summary["table"] = passkey_table(curves)
    _write(out / "summary.json", json.dumps(summary, indent=1))
    _write(out / "summary.md", summary_markdown(summary, curves))
    echo(f"wrote {figure}, {out / 'summary.md'}")
    return summary


def shown(cmd: list[str]) -> str:
    """cmd as a user types it in the working folder, where it runs: `python`, paths under the folder
    relative to it."""
    here = str(Path.cwd()) + os.sep
    return " ".join("python" if part == sys.executable else part.replace(here, "") for part in cmd)


def scored(stage: Stage, args) -> bool:
    """Whether stage.eval_dir/results.json scores the stage's final step with args' lengths, samples and
    tasks (--reuse-scores)."""
    path = stage.eval_dir / "results.json"
    if not path.exists():
        return False
    res = json.loads(path.read_text())
    return (res.get("step") == stage.steps and res.get("samples") == args.samples
            and res.get("lengths") == [int(x) for x in args.lengths.split(",")]
            and set(res.get("tasks", {})) == set(args.tasks.split(",")))


def train_seconds(run_dir: Path) -> float:
    """Sum of the step times a run logged (metrics.jsonl), 0 where it has none."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0.0
    return sum(json.loads(line).get("step_time", 0.0) for line in path.read_text().splitlines() if line.strip())


def _results(eval_dir: Path) -> dict:
    return json.loads((eval_dir / "results.json").read_text())


def passkey_table(curves: dict[str, dict]) -> dict[str, dict]:
    """{label: {length: {"passkey", "multikey_needle", "ppl"}}} from each eval's results.json."""
    table = {}
    for label, res in curves.items():
        rows = {}
        for length in res["lengths"]:
            row = {}
            for task in ("passkey", "multikey_needle"):
                cell = res["tasks"].get(task, {}).get("by_length", {}).get(str(length))
                row[task] = cell["exact"] if cell else None
            ppl = res["tasks"].get("perplexity", {}).get("by_length", {}).get(str(length))
            row["ppl"] = ppl["ppl"] if ppl else None
            rows[str(length)] = row
        table[label] = rows
    return table


def summary_markdown(summary: dict, curves: dict) -> str:
    def cell(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["# Long-context extension", "", "![](longctx.png)", "",
             "Exact match (passkey / multi-key needle, averaged over needle depths) and held-out perplexity by "
             "context length:", ""]
    lengths = next(iter(curves.values()))["lengths"]
    lines.append("| model | " + " | ".join(str(x) for x in lengths) + " |")
    lines.append("| --- |" + " --- |" * len(lengths))
    for label, rows in summary["table"].items():
        lines.append(f"| {label} | " + " | ".join(
            f"{cell(r['passkey'], '.2f')} / {cell(r['multikey_needle'], '.2f')} / {cell(r['ppl'], '.2f')}"
            for r in (rows[str(x)] for x in lengths)) + " |")
    lines += ["", "Wall time (seconds, this machine):", ""]
    for s in summary["stages"]:
        lines.append(f"- {s['name']}: seq_len {s['seq_len']}, {s['nproc']} rank(s), {s['steps']} steps, "
                     f"rope {s['rope']}: " + ", ".join(f"{k} {v:.0f}" for k, v in s["wall_s"].items()))
    lines += ["", "Commands:", "", "```"] + summary["commands"] + ["```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Exit status 0; 2 with one `error:` line (a bad recipe or path, a failed step); 130 / 143 when stopped
    by SIGINT / SIGTERM."""
    ap = argparse.ArgumentParser(prog="python tools/extend.py", description=__doc__.splitlines()[0])
    ap.add_argument("stages", nargs="*", help="stage recipes, in order (default: the checkout's recipes/longctx/"
                                              "base.toml extend_2k.toml extend_4k.toml)")
    ap.add_argument("--runs", default="runs/longctx", help="training runs go to RUNS/<stage name>")
    ap.add_argument("--out", default="runs/longctx/eval", help="eval results, figure and summary")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every stage")
    ap.add_argument("--lengths", default=DEFAULT_LENGTHS)
    ap.add_argument("--samples", type=int, default=10, help="samples per (length, depth) cell")
    ap.add_argument("--tasks", default="passkey,multikey_needle,perplexity")
    ap.add_argument("--ppl-tokens", type=int, default=16384)
    ap.add_argument("--eval-only", action="store_true", help="score the stages' existing checkpoints")
    ap.add_argument("--reuse-scores", action="store_true",
                    help="keep a stage's results.json where it scores its final step with these lengths, samples "
                         "and tasks")
    ap.add_argument("--no-yarn-inference", dest="yarn_inference", action="store_false",
                    help="skip scoring the first stage with the last stage's YaRN")
    args = ap.parse_args(argv)
    missing = [s for s in DEFAULT_STAGES if not Path(s).is_file()]
    if not args.stages and missing:
        print(f"error: the default stages, recipes/longctx/{{base,extend_2k,extend_4k}}.toml, ship with the moe_lc "
              f"checkout, not the installed package ({missing[0]} is not there); give the stage recipes: "
              f"moe-extend STAGE.toml ...", file=sys.stderr)
        return 2
    # absolute from here on: the children run in this folder too, and the messages name where things are
    recipes = [os.path.abspath(s) for s in args.stages or DEFAULT_STAGES]
    runs, out = Path(os.path.abspath(args.runs)), Path(os.path.abspath(args.out))
    # SIGTERM (kill, a job's time limit) stops the chain as Ctrl-C does; Python handles signals in the main thread
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_stopped)} if main_thread else {}
    try:
        stages = plan_stages(recipes, runs, out, args.set)
        for flag, folder in (("--runs", runs), ("--out", out)):
            _check_dir(flag, folder)
        run_pipeline(stages, out, args)
    except (ConfigError, RuntimeError, FileNotFoundError, OutPathError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"stopped by {signal.Signals(signum).name}; the same command continues the chain (finished stages "
              "are skipped, a stopped stage resumes from its last checkpoint)", file=sys.stderr)
        return STOP_EXIT[signum]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def _check_dir(flag: str, folder: Path) -> None:
    """OutPathError when `folder` cannot hold the outputs (a file there or above it, not writable); made
    only where a step writes into it."""
    existing = next(q for q in (folder, *folder.parents) if q.exists())
    if not existing.is_dir():
        raise OutPathError(f"{flag} {folder}: {existing} is a file, not a directory")
    problem = unwritable(existing)
    if problem:
        raise OutPathError(f"{flag} {folder}: {problem}")


if __name__ == "__main__":
    sys.exit(main())
