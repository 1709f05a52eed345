"""DeepSeek-V4 (`model_type = "deepseek_v4"`) <-> ours: config.json and the weight table.

transformers' DeepseekV4ForCausalLM (src/transformers/models/deepseek_v4/) computes what our model.attention = "v4"
with model.residual = "mhc" computes: every layer MoE (sqrt(softplus) scores, a bias for selection, top-k
renormalized and scaled, no groups), its first `hash_moe` layers routed by tid2eid, the routed and shared SwiGLU
clamped at swiglu_limit, mHC everywhere, and the three attention layer types (moe_lc/model/v4_attention.py).

Names. DeepSeek's checkpoints keep their own names ("layers.0.attn.wq_a.weight", "hc_head_fn", "mtp.0.*") and
transformers renames them as it loads (its conversion_mapping.py, "deepseek_v4"); its save_pretrained writes them
back the same way under "model." (with embed_tokens, hc_head.hc_fn and head.weight at the top). The table is in
that written form; `hub_names` maps it to the Hub's (from-hf reads either, to-hf writes the written form, which
transformers loads). Shapes: o_a_proj is (G R, H d / G), ours wo_a (G, R, H d / G) (a view); the compressor's
kv | gate projections are the rows of our wkv_gate; experts one tensor each (w1 gate, w3 up, w2 down).
No row is permuted: V4's RoPE and ours both rotate adjacent pairs of the last rope dims.

The MTP layer. DeepSeek's checkpoints hold one ("mtp.0.*", num_nextn_predict_layers = 1), named as the modules of
DeepSeek's own inference code (inference/model.py of the deepseek-ai/DeepSeek-V4-Flash release: `Transformer.mtp`, a
list of `MTPBlock`, each a `Block` plus e_proj, h_proj, enorm, hnorm, norm and hc_head_fn / base / scale; the
embedding and head are the model's, so it has no copies of them). transformers does not build it (its
DeepseekV4PreTrainedModel ignores "mtp.*" on load), so the table keeps those names in both forms: from-hf reads them
into our `mtp.<d>` (model/mtp.py StreamMTPModule), to-hf writes them back and transformers skips them. The MTP
block's attention type (DeepSeek's compress_ratios[n_layers]) has no field in transformers' config: to-hf refuses
any but sliding_attention, V4-Flash's and from-hf's (model.v4_attention.mtp_layer_type).
"""

from __future__ import annotations

import re

from moe_lc.config import ModelConfig, MoEConfig
from moe_lc.config.model_sections import MHCConfig
from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.convert.hf_fields import ConvertError, refuse
from moe_lc.convert.hf_names import Piece, stacked_rows
from moe_lc.model.mtp import block_config

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale"}


def hub_names(table: list[Piece]) -> list[Piece]:
    """The table under the names of DeepSeek's own checkpoints (module docstring)."""
    def hub(name: str) -> str:
        return _TOP.get(name, re.sub(r"^model\.", "", name))
    return [Piece(p.ours, p.offset, hub(p.theirs), p.shape, p.cols, p.rope, p.expert, p.view) for p in table]


def v4_family(cfg: ModelConfig) -> str:
    """The "v4" kind's `hf_family`: deepseek_v4, or one ConvertError naming what transformers' V4 cannot compute."""
    m = cfg.moe
    for bad, why in ((cfg.residual != "mhc", f"model.residual={cfg.residual!r} (transformers' V4 always runs mHC)"),
                     (not cfg.has_moe or m.n_dense_layers, "dense layers (every V4 layer is MoE)"),
                     (m.n_groups > 1 and m.topk_groups < m.n_groups, f"model.moe.n_groups={m.n_groups} (no groups)"),
                     (not m.norm_topk_prob, "model.moe.norm_topk_prob = false (V4 renormalizes)"),
                     (m.shared_ffn_dim not in (0, m.ffn_dim) or m.n_shared_experts != 1 or m.shared_expert_gate,
                      "shared experts other than one ungated of moe.ffn_dim"),
                     (m.swiglu_limit <= 0, "model.moe.swiglu_limit = 0 (V4 always clamps)"),
                     (not cfg.v4_attention.attn_sink, "model.v4_attention.attn_sink = false"),
                     (cfg.tie_embeddings, "model.tie_embeddings"),
                     (cfg.mtp.depth and cfg.v4_attention.mtp_layer_type != "sliding_attention",
                      f"model.v4_attention.mtp_layer_type={cfg.v4_attention.mtp_layer_type!r} (no config field)")):
        if bad:
            raise ConvertError(f"to-hf: {why} has no deepseek_v4 form in transformers")
    return "deepseek_v4"


