"""A bridge to EleutherAI's lm-evaluation-harness: a moe_lc checkpoint as an lm-eval `LM`.

    python -m eval.lm_eval run --model moe_lc --model_args path=RUN_OR_CHECKPOINT[,recipe=R,max_length=N]
        --tasks NAME [--include_path DIR] [lm_eval's other arguments]
    python -m eval.lm_eval --model moe_lc ...           # lm_eval's legacy form (it inserts `run`)
    moe-lm-eval ...                                     # the same, installed

lm-eval 0.4.x has no plugin discovery, so this front end registers the model class (eval/lm_eval_model.py)
with lm_eval's registry under the name "moe_lc" and then hands its own command line to lm_eval's CLI
unchanged; the package also declares an entry point (group "lm_eval.models", pyproject.toml) for a later
lm-eval that discovers plugins. Needs the `[eval]` extra (pip install -e '.[eval]': lm-eval pinned).

model_args: path (run directory, checkpoint root, step directory or from-hf directory, as `python -m
eval`), recipe (default: the run's config.toml), set (recipe overrides, `;`-separated: set=a.b=1;c.d=2),
max_length (tokens the model sees: default the recipe's train.seq_len), max_gen_toks (default 256),
device (auto | cpu | cuda | cuda:N, or lm_eval's own --device; default auto), threads (0: the idle cores, as
train.threads; moe_lc/cpu_threads.py). The model reads
and writes text with the recipe's data.tokenizer; `tokenizer=` is accepted and left to the tasks that read
it from model_args (lm_eval's `ruler` tasks size their prompts with a Hugging Face tokenizer of that name:
a converted model's tokenizer/ directory).

Mistakes are one `error: ` line and exit status 2, before lm_eval loads a task or the model a weight: the
extra not installed, an unknown or malformed model argument, a path that holds no checkpoint, a recipe
that does not load, sampling asked for in --gen_kwargs. A task whose own generation_kwargs sample is
refused the same way when its first request arrives. This module imports lm_eval only inside main(), so
that its own mistakes can be said without it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

MODEL_NAME = "moe_lc"
KNOWN_ARGS = ("path", "recipe", "set", "max_length", "max_gen_toks", "device", "threads", "tokenizer")
EXTRA_HINT = "pip install -e '.[eval]' (the [eval] extra: lm-eval 0.4.13)"


class BridgeError(ValueError):
    """A mistake in what the bridge was given; its message is one line naming the argument."""


@dataclass(frozen=True)
class ModelArgs:
    """--model_args resolved: the checkpoint's step directory, its recipe, and the numbers."""

    step_dir: Path
    cfg: object  # moe_lc.config.Config
    max_length: int
    max_gen_toks: int
    device: object  # torch.device
    threads: int


def _whole_number(name: str, value, low: int) -> int | None:
    """value as an int >= low (lm_eval hands numbers over as int, text as str); None when not given."""
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) or str(value).strip().isdigit()) or int(value) < low:
        raise BridgeError(f"--model_args {name}={value}: must be a whole number >= {low}")
    return int(value)


