"""What each block kind keeps for backward, against Megatron-LM's accounting, term by term (plan.py --saved).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198,
section 4) count what a GPT block keeps per layer in 16-bit activations: with tensor and sequence
parallelism over t ranks and a fused attention kernel (no s x s terms), s b h / t times

    attention   11   the QKV input 2, Q and K 4, V 2, the output projection's input 2, its dropout mask 1
    MLP         19   the input 2, the 4h-wide first GEMM's output 8, the activation's output 8, dropout mask 1
    norms        4   the two LayerNorms' inputs, 2 each
    total       34

The traced tensors of one block (tools/planner/block_trace.py, the module that saved each) are put under
those terms by their module: a block's two norms; its attention module (the kind's projections, core,
RoPE, indexer); its FFN (dense SwiGLU, or the MoE's shared and routed experts); what a MoE layer keeps
to route and move rows (router, dispatch) has no term in a dense GPT block and is listed apart.
Figures are bytes per token of the micro-batch on this rank (B S / cp tokens), so the formula reads 34 h / t.
The formula is for a dense 4h-GeLU block with dropout; a SwiGLU block, GQA's narrower K and V, MLA's
latents and MoE's routed rows differ by design, which is what the per-term ratios show.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_lc.config import Config
from .activation_memory import policy_config
from .block_trace import block_kind, trace_parts

MEGATRON_TERMS = {"attention": 11, "MLP": 19, "norms": 4}  # x s b h / t bytes per layer (16-bit)
ROUTING = "MoE routing"
STREAM = "mHC"  # DeepSeek-V4's hyper-connections around each sublayer (model.residual = "mhc")
REPLAY = "replay inputs"  # what a recomputed phase keeps to run again (a block's phases under full recompute)


def term_of(module: str) -> str:
    """The Megatron term a saved tensor belongs to, from the module that saved it (`layers.<i>.<path>`)."""
    path = module.split(".", 2)[2] if module.startswith("layers.") and module.count(".") >= 2 else module
    head = path.split(".", 1)[0]
    if module.endswith(" " + REPLAY):
        return REPLAY
    if head in ("attn_norm", "ffn_norm"):
        return "norms"
    if head in ("attn_res", "ffn_res"):
        return STREAM
    if head == "attn":
        return "attention"
    if head == "ffn":
        rest = path.split(".")[1:2]
        return ROUTING if rest and rest[0] in ("router", "gate", "dispatcher") else "MLP"
    # "<kind> phases" of a MoE kind ("moe phases", "csa moe phases"): the MoE layer's own phases (scores, sort
    # order, the rows copied in expert order)
    phases = module.endswith(" phases") and "moe" in module.split()
    return ROUTING if phases or "router" in path or "dispatch" in path else "MLP"


@dataclass
class SavedTable:
    kind: str  # `block_kind`: "dense", "moe", or V4's "csa moe", ...
    tokens: int  # B S / cp: the micro-batch's tokens on this rank
    h: int
    t: int
    bytes_per_value: int  # the compute dtype's; Megatron's formula assumes 2
    by_term: dict[str, int]  # traced bytes of one block under each term
    tensors: dict[str, list[tuple[int, str]]]

    def megatron(self, term: str) -> float:
        """Megatron's bytes per token for `term` (or the total, "total"), in this recipe's compute dtype."""
        k = sum(MEGATRON_TERMS.values()) if term == "total" else MEGATRON_TERMS.get(term, 0)
        return k * self.h / self.t * self.bytes_per_value / 2

    @property
    def total(self) -> int:
        return sum(self.by_term.values())

    def ratio(self) -> float:
        return self.total / self.tokens / self.megatron("total")


def saved_tables(cfg: Config) -> list[SavedTable]:
    """One table per block kind of cfg's model, traced under its recompute policy and precision."""
    cfg = policy_config(cfg)
    traced = trace_parts(cfg, cfg.data.has_loss_mask)
    m, p = cfg.model, cfg.parallel
    tokens = cfg.train.micro_batch * cfg.train.seq_len // p.cp
    value = 4 if cfg.precision.recipe == "fp32" else 2
    out = []
    for kind in sorted({block_kind(m, i) for i in range(m.n_layers)}):
        by_term, tensors = {}, {}
        for nbytes, what in traced.tensors.get(kind, []):
            term = term_of(what.split(":", 1)[0])
            by_term[term] = by_term.get(term, 0) + nbytes
            tensors.setdefault(term, []).append((nbytes, what))
        out.append(SavedTable(kind, tokens, m.dim, p.tp, value, by_term, tensors))
    return out


def render(tables: list[SavedTable], cfg: Config) -> list[str]:
    p = cfg.parallel
    lines = [f"Saved for backward per block, bytes per token of one micro-batch on one rank ({tables[0].tokens:,} "
             f"tokens = micro_batch x seq_len / cp), against Megatron-LM's 34 h / t (Korthikanti et al. 2022: "
             f"SP and a fused attention kernel; h = {cfg.model.dim}, t = {p.tp}"
             f"{'' if tables[0].bytes_per_value == 2 else '; doubled for fp32 activations'}), "
             f"recompute {cfg.recompute.policy}:"]
    for table in tables:
        lines.append(f"  {table.kind} block")
        lines.append(f"    {'term':<13}{'ours':>12}{'Megatron':>12}{'ratio':>8}")
        for term in [*MEGATRON_TERMS, STREAM, ROUTING, REPLAY]:
            if term not in table.by_term and term not in MEGATRON_TERMS:
                continue
            ours, theirs = table.by_term.get(term, 0) / table.tokens, table.megatron(term)
            ratio = f"{ours / theirs:.2f}" if theirs else "-"
            lines.append(f"    {term:<13}{ours:>12,.1f}{theirs:>12,.1f}{ratio:>8}")
        lines.append(f"    {'total':<13}{table.total / table.tokens:>12,.1f}{table.megatron('total'):>12,.1f}"
                     f"{table.ratio():>8.2f}   ({table.total / 2**20:,.2f} MiB per layer per micro-batch)")
    return lines + [""]


def to_json(tables: list[SavedTable]) -> dict:
    return {t.kind: {"tokens": t.tokens, "bytes_per_token": {k: v / t.tokens for k, v in t.by_term.items()},
                     "megatron_bytes_per_token": {k: t.megatron(k) for k in [*MEGATRON_TERMS, "total"]},
                     "total_bytes": t.total, "ratio_to_megatron": t.ratio()} for t in tables}
