"""MLA under context parallelism passes the latent: the zig-zag ring (cp/ring.py) moves each rank's
normalized KV latent c_kv and its roped shared key k_r, and every rank up-projects a visiting block
with its own W_UKV (`wkv_b`, heads split under TP) right before attending to it. It is the "mla"
attention kind's `ring` (moe_lc/config/attention_kinds.py; parallel.mla_ring = "expanded" takes
cp/ring.py's K/V ring instead).

Legend: B batch, S this rank's zig-zag shard (2 chunks), H local heads, Ckv the KV latent rank,
Dn / Dr / Dv the nope, rope and value head dims. Per token the ring moves Ckv + Dr values instead of
H (Dn + Dr) + H Dv: DeepSeek-V3 (H = 128, Ckv = 512, Dn = Dr + 64 = 128, Dv = 128) 576 instead of
40,960, 71x less; under TP the expanded K/V is per rank (H/tp heads), the latent is not.

    forward, per ring step:  k_nope | v = c_blk W_UKV^T   (B, s, H, Dn), (B, s, H, Dv)
                             k = [k_nope, k_r for every head]; attention and merge as for GQA
    backward, per ring step: dk, dv from the attention backward ->
                             d c_blk = [dk_nope | dv] W_UKV,  d k_r = sum over heads of dk's rope part
                             (both travel home in the block's fp32 accumulators),
                             dW_UKV += [dk_nope | dv]^T c_blk (stays here, fp32, delivered once)

Cost: the up-projection runs once per visiting block in forward and again in backward (2 GEMMs):
per ring step and token of the block, 2 Ckv H (Dn + Dv) FLOPs forward and 3x that in backward (the
forward's again, then dgrad and wgrad), against (cp - 1) / cp of the hops saving the bytes above.
The weight gradient of W_UKV is computed in B (never deferred to a zero-bubble W): deferring it would
hold every visiting block's gradient until W. Its GEMMs are the Linear's own (FP8 under the fp8 recipe).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from moe_lc.model.mla import MLAttention
from moe_lc.model.rope import apply_rope
from moe_lc.model.saved_tensors import recompute_from
from moe_lc.ops.attention import get_backend, note_max_lse
from moe_lc.parallel.comm import Group
from moe_lc.parallel.cp.ring import P2PRing, RingAttentionFunction


class LatentBlocks:
    """Ring codec for MLA: blocks (c (B,S,Ckv), k_r (B,S,Dr)); weights (W_UKV (H*(Dn+Dv), Ckv),)."""

    n_blocks = 2

    def __init__(self, gemms, n_heads: int, nope_dim: int, v_dim: int):
        self.gemms, self.n_heads, self.nope_dim, self.v_dim = gemms, n_heads, nope_dim, v_dim

    def expand(self, blocks, weights, cols):
        """-> k (B, s, H, Dn+Dr), v (B, s, H, Dv) of the block's key columns `cols`."""
        c, k_r = blocks[0][:, cols], blocks[1][:, cols]
        B, s, C = c.shape
        kv = self.gemms.fprop(c.reshape(-1, C), weights[0].to(c.dtype)).view(B, s, self.n_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_r.unsqueeze(2).expand(B, s, self.n_heads, k_r.shape[-1])], dim=-1)
        return k, v

    ROWS = 1024  # block rows whose [dk_nope | dv] is formed (and FP8-quantized) at once: a multiple of 128,
    # so FP8 tiles along the tokens stay whole; it bounds the fp32 quantization temporaries (at 128K on cp32
    # a whole block's would be 3 x 512 MiB)

    def grads(self, dk, dv, blocks, weights, cols):
        """-> ((d c (B,s,Ckv), d k_r (B,s,Dr) fp32), (d W_UKV fp32,)) for the block's key columns."""
        c = blocks[0][:, cols]
        B, s, C = c.shape
        c2, w = c.reshape(B * s, C), weights[0].to(c.dtype)
        dk2, dv2 = dk.reshape(B * s, self.n_heads, -1), dv.reshape(B * s, self.n_heads, -1)
        dc, dw = torch.empty_like(c2), None
        for lo in range(0, B * s, self.ROWS):
            rows = slice(lo, lo + self.ROWS)
            dkv = torch.cat([dk2[rows, :, :self.nope_dim], dv2[rows]], dim=-1).flatten(1).to(c.dtype)
            dc[rows] = self.gemms.dgrad(dkv, w)
            part = self.gemms.wgrad(dkv, c2[rows]).float()
            dw = part if dw is None else dw.add_(part)
        return (dc.view(B, s, C), dk[..., self.nope_dim:].float().sum(2)), (dw,)


