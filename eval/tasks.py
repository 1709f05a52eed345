"""Long-context retrieval tasks, generated offline and seeded, scored by teacher-forced likelihood.

Every sample is `moe_lc.data.synthetic.make_task(kind, rng, length, tokenizer, ...)`: exactly
`length` tokens whose last tokens are the answer. One forward pass over tokens[:-1] scores it:
  logprob  mean log-probability of the answer tokens given everything before them
  exact    every answer token is the argmax (= greedy decoding reproduces the whole answer)
  token    fraction of answer tokens that are the argmax (per digit / letter with the byte tokenizer)
Sample i of a cell (task, length, depth) uses rng = default_rng([seed, task id, length, depth
index, i]): the same samples on every run and machine, independent of the other cells.

Chance (a guesser that knows the answer format but not the context; byte tokenizer):
  passkey            key uniform in [10000, 99999]: exact 1/90000 = 1.1e-5; per token
                     (1/9 + 4 x 1/10) / 5 = 0.102 (the first digit is never 0)
  multikey_needle    value uniform in [1e6, 1e7): exact 1/9e6; per token (1/9 + 6/10) / 7 = 0.102;
                     a model that copies *some* needle's value: exact 1/n_keys ("copy" chance)
  variable_tracking  n_hops names of 5 random capitals: exact 26^(-5 n_hops); per token over the
                     letters and separating spaces (spaces free): 0.164 for 4 hops; copying one of
                     the n_chains chains: 1/n_chains
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_lc.data import ByteTokenizer
from moe_lc.data.synthetic import TASKS, make_task
from .model_io import forward_logits
from .ruler_sample import TooShort

RETRIEVAL_TASKS = ("passkey", "multikey_needle", "variable_tracking")
TASK_IDS = {"passkey": 1, "multikey_needle": 2, "variable_tracking": 3, "associative_recall": 4}
DEPTH_TASKS = ("passkey", "multikey_needle")  # tasks with a needle depth (the heatmap's rows)
_SET_BY_HARNESS = ("rng", "length", "tokenizer", "depth", "haystack", "data")


def _generator(kind: str):
    if kind in TASKS:
        return TASKS[kind]
    from .ruler import RULER_TASKS

    return RULER_TASKS[kind][1]


def param_names(kind: str) -> tuple[str, ...]:
    """The parameters --task-param may set for `kind`: its generator's keywords the harness does not set."""
    return tuple(p for p in inspect.signature(_generator(kind)).parameters if p not in _SET_BY_HARNESS)


def param_error(kind: str, params: dict) -> str | None:
    """Why `params` cannot make a sample of `kind` (None when they can), found by making one 1-token
    sample: the generator checks its parameters before the length, so "too short" means they passed.
    Why here: run_retrieval records a generator's ValueError as that length being too short, so a bad
    parameter would otherwise skip every length and the eval would end "successfully" with no numbers."""
    defaults = inspect.signature(_generator(kind)).parameters
    for name, value in params.items():
        default = defaults[name].default
        if isinstance(default, int) and not isinstance(value, int):
            return f"{name}={value!r} must be an integer"
        if isinstance(default, float) and not isinstance(value, (int, float)):
            return f"{name}={value!r} must be a number"
    try:
        if kind in TASKS:
            make_task(kind, np.random.default_rng(0), 1, ByteTokenizer(), **params)
        else:
            from .ruler import make_ruler_sample
            from .haystack import Haystack

            tiny = Haystack("probe", np.arange(8, dtype=np.int64) + 65, np.array([0, 4]))
            make_ruler_sample(kind, np.random.default_rng(0), 1, ByteTokenizer(), haystack=tiny, **params)
    except TypeError as exc:  # a parameter this task's family does not take
        return str(exc)
    except TooShort:  # the parameters passed; a 1-token sample (or a missing QA file) is no fault of theirs
        return None
    except ValueError as exc:
        return None if "too short" in str(exc) else str(exc)
    return None


@dataclass
class Score:
    kind: str
    length: int
    depth: float | None
    logprob: float
    exact: bool
    token_acc: float
    params: dict = field(default_factory=dict)


