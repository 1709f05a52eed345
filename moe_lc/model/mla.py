"""Multi-head latent attention (MLA, DeepSeek-V2/V3), trained in its decompressed form.

Legend: B batch, S sequence, D model dim, H heads, Cq / Ckv the query / key-value latent ranks,
Dn the per-head "nope" dim (no RoPE), Dr the decoupled RoPE dim (one rotated key shared by all
heads), Dv the value head dim. Query/key head dim = Dn + Dr differs from Dv: every attention
backend and the ring handle that.

    a      = x @ wa^T                          (B, S_x, Cq + Ckv + Dr)   per token: runs on SP shards
    a      = gather(a)                         (B, S, ...)               identity on one device
    q      = wq_b(q_norm(c_q))                 (B, S, H, Dn + Dr), RoPE on the last Dr dims
    k_nope, v = split(wkv_b(kv_norm(c_kv)))    (B, S, H, Dn), (B, S, H, Dv)
    k      = [k_nope, rope(k_r) for every head](B, S, H, Dn + Dr)
    out    = wo(attention(q, k, v))            (B, S_x, D)

Seams (moe_lc/model/seams.py): `core`; `replay` around the queries' RoPE, the key assembly and the
core (selective recomputation of "attention" keeps q, [k_nope | v] and the roped k_r, like GQA's q|k|v);
`attend` (module, c_q or q, c_kv, k_r, cos, sin) -> attention output, the whole path from the latents
("mla_up" recomputes the up-projections from the latents in backward, DeepSeek-V3 3.2.2); `out_proj`
(wo, attend) -> wo(attention output), as GQA's.

With q_lora_rank = 0 the query comes straight from x through `wq` (DeepSeek-V2-Lite). The softmax
scale is (Dn + Dr)^-0.5 times m(s, rope.mscale_all_dim)^2 under YaRN, as DeepSeek-V3 applies it. Under tensor
parallelism `wq_b`, `wkv_b` are column-parallel (heads split), `wo` row-parallel, the latent
projections replicated, and `gather` becomes the sequence all-gather of the latents (smaller than x).

The "mla" attention kind (moe_lc/config/attention_kinds.py): besides the module, this file holds its
counts from the config (`mla_params`, ...) and its latent decode cache (`MLADecode`, for
moe_lc/model/decode.py). Its ring under context parallelism is moe_lc/parallel/cp/latent_ring.py.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.model.attention import LocalAttention, new_queries_mask
from moe_lc.model.norm import RMSNorm
from moe_lc.model.rope import apply_rope, yarn_get_mscale
from moe_lc.model.seams import project_now, run_now
from moe_lc.ops.linear import Linear


class MLAttention(nn.Module):
    """x (B, S, D) -> (B, S, D); cos, sin: (S, Dr // 2) for the decoupled RoPE part."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q_lora_rank, self.kv_lora_rank = cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        latent = (self.q_lora_rank or 0) + self.kv_lora_rank + self.rope_dim
        self.wa = Linear(cfg.dim, latent)
        self.wq = None if self.q_lora_rank else Linear(cfg.dim, cfg.n_heads * qk_dim)
        self.q_norm = RMSNorm(self.q_lora_rank, cfg.norm_eps) if self.q_lora_rank else None
        self.wq_b = Linear(self.q_lora_rank, cfg.n_heads * qk_dim) if self.q_lora_rank else None
        self.kv_norm = RMSNorm(self.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = Linear(self.kv_lora_rank, cfg.n_heads * (self.nope_dim + self.v_dim))
        self.wo = Linear(cfg.n_heads * self.v_dim, cfg.dim)
        self.gather = nn.Identity()  # the sequence all-gather of the latents under TP + SP
        # DeepSeek's convention (its inference code and transformers' DeepseekV2/V3): with YaRN the softmax
        # scale also takes m(s, mscale_all_dim)^2, besides the cos/sin factor rope.py applies
        scaled = cfg.rope.scaling == "yarn" and cfg.rope.mscale_all_dim
        mscale = yarn_get_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) if scaled else 1.0
        self.softmax_scale = qk_dim ** -0.5 * mscale * mscale
        self.core = LocalAttention(cfg.attn_backend)
        self.replay = run_now
        self.run_region = run_now
        self.attend = attend
        self.out_proj = project_now

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs=None, stats=None) -> torch.Tensor:
        """docs: the micro-batch's packed documents (moe_lc/ops/documents.py) when attention stays inside
        each, else None; stats: the step's ForwardStats (unused: MLA has no loss of its own)."""
        q_src, c_kv, k_r = self.latents(x_BSD)
        return self.out_proj(self.wo, lambda: self.attend(self, q_src, c_kv, k_r, cos, sin, docs))

    def latents(self, x_BSD: torch.Tensor):
        """x -> (c_q, or q itself without q_lora; c_kv (B, S, Ckv); k_r (B, S, Dr), not yet roped)."""
        a = self.gather(self.wa(x_BSD))
        if self.q_lora_rank:
            return a.split([self.q_lora_rank, self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv, k_r = a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.wq(x_BSD), c_kv, k_r

    def up_project_q(self, q_src):
        """The query up-projection: q (B, S, H*(Dn+Dr)) from c_q (or q itself without q_lora)."""
        return self.wq_b(self.q_norm(q_src)) if self.q_lora_rank else q_src

    def up_project(self, q_src, c_kv):
        """The up-projections: q (B, S, H*(Dn+Dr)) as `up_project_q`, kv (B, S, H*(Dn+Dv))."""
        return self.up_project_q(q_src), self.wkv_b(self.kv_norm(c_kv))

    def rope_q(self, q, cos, sin):
        """q (B, S, H*(Dn+Dr)) -> (B, S, H, Dn+Dr) with RoPE on each head's last Dr dims (h: local heads)."""
        q_nope, q_r = rearrange(q, "b s (h d) -> b s h d", h=self.n_heads).split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat([q_nope, self.run_region(apply_rope, q_r, cos, sin)], dim=-1)

    def rope_qkv(self, q, kv, k_r, cos, sin):
        """q, kv as up_project returns them, roped k_r (B, S, 1, Dr) -> the core's q, k (B, S, H, Dn+Dr), v."""
        k_nope, v = rearrange(kv, "b s (h d) -> b s h d", h=self.n_heads).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_r.expand(*k_nope.shape[:3], self.rope_dim)], dim=-1)
        return self.rope_q(q, cos, sin), k, v

    def _rope_and_core(self, q, kv, k_r, cos, sin, docs=None) -> torch.Tensor:
        """-> (B, S, H, Dv)."""
        return self.core(*self.rope_qkv(q, kv, k_r, cos, sin), self.softmax_scale, docs)


