"""RULER's aggregation tasks: common words extraction (cwe) and frequent words extraction (fwe).

cwe (RULER's common_words_extraction.py): a numbered list of words in which 10 words appear
`freq_cw` times each and every other word `freq_ucw` times (below 4K tokens RULER uses 6 and 1), after
one solved example of 20 words (3 and 1; from 4K: 40 words, 10 and 3); name the 10 most common words.
fwe (freq_words_extraction.py): a text of coded 6-letter words whose counts follow a zeta distribution
(alpha 2.0) over a vocabulary of (length - 50) / 50 words, the most frequent one replaced by "...";
name the three most frequent words after it.

Both fill the context with as many words as fit (RULER's binary search over the number of words) and
put the few tokens a whole word more would overflow in a preamble (ruler_sample.py). Words: the shipped
English words, then pseudo-words (words.py), where RULER continues with a larger English list.
"""

from __future__ import annotations

import numpy as np

from .ruler_sample import RulerSample, assemble, most_that_fit
from .words import distinct_words

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
                "above list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _word_list(seed: int, common: list[str], num_uncommon: int, common_repeats: int, uncommon_repeats: int):
    """RULER's get_example: the common words `common_repeats` times and `num_uncommon` other words
    `uncommon_repeats` times, shuffled, from their own seed (the same list for the same arguments)."""
    rng = np.random.default_rng(seed)
    uncommon = [w for w in distinct_words(rng, num_uncommon + len(common)) if w not in common][:num_uncommon]
    listed = common * common_repeats + uncommon * uncommon_repeats
    return [listed[i] for i in rng.permutation(len(listed))]


def common_words(rng: np.random.Generator, length: int, tokenizer, freq_cw: int = 30, freq_ucw: int = 3,
                 num_cw: int = 10, num_fewshot: int = 1) -> RulerSample:
    """The 10 most common words of a numbered list; answer " 1. w 2. w ..." (any order scores)."""
    if num_cw < 1 or freq_cw <= freq_ucw or freq_ucw < 1 or num_fewshot < 0:
        raise ValueError(f"need num_cw >= 1, freq_cw > freq_ucw >= 1, num_fewshot >= 0; got {num_cw}, {freq_cw}, "
                         f"{freq_ucw}, {num_fewshot}")
    short = length < 4096  # RULER's switch (on its max_seq_length)
    (shot_words, *shot_repeats), repeats = ((20, 3, 1), (6, 1)) if short else ((40, 10, 3), (freq_cw, freq_ucw))
    head, tail = (CWE_TEMPLATE + CWE_ANSWER_PREFIX).split("{context}")
    shots = []
    for _ in range(num_fewshot):
        common = distinct_words(rng, num_cw)
        listed = _word_list(int(rng.integers(2**62)), common, shot_words - num_cw, *shot_repeats)
        shots.append(head + _numbered(listed) + tail + " " + _numbered(common) + "\n")
    common, seed = distinct_words(rng, num_cw), int(rng.integers(2**62))

    def entries(num_uncommon):
        listed = _word_list(seed, common, num_uncommon, *repeats)
        return [np.asarray(t, dtype=np.int64) for t in tokenizer.encode_batch(
            [f"{i + 1}. {w}" + (" " if i + 1 < len(listed) else "") for i, w in enumerate(listed)])]

    def context(n):
        # each listed word costs at least a token for its number and one for itself
        k = most_that_fit(lambda m: sum(len(e) for e in entries(m)), n, 0, max(1, n // (2 * repeats[1])))
        context.num_words = num_cw + k
        return np.concatenate(entries(k))

    params = {"repeats": list(repeats), "num_cw": num_cw, "fewshot": num_fewshot}
    sample = assemble("common_words_extraction", length, tokenizer, ["".join(shots) + head, context, tail],
                      " " + _numbered(common), common, False, params, preamble=True)
    sample.params["num_words"] = context.num_words
    return sample


def _zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta(alpha), alpha > 1: the partial sum and the integral of its tail."""
    k = np.arange(1, terms + 1, dtype=np.float64)
    return float(np.sum(k ** -alpha) + terms ** (1 - alpha) / (alpha - 1))


def frequent_words(rng: np.random.Generator, length: int, tokenizer, alpha: float = 2.0, coded_wordlen: int = 6,
                   vocab_size: int = -1) -> RulerSample:
    """The three most frequent coded words after "..."; answer " w1 w2 w3" (any order scores)."""
    if alpha <= 1 or coded_wordlen < 1:
        raise ValueError(f"alpha={alpha} must be > 1 and coded_wordlen={coded_wordlen} >= 1")
    size = max(4, (length - 50) // 50) if vocab_size == -1 else vocab_size
    if size < 4:
        raise ValueError(f"vocab_size={size} must be >= 4 (the noise word and three answers)")
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    seen: dict[str, None] = {}
    while len(seen) < size:
        seen.setdefault("".join(rng.choice(letters, size=coded_wordlen)), None)
    vocab = sorted(seen)
    vocab = [vocab[i] for i in rng.permutation(size)]
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    answers = vocab[1:4]
    word_ids = [np.asarray(t, dtype=np.int64) for t in tokenizer.encode_batch([w + " " for w in vocab])]
    share = np.arange(1, size + 1, dtype=np.float64) ** -alpha / _zeta(alpha)
    order_seed = int(rng.integers(2**62))
    head, tail = (FWE_TEMPLATE + FWE_ANSWER_PREFIX).split("{context}")

    def counts(num_words):
        return (num_words * share).astype(int)

    def context(n):
        k = most_that_fit(lambda m: int(sum(c * len(w) for c, w in zip(counts(m), word_ids))), n, 1, max(2, 4 * n))
        listed = np.repeat(np.arange(size), counts(k))
        listed = listed[np.random.default_rng(order_seed).permutation(len(listed))]
        context.num_words = k
        return np.concatenate([word_ids[i] for i in listed]) if len(listed) else np.zeros(0, dtype=np.int64)

    sample = assemble("freq_words_extraction", length, tokenizer, [head, context, tail], " " + " ".join(answers),
                      answers, False, {"alpha": alpha, "vocab_size": size}, preamble=True)
    sample.params["num_words"] = context.num_words
    return sample
