"""Synthetic long-context tasks: passkey, multi-key needle, variable tracking, associative recall.

Each task is a pure function of (rng, length, tokenizer, params) and returns a `Sample` whose answer is
the last tokens of the sequence, so one forward pass scores it (teacher-forced answer tokens) and a
training run can mix the tasks into its data.

How a sample is built, and why:
- Text is assembled from *separately encoded pieces* (filler sentences, needles, query, answer) whose
  token arrays are concatenated. The answer span is then exactly the answer's own tokens and lengths add
  up exactly, for any tokenizer (BPE merges across a piece boundary cannot shift anything).
- Filler ("haystack") is the tail of the repeated filler paragraph, cut to the exact number of tokens
  left after the fixed pieces, so a sample is *exactly* `length` tokens: the context starts mid-sentence,
  as a crop of a longer document would.
- Needles are inserted at filler sentence boundaries, at the boundary nearest to depth x filler length;
  `depth` is the fraction of the filler that lies before the needle (0 = very start, 1 = just before the
  query). `params["depth_actual"]` records where it really landed.
- Pieces end in a space and the query ends in ": " or " is ", so the answer is bare text:
  `tokenizer.decode(tokens[answer_start:answer_end]) == sample.answer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

FILLER_SENTENCES = (
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
)

# Keys for the multi-key needle task: short, common, distinct words.
WORDS = (
    "apple", "river", "candle", "forest", "marble", "pepper", "rocket", "saddle", "tunnel", "violin",
    "anchor", "basket", "carpet", "dragon", "engine", "falcon", "garden", "hammer", "island", "jacket",
    "kettle", "ladder", "magnet", "needle", "orange", "pencil", "quartz", "rabbit", "silver", "ticket",
    "umbrella", "valley", "window", "yellow", "zipper", "bridge", "castle", "desert", "feather", "glacier",
    "harbor", "insect", "jungle", "kingdom", "lantern", "meadow", "nutmeg", "oyster", "parrot", "quiver",
    "ribbon", "spider", "thunder", "unicorn", "velvet", "walnut", "yogurt", "zebra", "bottle", "cactus",
    "dolphin", "eclipse", "fossil", "goblet", "helmet", "iceberg", "jigsaw", "koala", "lemon", "mirror",
    "nebula", "octopus", "pebble", "quill", "raven", "saffron", "tiger", "urchin", "vortex", "wizard",
)


@dataclass(frozen=True)
class Sample:
    """One task instance.

    tokens:       (n,) int64, n == requested length (never longer)
    answer_start: index of the first answer token; answer_end == n (the answer ends the sequence)
    answer:       the answer text; decode(tokens[answer_start:answer_end]) == answer
    kind:         task name, as given to `make_task`
    params:       the task's parameters as drawn (depth, keys, values, ...), for logging and heatmaps
    """

    tokens: np.ndarray
    answer_start: int
    answer_end: int
    answer: str
    kind: str
    params: dict = field(default_factory=dict)


def _filler(n_tokens: int, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Last `n_tokens` tokens of the repeated filler paragraph, and the sentence boundaries in it.

    Returns (tokens (n_tokens,) int64, boundaries (b,) int64 sorted, including 0 and n_tokens).
    """
    sentences = [tokenizer.encode(s) for s in FILLER_SENTENCES]
    cycle = np.concatenate(sentences)
    starts_in_cycle = np.cumsum([0] + [len(s) for s in sentences[:-1]])
    reps = n_tokens // len(cycle) + 1
    tiled = np.tile(cycle, reps)
    cut = len(tiled) - n_tokens
    starts = (starts_in_cycle[None, :] + len(cycle) * np.arange(reps)[:, None]).ravel() - cut
    boundaries = np.unique(np.concatenate([[0], starts[starts >= 0], [n_tokens]]))
    return tiled[cut:], boundaries


def _insert(
    filler: np.ndarray, boundaries: np.ndarray, pieces: Sequence[np.ndarray], depths: Sequence[float]
) -> tuple[np.ndarray, list[int], list[float]]:
    """Insert `pieces` into `filler` at the sentence boundaries nearest to depth x len(filler).

    Pieces landing on the same boundary keep their given order. Returns (tokens, start index of each
    piece in tokens, actual depth of each piece as a fraction of the filler before it).
    """
    n_fill = len(filler)
    targets = np.asarray(depths, dtype=np.float64) * n_fill
    right = np.clip(np.searchsorted(boundaries, targets), 0, len(boundaries) - 1)
    left = np.clip(right - 1, 0, len(boundaries) - 1)
    nearer_left = np.abs(boundaries[left] - targets) <= np.abs(boundaries[right] - targets)
    positions = np.where(nearer_left, boundaries[left], boundaries[right])
    order = np.argsort(positions, kind="stable")

    out, starts, cursor, written = [], [0] * len(pieces), 0, 0
    for k in order:
        out.append(filler[cursor : positions[k]])
        written += positions[k] - cursor
        cursor = positions[k]
        starts[k] = int(written)
        out.append(pieces[k])
        written += len(pieces[k])
    out.append(filler[cursor:])
    actual = [float(p) / n_fill if n_fill else 0.0 for p in positions]
    return np.concatenate(out).astype(np.int64), starts, actual


