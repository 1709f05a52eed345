"""Muon (Jordan et al. 2024) as Moonlight specifies it (Liu et al., arXiv:2502.16982), with AdamW for the rest;
DeepSeek-V4's variant (arXiv 2606.19348) by train.muon_ns = "v4" and train.muon_update_rms = 0.18.

Hidden matrices (every 2-D weight, and each routed expert of a stacked (E, rows, cols) weight, except the
embedding table and the output head) take Muon; embeddings, the head, norms, biases and every other
1-D parameter take AdamW with train.beta1 / beta2 / eps. Both use train.lr and train.weight_decay
(decoupled). One Muon step on a matrix W (A x B), g its clipped gradient:

    m = mu m + g                          (the momentum buffer, mu = train.muon_momentum = 0.95)
    u = g + mu m                          (Nesterov)
    O = NS5(u)                            (5 Newton-Schulz steps, coefficients (3.4445, -4.7750, 2.0315),
                                           on u / ||u||_F, transposed when A > B; matmuls in fp32, or
                                           bf16 by train.muon_ns_dtype, bf16 on CUDA by default; "v4": 8 of
                                           those, then 2 of (2, -1.5, 0.5), NS_SCHEDULES)
    W = W (1 - lr wd) - lr r sqrt(max(A, B)) O       (r = train.muon_update_rms, 0.2: AdamW's update RMS, were O
                                                       orthogonal; NS5's O has 0.85-0.90 of that RMS, V4's
                                                       hybrid's all of it; train.muon_exact_rms scales by
                                                       r / RMS(O) instead)

Which parameters take AdamW under V4 (its report: embeddings, the prediction head, RMSNorm weights and mHC's
static biases and gating factors) is this rule as it stands: mHC's biases and gates are 1-D (AdamW), its
projections `fn` are matrices (Muon).

Fused weights are orthogonalized per logical matrix, each scaled by its own shape: attention's
wqkv = [q; k; v] as q, k and v; SwiGLU's w13 = [w1; w3] (dense, shared and each routed expert) as w1
and w3; MLA's wa = [wq_a; wkv_a] (with q_lora_rank) as DeepSeek's two projections, wkv_a keeping its
rope key rows; DSA's indexer wkw = [wk; weights_proj] as wk and weights_proj.

Batched: every logical matrix of a step with the same shape (the experts of a layer, each layer's wo, ...)
goes through Newton-Schulz in one stack (n, A, B), a chain of batched matmuls; the same math per matrix
(its own norm, transpose and scale), stacks of at most NS_BATCH_ELEMENTS elements so the working set does
not grow with the number of experts.

State per master element: `momentum` (fp32; Muon's buffer m on matrix elements, AdamW's exp_avg on the
rest) and `exp_avg_sq` (fp32; AdamW's, zero and unused on matrix elements). ZeRO-1 hands each matrix
whole to one owner rank of its data-parallel group (`whole`); a tensor-parallel matrix reaches the rule as
its TP slice, and `ShardView.to_full` / `to_local` gather it whole over tp and cut the update back (every
rank of the tp group orthogonalizes the same full matrix).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from moe_lc.optim.adamw import AdamW
from moe_lc.optim.rule import OwnedParam, ShardView, StateSpec, UpdateRule

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Moonlight / Keller Jordan's quintic
NS_STEPS = 5
# train.muon_ns: ((a, b, c), steps) in order. V4's last two steps, f(s) = 2s - 1.5s^3 + 0.5s^5, have f(1) = 1
# and f'(1) = 0: they pull the quintic's band of singular values (about [0.68, 1.13]) onto 1.
NS_SCHEDULES = {"moonlight": ((NS_COEFFICIENTS, NS_STEPS),),
                "v4": ((NS_COEFFICIENTS, 8), ((2.0, -1.5, 0.5), 2))}
ADAMW_NAMES = ("embed", "head")  # module names of matrices that take AdamW (Moonlight: embeddings, the head)
# elements of one Newton-Schulz stack at most (one matrix if larger): 64 MiB per fp32 copy, enough matrices
# per batched matmul to fill a GPU (5 of 1408 x 2048, 23 of 512 x 1408), a bound on the working set
NS_BATCH_ELEMENTS = 2**24


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32, schedule=None) -> torch.Tensor:
    """(..., A, B) -> the same shape in fp32, each matrix's approximate U V^T (its singular values pushed
    into about [0.68, 1.13]) by `steps` iterations of X = a X + (b X X^T + c (X X^T)^2) X, all matrices at
    once (batched matmuls, the polynomial's coefficients in baddbmm's alpha and beta), the iterations in
    `dtype` (the quintic tolerates bf16: its fixed point is a band, not a value). `schedule`: ((a, b, c),
    steps) pairs run in order instead (NS_SCHEDULES). Holds g and at most three fp32 copies of its size
    besides (X, the next X, one (n, A, A) Gram or polynomial: A <= B transposed)."""
    x = g.float().reshape(-1, *g.shape[-2:])  # (n, A, B)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # X X^T is then the smaller Gram matrix
        x = x.mT
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(dtype)
    for (a, b, c), n_steps in schedule or ((NS_COEFFICIENTS, steps),):
        for _ in range(n_steps):
            gram = x @ x.mT  # (n, A, A)
            gram = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2, over G (one (n, A, A) kept)
            x = torch.baddbmm(x, gram, x, beta=a)  # a X + (b G + c G^2) X
    return (x.mT if tall else x).float().reshape(g.shape)


def stacks(blocks: list[torch.Tensor], most: int) -> Iterator[list[torch.Tensor]]:
    """blocks [(n_i, A, B)] -> lists of their slices along dim 0 (views, in order), each list at most `most`
    matrices in all: the parts of one Newton-Schulz stack."""
    parts, room = [], most
    for block in blocks:
        lo = 0
        while lo < block.shape[0]:
            take = min(room, block.shape[0] - lo)
            parts.append(block[lo:lo + take])
            lo, room = lo + take, room - take
            if room == 0:
                yield parts
                parts, room = [], most
    if parts:
        yield parts


def fused_sections(model) -> dict[str, tuple[int, ...]]:
    """{parameter-name suffix: rows of each logical matrix} of the fused weights (module docstring) under
    a model config (moe_lc.config.ModelConfig); w13's halves need no entry. {} without a model."""
    if model is None:
        return {}
    out = {"attn.wqkv.weight": (model.n_heads * model.head_size, model.n_kv_heads * model.head_size,
                                model.n_kv_heads * model.head_size)}
    mla = model.mla
    if mla.q_lora_rank:
        out["attn.wa.weight"] = (mla.q_lora_rank, mla.kv_lora_rank + mla.qk_rope_head_dim)
    dsa = getattr(model, "dsa", None)
    if dsa is not None:
        out["indexer.wkw.weight"] = (dsa.index_head_dim, dsa.index_n_heads)
    return out


