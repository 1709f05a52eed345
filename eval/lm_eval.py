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

import importlib
import importlib.util
import sys

from .lm_eval_args import EXTRA_HINT, MODEL_NAME, BridgeError, greedy_error, resolve_model_args


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
