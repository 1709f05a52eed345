"""Datasets whose sample i is a pure function of (seed, i), and the per-step loader over them.

Because global sample i never depends on which rank asks, how many ranks there are, or what was read
before, a loader's whole state is one integer, `samples_consumed`: resuming is exact, and a run can
resume on a different data-parallel size (or global batch) and continue at the same global sample.

Every dataset's `__getitem__(i)` returns
    {"tokens": LongTensor (S+1,), "loss_mask": FloatTensor (S,) or None, "documents": LongTensor (n,) or None}
where tokens[:-1] are the inputs, tokens[1:] the labels, and loss_mask[t] weights the loss of predicting
tokens[t+1] (None = all ones). "documents" are the lengths of the documents over the S input positions,
in order, summing to exactly S: input position t belongs to the document that holds tokens[t], the first
length may be the tail of a document the window cut and the last the head of one (None = the whole
sample is one document). A Mixture adds "source": the index of the source it drew the sample from
(collate gives 0 to samples without one). Datasets are endless: i may be any non-negative integer.

Random streams are separated by a tag in the numpy SeedSequence key, so that a dataset inside a
Mixture never reuses the numbers the Mixture used to pick it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from moe_lc.data.corpus import stdlib_token_stream
from moe_lc.data.documents import check_starts, window_documents
from moe_lc.data.synthetic import TASKS, make_task
from moe_lc.data.token_corpus import open_token_corpus

_SYNTHETIC_STREAM = 0x73796E74  # "synt"
_MIXTURE_STREAM = 0x6D697874  # "mixt"
_SPLIT_IDS = {"train": 0, "val": 1}


def _check_index(i: int) -> int:
    if not isinstance(i, (int, np.integer)) or i < 0:
        raise IndexError(f"sample index must be a non-negative integer, got {i!r}")
    return int(i)


class TokenWindows:
    """Non-overlapping windows of a token stream, in a fresh random order every epoch.

    Window w is tokens[w*S : w*S + S + 1] (S = seq_len; consecutive windows share one boundary token so
    that every token is a label exactly once). Sample i is window perm_e[i % n_windows] with epoch
    e = i // n_windows and perm_e = default_rng([seed, e]).permutation(n_windows).

    doc_starts: the stream's (n_docs,) int64 document starts (documents.py); each sample's "documents"
    come from them by binary search. None: no boundaries known, "documents" is None.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, doc_starts: np.ndarray | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"data too short: {len(tokens)} tokens for seq_len {seq_len} (needs {seq_len + 1})")
        self.tokens = tokens
        self.doc_starts = None if doc_starts is None else check_starts(doc_starts, len(tokens), "TokenWindows")
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        self._perms: dict[int, np.ndarray] = {}  # epoch -> permutation; a cache, at most two epochs

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def window_index(self, i: int) -> int:
        """Which window global sample i reads."""
        i = _check_index(i)
        return int(self._permutation(i // self.n_windows)[i % self.n_windows])

    def __getitem__(self, i: int) -> dict:
        start = self.window_index(i) * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        documents = None
        if self.doc_starts is not None:
            documents = torch.from_numpy(window_documents(self.doc_starts, start, self.seq_len))
        return {"tokens": torch.from_numpy(window), "loss_mask": None, "documents": documents}


class SyntheticTasks:
    """Synthetic long-context task samples of exactly S+1 tokens (left-padded with PAD if shorter).

    Sample i: rng = default_rng([seed, tag, split, i]); kind = kinds[rng.integers(len(kinds))]; then
    make_task(kind, rng, S + 1, tokenizer, **task_params.get(kind, {})). The loss mask is 0 where the label
    is padding or follows only padding; with answer_only_loss=True it is 1 only on the answer tokens.
    A sample is one document ("documents": None), its padding included.
    """

    def __init__(
        self,
        kinds: Sequence[str],
        seq_len: int,
        seed: int,
        tokenizer,
        *,
        split: str = "train",
        answer_only_loss: bool = False,
        task_params: dict[str, dict] | None = None,
    ):
        if not kinds:
            raise ValueError(f"SyntheticTasks needs at least one task kind; known: {', '.join(TASKS)}")
        unknown = [k for k in kinds if k not in TASKS]
        if unknown:
            raise ValueError(f"unknown synthetic task(s) {unknown}; known tasks: {', '.join(TASKS)}")
        if split not in _SPLIT_IDS:
            raise ValueError(f"split={split!r} must be one of {tuple(_SPLIT_IDS)}")
        self.kinds = list(kinds)
        self.seq_len = seq_len
        self.seed = seed
        self.tokenizer = tokenizer
        self.split = split
        self.answer_only_loss = answer_only_loss
        self.task_params = dict(task_params or {})
        for kind in self.kinds:  # fail now, not at step 10k, if a task cannot fit in seq_len + 1 tokens
            make_task(kind, np.random.default_rng(0), seq_len + 1, tokenizer, **self.task_params.get(kind, {}))

    def sample(self, i: int):
        """The `synthetic.Sample` behind global sample i (answer span, parameters), unpadded."""
        rng = np.random.default_rng([self.seed, _SYNTHETIC_STREAM, _SPLIT_IDS[self.split], _check_index(i)])
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        return make_task(kind, rng, self.seq_len + 1, self.tokenizer, **self.task_params.get(kind, {}))

    def __getitem__(self, i: int) -> dict:
        sample = self.sample(i)
        n_pad = self.seq_len + 1 - len(sample.tokens)
        tokens = np.concatenate([np.full(n_pad, self.tokenizer.pad_id, dtype=np.int64), sample.tokens])
        label_pos = np.arange(1, self.seq_len + 1)  # loss_mask[t] is for label tokens[t + 1]
        if self.answer_only_loss:
            keep = (label_pos >= n_pad + sample.answer_start) & (label_pos < n_pad + sample.answer_end)
        else:
            keep = label_pos > n_pad  # the first real token has only padding before it: no loss either
        return {"tokens": torch.from_numpy(tokens), "loss_mask": torch.from_numpy(keep.astype(np.float32)),
                "documents": None}


class Mixture:
    """Sample i comes from source j ~ weights, drawn with default_rng([seed, tag, i]).

    The chosen source is asked for *its* sample i (the global index), which keeps every source a pure
    function of i. Consequence: with a TokenWindows source of weight w, each of its epochs (n_windows
    global samples) shows a random fraction ~w of its windows, none twice. A sample's "documents" are
    its source's; its "source" is j. `names`: one per source, for metrics (default source0, source1, ...).
    """

    def __init__(self, sources: Sequence, weights: Sequence[float], seed: int, names: Sequence[str] | None = None):
        if len(sources) == 0 or len(sources) != len(weights):
            raise ValueError(f"Mixture needs one weight per source: {len(sources)} sources, {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"Mixture weights must be >= 0 with a positive sum, got {list(weights)}")
        seq_lens = {getattr(s, "seq_len", None) for s in sources} - {None}
        if len(seq_lens) > 1:
            raise ValueError(f"Mixture sources have different seq_len: {sorted(seq_lens)}")
        self.sources = list(sources)
        self.names = list(names) if names is not None else [f"source{k}" for k in range(len(sources))]
        if len(self.names) != len(self.sources):
            raise ValueError(f"Mixture needs one name per source: {len(sources)} sources, {len(self.names)} names")
        self.weights = w / w.sum()
        self.seq_len = seq_lens.pop() if seq_lens else None
        self.seed = seed
        self._cumulative = np.cumsum(self.weights)

    def source_index(self, i: int) -> int:
        """Which source global sample i is drawn from."""
        u = np.random.default_rng([self.seed, _MIXTURE_STREAM, _check_index(i)]).random()
        return int(min(np.searchsorted(self._cumulative, u, side="right"), len(self.sources) - 1))

    def __getitem__(self, i: int) -> dict:
        j = self.source_index(i)
        return {**self.sources[j][i], "source": j}


def collate(samples: Sequence[dict]) -> dict:
    """Stack samples: tokens (B, S+1) int64; loss_mask (B, S) float32, or None if no sample has one
    (a sample without a mask, in a batch where others have one, gets ones); documents None if no
    sample has boundaries, else a list of B int64 tensors of document lengths, each summing to S (a
    sample without them is one document: tensor([S])); source (B,) int64, each sample's mixture source
    (0 where it has none)."""
    # numpy copies in this thread; torch.stack would split a 128K-token copy over the intra-op threads,
    # which on a busy CPU waits for them (measured: 17 ms instead of 0.03 ms per sample, tools/data_bench.py)
    tokens = torch.from_numpy(np.stack([s["tokens"].numpy() for s in samples]))
    seq_len = tokens.shape[1] - 1
    source = torch.tensor([s.get("source", 0) for s in samples], dtype=torch.int64)
    documents = None
    if any(s.get("documents") is not None for s in samples):
        whole = torch.tensor([seq_len], dtype=torch.int64)
        documents = [whole if s.get("documents") is None else s["documents"] for s in samples]
    if all(s["loss_mask"] is None for s in samples):
        return {"tokens": tokens, "loss_mask": None, "documents": documents, "source": source}
    ones = torch.ones(seq_len, dtype=torch.float32)
    masks = np.stack([(ones if s["loss_mask"] is None else s["loss_mask"]).numpy() for s in samples])
    return {"tokens": tokens, "loss_mask": torch.from_numpy(masks), "documents": documents, "source": source}


class StepLoader:
    """Feeds one data-parallel rank: each optimizer step consumes global_batch consecutive global indices.

    Step at `samples_consumed` = s covers [s, s + G); rank r takes [s + r*G/dp, s + (r+1)*G/dp) and cuts
    it into G / (dp * micro_batch) micro-batches in order. The union over ranks is the dp=1 batch.
    """

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1):
        for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("dp_size", dp_size)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"global_batch={global_batch} must be divisible by micro_batch={micro_batch} x "
                f"dp_size={dp_size} = {micro_batch * dp_size}"
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.samples_consumed = 0

    def step_indices(self) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches for the next step (consumes nothing): its
        global_batch / dp_size consecutive samples, micro_batch at a time (`TrainConfig.microbatches` lists)."""
        per_rank = self.global_batch // self.dp_size
        first = self.samples_consumed + self.dp_rank * per_rank
        starts = range(first, first + per_rank, self.micro_batch)
        return [list(range(start, start + self.micro_batch)) for start in starts]

    def next_step(self) -> list[dict]:
        """This rank's micro-batches for one optimizer step, each as `collate` returns it:
        [{"tokens": (mb, S+1) int64, "loss_mask": (mb, S) float32 or None,
          "documents": None or mb int64 tensors of document lengths summing to S, "source": (mb,) int64}, ...]."""
        batches = [collate([self.dataset[i] for i in indices]) for indices in self.step_indices()]
        self.samples_consumed += self.global_batch
        return batches

    def state_dict(self) -> dict:
        """All that is needed to resume (global_batch is informational: resuming with another is allowed)."""
        return {"samples_consumed": self.samples_consumed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        consumed = state["samples_consumed"]
        if not isinstance(consumed, (int, np.integer)) or consumed < 0:
            raise ValueError(f"samples_consumed={consumed!r} must be a non-negative integer")
        self.samples_consumed = int(consumed)


DATA_SOURCES = ("stdlib", "tokens", "synthetic", "stdlib+synthetic", "tokens+synthetic")


def build_dataset(
    source: str,
    *,
    split: str,
    seq_len: int,
    seed: int,
    tokenizer,
    path: str | Path | None = None,
    synthetic_kinds: Sequence[str] | None = None,
    synthetic_weight: float = 0.0,
    val_fraction: float = 0.02,
    task_params: dict[str, dict] | None = None,
):
    """Dataset for a recipe's `[data] source`.

    source:
      "stdlib"            the interpreter's standard library sources (val_fraction of files in 'val')
      "tokens"            token file `{path}.{split}` (built by tools/prepare_data.py --out path)
      "synthetic"         synthetic long-context tasks `synthetic_kinds` (default: all) only
      "stdlib+synthetic"  Mixture: synthetic with probability synthetic_weight (0 < w < 1), else stdlib
      "tokens+synthetic"  the same over a token file
    task_params: per-task keyword arguments of `make_task`, e.g. {"multikey_needle": {"n_keys": 2}}
    """
    if source not in DATA_SOURCES:
        raise ValueError(f"data source {source!r} is not one of {', '.join(DATA_SOURCES)}")
    base, _, extra = source.partition("+")
    if extra and not 0.0 < synthetic_weight < 1.0:
        raise ValueError(f"source {source!r} needs 0 < synthetic_weight < 1, got {synthetic_weight}")
    if not extra and base != "synthetic" and synthetic_weight != 0.0:
        raise ValueError(
            f"synthetic_weight={synthetic_weight} has no effect with source {source!r}; "
            f"use source '{base}+synthetic' to mix in synthetic tasks"
        )
    kinds = list(synthetic_kinds) if synthetic_kinds else list(TASKS)

    def synthetic() -> SyntheticTasks:
        return SyntheticTasks(kinds, seq_len, seed, tokenizer, split=split, task_params=task_params)

    if base == "synthetic":
        return synthetic()
    if base == "stdlib":
        tokens, starts = stdlib_token_stream(split, tokenizer, val_fraction, documents=True)
    else:
        tokens, starts = _open_split_tokens(path, split, tokenizer)
    windows = TokenWindows(tokens, seq_len, seed, doc_starts=starts)
    if not extra:
        return windows
    return Mixture([windows, synthetic()], [1.0 - synthetic_weight, synthetic_weight], seed, names=[base, "synthetic"])


def _open_split_tokens(path: str | Path | None, split: str, tokenizer):
    """(tokens, document starts) of split `split` at `path` (a token file, prepare_data's shards, or a
    glob: token_corpus.py), checked to be tokenized by `tokenizer`; a file without a document index has
    its documents found at its EOS tokens."""
    if path is None:
        raise ValueError("data source 'tokens' needs a path prefix (the --out of tools/prepare_data.py)")
    return open_token_corpus(path, split, tokenizer).stream()
