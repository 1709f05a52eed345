"""Muon (Jordan et al. 2024) as Moonlight specifies it (Liu et al., arXiv:2502.16982), with AdamW for the rest.

Hidden matrices (every 2-D weight, and each routed expert of a stacked (E, rows, cols) weight, except the
embedding table and the output head) take Muon; embeddings, the head, norms, biases and every other
1-D parameter take AdamW with train.beta1 / beta2 / eps. Both use train.lr and train.weight_decay
(decoupled). One Muon step on a matrix W (A x B), g its clipped gradient:

    m = mu m + g                          (the momentum buffer, mu = train.muon_momentum = 0.95)
    u = g + mu m                          (Nesterov)
    O = NS5(u)                            (5 Newton-Schulz steps, coefficients (3.4445, -4.7750, 2.0315),
                                           on u / ||u||_F, transposed when A > B; matmuls in fp32, or
                                           bf16 by train.muon_ns_dtype, bf16 on CUDA by default)
    W = W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O     (0.2 sqrt(max(A, B)): AdamW's update RMS, were O
                                                       orthogonal; NS5's O has 0.85-0.90 of that RMS, and
                                                       train.muon_exact_rms scales by 0.2 / RMS(O) instead)

Fused weights are orthogonalized per logical matrix, each scaled by its own shape: attention's
wqkv = [q; k; v] as q, k and v; SwiGLU's w13 = [w1; w3] (dense, shared and each routed expert) as w1
and w3; MLA's wa = [wq_a; wkv_a] (with q_lora_rank) as DeepSeek's two projections, wkv_a keeping its
rope key rows; DSA's indexer wkw = [wk; weights_proj] as wk and weights_proj.

State per master element: `momentum` (fp32; Muon's buffer m on matrix elements, AdamW's exp_avg on the
rest) and `exp_avg_sq` (fp32; AdamW's, zero and unused on matrix elements). ZeRO-1 hands each matrix
whole to one owner rank of its data-parallel group (`whole`); a tensor-parallel matrix reaches the rule as
its TP slice, and `ShardView.to_full` / `to_local` gather it whole over tp and cut the update back (every
rank of the tp group orthogonalizes the same full matrix).
"""

from __future__ import annotations

import math

import torch

from moe_lc.optim.adamw import AdamW
from moe_lc.optim.rule import OwnedParam, ShardView, StateSpec, UpdateRule

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Moonlight / Keller Jordan's quintic
NS_STEPS = 5
ADAMW_NAMES = ("embed", "head")  # module names of matrices that take AdamW (Moonlight: embeddings, the head)


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., A, B) -> the same shape in fp32, each matrix's approximate U V^T (its singular values pushed
    into about [0.68, 1.13]) by `steps` iterations of X = a X + (b X X^T + c (X X^T)^2) X, the iterations
    in `dtype` (the quintic tolerates bf16: its fixed point is a band, not a value)."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # X X^T is then the smaller Gram matrix
        x = x.mT
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).float()


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
    # AdamW's temporaries on its runs; on a matrix of n elements the Newton-Schulz step holds about eight
    # fp32 copies (u, X, X X^T, its square, the polynomial, the product, the scaled update) at once
    update_bytes_per_element = 32

    def __init__(self, momentum: float = 0.95, weight_decay: float = 0.0, beta1: float = 0.9, beta2: float = 0.95,
                 eps: float = 1e-8, sections: dict[str, tuple[int, ...]] | None = None, exact_rms: bool = False,
                 ns_dtype: str = "auto"):
        self.momentum, self.weight_decay, self.exact_rms, self.ns_dtype = momentum, weight_decay, exact_rms, ns_dtype
        self.adamw = AdamW(beta1, beta2, eps, weight_decay)
        self.sections = dict(sections or {})

    @classmethod
    def from_config(cls, train, precision, model=None) -> "Muon":
        return cls(train.muon_momentum, train.weight_decay, train.beta1, train.beta2, train.eps,
                   fused_sections(model), train.muon_exact_rms, train.muon_ns_dtype)

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
        """The scaled update 0.2 sqrt(max(A, B)) NS5(.) of each logical matrix of the full tensor u
        ((rows, cols) or (E, rows, cols): each expert its own matrix), u's shape. With `exact_rms`,
        0.2 NS5(.) / RMS(NS5(.)) instead: the same for an exactly orthogonal output (its RMS is
        1 / sqrt(max(A, B))), and exactly AdamW's 0.2 for Newton-Schulz's approximate one."""
        parts = []
        bf16 = self.ns_dtype == "bf16" or (self.ns_dtype == "auto" and u.is_cuda)
        for block in u.split(self.rows_of(name, u.shape[-2]), dim=-2):
            o = newton_schulz(block, dtype=torch.bfloat16 if bf16 else torch.float32)
            if self.exact_rms:
                parts.append(o.mul_(0.2 / o.pow(2).mean(dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-30)))
            else:
                parts.append(o.mul_(0.2 * math.sqrt(max(block.shape[-2:]))))
        return torch.cat(parts, dim=-2)

    @torch.no_grad()
    def update_(self, shard: ShardView, lr: float, step: int) -> None:
        no_decay = set(shard.no_decay)
        run: list[OwnedParam] = []  # consecutive AdamW parameters, updated as one range
        for o in shard.params:
            if not self.whole(o.name, o.shape):
                if run and run[-1].hi != o.lo:
                    self._adamw_run(shard, run, no_decay, lr, step)
                    run = []
                run.append(o)
                continue
            assert o.whole, f"{o.name} must sit whole on its owner (Muon.whole)"
            self._muon_(shard, o, (o.lo, o.hi) not in no_decay, lr)
        if run:
            self._adamw_run(shard, run, no_decay, lr, step)

    def _adamw_run(self, shard: ShardView, run: list[OwnedParam], no_decay: set, lr: float, step: int) -> None:
        lo, hi = run[0].lo, run[-1].hi
        view = ShardView(shard.master[lo:hi], shard.grad[lo:hi],
                         {"exp_avg": shard.state["momentum"][lo:hi], "exp_avg_sq": shard.state["exp_avg_sq"][lo:hi]},
                         [(o.lo - lo, o.hi - lo) for o in run if (o.lo, o.hi) in no_decay])
        self.adamw.update_(view, lr, step)

    def _muon_(self, shard: ShardView, o: OwnedParam, decay: bool, lr: float) -> None:
        grad = shard.grad[o.lo:o.hi].view(o.shape)
        buf = shard.state["momentum"][o.lo:o.hi].view(o.shape)
        buf.mul_(self.momentum).add_(grad)
        u = grad.add(buf, alpha=self.momentum)
        update = shard.to_local(o, self.orthogonal_update(o.name, shard.to_full(o, u)))
        master = shard.master[o.lo:o.hi]
        if decay and self.weight_decay:
            master.mul_(1 - lr * self.weight_decay)
        master.add_(update.reshape(-1), alpha=-lr)
