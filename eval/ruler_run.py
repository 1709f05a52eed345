"""Scoring the RULER tasks as RULER scores them: string match over a greedy generation; beside it, where
the answer is one fixed text, our teacher-forced exact match of that text.

Per sample, one prefill of the prompt (moe_lc/model/decode.py; through the ring under CP) serves both:
  teacher forcing  the reference answer fed after the prompt (one `extend`): exact = every answer token is
                   the argmax given the ones before it; token = the fraction that are; logprob = their mean
                   log-probability. Reported only for tasks whose answer is one fixed text ("ordered").
  generation       the cache rewound to the prompt, then greedy decoding for RULER's budget (niah 128,
                   vt 30, cwe 120, fwe 50, qa 32 tokens; `gen_tokens` caps it) or until EOS. The text is
                   cleaned as RULER's evaluate.py does (control characters made newlines, stripped) and
                   scored by its metric: string_match_all (the fraction of references found in it,
                   case-insensitively) for niah, vt, cwe, fwe; string_match_part (1 if any is) for qa.
When greedy decoding reproduces the reference answer token for token (teacher-forced exact), the
generation starts with the answer, so its string match is 1: the two agree on a deterministic answer.

Sample i of a cell (task, length) uses rng = default_rng([seed, 100 + task index, length, i]).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from moe_lc.model.decode import extend, greedy_from, new_cache, prefill
from .ruler import METRIC, NEEDS_QA, RULER_TASKS, TOKENS_TO_GENERATE, make_ruler_sample
from .ruler_sample import TooShort

RULER_NAMES = tuple(RULER_TASKS)
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(text: str) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """The fraction of references that occur in the prediction, case-insensitively (RULER, 0..1 here)."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 when any reference occurs in the prediction, case-insensitively (RULER, 0..1 here)."""
    return float(any(r.lower() in prediction.lower() for r in references))


METRICS = {"all": string_match_all, "part": string_match_part}


def family(name: str) -> str:
    return RULER_TASKS[name][0]


def make_samples(name: str, length: int, n: int, seed: int, tokenizer, haystack=None, qa_data=None, **params):
    """n seeded samples of one cell; TooShort when `length` cannot hold the task."""
    task_id = 100 + RULER_NAMES.index(name)
    return [make_ruler_sample(name, np.random.default_rng([seed, task_id, length, i]), length, tokenizer,
                              haystack=haystack, qa_data=qa_data, **params) for i in range(n)]


def _cut_at(ids: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    for k, t in enumerate(ids):
        if t in stop_ids:
            return ids[:k]
    return ids


@torch.no_grad()
def score_samples(model, samples, tokenizer, gen_tokens: int, batch_size: int = 8) -> list[dict]:
    """Per sample: {"prediction", "string_match", and with an ordered answer "exact", "token_acc",
    "logprob"}; samples sharing a prompt length are batched."""
    stop_ids = (tokenizer.eos_id,)
    metric = METRICS[METRIC[samples[0].kind]] if samples else None
    out: list[dict | None] = [None] * len(samples)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.answer_start, []).append(i)
    for start, members in groups.items():
        for b in range(0, len(members), batch_size):
            rows = members[b:b + batch_size]
            tokens = torch.from_numpy(np.stack([samples[i].tokens for i in rows]))
            answer_len = tokens.shape[1] - start
            cache = new_cache(model, len(rows), start + max(gen_tokens, answer_len))
            first = prefill(model, tokens[:, :start], cache)
            teacher = None
            if samples[rows[0]].ordered:
                rest = extend(model, tokens[:, start:-1], cache) if answer_len > 1 else first[:, None][:, :0]
                teacher = torch.log_softmax(torch.cat([first[:, None], rest], 1), -1).cpu()
                cache.rewind(start)
            generated = greedy_from(model, first, cache, gen_tokens, stop_ids).cpu().tolist()
            for k, i in enumerate(rows):
                text = postprocess(tokenizer.decode(_cut_at(generated[k], stop_ids)))
                score = {"prediction": text, "string_match": metric(text, samples[i].outputs)}
                if teacher is not None:
                    target = tokens[k, start:]
                    hits = teacher[k].argmax(-1) == target
                    score.update(exact=bool(hits.all()), token_acc=hits.float().mean().item(),
                                 logprob=teacher[k].gather(-1, target[:, None]).mean().item())
                out[i] = score
    return out