def _checked_names(args: dict) -> None:
    for name in args:
        if name not in KNOWN_ARGS:
            near = difflib.get_close_matches(str(name), KNOWN_ARGS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise BridgeError(f"--model_args {name}={args[name]}: unknown argument {name!r}{hint}; moe_lc takes "
                              f"{', '.join(KNOWN_ARGS)}")
    if not args.get("path"):
        raise BridgeError("--model_args: path= is required (a run directory, checkpoint root, step directory or "
                          "from-hf directory)")


def resolve_model_args(args: dict, lm_eval_device: str | None = None) -> ModelArgs:
    """lm_eval's parsed --model_args for model moe_lc, checked and resolved without loading a weight;
    BridgeError (one line naming the argument) for anything wrong. The device is model_args' `device`,
    else lm_eval's --device (`lm_eval_device`), else auto (CUDA where torch sees it)."""
    import torch

    from moe_lc.checkpoint import CheckpointError
    from moe_lc.config import ConfigError
    from moe_lc.preflight import resolve_device
    from .model_io import load_eval_config, resolve_checkpoint

    _checked_names(args)
    max_length = _whole_number("max_length", args.get("max_length"), 1)
    max_gen_toks = _whole_number("max_gen_toks", args.get("max_gen_toks"), 1)
    threads = _whole_number("threads", args.get("threads"), 0)
    flag, device = ("--model_args device", args["device"]) if args.get("device") else ("--device", lm_eval_device)
    device = str(device or "auto")
    if device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", device):
        raise BridgeError(f"{flag}={device}: must be auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BridgeError(f"{flag}={device}: torch sees no CUDA device (use auto or cpu)")
    path = str(args["path"])
    try:
        step_dir, config_path = resolve_checkpoint(path)
    except (CheckpointError, OSError) as exc:
        raise BridgeError(f"--model_args path={path}: {exc}") from None
    overrides = [x for x in str(args["set"]).split(";") if x] if args.get("set") else []
    try:
        cfg = load_eval_config(config_path, args.get("recipe"), overrides)
    except ConfigError as exc:
        flag = "recipe" if args.get("recipe") else "set" if overrides else "path"
        raise BridgeError(f"--model_args {flag}=...: " + "; ".join(exc.errors)) from None
    return ModelArgs(step_dir, cfg, max_length or cfg.train.seq_len, max_gen_toks or 256,
                     resolve_device(device) if device in ("auto", "cuda") else torch.device(device), threads or 0)


def greedy_error(gen_kwargs: dict) -> str | None:
    """Why generation kwargs ask for sampling, which moe_lc does not do (None when they do not)."""
    sample = gen_kwargs.get("do_sample")
    if sample is True or str(sample).lower() == "true":
        return f"do_sample={sample}: moe_lc decodes greedily only (leave do_sample out, or false)"
    try:
        temperature = float(gen_kwargs.get("temperature") or 0)
    except (TypeError, ValueError):
        return f"temperature={gen_kwargs.get('temperature')}: not a number (moe_lc decodes greedily: 0)"
    if temperature > 0:
        return f"temperature={gen_kwargs['temperature']}: moe_lc decodes greedily only (temperature 0)"
    return None


def check_run(args) -> None:
    """lm_eval's parsed `run` arguments, for model moe_lc: BridgeError before any task or weight loads."""
    if getattr(args, "command", None) != "run" or getattr(args, "model", None) != MODEL_NAME:
        return
    if isinstance(args.model_args, dict):  # a --config file's model_args are checked by the model itself
        # lm_eval hands its --device (default cuda:0) to the model beside model_args: one place for it,
        # and auto (not cuda:0) where neither names one
        resolve_model_args(args.model_args, args.device)
        if args.model_args.get("device"):
            args.device = args.model_args.pop("device")
        args.device = args.device or "auto"
    refused = greedy_error(args.gen_kwargs) if isinstance(args.gen_kwargs, dict) else None
    if refused:
        raise BridgeError(f"--gen_kwargs {refused}")


def register() -> None:
    """Register MoeLcLM with lm_eval's model registry as "moe_lc" (again is harmless)."""
    from lm_eval.api.registry import register_model

    from .lm_eval_model import MoeLcLM

    try:
        register_model(MODEL_NAME)(MoeLcLM)
    except ValueError:  # registered already (by this module imported under another name): that one serves
        pass


def lm_eval_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def main(argv: list[str] | None = None) -> int:
    """lm_eval's own CLI with the moe_lc model registered; `argv` as lm_eval's (default: sys.argv[1:]).
    Exit status lm_eval's, or 2 with one `error: ` line for the mistakes above."""
    if not lm_eval_installed():
        if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):  # what it is, even without the extra
            print("usage: moe-lm-eval [lm-evaluation-harness's arguments] --model moe_lc --model_args path=RUN_DIR\n\n"
                  f"lm-eval's CLI with the moe_lc model registered; it needs lm-eval: {EXTRA_HINT}")
            return 0
        print(f"error: python -m eval.lm_eval (moe-lm-eval) needs lm-eval, which is not installed: {EXTRA_HINT}",
              file=sys.stderr)
        return 2
    from lm_eval._cli import HarnessCLI  # the pinned 0.4.x CLI: lm_eval.__main__.cli_evaluate, in two steps
    from lm_eval.utils import setup_logging

    register()
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    setup_logging()
    cli = HarnessCLI()
    args = cli.parse_args()
    try:
        check_run(args)
        cli.execute(args)
    except BridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def __getattr__(name: str):
    """MoeLcLM on first use (it subclasses lm_eval's LM, so it needs the extra): `from eval.lm_eval import
    MoeLcLM` and the lm_eval.models entry point keep working."""
    if name == "MoeLcLM":
        from .lm_eval_model import MoeLcLM

        return MoeLcLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # as the package's module: the BridgeError main() catches is the one the model raises
    sys.exit(importlib.import_module(__spec__.name).main())
