"""`to-hf`: one of our checkpoints (any training layout) -> a Hugging Face model directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads: config.json, safetensors shards of at
most `max_shard_bytes` with their index, and the tokenizer files of the recipe's tokenizer.

The checkpoint holds every tensor as boxes of the full tensor (moe_lc.job.checkpoint_state), so
reading a full tensor is the resharding load resume does, into a one-rank layout. It is read one
layer at a time (the embedding, final norm and head as a group of their own); each layer's HF
tensors go to the shard being filled, which is written when full: the resident set stays near one
layer plus one output shard. Tensors keep the dtype they were saved in (the compute dtype the run
trained with), so from-hf followed by to-hf gives back the input bit for bit.

config.json carries bos / eos (/ pad) token ids: those from-hf recorded from the source config.json
(tokenizer/hf_token_ids.json), else the ids the recipe's tokenizer gave training. The index is written
even for one shard (model.safetensors, the name transformers gives a single shard and loads first).
--out is checked before the checkpoint is read and written beside itself, then swapped in (out_dir).
"""

from __future__ import annotations

import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moe_lc.job.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, recipe_beside, weight_errors
from moe_lc.config import Config, load_config
from moe_lc.convert.hf_config import ConvertError, family_of, to_hf_config
from moe_lc.convert.hf_files import (TOKEN_IDS, ShardWriter, check_tokenizer, copy_tokenizer, require_hf_extra,
                                     tokenizer_files)
from moe_lc.convert.hf_names import Piece, layer_of, pieces, to_theirs
from moe_lc.convert.out_dir import check_out, is_hf_model_dir, staged
from moe_lc.data.tokenizer import load_tokenizer
from moe_lc.model.transformer import state_shapes

BIASED_ROUTERS = ("deepseek_v3", "deepseek_v32", "deepseek_v4", "glm4_moe")  # families whose router has e_score_correction_bias (our expert_bias)


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


def find_step(checkpoint: Path) -> Path:
    """The step directory to export, or one ConvertError: a run that saved no checkpoint is the usual
    cause (checkpoint.interval = 0 without save_final), so the message says how to get one."""
    try:
        return find_checkpoint(checkpoint)
    except FileNotFoundError:
        raise ConvertError(f"to-hf: {checkpoint} does not exist (expected a run's train.output_dir, a checkpoint "
                           "root or step, or a from-hf directory)") from None
    except CheckpointError:
        raise ConvertError(f"to-hf: {checkpoint} holds no committed checkpoint (none in it, in checkpoints/ or in "
                           "checkpoint/): train with checkpoint.save_final = true or checkpoint.interval > 0 so the "
                           "run saves one (a run with its own checkpoint.dir: pass that directory)") from None


def recipe_tokenizer(spec: str) -> dict[str, Path]:
    """The recipe's tokenizer files to copy, checked before any weight is read ({} for 'byte')."""
    if spec == "byte":
        return {}
    files = tokenizer_files(Path(spec))
    if "tokenizer.json" not in files:
        raise ConvertError(f"to-hf: data.tokenizer={spec!r}: no tokenizer.json there")
    try:
        check_tokenizer(files)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise ConvertError(f"to-hf: data.tokenizer={spec!r}: {exc}") from None
    return files


def token_ids(spec: str, files: dict[str, Path]) -> dict:
    """bos / eos / pad ids for config.json: from-hf's record of the source config.json where there is
    one, else the ids load_tokenizer gives (those training used); {} for the byte tokenizer."""
    if not files:
        return {}
    record = files["tokenizer.json"].parent / TOKEN_IDS
    if record.is_file():
        try:
            return json.loads(record.read_text())
        except ValueError as exc:
            raise ConvertError(f"{record} is not valid JSON ({exc})") from None
    try:
        tok = load_tokenizer(spec)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise ConvertError(f"to-hf: data.tokenizer={spec!r}: {exc}") from None
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}


def _tables(cfg: Config, family: str):
    """(HF key -> pieces, our tensor -> pieces, layer -> our tensors in table order)."""
    by_key: dict[str, list[Piece]] = defaultdict(list)
    by_ours: dict[str, list[Piece]] = defaultdict(list)
    groups: dict[str, list[str]] = defaultdict(list)
    for p in pieces(cfg.model, family):
        by_key[p.theirs].append(p)
        if p.ours not in by_ours:
            groups[layer_of(p.ours)].append(p.ours)
        by_ours[p.ours].append(p)
    return by_key, by_ours, groups