def chance(name: str) -> dict:
    """What scores without reading the context. "guess": the string match of a guesser that knows the answer's
    format (a uniform number, UUID or name per answer); "note" says what a model that copies from the
    context scores: string match finds a reference anywhere in the generation, so listing every needle of a
    noise or real-text haystack (at most 4) scores 1, while the copy chance per length (by_length's
    copy_chance) is that of copying one item of the right kind picked at random."""
    args = RULER_TASKS[name][2]
    if family(name) == "niah":
        guess = 1 / 9_000_000 if args["type_needle_v"] == "numbers" else 2.0 ** -122
        return {"guess": guess, "note": "copy_chance: one needle of the context picked at random, 1 / needles; "
                                        "listing every needle scores 1 where they fit the generation (<= 4 needles)"}
    if name == "vt":
        return {"guess": 26.0 ** -5, "note": "copying one chain of the context: 1 / chains (1 here), but the "
                                             "in-context example's chain is a decoy (copying it scores 0)"}
    if name == "cwe":
        return {"guess": None, "note": "copy_chance: 10 of the list's distinct words picked at random, "
                                       "10 / distinct words per reference"}
    if name == "fwe":
        return {"guess": None, "note": "copy_chance: 3 of the vocabulary's words but '...' picked at random, "
                                       "3 / (vocabulary - 1)"}
    return {"guess": None, "note": "open answers: no closed-form chance (a closed-book model scores what it knows)"}


def _copy_chance(name: str, samples) -> float | None:
    if family(name) == "niah":
        return float(np.mean([1 / s.params["needles_in_context"] for s in samples]))
    if name == "cwe":
        return float(np.mean([s.params["num_cw"] / s.params["num_words"] for s in samples]))
    if name == "fwe":
        return float(np.mean([3 / (s.params["vocab_size"] - 1) for s in samples]))
    return None


def summarize(scores: list[dict]) -> dict:
    """Mean string match, nulls (empty generations), and the teacher-forced means where there are any."""
    out = {"string_match": float(np.mean([s["string_match"] for s in scores])), "n": len(scores),
           "nulls": sum(not s["prediction"] for s in scores)}
    if scores and "exact" in scores[0]:
        for key in ("exact", "token_acc", "logprob"):
            out[key] = float(np.mean([s[key] for s in scores]))
    return out


def run_ruler(model, name: str, lengths: list[int], n: int, seed: int, tokenizer, haystack=None, qa_data=None,
              batch_size: int = 8, gen_tokens: int = 0, progress=print, **params) -> dict:
    """One RULER task over lengths: {"by_length": {L: summary}, "skipped": {L: why}, "chance", "metric",
    "tokens_to_generate", "examples": {L: first sample's prediction and references}}. `gen_tokens` > 0
    caps RULER's budget. `progress` gets exactly one line per length."""
    budget = TOKENS_TO_GENERATE[family(name)]
    budget = min(budget, gen_tokens) if gen_tokens > 0 else budget
    out = {"by_length": {}, "skipped": {}, "chance": chance(name), "params": params, "tokens_to_generate": budget,
           "metric": f"string_match_{METRIC[family(name)]}", "examples": {}}
    data = qa_data.get(NEEDS_QA[name]) if name in NEEDS_QA and qa_data else None
    for length in lengths:
        try:
            samples = make_samples(name, length, n, seed, tokenizer, haystack, data, **params)
        except TooShort as exc:
            out["skipped"][str(length)] = str(exc)
            progress(f"  {name} length {length}: skipped ({exc})")
            continue
        scores = score_samples(model, samples, tokenizer, budget, batch_size)
        s = out["by_length"][str(length)] = summarize(scores)
        copy = _copy_chance(name, samples)
        if copy is not None:
            s["copy_chance"] = copy
        out["examples"][str(length)] = {"prediction": scores[0]["prediction"][:200], "outputs": samples[0].outputs}
        tf = f" | teacher-forced exact {s['exact']:.3f}" if "exact" in s else ""
        progress(f"  {name} length {length}: string match {s['string_match']:.3f}{tf} (n={s['n']})")
    return out


def average_by_length(tasks: dict[str, dict], lengths: list[int]) -> dict:
    """RULER's average per length over the RULER tasks scored there: {L: {"score", "tasks"}}."""
    out = {}
    for length in lengths:
        scored = [r["by_length"][str(length)]["string_match"] for name, r in tasks.items()
                  if name in RULER_TASKS and str(length) in r.get("by_length", {})]
        if scored:
            out[str(length)] = {"score": float(np.mean(scored)), "tasks": len(scored)}
    return out

