"""python -m moe_lc.convert {from-hf,to-hf} ...  (see moe_lc/convert/__init__.py)

Exit status: 0 written, 2 refused or failed (one line), 130 on Ctrl-C and 143 on SIGTERM (a scheduler's
stop, `timeout`): an interrupted conversion removes its partial copy and prints one line saying that
--out was left as it was (moe_lc/convert/out_dir.py), and exits with the status a process killed by
the signal reports, as training does (moe_lc/job/stop_signal.py).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from moe_lc.job.checkpoint import CheckpointError
from moe_lc.config import ConfigError
from moe_lc.convert import ConvertError, from_hf, to_hf
from moe_lc.convert.from_hf import TRAIN_FOR


class Terminated:
    """While `installed()`: SIGTERM unwinds the conversion as Ctrl-C does (KeyboardInterrupt, so the staging
    directory is removed on the way out), and `signum` says which of the two stopped it."""

    def __init__(self):
        self.signum = signal.SIGINT

    def _raise(self, signum: int, frame) -> None:
        self.signum = signum
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():  # main() called from a thread
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._raise)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_lc.convert", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="a Hugging Face model directory -> recipe + step-0 checkpoint")
    a.add_argument("hf_dir", help="directory with config.json, *.safetensors, tokenizer files")
    a.add_argument("--out", required=True, help="output directory (recipe.toml, tokenizer/, checkpoint/); absent or "
                   "empty, or an earlier conversion with --overwrite")
    a.add_argument("--overwrite", action="store_true", help="replace an earlier conversion at --out (whole)")
    a.add_argument("--train-for", choices=sorted(TRAIN_FOR), help="size the recipe's [train] for this machine "
                   "(seq_len, batches); default: gpu where torch sees CUDA, else cpu")
    b = sub.add_parser("to-hf", help="one of our checkpoints -> a Hugging Face model directory")
    b.add_argument("checkpoint", help="a step directory, a checkpoint root (newest), or a from-hf directory")
    b.add_argument("--out", required=True, help="output directory (config.json, safetensors, tokenizer); absent or "
                   "empty, or a Hugging Face model directory with --overwrite")
    b.add_argument("--overwrite", action="store_true", help="replace the Hugging Face model directory at --out (whole)")
    b.add_argument("--recipe", help="the recipe the checkpoint was trained with (default: the run's config.toml)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit (GB)")
    args = ap.parse_args(argv)
    stop = Terminated()
    try:
        with stop.installed():
            if args.command == "from-hf":
                from_hf(args.hf_dir, args.out, overwrite=args.overwrite, train_for=args.train_for)
            else:
                to_hf(args.checkpoint, args.out, recipe=args.recipe, overwrite=args.overwrite,
                      max_shard_bytes=int(args.max_shard_gb * 1e9))
    except (ConvertError, ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted by {signal.Signals(stop.signum).name}: nothing written to {args.out}", file=sys.stderr)
        return 128 + stop.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
