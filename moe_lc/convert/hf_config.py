"""Hugging Face config.json <-> our [model] section, for the families we can express exactly.

    deepseek_v2   MLA, softmax routing, greedy or group-limited greedy (a group scored by its best
                  expert), top-k weights not renormalized (norm_topk_prob = false), shared experts,
                  first_k_dense_replace, YaRN with mscale / mscale_all_dim (DeepSeek-V2, V2-Lite)
    deepseek_v3   MLA, sigmoid routing with e_score_correction_bias (our aux-loss-free bias),
                  group-limited top-k by top-2 sums, routed_scaling_factor, norm_topk_prob, MTP layers
    deepseek_v32  DeepSeek-V3's model with DeepSeek Sparse Attention: a lightning indexer per layer
                  (index_topk, index_n_heads, index_head_dim: [model.dsa]); the sparse stage
    deepseek_v4   DeepSeek-V4: model.attention = "v4" per layer type, mHC, sqrt(softplus) MoE with hash-routed
                  first layers and the SwiGLU clamp (convert/hf_v4.py)
    llama, qwen2  dense GQA, RoPE, YaRN or llama3 frequency bands (rope.scaling = "llama3");
                  Qwen2's q/k/v biases (model.qkv_bias); Llama's attention_bias (q, k, v and o:
                  model.qkv_bias + model.attn_out_bias)
    qwen3         dense GQA with q/k RMSNorm per head (model.qk_norm = "head"), attention_bias as Llama's
    mixtral       GQA MoE, softmax top-k renormalized, every layer MoE (block_sparse_moe w1/w3/w2)
    qwen3_moe     GQA MoE, softmax top-k (norm_topk_prob), per-head q/k norm, mlp_only_layers 0..k-1
                  as n_dense_layers, attention_bias as Llama's
    olmoe         GQA MoE, softmax top-k, q/k RMSNorm over the whole projections (qk_norm = "full"),
                  attention_bias as Llama's
    qwen2_moe     GQA MoE with q/k/v biases and a sigmoid-gated shared expert (moe.shared_expert_gate,
                  moe.shared_ffn_dim = shared_expert_intermediate_size), mlp_only_layers as qwen3_moe
    glm4_moe      GQA MoE with DeepSeek-V3's router, first_k_dense_replace, attention_bias (q, k, v
                  only), per-head q/k norm (use_qk_norm), partial RoPE (rope.partial_rotary_factor)

(hf_moe_config.py has the MoE families in detail.) A field we cannot express raises one
ConvertError naming the field and its value, before any weight is read: a sliding window
(use_sliding_window, mixtral's sliding_window, non-full layer_types), a rope type other than
default / yarn / llama3, a partial rotary factor outside glm4_moe, decoder_sparse_step != 1,
mlp_only_layers other than the first k layers, olmoe's clip_qkv, a non-silu hidden_act, DeepSeek's
attention_bias. Training-only fields (output_router_logits, router_aux_loss_coef,
router_jitter_noise, aux_loss_alpha) map to nothing.
"""

from __future__ import annotations

import dataclasses

from moe_lc.config import DSAConfig, MLAConfig, ModelConfig, MoEConfig, MTPConfig
from moe_lc.config.attention_kinds import attention_kind, load
from moe_lc.convert.hf_fields import ConvertError, common, refuse, rope_to_hf
from moe_lc.convert.hf_moe_config import MOE_FAMILIES, from_hf_moe, moe_family_of, to_hf_moe
from moe_lc.convert.hf_v4 import from_hf_v4, to_hf_v4

FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "llama", "qwen2", "qwen3") + MOE_FAMILIES
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM",
                 "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
__all__ = ["ARCHITECTURES", "FAMILIES", "ConvertError", "check_field_types", "family_of", "from_hf_config",
           "to_hf_config"]


