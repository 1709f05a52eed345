"""Saved-activation bytes of one micro-batch: derived from the model code, and measured.

Legend: B micro-batch sequences, S local sequence length, T = B*S tokens, D model dim, H query heads,
K kv heads, Dh head dim, V vocabulary rows, E routed experts, k experts per token, F dense FFN hidden,
Fe routed-expert hidden, Fs = n_shared * Fe shared-expert hidden, c compute bytes (fp32 4, bf16 2).

What our block keeps for backward (read off the code, then checked against `measure_saved_bytes`
on the debug model, fp32 and bf16, exact to the byte), bytes per token:

    RMSNorm (x2 per block)  fp32 copy of its input 4D (in fp32 this *is* the input), rsqrt 4, x*rsqrt 4D
                            (+ a 4D fp32 copy of the weight per layer when c != 4)
    attention               normed input cD (saved by wqkv), qkv c(H+2K)Dh (v is a view of it),
                            roped q cH*Dh and k cK*Dh, out cH*Dh (also wo's input: the reshape is a
                            view), lse 4H.  RoPE multiplies by cos/sin, which need no saving.
    dense SwiGLU            normed input cD, gate|up c*2F, silu(gate) cF, product cF
    MoE                     normed input cD (+ 4D fp32 router input when c != 4), affinities 4E,
                            top-k ids 8k, gathered gates 4k, their sum 4, normalized gates ck,
                            dispatch ids 8k, sorted token copies ckD, expert SwiGLU c*4k*Fe, combine
                            ids 8k, combined copies ckD, shared SwiGLU c*4Fs (+ 8E per layer: counts);
                            weighted_swiglu: no combined copies nor normalized gates, but gate order
                            ids 8k, the SwiGLU's weight multiply ck + ckFe (selective "swiglu": fp32
                            gates 4k instead)
    no dropout; the fused attention keeps no S x S matrix (Korthikanti's 5as/h term is gone).

So in fp32 a dense block keeps 4*(7D + 2(H+K)Dh + (H+2K)Dh + H + 2 + 4F) bytes per token, and the loss
adds a 4V fp32 log-softmax per token (the logits themselves are not kept); with 16-bit logits the
loss keeps those (cV) and an fp32 log-sum-exp per token instead (moe_lc/model/transformer.py).

Recompute policies (moe_lc/model/recompute.py), also checked against measurement on the debug model:
    selective  drops the terms of its items: "norm" keeps each norm's input (cD) instead of its
               fp32 intermediates (the final norm too), "swiglu" keeps gate|up only, "attention"
               keeps q|k|v only (roped q, k and lse go; out stays, it is wo's input)
    full       the trainer runs blocks as phases and checkpoints each: a block keeps its phases'
               inputs: 2cD (dense) or 3cD + 2ckD + 4k (MoE: residual, normed input, sorted copies,
               expert outputs, fp32 gates); the head, loss and embedding are not recomputed.
    Not counted: the MoE routing handle a phased block keeps outside autograd (8k per token).

Every term has a tensor-parallel class: "seq" lives in the sequence-parallel region (divided by tp
with SP, replicated without), "heads" is cut by heads / hidden units / vocabulary (divided by tp),
"full" is whole on every tp rank: the input of a column-parallel Linear, saved after the sequence
all-gather (the one Linear saves what it multiplies), and replicated token ids and labels. Context
parallelism shortens S to S/cp for every term. The layout-specific terms (moe_lc/parallel/tensor.py
and context.py: vocab-parallel embedding and loss, the MoE router's sequence shard, ring attention's
contiguous v) were read off those files and are compared with measurement by tests/test_plan.py
(tp2, cp2, cp2 x tp2 on the debug model: equal to the byte).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from moe_lc.config import ModelConfig
from moe_lc.config.choices import RecomputePolicy, names

POLICIES = names(RecomputePolicy)
CHECKED = "checked against measurement (tests/test_plan.py)"
UNCHECKED = "formula, not yet checked against measurement"


@dataclass(frozen=True)
class Saved:
    """One tensor kept for backward: bytes per token, per sequence and per layer (constant)."""

    what: str
    per_token: float = 0.0
    tp: str = "seq"  # "seq" | "heads" | "full" (see the module docstring)
    dropped_by: str = ""  # the selective-recompute items that stop saving it ("a|b": either), e.g. "norm"
    kept_by: str = ""  # the items that make it saved (a replay's input; "a|b": either); else always
    per_seq: float = 0.0
    per_layer: float = 0.0
    fp8: str = ""  # the precision.fp8_cache item that keeps it in FP8 (see `_fp8_cached`)
    fp8_width: int = 0  # row width of its 1 x 128 tiles ("swiglu", "attn_out"); 0: a Linear's input
    fp8_unless: str = ""  # a selective item under which another part keeps it as is (no FP8 copy)
    fp8_copies: int = 1  # Linears that each keep their own FP8 copy of it


def _norm(name: str, D: int, c: int) -> list[Saved]:
    return [Saved(f"{name}: fp32 input", 4 * D, "seq", "norm"),
            Saved(f"{name}: rsqrt", 4, "seq", "norm"),
            Saved(f"{name}: x*rsqrt", 4 * D, "seq", "norm"),
            Saved(f"{name}: fp32 weight copy", per_layer=4 * D if c != 4 else 0, dropped_by="norm"),
            Saved(f"{name}: input (the replay's input)", c * D, "seq", kept_by="norm")]


def _swiglu(name: str, hidden: float, c: int, tp: str, row: int) -> list[Saved]:
    """A SwiGLU of `hidden` units per token (k rows of `row` units for routed experts)."""
    return [Saved(f"{name}: gate|up", 2 * c * hidden, tp, fp8="swiglu", fp8_width=2 * row),
            Saved(f"{name}: silu(gate)", c * hidden, tp, "swiglu"),
            Saved(f"{name}: silu*up (w2 input)", c * hidden, tp, "swiglu", fp8="linear")]


def _gqa_terms(m: ModelConfig, c: int, cp: int) -> list[Saved]:
    H, K, Dh = m.n_heads, m.n_kv_heads, m.head_size
    qkv = (Saved("attn: v (contiguous copy for the ring)", c * K * Dh, "heads") if cp > 1 else
           Saved("attn: qkv (v is a view)", c * (H + 2 * K) * Dh, "heads"))
    return [Saved("attn: normed input (wqkv input)", c * m.dim, "full", fp8="linear"), qkv,
            Saved("attn: roped q", c * H * Dh, "heads", "attention"),
            Saved("attn: roped k", c * K * Dh, "heads", "attention"),
            Saved("attn: out (and wo input)", c * H * Dh, "heads", fp8="attn_out", fp8_width=Dh),
            Saved("attn: lse", 4 * H, "heads", "attention")]


def _mla_terms(m: ModelConfig, c: int) -> list[Saved]:
    """MLA (moe_lc/model/mla.py), decompressed. The fused backends that pad the head dim to max(Dqk, Dv)
    hand out (and save) a D_v-wide copy (attention_backends.unpad_out), which wo reads as a view."""
    H, Cq, Ckv, Dr = m.n_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_rope_head_dim
    Dqk, Dv = m.mla.qk_nope_head_dim + Dr, m.mla.v_head_dim
    latent = ([Saved("mla: latents [c_q|c_kv|k_r] (fp32 norm inputs are views)", 4 * (Cq + Ckv + Dr), "full",
                     "norm|mla_up")]
              if c == 4 else [Saved("mla: fp32 copies of c_q, c_kv", 4 * (Cq + Ckv), "full", "norm|mla_up")])
    # recomputed latent norms (or "mla_up", which checkpoints everything from the latents) keep their
    # inputs, views of the latent [c_q | c_kv | k_r]: one storage
    # without q_lora, wa and wq both take the normed input: two FP8 copies of one tensor under "linear"
    terms = [Saved("attn: normed input (wa / wq input)", c * m.dim, "full", fp8="linear", fp8_copies=1 if Cq else 2),
             *latent,
             Saved("mla: latents (the latent norms' replay input)", c * (Cq + Ckv + Dr), "full", kept_by="norm|mla_up")]
    for name, C in (("q_norm", Cq), ("kv_norm", Ckv)):
        if C:
            terms += [Saved(f"mla {name}: rsqrt", 4, "full", "norm|mla_up"),
                      Saved(f"mla {name}: x*rsqrt", 4 * C, "full", "norm|mla_up"),
                      Saved(f"mla {name}: fp32 weight copy", per_layer=4 * C if c != 4 else 0, dropped_by="norm|mla_up"),
                      Saved(f"mla {name}: output (up-projection input)", c * C, "full", "mla_up", fp8="linear")]
    # Under selective "attention" the replay (mla.py `_rope_and_core`) keeps its inputs: q before RoPE
    # and the roped k_r; kv it keeps either way. Under "mla_up" (which takes MLA's place of "attention")
    # only the latents stay of the up-projections' side, and the core keeps its LSE (its forward is not
    # replayed); out is wo's input either way.
    terms += [Saved("mla: kv = [k_nope | v] (v is a view)", c * H * (m.mla.qk_nope_head_dim + Dv), "heads", "mla_up"),
              Saved("mla: q with roped part", c * H * Dqk, "heads", "attention|mla_up"),
              Saved("mla: k with shared roped part", c * H * Dqk, "heads", "attention|mla_up"),
              Saved("mla: out (and wo input, a view)", c * H * Dv, "heads", fp8="attn_out", fp8_width=Dv),
              Saved("attn: lse", 4 * H, "heads", "attention|mla_up"),
              Saved("attn: lse (kept under mla_up)", 4 * H, "heads", kept_by="mla_up"),
              Saved("mla: q before RoPE (replay input)", c * H * Dqk, "heads", "mla_up", kept_by="attention"),
              Saved("mla: roped k_r (replay input)", c * Dr, "full", "mla_up", kept_by="attention"),
              Saved("mla: q from wq (mla_up's input without q_lora)", 0 if Cq else c * H * Dqk, "heads",
                    kept_by="mla_up")]
    return terms


def block_terms(m: ModelConfig, layer_id: int, c: int, tp: int = 1, cp: int = 1) -> list[Saved]:
    """What block `layer_id` keeps for backward under recompute policy "none"."""
    D = m.dim
    attention = _mla_terms(m, c) if m.attention == "mla" else _gqa_terms(m, c, cp)
    terms = _norm("attn_norm", D, c) + attention + _norm("ffn_norm", D, c)
    if not (m.moe.n_routed_experts > 0 and layer_id >= m.moe.n_dense_layers):
        return terms + [Saved("ffn: normed input", c * D, "full", fp8="linear")] + _swiglu("dense ffn", m.ffn_dim, c, "heads", m.ffn_dim)
    k, E, Fe = m.moe.topk, m.moe.n_routed_experts, m.moe.ffn_dim
    # the shared experts' w13 keeps it in FP8 under "linear", unless the router's replay keeps it anyway
    terms.append(Saved("ffn: normed input", c * D, "full", fp8="linear" if m.moe.n_shared_experts else "",
                       fp8_unless="router"))
    terms += [
        # in fp32 without TP the router's input is the normed input itself; else a copy / the shard.
        # Selective "router" rebuilds the fp32 copy from its input: without TP the normed input the
        # experts keep anyway, under TP the sequence shard
        Saved("router: fp32 input (sequence shard)", 4 * D if c != 4 or tp > 1 else 0, dropped_by="router"),
        Saved("router: input (the upcast's replay input)", (4 * D if tp > 1 else 0) if c == 4 else (c * D if tp > 1 else 0),
              kept_by="router"),
        Saved("router: affinities", 4 * E),
        Saved("router: top-k ids", 8 * k),
        Saved("router: gathered gates + sum", 4 * k + 4),
        Saved("dispatch: ids", 8 * k),
        Saved("dispatch: sorted token copies", c * k * D, fp8="linear"),
        Saved("experts: counts", per_layer=8 * E),
        *_swiglu("routed experts", k * Fe, c, "seq", Fe),
        Saved("combine: ids", 8 * k),
    ]
    if m.moe.weighted_swiglu:  # the gates multiply the SwiGLU output; combine only sums
        terms += [Saved("dispatch: gate order ids", 8 * k),
                  Saved("routed experts: gates in the compute dtype", c * k, "seq", "swiglu"),
                  Saved("routed experts: unweighted silu*up", c * k * Fe, "seq", "swiglu"),
                  Saved("routed experts: fp32 gates (the replay's input)", 4 * k, "seq", kept_by="swiglu")]
    else:
        terms += [Saved("router: normalized gates", c * k),
                  Saved("combine: expert outputs in token order", c * k * D)]
    if m.moe.n_shared_experts:
        terms += _swiglu("shared experts", m.moe.n_shared_experts * Fe, c, "heads", m.moe.n_shared_experts * Fe)
    if m.moe.aux_loss_weight > 0:
        terms += [Saved("aux loss: affinity sums", 4), Saved("aux loss: f_e", per_seq=4 * E)]
    return terms


def model_terms(m: ModelConfig, c: int, micro_batch: int, seq_len: int, loss_mask: bool,
                tp: int = 1, cp: int = 1) -> dict[str, list[Saved]]:
    """Outside the blocks: token ids (embedding), RoPE tables, final norm + head + loss.
    seq_len is the local (cp shard) length."""
    head = _norm("final norm", m.dim, c) + [Saved("head: normed input", c * m.dim, "full")]
    if tp > 1:  # VocabParallelCrossEntropy: softmax of the vocab shard, label index, two masks
        head += [Saved("loss: fp32 softmax (vocab shard)", 4 * m.vocab_size, "heads"),
                 Saved("loss: label index + hit/valid masks", 8 + 1 + 1, "full")]
        embed = [Saved("vocab-parallel ids + outside mask", 8 + 1, "full")]
    else:
        head += [_loss_saved("loss", m.vocab_size, c),
                 # tokens[:, 1:] is a view when B = 1; the zig-zag shard is a copy
                 Saved("loss: labels copy", 8 if micro_batch > 1 or cp > 1 else 0, "full"),
                 Saved("loss: total weight", per_layer=4)]
        # the trainer's inputs are a view of the (B, S+1) tokens; zig-zag shards are (B, S/cp) copies
        embed = [Saved("token ids", 8, "full", per_seq=8 if cp == 1 else 0)]
    if loss_mask:
        head.append(Saved("loss: mask", 4, "full"))
    for d in range(m.mtp.depth):
        head += _mtp_terms(m, d, c, tp, cp)
    return {"embed": embed, "rope": [Saved("cos, sin tables", per_layer=4 * seq_len * m.rope_dim)], "head": head}


def _mtp_terms(m: ModelConfig, d: int, c: int, tp: int, cp: int) -> list[Saved]:
    """Multi-token prediction module d (moe_lc/model/mtp.py): two norms, the [h; emb] projection, one
    block, a norm, the shared head and its loss. Per depth, the token ids, labels and mask add 20
    bytes per token (views of the (B, D, S) targets or copies of their slices)."""
    D = m.dim
    h_input = 0 if d == 0 and c == 4 else 4 * D  # depth 0 normalizes h, which the final norm already keeps
    hnorm = _norm(f"mtp{d} hnorm", D, c)[1:]
    if d == 0:  # its replay input is h, which the final norm's replay keeps already
        hnorm[-1] = replace(hnorm[-1], what=f"{hnorm[-1].what}: the final norm's", per_token=0)
    terms = [Saved(f"mtp{d} hnorm: fp32 input", h_input, "seq", "norm")] + hnorm
    terms += [Saved(f"mtp{d} embedding output / enorm fp32 input", 4 * D, "seq", "norm")] + _norm(f"mtp{d} enorm", D, c)[1:]
    terms += [Saved(f"mtp{d}: [h; emb] (eh_proj input)", 2 * c * D, "seq", fp8="linear")]
    terms += block_terms(m, m.n_layers + d, c, tp, cp)
    terms += _norm(f"mtp{d} norm", D, c) + [Saved(f"mtp{d}: head input", c * D, "full")]
    loss = Saved(f"mtp{d}: fp32 softmax (vocab shard)", 4 * m.vocab_size, "heads") if tp > 1 else \
        _loss_saved(f"mtp{d}", m.vocab_size, c)
    terms += [loss, Saved(f"mtp{d}: ids, labels, mask", 20, "full"),
              Saved(f"mtp{d}: total weight", per_layer=4)]
    return terms


def _loss_saved(name: str, V: int, c: int) -> Saved:
    """What the cross-entropy of one head keeps per token (without TP): fp32 logits' log-softmax, or
    16-bit logits and their fp32 log-sum-exp."""
    if c == 4:
        return Saved(f"{name}: fp32 log-softmax", 4 * V, "heads")
    return Saved(f"{name}: logits (compute dtype) + fp32 log-sum-exp", c * V + 4, "heads")


def _tp_factor(term: Saved, tp: int, sequence_parallel: bool) -> float:
    if term.tp == "heads" or (term.tp == "seq" and sequence_parallel):
        return 1.0 / tp
    return 1.0


def _phase_inputs(m: ModelConfig, layer_id: int, c: int) -> list[Saved]:
    """What full recomputation keeps of a block: the inputs of each of its phases (the trainer runs
    blocks as phases, `Block.phases`, and checkpoints each phase): the residual stream before
    attention and before the FFN; for MoE also the normed input, the sorted token copies, the expert
    outputs and the fp32 gate weights that the experts and combine phases take."""
    kept = [Saved("full: attention-phase input", c * m.dim, "seq"), Saved("full: ffn-phase input", c * m.dim, "seq")]
    if m.moe.n_routed_experts > 0 and layer_id >= m.moe.n_dense_layers:
        kept += [Saved("full: normed input (carried to the shared experts)", c * m.dim),
                 Saved("full: sorted token copies (experts-phase input)", c * m.moe.topk * m.dim),
                 Saved("full: expert outputs (combine-phase input)", c * m.moe.topk * m.dim),
                 Saved("full: gate weights (fp32)", 4 * m.moe.topk)]
    return kept


def _apply_policy(terms: list[Saved], m: ModelConfig, c: int, policy: str, selective, layer_id=None,
                  fp8_cache=()) -> list[Saved]:
    """Terms kept under a recompute policy and FP8 caching (`layer_id` None: the terms outside the blocks).
    FP8 caching of "swiglu" keeps what selective "swiglu" keeps, in FP8."""
    if "swiglu" in fp8_cache and policy != "full":
        policy, selective = "selective", (*(selective if policy == "selective" else ()), "swiglu")
    if fp8_cache:
        return _fp8_cached(_apply_policy(terms, m, c, policy, selective, layer_id), c, fp8_cache, selective)
    return _recompute_policy(terms, m, c, policy, selective, layer_id)


def _recompute_policy(terms: list[Saved], m: ModelConfig, c: int, policy: str, selective, layer_id) -> list[Saved]:
    if policy != "selective":
        terms = [t for t in terms if not t.kept_by]
    if policy == "none":
        return terms
    if policy == "full":
        return terms if layer_id is None else _phase_inputs(m, layer_id, c)
    chosen = set(selective)
    return [t for t in terms if not chosen & set(t.dropped_by.split("|"))
            and (not t.kept_by or chosen & set(t.kept_by.split("|")))]


def _fp8_cached(terms: list[Saved], c: int, cache, items) -> list[Saved]:
    """The terms under `precision.fp8_cache` (moe_lc/model/fp8_cache.py): a Linear's input kept as its
    weight gradient quantizes it (FP8, and an fp32 scale per 128 tokens of each column), gate|up and the
    attention output as 1 x 128 tiles of rows `fp8_width` wide (FP8, and an fp32 scale per tile)."""
    out = []
    for t in terms:
        if t.fp8 in cache and not (t.fp8_unless and t.fp8_unless in items):
            elems = t.per_token / c
            tiles = elems / 128 if not t.fp8_width else elems / t.fp8_width * -(-t.fp8_width // 128)
            t = replace(t, what=f"{t.what} [fp8 {t.fp8}]", per_token=t.fp8_copies * (elems + 4 * tiles))
        out.append(t)
    return out


def _bytes(terms: list[Saved], tokens: int, seqs: int, tp: int, sp: bool) -> float:
    return sum((t.per_token * tokens + t.per_seq * seqs) * _tp_factor(t, tp, sp) + t.per_layer for t in terms)


@dataclass
class ActivationEstimate:
    """Saved-activation bytes of one micro-batch on one rank (one pipeline stage)."""

    layers: dict[int, float]
    embed: float
    rope: float
    head: float
    recompute_working: float  # transient upper bound: one block's dropped terms, re-created in backward
    status: str
    terms: dict[str, list[Saved]] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.layers.values()) + self.embed + self.rope + self.head


def estimate(m: ModelConfig, micro_batch: int, seq_len: int, compute_bytes: int, *, policy: str = "none",
             selective=("norm", "swiglu"), tp: int = 1, sequence_parallel: bool = True, cp: int = 1,
             loss_mask: bool = False, layers=None, first_stage: bool = True,
             last_stage: bool = True, fp8_cache=()) -> ActivationEstimate:
    """Saved bytes per layer and outside the layers for one micro-batch (see the module docstring).

    seq_len is the full sequence; cp divides it. `layers` are the block ids on this rank (default all).
    `fp8_cache`: the precision.fp8_cache items.
    """
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r} must be one of {', '.join(POLICIES)}")
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp={cp}")
    c, S = compute_bytes, seq_len // cp
    tokens = micro_batch * S
    layers = range(m.n_layers) if layers is None else layers
    per_layer, working = {}, 0.0
    for i in layers:
        full = block_terms(m, i, c, tp, cp)
        kept = _apply_policy(full, m, c, policy, selective, i, fp8_cache)
        per_layer[i] = _bytes(kept, tokens, micro_batch, tp, sequence_parallel)
        # what backward re-creates: the dropped terms, not the FP8 copies' savings
        unshrunk = [t for t in full if t.what in {k.what.split(" [fp8")[0] for k in kept}]
        working = max(working, _bytes(full, tokens, micro_batch, tp, sequence_parallel)
                      - _bytes(unshrunk, tokens, micro_batch, tp, sequence_parallel))
    outside = {k: _apply_policy(v, m, c, policy, selective, fp8_cache=fp8_cache)
               for k, v in model_terms(m, c, micro_batch, S, loss_mask, tp, cp).items()}
    part = {k: _bytes(v, tokens, micro_batch, tp, sequence_parallel) for k, v in outside.items()}
    # measured (tests/test_plan.py): every policy on GQA blocks without MTP at tp = cp = 1; policy
    # "none" also with MLA + MTP at tp = cp = 1, and on GQA under tp2, cp2 and cp2 x tp2
    gqa = m.attention != "mla" and not m.mtp.depth
    checked = (tp == 1 and cp == 1 and (policy == "none" or gqa)) or (policy == "none" and gqa)
    return ActivationEstimate(per_layer, part["embed"] if first_stage else 0.0, part["rope"],
                              part["head"] if last_stage else 0.0, working, CHECKED if checked else UNCHECKED,
                              {"block": block_terms(m, max(layers, default=0), c, tp, cp), **outside})


# ---------------------------------------------------------------------------------------------
# measurement


@contextlib.contextmanager
def held_checkpoint_inputs(callback: Callable[[torch.Tensor], None]):
    """Inside: callback(t) for every tensor input of a non-reentrant checkpoint (recomputation), which
    keeps its inputs in a closure rather than through saved-tensor hooks (whose own hooks also hide
    what runs inside it). The tools that count saved activations (here, tools/dry_trace.py) use it."""
    generator = getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None)
    if generator is None:
        yield
        return

    def held(fn, *args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                callback(a)
        return generator(fn, *args, **kwargs)

    torch_checkpoint._checkpoint_without_reentrant_generator = held
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = generator


def measure_saved_bytes(model: nn.Module, forward: Callable[[], object]) -> dict[str, int]:
    """Run `forward()` (which calls `model`) under saved-tensor hooks and count the unique storage
    bytes autograd keeps, parameters excluded, plus the inputs held by non-reentrant checkpoints
    (recomputation). Each storage is attributed to the part that saved it first: "layer<i>"
    (model.layers[i]), "rope" (the cos/sin tables), "embed" (before the first block), "head" (final
    norm, head and loss); a checkpointed call's inputs are claimed by the part whose module it runs first. Returns {part: bytes}."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owner: dict[int, tuple[str, int]] = {}
    where = ["embed"]

    pending: list[torch.Tensor] = []  # checkpoint inputs, claimed by the first module the checkpoint runs

    def enter(part: str):
        def hook(*args):
            where[0] = part
            while pending:
                claim(pending.pop(), part)
        return hook

    # Every module of block i marks "layer<i>" when it runs, so the tagging does not depend on how the
    # model sequences its blocks (plain calls or pipeline phases).
    parts = [(f"layer{name}", blk) for name, blk in model.layers.items()]
    parts += [("head", mod) for mod in (getattr(model, "norm", None), getattr(model, "head", None),
                                       getattr(model, "loss_fn", None)) if mod is not None]
    handles = [sub.register_forward_pre_hook(enter(part)) for part, mod in parts for sub in mod.modules()]

    def claim(t: torch.Tensor, part: str) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in params:
            owner.setdefault(storage.data_ptr(), (part, storage.nbytes()))

    def claim_rope(module, args, out) -> None:
        for t in out:
            claim(t, "rope")

    if getattr(model, "rope", None) is not None:
        handles.append(model.rope.register_forward_hook(claim_rope))

    def pack(t: torch.Tensor) -> torch.Tensor:
        # the checkpoint saves its own inputs (under our hook) before it runs: leave those to `enter`
        if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in pending):
            claim(t, where[0])
        return t

    try:
        with held_checkpoint_inputs(pending.append), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        for t in pending:
            claim(t, where[0])
    finally:
        for h in handles:
            h.remove()
    totals: dict[str, int] = {}
    for part, nbytes in owner.values():
        totals[part] = totals.get(part, 0) + nbytes
    return totals