class LatentRingAttention(nn.Module):
    """The MLA core under cp > 1: (q (B,S,H,Dn+Dr), c (B,S,Ckv), k_r (B,S,Dr), scale, wkv_b) ->
    (B,S,H,Dv), S the zig-zag shard of this cp rank; same backend choice as the core it replaces."""

    def __init__(self, group: Group, backend: str = "auto"):
        super().__init__()
        self.group, self.backend_name = group, backend
        self._backend = None

    def forward(self, q: Tensor, c: Tensor, k_r: Tensor, scale: float, mla: MLAttention, docs=None) -> Tensor:
        if self._backend is None:
            self._backend = get_backend(self.backend_name, q.device)
        codec = LatentBlocks(mla.wkv_b.gemms, mla.n_heads, mla.nope_dim, mla.v_dim)
        out, lse = RingAttentionFunction.apply(q, float(scale), P2PRing(self.group), self._backend, "zigzag", codec,
                                               docs, c, k_r, mla.wkv_b.weight)
        note_max_lse(self, lse)
        return out

    def extra_repr(self) -> str:
        return f"backend={self.backend_name}, cp={self.group.size}, latent"


def _queries_and_latents(mla: MLAttention, q_src, c_kv, k_r, cos, sin):
    """-> roped q (B,S,H,Dn+Dr), normalized latent c (B,S,Ckv), roped shared key k_r (B,S,Dr)."""
    B, S, _ = c_kv.shape
    k_r = mla.run_region(apply_rope, k_r.view(B, S, 1, mla.rope_dim), cos, sin).view(B, S, mla.rope_dim)
    return mla.rope_q(mla.up_project_q(q_src), cos, sin), mla.kv_norm(c_kv), k_r


def _ring(q, c, k_r, mla: MLAttention, docs=None):
    return mla.core(q, c, k_r, mla.softmax_scale, mla, docs)


def latent_attend(mla: MLAttention, q_src, c_kv, k_r, cos, sin, docs=None) -> Tensor:
    """The MLA `attend` seam under context parallelism: the queries' up-projection and RoPE here, the
    keys' and values' inside the ring, per visiting block -> (B, S, H, Dv). The `replay` seam wraps
    the ring (selective "attention": the ring runs again in backward, as GQA's does)."""
    q, c, k_r = _queries_and_latents(mla, q_src, c_kv, k_r, cos, sin)
    return mla.replay(_ring, q, c, k_r, mla, docs)


def latent_attend_mla_up(mla: MLAttention, q_src, c_kv, k_r, cos, sin, docs=None) -> Tensor:
    """`latent_attend` under selective "mla_up": the query up-projection, the latent norm and RoPE are
    recomputed in backward from the latents (c_q or q, c_kv, k_r), which alone stay; the ring's own
    saved q, c and k_r are rebuilt from them when its backward needs them."""
    if not torch.is_grad_enabled():
        return latent_attend(mla, q_src, c_kv, k_r, cos, sin, docs)
    prepare = partial(_queries_and_latents, mla, cos=cos, sin=sin)
    q, c, kr = checkpoint(prepare, q_src, c_kv, k_r, use_reentrant=False)
    return recompute_from((q_src, c_kv, k_r), (q, c, kr), prepare, _ring, mla, docs)