# ------------------------------------------------------------------------------------------- config.json


def _rope(hf: dict) -> dict:
    """yarn_* fields of [model.v4_attention] from the compress rope; the main rope must be unscaled."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    main, compress = (params.get("main"), params.get("compress")) if "compress" in params else ({}, params)
    if (main or {}).get("rope_type", "default") != "default":
        raise ConvertError(f"rope_parameters.main.rope_type={main['rope_type']!r}: V4's window-only layers are "
                           "unscaled")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default" or (kind == "yarn" and float(compress.get("factor", 1.0)) == 1.0):
        return dict(yarn_factor=1.0)
    if kind != "yarn":
        raise ConvertError(f"rope_parameters.compress.rope_type={kind!r}: only default RoPE and YaRN are supported")
    for key, ok in (("attention_factor", lambda v: v == 1.0), ("mscale", lambda v: not v),
                    ("mscale_all_dim", lambda v: not v), ("truncate", lambda v: v)):
        refuse(compress, key, ok)
    return dict(yarn_factor=float(compress["factor"]),
                yarn_original_seq_len=int(compress["original_max_position_embeddings"]),
                yarn_beta_fast=float(compress.get("beta_fast") or 32.0),
                yarn_beta_slow=float(compress.get("beta_slow") or 1.0))


def from_hf_v4(hf: dict) -> ModelConfig:
    """Our [model] for a deepseek_v4 config.json (transformers' DeepseekV4Config defaults where a field is absent)."""
    for key, ok in (("hidden_act", lambda v: v == "silu"), ("attention_bias", lambda v: not v),
                    ("mlp_bias", lambda v: not v), ("num_key_value_heads", lambda v: v == 1),
                    ("norm_topk_prob", lambda v: v), ("tie_word_embeddings", lambda v: not v)):
        refuse(hf, key, ok)
    n, head_dim = hf["num_hidden_layers"], hf.get("head_dim", 512)
    types = list(hf.get("layer_types") or [])
    mlp = list(hf.get("mlp_layer_types") or [])
    n_hash = mlp.count("hash_moe")
    if mlp != ["hash_moe"] * n_hash + ["moe"] * (len(mlp) - n_hash) or len(mlp) != n or len(types) != n:
        raise ConvertError(f"layer_types / mlp_layer_types={mlp!r}: both must list all {n} layers, the hash_moe "
                           "layers first")
    rates = dict(hf.get("compress_rates") or {CSA: 4, HCA: 128})
    partial = hf.get("partial_rotary_factor") or 64 / 512
    eps = float(hf.get("rms_norm_eps", 1e-6))
    attn = V4AttentionConfig(
        head_dim=head_dim, q_lora_rank=hf.get("q_lora_rank", 1024), rope_head_dim=int(head_dim * partial),
        o_groups=hf.get("o_groups", 8), o_lora_rank=hf.get("o_lora_rank", 1024),
        sliding_window=hf.get("sliding_window", 128), csa_compress_rate=rates[CSA], hca_compress_rate=rates[HCA],
        index_n_heads=hf.get("index_n_heads", 64), index_head_dim=hf.get("index_head_dim", 128),
        index_topk=hf.get("index_topk", 512), rope_theta=float(hf.get("rope_theta", 10000.0)),
        compress_rope_theta=float(hf.get("compress_rope_theta", 160000.0)), eps=eps, layer_types=types, **_rope(hf))
    F = hf.get("moe_intermediate_size", 2048)
    moe = MoEConfig(n_dense_layers=0, n_routed_experts=hf.get("n_routed_experts", 256),
                    n_shared_experts=hf.get("n_shared_experts", 1), ffn_dim=F, topk=hf.get("num_experts_per_tok", 6),
                    n_groups=1, topk_groups=1, score_func=hf.get("scoring_func", "sqrtsoftplus"),
                    norm_topk_prob=True, routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
                    bias_update_speed=1e-3, aux_loss_weight=0.0, swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
                    hash_layers=n_hash)
    mhc = MHCConfig(hc_mult=hf.get("hc_mult", 4), sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
                    eps=float(hf.get("hc_eps", 1e-6)))
    return ModelConfig(vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n,
                       n_heads=hf["num_attention_heads"], n_kv_heads=1, ffn_dim=F, norm_eps=eps,
                       init_std=float(hf.get("initializer_range", 0.02)), attention="v4", moe=moe, residual="mhc",
                       mhc=mhc, v4_attention=attn)


def to_hf_v4(cfg: ModelConfig, hf: dict) -> dict:
    """config.json fields of deepseek_v4 on top of the shared ones in `hf` (hf_config.to_hf_config)."""
    a, m = cfg.v4_attention, cfg.moe
    compress = {"rope_type": "default", "rope_theta": a.compress_rope_theta}
    if a.yarn_factor > 1:
        compress.update(rope_type="yarn", factor=a.yarn_factor,
                        original_max_position_embeddings=a.yarn_original_seq_len,
                        beta_fast=a.yarn_beta_fast, beta_slow=a.yarn_beta_slow, attention_factor=1.0)
    partial = a.rope_head_dim / a.head_dim
    hf = {k: v for k, v in hf.items() if k not in ("num_key_value_heads", "intermediate_size")}
    n_hash = min(m.hash_layers, cfg.n_layers)
    return {**hf, "num_key_value_heads": 1, "head_dim": a.head_dim, "q_lora_rank": a.q_lora_rank,
            "partial_rotary_factor": partial, "o_groups": a.o_groups, "o_lora_rank": a.o_lora_rank,
            "sliding_window": a.sliding_window, "compress_rates": {CSA: a.csa_compress_rate, HCA: a.hca_compress_rate},
            "index_n_heads": a.index_n_heads, "index_head_dim": a.index_head_dim, "index_topk": a.index_topk,
            "rope_theta": a.rope_theta, "compress_rope_theta": a.compress_rope_theta,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": a.rope_theta,
                                         "partial_rotary_factor": partial},
                                "compress": {**compress, "partial_rotary_factor": partial}},
            "layer_types": a.layer_types_for(cfg.n_layers),
            "mlp_layer_types": ["hash_moe"] * n_hash + ["moe"] * (cfg.n_layers - n_hash),
            "moe_intermediate_size": m.ffn_dim, "n_routed_experts": m.n_routed_experts,
            "n_shared_experts": m.n_shared_experts, "num_experts_per_tok": m.topk, "scoring_func": m.score_func,
            "norm_topk_prob": True, "routed_scaling_factor": m.routed_scaling_factor, "swiglu_limit": m.swiglu_limit,
            "hc_mult": cfg.mhc.hc_mult, "hc_sinkhorn_iters": cfg.mhc.sinkhorn_iters, "hc_eps": cfg.mhc.eps,
            "num_nextn_predict_layers": cfg.mtp.depth, "attention_bias": False, "mlp_bias": False}


