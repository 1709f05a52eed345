"""RULER's synthetic task families, generated offline and seeded: the 13 tasks of its table by their names.

Parameters are RULER's (github.com/NVIDIA/RULER: scripts/synthetic.yaml for each task's arguments,
scripts/data/synthetic/constants.py for the templates, answer prefixes and generation budgets, the
data/synthetic/*.py generators for how contexts are built); what differs is said where it is done.

  niah_single_1      noise haystack (repeated lines)     key: word    value: 7-digit number
  niah_single_2      real-text haystack (--haystack)     key: word    value: number
  niah_single_3      real-text haystack                  key: word    value: UUID
  niah_multikey_1    real-text haystack, 4 keys (1 asked) key: word    value: number
  niah_multikey_2    haystack of distractor needles      key: word    value: number
  niah_multikey_3    haystack of distractor needles      key: UUID    value: UUID   (the UUID-dense haystack)
  niah_multivalue    real-text haystack, 4 values for the key asked
  niah_multiquery    real-text haystack, 4 keys asked at once
  vt                 variable tracking: 1 chain of 4 hops in the noise haystack, one in-context example
  cwe / fwe          common / frequent words extraction (ruler_lists.py)
  qa_1 / qa_2        QA over distractor documents, SQuAD / HotpotQA from a local JSONL file (ruler_qa.py)

Each task is a function (rng, length, tokenizer, **params) -> RulerSample (ruler_sample.py). A needle
lands at a sentence start of the real text (depths drawn from RULER's 40 evenly spaced ones, without
replacement) or at a line start of a line haystack (uniform, as RULER's random line index).
"""

from __future__ import annotations

import numpy as np

from .ruler_lists import common_words, frequent_words
from .ruler_qa import qa
from .ruler_sample import NOISE, RulerSample, TooShort, assemble, encode, insert_pieces, lines_tail, tiled_tail
from .words import draw_distinct

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                 "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                 "magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                    "are assigned the value {query}, they are: ")
DEPTHS = np.round(np.linspace(0, 100, num=40)).astype(int)  # RULER's needle depths, in percent


def _split(template: str, **fields) -> tuple[str, str]:
    """(text before {context}, text after it) with the other fields filled."""
    head, tail = template.split("{context}")
    return head.format(**fields), tail.format(**fields)


def _room(n: int, pieces: list[np.ndarray]) -> int:
    """Tokens of haystack left beside the needles in a context of n (TooShort when they do not fit)."""
    room = n - sum(len(p) for p in pieces)
    if room < 0:
        raise TooShort(f"its needles take {n - room} tokens, more than the {n} the context has")
    return room


def _essay(haystack, rng, pieces: list[np.ndarray]):
    """context(n): a real-text window with `pieces` at sentence starts (RULER's depths)."""
    if haystack is None:
        raise ValueError("this task needs a real-text haystack (eval/haystack.py)")

    def context(n):
        filler, starts = haystack.window(_room(n, pieces), rng)
        depths = sorted(rng.choice(DEPTHS, size=len(pieces), replace=len(pieces) > len(DEPTHS)) / 100)
        tokens, actual = insert_pieces(filler, starts, pieces, depths)
        context.depths = actual
        return tokens
    return context


def _lines(rng, pieces: list[np.ndarray], make_filler, depths=None):
    """context(n): line filler (make_filler(n) -> (tokens, line starts)) with `pieces` at line starts."""
    def context(n):
        filler, starts = make_filler(_room(n, pieces))
        at = depths if depths is not None else sorted(rng.uniform(size=len(pieces)))
        tokens, actual = insert_pieces(filler, starts, pieces, at)
        context.depths = actual
        return tokens
    return context


