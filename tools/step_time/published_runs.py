"""The step-time model's test set: published training runs, each a recipe with its layout, cluster and figure.

Each run: its recipe (the header cites the source and says what the recipe cannot express), the cluster it ran
on, the published figure (tokens/s/GPU, or model TFLOP/s/GPU with the convention the source counts attention in:
"causal", "full", or "unstated"), the implementation it ran (tools/step_time/compute.py: "fused" kernels, and
"fused_a2a_overlap" where the source's configuration overlaps the EP all-to-all with 1F1B), its source, the
attention kernels its stack runs where they are not cuDNN's (attention_impls.py: NeMo AutoModel's GPT-OSS configs,
examples/benchmark/configs/gptoss_*_te_deepep.yaml, set `attn: flex`), and the model's sliding window where it
has one (moe_lc's config cannot state one for GQA: GPT-OSS's 128 tokens on every other layer).
tools/step_time/published.py predicts each and fits what the model fits from them leave-one-out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attention_impls import SlidingWindow

MB = ("Megatron-Bridge performance summary, 25.11 container, DGX-H100 table "
      "(docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html; github.com/NVIDIA-NeMo/Megatron-Bridge "
      "its file performance-summary.md under docs), row ")
AM = ("NeMo AutoModel performance summary, pre-training table \"System: DGX-H100, Precision: BF16\" "
      "(docs.nvidia.com/nemo/automodel/latest/performance-summary.html; github.com/NVIDIA-NeMo/Automodel "
      "its file performance-summary.md under docs, and its examples/benchmark/configs/), row ")


# GPT-OSS's attention (openai/gpt-oss-120b and -20b config.json: `sliding_window` 128, `layer_types` alternating
# "sliding_attention" and "full_attention"); its heads of 64 come from the recipe (attention_impls.py prices both)
GPT_OSS_WINDOW = SlidingWindow(tokens=128, every=2)
# what is still left out of both stacks' GPT-OSS runs
GPT_OSS_NOTE = ("not modelled: the learned attention sinks (no public measurement of their cost in a fused kernel), "
                "the biases of attention and experts (both stacks add an expert GEMM's bias per local expert in "
                "Python: Megatron-Core on the second GEMM, megatron/core/transformer/moe/experts.py _apply_bias, "
                "NeMo AutoModel on both, nemo_automodel/components/moe/layers.py GroupedExpertsDeepEP._apply_bias: "
                "launches and a split, add and concatenation over the expert activations) and the SwiGLU clamp (fused "
                "with the bias and the routing weight: Megatron-Core's weighted_bias_quick_geglu_impl, AutoModel's "
                "torch.compile'd quick_geglu_deepep)")
# what is left of Megatron-Bridge's GPT-OSS miss, and what would tell its causes apart
MB_GPT_OSS_NOTE = (GPT_OSS_NOTE + ". Megatron-Bridge's GPT-OSS rows miss alike: its 64-B200 row (PP1 EP8, MBS 4, "
                   "8,213 tokens/s/GPU in the same 25.11 table) is predicted 11,822 with this attention (+44%; "
                   "`python tools/plan.py recipes/published/gpt_oss_120b_4k_h100.toml --cluster b200 "
                   "--set parallel.pp=1 --set parallel.dp=64 --set parallel.pp_stage_layers=[] "
                   "--set train.micro_batch=4` gives 11,739 with causal heads of 128), while NeMo AutoModel's "
                   "GPT-OSS runs land within 16% and Megatron-Bridge's Llama and Qwen3 runs within 22%. What only "
                   "Megatron's GPT-OSS runs: Transformer "
                   "Engine's cuDNN attention with learnable sinks (cuDNN 9.13.1 and later; its cost is not published), "
                   "Transformer Engine 2.9's GroupedLinear (one cuBLAS GEMM per local expert over 4 streams, "
                   "nvte_multi_stream_cublas_gemm) with biases, and the NCCL all-to-all. A device run timing "
                   "DotProductAttention with softmax_type learnable and window (128, 0) at heads of 64 against the "
                   "vanilla softmax would say whether the attention is it")


@dataclass(frozen=True)
class Run:
    """One published run (module docstring)."""

    name: str
    recipe: str
    cluster: str
    tokens: float | None  # published tokens/s/GPU
    tflops: float | None  # published model TFLOP/s/GPU
    convention: str  # how the source counts attention in its TFLOP/s: causal, full, unstated
    impl: str
    precision: str  # as published
    source: str
    attention: str = "cudnn"  # the attention kernels its stack runs (tools/step_time/attention_impls.py)
    window: SlidingWindow | None = None  # the model's sliding window, where its recipe cannot state it
    note: str = ""  # what is known about why the model misses it, printed under the table


RUNS = [
    Run("DeepSeek-V3, 2,048 H800", "recipes/deepseek_v3_671b.toml", "h800", 1543.0, None, "-", "fused", "FP8 blockwise",
        "DeepSeek-V3 report (arXiv 2412.19437) Table 1: 2.664M H800 GPU-hours of pre-training for 14.8T tokens on "
        "2,048 H800 = 14.8e12 / (2.664e6 x 3600) = 1,543 tokens/s/GPU"),
    Run("Megatron DeepSeek-V3, 1,024 H100", "recipes/megatron_deepseek_v3_h100.toml", "h100", 1297.0, 338.0, "causal",
        "fused_a2a_overlap", "FP8 blockwise",
        "Megatron-Bridge 25.09 performance summary (docs.nvidia.com/nemo/megatron-bridge): DeepSeek-V3, 1,024 H100, "
        "FP8, TP2 PP8 EP64, 4K; EP all-to-all overlapped with 1F1B (the Megatron MoE model zoo's H100 guide)"),
    Run("Megatron Qwen3-235B-A22B 128K, 256 H100", "recipes/qwen3_235b_a22b_128k.toml", "h100", None, 357.0,
        "unstated", "fused", "BF16",
        "Megatron MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md): "
        "Qwen3-235B-A22B, 128K, TP4 CP8 PP8 VPP4 EP8, 32 H100 nodes, BF16, dropless"),
    Run("MB Llama 3 8B FP8, 8 H100", "recipes/published/llama3_8b_8k_h100_fp8.toml", "h100", 14451.0, 744.0, "causal",
        "fused", "FP8-CS", MB + "LLAMA3_8B: FSDP, GBS 128, MBS 1"),
    Run("MB Llama 3 70B FP8, 64 H100", "recipes/published/llama3_70b_8k_h100_fp8.toml", "h100", 1602.0, 719.0, "causal",
        "fused", "FP8-CS", MB + "LLAMA3_70B: TP4 PP8 VP5, GBS 128, MBS 1"),
    Run("MB Llama 3.1 405B FP8, 1,024 H100", "recipes/published/llama31_405b_8k_h100_1024_fp8.toml", "h100", 292.0,
        737.0, "causal", "fused", "FP8-CS", MB + "LLAMA3.1_405B: TP8 PP8 CP2 VP8, GBS 512, MBS 1"),
    Run("MB Qwen3-30B-A3B FP8, 16 H100", "recipes/published/qwen3_30b_a3b_4k_h100_fp8.toml", "h100", 5275.0, 121.0,
        "causal", "fused_a2a_overlap", "FP8-CS", MB + "Qwen3_30B_a3B: PP2 VP24 EP8, GBS 512, MBS 2; the release's "
        "preset (scripts/performance/configs/qwen/qwen3_workload_base_configs.py) sets moe_a2a_overlap"),
    Run("MB Qwen3-235B-A22B FP8, 256 H100", "recipes/published/qwen3_235b_a22b_4k_h100_fp8.toml", "h100", 1575.0,
        233.0, "causal", "fused_a2a_overlap", "FP8-CS", MB + "Qwen3_235B_a22B: TP2 PP8 VP4 EP32, GBS 2048, MBS 1; "
        "the release's preset sets moe_a2a_overlap"),
    Run("MB GPT-OSS 120B, 64 H100", "recipes/published/gpt_oss_120b_4k_h100.toml", "h100", 5630.0, 153.0, "causal",
        "fused", "BF16", MB + "GPT OSS 120B: PP4 EP8, GBS 512, MBS 4 (GA 2); the release's H100 preset (branch r0.2.0, "
        "scripts/performance/configs/gpt_oss/workload_base_configs.py, GPT_OSS_120B_H100_BF16_BASE_CONFIG) runs MBS 1, "
        "which the recipe takes (the row's MBS 4 and GA 2 are the B200 row's)", window=GPT_OSS_WINDOW,
        note=MB_GPT_OSS_NOTE),
    Run("AutoModel Qwen3-30B-A3B, 8 H100", "recipes/published/automodel_qwen3_30b_a3b_4k_h100.toml", "h100", 12040.0,
        277.0, "unstated", "fused", "BF16", AM + "Qwen3 MoE 30B: EP8 FSDP8, GBS 512, MBS 4"),
    Run("AutoModel DeepSeek-V3, 256 H100", "recipes/published/automodel_deepseek_v3_4k_h100_256.toml", "h100", 1002.0,
        250.0, "unstated", "fused", "BF16", AM + "DeepSeek V3 671B, 256 GPUs: PP4 VP8 EP64 FSDP64, GBS 512"),
    Run("AutoModel DeepSeek-V3, 1,024 H100", "recipes/published/automodel_deepseek_v3_4k_h100_1024.toml", "h100", 865.0,
        216.0, "unstated", "fused", "BF16", AM + "DeepSeek V3 671B, 1024 GPUs: PP4 VP8 EP64 FSDP256, GBS 8192"),
    Run("AutoModel Kimi K2, 256 H100", "recipes/published/automodel_kimi_k2_4k_h100.toml", "h100", 924.0, 189.0,
        "unstated", "fused", "BF16", AM + "Kimi K2: PP8 VP4 EP32 FSDP32, GBS 512"),
    Run("AutoModel GPT-OSS 120B, 64 H100", "recipes/published/automodel_gpt_oss_120b_4k_h100.toml", "h100", 7626.0,
        231.0, "unstated", "fused", "BF16", AM + "GPT-OSS 120B: EP64 FSDP64, GBS 512, MBS 2", attention="flex",
        window=GPT_OSS_WINDOW, note=GPT_OSS_NOTE),
    Run("AutoModel GPT-OSS 20B, 8 H100", "recipes/published/automodel_gpt_oss_20b_4k_h100.toml", "h100", 13058.0,
        279.0, "unstated", "fused", "BF16",
        AM + "GPT-OSS 20B: EP8 FSDP8, GBS 256, MBS 2; its config as published checkpoints every block",
        attention="flex", window=GPT_OSS_WINDOW, note=GPT_OSS_NOTE),
]
