"""Grouped-query self-attention over the attention-backend interface.

Legend: B batch, S sequence (local: the full sequence on one device, a zig-zag shard under CP),
H query heads, K key/value heads (H % K == 0), Dh head dim, D model dim. Under TP the heads of this
module are the local ones (set by `moe_lc.parallel.tensor`), and the core is swapped for ring
attention under CP (`moe_lc.parallel.context`); this file stays single-device code. Seams (see
moe_lc/model/seams.py): `core`, `replay` around RoPE + core (selective recomputation keeps q|k|v), and
`out_proj` around the whole attention and wo (FP8 activation caching keeps the output once, in FP8).
Optional: q/k normalization before RoPE (`model.qk_norm`, moe_lc/model/qk_norm.py), RoPE on the first
rot_dim dims of a head only (`model.rope.partial_rotary_factor`: the cos/sin tables are that narrow),
biases on q|k|v (`model.qkv_bias`) and on wo (`model.attn_out_bias`).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.qk_norm import qk_norms
from moe_lc.model.rope import apply_rope
from moe_lc.model.seams import project_now, run_now
from moe_lc.ops.attention import attention, get_backend
from moe_lc.ops.documents import Documents
from moe_lc.ops.linear import Linear


class LocalAttention(nn.Module):
    """Causal attention on one device: (q (B,S,H,Dqk), k, v (B,S,K,Dv)) -> (B,S,H,Dv); with `docs`
    (moe_lc/ops/documents.py) it stays inside each packed document."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend_name = backend
        self._backend = None

    def forward(self, q, k, v, scale: float, docs: Documents | None = None) -> torch.Tensor:
        if self._backend is None:  # resolved on first use: the device is known then
            self._backend = get_backend(self.backend_name, q.device)
        whole = ((0, q.shape[1]),)
        pieces = docs.plan_call(whole, [whole])[0] if docs is not None else None
        return attention(q, k, v, causal=True, scale=scale, backend=self._backend, pieces=pieces)

    def extra_repr(self) -> str:
        return f"backend={self.backend_name}"


class Attention(nn.Module):
    """x (B, S, D) -> (B, S, D).  wqkv: (H*Dh + 2*K*Dh, D) fused q|k|v projection; wo: (D, H*Dh);
    q_norm, k_norm: None, or RMSNorm weights (Dh,) ("head") / (H*Dh,), (K*Dh,) ("full")."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        self.wqkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * self.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=cfg.attn_out_bias)
        self.qk_norm = cfg.qk_norm
        self.q_norm, self.k_norm = qk_norms(cfg.qk_norm, cfg.n_heads, cfg.n_kv_heads, self.head_dim, cfg.norm_eps)
        self.softmax_scale = self.head_dim ** -0.5  # YaRN's temperature is in cos/sin (rope.py), as in transformers
        self.core = LocalAttention(cfg.attn_backend)
        self.replay = run_now
        self.out_proj = project_now

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Documents | None = None) -> torch.Tensor:
        """docs: the micro-batch's packed documents when attention stays inside each (else None)."""
        qkv = self.wqkv(x_BSD)  # under sequence parallelism S grows back to the full length here
        return self.out_proj(self.wo, lambda: self.replay(self._rope_and_core, qkv, cos, sin, docs))

    def _rope_and_core(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       docs: Documents | None = None) -> torch.Tensor:
        """qkv (B, S, (H + 2K) * Dh) -> attention output (B, S, H, Dh)."""
        return self.core(*self.heads(qkv, cos, sin), self.softmax_scale, docs)

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """qkv (B, S, (H + 2K) * Dh) -> q (B, S, H, Dh), k, v (B, S, K, Dh): q and k normalized (qk_norm)
        and roped, what the core sees (the KV cache of moe_lc/model/decode.py keeps these k, v)."""
        dq, dkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([dq, dkv, dkv], dim=-1)
        if self.qk_norm == "full":  # over the whole projection, before the split into heads (OLMoE)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (rearrange(t, "b s (h d) -> b s h d", d=self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":  # one (Dh,) weight for every head (Qwen3, GLM-4.5)
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