def _check_depth(depth: float | None, rng: np.random.Generator) -> float:
    if depth is None:
        return float(rng.uniform(0.0, 1.0))
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    return float(depth)


def _haystack_sample(
    kind: str, params: dict, length: int, tokenizer,
    needles: Sequence[str], depths: Sequence[float], query: str, answer: str, queried: int | None = None,
) -> Sample:
    """Filler of exactly the right size with `needles` at `depths`, then `query` and `answer`.

    Adds the needles' token starts and actual depths to `params`, and `depth_actual` of needle `queried`.
    """
    needle_ids = [tokenizer.encode(n) for n in needles]
    query_ids, answer_ids = tokenizer.encode(query), tokenizer.encode(answer)
    n_fixed = sum(len(n) for n in needle_ids) + len(query_ids) + len(answer_ids)
    if n_fixed > length:
        raise ValueError(f"length={length} is too short for task {kind!r}: it needs at least {n_fixed} tokens")
    filler, boundaries = _filler(length - n_fixed, tokenizer)
    context, starts, actual = _insert(filler, boundaries, needle_ids, depths)
    tokens = np.concatenate([context, query_ids, answer_ids]).astype(np.int64)
    params = dict(params, needle_starts=starts, depths_actual=actual)
    if queried is not None:
        params["depth_actual"] = actual[queried]
    return Sample(tokens, len(tokens) - len(answer_ids), len(tokens), answer, kind, params)


def passkey(rng: np.random.Generator, length: int, tokenizer, depth: float | None = None) -> Sample:
    """Find a 5-digit pass key hidden at `depth` (random when None) in repeated filler."""
    depth = _check_depth(depth, rng)
    key = str(int(rng.integers(10_000, 100_000)))
    return _haystack_sample(
        "passkey", {"depth": depth, "passkey": key}, length, tokenizer,
        needles=[f"The pass key is {key}. Remember it. {key} is the pass key. "],
        depths=[depth],
        query="What is the pass key? The pass key is ",
        answer=key,
        queried=0,
    )


