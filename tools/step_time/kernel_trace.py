"""Every kernel one micro-batch launches on one rank, by part and phase, traced on the meta device.

The step-time model (tools/step_time/compute.py) prices kernels by their shapes, so it needs the shapes: this
file builds the rank's model with one block of each kind, as tools/planner/block_trace.py does (the recipe's
own mesh on torch's fake process group, the trainer's `build_rank_model`, meta standing for an H100), and runs

    embed   the embedding phase on a (B, S+1) micro-batch
    dense   one dense block on a fresh input (B, S/cp, D) (S/(cp tp) under SP)
    moe     one MoE block, likewise (balanced routing: every expert gets the same tokens)
    head    the final norm, the output head, the loss and the MTP modules

forward (F), then each part's backward as a split schedule runs it: B (input gradients, and whatever the
recompute policy replays) with the Linears' weight gradients deferred, then W. `KernelRecorder`, a
TorchDispatchMode inside the dry run's `StepTracer` (which gives data-dependent ops their shapes), sees every
aten op the trainer's code issues and books it as a kernel:

    gemm / gemm_fp8           mm, addmm, bmm (fp8: _scaled_mm): FLOPs 2 M K N, bytes its operands and output
    grouped_gemm(_fp8)        _grouped_mm (_scaled_grouped_mm): the routed experts
    attention_fwd / _bwd      the fused attention kernels (flash, cuDNN, efficient): FLOPs of QK^T and PV,
                              halved when causal; the backward 2.5x its forward (it recomputes the scores)
    memory                    every other op that writes a tensor (elementwise, norms, copies, gathers): its
                              bytes read and written; views, empties and collectives are not kernels
    ops                       every aten op dispatched (views included): what the host pays per op

Collectives are the planner's business (its traffic rows): they are not booked here.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moe_lc.config import Config, ParallelConfig
from moe_lc.model.block import run_phases
from moe_lc.ops.linear import WeightGradStore
from moe_lc.parallel.build import build_rank_model
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.parallel.parallelize import prepare_batch
from ..dry_run.hash_routing import balance_hash_tables, trace_tokens
from ..dry_run.trace import HostLiterals, StepTracer, balanced_select, position_priority
from ..planner.block_trace import block_kind, on_traced_device, one_block_of_each_kind

META = torch.device("meta")
PHASES = ("F", "B", "W")
GEMMS = {"mm": "gemm", "addmm": "gemm", "bmm": "gemm", "baddbmm": "gemm", "_scaled_mm": "gemm_fp8",
         "_scaled_mm_v2": "gemm_fp8", "_grouped_mm": "grouped_gemm", "_scaled_grouped_mm": "grouped_gemm_fp8"}
NOT_KERNELS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh",
               "_local_scalar_dense", "is_nonzero", "equal", "set_", "resize_", "record_stream", "_unsafe_view",
               "_reshape_alias", "view_as_real", "view_as_complex"}
ATTENTION_BWD = 2.5  # flash attention's backward recomputes the scores: 2.5x the forward FLOPs (FlashAttention-2)


@dataclass(frozen=True)
class Kernel:
    """One kernel shape: its kind, FLOPs, bytes moved (reads + writes) and, for a GEMM, its two operands' bytes."""

    kind: str
    flops: float
    bytes: float
    operands: float = 0.0


@dataclass
class TracedKernels:
    """{part: {phase: Counter(Kernel -> launches)}} and {part: {phase: aten ops dispatched}} of one micro-batch
    on one rank (module docstring); `host_syncs` {part: device-to-host reads}; `params` {part: [(name, local
    shape)]} of the traced model's parameters (the embedding's, one block of each kind, the rest under "head")."""

    kernels: dict[str, dict[str, Counter]] = field(default_factory=dict)
    ops: dict[str, dict[str, int]] = field(default_factory=dict)
    host_syncs: dict[str, int] = field(default_factory=dict)
    params: dict[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)

    def of(self, part: str, phase: str) -> Counter:
        return self.kernels.get(part, {}).get(phase, Counter())


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor) and x.device.type == "meta"]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel moves for `t`: its elements, or its storage where it is a broadcast of a smaller one."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) if t.numel() else 0