def attend(mla: MLAttention, q_src, c_kv, k_r, cos, sin, docs=None) -> torch.Tensor:
    """The default `attend` seam: up-projections, the shared key's RoPE, then (through `replay`) the
    queries' RoPE and the core -> (B, S, H, Dv)."""
    B, S, _ = c_kv.shape
    q, kv = mla.up_project(q_src, c_kv)
    k_r = mla.run_region(apply_rope, k_r.view(B, S, 1, mla.rope_dim), cos, sin)  # one rotated key for every head
    return mla.replay(mla._rope_and_core, q, kv, k_r, cos, sin, docs)


def mla_qk_clip_rows(attn: MLAttention, gamma_H: torch.Tensor) -> dict:
    """QK-clip (Kimi K2, arXiv:2507.20534, section 2.1) on MLA: {parameter: factor per row} from gamma_H (H,)
    = min(1, tau / max logit) of each local head. K2's rule for MLA: the head-specific parts q_nope and
    k_nope take sqrt(gamma_h) each, q_rope takes gamma_h, and the rope key every head shares (wa's k_r rows)
    is left alone; so every logit of head h is gamma_h times what it was. Rows: wq_b's (or wq's) per head
    [nope Dn, rope Dr], wkv_b's per head [k_nope Dn, v Dv] (v untouched)."""
    root, ones = gamma_H.sqrt(), torch.ones_like(gamma_H)
    q = torch.cat([root[:, None].expand(-1, attn.nope_dim), gamma_H[:, None].expand(-1, attn.rope_dim)], 1)
    kv = torch.cat([root[:, None].expand(-1, attn.nope_dim), ones[:, None].expand(-1, attn.v_dim)], 1)
    w_q = attn.wq_b if attn.q_lora_rank else attn.wq
    return {w_q.weight: q.reshape(-1), attn.wkv_b.weight: kv.reshape(-1)}


# --------------------------------------------------------------------------- counts from the config alone


def mla_vector_params(cfg: ModelConfig) -> int:
    """Parameters no matmul reads: the latent norm weights."""
    return cfg.mla.q_lora_rank + cfg.mla.kv_lora_rank


def mla_params(cfg: ModelConfig) -> int:
    """Parameters of one module: latent (down) projection, norms, up and output projections."""
    D, H, a = cfg.dim, cfg.n_heads, cfg.mla
    qk, q_rank, kv_rank = cfg.qk_head_dim, a.q_lora_rank, a.kv_lora_rank
    down = D * (q_rank + kv_rank + a.qk_rope_head_dim)
    q_up = q_rank * H * qk + q_rank if q_rank else D * H * qk  # (+ q_norm weight)
    kv_up = kv_rank * H * (a.qk_nope_head_dim + a.v_head_dim) + kv_rank  # (+ kv_norm weight)
    return down + q_up + kv_up + H * a.v_head_dim * D


