"""Model sections of a recipe: [model] holds the shape every block shares; its components read their
own sub-tables: [model.moe] (router and experts), [model.rope] (RoPE / YaRN), [model.mla] (latent
attention), [model.dsa] (its sparse variant), [model.v4_attention] (DeepSeek-V4's attention), [model.mtp]
(multi-token prediction) and [model.mhc]
(DeepSeek-V4's widened residual stream, read when model.residual = "mhc"). Choices are `Literal` types from `choices.py`;
the field helpers are in `fields.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lc.config.attention_kinds import attention_kind
from moe_lc.config.choices import (AttentionKind, AttnBackend, DropPolicy, DsaStage, GroupScore, QkNorm, ResidualStream,
                                   RopeScaling, ScoreFunc, names)
from moe_lc.config.fields import f, non_negative, positive
from moe_lc.config.v4_attention import V4AttentionConfig

# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class MoEConfig:
    """[model.moe]: shared + fine-grained routed experts, group-limited routing, load balancing."""

    n_dense_layers: int = f(1, "the first n_dense_layers blocks use the dense SwiGLU (model.ffn_dim), the rest MoE")
    n_routed_experts: int = f(8, "fine-grained routed experts per MoE layer (0 = a dense model)")
    n_shared_experts: int = f(1, "always-active shared experts per MoE layer")
    ffn_dim: int = f(128, "hidden width of each routed (and shared) expert")
    topk: int = f(2, "routed experts per token")
    n_groups: int = f(4, "expert groups (map to nodes under EP); divides n_routed_experts")
    topk_groups: int = f(2, "groups a token may use (node-limited routing); <= n_groups")
    score_func: ScoreFunc = f("sigmoid", "router affinity: sigmoid (V3), softmax, or sqrt(softplus) (V4)")
    group_score: GroupScore = f("top2_sum", "a group's score: the sum of its top-2 affinities (DeepSeek-V3) or its best one (V2)")
    norm_topk_prob: bool = f(True, "renormalize the top-k affinities to sum to 1 (DeepSeek-V3; V2 does not)")
    routed_scaling_factor: float = f(1.0, "gate weights are the (normalized) top-k affinities times this")
    bias_update_speed: float = f(1e-3, "aux-loss-free balancing: bias step per optimizer step (0 = off)")
    aux_loss_weight: float = f(0.0, "weight of the sequence-wise balance loss (0 = off)")
    z_loss_weight: float = f(0.0, "router z-loss weight (ST-MoE): mean over the step's tokens of logsumexp(logits)^2 "
                                  "(0 = off)")
    global_aux_loss_weight: float = f(0.0, "global-batch balance loss weight (Qwen3-MoE): E * sum_e f_e * P_e with f "
                                           "counted over the micro-batch of every data-parallel rank (0 = off)")
    capacity_factor: float = f(0.0, "expert capacity ceil(factor * T * topk / E) per expert, T = the tokens one "
                                    "router call sees (a micro-batch's shard); copies over it are dropped (0 = off)")
    drop_policy: DropPolicy = f("probability", "which copies an over-capacity expert drops: the lowest affinity "
                                               "('probability') or the latest tokens ('position')")
    weighted_swiglu: bool = f(False, "gate weights multiply each expert's SwiGLU output before its down projection "
                                     "(the same function; combine then only sums and saves no expert outputs)")
    shared_ffn_dim: int = f(0, "hidden width of the shared expert(s) together; 0 = n_shared_experts * ffn_dim "
                               "(Qwen2-MoE: shared_expert_intermediate_size)")
    shared_expert_gate: bool = f(False, "scale the shared experts' output per token by sigmoid(x w^T), w: (1, dim) "
                                        "(Qwen2-MoE's shared_expert_gate)")
    swiglu_limit: float = f(0.0, "clamp the routed and shared experts' SwiGLU inputs: gate to <= L, up to [-L, L] "
                                 "(DeepSeek-V4: 10); 0 = off")
    hash_layers: int = f(0, "the first N MoE layers choose their experts by a fixed token-id table tid2eid (V4's "
                            "hash routing: 3); the gate still weighs the chosen experts")
    hash_seed: int = f(0, "seed of the tid2eid tables built for training from scratch (each token's topk distinct "
                          "experts drawn uniformly, one table per hash layer); a checkpoint's tables replace them")

    @property
    def shared_hidden(self) -> int:
        """Hidden width of the shared SwiGLU (0: no shared experts)."""
        return (self.shared_ffn_dim or self.n_shared_experts * self.ffn_dim) if self.n_shared_experts else 0

    def errors(self, n_layers: int) -> list[str]:
        e, p = [], "model.moe"
        if not 0 <= self.n_dense_layers <= n_layers:
            e.append(f"{p}.n_dense_layers={self.n_dense_layers} must lie in [0, model.n_layers={n_layers}]")
        non_negative(e, f"{p}.n_routed_experts", self.n_routed_experts)
        non_negative(e, f"{p}.n_shared_experts", self.n_shared_experts)
        non_negative(e, f"{p}.bias_update_speed", self.bias_update_speed)
        for name in ("swiglu_limit", "hash_layers", "hash_seed", "aux_loss_weight", "z_loss_weight",
                     "global_aux_loss_weight", "capacity_factor", "shared_ffn_dim"):
            non_negative(e, f"{p}.{name}", getattr(self, name))
        for key, on in ((f"shared_ffn_dim={self.shared_ffn_dim}", self.shared_ffn_dim),
                        ("shared_expert_gate = true", self.shared_expert_gate)):
            if on and not self.n_shared_experts:
                e.append(f"{p}.{key} needs {p}.n_shared_experts >= 1 (there is no shared expert)")
        positive(e, f"{p}.routed_scaling_factor", self.routed_scaling_factor)
        if self.hash_layers and (self.n_routed_experts <= 0 or self.n_dense_layers >= n_layers):
            e.append(f"{p}.hash_layers={self.hash_layers} needs MoE layers (n_routed_experts > 0, n_dense_layers "
                     "< model.n_layers)")
        if self.n_routed_experts <= 0 or self.n_dense_layers >= n_layers:
            return e
        positive(e, f"{p}.ffn_dim", self.ffn_dim)
        E = self.n_routed_experts
        if self.hash_layers > n_layers - self.n_dense_layers:
            e.append(f"{p}.hash_layers={self.hash_layers} exceeds the {n_layers - self.n_dense_layers} MoE layers "
                     f"(model.n_layers={n_layers} - n_dense_layers={self.n_dense_layers})")
        if not 1 <= self.topk <= E:
            e.append(f"{p}.topk={self.topk} must lie in [1, n_routed_experts={E}]")
        if self.n_groups < 1 or E % self.n_groups:
            e.append(f"{p}.n_groups={self.n_groups} must divide {p}.n_routed_experts={E}")
        elif not 1 <= self.topk_groups <= self.n_groups:
            e.append(f"{p}.topk_groups={self.topk_groups} must lie in [1, n_groups={self.n_groups}]")
        elif self.topk > self.topk_groups * (E // self.n_groups):
            e.append(f"{p}.topk={self.topk} exceeds the experts in topk_groups={self.topk_groups} groups of "
                     f"{E // self.n_groups}")
        elif self.n_groups > 1 and E // self.n_groups < 2 and self.group_score == "top2_sum":
            e.append(f"{p}.n_groups={self.n_groups}: each group needs >= 2 experts (group score = top-2 sum)")
        return e


@dataclass(frozen=True)
class RopeConfig:
    """[model.rope]: rotary position embedding and its YaRN extension."""

    theta: float = f(10000.0, "RoPE base b (theta_i = b^(-2i/d))")
    scaling: RopeScaling = f("none", "long-context extension of the frequencies")
    factor: float = f(1.0, "YaRN scale factor s (e.g. 32 for 4K -> 128K)")
    original_seq_len: int = f(4096, "YaRN: context length L the model was pre-trained at")
    beta_fast: float = f(32.0, "YaRN: dims with more than beta_fast rotations in L keep theta_i")
    beta_slow: float = f(1.0, "YaRN: dims with fewer than beta_slow rotations in L use theta_i/s")
    truncate: bool = f(True, "YaRN: round the correction range to whole dims (floor / ceil), as the official code")
    mscale: float = f(1.0, "YaRN: cos/sin factor m(s, mscale) / m(s, mscale_all_dim), m(s, x) = 0.1 x ln(s) + 1")
    mscale_all_dim: float = f(0.0, "YaRN: 0 = cos/sin factor m(s, 1); MLA multiplies its softmax scale by m(s, this)^2")
    low_freq_factor: float = f(1.0, "llama3: wavelengths above original_seq_len / this are divided by factor")
    high_freq_factor: float = f(4.0, "llama3: wavelengths below original_seq_len / this keep theta_i; between, a ramp")
    partial_rotary_factor: float = f(1.0, "GQA: rotate the first int(head_dim * this) dims of each q/k head, pass "
                                          "the rest through (GLM-4.5: 0.5)")

    def errors(self) -> list[str]:
        e = []
        positive(e, "model.rope.theta", self.theta)
        if self.scaling == "yarn":
            if self.factor < 1:
                e.append(f"model.rope.factor={self.factor} must be >= 1 with rope.scaling = 'yarn'")
            if not self.beta_fast > self.beta_slow:
                e.append(f"model.rope.beta_fast={self.beta_fast} must exceed rope.beta_slow={self.beta_slow}")
            positive(e, "model.rope.original_seq_len", self.original_seq_len)
        if self.scaling == "llama3":
            if self.factor < 1:
                e.append(f"model.rope.factor={self.factor} must be >= 1 with rope.scaling = 'llama3'")
            positive(e, "model.rope.low_freq_factor", self.low_freq_factor)
            if not self.high_freq_factor > self.low_freq_factor:
                e.append(f"model.rope.high_freq_factor={self.high_freq_factor} must exceed "
                         f"rope.low_freq_factor={self.low_freq_factor}")
            positive(e, "model.rope.original_seq_len", self.original_seq_len)
        if not 0 < self.partial_rotary_factor <= 1:
            e.append(f"model.rope.partial_rotary_factor={self.partial_rotary_factor} must lie in (0, 1]")
        return e


@dataclass(frozen=True)
class MLAConfig:
    """[model.mla]: multi-head latent attention (DeepSeek-V2/V3), read when model.attention = 'mla'."""

    q_lora_rank: int = f(0, "query latent rank (0 = project queries straight from x)")
    kv_lora_rank: int = f(0, "key/value latent rank")
    qk_nope_head_dim: int = f(0, "per-head query/key dims without RoPE")
    qk_rope_head_dim: int = f(0, "decoupled RoPE dims (one rotated key shared by all heads)")
    v_head_dim: int = f(0, "per-head value dim")

    def errors(self) -> list[str]:
        e = []
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            positive(e, f"model.mla.{name}", getattr(self, name))
        non_negative(e, "model.mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            e.append(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        return e


@dataclass(frozen=True)
class DSAConfig:
    """[model.dsa]: DeepSeek Sparse Attention (DeepSeek-V3.2) on MLA: a lightning indexer scores every earlier
    token per query and the attention keeps the top index_topk."""

    enabled: bool = f(False, "add the lightning indexer to every MLA layer (model.attention = 'mla')")
    stage: DsaStage = f("sparse", "'warmup': dense attention, only the indexer trains (KL to the attention); "
                                  "'sparse': top-k attention, everything trains (the indexer on the KL over its "
                                  "selection)")
    index_topk: int = f(2048, "keys each query attends to (all it sees when fewer)")
    index_n_heads: int = f(64, "indexer heads")
    index_head_dim: int = f(128, "indexer head dim (RoPE on its first mla.qk_rope_head_dim dims)")
    indexer_lr: float = f(0.0, "the indexer's learning rate (0 = train.lr); the report's warm-up uses 1e-3")

    def errors(self, mla: MLAConfig) -> list[str]:
        e, p = [], "model.dsa"
        if not self.enabled:
            return e
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            positive(e, f"{p}.{name}", getattr(self, name))
        non_negative(e, f"{p}.indexer_lr", self.indexer_lr)
        if mla.q_lora_rank <= 0:
            e.append(f"{p}.enabled = true needs model.mla.q_lora_rank > 0 (the indexer's queries come from the "
                     "query latent)")
        if self.index_head_dim < mla.qk_rope_head_dim:
            e.append(f"{p}.index_head_dim={self.index_head_dim} must be >= model.mla.qk_rope_head_dim="
                     f"{mla.qk_rope_head_dim} (RoPE on its first dims)")
        return e


@dataclass(frozen=True)
class MTPConfig:
    """[model.mtp]: multi-token prediction (DeepSeek-V3)."""

    depth: int = f(0, "prediction modules (0 = off); module d predicts token t+1+d")
    loss_weight: float = f(0.3, "weight lambda of the MTP loss: lambda / depth * sum of module losses")

    def errors(self) -> list[str]:
        e = []
        non_negative(e, "model.mtp.depth", self.depth)
        non_negative(e, "model.mtp.loss_weight", self.loss_weight)
        return e


@dataclass(frozen=True)
class MHCConfig:
    """[model.mhc]: manifold-constrained hyper-connections (DeepSeek-V4, arXiv 2606.19348 section 2.2), read when
    model.residual = "mhc": the residual stream widened to hc_mult copies, mixed around every attention and FFN
    by input-dependent maps, the residual map projected onto doubly stochastic matrices."""

    hc_mult: int = f(4, "residual streams n_hc (V4: 4)")
    sinkhorn_iters: int = f(20, "Sinkhorn-Knopp iterations t_max of the residual map's projection (V4: 20)")
    eps: float = f(1e-6, "floor added to the pre and residual maps and to Sinkhorn-Knopp's sums (V4's hc_eps)")

    def errors(self) -> list[str]:
        e = []
        for name in ("hc_mult", "sinkhorn_iters", "eps"):
            positive(e, f"model.mhc.{name}", getattr(self, name))
        return e


@dataclass(frozen=True)
class ModelConfig:
    """[model]: shape of the decoder-only MoE transformer (DeepSeek-style)."""

    vocab_size: int = f(512, "embedding rows; >= the tokenizer's vocabulary (padded for TP)")
    dim: int = f(128, "model width (hidden size)")
    n_layers: int = f(4, "transformer blocks")
    n_heads: int = f(4, "query heads")
    n_kv_heads: int = f(2, "key/value heads (grouped-query attention); divides n_heads")
    head_dim: int = f(0, "per-head width; 0 means dim // n_heads")
    ffn_dim: int = f(512, "hidden width of the dense SwiGLU FFN (the first moe.n_dense_layers blocks)")
    norm_eps: float = f(1e-6, "RMSNorm epsilon")
    init_std: float = f(0.02, "std of the normal init of weights (output projections scaled by depth)")
    attention: AttentionKind = f("gqa", "grouped-query, multi-head latent attention ([model.mla]), or DeepSeek-V4's "
                                        "per-layer-type attention ([model.v4_attention])")
    attn_backend: AttnBackend = f("auto", "attention kernel; auto = the fastest usable on the device")
    qkv_bias: bool = f(False, "biases on the q, k, v projections (Qwen2); GQA only")
    qk_norm: QkNorm = f("none", "GQA: RMSNorm of q and k before RoPE; 'head': over each head's dims, one weight "
                                "(head_dim,) for all heads (Qwen3, GLM-4.5); 'full': over the whole q and k "
                                "projection outputs (OLMoE)")
    attn_out_bias: bool = f(False, "a bias on the attention output projection wo (transformers' attention_bias "
                                   "in Llama, Qwen3, OLMoE covers it and q, k, v)")
    tie_embeddings: bool = f(False, "one parameter serves the embedding and the output head (transformers' "
                                    "tie_word_embeddings: Qwen3-0.6B, Llama-3.2-1B); under a pipeline whose first "
                                    "and last stages are on different ranks both hold it and sum its gradient over "
                                    "the pp_tie group")
    moe: MoEConfig = f(MoEConfig(), "[model.moe]")
    rope: RopeConfig = f(RopeConfig(), "[model.rope]")
    mla: MLAConfig = f(MLAConfig(), "[model.mla]")
    dsa: DSAConfig = f(DSAConfig(), "[model.dsa] (with attention = 'mla')")
    v4_attention: V4AttentionConfig = f(V4AttentionConfig(), "[model.v4_attention] (with attention = 'v4')")
    mtp: MTPConfig = f(MTPConfig(), "[model.mtp]")
    residual: ResidualStream = f("plain", "the residual stream: plain x + f(norm(x)), or DeepSeek-V4's mHC "
                                          "([model.mhc], moe_lc/model/residual_stream.py)")
    mhc: MHCConfig = f(MHCConfig(), "[model.mhc] (with residual = 'mhc')")

    @property
    def head_size(self) -> int:
        return self.head_dim or (self.dim // self.n_heads if self.n_heads > 0 else 0)

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head (MLA: nope + rope dims); the attention kind's (config/attention_kinds.py)."""
        return attention_kind(self).head_dims(self)[0]

    @property
    def value_head_dim(self) -> int:
        return attention_kind(self).head_dims(self)[1]

    @property
    def rope_dim(self) -> int:
        """Rotated dims per head (MLA rotates only its decoupled part; GQA its first partial_rotary_factor)."""
        return attention_kind(self).head_dims(self)[2]

    @property
    def has_moe(self) -> bool:
        return self.moe.n_routed_experts > 0 and self.moe.n_dense_layers < self.n_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe.n_routed_experts > 0 and layer_id >= self.moe.n_dense_layers

    def is_hash_layer(self, layer_id: int) -> bool:
        """The first moe.hash_layers MoE layers route by token id (an MTP module's block never does)."""
        return self.is_moe_layer(layer_id) and layer_id < min(self.moe.n_dense_layers + self.moe.hash_layers,
                                                               self.n_layers)  # (MTP blocks: id >= n_layers)

    @property
    def n_moe_layers(self) -> int:
        return max(self.n_layers - self.moe.n_dense_layers, 0) if self.moe.n_routed_experts else 0

    def errors(self) -> list[str]:
        e = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "init_std"):
            positive(e, f"model.{name}", getattr(self, name))
        if self.attention in names(AttentionKind):  # else the choice rule names it
            e += attention_kind(self).errors(self)
        e += self.mhc.errors() if self.residual == "mhc" else []
        return e + self.moe.errors(self.n_layers) + self.rope.errors() + self.mtp.errors()
