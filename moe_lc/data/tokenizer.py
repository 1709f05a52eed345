"""Tokenizers: a dependency-free byte tokenizer and a wrapper around HuggingFace `tokenizers` JSON files.

Both expose the same small interface, which is all the rest of moe_lc relies on:

    encode(text) -> np.ndarray[int64] (n,)       no special tokens added
    encode_batch(texts) -> list of (n_i,) arrays  same as encode, possibly parallel
    decode(ids) -> str                           special ids skipped
    bos_id, eos_id, pad_id, vocab_size, name

`name` identifies the exact vocabulary; it is written into token-file sidecars and cache keys, so two
tokenizers with the same name must map text to the same ids.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


def _as_int_list(ids) -> list[int]:
    """Accept a list, numpy array or torch tensor of ids (any int dtype) and return a flat list."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are raw bytes, then BOS=256, EOS=257, PAD=258.

    Needs no files and no training, round-trips any text exactly, and keeps the vocabulary tiny, which is
    what a CPU debug run wants.
    """

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        """Text -> (n_bytes,) int64 ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """List of texts -> list of (n_i,) int64 id arrays."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text. Ids >= 256 (specials, or padded-vocab ids a model may emit) are skipped;
        byte sequences that are not valid UTF-8 become U+FFFD."""
        values = _as_int_list(ids)
        if any(i < 0 for i in values):
            raise ValueError(f"ByteTokenizer.decode: negative token id {min(values)}")
        return bytes(i for i in values if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


# Special-token spellings tried, in order, when an HF tokenizer file is loaded without explicit names.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|end▁of▁sentence|>", "[SEP]")
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|begin▁of▁sentence|>", "[CLS]", "<|endoftext|>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


def read_tokenizer_file(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json, or one line saying why not: the Rust library raises
    a bare Exception ("expected value at line 1 column 1") that names neither the file nor the cause, and
    a truncated download or an HTML error page saved as tokenizer.json is a common way to get one."""
    try:
        import tokenizers  # lazy: only needed for real-vocabulary runs
    except ImportError as exc:
        raise ImportError(
            f"loading tokenizer {str(path)!r} needs the HuggingFace 'tokenizers' package (pip install -e '.[hf]', "
            "or pip install tokenizers), or use the built-in tokenizer 'byte'"
        ) from exc
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a plain Exception for any unreadable file
        raise ValueError(f"{path} is not a tokenizer the `tokenizers` library can load ({exc}): a truncated or "
                         "partial download, or not a tokenizer.json?") from None


class HFTokenizer:
    """A HuggingFace `tokenizers` JSON file (tokenizer.json) behind the ByteTokenizer interface.

    Special ids are looked up by common spellings unless given; EOS is required (it separates
    documents), BOS and PAD fall back to EOS when the vocabulary has none.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ):
        path = Path(path)
        self.path = path
        self._tok = read_tokenizer_file(path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        # The name must change whenever the vocabulary does, so it carries a content hash.
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        self.name = f"hf-{path.stem}-{digest}"

        self.eos_id = self._special_id("eos", eos_token, _EOS_CANDIDATES)
        if self.eos_id is None:
            raise ValueError(
                f"tokenizer {path} has no end-of-text token (tried {', '.join(_EOS_CANDIDATES)}); "
                "pass eos_token= explicitly"
            )
        bos = self._special_id("bos", bos_token, _BOS_CANDIDATES)
        pad = self._special_id("pad", pad_token, _PAD_CANDIDATES)
        self.bos_id = self.eos_id if bos is None else bos
        self.pad_id = self.eos_id if pad is None else pad

    def _special_id(self, role: str, explicit: str | None, candidates: Sequence[str]) -> int | None:
        if explicit is not None:
            token_id = self._tok.token_to_id(explicit)
            if token_id is None:
                raise ValueError(f"{role}_token {explicit!r} is not in the vocabulary of {self.path}")
            return int(token_id)
        for spelling in candidates:
            token_id = self._tok.token_to_id(spelling)
            if token_id is not None:
                return int(token_id)
        return None

    def encode(self, text: str) -> np.ndarray:
        """Text -> (n,) int64 ids, without BOS/EOS or other template tokens."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """List of texts -> list of (n_i,) int64 id arrays (encoded in parallel by the Rust library)."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text, special tokens skipped."""
        return self._tok.decode(_as_int_list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


Tokenizer = ByteTokenizer | HFTokenizer


def _special_tokens(directory: Path) -> dict:
    """bos/eos/pad token spellings from a model directory's tokenizer_config.json (str or {"content": str})."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    import json

    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except ValueError as exc:  # not JSON, or not UTF-8: name the file, not only the position
        raise ValueError(f"{config} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config} is not a JSON object")
    out = {}
    for role in ("bos", "eos", "pad"):
        value = raw.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            out[f"{role}_token"] = value
    return out


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' -> ByteTokenizer; a tokenizer.json file, or a directory holding one (a Hugging Face model's)
    -> HFTokenizer, with the special tokens its tokenizer_config.json names; anything else is an error."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"directory {path} holds no tokenizer.json (a slow-only tokenizer? save it "
                                    "with a fast tokenizer, or point data.tokenizer at a tokenizer.json)")
        path = path / "tokenizer.json"
    elif not str(spec).endswith(".json"):
        raise ValueError(f"unknown tokenizer {spec!r}: expected 'byte', a HuggingFace tokenizer.json file, "
                         "or a directory holding one")
    return HFTokenizer(path, **_special_tokens(path.parent))
