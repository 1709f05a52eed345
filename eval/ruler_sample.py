"""What every RULER task builds: a prompt and a reference answer of exactly `length` tokens together.

RULER (github.com/NVIDIA/RULER; Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?") feeds `input + answer_prefix` and scores the model's greedy generation
against `outputs` by string match. Here a sample is that prompt followed by the task's reference answer
in its canonical form, `length` tokens in all, assembled from separately encoded pieces (as
moe_lc/data/synthetic.py does): the context is cut to the exact number of tokens the fixed pieces leave,
so the length is exact for any tokenizer and the answer's tokens are exactly `tokens[answer_start:]`.
RULER counts its generation budget (`tokens_to_generate`) inside the length instead; here generation may
run past `length` by up to the budget minus the answer's length.

Tasks whose context is a list of discrete items (common / frequent words, QA documents) fill what the
last whole item leaves with a preamble: the tail of RULER's noise text before the prompt (a crop of a
longer document), recorded as `params["preamble_tokens"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# RULER's "noise" haystack (niah.py, variable_tracking.py): one line, repeated
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


class TooShort(ValueError):
    """`length` cannot hold the task's fixed pieces (run_ruler records the length as skipped)."""


@dataclass(frozen=True)
class RulerSample:
    """tokens (length,) int64: the prompt (RULER's input + answer_prefix) = tokens[:answer_start], then
    the reference answer, `answer` (decode(tokens[answer_start:]) == answer). outputs: RULER's references
    for string match. ordered: whether `answer` is the one right answer text (teacher-forced exact
    match is reported only then; a list in any order, or several references, is not)."""

    tokens: np.ndarray
    answer_start: int
    answer: str
    outputs: list[str]
    kind: str
    ordered: bool
    params: dict = field(default_factory=dict)


def encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def tiled_tail(unit: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The last n tokens of `unit` repeated, and where each repetition starts in them (with 0 and n)."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64), np.array([0, 0])
    reps = n // len(unit) + 1
    cut = reps * len(unit) - n
    starts = np.arange(reps) * len(unit) - cut
    return np.tile(unit, reps)[cut:], np.unique(np.concatenate([[0], starts[starts > 0], [n]]))


def lines_tail(pieces: list[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The last n tokens of the concatenated `pieces` (which must hold at least n), and piece starts."""
    total = sum(len(p) for p in pieces)
    if total < n:
        raise ValueError(f"{total} tokens of pieces for a tail of {n}")
    tokens = np.concatenate(pieces)[total - n:] if pieces else np.zeros(0, dtype=np.int64)
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]) - (total - n)
    return tokens.astype(np.int64), np.unique(np.concatenate([[0], starts[starts > 0], [n]]))


def insert_pieces(filler: np.ndarray, boundaries: np.ndarray, pieces: list[np.ndarray],
                  depths: list[float]) -> tuple[np.ndarray, list[float]]:
    """`pieces` inserted into `filler` at the boundary nearest to depth x len(filler), in depth order (ties
    keep their given order) -> (tokens, the actual depth of each piece)."""
    n = len(filler)
    targets = np.asarray(depths, dtype=np.float64) * n
    right = np.clip(np.searchsorted(boundaries, targets), 0, len(boundaries) - 1)
    left = np.clip(right - 1, 0, len(boundaries) - 1)
    at = np.where(np.abs(boundaries[left] - targets) <= np.abs(boundaries[right] - targets),
                  boundaries[left], boundaries[right])
    out, cursor = [], 0
    for k in np.argsort(at, kind="stable"):
        out += [filler[cursor:at[k]], pieces[k]]
        cursor = at[k]
    out.append(filler[cursor:])
    return np.concatenate(out).astype(np.int64), [float(a) / n if n else 0.0 for a in at]


def assemble(kind: str, length: int, tokenizer, parts: list, answer: str, outputs: list[str], ordered: bool,
             params: dict, preamble: bool = False) -> RulerSample:
    """One sample from `parts`: texts (encoded here) or token arrays, and at most one callable
    context(n) -> tokens of exactly n that fills what the others leave. With `preamble`, the tail of the
    noise text goes first instead (for a context(n) that can only come close to n, returning fewer)."""
    encoded = [encode(tokenizer, p) if isinstance(p, str) else p for p in parts]
    answer_ids = encode(tokenizer, answer)
    fixed = sum(len(p) for p in encoded if not callable(p)) + len(answer_ids)
    if fixed > length:
        raise TooShort(f"length={length} is too short: the prompt's fixed pieces take {fixed} tokens")
    for i, p in enumerate(encoded):
        if callable(p):
            try:
                encoded[i] = p(length - fixed)
            except TooShort as exc:
                raise TooShort(f"length={length} is too short: {exc}") from None
    prompt = np.concatenate(encoded).astype(np.int64)
    left = length - len(prompt) - len(answer_ids)
    if left and not preamble:
        raise AssertionError(f"{kind}: the context filled {length - fixed - left} of {length - fixed} tokens")
    params = dict(params)
    if preamble:
        params["preamble_tokens"] = left
        prompt = np.concatenate([tiled_tail(encode(tokenizer, NOISE + " "), left)[0], prompt]).astype(np.int64)
    tokens = np.concatenate([prompt, answer_ids]).astype(np.int64)
    return RulerSample(tokens, len(prompt), answer, list(outputs), kind, ordered, params)


def most_that_fit(count_tokens, budget: int, low: int, high: int) -> int:
    """The largest k in [low, high] with count_tokens(k) <= budget (count_tokens increasing in k);
    TooShort when even `low` does not fit. RULER finds its haystack sizes by the same binary search."""
    if count_tokens(low) > budget:
        raise TooShort(f"even {low} items take {count_tokens(low)} tokens, more than the {budget} left")
    while low < high:
        mid = (low + high + 1) // 2
        if count_tokens(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return low
