"""CPU benchmark: what one rank of a CPU recipe pays per framework op, per GEMM FLOP at the recipe's own
shapes and per memory-bound byte, on one core (tools/step_time/cpu.py builds the `cpu` cluster from it).

    python -m tools.bench.cpu_costs --out docs/results/steptime     # ~15 s
    python -m tools.bench.cpu_costs --recipe recipes/overlap_cpu.toml --reps 50

One process, one thread, CPU time of this thread (`time.thread_time`: what the work costs, not the
wall time a loaded machine adds; tools/step_time/cpu.py scales it by how much sharing the cores costs):

  gemm        every GEMM (mm, addmm, bmm, _grouped_mm) the recipe's dense and MoE blocks dispatch at the
              recipe's micro-batch (1 x 128 tokens: 128-row GEMMs, the experts' grouped GEMMs with the
              routed counts), forward and backward, replayed with its own arguments: FLOPs / (time - the
              cost of issuing a 1x1 mm), summed over all of them -> `gemm_flops_per_s`.
  op_s        what the same blocks cost beyond those GEMMs, per aten op: each block's forward + backward
              at the recipe's micro-batch, minus its GEMMs' replayed time, over the ops tools/planner/block_trace.py
              counts for it (F + B + W: the count the predictor multiplies by). The framework (Python,
              modules, autograd, dispatcher), allocating the activations and the memory-bound kernels, at
              the recipe's sizes and in the block's own order. `framework_op_s`: the framework alone, the
              blocks shrunk to no FLOPs (dim 16, seq 8: the same modules and routing), for comparison.
  memory      out-of-place add and mul on the recipe's activation sizes ((S, D) and (S, ffn), fp32): bytes
              read + written / (time - the cost of issuing them on 1 element) -> `memory_bytes_per_s` (the
              predictor's memory-bound bytes at this rate are also inside op_s: `memory_share_of_op_s`).

Results: cpu_costs.json (`meta`, `op_s`, `gemm_flops_per_s`, `memory_bytes_per_s`, and the pieces).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench/cpu_costs.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    runpy.run_module("tools.bench.cpu_costs", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lc.config import load_config
from moe_lc.model.block import Block
from moe_lc.model.init import init_weights
from moe_lc.model.rope import RotaryEmbedding
from .common import ROOT, load_average, write_json
from .compile_cpu import cpu_name

OUT_NAME = "cpu_costs.json"
DEFAULT_RECIPE = "recipes/overlap_cpu.toml"
ONE_PROCESS = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.pp_schedule=1f1b"]
TINY = ["model.dim=16", "model.ffn_dim=16", "model.moe.ffn_dim=8", "train.seq_len=8"]
GEMMS = ("mm", "addmm", "bmm", "_grouped_mm")


class OpLog(TorchDispatchMode):
    """Every aten op dispatched inside: `count`, and the GEMMs with their arguments (`gemms`)."""

    def __init__(self, keep_gemms: bool = False):
        super().__init__()
        self.count, self.keep, self.gemms = 0, keep_gemms, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        kwargs = kwargs or {}
        if self.keep and func.overloadpacket.__name__ in GEMMS:
            self.gemms.append((func, [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args], kwargs))
        return func(*args, **kwargs)


def gemm_flops(func, args) -> float:
    """FLOPs of one traced GEMM from its operands' shapes."""
    name = func.overloadpacket.__name__
    a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
    if name == "bmm":
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name == "_grouped_mm" and b.dim() == 3:  # (T, K) x (E, K, N) by row groups
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[-1]  # mm / addmm, and the grouped wgrad (K, T) x (T, N)


def cpu_time(fn, reps: int) -> float:
    """Median thread CPU seconds of fn() over `reps` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def blocks(recipe: str, sets: list[str]):
    """[(kind, block, x, dy, cos, sin)] of the recipe's first dense and first MoE block, one process."""
    cfg = load_config(ROOT / recipe, ONE_PROCESS + sets, world_size=1, check=False)
    m, seq = cfg.model, cfg.train.seq_len
    cos, sin = RotaryEmbedding.from_config(m.rope, m.rope_dim)(torch.arange(seq))
    g = torch.Generator().manual_seed(0)
    out = []
    for kind, layer in (("dense", 0), ("moe", m.moe.n_dense_layers)):
        if (kind == "moe") != m.is_moe_layer(layer):
            continue
        block = Block(m, layer)
        with torch.no_grad():
            init_weights(block, 0, 0.02, m.n_layers)
        x = torch.randn(cfg.train.micro_batch, seq, m.dim, generator=g).requires_grad_()
        out.append((kind, block, x, torch.randn(x.shape, generator=g), cos, sin))
    return out


def forward_backward(block, x, dy, cos, sin) -> None:
    block(x, cos, sin).backward(dy)
    x.grad = None
    block.zero_grad(set_to_none=True)


def _traced_ops(recipe: str) -> dict[str, int]:
    """tools/planner/block_trace.py's F + B + W op count of each block kind, on the one-process layout."""
    from ..planner.block_trace import trace_parts

    cfg = load_config(ROOT / recipe, ONE_PROCESS, world_size=1, check=False)
    return {k: sum(v.values()) for k, v in trace_parts(cfg, cfg.data.has_loss_mask, backward=True).ops.items()}


