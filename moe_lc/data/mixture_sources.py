"""The dataset a recipe's [data] describes, and the `[[data.sources]]` mixture: each source's corpus
opened, its documents chosen and packed, cut into windows; the sources (and the synthetic tasks' share,
`data.synthetic_weight`) drawn by weight; and what a run actually draws from each.

Sample i's source is `Mixture.source_index(i)`, a pure function of (seed, i), and the source's sample
is its own sample i, so resuming continues the exact sequence and every data-parallel layout sees the
same global samples. For the same reason the tokens drawn per source over any range of samples can be
counted without reading them (`drawn_tokens`): the trainer logs them per step, on the logging rank,
without a collective.
"""

from __future__ import annotations

import numpy as np

from moe_lc.data.corpus import stdlib_corpus
from moe_lc.data.document_select import Selection, select_documents
from moe_lc.data.loader import Mixture, SyntheticTasks, TokenWindows, build_dataset
from moe_lc.data.synthetic import TASKS
from moe_lc.data.token_corpus import open_token_corpus

REPORT_MAX_SAMPLES = 100_000  # the start-of-run report counts at most this many samples (~10 us each)


def source_windows(src, *, split: str, seq_len: int, seed: int, tokenizer, val_fraction: float) -> TokenWindows:
    """Windows of one `SourceConfig`'s packed documents; ValueError / FileNotFoundError name the source."""
    where = f"data source {src.label!r}"
    try:
        if src.source == "stdlib":
            corpus = stdlib_corpus(split, tokenizer, val_fraction)
        else:
            corpus = open_token_corpus(src.path, split, tokenizer)
        selection = Selection(src.concat_by, src.min_doc_tokens, src.max_doc_tokens, src.upsample_min_tokens,
                              src.upsample_factor)
        if selection.active:
            tokens, starts, _ = select_documents(corpus, selection)  # its errors get `where` below, once
        else:
            tokens, starts = corpus.stream()
        return TokenWindows(tokens, seq_len, seed, doc_starts=starts)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def mixture_from_config(data_cfg, *, split: str, seq_len: int, seed: int, tokenizer) -> Mixture:
    """A Mixture of `data_cfg.sources` (weights normalized to 1 - synthetic_weight) and, when
    `synthetic_weight` > 0, the synthetic tasks (named 'synthetic') with that weight."""
    sources = [source_windows(src, split=split, seq_len=seq_len, seed=seed, tokenizer=tokenizer,
                              val_fraction=data_cfg.val_fraction) for src in data_cfg.sources]
    weights = np.array([src.weight for src in data_cfg.sources], dtype=np.float64)
    weights = weights / weights.sum() * (1.0 - data_cfg.synthetic_weight)
    names = [src.label for src in data_cfg.sources]
    if data_cfg.synthetic_weight > 0:
        kinds = list(data_cfg.synthetic_tasks) or list(TASKS)
        sources.append(SyntheticTasks(kinds, seq_len, seed, tokenizer, split=split,
                                      task_params={"multikey_needle": {"n_keys": data_cfg.needle_keys}}))
        weights = np.append(weights, data_cfg.synthetic_weight)
        names.append("synthetic")
    return Mixture(sources, weights.tolist(), seed, names=names)


def dataset_from_config(data_cfg, *, split: str, seq_len: int, seed: int, tokenizer):
    """The dataset a recipe's [data] section describes (`moe_lc.config.DataConfig`): `source` plus
    `synthetic_weight` > 0 means a mixture with the synthetic tasks; `[[data.sources]]` a mixture of
    those corpora (mixture_sources.py)."""
    if data_cfg.sources:
        return mixture_from_config(data_cfg, split=split, seq_len=seq_len, seed=seed, tokenizer=tokenizer)
    source, weight = data_cfg.source, data_cfg.synthetic_weight
    if source == "synthetic":
        weight = 1.0
    elif weight > 0:
        source = f"{source}+synthetic"
    return build_dataset(source, split=split, seq_len=seq_len, seed=seed, tokenizer=tokenizer,
                         path=data_cfg.path or None, synthetic_kinds=data_cfg.synthetic_tasks,
                         synthetic_weight=weight, val_fraction=data_cfg.val_fraction,
                         task_params={"multikey_needle": {"n_keys": data_cfg.needle_keys}})


def drawn_counts(dataset, first: int, count: int) -> np.ndarray:
    """(n_sources,) int64: how many of global samples [first, first + count) each source gives."""
    picks = [dataset.source_index(i) for i in range(first, first + count)]
    return np.bincount(np.asarray(picks, dtype=np.int64), minlength=len(dataset.sources))


def source_names(dataset) -> list[str]:
    """A Mixture's source names, in the order of its samples' "source" index; [] for any other dataset."""
    return list(dataset.names) if isinstance(dataset, Mixture) else []


def drawn_tokens(dataset, first: int, count: int, seq_len: int) -> dict[str, float]:
    """{"data/tokens/<name>": input tokens drawn from that source} over global samples [first, first +
    count), for a Mixture; {} for any other dataset (one source: nothing to tell apart)."""
    if not isinstance(dataset, Mixture):
        return {}
    counts = drawn_counts(dataset, first, count)
    return {f"data/tokens/{name}": float(n * seq_len) for name, n in zip(dataset.names, counts)}


def mixture_report(dataset, first: int, count: int, seq_len: int) -> dict | None:
    """What a run draws from each source over samples [first, first + count) (at most
    REPORT_MAX_SAMPLES of them, from `first`): {"samples", "first", "sources": [{"name", "weight",
    "samples", "tokens", "share"}]}; None for a dataset that is not a Mixture."""
    if not isinstance(dataset, Mixture):
        return None
    count = min(count, REPORT_MAX_SAMPLES)
    counts = drawn_counts(dataset, first, count) if count > 0 else np.zeros(len(dataset.sources), np.int64)
    rows = [{"name": name, "weight": float(w), "samples": int(n), "tokens": int(n) * seq_len,
             "share": float(n / count) if count else 0.0}
            for name, w, n in zip(dataset.names, dataset.weights, counts)]
    return {"first": first, "samples": count, "sources": rows}


def format_report(report: dict) -> str:
    """The report as one line per source, for the console."""
    head = (f"data mixture: samples {report['first']:,}-{report['first'] + report['samples'] - 1:,} "
            f"({report['samples']:,}) draw")
    rows = [f"  {r['name']:<16s} {r['share']:6.1%} of samples, {r['tokens']:>14,d} tokens (weight {r['weight']:.3f})"
            for r in report["sources"]]
    return "\n".join([head, *rows])