def mla_saved_bytes(cfg: ModelConfig, c: int, cp: int = 1) -> int:
    """Bytes per token its backward surely keeps besides wo's input (moe_lc/model/memory_floor.py): none
    counted, since "mla_up" keeps only the latents, and a floor stays under every policy."""
    return 0


# --------------------------------------------------------------------------- decode cache


class MLADecode:
    """MLA's latent cache (moe_lc/model/decode.py): c (B, T, C) = kv_norm(c_kv), the normalized latent, and
    k_r (B, T, Dr), the shared key's RoPE part, roped: C + Dr values per token (DeepSeek-V3: 576) instead
    of H (Dn + Dr + Dv) (40,960). A step decodes in the "absorbed" form of DeepSeek-V3's own inference
    code (github.com/deepseek-ai/DeepSeek-V3, inference/model.py, attn_impl = "absorb"): with wkv_b =
    [W_UK; W_UV] per head, q_nope . (W_UK c) = (W_UK^T q_nope) . c and sum_t p_t W_UV c_t = W_UV (sum_t
    p_t c_t), so it attends over the latents directly and never up-projects the cache (one (C x Dn) and
    one (Dv x C) product per head and new token). Legend: C kv_lora_rank, E = Dn + Dr."""

    @staticmethod
    def shapes(attn: MLAttention) -> dict[str, tuple[int, ...]]:
        return {"c": (attn.kv_lora_rank,), "k_r": (attn.rope_dim,)}

    @staticmethod
    def cached(attn: MLAttention, c_kv, k_r, cos, sin):
        """What it caches of n tokens: kv_norm(c_kv) (B, n, C) and the roped shared key (B, n, Dr)."""
        B, n, _ = k_r.shape
        return attn.kv_norm(c_kv), attn.run_region(apply_rope, k_r.view(B, n, 1, attn.rope_dim), cos, sin)[:, :, 0]

    @staticmethod
    def prefill(attn: MLAttention, x_BSD, cos, sin):
        """The prompt through the module's `attend` seam (the latent ring under CP) -> (out, {"c", "k_r"})."""
        q_src, c_kv, k_r = attn.latents(x_BSD)
        c, k_r_roped = MLADecode.cached(attn, c_kv, k_r, cos, sin)
        out = attn.out_proj(attn.wo, lambda: attn.attend(attn, q_src, c_kv, k_r, cos, sin))
        return out, {"c": c, "k_r": k_r_roped}

    @staticmethod
    def step(attn: MLAttention, x_BnD, cos, sin, cache, start: int) -> torch.Tensor:
        """n new tokens at positions start .. start+n-1 against the cache, which they are written into."""
        q_src, c_kv, k_r = attn.latents(x_BnD)
        c, k_r_roped = MLADecode.cached(attn, c_kv, k_r, cos, sin)
        cache.write(start, c=c, k_r=k_r_roped)
        held = cache.read(start + x_BnD.shape[1])
        q = attn.rope_q(attn.up_project_q(q_src), cos, sin)
        return attn.out_proj(attn.wo, lambda: cached_mla_attention(attn, q, held["c"], held["k_r"]))


def cached_mla_attention(attn: MLAttention, q_BnHE, c_BTC, kr_BTR) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache -> (B, n, H, Dv); q roped (`MLADecode`)."""
    H, n, T = attn.n_heads, q_BnHE.shape[1], c_BTC.shape[1]
    w = attn.wkv_b.weight.float().view(H, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)
    w_uk, w_uv = w.split([attn.nope_dim, attn.v_dim], dim=1)  # (H, Dn, C), (H, Dv, C)
    q_nope, q_r = q_BnHE.float().split([attn.nope_dim, attn.rope_dim], dim=-1)
    q_latent = torch.einsum("bnhd,hdc->bnhc", q_nope, w_uk)
    scores = (torch.einsum("bnhc,btc->bhnt", q_latent, c_BTC.float())
              + torch.einsum("bnhr,btr->bhnt", q_r, kr_BTR.float())) * attn.softmax_scale
    p = scores.masked_fill(~new_queries_mask(n, T, q_latent.device), float("-inf")).softmax(-1)
    out_latent = torch.einsum("bhnt,btc->bnhc", p, c_BTC.float())
    return torch.einsum("bnhc,hvc->bnhv", out_latent, w_uv).to(q_BnHE.dtype)
