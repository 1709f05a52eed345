"""Which Hugging Face tensor goes where in our model: one table of `Piece`s, read both ways.

A piece is one HF tensor (or a column range of one) placed as a rectangular box of one of our full
tensors. Fused weights of ours are several pieces: `wqkv` = q | k | v rows, `w13` = gate | up rows,
MLA's `wa` = q_a_proj | kv_a_proj_with_mqa rows; stacked experts are one piece per expert at
offset (e, 0, 0) (Mixtral names its MoE block `block_sparse_moe` and an expert's gate / up / down
w1 / w3 / w2; the others `mlp` and gate_proj / up_proj / down_proj). `from_hf` fills boxes from
pieces, `to_hf` cuts pieces out of boxes, so the two directions cannot disagree.

Conventions that differ, and why we convert instead of matching them at run time:
  - DeepSeek checkpoints store the decoupled RoPE dims of q_b_proj / q_proj and kv_a_proj_with_mqa
    interleaved, pairs (x0, x1), (x2, x3), ... (their inference code rotates them as complex
    numbers; transformers' DeepseekV2 does the same and DeepseekV3 de-interleaves when
    `rope_interleave`). Our RoPE rotates (x_j, x_{j+d/2}), so those rows are permuted to
    [0, 2, 4, ..., 1, 3, 5, ...] once at conversion: q.k is unchanged, no per-step shuffle.
  - The MTP projection of DeepSeek-V3 checkpoints reads [enorm(embedding); hnorm(hidden)]; ours
    follows the paper's order [hnorm(hidden); enorm(embedding)] (eq. 21), so eh_proj's halves swap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lc.config import ModelConfig
from moe_lc.config.attention_kinds import attention_kind, load


@dataclass(frozen=True)
class Piece:
    """HF tensor `theirs` (shape `shape`) -> the box of our tensor `ours` starting at `offset`."""

    ours: str
    offset: tuple[int, ...]
    theirs: str
    shape: tuple[int, ...]                 # of the HF tensor (before taking `cols`)
    cols: tuple[int, int] | None = None    # only these columns of theirs form the box
    rope: tuple[int, int] | None = None    # (row block, first rope row in a block): de-interleave those rows
    expert: bool = False                   # theirs is one expert: a (1, *shape) slab of our stacked tensor
    view: tuple[int, ...] | None = None    # theirs viewed as this shape is the box (V4's wo_a: (G R, c) -> (G, R, c))

    def box_shape(self) -> tuple[int, ...]:
        if self.view is not None:
            return self.view
        shape = list(self.shape)
        if self.cols is not None:
            shape[-1] = self.cols[1] - self.cols[0]
        return (1, *shape) if self.expert else tuple(shape)


def _rope_order(rows: int, block: int, start: int, rope_dim: int) -> torch.Tensor:
    """Row index: ours[i] = theirs[order[i]], de-interleaving rope rows [start, start+rope_dim) of each block."""
    order = torch.arange(rows)
    deinterleave = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    for base in range(0, rows, block):
        order[base + start: base + start + rope_dim] = base + start + deinterleave
    return order


def to_ours(piece: Piece, theirs: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The box data of `piece` from the HF tensor."""
    t = theirs
    if piece.cols is not None:
        t = t[:, piece.cols[0]:piece.cols[1]]
    if piece.rope is not None:
        t = t[_rope_order(t.shape[0], *piece.rope, rope_dim)]
    if piece.view is not None:
        return t.view(piece.view)
    return t.unsqueeze(0) if piece.expert else t


