"""`from-hf`: a Hugging Face model directory -> our recipe + a step-0 DCP checkpoint, streamed.

    DIR/recipe.toml          [model] of the architecture, [data] tokenizer, [checkpoint] init_from = DIR,
                             [train] sized for the machine it is meant to train on (TRAIN_FOR: a GPU's
                             seq_len <= 4096 x 16 sequences, or a CPU's 256 x 8; by default the one
                             converting, CUDA or not), said in its header
    DIR/tokenizer/           the tokenizer files, copied (checked first), and hf_token_ids.json: the
                             bos / eos / pad ids of the source config.json, which to-hf writes back
    DIR/checkpoint/step_00000000/    committed DCP checkpoint: "model" entries as boxes of full tensors

Everything that can be refused is refused before any weight is read: --out (out_dir: never into a
training run, over an earlier conversion only with overwrite, writable), the config (hf_config), the
tokenizer files, then every expected tensor's presence and shape against the safetensors headers
(a truncated shard fails there), and any tensor that would be left over. DIR is written beside
itself and swapped in whole. The checkpoint is written box by box: DCP asks each `LazyChunks` box
for its data only when it writes it, one file per box, so the resident set stays near one box plus
the open shard (boxes are one tensor, or a run of experts of at most `box_bytes`).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lc.job.checkpoint import save_checkpoint
from moe_lc.config import CheckpointConfig, Config, DataConfig, TrainConfig, to_toml
from moe_lc.convert.hf_config import ConvertError, check_field_types, from_hf_config
from moe_lc.convert.hf_files import (TOKEN_IDS, HFWeights, check_tokenizer, copy_tokenizer, require_hf_extra,
                                     tokenizer_files)
from moe_lc.convert.hf_names import Piece, mtp_copies, pieces, to_ours
from moe_lc.convert.hf_v4 import hub_names
from moe_lc.convert.out_dir import CONVERSION_HEAD, check_out, is_conversion, staged
from moe_lc.model.transformer import state_shapes
from moe_lc.job.checkpoint_state import Chunks

BOX_BYTES = 1 << 30


@dataclass(frozen=True)
class TrainSize:
    """The [train] sizes a converted recipe starts with, for one kind of machine."""

    machine: str  # "a GPU", for the recipe's header
    max_seq_len: int  # seq_len = min(max_position_embeddings, this)
    global_batch: int
    micro_batch: int


# a CPU step at the GPU sizes (4096 tokens x 16 sequences) took 39 s for a 0.14M-parameter model (issue 61)
TRAIN_FOR = {"gpu": TrainSize("a GPU", 4096, 16, 8), "cpu": TrainSize("a CPU", 256, 8, 4)}


def default_train_for() -> str:
    """'gpu' where torch sees CUDA, else 'cpu'."""
    return "gpu" if torch.cuda.is_available() else "cpu"


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


def read_hf_config(hf_dir: Path) -> dict:
    """config.json as a dict, or one ConvertError naming the file (absent, not JSON, not an object)."""
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConvertError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ConvertError(f"{path} is not a JSON object")
    check_field_types(hf)
    return hf


def plan(hf_dir: Path, hf: dict | None = None):
    """Read config.json (unless given as `hf`) and the headers; refuse anything we cannot convert exactly.
    Returns (ModelConfig, family, HFWeights, {our name: [Piece]})."""
    hf = read_hf_config(hf_dir) if hf is None else hf
    try:
        weights = HFWeights(hf_dir, hf.get("quantization_config"))
    except (FileNotFoundError, ValueError) as exc:
        raise ConvertError(str(exc)) from None
    try:
        return _check_weights(hf_dir, hf, weights)
    except BaseException:
        weights.close()
        raise


def _check_weights(hf_dir: Path, hf: dict, weights: HFWeights):
    n_layers = hf.get("num_hidden_layers", 0)
    mtp_layers = len({k.split(".")[2] for k in weights.keys()
                      if k.startswith("model.layers.") and k.endswith(".eh_proj.weight")
                      and int(k.split(".")[2]) >= n_layers})
    mtp_layers += len({k.split(".")[1] for k in weights.keys()  # DeepSeek-V4's "mtp.<d>.*" (convert/hf_v4.py)
                       if k.startswith("mtp.") and k.endswith(".e_proj.weight")})
    cfg, family = from_hf_config(hf, mtp_layers)
    if "lm_head.weight" not in weights and not cfg.tie_embeddings and family != "deepseek_v4":  # V4's: head.weight
        raise ConvertError(f"{hf_dir}: lm_head.weight is missing and tie_word_embeddings is not set")
    interleaved = family in ("deepseek_v2", "deepseek_v32") or (family == "deepseek_v3" and hf.get("rope_interleave", True))
    table = pieces(cfg, family, interleaved=interleaved)
    if family == "deepseek_v4" and "embed.weight" in weights:  # DeepSeek's own names, not save_pretrained's
        table = hub_names(table)
    for p in table:
        if p.theirs not in weights:
            raise ConvertError(f"{hf_dir}: tensor {p.theirs} is missing (needed for our {p.ours})")
        if weights.shape[p.theirs] != p.shape:
            raise ConvertError(f"{p.theirs}: shape {weights.shape[p.theirs]} in the checkpoint, "
                               f"{p.shape} from config.json")
    used = {p.theirs for p in table} | set(mtp_copies(cfg))
    if cfg.tie_embeddings:  # a tied checkpoint that also saved the head: transformers ignores it, as we do
        used.add("lm_head.weight")
    left = [k for k in weights.keys() if k not in used and not k.endswith("_scale_inv")
            and not k.endswith("rotary_emb.inv_freq")]
    if left:
        raise ConvertError(f"{hf_dir}: {len(left)} tensors we have no place for, e.g. {', '.join(sorted(left)[:4])}")
    by_name: dict[str, list[Piece]] = defaultdict(list)
    for p in table:
        by_name[p.ours].append(p)
    return cfg, family, weights, dict(by_name)


def checked_tokenizer(hf_dir: Path) -> dict[str, Path]:
    """The tokenizer files to copy, each loaded first: a garbage tokenizer.json is refused, not copied."""
    files = tokenizer_files(hf_dir)
    try:
        check_tokenizer(files)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise ConvertError(str(exc)) from None
    return files


def recipe_text(cfg, family: str, hf_dir: Path, out: Path, tokenizer: str, hf: dict, train_for: str) -> str:
    size, max_len = TRAIN_FOR[train_for], _max_len(hf)
    recipe = Config(model=cfg, data=DataConfig(tokenizer=tokenizer),
                    train=TrainConfig(seq_len=min(max_len, size.max_seq_len), global_batch=size.global_batch,
                                      micro_batch=size.micro_batch, output_dir=f"runs/{out.name}"),
                    checkpoint=CheckpointConfig(init_from=str(out)))
    head = (f"{CONVERSION_HEAD}{hf_dir} ({family}) by `python -m moe_lc.convert from-hf`.\n"
            "# Train from these weights with a recipe of your own, e.g. my_run.toml:\n"
            f"#     extends = \"{out / 'recipe.toml'}\"\n"
            "#     [train]\n"
            "#     output_dir = \"runs/my_run\"\n"
            "# then `python -m moe_lc.convert to-hf runs/my_run --out hf/my_run` exports the run's newest checkpoint.\n"
            "# The [model] tables must stay as they are (weight shapes); everything else is yours to change.\n"
            + _size_note(train_for, max_len) + "\n")
    return head + to_toml(recipe)


def _size_note(train_for: str, max_len: int) -> str:
    """The header's lines on [train]'s sizes: for which machine and why, and the other machine's sizes."""
    other = "cpu" if train_for == "gpu" else "gpu"
    default = ""
    if train_for == default_train_for():
        default = ", the default where torch sees CUDA" if train_for == "gpu" else ", the default without CUDA"

    def sizes(kind: str) -> str:
        t = TRAIN_FOR[kind]
        return (f"seq_len = {min(max_len, t.max_seq_len)}, global_batch = {t.global_batch}, "
                f"micro_batch = {t.micro_batch}")
    return (f"# [train] is sized for {TRAIN_FOR[train_for].machine} (--train-for {train_for}{default}): "
            f"{sizes(train_for)}.\n# For {TRAIN_FOR[other].machine} set {sizes(other)} in your [train], or convert "
            f"with --train-for {other}\n"
            "# (on a CPU, 4096 tokens x 16 sequences take tens of seconds a step, even for a tiny model).\n")


