"""Decoding with DeepSeek-V4's attention (the "v4" kind's `decode`, moe_lc/model/decode.py): exact, not yet fast.

Legend: B batch, S prompt length, T tokens cached so far, n tokens fed in one call, D model dim.

What a V4 layer would cache to decode in O(window + entries) per token is its sliding window's KV, the
compressed entries made so far, the compressors' partial windows (the tokens of an entry not yet complete,
with their gate logits) and, for CSA, the indexer's compressed keys (transformers' DeepseekV4HCACache /
DeepseekV4CSACache). That cache is not built here. This one keeps each layer's normalized input x (B, T, D)
and, for n new tokens, runs the layer's own forward over all T + n rows and keeps the last n: the same
numbers as the uncached model (window, entries, indexer and all), at O(T) per new token per layer. The
model's `rope` for this kind (v4_rope.PositionsOnly) hands decode.py's (cos, sin) as (positions, positions).
"""

from __future__ import annotations

import torch


class V4Decode:
    """The "v4" kind's cache: x (B, T, D), each layer's attention input."""

    @staticmethod
    def shapes(attn) -> dict[str, tuple[int, ...]]:
        return {"x": (attn.wa.weight.shape[1],)}

    @staticmethod
    def prefill(attn, x_BSD: torch.Tensor, positions: torch.Tensor, _positions=None):
        """The prompt (positions 0 .. S-1) through the module -> (out (B, S, D), {"x": x})."""
        return attn(x_BSD, positions), {"x": x_BSD}

    @staticmethod
    def step(attn, x_BnD: torch.Tensor, positions: torch.Tensor, _positions, cache, start: int) -> torch.Tensor:
        """n new tokens at positions start .. start+n-1: written to the cache, the layer rerun over every cached
        row, the last n rows returned (B, n, D)."""
        n = x_BnD.shape[1]
        cache.write(start, x=x_BnD)
        held = cache.read(start + n)["x"]
        return attn(held, torch.arange(start + n, device=held.device))[:, -n:]
