"""What every family's config.json shares: the error type, one-line refusals, the dense shape fields
and the rope table (RoPE, YaRN, Llama 3's frequency bands; a partial rotary factor where the
family allows one). Read by hf_config.py (DeepSeek, dense GQA) and hf_moe_config.py (GQA MoE).
"""

from __future__ import annotations

from moe_lc.config import RopeConfig


class ConvertError(ValueError):
    """A checkpoint we cannot convert exactly, with the reason."""


def refuse(hf: dict, field: str, ok) -> None:
    """One ConvertError naming `field` when config.json sets it to a value `ok` rejects."""
    if field in hf and hf[field] is not None and not ok(hf[field]):
        raise ConvertError(f"{field}={hf[field]!r} is not supported")


def rope_params(hf: dict) -> dict:
    """The rope table: transformers 5's `rope_parameters`, or the older `rope_scaling`."""
    return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def rope_section(hf: dict, partial_ok: bool = False) -> RopeConfig:
    params = rope_params(hf)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1.0 and not partial_ok:
        raise ConvertError(f"partial_rotary_factor={partial!r} is not supported for model_type={hf.get('model_type')!r}")
    base = dict(theta=theta, partial_rotary_factor=float(partial))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None) or (kind in ("yarn", "llama3") and params.get("factor", 1.0) == 1.0):
        return RopeConfig(**base)
    if kind == "llama3":
        return RopeConfig(**base, scaling="llama3", factor=float(params["factor"]),
                          original_seq_len=int(params["original_max_position_embeddings"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]))
    if kind != "yarn":
        raise ConvertError(f"rope_scaling.type={kind!r}: only default RoPE, YaRN and llama3 are supported")
    if params.get("attention_factor") is not None:
        raise ConvertError(f"rope_scaling.attention_factor={params['attention_factor']!r}: an explicit YaRN attention "
                           "factor is not supported (it is derived from factor, mscale, mscale_all_dim)")
    return RopeConfig(**base, scaling="yarn", factor=float(params["factor"]),
                      original_seq_len=int(params["original_max_position_embeddings"]),
                      beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                      truncate=bool(params.get("truncate", True)), mscale=float(params.get("mscale") or 0.0),
                      mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))


def common(hf: dict, partial_ok: bool = False) -> dict:
    """The [model] fields every family maps the same way, after the refusals every family shares."""
    refuse(hf, "hidden_act", lambda v: v == "silu")
    refuse(hf, "mlp_bias", lambda v: not v)
    refuse(hf, "pretraining_tp", lambda v: v == 1)
    refuse(hf, "use_sliding_window", lambda v: not v)
    refuse(hf, "layer_types", lambda v: all(t == "full_attention" for t in v))
    return dict(vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                ffn_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                init_std=float(hf.get("initializer_range", 0.02)), rope=rope_section(hf, partial_ok),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def rope_to_hf(r) -> dict:
    """Our [model.rope] as transformers 5's `rope_parameters`."""
    rope = {"rope_theta": r.theta, "rope_type": "default"}
    if r.scaling == "yarn":
        rope.update(rope_type="yarn", factor=r.factor, original_max_position_embeddings=r.original_seq_len,
                    beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        rope.update({k: v for k, v in (("mscale", r.mscale), ("mscale_all_dim", r.mscale_all_dim)) if v})
    elif r.scaling == "llama3":
        rope.update(rope_type="llama3", factor=r.factor, original_max_position_embeddings=r.original_seq_len,
                    low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = r.partial_rotary_factor
    return rope
