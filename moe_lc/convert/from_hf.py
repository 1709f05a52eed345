"""`from-hf`: a Hugging Face model directory -> our recipe + a step-0 DCP checkpoint, streamed.

    DIR/recipe.toml          [model] of the architecture, [data] tokenizer, [checkpoint] init_from = DIR
    DIR/tokenizer/           the tokenizer files, copied
    DIR/checkpoint/step_00000000/    committed DCP checkpoint: "model" entries as boxes of full tensors

Everything that can be refused is refused before any weight is read: the config (hf_config), then
every expected tensor's presence and shape against the safetensors headers, and any tensor that
would be left over. The checkpoint is then written box by box: DCP asks each `LazyChunks` box for
its data only when it writes it, one file per box, so the resident set stays near one box plus
the open shard (boxes are one tensor, or a run of experts of at most `box_bytes`).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from moe_lc.checkpoint import save_checkpoint
from moe_lc.config import CheckpointConfig, Config, DataConfig, TrainConfig, to_toml
from moe_lc.convert.hf_config import ConvertError, from_hf_config
from moe_lc.convert.hf_files import HFWeights, copy_tokenizer
from moe_lc.convert.hf_names import Piece, mtp_copies, pieces, to_ours
from moe_lc.model.transformer import state_shapes
from moe_lc.parallel.checkpoint_state import Chunks

BOX_BYTES = 1 << 30


class LazyChunks(Chunks):
    """A Chunks whose boxes are read from the HF files when DCP writes them (see the module docstring)."""

    @staticmethod
    def __new__(cls, global_shape, boxes: list[tuple[tuple[int, ...], tuple[int, ...], object]], dtype):
        r = Chunks.__new__(cls, global_shape, [(off, torch.empty(shape, dtype=dtype, device="meta"))
                                               for off, shape, _ in boxes], dtype)
        r._loaders = {tuple(off): load for off, _, load in boxes}
        return r

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self._loaders[tuple(index.offset)]()


def _box_loader(weights: HFWeights, box_offset, box_shape, parts: list[Piece], dtype, rope_dim: int, progress):
    def load() -> torch.Tensor:
        out = torch.empty(box_shape, dtype=dtype)
        for p in parts:
            data = to_ours(p, weights.get(p.theirs), rope_dim)
            region = out
            for d, (start, size) in enumerate(zip(p.offset, p.box_shape())):
                region = region.narrow(d, start - box_offset[d], size)
            region.copy_(data)
        progress(out.numel() * out.element_size())
        return out
    return load


def _boxes(name: str, shape, parts: list[Piece], weights: HFWeights, dtype, rope_dim, box_bytes, progress):
    """[(offset, shape, loader)] covering our tensor `name`: whole, or runs of experts for stacked ones."""
    if not parts[0].expert:
        zero = (0,) * len(shape)
        return [(zero, shape, _box_loader(weights, zero, shape, parts, dtype, rope_dim, progress))]
    per_expert = math.prod(shape[1:]) * dtype.itemsize
    run = max(1, box_bytes // per_expert)
    out = []
    for first in range(0, shape[0], run):
        n = min(run, shape[0] - first)
        off, box = (first,) + (0,) * (len(shape) - 1), (n, *shape[1:])
        mine = [p for p in parts if first <= p.offset[0] < first + n]
        out.append((off, box, _box_loader(weights, off, box, mine, dtype, rope_dim, progress)))
    return out


def plan(hf_dir: Path):
    """Read config.json and the headers; refuse anything we cannot convert exactly.
    Returns (ModelConfig, family, HFWeights, {our name: [Piece]})."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    hf = json.loads(config_path.read_text())
    try:
        weights = HFWeights(hf_dir, hf.get("quantization_config"))
    except (FileNotFoundError, ValueError) as exc:
        raise ConvertError(str(exc)) from None
    n_layers = hf.get("num_hidden_layers", 0)
    mtp_layers = len({k.split(".")[2] for k in weights.keys()
                      if k.startswith("model.layers.") and k.endswith(".eh_proj.weight")
                      and int(k.split(".")[2]) >= n_layers})
    cfg, family = from_hf_config(hf, mtp_layers)
    tied = "lm_head.weight" not in weights
    if tied and not hf.get("tie_word_embeddings", False):
        raise ConvertError(f"{hf_dir}: lm_head.weight is missing and tie_word_embeddings is not set")
    interleaved = family == "deepseek_v2" or (family == "deepseek_v3" and hf.get("rope_interleave", True))
    table = pieces(cfg, family, tied=tied, interleaved=interleaved)
    for p in table:
        if p.theirs not in weights:
            raise ConvertError(f"{hf_dir}: tensor {p.theirs} is missing (needed for our {p.ours})")
        if weights.shape[p.theirs] != p.shape:
            raise ConvertError(f"{p.theirs}: shape {weights.shape[p.theirs]} in the checkpoint, "
                               f"{p.shape} from config.json")
    used = {p.theirs for p in table} | set(mtp_copies(cfg))
    left = [k for k in weights.keys() if k not in used and not k.endswith("_scale_inv")
            and not k.endswith("rotary_emb.inv_freq")]
    if left:
        raise ConvertError(f"{hf_dir}: {len(left)} tensors we have no place for, e.g. {', '.join(sorted(left)[:4])}")
    by_name: dict[str, list[Piece]] = defaultdict(list)
    for p in table:
        by_name[p.ours].append(p)
    return cfg, family, weights, dict(by_name)