def _deepseek(hf: dict, family: str) -> ModelConfig:
    refuse(hf, "moe_layer_freq", lambda v: v == 1)
    refuse(hf, "attention_bias", lambda v: not v)
    method = hf.get("topk_method", "greedy" if family == "deepseek_v2" else "noaux_tc")
    wanted = {"deepseek_v2": ("greedy", "group_limited_greedy")}.get(family, ("noaux_tc",))
    if method not in wanted:
        raise ConvertError(f"topk_method={method!r} is not supported for {family} (expected one of {wanted})")
    grouped = method != "greedy"
    score = hf.get("scoring_func", "softmax" if family == "deepseek_v2" else "sigmoid")
    moe = MoEConfig(n_dense_layers=hf.get("first_k_dense_replace", 0), n_routed_experts=hf["n_routed_experts"],
                    n_shared_experts=hf.get("n_shared_experts") or 0, ffn_dim=hf["moe_intermediate_size"],
                    topk=hf["num_experts_per_tok"], n_groups=(hf.get("n_group") or 1) if grouped else 1,
                    topk_groups=(hf.get("topk_group") or 1) if grouped else 1, score_func=score,
                    group_score="max" if family == "deepseek_v2" else "top2_sum",
                    norm_topk_prob=bool(hf.get("norm_topk_prob", family != "deepseek_v2")),
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                    # continued training balances by the bias (DeepSeek-V3's aux-loss-free method); the
                    # checkpoint's aux_loss_alpha is not carried over: set model.moe.aux_loss_weight to use one
                    bias_update_speed=0.0 if family == "deepseek_v2" else 1e-3, aux_loss_weight=0.0)
    mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"])
    dsa = DSAConfig()
    if family == "deepseek_v32":  # every layer indexed (its layer_types), its MLP pattern the dense prefix's
        refuse(hf, "layer_types", lambda v: all(t == "indexed_attention" for t in v))
        refuse(hf, "mlp_layer_types", lambda v: v == ["dense"] * moe.n_dense_layers + ["sparse"] * (len(v) - moe.n_dense_layers))
        hf = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types")}
        dsa = DSAConfig(enabled=True, index_topk=hf["index_topk"], index_n_heads=hf["index_n_heads"],
                        index_head_dim=hf["index_head_dim"])
    return ModelConfig(**common(hf), attention="mla", moe=moe, mla=mla, dsa=dsa)


def _dense_gqa(hf: dict, family: str) -> ModelConfig:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    base = common(hf)
    # llama, qwen3: attention_bias puts a bias on q, k, v *and* o; qwen2: always on q, k, v, never on o
    both = family != "qwen2" and bool(hf.get("attention_bias", False))
    return ModelConfig(**base, head_dim=head_dim, qkv_bias=family == "qwen2" or both, attn_out_bias=both,
                       qk_norm="head" if family == "qwen3" else "none",
                       moe=MoEConfig(n_dense_layers=base["n_layers"], n_routed_experts=0, n_shared_experts=0))


_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
               "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace", "q_lora_rank",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "index_topk",
               "index_n_heads", "index_head_dim", "o_groups", "o_lora_rank", "sliding_window", "hc_mult",
               "hc_sinkhorn_iters",
               "num_local_experts", "shared_expert_intermediate_size", "decoder_sparse_step")


def check_field_types(hf: dict) -> None:
    """Name the field when config.json gives a size as a string or a rope table as a word; what gets
    past this (a rarer field) is still refused in one line, without the name (from_hf_config)."""
    for name in _INT_FIELDS:
        value = hf.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConvertError(f"config.json: {name}={value!r} is not an integer")
    for name in ("rope_parameters", "rope_scaling", "quantization_config"):
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            raise ConvertError(f"config.json: {name}={hf[name]!r} is not an object")


def from_hf_config(hf: dict, mtp_layers: int = 0) -> tuple[ModelConfig, str]:
    """(our ModelConfig, family) for an HF config.json; `mtp_layers`: MTP layers present in the weights."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConvertError(f"model_type={family!r} is not supported (supported: {', '.join(FAMILIES)})")
    check_field_types(hf)
    try:
        if family == "deepseek_v4":
            cfg = from_hf_v4(hf)
        elif family.startswith("deepseek"):
            cfg = _deepseek(hf, family)
        else:
            cfg = from_hf_moe(hf, family) if family in MOE_FAMILIES else _dense_gqa(hf, family)
        if mtp_layers:
            cfg = dataclasses.replace(cfg, mtp=MTPConfig(depth=mtp_layers))
        errors = cfg.errors()
    except KeyError as exc:
        raise ConvertError(f"config.json has no {exc.args[0]!r} (model_type={family!r} needs it)") from None
    except ConvertError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong type: "64", a list, ...
        raise ConvertError(f"config.json: a field of model_type={family!r} has the wrong type "
                           f"({type(exc).__name__}: {exc})") from None
    if errors:
        raise ConvertError("the converted [model] is invalid: " + "; ".join(errors))
    return cfg, family


def family_of(cfg: ModelConfig) -> str:
    """The transformers family that computes exactly what `cfg` does, or ConvertError saying why none: its
    attention kind's `hf_family` (moe_lc/config/attention_kinds.py)."""
    return load(attention_kind(cfg).hf_family)(cfg)


