"""Grouped-query self-attention over the attention-backend interface.

Legend: B batch, S sequence (local: the full sequence on one device, a zig-zag shard under CP),
H query heads, K key/value heads (H % K == 0), Dh head dim, D model dim. Under TP the heads of this
module are the local ones (set by `moe_lc.parallel.tp.mappings`), and the core is swapped for ring
attention under CP (`moe_lc.parallel.cp.ring`); this file stays single-device code. Seams (see
moe_lc/model/seams.py): `core`, `replay` around RoPE + core (selective recomputation keeps q|k|v), and
`out_proj` around the whole attention and wo (FP8 activation caching keeps the output once, in FP8).
Optional: q/k normalization before RoPE (`model.qk_norm`, moe_lc/model/qk_norm.py), RoPE on the first
rot_dim dims of a head only (`model.rope.partial_rotary_factor`: the cos/sin tables are that narrow),
biases on q|k|v (`model.qkv_bias`) and on wo (`model.attn_out_bias`).

The "gqa" attention kind (moe_lc/config/attention_kinds.py): besides the module, this file holds its
counts from the config (`gqa_params`, ...) and its decode cache (`GQADecode`, for moe_lc/model/decode.py).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.qk_norm import qk_norms
from moe_lc.model.rope import apply_rope
from moe_lc.model.seams import project_now, run_now
from moe_lc.ops.attention import attention_with_lse, get_backend, note_max_lse
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
        out, lse = attention_with_lse(q, k, v, causal=True, scale=scale, backend=self._backend, pieces=pieces)
        note_max_lse(self, lse)
        return out

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
        self.run_region = run_now
        self.out_proj = project_now

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Documents | None = None, stats=None) -> torch.Tensor:
        """docs: the micro-batch's packed documents when attention stays inside each (else None); stats: the
        step's ForwardStats (a kind with a loss of its own books there; GQA has none)."""
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
        # v's own copy (K*Dh per token): as a view it would keep the whole q|k|v projection alive for
        # backward beside the roped copies of q and k the core saves (H*Dh + 2*K*Dh per token more). A q/k
        # norm saves its input, a view of the projection, so there the projection stays and a copy would add.
        v = v.contiguous() if self.qk_norm == "none" else v
        return self.run_region(apply_rope, q, cos, sin), self.run_region(apply_rope, k, cos, sin), v


def gqa_qk_clip_rows(attn: Attention, gamma_H: torch.Tensor) -> dict:
    """QK-clip (Kimi K2, arXiv:2507.20534, section 2.1: MuonClip) on this module: {parameter: factor per
    row} from gamma_H (H,) = min(1, tau / max logit) of each local query head. Multi-head (H = K):
    head h's q and k rows take sqrt(gamma_h) each (K2's alpha = 0.5); grouped (K < H, or kv heads
    replicated under TP): a key head serves several query heads, so only q rows take gamma_h. Either way
    every logit of head h is gamma_h times what it was. A bias takes its rows' factors."""
    H, K, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    shared = K < H
    q = gamma_H if shared else gamma_H.sqrt()
    k = torch.ones(K, device=gamma_H.device) if shared else gamma_H.sqrt()
    rows = torch.cat([q.repeat_interleave(Dh), k.repeat_interleave(Dh), torch.ones(K * Dh, device=gamma_H.device)])
    out = {attn.wqkv.weight: rows}
    if attn.wqkv.bias is not None:
        out[attn.wqkv.bias] = rows
    return out


# --------------------------------------------------------------------------- counts from the config alone


def gqa_vector_params(cfg: ModelConfig) -> int:
    """Parameters no matmul reads: the q/k norm weights (model.qk_norm) and biases (qkv_bias, attn_out_bias)."""
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
    norms = {"none": 0, "head": 2 * Dh, "full": (H + K) * Dh}[cfg.qk_norm]
    return norms + (H + 2 * K) * Dh * cfg.qkv_bias + cfg.dim * cfg.attn_out_bias


def gqa_params(cfg: ModelConfig) -> int:
    """Parameters of one module: fused qkv, output, and `gqa_vector_params`."""
    D, H, Dh = cfg.dim, cfg.n_heads, cfg.head_size
    return D * (H + 2 * cfg.n_kv_heads) * Dh + H * Dh * D + gqa_vector_params(cfg)


def gqa_saved_bytes(cfg: ModelConfig, c: int, cp: int = 1) -> int:
    """Bytes per token its backward surely keeps besides wo's input (moe_lc/model/memory_floor.py): q|k|v
    in the compute dtype (c bytes), or under ring attention (cp > 1) v's contiguous copy."""
    return c * (cfg.n_kv_heads if cp > 1 else cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_size


# --------------------------------------------------------------------------- decode cache


def new_queries_mask(n: int, T: int, device) -> torch.Tensor:
    """(n, T) bool: new query i (position T - n + i) sees cached keys 0 .. T - n + i."""
    return torch.arange(T, device=device)[None, :] <= torch.arange(T - n, T, device=device)[:, None]


def cached_gqa_attention(q_BnHD, k_BTJD, v_BTJD, scale: float) -> torch.Tensor:
    """softmax(scale q k^T, causal for the last n of T positions) v in fp32 -> (B, n, H, Dh); J kv heads."""
    J, n, T = k_BTJD.shape[2], q_BnHD.shape[1], k_BTJD.shape[1]
    q = rearrange(q_BnHD.float(), "b n (j g) d -> b j g n d", j=J)
    scores = torch.einsum("bjgnd,btjd->bjgnt", q, k_BTJD.float()) * scale
    p = scores.masked_fill(~new_queries_mask(n, T, q.device), float("-inf")).softmax(-1)
    out = torch.einsum("bjgnt,btjd->bjgnd", p, v_BTJD.float())
    return rearrange(out, "b j g n d -> b n (j g) d").to(q_BnHD.dtype)


class GQADecode:
    """GQA's cache (moe_lc/model/decode.py): k, v (B, T, J, Dh), the roped keys and the values as the core
    saw them; n new tokens' q, k, v come from the module's own `wqkv` and `heads`."""

    @staticmethod
    def shapes(attn: Attention) -> dict[str, tuple[int, ...]]:
        return {"k": (attn.n_kv_heads, attn.head_dim), "v": (attn.n_kv_heads, attn.head_dim)}

    @staticmethod
    def prefill(attn: Attention, x_BSD, cos, sin):
        """The prompt through the module's core seam (the ring under CP) -> (out (B, S, D), {"k", "v"})."""
        q, k, v = attn.heads(attn.wqkv(x_BSD), cos, sin)
        return attn.out_proj(attn.wo, lambda: attn.core(q, k, v, attn.softmax_scale)), {"k": k, "v": v}

    @staticmethod
    def step(attn: Attention, x_BnD, cos, sin, cache, start: int) -> torch.Tensor:
        """n new tokens at positions start .. start+n-1 against the cache, which they are written into."""
        q, k, v = attn.heads(attn.wqkv(x_BnD), cos, sin)
        cache.write(start, k=k, v=v)
        held = cache.read(start + x_BnD.shape[1])
        return attn.out_proj(attn.wo, lambda: cached_gqa_attention(q, held["k"], held["v"], attn.softmax_scale))
