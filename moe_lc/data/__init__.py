"""Data: tokenizers, the offline stdlib corpus, token files, synthetic long-context tasks, datasets and the
step loader. Global sample i is a pure function of (seed, i); see loader.py."""

from moe_lc.data.corpus import stdlib_token_stream
from moe_lc.data.documents import starts_from_eos, window_documents
from moe_lc.data.loader import (
    DATA_SOURCES,
    Mixture,
    StepLoader,
    SyntheticTasks,
    TokenWindows,
    build_dataset,
    collate,
)
from moe_lc.data.mixture_sources import dataset_from_config
from moe_lc.data.synthetic import TASKS, Sample, make_task
from moe_lc.data.token_file import check_vocab, open_token_file, write_token_file
from moe_lc.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DATA_SOURCES",
    "HFTokenizer",
    "Mixture",
    "Sample",
    "StepLoader",
    "SyntheticTasks",
    "TASKS",
    "TokenWindows",
    "build_dataset",
    "check_vocab",
    "collate",
    "dataset_from_config",
    "load_tokenizer",
    "make_task",
    "open_token_file",
    "starts_from_eos",
    "stdlib_token_stream",
    "window_documents",
    "write_token_file",
]
