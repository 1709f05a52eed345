"""`to-hf`: one of our checkpoints (any training layout) -> a Hugging Face model directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads: config.json, safetensors shards of at
most `max_shard_bytes` with their index, and the tokenizer files of the recipe's tokenizer.

The checkpoint holds every tensor as boxes of the full tensor (moe_lc.parallel.checkpoint_state), so
reading a full tensor is the resharding load resume does, into a one-rank layout. It is read one
layer at a time (the embedding, final norm and head as a group of their own); each layer's HF
tensors go to the shard being filled, which is written when full: the resident set stays near one
layer plus one output shard. Tensors keep the dtype they were saved in (the compute dtype the run
trained with), so from-hf followed by to-hf gives back the input bit for bit.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moe_lc.checkpoint import find_checkpoint, load_checkpoint, recipe_beside, weight_errors
from moe_lc.config import Config, load_config
from moe_lc.convert.hf_config import ConvertError, family_of, to_hf_config
from moe_lc.convert.hf_files import ShardWriter, copy_tokenizer
from moe_lc.convert.hf_names import Piece, layer_of, pieces, to_theirs
from moe_lc.model.transformer import state_shapes

def _read_group(path: Path, names: list[str], shapes: dict, dtypes: dict) -> dict[str, torch.Tensor]:
    """Full tensors of `names` from the checkpoint (DCP reads the boxes that overlap each)."""
    state = {"model": {n: torch.empty(shapes[n], dtype=dtypes[n]) for n in names}}
    return load_checkpoint(path, state)["model"]


def _hf_tensor(parts: list[Piece], ours: dict[str, torch.Tensor], rope_dim: int) -> torch.Tensor:
    """One HF tensor assembled from its pieces (one, or eh_proj's two column halves); a view of ours
    where one piece is the whole tensor (no second copy of the layer)."""
    regions = []
    for p in parts:
        region = ours[p.ours]
        for d, (start, size) in enumerate(zip(p.offset, p.box_shape())):
            region = region.narrow(d, start, size)
        regions.append(to_theirs(p, region, rope_dim))
    if len(parts) == 1 and parts[0].cols is None:
        return regions[0]
    out = torch.empty(parts[0].shape, dtype=regions[0].dtype)
    for p, region in zip(parts, regions):
        out[:, p.cols[0]:p.cols[1]] = region
    return out


def to_hf(checkpoint: str | Path, out: str | Path, *, recipe: str | Path | None = None,
          max_shard_bytes: int = 5 * 10**9, log=print) -> list[Path]:
    """Convert; returns the safetensors shard paths. See the module docstring."""
    start = time.perf_counter()
    path = find_checkpoint(checkpoint)
    recipe_path = Path(recipe) if recipe else recipe_beside(path)
    if recipe_path is None:
        raise ConvertError(f"no config.toml or recipe.toml found above {path}: pass --recipe")
    cfg: Config = load_config(recipe_path)
    family = family_of(cfg.model)
    shapes = state_shapes(cfg.model)
    errors = weight_errors(path, shapes)
    if errors:
        raise ConvertError(f"{path} does not fit {recipe_path} (the recipe it was trained with?): {errors[0]}"
                           + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""))
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    dtypes = {n: meta[f"model.{n}"].properties.dtype for n in shapes if f"model.{n}" in meta}
    table = pieces(cfg.model, family)
    by_key: dict[str, list[Piece]] = defaultdict(list)
    by_ours: dict[str, list[Piece]] = defaultdict(list)
    groups: dict[str, list[str]] = defaultdict(list)  # layer -> our tensors, in table order
    for p in table:
        by_key[p.theirs].append(p)
        if p.ours not in by_ours:
            groups[layer_of(p.ours)].append(p.ours)
        by_ours[p.ours].append(p)
    out = Path(out)
    writer = ShardWriter(out, max_shard_bytes)
    dtype = dtypes["embed.weight"]
    rope_dim = cfg.model.mla.qk_rope_head_dim
    log(f"to-hf: {path} ({recipe_path.name}) -> {family} in {out}")
    for i, (group, names) in enumerate(groups.items()):
        present = [n for n in names if n in dtypes]
        ours = _read_group(path, present, shapes, dtypes)
        if family == "deepseek_v2":
            bias = [n for n in present if n.endswith("expert_bias") and ours[n].any()]
            if bias:
                raise ConvertError(f"{bias[0]} is non-zero: DeepSeek-V2 routing has no bias "
                                   "(train with model.moe.bias_update_speed = 0 to export as deepseek_v2)")
        for key in dict.fromkeys(p.theirs for n in present for p in by_ours[n]):
            writer.add(key, _hf_tensor(by_key[key], ours, rope_dim))
        if group.startswith("mtp."):  # DeepSeek-V3's MTP layers carry copies of the embedding and head
            layer = f"model.layers.{cfg.model.n_layers + int(group.split('.')[1])}"
            shared = _read_group(path, ["embed.weight", "head.weight"], shapes, dtypes)
            writer.add(f"{layer}.embed_tokens.weight", shared["embed.weight"])
            writer.add(f"{layer}.shared_head.head.weight", shared["head.weight"])
        log(f"  {group or 'embedding / norm / head'} ({i + 1}/{len(groups)}, {time.perf_counter() - start:.0f} s)")
    shards = writer.finish()
    seq = cfg.model.rope.original_seq_len * cfg.model.rope.factor if cfg.model.rope.scaling == "yarn" else 0
    hf = to_hf_config(cfg.model, family, max(cfg.train.seq_len, int(seq)), str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    _copy_recipe_tokenizer(cfg.data.tokenizer, out, log)
    total = sum(s.stat().st_size for s in shards)
    log(f"to-hf: {len(shards)} shard(s), {total / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")
    return shards


def _copy_recipe_tokenizer(spec: str, out: Path, log) -> None:
    if spec == "byte":
        log("to-hf: the recipe uses the byte tokenizer, which has no Hugging Face form; no tokenizer written")
        return
    src = Path(spec)
    if src.is_file():
        shutil.copyfile(src, out / "tokenizer.json")
        src = src.parent
    copy_tokenizer(src, out)