def _needle_lines(rng, tokenizer, type_k: str, type_v: str, avoid: set[str]):
    """make_filler(n) for RULER's "needle" haystack: lines of needles with other keys and values."""
    def make(n):
        lines, total, keys = [], 0, set(avoid)
        while total < n:
            batch = max(4, (n - total) // 40 + 4)
            new_keys = draw_distinct(rng, type_k, batch, avoid=keys)
            keys.update(new_keys)
            texts = [NEEDLE.format(type_needle_v=type_v, key=k, value=v) + "\n"
                     for k, v in zip(new_keys, draw_distinct(rng, type_v, batch))]
            for ids in tokenizer.encode_batch(texts):
                lines.append(np.asarray(ids, dtype=np.int64))
                total += len(ids)
        ends = np.cumsum([len(line) for line in lines])
        make.n_lines = int(np.sum(ends > total - n))  # the lines (the first possibly cropped) in the tail
        return lines_tail(lines, n)
    return make


def niah(rng: np.random.Generator, length: int, tokenizer, haystack=None, type_haystack: str = "essay",
         type_needle_k: str = "words", type_needle_v: str = "numbers", num_needle_k: int = 1,
         num_needle_v: int = 1, num_needle_q: int = 1) -> RulerSample:
    """Needles "One of the special magic {numbers} for {key} is: {value}." in a haystack; asked for the
    values of `num_needle_q` keys (RULER's niah.py). Answer: the values, ", "-separated, in asking order."""
    if min(num_needle_k, num_needle_v, num_needle_q) < 1 or num_needle_q > max(num_needle_k, num_needle_q):
        raise ValueError(f"num_needle_k/v/q = {num_needle_k}/{num_needle_v}/{num_needle_q} must be >= 1")
    if type_haystack not in ("essay", "noise", "needle"):
        raise ValueError(f"type_haystack={type_haystack!r} must be essay, noise or needle")
    num_k = max(num_needle_k, num_needle_q)
    keys = draw_distinct(rng, type_needle_k, num_k)
    flat = draw_distinct(rng, type_needle_v, num_k * num_needle_v)
    values = [flat[i * num_needle_v:(i + 1) * num_needle_v] for i in range(num_k)]
    needles = [NEEDLE.format(type_needle_v=type_needle_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    needles = [needles[i] for i in rng.permutation(len(needles))]
    asked = [int(i) for i in rng.choice(num_k, size=num_needle_q, replace=False)]
    answers = [v for i in asked for v in values[i]]
    query = ", ".join(keys[i] for i in asked[:-1]) + f", and {keys[asked[-1]]}" if num_needle_q > 1 else keys[asked[0]]
    template, type_v = NIAH_TEMPLATE + NIAH_ANSWER_PREFIX, type_needle_v
    if num_needle_q * num_needle_v == 1:  # RULER's singular wording for one answer
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
        type_v = type_v[:-1]
    head, tail = _split(template, type_needle_v=type_v, query=query)
    if type_haystack == "essay":
        context = _essay(haystack, rng, [encode(tokenizer, n + " ") for n in needles])
    else:  # line haystacks: the context's last line ends in "\n", where RULER's template has its own
        tail = tail.removeprefix("\n")
        pieces = [encode(tokenizer, n + "\n") for n in needles]
        if type_haystack == "noise":
            unit = encode(tokenizer, NOISE + "\n")
            context = _lines(rng, pieces, lambda n: tiled_tail(unit, n))
        else:
            distractors = _needle_lines(rng, tokenizer, type_needle_k, type_needle_v, set(keys))
            context = _lines(rng, pieces, distractors)
    params = {"type_haystack": type_haystack, "type_needle_k": type_needle_k, "type_needle_v": type_needle_v,
              "num_needle_k": num_k, "num_needle_v": num_needle_v, "num_needle_q": num_needle_q,
              "keys": keys, "asked": [keys[i] for i in asked]}
    sample = assemble("niah", length, tokenizer, [head, context, tail], " " + ", ".join(answers), answers,
                      num_needle_q * num_needle_v == 1, params)
    sample.params["depths_actual"] = context.depths
    # needles a copying model could pick from (the copy chance): the distractor lines too, the first
    # of them possibly cropped
    sample.params["needles_in_context"] = len(needles) + (distractors.n_lines if type_haystack == "needle" else 0)
    return sample


def _chains(rng, num_chains: int, num_hops: int) -> tuple[list[list[str]], list[list[str]], list[str]]:
    """(variable names per chain, statements per chain, values) as RULER's generate_chains."""
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    seen: dict[str, None] = {}
    while len(seen) < num_chains * (num_hops + 1):
        seen.setdefault("".join(rng.choice(letters, size=5)), None)
    names = list(seen)
    chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
    values = [str(int(v)) for v in rng.integers(10_000, 99_999, size=num_chains)]
    statements = [[f"VAR {chain[0]} = {value}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(num_hops)]
                  for chain, value in zip(chains, values)]
    return chains, statements, values


def _vt_parts(rng, tokenizer, haystack, type_haystack: str, num_chains: int, num_hops: int, noise_lines=None):
    """(head, context(n) or fixed context tokens, tail, answer, values) of one variable-tracking prompt."""
    chains, statements, values = _chains(rng, num_chains, num_hops)
    head, tail = _split(VT_TEMPLATE + VT_ANSWER_PREFIX, query=values[0], num_v=num_hops + 1)
    if type_haystack == "essay":
        flat = [s for chain in statements for s in chain]  # RULER interleaves chains; each keeps its order
        context = _essay(haystack, rng, [encode(tokenizer, s.strip() + ". ") for s in flat])
    else:
        tail = tail.removeprefix("\n")
        pieces = [encode(tokenizer, s + "\n") for chain in statements for s in chain]
        depths = [d for chain in statements for d in sorted(rng.uniform(size=len(chain)))]
        unit = encode(tokenizer, NOISE + "\n")
        context = _lines(rng, pieces, lambda n: tiled_tail(unit, n), depths)
        if noise_lines is not None:
            context = context(len(unit) * noise_lines + sum(len(p) for p in pieces))
    return head, context, tail, " ".join(chains[0]), chains[0]


def variable_tracking(rng: np.random.Generator, length: int, tokenizer, haystack=None, type_haystack: str = "noise",
                      num_chains: int = 1, num_hops: int = 4, fewshot: int = 1, fewshot_noise_lines: int = 2
                      ) -> RulerSample:
    """Chains "VAR A = 12345", "VAR B = VAR A", ... in a haystack; name every variable of the first chain
    (RULER's variable_tracking.py), after `fewshot` solved examples. RULER's example has ~500 tokens of
    noise; here it has `fewshot_noise_lines` noise lines, so that it fits short contexts."""
    if num_chains < 1 or num_hops < 1 or fewshot < 0 or fewshot_noise_lines < 0:
        raise ValueError(f"num_chains={num_chains}, num_hops={num_hops} must be >= 1; fewshot={fewshot}, "
                         f"fewshot_noise_lines={fewshot_noise_lines} >= 0")
    examples = []
    for _ in range(fewshot):
        head, context, tail, answer, _ = _vt_parts(rng, tokenizer, haystack, "noise", num_chains, num_hops,
                                                   noise_lines=fewshot_noise_lines)
        examples += [head, context, tail + answer + "\n\n"]
    head, context, tail, answer, names = _vt_parts(rng, tokenizer, haystack, type_haystack, num_chains, num_hops)
    params = {"type_haystack": type_haystack, "num_chains": num_chains, "num_hops": num_hops, "fewshot": fewshot,
              "variables": names}
    return assemble("variable_tracking", length, tokenizer, [*examples, head, context, tail], answer, names, True,
                    params)


# name -> (family, generator, RULER's arguments from scripts/synthetic.yaml)
RULER_TASKS = {
    "niah_single_1": ("niah", niah, dict(type_haystack="noise", type_needle_k="words", type_needle_v="numbers")),
    "niah_single_2": ("niah", niah, dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers")),
    "niah_single_3": ("niah", niah, dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids")),
    "niah_multikey_1": ("niah", niah, dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                           num_needle_k=4)),
    "niah_multikey_2": ("niah", niah, dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers")),
    "niah_multikey_3": ("niah", niah, dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids")),
    "niah_multivalue": ("niah", niah, dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                           num_needle_v=4)),
    "niah_multiquery": ("niah", niah, dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                           num_needle_q=4)),
    "vt": ("variable_tracking", variable_tracking, dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", common_words, dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", frequent_words, dict(alpha=2.0)),
    "qa_1": ("qa", qa, dict(dataset="squad")),
    "qa_2": ("qa", qa, dict(dataset="hotpotqa")),
}
# scripts/data/synthetic/constants.py: tokens_to_generate; scripts/eval/synthetic/constants.py: metric_fn
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
                      "freq_words_extraction": 50, "qa": 32}
METRIC = {"niah": "all", "variable_tracking": "all", "common_words_extraction": "all", "freq_words_extraction": "all",
          "qa": "part"}
NEEDS_HAYSTACK = tuple(name for name, (_, fn, args) in RULER_TASKS.items()
                       if args.get("type_haystack") == "essay")
NEEDS_QA = {"qa_1": "squad", "qa_2": "hotpotqa"}


def make_ruler_sample(name: str, rng: np.random.Generator, length: int, tokenizer, haystack=None, qa_data=None,
                      **params) -> RulerSample:
    """One sample of RULER task `name` with exactly `length` tokens; `params` override RULER's arguments."""
    family, fn, defaults = RULER_TASKS[name]
    args = dict(defaults, **params)
    if family == "qa":
        args["data"] = qa_data
    elif args.get("type_haystack") == "essay" or fn is niah:
        args["haystack"] = haystack
    sample = fn(rng, length, tokenizer, **args)
    assert len(sample.tokens) == length, (name, len(sample.tokens), length)
    return sample
