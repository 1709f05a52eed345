"""Token shards of bounded size, written so that an interrupted prepare resumes where it stopped.

Layout for `--out PREFIX`, per split s:
    PREFIX.s.00000.{bin,json,docs.npy[,meta.jsonl]}, PREFIX.s.00001..., token files (token_file.py)
    PREFIX.s.shards.json          the manifest: the shards in order, written when the split is complete
    PREFIX.prepare.json           the run's settings and input files, written before the first shard

A shard is closed after the document that takes it to `shard_tokens` tokens (so shards end where
documents end, and a document is never split), and published atomically: its files appear complete or
not at all, the sidecar last. Its sidecar records "prepare": {"last_position": [file, record]}, the
position of its last document. A resumed run finds the complete shards of each split, removes the
temporary files a killed writer left, and gives each split only the documents past its last position;
the shards it then writes are the ones an uninterrupted run writes, byte for byte. A run reads a split
only through its manifest (token_corpus.py), so it never sees part of one.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np

from moe_lc import faults
from moe_lc.data.token_corpus import manifest_path
from moe_lc.data.token_file import TokenFileWriter, documents_path, metadata_path, read_token_meta

SHARD_DIGITS = 5


def shard_prefix(prefix: str, split: str, k: int) -> str:
    return f"{prefix}.{split}.{k:0{SHARD_DIGITS}d}"


def state_path(prefix: str) -> Path:
    return Path(f"{prefix}.prepare.json")


def write_json_atomic(path: Path, value) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def outputs_of(prefix: str, splits) -> list[Path]:
    """Every file a prepare into PREFIX may have written (shards, manifests, temporaries, its state, the
    single-file layout of earlier versions): what --overwrite removes."""
    out = [state_path(prefix)]
    for split in splits:
        escaped = glob.escape(f"{prefix}.{split}")
        out += [Path(p) for p in glob.glob(f"{escaped}.[0-9][0-9][0-9][0-9][0-9].*")]
        out += [Path(p) for p in glob.glob(f"{escaped}.*.tmp-*")]
        out += [manifest_path(prefix, split)] + [Path(f"{prefix}.{split}{ext}") for ext in (".bin", ".json")]
        out += [documents_path(f"{prefix}.{split}"), metadata_path(f"{prefix}.{split}")]
    return [p for p in out if p.exists()]


class SplitShards:
    """The shards of one split: the complete ones found on disk, then the ones this run writes.

    `add(ids, metadata, position)` appends a document (ids, then EOS) unless the split already holds
    `position`; `finish()` closes the open shard and writes the manifest."""

    def __init__(self, prefix: str, split: str, tokenizer, shard_tokens: int, metadata_fields: tuple[str, ...],
                 source: str):
        self.prefix, self.split, self.shard_tokens = prefix, split, shard_tokens
        self.tokenizer, self.metadata_fields, self.source = tokenizer, metadata_fields, source
        self.eos = np.array([tokenizer.eos_id], dtype=np.int64)
        for tmp in glob.glob(f"{glob.escape(f'{prefix}.{split}')}.*.tmp-*"):  # a killed writer's leftovers
            os.remove(tmp)
        self.done: list[dict] = []  # sidecars of the complete shards, in order
        while Path(shard_prefix(prefix, split, len(self.done)) + ".json").is_file():
            self.done.append(read_token_meta(shard_prefix(prefix, split, len(self.done))))
        self.last_position = tuple(self.done[-1]["prepare"]["last_position"]) if self.done else None
        self.writer: TokenFileWriter | None = None
        self.position = self.last_position
        self.resumed_shards = len(self.done)

    def wants(self, position: tuple[int, int]) -> bool:
        """Whether the document at `position` still has to be written to this split."""
        return self.last_position is None or position > self.last_position

    def add(self, ids: np.ndarray, metadata: dict, position: tuple[int, int]) -> None:
        if not self.wants(position) or len(ids) == 0:
            return
        if self.writer is None:
            self.writer = TokenFileWriter(shard_prefix(self.prefix, self.split, len(self.done)),
                                          tokenizer_name=self.tokenizer.name, vocab_size=self.tokenizer.vocab_size,
                                          source=self.source, metadata_fields=self.metadata_fields)
        self.writer.append_document(ids, self.eos, metadata=metadata)
        self.position = position
        if self.writer.n_tokens >= self.shard_tokens:
            self.commit()

    def commit(self) -> None:
        """Publish the open shard with the position of its last document."""
        self.writer.extra["prepare"] = {"last_position": list(self.position)}
        self.done.append(self.writer.close())
        self.writer = None
        self.last_position = self.position
        faults.maybe_kill_after_shard(self.shards_written)

    @property
    def shards_written(self) -> int:
        return len(self.done) - self.resumed_shards

    @property
    def n_tokens(self) -> int:
        return sum(m["n_tokens"] for m in self.done) + (self.writer.n_tokens if self.writer else 0)

    @property
    def n_documents(self) -> int:
        return sum(m.get("n_documents", 0) for m in self.done) + (self.writer.n_documents if self.writer else 0)

    def finish(self) -> dict:
        """Close the open shard, write the manifest (the split is complete); returns the manifest."""
        if self.writer is not None:
            self.commit()
        manifest = {
            "shards": [Path(shard_prefix(self.prefix, self.split, k)).name for k in range(len(self.done))],
            "n_tokens": sum(m["n_tokens"] for m in self.done),
            "n_documents": sum(m.get("n_documents", 0) for m in self.done),
            "tokenizer": self.tokenizer.name, "vocab_size": self.tokenizer.vocab_size,
            "max_token_id": max((m["max_token_id"] for m in self.done), default=-1),
            "metadata_fields": list(self.metadata_fields), "source": self.source,
        }
        write_json_atomic(manifest_path(self.prefix, self.split), manifest)
        return manifest

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