def gemm_flops(name: str, args) -> float:
    """FLOPs of one GEMM from its operands' shapes: mm / addmm / _scaled_mm (M, K) x (K, N), bmm / baddbmm
    (b, M, K) x (b, K, N), _grouped_mm (T, K) x (E, K, N) by row groups or its weight gradient (K, T) x (T, N)."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    if a.dim() == 3 and b.dim() == 3:  # bmm
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if b.dim() == 3:  # grouped forward / dgrad: every row meets one expert's (K, N)
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[-1]


def _argument(func, args, kwargs, name: str, default):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, args[i] if i < len(args) else default)
    return default


def attention_flops(func, args, kwargs) -> float:
    """Forward FLOPs of the attention call: 2 B H Sq Sk (Dqk + Dv), halved when causal (q (B, H, Sq, Dqk),
    k (B, Hk, Sk, Dqk), v (B, Hk, Sk, Dv), heads on dim 1 as aten's fused kernels take them)."""
    q, k, v = args[:3] if "backward" not in func.__name__ else args[1:4]
    causal = bool(_argument(func, args, kwargs, "is_causal", False))
    b, h, sq, dqk = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]
    return 2.0 * b * h * sq * k.shape[-2] * (dqk + v.shape[-1]) * (0.5 if causal and sq == k.shape[-2] else 1.0)


def is_attention(name: str) -> bool:
    return any(s in name for s in ("flash_attention", "cudnn_attention", "efficient_attention", "_fused_attention"))