class Muon(UpdateRule):
    name = "muon"
    # at most 16 B per shard element: a Newton-Schulz stack (its shard's matrices at most) and three fp32 copies
    # of its size (`newton_schulz`); AdamW's 12 on its runs. The Nesterov direction overwrites the gradient.
    # Not counted: under tp the matrices are gathered whole (tp times their local elements)
    update_bytes_per_element = 16

    def __init__(self, momentum: float = 0.95, weight_decay: float = 0.0, beta1: float = 0.9, beta2: float = 0.95,
                 eps: float = 1e-8, sections: dict[str, tuple[int, ...]] | None = None, exact_rms: bool = False,
                 ns_dtype: str = "auto", ns: str = "moonlight", update_rms: float = 0.2):
        self.momentum, self.weight_decay, self.exact_rms, self.ns_dtype = momentum, weight_decay, exact_rms, ns_dtype
        self.schedule, self.update_rms = NS_SCHEDULES[ns], update_rms
        self.adamw = AdamW(beta1, beta2, eps, weight_decay)
        self.sections = dict(sections or {})

    @classmethod
    def from_config(cls, train, precision, model=None) -> "Muon":
        return cls(train.muon_momentum, train.weight_decay, train.beta1, train.beta2, train.eps,
                   fused_sections(model), train.muon_exact_rms, train.muon_ns_dtype, train.muon_ns,
                   train.muon_update_rms)

    def states(self) -> tuple[StateSpec, ...]:
        return StateSpec("momentum", torch.float32), StateSpec("exp_avg_sq", torch.float32)

    def whole(self, name: str, shape: torch.Size) -> bool:
        """Matrices Muon updates: 2-D weights and stacked (E, rows, cols) experts, not embeddings or the head."""
        module = name.split(".")[-2] if "." in name else name
        return len(shape) in (2, 3) and module not in ADAMW_NAMES

    def rows_of(self, name: str, rows: int) -> tuple[int, ...]:
        """The rows of each logical matrix of parameter `name` (full rows along dim -2)."""
        if name.endswith("w13.weight") and rows % 2 == 0:
            return rows // 2, rows // 2
        for suffix, parts in self.sections.items():
            if name.endswith(suffix) and sum(parts) == rows:
                return parts
        return (rows,)

    def orthogonal_update(self, name: str, u: torch.Tensor) -> torch.Tensor:
        """The scaled update r sqrt(max(A, B)) NS(.) of each logical matrix of the full tensor u
        ((rows, cols) or (E, rows, cols): each expert its own matrix), u's shape, r = update_rms (0.2). With
        `exact_rms`, r NS(.) / RMS(NS(.)) instead: the same for an exactly orthogonal output (its RMS is
        1 / sqrt(max(A, B))), and exactly r for Newton-Schulz's approximate one."""
        out = u.float().clone()
        self.orthogonal_updates_([(name, out)])
        return out

    def orthogonal_updates_(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Each full fp32 tensor u of `named` [(parameter name, u)] overwritten by its `orthogonal_update`,
        every logical matrix stacked with the others of its shape (and dtype, device): one Newton-Schulz
        chain per stack of at most NS_BATCH_ELEMENTS elements, or of one matrix where that is larger."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for name, u in named:
            for block in u.split(self.rows_of(name, u.shape[-2]), dim=-2):
                block = block.view(-1, *block.shape[-2:])  # (n, A, B), a view: the update is written into u
                groups.setdefault((*block.shape[-2:], block.dtype, block.device), []).append(block)
        for (rows, cols, *_), blocks in groups.items():
            for parts in stacks(blocks, max(1, NS_BATCH_ELEMENTS // (rows * cols))):
                stack = parts[0] if len(parts) == 1 else torch.cat(parts)  # (n, A, B)
                for part, out in zip(parts, self._scaled_ns(stack).split([p.shape[0] for p in parts])):
                    part.copy_(out)

    def _scaled_ns(self, stack: torch.Tensor) -> torch.Tensor:
        """(n, A, B) -> NS5 of each matrix, scaled (orthogonal_update): a new tensor."""
        bf16 = self.ns_dtype == "bf16" or (self.ns_dtype == "auto" and stack.is_cuda)
        o = newton_schulz(stack, dtype=torch.bfloat16 if bf16 else torch.float32, schedule=self.schedule)
        if self.exact_rms:
            return o.mul_(self.update_rms / o.pow(2).mean(dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-30))
        return o.mul_(self.update_rms * math.sqrt(max(stack.shape[-2:])))

    @torch.no_grad()
    def update_(self, shard: ShardView, lr: float, step: int) -> None:
        no_decay = set(shard.no_decay)
        run: list[OwnedParam] = []  # consecutive AdamW parameters, updated as one range
        matrices: list[OwnedParam] = []
        for o in shard.params:
            if self.whole(o.name, o.shape):
                assert o.whole, f"{o.name} must sit whole on its owner (Muon.whole)"
                matrices.append(o)
                continue
            if run and run[-1].hi != o.lo:
                self._adamw_run(shard, run, no_decay, lr, step)
                run = []
            run.append(o)
        if run:
            self._adamw_run(shard, run, no_decay, lr, step)
        window, size = [], 0  # matrices orthogonalized together: NS_BATCH_ELEMENTS local elements (or one)
        for o in matrices:
            window.append(o)
            size += o.hi - o.lo
            if size >= NS_BATCH_ELEMENTS:
                self._muon_(shard, window, no_decay, lr)
                window, size = [], 0
        if window:
            self._muon_(shard, window, no_decay, lr)

    def _adamw_run(self, shard: ShardView, run: list[OwnedParam], no_decay: set, lr: float, step: int) -> None:
        lo, hi = run[0].lo, run[-1].hi
        view = ShardView(shard.master[lo:hi], shard.grad[lo:hi],
                         {"exp_avg": shard.state["momentum"][lo:hi], "exp_avg_sq": shard.state["exp_avg_sq"][lo:hi]},
                         [(o.lo - lo, o.hi - lo) for o in run if (o.lo, o.hi) in no_decay])
        self.adamw.update_(view, lr, step)

    def _muon_(self, shard: ShardView, window: list[OwnedParam], no_decay: set, lr: float) -> None:
        """Muon's step on whole matrices: each one's momentum and Nesterov direction u (in place of its
        gradient), gathered whole over tp (to_full, in shard order on every rank), all orthogonalized
        together, cut back (to_local) and applied."""
        full = []
        for o in window:
            grad = shard.grad[o.lo:o.hi].view(o.shape)
            buf = shard.state["momentum"][o.lo:o.hi].view(o.shape)
            buf.mul_(self.momentum).add_(grad)
            full.append(shard.to_full(o, grad.add_(buf, alpha=self.momentum)))
        self.orthogonal_updates_([(o.name, u) for o, u in zip(window, full)])
        for o, update in zip(window, full):
            master = shard.master[o.lo:o.hi]
            if (o.lo, o.hi) not in no_decay and self.weight_decay:
                master.mul_(1 - lr * self.weight_decay)
            master.view(o.shape).add_(shard.to_local(o, update), alpha=-lr)