def _max_len(hf: dict) -> int:
    try:
        return int(hf.get("max_position_embeddings") or 4096)
    except (TypeError, ValueError):
        raise ConvertError(f"max_position_embeddings={hf['max_position_embeddings']!r} is not an integer") from None


def _model_state(cfg, weights: HFWeights, by_name: dict, box_bytes: int, log) -> dict[str, LazyChunks]:
    """Our tensors as LazyChunks over the HF files (nothing read yet), with progress logged as DCP writes."""
    shapes = state_shapes(cfg)
    missing = [n for n in shapes if n not in by_name and not n.endswith("expert_bias")]
    assert not missing, f"pieces table misses {missing[:4]}"  # the table and the model disagree: a bug here
    total = sum(math.prod(shapes[n]) * weights.out_dtype(ps[0].theirs).itemsize for n, ps in by_name.items())
    log(f"  {len(by_name)} tensors, {total / 2**30:.2f} GiB")
    done, start = [0], time.perf_counter()

    def progress(nbytes: int) -> None:
        before = done[0] * 10 // total
        done[0] += nbytes
        if done[0] * 10 // total > before:
            log(f"  {done[0] / 2**30:.2f} / {total / 2**30:.2f} GiB written ({time.perf_counter() - start:.0f} s)")

    state = {}
    for name, parts in by_name.items():
        dtype = weights.out_dtype(parts[0].theirs)
        boxes = _boxes(name, shapes[name], parts, weights, dtype, cfg.mla.qk_rope_head_dim, box_bytes, progress)
        state[name] = LazyChunks(shapes[name], boxes, dtype)
    return state


