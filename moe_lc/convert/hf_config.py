"""Hugging Face config.json <-> our [model] section, for the families we can express exactly.

    deepseek_v2   MLA, softmax routing, greedy or group-limited greedy (a group scored by its best
                  expert), top-k weights not renormalized (norm_topk_prob = false), shared experts,
                  first_k_dense_replace, YaRN with mscale / mscale_all_dim (DeepSeek-V2, V2-Lite)
    deepseek_v3   MLA, sigmoid routing with e_score_correction_bias (our aux-loss-free bias),
                  group-limited top-k by top-2 sums, routed_scaling_factor, norm_topk_prob, MTP layers
    llama, qwen2  dense GQA, RoPE or YaRN; Qwen2's q/k/v biases (model.qkv_bias)

A field we cannot express (a sliding window, an o_proj bias, a rope type we lack, ...) raises one
ConvertError naming the field and its value, before any weight is read.
"""

from __future__ import annotations

import dataclasses

from moe_lc.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeConfig

FAMILIES = ("deepseek_v2", "deepseek_v3", "llama", "qwen2")


class ConvertError(ValueError):
    """A checkpoint we cannot convert exactly, with the reason."""


def _rope_section(hf: dict) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None) or (kind == "yarn" and params.get("factor", 1.0) == 1.0):
        return RopeConfig(theta=float(theta))
    if kind != "yarn":
        raise ConvertError(f"rope_scaling.type={kind!r}: only default RoPE and YaRN are supported")
    if params.get("attention_factor") is not None:
        raise ConvertError(f"rope_scaling.attention_factor={params['attention_factor']!r}: an explicit YaRN attention "
                           "factor is not supported (it is derived from factor, mscale, mscale_all_dim)")
    return RopeConfig(theta=float(theta), scaling="yarn", factor=float(params["factor"]),
                      original_seq_len=int(params["original_max_position_embeddings"]),
                      beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                      truncate=bool(params.get("truncate", True)), mscale=float(params.get("mscale") or 0.0),
                      mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))


def _refuse(hf: dict, field: str, ok) -> None:
    if field in hf and hf[field] is not None and not ok(hf[field]):
        raise ConvertError(f"{field}={hf[field]!r} is not supported")


def _common(hf: dict) -> dict:
    _refuse(hf, "hidden_act", lambda v: v == "silu")
    _refuse(hf, "mlp_bias", lambda v: not v)
    _refuse(hf, "partial_rotary_factor", lambda v: v == 1.0)
    _refuse(hf, "pretraining_tp", lambda v: v == 1)
    _refuse(hf, "use_sliding_window", lambda v: not v)
    _refuse(hf, "layer_types", lambda v: all(t == "full_attention" for t in v))
    return dict(vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                ffn_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                init_std=float(hf.get("initializer_range", 0.02)), rope=_rope_section(hf))


def _deepseek(hf: dict, family: str) -> ModelConfig:
    _refuse(hf, "moe_layer_freq", lambda v: v == 1)
    _refuse(hf, "attention_bias", lambda v: not v)
    method = hf.get("topk_method", "greedy" if family == "deepseek_v2" else "noaux_tc")
    wanted = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}[family]
    if method not in wanted:
        raise ConvertError(f"topk_method={method!r} is not supported for {family} (expected one of {wanted})")
    grouped = method != "greedy"
    score = hf.get("scoring_func", "softmax" if family == "deepseek_v2" else "sigmoid")
    moe = MoEConfig(n_dense_layers=hf.get("first_k_dense_replace", 0), n_routed_experts=hf["n_routed_experts"],
                    n_shared_experts=hf.get("n_shared_experts") or 0, ffn_dim=hf["moe_intermediate_size"],
                    topk=hf["num_experts_per_tok"], n_groups=(hf.get("n_group") or 1) if grouped else 1,
                    topk_groups=(hf.get("topk_group") or 1) if grouped else 1, score_func=score,
                    group_score="max" if family == "deepseek_v2" else "top2_sum",
                    norm_topk_prob=bool(hf.get("norm_topk_prob", family == "deepseek_v3")),
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                    # continued training balances by the bias (DeepSeek-V3's aux-loss-free method); the
                    # checkpoint's aux_loss_alpha is not carried over: set model.moe.aux_loss_weight to use one
                    bias_update_speed=1e-3 if family == "deepseek_v3" else 0.0, aux_loss_weight=0.0)
    mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"])
    return ModelConfig(**_common(hf), attention="mla", moe=moe, mla=mla)


def _dense_gqa(hf: dict, family: str) -> ModelConfig:
    _refuse(hf, "attention_bias", lambda v: not v)  # llama: bias on q, k, v *and* o
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    common = _common(hf)
    return ModelConfig(**common, head_dim=head_dim, qkv_bias=family == "qwen2",
                       moe=MoEConfig(n_dense_layers=common["n_layers"], n_routed_experts=0, n_shared_experts=0))


_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
               "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace", "q_lora_rank",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


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
        cfg = _deepseek(hf, family) if family.startswith("deepseek") else _dense_gqa(hf, family)
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
    """The transformers family that computes exactly what `cfg` does, or ConvertError saying why none."""
    m = cfg.moe
    dense = m.n_routed_experts == 0 or m.n_dense_layers >= cfg.n_layers
    if cfg.attention == "gqa":
        if not dense:
            raise ConvertError("to-hf: a GQA model with routed experts has no transformers family here "
                               "(use model.attention = 'mla' for DeepSeek-V2/V3, or a dense GQA model)")
        return "qwen2" if cfg.qkv_bias else "llama"
    if dense:
        raise ConvertError("to-hf: a dense MLA model has no transformers family here (DeepSeek-V2/V3 are MoE)")
    if m.score_func == "sigmoid" and m.group_score == "top2_sum":
        return "deepseek_v3"
    if m.score_func == "softmax" and (m.n_groups == 1 or m.group_score == "max") and not m.norm_topk_prob:
        return "deepseek_v2"
    raise ConvertError(f"to-hf: routing score_func={m.score_func!r}, group_score={m.group_score!r}, "
                       f"norm_topk_prob={m.norm_topk_prob} is neither DeepSeek-V3's (sigmoid, top2_sum) nor "
                       "DeepSeek-V2's (softmax, max, no renormalization)")


def to_hf_config(cfg: ModelConfig, family: str, max_position_embeddings: int, dtype: str = "float32") -> dict:
    """An HF config.json dict that transformers' AutoModelForCausalLM builds our model as."""
    hf = {"model_type": family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std,
          "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
          "dtype": dtype}
    r = cfg.rope
    rope = {"rope_theta": r.theta, "rope_type": "default"}
    if r.scaling == "yarn":
        rope.update(rope_type="yarn", factor=r.factor, original_max_position_embeddings=r.original_seq_len,
                    beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        rope.update({k: v for k, v in (("mscale", r.mscale), ("mscale_all_dim", r.mscale_all_dim)) if v})
    hf["rope_parameters"] = rope
    hf["architectures"] = [{"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                            "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]]
    if family in ("llama", "qwen2"):
        return {**hf, "head_dim": cfg.head_size, "attention_bias": False, "mlp_bias": False}
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
    return hf