def block_costs(recipe: str, reps: int) -> dict:
    """The recipe's blocks' GEMMs at its micro-batch, each replayed: summed FLOPs / summed seconds; and
    each block's forward + backward with what it costs beyond them per traced op (`op_s`)."""
    one = torch.ones(1, 1)
    issue = cpu_time(lambda: [torch.mm(one, one) for _ in range(100)], reps) / 100
    flops = seconds = 0.0
    shapes, rows, traced = {}, {}, _traced_ops(recipe)
    for kind, block, x, dy, cos, sin in blocks(recipe, []):
        forward_backward(block, x, dy, cos, sin)
        with OpLog(keep_gemms=True) as log:
            forward_backward(block, x, dy, cos, sin)
        block_gemm_s = 0.0
        for func, args, kwargs in log.gemms:
            f = gemm_flops(func, args)
            t = max(cpu_time(lambda: func(*args, **kwargs), reps) - issue, 1e-9)
            flops, seconds, block_gemm_s = flops + f, seconds + t, block_gemm_s + t
            key = f"{kind} {func.overloadpacket.__name__} " + " x ".join(
                str(list(a.shape)) for a in args if isinstance(a, torch.Tensor) and a.dim() > 1)
            shapes[key] = {"flops": f, "s": t, "gflops_per_s": f / t / 1e9}
        total = cpu_time(lambda: forward_backward(block, x, dy, cos, sin), reps)
        rows[kind] = {"s": total, "gemm_s": block_gemm_s, "ops": traced[kind], "dispatched": log.count}
    beyond = sum(r["s"] - r["gemm_s"] for r in rows.values())
    return {"gemm_flops_per_s": flops / seconds, "gemm_issue_s": issue, "op_s": beyond / sum(r["ops"] for r in rows.values()),
            "blocks": rows, "gemms": shapes}


def framework_op_cost(recipe: str, reps: int) -> dict:
    """Per-op framework seconds: the tiny blocks' forward + backward CPU time over the ops they dispatch."""
    rows = {}
    for kind, block, x, dy, cos, sin in blocks(recipe, TINY):
        forward_backward(block, x, dy, cos, sin)
        with OpLog() as log:
            forward_backward(block, x, dy, cos, sin)
        rows[kind] = {"ops": log.count, "s": cpu_time(lambda: forward_backward(block, x, dy, cos, sin), reps)}
    return {"framework_op_s": sum(r["s"] for r in rows.values()) / sum(r["ops"] for r in rows.values()),
            "tiny_blocks": rows}


def memory_rate(recipe: str, reps: int) -> dict:
    """Elementwise add and mul at the recipe's activation sizes: bytes moved / (time - issue cost)."""
    cfg = load_config(ROOT / recipe, ONE_PROCESS, world_size=1, check=False)
    m, tokens = cfg.model, cfg.train.micro_batch * cfg.train.seq_len
    tiny = torch.ones(1)
    issue = cpu_time(lambda: [torch.add(tiny, tiny), torch.mul(tiny, tiny)], reps) / 2
    moved = seconds = 0.0
    for width in sorted({m.dim, m.ffn_dim, m.moe.ffn_dim}):
        a, b = torch.randn(tokens, width), torch.randn(tokens, width)
        t = cpu_time(lambda: [torch.add(a, b) for _ in range(10)] + [torch.mul(a, b) for _ in range(10)], reps) / 20
        moved, seconds = moved + 3 * a.numel() * 4, seconds + max(t - issue, 1e-9)
    return {"memory_bytes_per_s": moved / seconds, "memory_issue_s": issue}


def _memory_share(recipe: str, out: dict) -> float:
    """The predictor's memory-bound seconds of the blocks' F + B at `memory_bytes_per_s` over their time beyond
    the GEMMs: how much of op_s the predictor counts twice."""
    from ..step_time.model import block_work

    cfg = load_config(ROOT / recipe, ONE_PROCESS, world_size=1, check=False)
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    layers = {"dense": 0, "moe": cfg.model.moe.n_dense_layers}
    memory = sum(3 * block_work(cfg, layers[k]).memory * tokens for k in out["blocks"])  # F 1x, full backward 2x
    return memory / out["memory_bytes_per_s"] / sum(r["s"] - r["gemm_s"] for r in out["blocks"].values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.cpu_costs", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"a CPU recipe (default {DEFAULT_RECIPE})")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per measurement (median; default 30)")
    ap.add_argument("--out", default=None, help=f"write {OUT_NAME} here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": 1, "recipe": args.recipe, "reps": args.reps,
            "torch": torch.__version__, "load_before": load_average()}
    out = {**block_costs(args.recipe, args.reps), **framework_op_cost(args.recipe, args.reps),
           **memory_rate(args.recipe, args.reps)}
    out["memory_share_of_op_s"] = _memory_share(args.recipe, out)
    meta["load_after"] = load_average()
    print(f"op {out['op_s'] * 1e6:.1f} us (framework alone {out['framework_op_s'] * 1e6:.1f}), GEMMs at the recipe's shapes {out['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s, "
          f"memory-bound {out['memory_bytes_per_s'] / 1e9:.1f} GB/s (one thread, CPU time)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out) / OUT_NAME, {"meta": meta, **out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