def from_hf(hf_dir: str | Path, out: str | Path, *, overwrite: bool = False, train_for: str | None = None,
            box_bytes: int = BOX_BYTES, log=print) -> Path:
    """Convert; returns the committed checkpoint directory. See the module docstring. `train_for`: 'cpu'
    or 'gpu', the machine the recipe's [train] is sized for (default: `default_train_for()`)."""
    train_for = train_for or default_train_for()
    if train_for not in TRAIN_FOR:
        raise ConvertError(f"train_for={train_for!r}: expected one of {', '.join(TRAIN_FOR)}")
    require_hf_extra("from-hf")
    hf_dir, out = Path(hf_dir).resolve(), Path(out).resolve()
    start = time.perf_counter()
    check = functools.partial(check_out, out, overwrite=overwrite, kind="an earlier conversion",
                              replaceable=is_conversion, inputs=(hf_dir,))
    with staged(out, "from-hf", check, log) as tmp:
        hf = read_hf_config(hf_dir)
        _max_len(hf)  # a bad max_position_embeddings is refused before any weight is read
        tok_files = checked_tokenizer(hf_dir)
        cfg, family, weights, by_name = plan(hf_dir, hf)
        log(f"from-hf: {family} from {hf_dir}")
        try:
            state = _model_state(cfg, weights, by_name, box_bytes, log)
            tokenizer = "byte"
            if "tokenizer.json" in tok_files:
                copy_tokenizer(tok_files, tmp / "tokenizer")
                ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
                (tmp / "tokenizer" / TOKEN_IDS).write_text(json.dumps(ids, indent=2) + "\n")
                tokenizer = str(out / "tokenizer")
            else:
                log(f"from-hf: {hf_dir} has no tokenizer.json; the recipe keeps data.tokenizer = 'byte'")
            (tmp / "recipe.toml").write_text(recipe_text(cfg, family, hf_dir, out, tokenizer, hf, train_for))
            path = save_checkpoint(tmp / "checkpoint", 0, {"model": state}, is_writer=True, file_per_tensor=True)
        finally:
            weights.close()
    path = out / path.relative_to(tmp)
    log(f"from-hf: wrote {out / 'recipe.toml'} and {path} in {time.perf_counter() - start:.1f} s")
    return path
