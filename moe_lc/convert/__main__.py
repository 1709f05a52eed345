"""python -m moe_lc.convert {from-hf,to-hf} ...  (see moe_lc/convert/__init__.py)"""

from __future__ import annotations

import argparse
import sys

from moe_lc.checkpoint import CheckpointError
from moe_lc.config import ConfigError
from moe_lc.convert import ConvertError, from_hf, to_hf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_lc.convert", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="a Hugging Face model directory -> recipe + step-0 checkpoint")
    a.add_argument("hf_dir", help="directory with config.json, *.safetensors, tokenizer files")
    a.add_argument("--out", required=True, help="output directory (recipe.toml, tokenizer/, checkpoint/); absent or "
                   "empty, or an earlier conversion with --overwrite")
    a.add_argument("--overwrite", action="store_true", help="replace an earlier conversion at --out (whole)")
    b = sub.add_parser("to-hf", help="one of our checkpoints -> a Hugging Face model directory")
    b.add_argument("checkpoint", help="a step directory, a checkpoint root (newest), or a from-hf directory")
    b.add_argument("--out", required=True, help="output directory (config.json, safetensors, tokenizer); absent or "
                   "empty, or a Hugging Face model directory with --overwrite")
    b.add_argument("--overwrite", action="store_true", help="replace the Hugging Face model directory at --out (whole)")
    b.add_argument("--recipe", help="the recipe the checkpoint was trained with (default: the run's config.toml)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit (GB)")
    args = ap.parse_args(argv)
    try:
        if args.command == "from-hf":
            from_hf(args.hf_dir, args.out, overwrite=args.overwrite)
        else:
            to_hf(args.checkpoint, args.out, recipe=args.recipe, overwrite=args.overwrite,
                  max_shard_bytes=int(args.max_shard_gb * 1e9))
    except (ConvertError, ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
