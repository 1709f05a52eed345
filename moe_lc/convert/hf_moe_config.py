"""config.json <-> [model] for the grouped-query-attention MoE families (hf_config.py has the table).

What each family computes, read from transformers 5's modeling files (models/<family>/modeling_*.py):
  mixtral     softmax over all experts, top-k, renormalized (== softmax over the top-k logits); every
              layer MoE; no shared expert; experts w1 (gate) / w3 (up) / w2 (down) under block_sparse_moe
  qwen3_moe   as mixtral with norm_topk_prob a choice, and q/k RMSNorm per head (qk_norm = "head")
  olmoe       as qwen3_moe, but q/k RMSNorm over the whole q and k projections (qk_norm = "full")
  qwen2_moe   one shared expert of shared_expert_intermediate_size, scaled by sigmoid(x . gate)
              (moe.shared_expert_gate, moe.shared_ffn_dim); q/k/v biases (qkv_bias)
  glm4_moe    DeepSeek-V3's router (sigmoid, e_score_correction_bias, groups by top-2 sums,
              routed_scaling_factor) with GQA, optional q/k/v biases and per-head q/k norm,
              first_k_dense_replace dense layers, partial RoPE (rope.partial_rotary_factor); MTP
              layers under DeepSeek-V3's names (vLLM's models/glm4_moe_mtp.py loads those)

Training-only fields map to nothing: output_router_logits (whether transformers returns router
logits), router_aux_loss_coef (its switch-style balance loss; ours is off: set model.moe.aux_loss_weight
or bias_update_speed to balance), router_jitter_noise (mixtral's training-time input noise). None
changes the function the weights compute.
"""

from __future__ import annotations

from moe_lc.config import ModelConfig, MoEConfig
from moe_lc.convert.hf_fields import ConvertError, common, refuse

SOFTMAX_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
MOE_FAMILIES = SOFTMAX_FAMILIES + ("glm4_moe",)


def _dense_prefix(hf: dict) -> int:
    """Qwen-MoE's dense layers as our n_dense_layers: mlp_only_layers must be 0..k-1, every other layer MoE."""
    refuse(hf, "decoder_sparse_step", lambda v: v == 1)
    only = sorted(hf.get("mlp_only_layers") or [])
    if only != list(range(len(only))):
        raise ConvertError(f"mlp_only_layers={only!r} is not supported (only the first k layers may be dense)")
    return len(only)


def _softmax_moe(hf: dict, family: str) -> MoEConfig:
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts" if family != "mixtral" else "num_local_experts")
    n_dense = _dense_prefix(hf) if family.startswith("qwen") else 0
    expert_ffn = hf["moe_intermediate_size"] if family.startswith("qwen") else hf["intermediate_size"]
    gated = family == "qwen2_moe"
    return MoEConfig(n_dense_layers=n_dense, n_routed_experts=experts, n_shared_experts=1 if gated else 0,
                     ffn_dim=expert_ffn, topk=hf["num_experts_per_tok"], n_groups=1, topk_groups=1,
                     score_func="softmax",
                     norm_topk_prob=True if family == "mixtral" else bool(hf.get("norm_topk_prob", False)),
                     routed_scaling_factor=1.0, bias_update_speed=0.0, aux_loss_weight=0.0,
                     shared_expert_gate=gated, shared_ffn_dim=hf["shared_expert_intermediate_size"] if gated else 0)


def _glm4_moe(hf: dict) -> MoEConfig:
    return MoEConfig(n_dense_layers=hf.get("first_k_dense_replace", 0), n_routed_experts=hf["n_routed_experts"],
                     n_shared_experts=hf.get("n_shared_experts") or 0, ffn_dim=hf["moe_intermediate_size"],
                     topk=hf["num_experts_per_tok"], n_groups=hf.get("n_group") or 1,
                     topk_groups=hf.get("topk_group") or 1, score_func="sigmoid", group_score="top2_sum",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                     routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                     # GLM-4.5 balances by the bias, as DeepSeek-V3 (e_score_correction_bias)
                     bias_update_speed=1e-3, aux_loss_weight=0.0)


def from_hf_moe(hf: dict, family: str) -> ModelConfig:
    """Our ModelConfig for a config.json of one of MOE_FAMILIES."""
    if family == "mixtral":
        refuse(hf, "sliding_window", lambda v: False)  # any window: mixtral has no use_sliding_window switch
    if family == "olmoe":
        refuse(hf, "clip_qkv", lambda v: False)
    # qwen3_moe, olmoe: attention_bias is a bias on q, k, v and o; glm4_moe: on q, k, v only
    both = family in ("qwen3_moe", "olmoe") and bool(hf.get("attention_bias", False))
    base = common(hf, partial_ok=family == "glm4_moe")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    qk_norm = {"qwen3_moe": "head", "olmoe": "full"}.get(family, "none")
    if family == "glm4_moe":
        moe, qkv_bias = _glm4_moe(hf), bool(hf.get("attention_bias", False))
        qk_norm = "head" if hf.get("use_qk_norm") else "none"
    else:
        moe, qkv_bias = _softmax_moe(hf, family), both or (family == "qwen2_moe" and hf.get("qkv_bias", True))
    return ModelConfig(**base, head_dim=head_dim, qkv_bias=bool(qkv_bias), moe=moe, qk_norm=qk_norm,
                       attn_out_bias=both)


