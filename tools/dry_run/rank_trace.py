"""The dry run's machinery: one rank's training step traced on the meta device (`trace_rank`), the ranks to
trace, and the comparison with the planner; the command line is tools/dryrun.py.

Dry run: one training step of a recipe at its real world size, traced rank by rank on one CPU.

    python tools/dryrun.py RECIPE [--set KEY=VALUE ...] [--ranks first,last|all-roles|N,M,...]
        [--microbatches auto|all] [--json]

"Will this layout fit, and what will it send?" For each traced rank, in this one process: torch's
fake process-group backend at the recipe's world size and that rank, the trainer built exactly as
`python -m moe_lc.train` builds it (parallelize, materialize, ZeRO-1) but on the meta device standing
for an H100, or for a CPU where the recipe runs there (fp32 recipes: tools/planner/block_trace.py
`on_traced_device`, as the planner traces them) (no data, no memory; see moe_lc/ops/device.py), then one `Trainer.train_step`: every
micro-batch through the recipe's pipeline schedule, its recompute policy and precision recipe,
the ZeRO-1 update. tools/dry_run/trace.py watches every op: memory by category and its peak, the
collectives (counted by comm.py as in a real run), host syncs and dtypes NCCL lacks. Each figure
is printed beside the planner's (tools/plan.py) with the difference in percent.

Ranks: "first,last" (default) traces the first and the last pipeline rank (with DualPipe rank 0
holds both ends of the model) and the pipeline rank the planner expects to peak highest; "all-roles" every pipeline rank (under DualPipe one of each mirror
pair r, pp-1-r, which hold the same stages); or global ranks "0,5". Every rank of
one pipeline rank holds experts and the same shapes (data, context, tensor and expert ranks are
symmetric), so one rank per pipeline position covers every role. Data is not read: micro-batches
are token ids on the meta device, routing is balanced (tools/dry_run/trace.py).

Micro-batches: under a pipeline, the fewest whose schedule passes every state the whole step's does
(tools/dry_run/microbatches.py: DualPipe with pp 16 peaks at 32 of 120), so the peak is the step's; the note
printed first says what that leaves out. `--microbatches all` traces every one.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the fake backend warns once per group about hooks

import torch
import torch.distributed as dist

from moe_lc.ops.device import GpuSpec
from moe_lc.parallel.memory.trace_hooks import watch
from moe_lc.train import Trainer
from ..planner.block_trace import on_traced_device
from .hash_routing import balance_hash_tables, trace_tokens
from .microbatches import input_bytes
from .trace import HostLiterals, SavedActivations, StepTracer, balanced_select, position_priority

META = torch.device("meta")
EXACT = ("params", "grads", "optimizer")


class MetaLoader:
    """Micro-batches of a step as the StepLoader shapes them: token ids on the meta device (all zeros
    as far as routing and counts are concerned; 0, 1, 2, ... where hash layers read them: hash_routing.py), a
    CPU loss mask when the data mix has one. One source, one document per sequence (`samples_consumed`,
    `dataset`: what the trainer reads besides the batches)."""

    samples_consumed = 0
    dataset = None

    def __init__(self, cfg, microbatches: int):
        t = cfg.train
        self.n, self.shape, self.model = microbatches, (t.micro_batch, t.seq_len + 1), cfg.model
        self.masked = cfg.data.has_loss_mask

    def next_step(self) -> list[dict]:
        mask = (lambda: torch.ones(self.shape[0], self.shape[1] - 1)) if self.masked else (lambda: None)
        return [{"tokens": trace_tokens(self.model, self.shape, META), "loss_mask": mask()}
                for _ in range(self.n)]

    def state_dict(self) -> dict:
        return {"samples_consumed": 0, "global_batch": 0}


class DryTrainer(Trainer):
    """The trainer on the meta device with `MetaLoader` data and balanced routing (the layer plan puts
    `balanced_select` in every router: every expert gets the same tokens)."""

    route = staticmethod(balanced_select)

    def build_data(self):
        return None, MetaLoader(self.cfg, self.cfg.train.microbatches(self.dims.dp))


def trace_rank(cfg, world: int, rank: int, spec: GpuSpec = GpuSpec()) -> dict:
    """Build and step global rank `rank` of `world` under the tracer -> its report (bytes, counts)."""
    cfg, device = on_traced_device(position_priority(cfg), spec)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved_env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK="0")
    dist.init_process_group("meta:fake,cpu:fake", store=FakeStore(), rank=rank, world_size=world)
    tracer = StepTracer()
    start = time.perf_counter()
    try:
        with device, tracer, HostLiterals(), watch("host_work", tracer.memory.on_host), \
                watch("resized", tracer.memory.resized):
            trainer = DryTrainer(cfg, device=META)
            balance_hash_tables(trainer.model, tracer)  # (hash layers: the tables the planner traces with)
            built = time.perf_counter()
            static = _label_states(trainer, tracer)
            tracer.memory.reset_peak()
            tracer.host_reads.clear()  # the step's, not the build's
            trainer.dims.counter.reset()
            with SavedActivations(tracer.memory).hooks():
                step = trainer.train_step()
                trainer.optimizer.flush()  # a deferred offloaded update is the step's (it runs in the next forward)
        mem = tracer.memory
        return {"rank": rank, "coords": trainer.dims.coords(), "build_s": built - start,
                "step_s": time.perf_counter() - built, "update_applied": step.applied, "ops": tracer.ops, "static_bytes": static,
                "peak_bytes": mem.peak, "saved_bytes": mem.most["saved"], "peak_by_category": {c: mem.at_peak.get(c, 0) for c in
                                                             ("params", "grads", "optimizer", "buffers", "saved",
                                                              "transients")},
                "top_transients": mem.top_transients, "comm": trainer.dims.counter.as_dict(),
                "host_reads": dict(tracer.host_reads.most_common()),
                "host_bytes": trainer.parallel.offload.peak if trainer.parallel.offload is not None else 0,
                "problems": sorted(set(tracer.problems))}
    finally:
        dist.destroy_process_group()
        # the process goes on as it was (a later run in it reads its world size from these)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _label_states(trainer, tracer: StepTracer) -> dict:
    """Label ZeRO's buffers as each group's strategies name them (`ShardedParams.tensors`: parameters,
    gradients, the optimizer's master and state, or host memory when offloaded), call whatever else lives
    after the build `buffers`; -> bytes by state."""
    mem = tracer.memory
    out = dict.fromkeys(EXACT + ("host",), 0)
    for s in trainer.optimizer.shards:
        for category, tensors in s.tensors().items():
            for t in tensors:
                mem.label(t, category)
                out[category] += t.untyped_storage().nbytes()
    mem.label_all_live("buffers")
    out["buffers"] = mem.now["buffers"]
    for s in trainer.optimizer.shards:  # ZeRO-3: each bucket's gathered storage comes and goes within the step
        for t in s.param_store.transient():
            mem.label(t, "transients", only_from="buffers")
    return out


def pick_ranks(spec: str, cfg, world: int, the_plan=None) -> list[int]:
    """Global ranks to trace. `the_plan` (tools/plan.py) names the pipeline rank it expects to peak."""
    p = cfg.parallel
    per_stage = world // p.pp
    if spec == "first,last":
        ranks = {0, (p.pp - 1) * per_stage}
        if the_plan is not None:  # and the planner's worst rank: "does it fit" is a question about that one
            ranks.add(max(the_plan.ranks, key=lambda r: r.peak_bytes()).pp_rank * per_stage)
        return sorted(ranks)
    if spec == "all-roles":  # DualPipe's mirror ranks r and pp-1-r hold the same two stages: one of each pair
        mirrored = p.pp_schedule == "dualpipe" and p.pp > 1
        return [i * per_stage for i in range(p.pp // 2 if mirrored else p.pp)]
    return global_ranks(spec, world)


def global_ranks(spec: str, world: int) -> list[int]:
    """--ranks N,M,... as global ranks; ValueError (one line naming the flag) for anything else."""
    try:
        ranks = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--ranks {spec!r}: expected first,last, all-roles or global ranks like 0,5") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"--ranks {spec!r}: ranks {bad} outside the world of {world}")
    return ranks


def compare(report: dict, rank_plan) -> dict:
    """The traced figures beside the planner's, with the difference in percent of the planner's."""
    planned = rank_plan.memory
    rows = {}
    for key in EXACT:
        rows[key] = (report["static_bytes"][key], planned[key])
    rows["saved activations"] = (report["saved_bytes"], planned["activations"])
    rows["peak"] = (report["peak_bytes"], rank_plan.peak_bytes())
    if report.get("host_bytes") or rank_plan.host_activations:  # train.offload: in host memory, not in the peak
        rows["host (offloaded)"] = (report.get("host_bytes", 0), rank_plan.host_activations)
    if report["static_bytes"].get("host") or sum(rank_plan.host_memory.values()):  # placement.optimizer offloaded
        rows["host (optimizer)"] = (report["static_bytes"].get("host", 0), sum(rank_plan.host_memory.values()))
    comm = {}
    planned_comm = rank_plan.comm_per_step()
    status = {t.key: t.status for t in rank_plan.traffic}
    for key in sorted(set(report["comm"]) | set(planned_comm)):
        if key.endswith("_inter_node_bytes"):
            continue
        comm[key] = (report["comm"].get(key, 0), planned_comm.get(key, 0), status.get(key, "not planned"))
    return {"memory": rows, "comm": comm}


def _pct(traced: float, planned: float) -> str:
    if planned == 0:
        return "  -" if traced == 0 else "  new"
    return f"{100 * (traced - planned) / planned:+.2f}%"


def render(report: dict, cmp: dict) -> str:
    gib = 2**30
    c = report["coords"]
    out = [f"== rank {report['rank']} (pp {c['pp']}, dp {c['dp']}, cp {c['cp']}, tp {c['tp']}, ep {c['ep']}): "
           f"built in {report['build_s']:.1f} s, step traced in {report['step_s']:.1f} s ({report['ops']:,} ops)",
           f"{'memory':<22}{'traced GiB':>12}{'planner GiB':>13}{'diff':>10}"]
    for key, (traced, planned) in cmp["memory"].items():
        out.append(f"{key:<22}{traced / gib:>12.3f}{planned / gib:>13.3f}{_pct(traced, planned):>10}")
    peak = report["peak_by_category"]
    out.append("at the peak: " + ", ".join(f"{k} {v / gib:.3f}" for k, v in peak.items()) + " GiB")
    out.append("planner's transients: " + ", ".join(f"{k} {v / gib:.3f}" for k, v in report["planner_transients"].items())
               + " GiB")
    out.append("largest transients near the peak: " + ", ".join(f"{what} {n / 2**20:,.1f} MiB"
                                                                 for n, what in report["top_transients"]))
    out.append(f"{'bytes sent per step':<36}{'traced':>18}{'planner':>18}{'diff':>10}")
    for key, (traced, planned, status) in cmp["comm"].items():
        mark = "" if status == "exact" else f"  [{status}]"
        out.append(f"{key:<36}{traced:>18,}{planned:>18,.0f}{_pct(traced, planned):>10}{mark}")
    out.append("host syncs (device -> host reads) per step:")
    out += [f"  {n:>6} x {site}" for site, n in report["host_reads"].items()] or ["  none"]
    out += [f"PROBLEM: {p}" for p in report["problems"]]
    return "\n".join(out)


def microbatch_note(cfg, whole: int, traced: int) -> str:
    """What tracing `traced` of the step's `whole` micro-batches leaves out ('' when it traces them all)."""
    if traced == whole:
        return ""
    extra = input_bytes(cfg, cfg.parallel.cp, whole - traced)
    return (f"micro-batches: {traced} of the step's {whole} per pipeline traced: from {traced} on every pipeline "
            f"rank's schedule passes the same states, so each peak below is the whole step's but for the other "
            f"{whole - traced} micro-batches' inputs ({extra / 2**20:,.2f} MiB more); the bytes sent per "
            f"micro-batch are for {traced} ({whole / traced:.2f}x for the whole step); --microbatches all traces "
            f"all {whole}")

