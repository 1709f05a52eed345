"""Which attention kernels a run's stack launches, as the kernel-rate table's attention kinds (clusters.py).

    cudnn   (the default) the fastest kernel the H100 bench measured per shape: cuDNN's fused attention, what
            Transformer Engine (Megatron, NeMo AutoModel's "te" attention), torch's SDPA cuDNN backend and this
            repo's "auto" run: the `attention_fwd` / `attention_bwd` kinds
    fa2     FlashAttention-2 (torch's own flash kernel, SDPA's flash backend, the flash-attn 2 package): the
            `attention_fa2_fwd` / `_bwd` kinds, fitted to the same bench's raw:aten_flash rows
    flex    torch's FlexAttention (torch.nn.attention.flex_attention; NeMo AutoModel's `attn: flex`, which its
            GPT-OSS configs use for the sinks and the sliding window): Triton kernels at FlashAttention-2's level,
            not the Hopper-specific cuDNN / FA3 ones (PyTorch's FlexAttention announcement, pytorch.org/blog/
            flexattention, measures it against FlashAttention-2, a little below it): priced as `fa2`

`with_attention(eff, impl)` returns the efficiency table with the attention kinds replaced; tools/step_time/
published.py applies each published run's own.
"""

from __future__ import annotations

ATTENTION_IMPLS = {"cudnn": "attention", "fa2": "attention_fa2", "flex": "attention_fa2"}
_FIELDS = ("", ".bw", ".launch_us", ".p")


def with_attention(eff: dict[str, float], impl: str) -> dict[str, float]:
    """`eff` with `attention_fwd` / `attention_bwd` (and their .bw, .launch_us, .p) taken from `impl`'s kinds."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation {impl!r}: one of {', '.join(ATTENTION_IMPLS)}")
    kind = ATTENTION_IMPLS[impl]
    out = dict(eff)
    for phase in ("fwd", "bwd"):
        for f in _FIELDS:
            out[f"attention_{phase}{f}"] = eff[f"{kind}_{phase}{f}"]
    return out