def moe_family_of(cfg: ModelConfig) -> str:
    """The GQA MoE family computing exactly what `cfg` does, or one ConvertError naming the field why none."""
    m, qk, out_bias = cfg.moe, cfg.qk_norm, cfg.attn_out_bias
    gated = m.shared_expert_gate
    if cfg.rope.partial_rotary_factor != 1.0 and m.score_func != "sigmoid":
        raise ConvertError("to-hf: model.rope.partial_rotary_factor != 1 exists only in glm4_moe (sigmoid routing)")
    if m.score_func == "sigmoid":
        if m.group_score != "top2_sum" and m.n_groups > 1:
            raise ConvertError(f"to-hf: model.moe.group_score={m.group_score!r}: glm4_moe scores groups by top-2 sums")
        if out_bias:
            raise ConvertError("to-hf: model.attn_out_bias: glm4_moe (sigmoid routing) has no bias on o_proj")
        if qk == "full" or gated:
            raise ConvertError(f"to-hf: sigmoid routing is glm4_moe's, which has no qk_norm={qk!r} / shared_expert_gate")
        return "glm4_moe"
    grouped = m.n_groups > 1 and m.topk_groups < m.n_groups
    for bad, why in ((grouped, f"model.moe.n_groups={m.n_groups} (group-limited softmax routing is DeepSeek-V2's, MLA)"),
                     (m.routed_scaling_factor != 1.0, f"model.moe.routed_scaling_factor={m.routed_scaling_factor}"),
                     (m.n_shared_experts and not gated, f"model.moe.n_shared_experts={m.n_shared_experts} without "
                      "shared_expert_gate (ungated shared experts with softmax routing are DeepSeek-V2's, MLA)")):
        if bad:
            raise ConvertError(f"to-hf: {why} has no GQA MoE family in transformers with softmax routing")
    if gated:
        family = "qwen2_moe"
    else:
        family = {"head": "qwen3_moe", "full": "olmoe", "none": "mixtral"}[qk]
    if family in ("qwen3_moe", "olmoe") and cfg.qkv_bias != out_bias:
        raise ConvertError(f"to-hf: model.qkv_bias={cfg.qkv_bias} and attn_out_bias={out_bias}: {family}'s "
                           "attention_bias is on q, k, v and o together")
    if family in ("mixtral", "qwen2_moe") and out_bias:
        raise ConvertError(f"to-hf: model.attn_out_bias: {family} has no bias on o_proj")
    if family == "mixtral" and cfg.qkv_bias:
        raise ConvertError("to-hf: model.qkv_bias = true: mixtral has no attention biases (qwen2_moe, glm4_moe do)")
    if family == "qwen2_moe" and qk != "none":
        raise ConvertError(f"to-hf: model.qk_norm={qk!r}: qwen2_moe has no q/k norm")
    if family == "mixtral" and not m.norm_topk_prob:
        raise ConvertError("to-hf: model.moe.norm_topk_prob = false without qk_norm: mixtral always renormalizes")
    if family == "olmoe" and cfg.head_size * cfg.n_heads != cfg.dim:
        raise ConvertError(f"to-hf: model.head_dim={cfg.head_dim}: olmoe's heads are hidden_size / heads wide")
    if family in ("mixtral", "olmoe") and m.n_dense_layers:
        raise ConvertError(f"to-hf: model.moe.n_dense_layers={m.n_dense_layers}: {family} has no dense layers")
    return family


def to_hf_moe(cfg: ModelConfig, family: str, hf: dict) -> dict:
    """The config.json fields of a GQA MoE family on top of the shared ones in `hf`."""
    m, out_bias = cfg.moe, cfg.attn_out_bias
    hf = {**hf, "head_dim": cfg.head_size, "num_experts_per_tok": m.topk}
    if family == "glm4_moe":
        return {**hf, "n_routed_experts": m.n_routed_experts, "n_shared_experts": m.n_shared_experts,
                "moe_intermediate_size": m.ffn_dim, "first_k_dense_replace": m.n_dense_layers, "n_group": m.n_groups,
                "topk_group": m.topk_groups, "norm_topk_prob": m.norm_topk_prob,
                "routed_scaling_factor": m.routed_scaling_factor, "attention_bias": cfg.qkv_bias,
                "use_qk_norm": cfg.qk_norm == "head", "num_nextn_predict_layers": cfg.mtp.depth}
    if family == "mixtral":
        return {**hf, "num_local_experts": m.n_routed_experts, "intermediate_size": m.ffn_dim, "sliding_window": None,
                "router_jitter_noise": 0.0}
    hf.update(num_experts=m.n_routed_experts, norm_topk_prob=m.norm_topk_prob)
    if family == "olmoe":
        return {**hf, "intermediate_size": m.ffn_dim, "attention_bias": out_bias, "clip_qkv": None}
    hf.update(moe_intermediate_size=m.ffn_dim, decoder_sparse_step=1, mlp_only_layers=list(range(m.n_dense_layers)),
              use_sliding_window=False)
    if family == "qwen3_moe":
        return {**hf, "attention_bias": out_bias}
    return {**hf, "qkv_bias": cfg.qkv_bias, "shared_expert_intermediate_size": m.shared_hidden}
