"""Hugging Face model directories on disk: safetensors shards read one tensor at a time, written one
shard at a time, and the tokenizer files that travel with the weights.

Reading goes through `safetensors.safe_open` with one shard open at a time (a memory map: pages are
touched only for the tensors read), so converting never holds more than the current shard's pages
plus the tensors of one box. DeepSeek-V3's published FP8 weights (`quantization_config`: fp8 with
128 x 128 `weight_block_size`, a `weight_scale_inv` per weight) are dequantized on read to bf16, as
DeepSeek's own `fp8_cast_bf16.py` does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from moe_lc.convert.hf_config import ConvertError
from moe_lc.data.tokenizer import read_tokenizer_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# from-hf's record, beside the copied tokenizer files, of the source config.json's bos / eos / pad ids:
# they can differ from the tokenizer's named specials (Llama 3 lists several eos ids), and to-hf writes
# them back into config.json
TOKEN_IDS = "hf_token_ids.json"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32}


class HFWeights:
    """The tensors of one HF model directory, by key: shapes and dtypes from the headers alone,
    data one tensor at a time (`get`)."""

    def __init__(self, directory: str | Path, quantization: dict | None = None):
        from safetensors import safe_open  # lazy: only conversion needs it

        self._open_fn = safe_open
        self.dir = Path(directory)
        self.file_of: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, torch.dtype] = {}
        for name in self._shard_names():
            self._read_header(name)
        self.block = None
        if quantization:
            method = quantization.get("quant_method")
            if method != "fp8" or "weight_block_size" not in quantization:
                raise ValueError(f"quantization_config.quant_method={method!r}: only DeepSeek's block-wise fp8 "
                                 "weights are read (dequantize others first)")
            self.block = tuple(quantization["weight_block_size"])
        self._file, self._handle = None, None

    def _shard_names(self) -> list[str]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        if (self.dir / SINGLE).is_file():
            return [SINGLE]
        raise FileNotFoundError(f"{self.dir}: neither {INDEX} nor {SINGLE}")

    def _read_header(self, name: str) -> None:
        """Shapes and dtypes of one shard. safetensors checks the header against the file's size, so a
        shard cut short (an interrupted download) is refused here, before any weight is read."""
        path = self.dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing (named in {INDEX})")
        try:
            with self._open_fn(path, framework="pt") as fh:
                for key in fh.keys():
                    view = fh.get_slice(key)
                    self.file_of[key] = name
                    self.shape[key] = tuple(view.get_shape())
                    self.dtype[key] = _DTYPES.get(view.get_dtype(), torch.float32)
        except Exception as exc:  # safetensors' SafetensorError derives from Exception only
            raise ValueError(f"{path}: unreadable safetensors file ({exc}): truncated, or a partial "
                             "download?") from None

    def keys(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def out_dtype(self, key: str) -> torch.dtype:
        """The dtype `get(key)` returns (fp8 weights come back in bf16)."""
        return torch.bfloat16 if self.dtype[key].itemsize == 1 and self.block else self.dtype[key]

    def _read(self, key: str) -> torch.Tensor:
        name = self.file_of[key]
        if name != self._file:  # one shard mapped at a time
            self.close()
            self._handle = self._open_fn(self.dir / name, framework="pt").__enter__()
            self._file = name
        return self._handle.get_tensor(key)

    def get(self, key: str) -> torch.Tensor:
        t = self._read(key)
        if t.dtype.itemsize == 1 and t.is_floating_point() and self.block:
            scale = self._read(key + "_scale_inv").float()
            r, c = self.block
            full = scale.repeat_interleave(r, 0)[:t.shape[0]].repeat_interleave(c, 1)[:, :t.shape[1]]
            t = (t.float() * full).to(torch.bfloat16)
        return t

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._file, self._handle = None, None


class ShardWriter:
    """Writes `model-0000i-of-0000n.safetensors` of at most `max_bytes` each (one tensor larger than that
    gets a shard of its own) and the index; holds one shard's tensors at a time."""

    def __init__(self, directory: str | Path, max_bytes: int = 5 * 10**9):
        self.dir, self.max_bytes = Path(directory), max_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (temporary file name, keys)
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, self.dir / name, metadata={"format": "pt"})
        self.written.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Flush, name the shards as transformers does, write the index; returns the shard paths."""
        if self.pending:
            self._flush()
        n = len(self.written)
        weight_map, paths = {}, []
        for i, (tmp, keys) in enumerate(self.written):
            final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.dir / tmp).rename(self.dir / final)
            weight_map.update({k: final for k in keys})
            paths.append(self.dir / final)
        # the index even for one shard: transformers reads model.safetensors (its one-shard name) and
        # ignores it, tools that list the weights through the index (total_size, weight_map) find it
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return paths


def tokenizer_files(src: Path) -> dict[str, Path]:
    """{name in the model directory: source file} for a tokenizer given as a directory (the files of
    TOKENIZER_FILES it holds) or as one tokenizer.json file (under any name, plus its directory's others)."""
    src = Path(src)
    found = {"tokenizer.json": src} if src.is_file() else {}
    directory = src.parent if src.is_file() else src
    for name in TOKENIZER_FILES:
        if name not in found and (directory / name).is_file():
            found[name] = directory / name
    return found


def check_tokenizer(files: dict[str, Path]) -> None:
    """ValueError naming the first file that would be copied but that nothing could read back: tokenizer.json
    must load in `tokenizers`, the other files must be JSON objects. Copying garbage would hand the
    converted model a tokenizer that fails only when training or transformers first loads it."""
    for name, path in files.items():
        if name == "tokenizer.json":
            read_tokenizer_file(path)
            continue
        try:
            if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc})") from None


def copy_tokenizer(files: dict[str, Path], dst: Path) -> list[str]:
    """Copy `files` (from `tokenizer_files`, checked by `check_tokenizer`) into `dst`; returns their names."""
    for name, path in files.items():
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst / name)
    return list(files)


def require_hf_extra(command: str) -> None:
    """Refuse, in one line naming the extra, to convert without safetensors and tokenizers (the `[hf]`
    extra): without it the first weight or tokenizer read fails with a bare ModuleNotFoundError."""
    for module in ("safetensors", "tokenizers"):
        try:
            __import__(module)
        except ImportError:
            raise ConvertError(f"{command} needs the {module!r} package of the [hf] extra: "
                               "pip install -e '.[hf]'") from None