def _is_view(func) -> bool:
    """Whether the op only aliases an input, by its schema (every return annotated as an alias it does not
    write): a view, no kernel. By the schema, not by storages, so that a kernel the tracer answered with an alias
    counts the same in every process."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def classify(func, args, kwargs, out) -> Kernel | None:
    """The kernel an aten op launches, None for a view, an allocation or a collective."""
    name = func.overloadpacket.__name__
    if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") or name in NOT_KERNELS:
        return None
    if _is_view(func):
        return None
    ins, outs = _tensors((args, kwargs)), _tensors(out)
    moved = float(sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs))  # (in place: read, then written)
    if name in GEMMS:
        a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        return Kernel(GEMMS[name], gemm_flops(name, args), moved, float(_nbytes(a) + _nbytes(b)))
    if is_attention(name):
        backward = "backward" in name
        flops = attention_flops(func, args, kwargs) * (ATTENTION_BWD if backward else 1.0)
        return Kernel("attention_bwd" if backward else "attention_fwd", flops, moved)
    return Kernel("memory", 0.0, moved)


class KernelRecorder(TorchDispatchMode):
    """Books every meta op into `into` under the current (part, phase) (module docstring)."""

    def __init__(self, into: TracedKernels):
        super().__init__()
        self.into, self.part, self.phase = into, "embed", "F"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _tensors((args, kwargs, out)):
            return out
        ops = self.into.ops.setdefault(self.part, {})
        ops[self.phase] = ops.get(self.phase, 0) + 1
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "is_nonzero", "equal"):
            self.into.host_syncs[self.part] = self.into.host_syncs.get(self.part, 0) + 1
        kernel = classify(func, args, kwargs, out)
        if kernel is not None:
            self.into.kernels.setdefault(self.part, {}).setdefault(self.phase, Counter())[kernel] += 1
        return out

    @contextlib.contextmanager
    def booking(self, part: str, phase: str):
        self.part, self.phase = part, phase
        yield


_CACHE: dict[str, TracedKernels] = {}


def trace_kernels(cfg: Config) -> TracedKernels:
    """The kernels of `cfg`'s parts on one rank (module docstring); cached per (model, precision, recompute,
    micro-batch, sequence, layout)."""
    key = repr((cfg.model, cfg.precision, cfg.recompute, cfg.train.micro_batch, cfg.train.seq_len,
                _mesh_parallel(cfg.parallel), cfg.data.has_loss_mask))
    if key not in _CACHE:
        _CACHE[key] = _trace(cfg)
    return _CACHE[key]


def _mesh_parallel(p: ParallelConfig) -> ParallelConfig:
    """The layout the pieces run on (as the planner's trace): the recipe's mesh, or where dp is left to the
    world size, pp = 1 and the fewest dp ranks that hold its tp x cp x ep (tools/planner/block_trace.py's
    rule). The pipeline is not built: one block of each kind runs whatever stage holds it."""
    if p.dp:
        return p
    return replace(p, pp=1, dp=p.ep // math.gcd(p.ep, p.cp * p.tp), pp_schedule="1f1b", pp_stage_layers=[])


@contextlib.contextmanager
def _fake_mesh(p: ParallelConfig):
    """ParallelDims of rank 0 of `p`'s mesh, its groups torch's fake process group (no process, no data)."""
    world = p.pp * p.dp * p.cp * p.tp
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("tools/step_time/kernel_trace.py traces on a fake process group of its own: "
                               "call it outside torch.distributed")
        dist.init_process_group("meta:fake,cpu:fake", store=FakeStore(), rank=0, world_size=world)
    try:
        dims = ParallelDims.from_config(p, world, 0, "meta")
        dims.init_groups()
        yield dims
    finally:
        if world > 1:
            dist.destroy_process_group()


def _trace(cfg: Config) -> TracedKernels:
    cfg, device = on_traced_device(position_priority(cfg))
    m = one_block_of_each_kind(cfg.model)
    parallel = _mesh_parallel(cfg.parallel)
    out = TracedKernels()
    with _fake_mesh(parallel) as dims, warnings.catch_warnings(), device:
        warnings.simplefilter("ignore")  # the build's and kernels' notes are the trainer's to give
        small = cfg.replace(model=m, parallel=parallel)
        built = build_rank_model(small, dims, META, pipeline=(None, None), materialized=True,
                                 route=balanced_select, defer_wgrad=True)
        with StepTracer() as tracer, HostLiterals(), KernelRecorder(out) as rec:
            balance_hash_tables(built.module, tracer)  # hash layers route as the planner traces them
            _run_parts(built.module, built.wgrad_store, m, cfg, dims, rec)
        for name, p in built.module.named_parameters():
            out.params.setdefault(_param_part(m, name), []).append((name, tuple(p.shape)))
    return out


def _param_part(m, name: str) -> str:
    """The part a parameter of the traced model belongs to: "embed", the kind of its block, else "head"."""
    parts = name.split(".")
    if parts[0] == "layers":
        return block_kind(m, int(parts[1]))
    return "embed" if parts[0].startswith("embed") else "head"


def _run_parts(model, store, m, cfg: Config, dims: ParallelDims, rec: KernelRecorder) -> None:
    """F of the embedding, one block of each kind and the head (each block and the head on a fresh input),
    then each one's B (weight gradients deferred) and W."""
    t = cfg.train
    tokens = trace_tokens(m, (t.micro_batch, t.seq_len + 1), META)  # ids a hash layer reads
    mask = torch.ones(t.micro_batch, t.seq_len, device=META) if cfg.data.has_loss_mask else None
    with rec.booking("embed", "F"):
        batch = prepare_batch(tokens, mask, dims, m.mtp.depth)
        tables = []
        hook = model.rope.register_forward_hook(lambda mod, args, o: tables.extend(o))
        chain = model.phases(batch["positions"], batch["labels"], batch["loss_mask"], batch["mtp"],
                             tokens=batch["inputs"])
        hook.remove()
        h = chain[0](batch["inputs"])[0]
    outputs = [("embed", batch["inputs"], h)]
    for i, block in model.layers.items():
        kind = block_kind(m, int(i))
        x = torch.empty_like(h).requires_grad_()
        with rec.booking(kind, "F"):
            outputs.append((kind, x, run_phases(block.phases(*tables, tokens=batch["inputs"]), x)))
    x = torch.empty_like(h).requires_grad_()
    with rec.booking("head", "F"):
        outputs.append(("head", x, chain[-1](x)[0]))
    for part, x, y in outputs:
        with rec.booking(part, "B"), store.deferring():
            y.backward(torch.empty_like(y))
        with rec.booking(part, "W"):
            WeightGradStore.run(store.take())
        for p in model.parameters():
            p.grad = None