def gqa_family(cfg: ModelConfig) -> str:
    """`family_of` a GQA model: a dense Llama / Qwen2 / Qwen3, or one of the GQA MoE families."""
    if cfg.has_moe:
        return moe_family_of(cfg)
    qk, out_bias = cfg.qk_norm, cfg.attn_out_bias
    if cfg.rope.partial_rotary_factor != 1.0:
        raise ConvertError("to-hf: model.rope.partial_rotary_factor != 1 has no dense family here (glm4_moe is MoE)")
    if out_bias and not cfg.qkv_bias:
        raise ConvertError("to-hf: model.attn_out_bias without model.qkv_bias: no transformers family biases o only")
    if qk == "head" and cfg.qkv_bias == out_bias:
        return "qwen3"
    if qk != "none":
        raise ConvertError(f"to-hf: a dense GQA model with model.qk_norm={qk!r} and q/k/v biases but none on wo "
                           "has no transformers family here (qwen3: per-head q/k norm, biases on all four or none)")
    return "qwen2" if cfg.qkv_bias and not out_bias else "llama"


def mla_family(cfg: ModelConfig) -> str:
    """`family_of` an MLA model: DeepSeek-V3 or V2, told apart by their routing."""
    m = cfg.moe
    if not cfg.has_moe:
        raise ConvertError("to-hf: a dense MLA model has no transformers family here (DeepSeek-V2/V3 are MoE)")
    if m.score_func == "sigmoid" and m.group_score == "top2_sum":
        return "deepseek_v3"
    if m.score_func == "softmax" and (m.n_groups == 1 or m.group_score == "max") and not m.norm_topk_prob:
        return "deepseek_v2"
    raise ConvertError(f"to-hf: routing score_func={m.score_func!r}, group_score={m.group_score!r}, "
                       f"norm_topk_prob={m.norm_topk_prob} is neither DeepSeek-V3's (sigmoid, top2_sum) nor "
                       "DeepSeek-V2's (softmax, max, no renormalization)")


def dsa_family(cfg: ModelConfig) -> str:
    """`family_of` a DSA model: DeepSeek-V3.2, DeepSeek-V3's model with the indexer."""
    if mla_family(cfg) != "deepseek_v3":
        raise ConvertError("to-hf: DeepSeek Sparse Attention on a model routed as DeepSeek-V2 has no transformers "
                           "family (deepseek_v32 routes as DeepSeek-V3)")
    return "deepseek_v32"


def to_hf_config(cfg: ModelConfig, family: str, max_position_embeddings: int, dtype: str = "float32") -> dict:
    """An HF config.json dict that transformers' AutoModelForCausalLM builds our model as."""
    hf = {"model_type": family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std,
          "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
          "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype, "rope_parameters": rope_to_hf(cfg.rope), "architectures": [ARCHITECTURES[family]]}
    if family in MOE_FAMILIES:
        return to_hf_moe(cfg, family, hf)
    if family == "deepseek_v4":
        return to_hf_v4(cfg, hf)
    if family in ("llama", "qwen2", "qwen3"):
        extra = {"use_sliding_window": False} if family == "qwen3" else {"mlp_bias": False}
        return {**hf, "head_dim": cfg.head_size, "attention_bias": cfg.attn_out_bias, **extra}
    m, a = cfg.moe, cfg.mla
    grouped = m.n_groups > 1
    hf.update(first_k_dense_replace=m.n_dense_layers, n_routed_experts=m.n_routed_experts,
              n_shared_experts=m.n_shared_experts, moe_intermediate_size=m.ffn_dim, num_experts_per_tok=m.topk,
              n_group=m.n_groups, topk_group=m.topk_groups, routed_scaling_factor=m.routed_scaling_factor,
              norm_topk_prob=m.norm_topk_prob, scoring_func=m.score_func, q_lora_rank=a.q_lora_rank or None,
              kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
              v_head_dim=a.v_head_dim, head_dim=a.qk_rope_head_dim, attention_bias=False)
    if family == "deepseek_v2":
        hf["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    else:
        hf.update(topk_method="noaux_tc", rope_interleave=True, num_nextn_predict_layers=cfg.mtp.depth)
    if family == "deepseek_v32":
        d = cfg.dsa
        hf.update(index_topk=d.index_topk, index_n_heads=d.index_n_heads, index_head_dim=d.index_head_dim)
    return hf