def to_theirs(piece: Piece, box: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Inverse of `to_ours`: the HF tensor's part (all of it, or its `cols`) from our box."""
    t = box.squeeze(0) if piece.expert else box
    if piece.view is not None:
        t = t.reshape(piece.shape)
    if piece.rope is not None:
        out = torch.empty_like(t)
        out[_rope_order(t.shape[0], *piece.rope, rope_dim)] = t
        t = out
    return t


def stacked_rows(ours: str, parts: list[tuple[str, tuple[int, ...]]], **kw) -> list[Piece]:
    """Pieces stacked along rows of `ours` in the order given."""
    out, row = [], 0
    for theirs, shape in parts:
        out.append(Piece(ours, (row,) + (0,) * (len(shape) - 1), theirs, shape, **kw.get(theirs, {})))
        row += shape[0]
    return out


def _swiglu(ours: str, theirs: str, hidden: int, dim: int) -> list[Piece]:
    return (stacked_rows(f"{ours}.w13.weight", [(f"{theirs}.gate_proj.weight", (hidden, dim)),
                                         (f"{theirs}.up_proj.weight", (hidden, dim))])
            + [Piece(f"{ours}.w2.weight", (0, 0), f"{theirs}.down_proj.weight", (dim, hidden))])


def gqa_pieces(cfg: ModelConfig, ours: str, theirs: str, interleaved: bool) -> list[Piece]:
    """GQA's attention (the "gqa" kind's `hf_pieces`): q|k|v rows of wqkv (and its bias), q/k norms, o."""
    D, H = cfg.dim, cfg.n_heads
    hd, kv = cfg.head_size, cfg.n_kv_heads
    qkv = [(f"{theirs}.{n}_proj.weight", (h * hd, D)) for n, h in (("q", H), ("k", kv), ("v", kv))]
    out = stacked_rows(f"{ours}.wqkv.weight", qkv)
    if cfg.qkv_bias:
        out += stacked_rows(f"{ours}.wqkv.bias", [(f"{theirs}.{n}_proj.bias", (h * hd,)) for n, h in
                                           (("q", H), ("k", kv), ("v", kv))])
    if cfg.qk_norm != "none":  # "head": one (Dh,) weight for every head; "full": over all of q, all of k
        q, k = (hd, hd) if cfg.qk_norm == "head" else (H * hd, kv * hd)
        out += [Piece(f"{ours}.q_norm.weight", (0,), f"{theirs}.q_norm.weight", (q,)),
                Piece(f"{ours}.k_norm.weight", (0,), f"{theirs}.k_norm.weight", (k,))]
    if cfg.attn_out_bias:
        out.append(Piece(f"{ours}.wo.bias", (0,), f"{theirs}.o_proj.bias", (D,)))
    return out + [Piece(f"{ours}.wo.weight", (0, 0), f"{theirs}.o_proj.weight", (D, H * hd))]


def mla_pieces(cfg: ModelConfig, ours: str, theirs: str, interleaved: bool) -> list[Piece]:
    """MLA's attention (the "mla" kind's `hf_pieces`): the latent projections as rows of wa, the latent norms,
    the up-projections (rope rows de-interleaved when `interleaved`) and o."""
    D, H = cfg.dim, cfg.n_heads
    a = cfg.mla
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    rope_q = {"rope": (qk, a.qk_nope_head_dim)} if interleaved else {}
    rope_kv = {"rope": (a.kv_lora_rank + a.qk_rope_head_dim, a.kv_lora_rank)} if interleaved else {}
    kv_a = f"{theirs}.kv_a_proj_with_mqa.weight"
    latent = [(kv_a, (a.kv_lora_rank + a.qk_rope_head_dim, D))]
    out = []
    if a.q_lora_rank:
        latent.insert(0, (f"{theirs}.q_a_proj.weight", (a.q_lora_rank, D)))
        out += [Piece(f"{ours}.q_norm.weight", (0,), f"{theirs}.q_a_layernorm.weight", (a.q_lora_rank,)),
                Piece(f"{ours}.wq_b.weight", (0, 0), f"{theirs}.q_b_proj.weight", (H * qk, a.q_lora_rank), **rope_q)]
    else:
        out.append(Piece(f"{ours}.wq.weight", (0, 0), f"{theirs}.q_proj.weight", (H * qk, D), **rope_q))
    out += stacked_rows(f"{ours}.wa.weight", latent, **{kv_a: rope_kv})
    return out + [
        Piece(f"{ours}.kv_norm.weight", (0,), f"{theirs}.kv_a_layernorm.weight", (a.kv_lora_rank,)),
        Piece(f"{ours}.wkv_b.weight", (0, 0), f"{theirs}.kv_b_proj.weight",
              (H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)),
        Piece(f"{ours}.wo.weight", (0, 0), f"{theirs}.o_proj.weight", (D, H * a.v_head_dim))]


def dsa_pieces(cfg: ModelConfig, ours: str, theirs: str, interleaved: bool) -> list[Piece]:
    """DeepSeek Sparse Attention (the "dsa" kind's `hf_pieces`): MLA's pieces and the indexer's (transformers'
    DeepseekV32Indexer: wq_b, wk and weights_proj as the rows of our wkw, k_norm weight and bias). Its RoPE is
    half-split like ours, so no row is permuted."""
    d, a = cfg.dsa, cfg.mla
    G, E, D = d.index_n_heads, d.index_head_dim, cfg.dim
    x, y = f"{ours}.indexer", f"{theirs}.indexer"
    return mla_pieces(cfg, ours, theirs, interleaved) + stacked_rows(
        f"{x}.wkw.weight", [(f"{y}.wk.weight", (E, D)), (f"{y}.weights_proj.weight", (G, D))]) + [
        Piece(f"{x}.wq.weight", (0, 0), f"{y}.wq_b.weight", (G * E, a.q_lora_rank)),
        Piece(f"{x}.k_norm.weight", (0,), f"{y}.k_norm.weight", (E,)),
        Piece(f"{x}.k_norm.bias", (0,), f"{y}.k_norm.bias", (E,))]


SEPARATE_TABLES = {"deepseek_v4": "moe_lc.convert.hf_v4:v4_pieces"}
# a family's MoE block: its module name, and each expert's gate / up / down weight names
_MOE_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


def _block(cfg: ModelConfig, ours: str, theirs: str, layer: int, family: str, interleaved: bool) -> list[Piece]:
    D, m = cfg.dim, cfg.moe
    out = [Piece(f"{ours}.attn_norm.weight", (0,), f"{theirs}.input_layernorm.weight", (D,)),
           Piece(f"{ours}.ffn_norm.weight", (0,), f"{theirs}.post_attention_layernorm.weight", (D,))]
    out += load(attention_kind(cfg).hf_pieces)(cfg, f"{ours}.attn", f"{theirs}.self_attn", interleaved)
    if layer < m.n_dense_layers or m.n_routed_experts == 0:
        return out + _swiglu(f"{ours}.ffn", f"{theirs}.mlp", cfg.ffn_dim, D)
    E, F = m.n_routed_experts, m.ffn_dim
    module, (gate, up, down) = _MOE_NAMES.get(family, ("mlp", _SWIGLU_NAMES))
    moe = f"{theirs}.{module}"
    out.append(Piece(f"{ours}.ffn.router.gate.weight", (0, 0), f"{moe}.gate.weight", (E, D)))
    if family in ("deepseek_v3", "deepseek_v32", "glm4_moe"):
        out.append(Piece(f"{ours}.ffn.router.expert_bias", (0,), f"{moe}.gate.e_score_correction_bias", (E,)))
    for e in range(E):
        x = f"{moe}.experts.{e}"
        out += [Piece(f"{ours}.ffn.experts.w13.weight", (e, 0, 0), f"{x}.{gate}.weight", (F, D), expert=True),
                Piece(f"{ours}.ffn.experts.w13.weight", (e, F, 0), f"{x}.{up}.weight", (F, D), expert=True),
                Piece(f"{ours}.ffn.experts.w2.weight", (e, 0, 0), f"{x}.{down}.weight", (D, F), expert=True)]
    if m.n_shared_experts:
        if m.shared_expert_gate:  # Qwen2-MoE: one shared expert, scaled by sigmoid(x . gate)
            out += _swiglu(f"{ours}.ffn.shared", f"{moe}.shared_expert", m.shared_hidden, D)
            out.append(Piece(f"{ours}.ffn.shared_gate.weight", (0, 0), f"{moe}.shared_expert_gate.weight", (1, D)))
        else:
            out += _swiglu(f"{ours}.ffn.shared", f"{moe}.shared_experts", m.shared_hidden, D)
    return out


def pieces(cfg: ModelConfig, family: str, *, interleaved: bool | None = None) -> list[Piece]:
    """Every piece of a model of `family` (moe_lc.convert.hf_config.FAMILIES) with our config `cfg`; a tied
    model (cfg.tie_embeddings, transformers' tie_word_embeddings) has no head piece and no lm_head: the
    head reads embed.weight.
    interleaved: DeepSeek's rope rows are interleaved (V2 always; V3 per its `rope_interleave`)."""
    if family in SEPARATE_TABLES:  # a family whose block is named its own way (DeepSeek-V4: convert/hf_v4.py)
        return load(SEPARATE_TABLES[family])(cfg)
    if interleaved is None:
        interleaved = family.startswith("deepseek")
    D, V = cfg.dim, cfg.vocab_size
    out = [Piece("embed.weight", (0, 0), "model.embed_tokens.weight", (V, D)),
           Piece("norm.weight", (0,), "model.norm.weight", (D,))]
    if not cfg.tie_embeddings:
        out.append(Piece("head.weight", (0, 0), "lm_head.weight", (V, D)))
    for i in range(cfg.n_layers):
        out += _block(cfg, f"layers.{i}", f"model.layers.{i}", i, family, interleaved)
    for d in range(cfg.mtp.depth):  # DeepSeek-V3 keeps MTP module d as layer n_layers + d
        theirs = f"model.layers.{cfg.n_layers + d}"
        out += [Piece(f"mtp.{d}.enorm.weight", (0,), f"{theirs}.enorm.weight", (D,)),
                Piece(f"mtp.{d}.hnorm.weight", (0,), f"{theirs}.hnorm.weight", (D,)),
                Piece(f"mtp.{d}.eh_proj.weight", (0, 0), f"{theirs}.eh_proj.weight", (D, 2 * D), cols=(D, 2 * D)),
                Piece(f"mtp.{d}.eh_proj.weight", (0, D), f"{theirs}.eh_proj.weight", (D, 2 * D), cols=(0, D)),
                Piece(f"mtp.{d}.norm.weight", (0,), f"{theirs}.shared_head.norm.weight", (D,))]
        out += _block(cfg, f"mtp.{d}.block", theirs, cfg.n_layers + d, family, interleaved)
    return out


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """HF keys DeepSeek-V3 checkpoints hold per MTP layer as copies of shared tensors -> the shared key."""
    out = {}
    for d in range(cfg.mtp.depth):
        theirs = f"model.layers.{cfg.n_layers + d}"
        out[f"{theirs}.embed_tokens.weight"] = "model.embed_tokens.weight"
        head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        out[f"{theirs}.shared_head.head.weight"] = head
    return out


def layer_of(name: str) -> str:
    """Group key for streaming: 'layers.3', 'mtp.0', or '' for the embedding, final norm and head."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else ""