def multikey_needle(
    rng: np.random.Generator, length: int, tokenizer, n_keys: int = 4, depth: float | None = None
) -> Sample:
    """Several "special magic number for KEY" needles at random depths; ask for one of them.

    `depth` places the queried needle (random when None); the n_keys - 1 distractors are at random depths.
    """
    if not 1 <= n_keys <= len(WORDS):
        raise ValueError(f"n_keys={n_keys} must be in [1, {len(WORDS)}]")
    keys = [WORDS[i] for i in rng.choice(len(WORDS), size=n_keys, replace=False)]
    values = [str(int(v)) for v in rng.integers(1_000_000, 10_000_000, size=n_keys)]
    query_index = int(rng.integers(n_keys))
    depths = [float(d) for d in rng.uniform(0.0, 1.0, size=n_keys)]
    depths[query_index] = _check_depth(depth, rng)
    key = keys[query_index]
    return _haystack_sample(
        "multikey_needle",
        {"n_keys": n_keys, "keys": keys, "values": values, "query_key": key, "depth": depths[query_index]},
        length, tokenizer,
        needles=[f"One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)],
        depths=depths,
        query=f"What is the special magic number for {key}? The special magic number for {key} is: ",
        answer=values[query_index],
        queried=query_index,
    )


def _unique_strings(rng: np.random.Generator, n: int, alphabet: str, width: int) -> list[str]:
    """`n` distinct random strings of `width` characters from `alphabet`, in draw order."""
    seen: dict[str, None] = {}
    letters = np.array(list(alphabet))
    while len(seen) < n:
        for row in rng.choice(letters, size=(n - len(seen), width)):
            seen.setdefault("".join(row), None)
    return list(seen)[:n]


def variable_tracking(
    rng: np.random.Generator, length: int, tokenizer, n_chains: int = 2, n_hops: int = 4
) -> Sample:
    """Chains "VAR A = 12345." "VAR B = VAR A." ... hidden in filler; name every variable of one chain.

    `n_chains - 1` distractor chains carry other values. Statements of all chains are interleaved at
    random, each chain in order, at increasing depths. Answer: the queried chain's names, space separated.
    """
    if n_chains < 1 or n_hops < 1:
        raise ValueError(f"n_chains={n_chains} and n_hops={n_hops} must be >= 1")
    names = _unique_strings(rng, n_chains * n_hops, "ABCDEFGHIJKLMNOPQRSTUVWXYZ", 5)
    chains = [names[c * n_hops : (c + 1) * n_hops] for c in range(n_chains)]
    values = [str(v) for v in rng.choice(np.arange(10_000, 100_000), size=n_chains, replace=False)]
    statements = [
        [f"VAR {chain[0]} = {value}. "] + [f"VAR {b} = VAR {a}. " for a, b in zip(chain, chain[1:])]
        for chain, value in zip(chains, values)
    ]
    # Random interleaving that keeps each chain's order: shuffle the multiset of chain ids.
    chain_order = rng.permutation(np.repeat(np.arange(n_chains), n_hops))
    next_hop = [0] * n_chains
    ordered = []
    for c in chain_order:
        ordered.append(statements[c][next_hop[c]])
        next_hop[c] += 1
    depths = np.sort(rng.uniform(0.0, 1.0, size=len(ordered)))
    query_chain = int(rng.integers(n_chains))
    return _haystack_sample(
        "variable_tracking",
        {"n_chains": n_chains, "n_hops": n_hops, "chains": chains, "values": values, "query_chain": query_chain},
        length, tokenizer,
        needles=ordered,
        depths=[float(d) for d in depths],
        query=f"Find all variables that are assigned the value {values[query_chain]}: ",
        answer=" ".join(chains[query_chain]),
    )


_KEY_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
_RECALL_QUERY = "Which value goes with {key}? {key}: "


def associative_recall(
    rng: np.random.Generator, length: int, tokenizer, n_pairs: int | None = None, depth: float | None = None
) -> Sample:
    """A list of "key: value" lines (distinct 4-letter keys, 5-digit values), then one key; answer its value.

    With n_pairs=None as many pairs as fit fill the context; otherwise the rest is filler before the list.
    `depth` is the queried pair's position in the list as a fraction (random when None).
    """
    depth = _check_depth(depth, rng)
    # The query's length depends on which key it repeats (for BPE vocabularies), so the pairs leave room
    # for the longest plausible query; what is left over becomes filler before the list.
    reserve = len(tokenizer.encode(_RECALL_QUERY.format(key="wxyz"))) + len(tokenizer.encode("99999")) + 13
    budget = length - reserve
    keys: list[str] = []
    values: list[str] = []
    pair_ids: list[np.ndarray] = []
    seen: set[str] = set()
    used = 0
    full = False
    while not full and (n_pairs is None or len(keys) < n_pairs):
        # Draw candidates in chunks: one rng call per pair would dominate the time at 128K tokens.
        chunk_letters = rng.choice(_KEY_LETTERS, size=(256, 4))
        chunk_values = rng.integers(10_000, 100_000, size=256)
        for letters, value in zip(chunk_letters, chunk_values):
            key = "".join(letters)
            if key in seen:
                continue
            ids = tokenizer.encode(f"{key}: {value}\n")
            if used + len(ids) > budget or len(keys) == n_pairs:
                full = used + len(ids) > budget
                break
            seen.add(key)
            keys.append(key)
            values.append(str(int(value)))
            pair_ids.append(ids)
            used += len(ids)
    if not keys or (n_pairs is not None and len(keys) < n_pairs):
        raise ValueError(
            f"length={length} is too short for task 'associative_recall' with n_pairs={n_pairs} "
            f"({len(keys)} pairs fit)"
        )
    index = int(round(depth * (len(keys) - 1)))
    query_ids = tokenizer.encode(_RECALL_QUERY.format(key=keys[index]))
    answer_ids = tokenizer.encode(values[index])
    newline = tokenizer.encode("\n")  # the list starts on its own line after the filler
    n_fill = length - len(newline) - used - len(query_ids) - len(answer_ids)
    assert n_fill >= 0, "associative_recall reserve too small for this tokenizer"
    filler, _ = _filler(n_fill, tokenizer)
    tokens = np.concatenate([filler, newline, *pair_ids, query_ids, answer_ids]).astype(np.int64)
    params = {"n_pairs": len(keys), "depth": depth, "query_index": index, "query_key": keys[index]}
    return Sample(tokens, len(tokens) - len(answer_ids), len(tokens), values[index], "associative_recall", params)


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey,
    "multikey_needle": multikey_needle,
    "variable_tracking": variable_tracking,
    "associative_recall": associative_recall,
}


def make_task(kind: str, rng: np.random.Generator, length: int, tokenizer, **params) -> Sample:
    """Build one sample of task `kind` with exactly `length` tokens (see the module docstring)."""
    if kind not in TASKS:
        raise ValueError(f"unknown synthetic task {kind!r}; known tasks: {', '.join(TASKS)}")
    if length < 1:
        raise ValueError(f"length={length} must be >= 1")
    return TASKS[kind](rng, length, tokenizer, **params)
