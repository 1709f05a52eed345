"""Real-text haystacks for the RULER tasks that use one (`niah_single_2`, ...: RULER's "essay" haystack).

RULER fills these contexts with Paul Graham's essays, downloaded by its setup script. Offline, the
default here is the prose of the Python standard library that runs the eval: the docstrings of its
modules, classes and functions, in sorted file order (every machine with the same Python has the same
text; which Python is recorded in the haystack's name), with runs of whitespace made single spaces as
RULER does with the essays. `--haystack PATH` takes any text file instead (UTF-8, a binary is refused;
whitespace likewise), or a moe_lc token file (`PATH` = the prefix of PATH.bin / PATH.json, made by
tools/prepare_data.py with the model's tokenizer).

A haystack is its token ids and the token indices where sentences start. Text is split into sentences
after ".", "!" or "?" followed by whitespace, and each sentence is encoded on its own (with its trailing
space), so a needle inserted at a sentence start never changes how the text around it is tokenized. A
token file's sentences start at the first non-blank token after one whose text ends a sentence (".",
"!", "?", a newline).
`window(n, rng)` is n tokens from a seeded random sentence start, wrapping around to the beginning when
the text is shorter than the window (RULER repeats its essays likewise).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lc.data.corpus import default_cache_dir, list_text_files, read_text, stdlib_root
from moe_lc.data.ingest import binary_reason

STDLIB_PROSE = "stdlib-prose"
# enough docstring text for a 128K-token window with any tokenizer (~4 characters per BPE token)
STDLIB_PROSE_CHARS = 1_500_000
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Haystack:
    """Token ids (N,) int64 of the whole text and the sentence starts (sorted, from 0) in them."""

    name: str
    tokens: np.ndarray
    starts: np.ndarray

    def window(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """n tokens from a random sentence start (wrapping around) -> (tokens (n,), sentence starts in the
        window, with 0 and n)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64), np.array([0, 0])
        first = int(self.starts[rng.integers(len(self.starts))])
        reps = -(-(first + n) // len(self.tokens))
        tiled = np.tile(self.tokens, reps)[first:first + n]
        starts = (self.starts[None, :] + len(self.tokens) * np.arange(reps)[:, None]).ravel() - first
        inside = starts[(starts > 0) & (starts < n)]
        return tiled.astype(np.int64), np.unique(np.concatenate([[0], inside, [n]]))

    def describe(self) -> dict:
        return {"name": self.name, "tokens": int(len(self.tokens)), "sentences": int(len(self.starts))}


def sentences(text: str) -> list[str]:
    """Whitespace runs made single spaces, split after sentence ends; each keeps a trailing space."""
    flat = re.sub(r"\s+", " ", text).strip()
    return [s + " " for s in _SENTENCE_END.split(flat) if s]


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # the stdlib's test files include deliberately broken ones
        return []
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                          ast.AsyncFunctionDef)))
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def stdlib_prose(max_chars: int = STDLIB_PROSE_CHARS) -> str:
    """The standard library's docstrings in sorted file order, up to about `max_chars` characters. Parsing
    the files takes ~10 s, so the text is kept in the token cache folder (default_cache_dir), per Python."""
    version = "{}.{}.{}-{}".format(*sys.version_info[:3], sys.implementation.name)
    cached = default_cache_dir() / f"stdlib-prose-py{version}-{max_chars}.txt"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    root, parts, size = stdlib_root(), [], 0
    for rel in list_text_files(root):
        for doc in _docstrings(read_text(root / rel)):
            parts.append(doc)
            size += len(doc)
        if size >= max_chars:
            break
    text = "\n".join(parts)
    try:  # written whole or not at all; an unwritable cache only costs the next eval the parse again
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, cached)
    except OSError:
        pass
    return text


def _from_sentences(name: str, text_sentences: list[str], tokenizer) -> Haystack:
    if not text_sentences:
        raise ValueError(f"haystack {name}: no text")
    pieces = tokenizer.encode_batch(text_sentences)
    lengths = np.array([len(p) for p in pieces])
    keep = lengths > 0
    tokens = np.concatenate([p for p, k in zip(pieces, keep) if k]).astype(np.int64)
    return Haystack(name, tokens, np.concatenate([[0], np.cumsum(lengths[keep])[:-1]]).astype(np.int64))


def _token_file(prefix: Path, tokenizer) -> Haystack:
    from moe_lc.data.token_file import open_token_file

    tokens, meta = open_token_file(prefix)
    if meta["tokenizer"] != tokenizer.name:
        raise ValueError(f"--haystack {prefix}: its tokens are of tokenizer {meta['tokenizer']!r}, the model uses "
                         f"{tokenizer.name!r} (rebuild it with tools/prepare_data.py --tokenizer)")
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) == 0:
        raise ValueError(f"haystack {prefix}: no tokens")
    texts = {int(i): tokenizer.decode([int(i)]) for i in np.unique(tokens)}
    ends = np.array([texts[int(t)].rstrip(" ").endswith((".", "!", "?", "\n")) for t in tokens[:-1]], dtype=bool)
    # a sentence starts at the first token after an end that is not whitespace (the space after ". ")
    words = np.flatnonzero([bool(texts[int(t)].strip()) for t in tokens])
    after = np.flatnonzero(ends) + 1
    at = np.searchsorted(words, after)
    starts = words[at[at < len(words)]]
    return Haystack(f"token file {prefix}", tokens, np.unique(np.concatenate([[0], starts])).astype(np.int64))


_CACHE: dict[tuple[str, str], Haystack] = {}


def load_haystack(spec: str | None, tokenizer) -> Haystack:
    """The haystack `spec` names (None or "stdlib-prose": the default; a text file; a token-file prefix),
    encoded with `tokenizer`; kept per (spec, tokenizer) for the process."""
    spec = spec or STDLIB_PROSE
    key = (spec, tokenizer.name)
    if key not in _CACHE:
        if spec == STDLIB_PROSE:
            version = ".".join(map(str, sys.version_info[:3]))
            _CACHE[key] = _from_sentences(f"{STDLIB_PROSE} (docstrings of Python {version}'s standard library)",
                                          sentences(stdlib_prose()), tokenizer)
        elif Path(f"{spec}.bin").is_file() and Path(f"{spec}.json").is_file():
            _CACHE[key] = _token_file(Path(spec), tokenizer)
        else:
            _CACHE[key] = _from_sentences(f"text file {spec}", sentences(read_text(spec)), tokenizer)
    return _CACHE[key]


def haystack_error(spec: str | None) -> str | None:
    """Why `--haystack spec` cannot be read (None when it can), before any model is loaded."""
    if spec is None or spec == STDLIB_PROSE:
        return None
    path = Path(spec)
    if Path(f"{spec}.bin").is_file() and Path(f"{spec}.json").is_file():
        return None
    if path.is_dir():
        return f"--haystack {spec} is a folder; give a text file or a token-file prefix (PREFIX.bin + PREFIX.json)"
    if not path.is_file():
        return f"--haystack {spec}: no such file (nor {spec}.bin + {spec}.json)"
    not_text = binary_reason(path)  # tools/prepare_data.py's test: a binary is no haystack
    if not_text:
        return f"--haystack {spec} {not_text}; give a UTF-8 text file or a token-file prefix"
    if not read_text(path, 4096).strip():
        return f"--haystack {spec}: the file holds no text"
    return None
