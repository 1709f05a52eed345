"""The lm-evaluation-harness bridge's arguments (eval/lm_eval.py runs lm_eval's CLI, eval/lm_eval_model.py is the
model): --model_args checked and resolved without loading a weight, and the sampling moe_lc refuses. Every
mistake is a BridgeError whose message is one line naming the argument. Imports neither lm_eval nor the
bridge's other modules, so both read it.
"""

from __future__ import annotations

import difflib
import re
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

    from moe_lc.job.checkpoint import CheckpointError
    from moe_lc.config import ConfigError
    from moe_lc.job.preflight import resolve_device
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