def chance(kind: str, params: dict | None = None) -> dict:
    """Chance levels of `kind` (see the module docstring) for the task's parameters."""
    params = params or {}
    if kind == "passkey":
        return {"exact": 1 / 90_000, "token": (1 / 9 + 4 / 10) / 5}
    if kind == "multikey_needle":
        n_keys = params.get("n_keys", 4)
        return {"exact": 1 / 9_000_000, "token": (1 / 9 + 6 / 10) / 7, "copy_exact": 1 / n_keys}
    if kind == "variable_tracking":
        hops, chains = params.get("n_hops", 4), params.get("n_chains", 2)
        return {"exact": 26.0 ** (-5 * hops), "token": (5 * hops / 26 + (hops - 1)) / (6 * hops - 1),
                "copy_exact": 1 / chains}
    raise ValueError(f"no chance level defined for task {kind!r}")


def make_samples(kind: str, length: int, n: int, seed: int, tokenizer, depth: float | None = None,
                 depth_index: int = 0, **params):
    """n seeded samples of one cell; ValueError (from the task) when `length` is too short."""
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, TASK_IDS[kind], length, depth_index, i])
        extra = dict(params, depth=depth) if kind in DEPTH_TASKS else dict(params)
        out.append(make_task(kind, rng, length, tokenizer, **extra))
    return out


def score_samples(model, samples, batch_size: int = 8) -> list[Score]:
    """Teacher-forced answer scores; samples of one batch must share their length."""
    scores = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        tokens = torch.from_numpy(np.stack([s.tokens for s in batch]))
        logits = forward_logits(model, tokens[:, :-1])  # position t predicts token t + 1
        logp = torch.log_softmax(logits, dim=-1)
        for row, s in enumerate(batch):
            targets = tokens[row, s.answer_start:s.answer_end]
            pred = logp[row, s.answer_start - 1:s.answer_end - 1]
            hits = pred.argmax(-1).cpu() == targets
            scores.append(Score(s.kind, len(s.tokens), s.params.get("depth"),
                                pred.gather(-1, targets.to(pred.device)[:, None]).mean().item(),
                                bool(hits.all()), hits.float().mean().item(), s.params))
    return scores


def summarize(scores: list[Score]) -> dict:
    """Mean exact match, token accuracy and answer log-prob over a list of scores."""
    if not scores:
        return {"n": 0}
    return {"exact": float(np.mean([s.exact for s in scores])), "token_acc": float(np.mean([s.token_acc for s in scores])),
            "logprob": float(np.mean([s.logprob for s in scores])), "n": len(scores)}


def run_retrieval(model, kind: str, lengths: list[int], depths: list[float], n: int, seed: int, tokenizer,
                  batch_size: int = 8, progress=print, **params) -> dict:
    """One retrieval task over lengths (x depths for needle tasks):
    {"by_length": {L: summary}, "grid": {L: {depth: summary}} (needle tasks), "skipped": {L: why},
     "chance": {...}}. `progress` gets exactly one line per length (run.py numbers them)."""
    out = {"by_length": {}, "grid": {}, "skipped": {}, "chance": chance(kind, params), "params": params}
    cells = list(enumerate(depths)) if kind in DEPTH_TASKS else [(0, None)]
    for length in lengths:
        every = []
        for d_index, depth in cells:
            try:
                samples = make_samples(kind, length, n, seed, tokenizer, depth, d_index, **params)
            except ValueError as exc:
                out["skipped"][str(length)] = str(exc)
                every = []
                break
            scores = score_samples(model, samples, batch_size)
            every += scores
            if depth is not None:
                out["grid"].setdefault(str(length), {})[f"{depth:g}"] = summarize(scores)
        if every:
            out["by_length"][str(length)] = summarize(every)
            s = out["by_length"][str(length)]
            progress(f"  {kind} length {length}: exact {s['exact']:.3f} token {s['token_acc']:.3f} "
                     f"logprob {s['logprob']:.3f} (n={s['n']})")
        else:
            out["grid"].pop(str(length), None)
            progress(f"  {kind} length {length}: skipped ({out['skipped'][str(length)]})")
    return out
