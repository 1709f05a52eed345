"""Which attention kernels a run's stack launches, as the kernel-rate table's attention kinds (clusters.py), and
what a model's attention does to them that its recipe cannot say.

    cudnn   (the default) the fastest kernel the H100 bench measured per shape: cuDNN's fused attention, what
            Transformer Engine (Megatron, NeMo AutoModel's "te" attention), torch's SDPA cuDNN backend and this
            repo's "auto" run: the `attention_fwd` / `attention_bwd` kinds
    fa2     FlashAttention-2 (torch's own flash kernel, SDPA's flash backend, the flash-attn 2 package): the
            `attention_fa2_fwd` / `_bwd` kinds, fitted to the same bench's raw:aten_flash rows
    flex    torch's FlexAttention (torch.nn.attention.flex_attention; NeMo AutoModel's `attn: flex`, which its
            GPT-OSS configs use for the sinks and the sliding window): Triton kernels at FlashAttention-2's level,
            not the Hopper-specific cuDNN / FA3 ones (PyTorch's FlexAttention announcement, pytorch.org/blog/
            flexattention, measures it against FlashAttention-2, a little below it): priced as `fa2`

Two properties of a model's attention change what those kernels cost; moe_lc's config has no field for the second,
so a published run states it (tools/step_time/published_runs.py):

    head dim  the bench measured query / key heads of 128 (and MLA's 192). Heads of 64 (GPT-OSS) run the same
              kernels slower per FLOP: the FlashAttention-3 paper (Shah et al., arXiv 2407.08608, Figures 5 and 6:
              H100 SXM5, BF16, sequence 4K) measures cuDNN's forward (causal) at 363 TFLOP/s at head dim 64 against
              518 at 128 and its backward at 417 against 499; FlashAttention-2's at 284 against 319 and 279 against
              310. `HEAD_DIM_64` holds those ratios; a model with heads of 64 or fewer gets them
    window    a sliding window on some layers (GPT-OSS: 128 tokens on every other layer, its config.json's
              `sliding_window` and `layer_types`). The traced kernels are full causal ones; a windowed layer's
              kernel visits only the key tiles its window overlaps (cuDNN's sliding-window support and
              FlexAttention's block mask skip the others), two tiles of 128 keys per query tile at a window of 128
              against (S/128 + 1)/2 causally. `SlidingWindow.work` is that fraction averaged over the layers

`with_attention(eff, impl, head_dim, window, seq_len)` returns the efficiency table with the attention kinds taken
from `impl`'s and their rates scaled by both (the traced causal FLOPs at the scaled rate take the windowed kernels'
time); tools/step_time/published.py applies each published run's own. Not priced: the learned sink logits of
GPT-OSS's softmax (one more term per row of the softmax; no public measurement of what they cost a fused kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ATTENTION_IMPLS = {"cudnn": "attention", "fa2": "attention_fa2", "flex": "attention_fa2"}
_FIELDS = ("", ".bw", ".launch_us", ".p")
# rate at head dim 64 over the rate at 128, (forward, backward), by attention kind: FlashAttention-3 paper (arXiv
# 2407.08608) Figures 5 (forward, causal) and 6 (backward), H100 SXM5, BF16, 4K: cuDNN 363/518 and 417/499,
# FlashAttention-2 284/319 and 279/310 (FlexAttention, priced as FlashAttention-2, takes its ratios)
HEAD_DIM_64 = {"attention": (363 / 518, 417 / 499), "attention_fa2": (284 / 319, 279 / 310)}
TILE = 128  # keys per tile of the fused kernels' block masks (FlexAttention's default BLOCK_SIZE, cuDNN's on Hopper)


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding window of `tokens` keys (the query itself included) on every `every`-th layer, full causal
    attention on the others (GPT-OSS: 128 and 2)."""

    tokens: int
    every: int = 1

    def work(self, seq_len: int, tile: int = TILE) -> float:
        """The kernels' work over a full causal kernel's, averaged over the layers: a query tile visits
        min(its causal tiles, the tiles its window spans) key tiles instead of all causal ones."""
        tiles = max(1, math.ceil(seq_len / tile))
        span = math.ceil((self.tokens - 1) / tile) + 1  # the diagonal tile and the ones the window reaches back to
        windowed = sum(min(t + 1, span) for t in range(tiles)) / sum(t + 1 for t in range(tiles))
        return (windowed + (self.every - 1)) / self.every


def with_attention(eff: dict[str, float], impl: str, head_dim: int = 128, window: SlidingWindow | None = None,
                   seq_len: int = 0) -> dict[str, float]:
    """`eff` with `attention_fwd` / `attention_bwd` (and their .bw, .launch_us, .p) taken from `impl`'s kinds, their
    rates scaled by the head dim's ratio (HEAD_DIM_64 at 64 or fewer) and over the window's work (module docstring)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation {impl!r}: one of {', '.join(ATTENTION_IMPLS)}")
    kind = ATTENTION_IMPLS[impl]
    slower = HEAD_DIM_64[kind] if head_dim <= 64 else (1.0, 1.0)
    work = window.work(seq_len) if window else 1.0
    out = dict(eff)
    for i, phase in enumerate(("fwd", "bwd")):
        for f in _FIELDS:
            out[f"attention_{phase}{f}"] = eff[f"{kind}_{phase}{f}"]
        out[f"attention_{phase}"] = eff[f"{kind}_{phase}"] * slower[i] / work
    return out