# ------------------------------------------------------------------------------------------- the weight table


def v4_attention_pieces(cfg: ModelConfig, ours: str, theirs: str, interleaved: bool = False,
                        layer_id: int | None = None) -> list[Piece]:
    """One block's attention (the "v4" kind's `hf_pieces`; `ours` "layers.<i>.attn" names the block when
    layer_id is None)."""
    a, D, H = cfg.v4_attention, cfg.dim, cfg.n_heads
    layer_id = int(ours.split(".")[1]) if layer_id is None else layer_id
    kind = a.layer_types_for(cfg.n_layers)[layer_id]
    d, G, R = a.head_dim, a.o_groups, a.o_lora_rank
    out = stacked_rows(f"{ours}.wa.weight", [(f"{theirs}.wq_a.weight", (a.q_lora_rank, D)),
                                             (f"{theirs}.wkv.weight", (d, D))])
    out += [Piece(f"{ours}.q_norm.weight", (0,), f"{theirs}.q_norm.weight", (a.q_lora_rank,)),
            Piece(f"{ours}.wq_b.weight", (0, 0), f"{theirs}.wq_b.weight", (H * d, a.q_lora_rank)),
            Piece(f"{ours}.kv_norm.weight", (0,), f"{theirs}.norm.weight", (d,)),
            Piece(f"{ours}.wo_a.weight", (0, 0, 0), f"{theirs}.wo_a.weight", (G * R, H * d // G),
                  view=(G, R, H * d // G)),
            Piece(f"{ours}.wo.weight", (0, 0), f"{theirs}.wo_b.weight", (D, G * R)),
            Piece(f"{ours}.sinks", (0,), f"{theirs}.attn_sink", (H,))]
    m = a.compress_rate(kind)
    if m:
        out += _compressor(f"{ours}.compressor", f"{theirs}.compressor", D, d, m, kind == CSA)
    if kind == CSA:
        E, GI = a.index_head_dim, a.index_n_heads
        out += _compressor(f"{ours}.indexer.compressor", f"{theirs}.indexer.compressor", D, E, m, True)
        out += [Piece(f"{ours}.indexer.wq_b.weight", (0, 0), f"{theirs}.indexer.wq_b.weight", (GI * E, a.q_lora_rank)),
                Piece(f"{ours}.indexer.weights_proj.weight", (0, 0), f"{theirs}.indexer.weights_proj.weight", (GI, D))]
    return out


def _compressor(ours: str, theirs: str, D: int, d: int, m: int, overlap: bool) -> list[Piece]:
    width = (2 if overlap else 1) * d
    kv_gate = [(f"{theirs}.wkv.weight", (width, D)), (f"{theirs}.wgate.weight", (width, D))]
    return stacked_rows(f"{ours}.wkv_gate.weight", kv_gate) + [
        Piece(f"{ours}.position_bias", (0, 0), f"{theirs}.ape", (m, width)),
        Piece(f"{ours}.kv_norm.weight", (0,), f"{theirs}.norm.weight", (d,))]


def _hyper(ours: str, theirs: str, n: int, D: int, rows: int, scales: int) -> list[Piece]:
    """mHC's maps: fn (rows, n D), base (rows,), scale (scales,) -> ours fn.weight, bias, scale."""
    return [Piece(f"{ours}.fn.weight", (0, 0), f"{theirs}fn", (rows, n * D)),
            Piece(f"{ours}.bias", (0,), f"{theirs}base", (rows,)),
            Piece(f"{ours}.scale", (0,), f"{theirs}scale", (scales,))]


def _ffn(cfg: ModelConfig, ours: str, theirs: str, layer_id: int) -> list[Piece]:
    m, D = cfg.moe, cfg.dim
    E, F = m.n_routed_experts, m.ffn_dim
    out = [Piece(f"{ours}.router.gate.weight", (0, 0), f"{theirs}.gate.weight", (E, D))]
    if cfg.is_hash_layer(layer_id):  # the token-id table; a hash layer has no selection bias
        out.append(Piece(f"{ours}.router.tid2eid", (0, 0), f"{theirs}.gate.tid2eid", (cfg.vocab_size, m.topk)))
    else:
        out.append(Piece(f"{ours}.router.expert_bias", (0,), f"{theirs}.gate.bias", (E,)))
    for e in range(E):
        x = f"{theirs}.experts.{e}"
        out += [Piece(f"{ours}.experts.w13.weight", (e, 0, 0), f"{x}.w1.weight", (F, D), expert=True),
                Piece(f"{ours}.experts.w13.weight", (e, F, 0), f"{x}.w3.weight", (F, D), expert=True),
                Piece(f"{ours}.experts.w2.weight", (e, 0, 0), f"{x}.w2.weight", (D, F), expert=True)]
    shared = f"{theirs}.shared_experts"
    gate_up = [(f"{shared}.w1.weight", (F, D)), (f"{shared}.w3.weight", (F, D))]
    return out + stacked_rows(f"{ours}.shared.w13.weight", gate_up) + [
        Piece(f"{ours}.shared.w2.weight", (0, 0), f"{shared}.w2.weight", (D, F))]


def _block(cfg: ModelConfig, ours: str, theirs: str, layer_id: int) -> list[Piece]:
    """Block `layer_id`: its norms, mHC maps, attention and MoE."""
    D, n = cfg.dim, cfg.mhc.hc_mult
    out = [Piece(f"{ours}.attn_norm.weight", (0,), f"{theirs}.attn_norm.weight", (D,)),
           Piece(f"{ours}.ffn_norm.weight", (0,), f"{theirs}.ffn_norm.weight", (D,))]
    out += _hyper(f"{ours}.attn_res", f"{theirs}.hc_attn_", n, D, n * (n + 2), 3)
    out += _hyper(f"{ours}.ffn_res", f"{theirs}.hc_ffn_", n, D, n * (n + 2), 3)
    out += v4_attention_pieces(cfg, f"{ours}.attn", f"{theirs}.attn", layer_id=layer_id)
    return out + _ffn(cfg, f"{ours}.ffn", f"{theirs}.ffn", layer_id)


def _mtp(cfg: ModelConfig, d: int) -> list[Piece]:
    """MTP depth d (layer id n_layers + d) under DeepSeek's names "mtp.<d>.*" (module docstring)."""
    D, n, ours, theirs = cfg.dim, cfg.mhc.hc_mult, f"mtp.{d}", f"mtp.{d}"
    out = [Piece(f"{ours}.{name}.weight", (0,), f"{theirs}.{name}.weight", (D,)) for name in ("enorm", "hnorm", "norm")]
    out += [Piece(f"{ours}.{name}.weight", (0, 0), f"{theirs}.{name}.weight", (D, D)) for name in ("e_proj", "h_proj")]
    out += _hyper(f"{ours}.stream_head", f"{theirs}.hc_head_", n, D, n, 1)
    return out + _block(block_config(cfg), f"{ours}.block", theirs, cfg.n_layers + d)


def v4_pieces(cfg: ModelConfig) -> list[Piece]:
    """Every piece of a deepseek_v4 model (hf_names.pieces), in the form save_pretrained writes."""
    D, V, n = cfg.dim, cfg.vocab_size, cfg.mhc.hc_mult
    out = [Piece("embed.weight", (0, 0), "model.embed_tokens.weight", (V, D)),
           Piece("norm.weight", (0,), "model.norm.weight", (D,)), Piece("head.weight", (0, 0), "head.weight", (V, D))]
    out += _hyper("stream_head", "model.hc_head.hc_", n, D, n, 1)
    for i in range(cfg.n_layers):
        out += _block(cfg, f"layers.{i}", f"model.layers.{i}", i)
    for d in range(cfg.mtp.depth):
        out += _mtp(cfg, d)
    return out
