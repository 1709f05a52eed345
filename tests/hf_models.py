"""Tiny random Hugging Face models, made locally with transformers' own config classes and
`save_pretrained` (no downloads), for the conversion tests.

Each family exercises what its real checkpoints have: DeepSeek-V3 (MLA with q_lora, 8 experts in 4
groups, sigmoid + a non-zero e_score_correction_bias, routed_scaling_factor 2.5, YaRN with mscale !=
mscale_all_dim, interleaved rope rows), DeepSeek-V2-Lite (MLA without q_lora, softmax, group-limited
greedy by the best expert, no renormalization, YaRN 0.707 / 0.707), Qwen2 (GQA with q/k/v biases,
tied embeddings, YaRN) and Llama (GQA, plain RoPE). The families added after them (NEW_FAMILIES):
Llama with llama3 rope bands and attention_bias; Qwen3 (per-head q/k norm, head_dim != hidden / heads); Mixtral (top-2
of 8, renormalized); Qwen3-MoE (per-head q/k norm, norm_topk_prob, a dense first layer by
mlp_only_layers); OLMoE (q/k norm over whole projections, no renormalization); Qwen2-MoE (q/k/v
biases, a sigmoid-gated shared expert of its own width); GLM-4.5-style GLM4-MoE (grouped sigmoid
routing with a non-zero correction bias, scaling 2.5, a dense first layer, q/k/v biases, per-head
q/k norm, partial RoPE 0.5). Every model's YaRN / llama3 rope has original length 64, so a 96-token
test sequence is past it.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
ORIGINAL = 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 32.0, "beta_slow": 1.0}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}


def tokenizer_files(directory: Path) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 4, special_tokens=["<|begin|>", "<|end|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The pass key is 12345. Remember it.", "def main():\n    return 0\n", "long context " * 20]
    tok.train_from_iterator(text * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>",
                                   pad_token="<|pad|>")
    fast.save_pretrained(directory)


def _common(**kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=4 * ORIGINAL,
                rms_norm_eps=1e-6, **kw)


def deepseek_v3(**over):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_common(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}, **over))


def deepseek_v32(**over):
    """DeepSeek-V3's tiny model with the lightning indexer: 16 indexer heads of 16, top-24 of a 96-token test
    sequence (so the attention really is sparse past position 23)."""
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**_common(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
        **{"index_topk": 24, "index_n_heads": 16, "index_head_dim": 16, **over}))


def deepseek_v2(**over):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**_common(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=4,
        n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
        topk_method="group_limited_greedy", first_k_dense_replace=1, tie_word_embeddings=False,
        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}, **over))


def qwen2(**over):
    from transformers import Qwen2Config

    return Qwen2Config(**_common(intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                                 tie_word_embeddings=True, rope_parameters=dict(YARN), **over))


def llama(**over):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
                                 tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0}, **over))


def llama3(**over):
    """Llama 3.1's rope (frequency bands interpolated by factor past the original length), and
    attention_bias (on q, k, v and o), which Llama 3 lacks but the family allows."""
    from transformers import LlamaConfig

    return LlamaConfig(**_common(intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                                 attention_bias=True, tie_word_embeddings=False, rope_parameters=dict(LLAMA3), **over))


def qwen3(**over):
    from transformers import Qwen3Config

    return Qwen3Config(**_common(intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
                                 tie_word_embeddings=False, rope_parameters=dict(YARN), **over))


def mixtral(**over):
    from transformers import MixtralConfig

    return MixtralConfig(**_common(intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                   num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                                   rope_parameters=dict(YARN), **over))


def qwen3_moe(**over):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                    num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False,
                                    rope_parameters=dict(YARN), **over))


def olmoe(**over):
    """pad_token_id None: transformers' embedding leaves the pad row out of training (padding_idx), ours
    trains every row, so with a pad id the two gradients differ in that row (OLMoE's own default is 1)."""
    from transformers import OlmoeConfig

    return OlmoeConfig(**_common(intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False,
                                 eos_token_id=2, pad_token_id=None, rope_parameters=dict(YARN), **over))


def qwen2_moe(**over):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**_common(intermediate_size=96, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                    tie_word_embeddings=False, rope_parameters=dict(YARN), **over))


def glm4_moe(**over):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**_common(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        tie_word_embeddings=False, rope_parameters={**YARN, "partial_rotary_factor": 0.5}, **over))


FAMILIES = {"deepseek_v3": deepseek_v3, "deepseek_v2": deepseek_v2, "qwen2": qwen2, "llama": llama}
NEW_FAMILIES = {"llama3": llama3, "qwen3": qwen3, "mixtral": mixtral, "qwen3_moe": qwen3_moe, "olmoe": olmoe,
                "qwen2_moe": qwen2_moe, "glm4_moe": glm4_moe}


def save_model(config, directory: Path, seed: int = 0, max_shard_size: str | None = None):
    """A random model of `config` (std 0.1 so the logits are far from uniform; random router biases and
    norm weights) saved with its tokenizer; returns the transformers model (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.initializer_range = 0.1
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn_like(t))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kw)
    tokenizer_files(directory)
    return model