def recipe_text(cfg, family: str, hf_dir: Path, out: Path, tokenizer: str, seq_len: int) -> str:
    recipe = Config(model=cfg, data=DataConfig(tokenizer=tokenizer),
                    train=TrainConfig(seq_len=seq_len, output_dir=f"runs/{out.name}"),
                    checkpoint=CheckpointConfig(init_from=str(out)))
    head = (f"# Converted from {hf_dir} ({family}) by `python -m moe_lc.convert from-hf`.\n"
            f"# Train from these weights with `extends = \"{out / 'recipe.toml'}\"` in your recipe; the\n"
            "# [model] tables must stay as they are (weight shapes), everything else is yours to change.\n\n")
    return head + to_toml(recipe)


def from_hf(hf_dir: str | Path, out: str | Path, *, box_bytes: int = BOX_BYTES, log=print) -> Path:
    """Convert; returns the committed checkpoint directory. See the module docstring."""
    hf_dir, out = Path(hf_dir).resolve(), Path(out).resolve()
    cfg, family, weights, by_name = plan(hf_dir)
    shapes = state_shapes(cfg)
    missing = [n for n in shapes if n not in by_name and not n.endswith("expert_bias")]
    assert not missing, f"pieces table misses {missing[:4]}"  # the table and the model disagree: a bug here
    total = sum(math.prod(shapes[n]) * weights.out_dtype(ps[0].theirs).itemsize for n, ps in by_name.items())
    log(f"from-hf: {family}, {len(by_name)} tensors, {total / 2**30:.2f} GiB from {hf_dir}")
    done, start = [0], time.perf_counter()

    def progress(nbytes: int) -> None:
        before = done[0] * 10 // total
        done[0] += nbytes
        if done[0] * 10 // total > before:
            log(f"  {done[0] / 2**30:.2f} / {total / 2**30:.2f} GiB written ({time.perf_counter() - start:.0f} s)")

    model_state = {}
    for name, parts in by_name.items():
        dtype = weights.out_dtype(parts[0].theirs)
        boxes = _boxes(name, shapes[name], parts, weights, dtype, cfg.mla.qk_rope_head_dim, box_bytes, progress)
        model_state[name] = LazyChunks(shapes[name], boxes, dtype)
    out.mkdir(parents=True, exist_ok=True)
    copied = copy_tokenizer(hf_dir, out / "tokenizer")
    tokenizer = str(out / "tokenizer") if "tokenizer.json" in copied else "byte"
    if tokenizer == "byte":
        log(f"from-hf: {hf_dir} has no tokenizer.json; the recipe keeps data.tokenizer = 'byte'")
    hf = json.loads((hf_dir / "config.json").read_text())
    seq_len = min(int(hf.get("max_position_embeddings") or 4096), 4096)
    (out / "recipe.toml").write_text(recipe_text(cfg, family, hf_dir, out, tokenizer, seq_len))
    try:
        path = save_checkpoint(out / "checkpoint", 0, {"model": model_state}, is_writer=True, file_per_tensor=True)
    finally:
        weights.close()
    log(f"from-hf: wrote {out / 'recipe.toml'} and {path} in {time.perf_counter() - start:.1f} s")
    return path
