"""Benchmark part "dsa_attention": one MLA attention sublayer at DeepSeek-V3's dims, dense against DeepSeek
Sparse Attention (the sparse stage, k = 2048), forward + backward by length, on one GPU.

    python tools/bench/run.py --parts dsa_attention [--quick] [--dry-run --out DIR]

The sublayer is the attention module from x to wo's output (norm excluded) in training mode, batch 1, bf16:
  dense   MLAttention on the recipe's backend ("auto": cuDNN's fused attention where it runs), causal
  dsa     DSAttention in the sparse stage: the indexer's top-k over every earlier token, the absorbed sparse
          attention over the k selected latent rows, the indexer's KL loss and its backward
Dims: recipes/deepseek_v32_671b_128k.toml's (hidden 7168, 128 heads, latents 1536 / 512, head dims 128 + 64
rope, value 128; indexer 64 heads of 128, k = 2048). Entries: seq, impl ("dense" / "dsa"), topk, fwd_bwd_ms,
peak_gib; tools/bench/ratios.py reads dense / dsa at 32K and 128K (issue #64: >= 1.5 and >= 4). A length
whose dense or sparse step runs out of memory is an error entry, and the part goes on.

Then the sparse core alone at S = 4096 (every query row selecting k = 2048 of the rows at or before it):
impl "core_torch" (moe_lc/ops/sparse_attention.py's latent_forward + latent_backward, what DSAttention runs)
against "core_triton" (moe_lc/kernels/dsa_sparse_attention.py's, the same signatures); the Triton row runs on
CUDA, or on a CPU under TRITON_INTERPRET=1 (the tests' dry run).
"""

from __future__ import annotations

import os

import torch

from moe_lc.config import load_config
from moe_lc.config.attention_kinds import attention_kind, load
from moe_lc.model.rope import RotaryEmbedding
from .common import ROOT, Context, Recorder, Timing, free_memory, memory_mark, peak_bytes_since, time_fn

PART = "dsa_attention"
RECIPE = "recipes/deepseek_v32_671b_128k.toml"
SEQS = (32768, 131072)
TOPK = 2048
CORE_SEQ = 4096
DRY = ["model.dim=64", "model.n_heads=2", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
       "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=16",
       "model.dsa.index_n_heads=2", "model.dsa.index_head_dim=16", "model.attn_backend=torch"]

COLUMNS = [("seq", "S", "{:d}"), ("impl", "impl", None), ("topk", "k", "{:d}"), ("fwd_bwd_ms", "fwd+bwd ms", "{:.1f}"),
           ("peak_gib", "peak GiB", "{:.2f}")]


def model_cfg(ctx: Context, dsa: bool, topk: int):
    sets = (DRY if ctx.dry_run else []) + [f"model.dsa.enabled={str(dsa).lower()}", f"model.dsa.index_topk={topk}",
                                           "model.dsa.stage=sparse"]
    return load_config(ROOT / RECIPE, sets, check=False).model


def build(cfg, device: torch.device, dtype: torch.dtype):
    """The attention module of cfg's kind with fixed random weights (norm weights 1), on device in dtype."""
    torch.manual_seed(0)
    module = load(attention_kind(cfg).module)(cfg).train()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    return module.to(device=device, dtype=dtype)


