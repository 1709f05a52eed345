"""Token ids and hash tables for a data-free trace of hash-routed MoE layers (DeepSeek-V4's first MoE layers,
moe_lc/model/hash_router.py): the stand-in for a hash layer that `balanced_select` is for a learned router.

A hash layer's experts are tid2eid[token id], a (V, K) table read with the micro-batch's token ids. A traced
step has neither real ids nor, on the meta device, the table's values, so both get known values (the tracer's
shadows, tools/dry_run/trace.py): token ids 0, 1, 2, ... in reading order (modulo V), and a table whose row v is
the balanced choice of token v (`balanced_select`'s row v: experts (v K + k) mod E, k < K). A micro-batch's
consecutive ids then load every expert alike (exactly, when its tokens times K are a multiple of E, as at
V4-Flash's 4K x 6 over 256), which is what the planner assumes; its layout's all-to-alls follow.
The planner (tools/planner/block_trace.py) and the dry run (tools/dry_run/rank_trace.py) both trace with them,
so a hash layer routes the same in both.
"""

from __future__ import annotations

import torch

from moe_lc.config import ModelConfig
from moe_lc.model.hash_router import HashRouter
from .trace import StepTracer, balanced_select


def trace_tokens(m: ModelConfig, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A micro-batch's token ids (B, S+1) int64 for a traced step: 0, 1, 2, ... mod V in reading order where
    the model has hash layers (each id then picks its own experts), else zeros (nothing reads the values)."""
    if not (m.has_moe and m.moe.hash_layers):
        return torch.zeros(shape, dtype=torch.int64, device=device)
    return torch.arange(shape[0] * shape[1], device=device).view(shape) % m.vocab_size


def balanced_table(vocab_size: int, n_experts: int, topk: int) -> torch.Tensor:
    """(V, K) int64 on the CPU: row v is `balanced_select`'s choice for token v (one group: no group limit)."""
    rows = torch.zeros((), device="cpu").expand(vocab_size, n_experts)  # shape only: nothing allocated
    return balanced_select(rows, None, 1, 1, topk)


def balance_hash_tables(model: torch.nn.Module, tracer: StepTracer) -> int:
    """Give every hash router's tid2eid (a meta buffer) the values of `balanced_table` in `tracer`; -> how many."""
    routers = [mod for mod in model.modules() if isinstance(mod, HashRouter)]
    for router in routers:
        V, K = router.tid2eid.shape
        tracer.shadows[router.tid2eid] = balanced_table(V, router.n_experts, K)
    return len(routers)
