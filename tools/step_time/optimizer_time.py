"""The optimizer step's seconds on one rank of a GPU cluster, by implementation (tools/step_time/compute.py).

    fused   one pass of a fused Adam over the rank's shard (Megatron's distributed optimizer, torch's fused
            AdamW): its optimizer state read and written, its parameters written, at the memory-bound rate
    eager   this repo's ZeroOptimizer step (moe_lc/parallel/zero/optimizer.py) as it runs today, per element of
            the master shard (n) and of the local parameters (P), read + written bytes:
              8 n   finish: each bucket's reduced slice copied into the fp32 gradient shard
              12 n  the global norm: each chunk squared (read 4, write 4) and summed (read 4)
              8 n   the clip: the shard scaled in place
              28 n  AdamW through torch's fused kernel (master, gradient, two fp32 moments read, three written);
                    under Muon the matrices' momentum, Nesterov and update instead (52 bytes per matrix element)
                    and each matrix's Newton-Schulz, traced (`muon_kernels`: five quintic iterations in bf16 on
                    the whole matrix, experts batched) and priced as the compute kernels are
              6 n   publish: the master cast into the bf16 parameters
              4 P   zero_grad: the main-gradient buffer zeroed
            Under ZeRO-1 Muon hands each matrix whole to one owner: the rank's share of the Newton-Schulz work is
            its block kinds' over the data-parallel degree of each (edp for the routed experts).
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from moe_lc.config import Config
from moe_lc.optim import recipe_rule
from moe_lc.optim.muon import Muon
from .clusters import Cluster
from .kernel_rates import kernel_seconds
from .kernel_trace import KernelRecorder, TracedKernels, trace_kernels

ADAMW_BYTES = 8 + 12 + 8 + 28 + 6  # per master element (module docstring)
MUON_MATRIX_BYTES = 52 - 28  # Muon's elementwise on a matrix element beyond what AdamW would have moved


def shard_elements(cfg: Config, memory: dict[str, float]) -> float:
    """Master elements on the rank: its optimizer bytes over (4 for the fp32 master + the rule's state)."""
    rule = recipe_rule(cfg)
    per = 4 + sum(s.bytes_per_element for s in rule.states())
    return memory.get("optimizer", 0.0) / per


def optimizer_seconds(cfg: Config, memory: dict[str, float], layers: list[int], degrees: dict[str, int],
                      cluster: Cluster, rates: dict[str, dict], impl: str) -> dict[str, float]:
    """{"memory": seconds of the memory-bound passes, "gemm": Newton-Schulz's GEMMs, "host": what dispatch adds}
    of one optimizer step of the rank (module docstring); `memory` is its planned bytes by state."""
    bw = rates["memory"]["bytes_per_s"]
    if impl == "fused":
        return {"memory": (2 * memory.get("optimizer", 0.0) + memory.get("params", 0.0)) / bw}
    n, params = shard_elements(cfg, memory), memory.get("params", 0.0) / 2
    out = {"memory": (ADAMW_BYTES * n + 4 * params) / bw}
    if cfg.train.optimizer != "muon":
        return out
    traced = trace_kernels(cfg)
    kinds = Counter(("moe" if cfg.model.is_moe_layer(i) else "dense") for i in layers)
    ops = 0
    for part, count in kinds.items():
        for name, shape in traced.params.get(part, []):
            owners = degrees.get("edp", 1) if ".experts." in name else degrees.get("dp", 1)
            share = count / max(1, owners)
            kernels, n_ops = muon_kernels(cfg, name, shape)
            if not kernels:
                continue
            ops += share * n_ops
            out["memory"] += share * MUON_MATRIX_BYTES * math.prod(shape) / bw
            for k, calls in kernels.items():
                kind = "memory" if k.kind == "memory" else "gemm"
                out[kind] = out.get(kind, 0.0) + share * calls * kernel_seconds(k.flops, k.bytes, rates[k.kind])
    host = ops * cluster.host_op_us * 1e-6
    if host > sum(out.values()):
        out["host"] = host - sum(out.values())
    return out


_MUON: dict[tuple, tuple[Counter, int]] = {}


def muon_kernels(cfg: Config, name: str, shape: tuple[int, ...]) -> tuple[Counter, int]:
    """(Counter of Kernel -> launches, aten ops) of Muon's orthogonal update of parameter `name` (local `shape`),
    traced on the meta device with the Newton-Schulz in bf16 (what "auto" runs on CUDA); empty for a parameter
    Muon leaves to AdamW."""
    rule = recipe_rule(cfg)
    if not isinstance(rule, Muon) or not rule.whole(name, torch.Size(shape)):
        return Counter(), 0
    key = (name.split(".", 2)[-1], shape, tuple(sorted(rule.sections.items())))
    if key not in _MUON:
        ns = Muon(sections=rule.sections, exact_rms=rule.exact_rms,
                  ns_dtype="fp32" if rule.ns_dtype == "fp32" else "bf16")
        into = TracedKernels()
        with KernelRecorder(into) as rec, rec.booking("muon", "F"):
            ns.orthogonal_update(name, torch.empty(shape, device="meta"))
        _MUON[key] = (into.of("muon", "F"), into.ops.get("muon", {}).get("F", 0))
    return _MUON[key]
