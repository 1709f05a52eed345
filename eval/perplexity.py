"""Perplexity vs context length (sliding window) and loss by token position, on held-out text.

Held-out text: the validation split of the run's corpus: the stdlib 'val' files (split by file, so
never trained on) for data.source = "stdlib" or "synthetic", the `{path}` token files' val split
(one file or prepare_data's shards) for data.source = "tokens", and for a `[[data.sources]]` mixture
its first source's. The first `max_tokens` tokens are used (a fixed, seeded-free prefix).

Sliding window (context length L, stride s <= L): windows [b, b + L) for b = 0, s, 2s, ...; the
first window scores all its L - 1 predictions, every later one only its last s (those with at
least L - s tokens of context), so each token is scored once (the usual "stride" perplexity).
Loss by position: mean loss at position t = 0 .. L-2 over non-overlapping windows of length L: how
much the model gains from more context, and where it falls apart beyond its trained length.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .model_io import forward_logits
from moe_lc.data import stdlib_token_stream
from moe_lc.data.token_corpus import open_token_corpus


def heldout_tokens(data_cfg, tokenizer, max_tokens: int) -> np.ndarray:
    """The first max_tokens tokens of the validation split (see the module docstring)."""
    source, path = data_cfg.source, data_cfg.path
    if data_cfg.sources:
        source, path = data_cfg.sources[0].source, data_cfg.sources[0].path
    if source == "tokens":
        tokens = open_token_corpus(path, "val", tokenizer).stream()[0]  # names a tokenizer mismatch
    else:
        tokens = stdlib_token_stream("val", tokenizer, data_cfg.val_fraction)
    if len(tokens) < 2:
        raise ValueError("the held-out split has fewer than 2 tokens")
    return np.asarray(tokens[:max_tokens], dtype=np.int64)


def _token_losses(model, windows: np.ndarray, batch_size: int) -> torch.Tensor:
    """Per-position next-token losses (W, L-1) for windows (W, L)."""
    out = []
    for start in range(0, len(windows), batch_size):
        batch = torch.from_numpy(windows[start:start + batch_size])
        logits = forward_logits(model, batch[:, :-1])
        out.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten().to(logits.device),
                                                     reduction="none").view(len(batch), -1).cpu())
    return torch.cat(out)


def sliding_window_perplexity(model, tokens: np.ndarray, length: int, stride: int, batch_size: int = 8) -> dict:
    """{"loss", "ppl", "tokens" scored, "windows"} for context length `length` and `stride`."""
    if not 1 <= stride <= length - 1:
        raise ValueError(f"stride={stride} must lie in [1, length - 1 = {length - 1}]")
    if len(tokens) < length:
        raise ValueError(f"{len(tokens)} held-out tokens are fewer than one window of {length}")
    starts = np.arange(0, len(tokens) - length + 1, stride)
    windows = np.stack([tokens[b:b + length] for b in starts])
    losses = _token_losses(model, windows, batch_size)
    scored = torch.cat([losses[0], losses[1:, length - 1 - stride:].flatten()])
    loss = scored.double().mean().item()
    return {"loss": loss, "ppl": math.exp(loss), "tokens": int(scored.numel()), "windows": len(windows)}


def loss_by_position(model, tokens: np.ndarray, length: int, batch_size: int = 8) -> list[float]:
    """Mean next-token loss at each position 0 .. length-2 over non-overlapping windows."""
    n = len(tokens) // length
    if n == 0:
        raise ValueError(f"{len(tokens)} held-out tokens are fewer than one window of {length}")
    windows = tokens[:n * length].reshape(n, length)
    return _token_losses(model, windows, batch_size).double().mean(0).tolist()


def run_perplexity(model, tokens: np.ndarray, lengths: list[int], stride: int, batch_size: int = 8,
                   progress=print) -> dict:
    """Perplexity per length (stride capped at L/2) and the loss by position at the largest length.
    `progress` gets exactly one line per length (run.py numbers them)."""
    out = {"by_length": {}, "skipped": {}, "stride": stride, "heldout_tokens": int(len(tokens))}
    for length in lengths:
        try:
            r = sliding_window_perplexity(model, tokens, length, min(stride, length // 2), batch_size)
        except ValueError as exc:
            out["skipped"][str(length)] = str(exc)
            progress(f"  perplexity length {length}: skipped ({exc})")
            continue
        r["stride"] = min(stride, length // 2)
        out["by_length"][str(length)] = r
        progress(f"  perplexity length {length}: ppl {r['ppl']:.3f} (loss {r['loss']:.4f}, {r['tokens']} tokens)")
    longest = max((int(k) for k in out["by_length"]), default=None)
    if longest is not None:
        out["position_window"] = longest
        out["loss_by_position"] = loss_by_position(model, tokens, longest, batch_size)
    return out
