"""The closed sets of names a recipe may choose from, as `Literal` types.

Validation, `--print-config --docs` and the registries that implement each choice all read these
(tests/test_config.py asserts every registry's keys equal its Literal), so adding an attention
backend or a pipeline schedule means adding it here and to its registry, nowhere else.
"""

from __future__ import annotations

from typing import Literal, get_args

AttnBackend = Literal["auto", "reference", "torch", "cudnn", "flash_attn", "flash_attn4"]
AttentionKind = Literal["gqa", "mla", "v4"]  # v4: DeepSeek-V4's attention ([model.v4_attention])
RopeScaling = Literal["none", "yarn", "llama3"]
QkNorm = Literal["none", "head", "full"]
ScoreFunc = Literal["sigmoid", "softmax", "sqrtsoftplus"]  # sqrtsoftplus: sqrt(softplus(x)), DeepSeek-V4
GroupScore = Literal["top2_sum", "max"]
ResidualStream = Literal["plain", "mhc"]  # model.residual (moe_lc/model/residual_stream.py: RESIDUAL_STREAMS)
DropPolicy = Literal["probability", "position"]  # which over-capacity copies an expert drops (model/capacity.py)
PPSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbh1", "dualpipe", "dualpipev"]
ExpertDispatch = Literal["flat", "hierarchical"]
MlaRing = Literal["latent", "expanded"]
DsaStage = Literal["warmup", "sparse"]  # DeepSeek-V3.2's two training stages of sparse attention
CpLayout = Literal["zigzag", "balanced", "contiguous"]
PrecisionRecipe = Literal["fp32", "bf16", "fp8"]
Fp8Scaling = Literal["blockwise", "tensorwise", "delayed"]
Fp8Backend = Literal["auto", "emulate", "scaled_mm", "te"]
Fp8CacheItem = Literal["linear", "swiglu", "attn_out"]
AdamMoments = Literal["fp32", "bf16"]
GradPlacement = Literal["replicated", "sharded"]  # parallel.placement.grads: ZeRO-1's buffer, or ZeRO-2
ParamsPlacement = Literal["replicated", "sharded_gather"]  # parallel.placement.params: ZeRO-3 gathers per unit
OptimizerPlacement = Literal["device", "offloaded"]  # parallel.placement.optimizer: master and state on the host
MuonNsDtype = Literal["auto", "fp32", "bf16"]  # train.muon_ns_dtype: Newton-Schulz's matmul dtype
MuonNs = Literal["moonlight", "v4"]  # train.muon_ns: Newton-Schulz's iterations (moe_lc/optim/muon.py: NS_SCHEDULES)
Optimizer = Literal["adamw", "sgd", "muon"]  # update rules on ZeRO-1's shards (moe_lc/optim: RULES)
RecomputePolicy = Literal["none", "selective", "full"]
OffloadItem = Literal["attn_core", "expert_fc1", "experts"]  # train.offload (moe_lc/parallel/memory/offload.py)
RecomputeItem = Literal["norm", "swiglu", "attention", "mla_up", "router"]
LrSchedule = Literal["cosine", "wsd", "constant"]
Device = Literal["auto", "cpu", "cuda"]
DataSource = Literal["stdlib", "tokens", "synthetic"]
MixtureSource = Literal["tokens", "stdlib"]  # what one [[data.sources]] table reads
SyntheticTask = Literal["passkey", "multikey_needle", "variable_tracking", "associative_recall"]
Logger = Literal["tensorboard", "wandb"]


def names(choice) -> tuple[str, ...]:
    """The names of a Literal choice type, in declaration order."""
    return get_args(choice)