def _refuse_trained_bias(path: Path, group: str, shapes: dict, dtypes: dict, family: str) -> None:
    """`family`'s router has no bias, so the checkpoint's expert_bias of this layer (our aux-loss-free
    balancing state; the table has no place for it) must be zero, or the export would route differently."""
    names = [n for n in dtypes if n.endswith("expert_bias") and layer_of(n) == group]
    bias = _read_group(path, names, shapes, dtypes) if names else {}
    moved = [n for n in names if bias[n].any()]
    if moved:
        raise ConvertError(f"{moved[0]} is non-zero: {family} routing has no bias "
                           f"(train with model.moe.bias_update_speed = 0 to export as {family})")


def _write_weights(writer: ShardWriter, path: Path, cfg: Config, family: str, dtypes: dict, log, start) -> None:
    """Every HF tensor, one layer of ours read at a time (see the module docstring)."""
    shapes = state_shapes(cfg.model)
    by_key, by_ours, groups = _tables(cfg, family)
    rope_dim = cfg.model.mla.qk_rope_head_dim
    for i, (group, names) in enumerate(groups.items()):
        present = [n for n in names if n in dtypes]
        ours = _read_group(path, present, shapes, dtypes)
        if family not in BIASED_ROUTERS:
            _refuse_trained_bias(path, group, shapes, dtypes, family)
        for key in dict.fromkeys(p.theirs for n in present for p in by_ours[n]):
            writer.add(key, _hf_tensor(by_key[key], ours, rope_dim))
        if group.startswith("mtp.") and family != "deepseek_v4":  # V3's MTP layers copy the embedding and head
            layer = f"model.layers.{cfg.model.n_layers + int(group.split('.')[1])}"
            head = "embed.weight" if cfg.model.tie_embeddings else "head.weight"
            shared = _read_group(path, list(dict.fromkeys(["embed.weight", head])), shapes, dtypes)
            writer.add(f"{layer}.embed_tokens.weight", shared["embed.weight"])
            writer.add(f"{layer}.shared_head.head.weight", shared[head])
        log(f"  {group or 'embedding / norm / head'} ({i + 1}/{len(groups)}, {time.perf_counter() - start:.0f} s)")


def to_hf(checkpoint: str | Path, out: str | Path, *, recipe: str | Path | None = None, overwrite: bool = False,
          max_shard_bytes: int = 5 * 10**9, log=print) -> list[Path]:
    """Convert; returns the safetensors shard paths. See the module docstring."""
    require_hf_extra("to-hf")
    start, out = time.perf_counter(), Path(out).resolve()
    path = find_step(Path(checkpoint))
    recipe_path = Path(recipe) if recipe else recipe_beside(path)
    if recipe_path is None:
        raise ConvertError(f"no config.toml or recipe.toml found above {path}: pass --recipe")
    cfg: Config = load_config(recipe_path)
    family = family_of(cfg.model)
    errors = weight_errors(path, state_shapes(cfg.model))
    if errors:
        raise ConvertError(f"{path} does not fit {recipe_path} (the recipe it was trained with?): {errors[0]}"
                           + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""))
    tok_files = recipe_tokenizer(cfg.data.tokenizer)
    ids = token_ids(cfg.data.tokenizer, tok_files)
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    dtypes = {n: meta[f"model.{n}"].properties.dtype for n in state_shapes(cfg.model) if f"model.{n}" in meta}
    inputs = (path.resolve(), *(f.resolve() for f in tok_files.values()))
    check = functools.partial(check_out, out, overwrite=overwrite, kind="a Hugging Face model directory",
                              replaceable=is_hf_model_dir, inputs=inputs)
    with staged(out, "to-hf", check, log) as tmp:
        log(f"to-hf: {path} ({recipe_path.name}) -> {family} in {out}")
        writer = ShardWriter(tmp, max_shard_bytes)
        _write_weights(writer, path, cfg, family, dtypes, log, start)
        shards = writer.finish()
        rope = cfg.model.rope
        seq = rope.original_seq_len * rope.factor if rope.scaling in ("yarn", "llama3") else 0
        dtype = str(dtypes["embed.weight"]).removeprefix("torch.")
        hf = {**to_hf_config(cfg.model, family, max(cfg.train.seq_len, int(seq)), dtype), **ids}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if tok_files:
            copy_tokenizer(tok_files, tmp)
        else:
            log("to-hf: the recipe uses the byte tokenizer, which has no Hugging Face form; no tokenizer written")
    shards = [out / s.name for s in shards]
    total = sum(s.stat().st_size for s in shards)
    log(f"to-hf: {len(shards)} shard(s), {total / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")
    return shards
