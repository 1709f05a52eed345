"""The command line's values, checked before anything is loaded: every mistake is one line.

Why: a mistyped --lengths or --depths used to surface as Python's own message ("invalid literal for
int()"), an unknown --task-param or `--device cuda` on a CPU build as a traceback after the model was
loaded, and a negative --seed or a bad task parameter as every length "skipped" in a run that then
exited 0 with no numbers. `check_inputs` reports all of them at once, one line each, before the
checkpoint is even opened (main() prints `error: LINE` per line and exits 2).

Lists (--tasks, --lengths, --depths) are comma-separated; an empty item or a value listed twice is a
mistake (it would be scored twice, or a stray comma hides a missing value).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from . import tasks
from .haystack import haystack_error
from .ruler import RULER_TASKS
from .ruler_qa import load_qa

ALL_TASKS = (*tasks.RETRIEVAL_TASKS, *RULER_TASKS, "perplexity")
# a name that stands for several tasks (RULER's table: all 13)
TASK_GROUPS = {"ruler": tuple(RULER_TASKS)}


class UsageError(ValueError):
    """Command-line mistakes, one line each in `errors` (main() prints each as `error: ...`, exit 2)."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("; ".join(self.errors))


@dataclass(frozen=True)
class Inputs:
    """The parsed lists of the command line, valid."""

    tasks: list[str]
    lengths: list[int]
    depths: list[float]
    params: dict[str, dict]  # task -> {param: value}, from --task-param
    qa: dict  # "squad" / "hotpotqa" -> QAData, from --squad / --hotpotqa


def _items(flag: str, text: str, cast, what: str) -> tuple[list, str | None]:
    """Comma-separated values of one flag, and the first thing wrong with them (None: nothing)."""
    values = []
    for i, item in enumerate(x.strip() for x in text.split(",")):
        if not item:
            return values, f"{flag} {text!r}: item {i + 1} is empty (a stray comma?)"
        try:
            values.append(cast(item))
        except ValueError:
            return values, f"{flag} {text!r}: {item!r} is not {what}"
    twice = [v for k, v in enumerate(values) if v in values[:k]]
    return values, f"{flag} {text!r}: {twice[0]} is listed twice" if twice else None


def _list_errors(args) -> tuple[Inputs, list[str]]:
    named, e_tasks = _items("--tasks", args.tasks, str, "task names")
    unknown = [t for t in named if t not in ALL_TASKS and t not in TASK_GROUPS]
    if not e_tasks and unknown:
        e_tasks = (f"--tasks {args.tasks!r}: unknown task {unknown[0]!r}; choose from {', '.join(ALL_TASKS)}, "
                   f"or {', '.join(f'{g} (= {len(ts)} tasks)' for g, ts in TASK_GROUPS.items())}")
    chosen = list(dict.fromkeys(t for name in named for t in TASK_GROUPS.get(name, (name,))))
    lengths, e_lengths = _items("--lengths", args.lengths, int, "an integer number of tokens")
    short = [x for x in lengths if x < 2]
    if not e_lengths and short:
        e_lengths = f"--lengths {args.lengths!r}: {short[0]} is below 2 (a context length needs at least 2 tokens)"
    depths, e_depths = _items("--depths", args.depths, float, "a number in [0, 1]")
    outside = [d for d in depths if not (math.isfinite(d) and 0 <= d <= 1)]
    if not e_depths and outside:
        e_depths = f"--depths {args.depths!r}: {outside[0]:g} is outside [0, 1] (0 = start of the context, 1 = end)"
    params, e_params = task_params(args.task_param)
    errors = [e for e in (e_tasks, e_lengths, e_depths) if e] + e_params
    return Inputs(chosen, lengths, depths, params, {}), errors


# flag -> (attribute, least value, why)
_AT_LEAST = {"--samples": ("samples", 1, "samples per cell"), "--batch-size": ("batch_size", 1, "samples per forward"),
             "--ppl-tokens": ("ppl_tokens", 2, "held-out tokens"), "--stride": ("stride", 1, "tokens per window step"),
             "--threads": ("threads", 0, "0 = torch's default"), "--seed": ("seed", 0, "numpy seeds are non-negative"),
             "--gen-tokens": ("gen_tokens", 0, "0 = RULER's budget per task")}


def _number_errors(args) -> list[str]:
    return [f"{flag} {getattr(args, attr)} must be >= {least} ({why})" for flag, (attr, least, why) in _AT_LEAST.items()
            if getattr(args, attr) < least]


def device_error(name: str) -> str | None:
    """Why `--device cuda` cannot run here (None when it can, or for auto / cpu): a CPU-only build of
    torch and a CUDA build that sees no GPU need different fixes, so the message tells them apart."""
    if name != "cuda":
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"--device cuda: this torch ({torch.__version__}) is a CPU-only build; use --device cpu, "
                "or install a CUDA build of torch")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"--device cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
                + "; use --device cpu, or check the driver with nvidia-smi")
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        return f"--device cuda: LOCAL_RANK={local} but torch sees only {count} GPU(s)"
    return None


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


def task_params(items: list[str]) -> tuple[dict[str, dict], list[str]]:
    """['multikey_needle.n_keys=2'] -> ({'multikey_needle': {'n_keys': 2}}, []), or the mistakes: a
    malformed item, a task that takes no such parameter (naming the ones it takes), a bad value."""
    out: dict[str, dict] = {}
    errors = []
    for item in items:
        key, sep, text = item.partition("=")
        kind, dot, name = key.partition(".")
        if not sep or not dot or not name or not text:
            errors.append(f"--task-param {item!r}: expected TASK.NAME=VALUE, e.g. multikey_needle.n_keys=2")
        elif kind not in tasks.RETRIEVAL_TASKS and kind not in RULER_TASKS:
            errors.append(f"--task-param {item!r}: unknown task {kind!r}; tasks with parameters: "
                          + ", ".join(k for k in (*tasks.RETRIEVAL_TASKS, *RULER_TASKS) if tasks.param_names(k)))
        elif name not in tasks.param_names(kind):
            names = tasks.param_names(kind)
            why = f"{kind} has no parameter {name!r}; its parameters: {', '.join(names)}" if names else \
                f"{kind} takes no parameters"
            errors.append(f"--task-param {item!r}: {why}")
        else:
            out.setdefault(kind, {})[name] = _value(text)
    for kind, params in out.items():
        why = tasks.param_error(kind, params)
        if why:
            errors.append(f"--task-param {kind}: {why}")
    return out, errors


def _qa_files(args) -> tuple[dict, list[str]]:
    """--squad / --hotpotqa read now (a bad line is a mistake to report before the model loads)."""
    data, errors = {}, []
    for flag, dataset in (("--squad", "squad"), ("--hotpotqa", "hotpotqa")):
        path = getattr(args, dataset, None)
        if path is None:
            continue
        try:
            data[dataset] = load_qa(path, dataset)
        except OSError as exc:
            errors.append(f"{flag} {path}: {exc.strerror or exc}")
        except ValueError as exc:
            errors.append(f"{flag}: {exc}")
    return data, errors


def check_inputs(args) -> Inputs:
    """The checked lists of `args` (parse_args' namespace); UsageError with every mistake, one line each."""
    inputs, errors = _list_errors(args)
    errors += _number_errors(args)
    problem = haystack_error(getattr(args, "haystack", None))
    if problem:
        errors.append(problem)
    qa, qa_errors = _qa_files(args)
    errors += qa_errors
    inputs.qa.update(qa)
    device = device_error(args.device)
    if device:
        errors.append(device)
    if errors:
        raise UsageError(errors)
    return inputs