def run(ctx: Context, rec: Recorder) -> None:
    """Length by length, dense then DSA (so a part cut short at 128K keeps the 32K pair)."""
    seqs = [256, 512] if ctx.dry_run else list(SEQS)
    topk = 64 if ctx.dry_run else TOPK
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    cfgs = {impl: model_cfg(ctx, sparse, topk) for impl, sparse in (("dense", False), ("dsa", True))}
    modules = {impl: build(cfg, ctx.device, dtype) for impl, cfg in cfgs.items()}
    rope = RotaryEmbedding.from_config(cfgs["dsa"].rope, cfgs["dsa"].mla.qk_rope_head_dim).to(ctx.device)
    for seq in seqs:
        for impl, module in modules.items():
            rec.measure({"seq": seq, "impl": impl, "topk": topk},
                        lambda: _measure(ctx, module, rope, cfgs[impl].dim, seq, dtype), _line)
            free_memory(ctx.device)
    core_seq, core_topk = (16, 8) if ctx.dry_run else (CORE_SEQ, topk)  # the interpreter is slow
    for impl, (fwd, bwd) in _cores(ctx).items():
        rec.measure({"seq": core_seq, "impl": impl, "topk": core_topk},
                    lambda: _measure_core(ctx, cfgs["dsa"], core_seq, core_topk, dtype, fwd, bwd), _line)
        free_memory(ctx.device)


def _cores(ctx: Context) -> dict:
    """impl -> (latent_forward, latent_backward)."""
    from moe_lc.ops import sparse_attention

    out = {"core_torch": (sparse_attention.latent_forward, sparse_attention.latent_backward)}
    if ctx.cuda or os.environ.get("TRITON_INTERPRET") == "1":
        from moe_lc.kernels import dsa_sparse_attention

        out["core_triton"] = (dsa_sparse_attention.latent_forward, dsa_sparse_attention.latent_backward)
    return out


def _measure_core(ctx: Context, cfg, seq: int, topk: int, dtype: torch.dtype, fwd, bwd) -> dict:
    """One block of seq query and key rows (batch 1), each query row selecting topk rows at or before it."""
    g = torch.Generator(device=ctx.device).manual_seed(seq)
    H, mla = cfg.n_heads, cfg.mla
    C, R, Dn, Dv = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=ctx.device) * std).to(dtype)

    q, kv, w_uk, w_uv = rand(1, seq, H, Dn + R), rand(1, seq, C + R), rand(H, Dn, C, std=C ** -0.5), \
        rand(H, Dv, C, std=C ** -0.5)
    pos = torch.arange(seq, device=ctx.device)
    future = pos[None, :] > pos[:, None]
    idx = torch.rand(seq, seq, generator=g, device=ctx.device).masked_fill_(future, -1.0).topk(topk).indices
    idx = torch.where(idx <= pos[:, None], idx, -1)[None]
    scale, dout = (Dn + R) ** -0.5, rand(1, seq, H, Dv)
    mark = memory_mark(ctx.device)

    def fwd_bwd():
        out, lse = fwd(q, kv, idx, w_uk, w_uv, scale)
        bwd(dout, q, kv, idx, out, lse, w_uk, w_uv, scale)

    t = time_fn(fwd_bwd, ctx.device, Timing(warmup=1, iters=3, min_iters=1 if ctx.dry_run else 2, max_s=10.0))
    peak = peak_bytes_since(ctx.device, mark)
    return {"fwd_bwd_ms": t["s"] * 1e3, "iters": t["n"], "peak_gib": peak / 2**30 if peak is not None else None}


def _measure(ctx: Context, module, rope, dim: int, seq: int, dtype: torch.dtype) -> dict:
    g = torch.Generator(device=ctx.device).manual_seed(seq)
    x = torch.randn(1, seq, dim, generator=g, device=ctx.device, dtype=dtype).requires_grad_()
    cos, sin = rope(torch.arange(seq, device=ctx.device))
    mark = memory_mark(ctx.device)

    def fwd_bwd():
        module(x, cos, sin).sum().backward()
        x.grad = None
        module.zero_grad(set_to_none=True)

    t = time_fn(fwd_bwd, ctx.device, Timing(warmup=1, iters=3, min_iters=1 if ctx.dry_run else 2, max_s=20.0))
    peak = peak_bytes_since(ctx.device, mark)
    return {"fwd_bwd_ms": t["s"] * 1e3, "iters": t["n"], "peak_gib": peak / 2**30 if peak is not None else None}


def _line(e: dict) -> str:
    return f"fwd+bwd {e['fwd_bwd_ms']:.1f} ms"
