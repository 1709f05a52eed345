"""Trainer: `python -m moe_lc.train RECIPE.toml [--set KEY=VALUE ...]`, torchrun-compatible.

One optimizer step = `global_batch` sequences: each data-parallel rank runs its share as
micro-batches (gradient accumulation), each micro-batch loss is the summed token loss divided by
the step's token count, so losses and gradients are the same under any valid layout.

Here: the trainer's build, its step and its loop, and main(). The job's pieces are in moe_lc/job/: the
start of a run (data, resume or init_from, loggers: run_start.py), a step's reductions and metrics
(step.py, metrics.py), checkpoints, stops and interrupts (checkpoint.py, stop_signal.py).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from moe_lc import cpu_threads

cpu_threads.passive_wait_if_shared()  # before torch loads the OpenMP runtime, which reads the policy once
import torch  # noqa: E402

from moe_lc.job import checkpoint as ckpt
from moe_lc import faults
from moe_lc.job import run_dir
from moe_lc.config import Config, ConfigError, load_config, to_toml
from moe_lc.data.mixture_sources import drawn_tokens, source_names
from moe_lc.job.lr_schedule import lr_at
from moe_lc.job.metrics import MetricsLogger, StepRow, import_wandb
from moe_lc.parallel.qk_clip import QKClip
from moe_lc.parallel import comm
from moe_lc.parallel.build import build_rank_model, pipeline_plan
from moe_lc.parallel.mesh import ParallelDims, init_distributed
from moe_lc.parallel.zero.param_gather import install_holds
from moe_lc.parallel.parallelize import full_state_dict, prepare_batch
from moe_lc.parallel.pipeline.runtime import PipelineRuntime
from moe_lc.model.residual_stream import stream_dims
from moe_lc.parallel.zero.optimizer import ZeroOptimizer
from moe_lc.parallel.zero.strategies import ZeroPlacement
from moe_lc.job.preflight import preflight, refuse_unusable_fp8, resolve_device
from moe_lc.job.recipe_error_exit import exit_on_recipe_error
from moe_lc.job.run_start import build_data, start_run
from moe_lc.job.timeline import traced_step
from moe_lc.job.stop_signal import Interrupted, StopRequest, Stopped, interrupted_line
from moe_lc.job.step import (KindTraining, StepResult, balance_routers, document_attention_metrics, forward_backward,
                             mtp_losses, source_losses, step_token_count, tell_skipped)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    final_state: dict | None = None  # unsharded parameters (rank 0, when asked for)
    comm_per_step: list[dict] = field(default_factory=list)
    optimizer_state_bytes: int = 0
    compile_per_step: list[dict] = field(default_factory=list)  # this rank's CompileWatch counts after each step


class Trainer:
    """Owns the model, optimizer, data and logging of one rank."""

    route = None  # a router selection replacing the learned one (the dry run's balanced routing)

    def __init__(self, cfg: Config, device: torch.device | None = None):
        """device: where this rank's tensors live (default: from train.device; the dry run passes meta)."""
        self.cfg = cfg
        t, p = cfg.train, cfg.precision
        self.device = device if device is not None else resolve_device(t.device)
        self.threads = cpu_threads.apply_threads(t.threads, "train.threads")  # before any parallel op
        rank, world = init_distributed(cfg.parallel.timeout_s, self.device.type)
        self.dims = ParallelDims.from_config(cfg.parallel, world, rank, self.device.type)
        self.dims.init_groups()
        self.microbatches = t.microbatches(self.dims.dp)  # per step on each pipeline (data-parallel rank)
        # (schedule, stage layers) under pp > 1; the recipe's rules already refused what cannot be scheduled
        self.schedule, self.stage_layers = pipeline_plan(cfg, self.microbatches)
        self.is_logger = rank == 0
        self.dp_rank = self.dims.coords()["dp"]
        self.tokenizer, self.loader = self.build_data()
        refuse_unusable_fp8(p, self.device)  # before building anything
        self.kind = KindTraining.of(cfg.model)  # the attention kind's part of each step (DSA's warm-up, metrics)
        zero3 = ZeroPlacement.from_config(cfg.parallel.placement).params_gathered  # no rank holds its whole model
        self.parallel = build_rank_model(cfg, self.dims, self.device, pipeline=(self.schedule, self.stage_layers),
                                         route=self.route, defer_params=zero3)
        self.model = self.parallel.module.train()
        self.compile_watch = self.parallel.compile_watch  # train.compile: the layer plan compiled the regions
        self.runtime = None
        if self.schedule is not None:
            seq_local = t.seq_len // self.dims.cp // self.dims.tp  # sequence-parallel shards between stages
            self.runtime = PipelineRuntime(self.schedule, self.dims.coords()["pp"], self.parallel.chunks,
                                           self.dims["pp"], (t.micro_batch, seq_local, *stream_dims(cfg.model)),
                                           p.compute_dtype, self.device, overlap=self.dims.overlap,
                                           store=self.parallel.wgrad_store)
        self.optimizer = ZeroOptimizer.from_config(cfg, self.parallel, self.dims)
        # ZeRO-3's unit gathers, or a deferring offloaded optimizer's updates, around each forward chain
        self.param_gather = install_holds(self.optimizer, self.parallel)
        self.qk_clip = None  # QK-clip (moe_lc/parallel/qk_clip.py): heads' logits bounded by train.qk_clip
        if t.qk_clip:  # the statistic is per local head: reduced over the attention weights' dp x cp replicas
            self.qk_clip = QKClip(self.model, t.qk_clip, self.dims["dp_cp"], self.dims["world"], cfg.model.n_layers,
                                  cfg.model.mtp.depth)
        self.step = 0
        self.nonfinite_skipped = 0
        self.stop, self.stop_signal = StopRequest(), 0  # SIGTERM / SIGUSR1: stop after the step (job/stop_signal.py)
        self.checkpointer = ckpt.Checkpointer(self.checkpoint_root(), self.dims, keep=cfg.checkpoint.keep,
                                              async_save=cfg.checkpoint.async_save)
        self.row = StepRow(cfg, self.device, self.dims.world)  # loss, lr, throughput, MFU of each step

    def build_data(self):
        """(tokenizer, StepLoader of this dp rank) from [data] (job/run_start.py; the dry run's replaces it)."""
        return build_data(self.cfg, self.dp_rank, self.dims.dp)

    # -- one optimizer step ---------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        t, m, d = self.cfg.train, self.cfg.model, self.cfg.data
        first_sample = self.loader.samples_consumed
        micro = self.loader.next_step()
        n_tokens = step_token_count(micro, t.global_batch * t.seq_len, self.dims, self.device)
        batches = []
        sources = source_names(self.loader.dataset)
        for mb in micro:
            mask = mb["loss_mask"].to(self.device) if mb["loss_mask"] is not None else None
            batches.append(prepare_batch(mb["tokens"].to(self.device), mask, self.dims, m.mtp.depth,
                                         mb.get("documents"), d.document_mask, d.document_positions,
                                         self.cfg.parallel.cp_layout))
            batches[-1]["sources"] = mb["source"].to(self.device) if sources else None
        scale = 1.0 / n_tokens
        if faults.armed("nan_loss", self.step + 1, self.dims.rank):
            scale = float("nan")
        self.optimizer.begin_step(self.runtime.grad_arrivals() if self.runtime is not None else len(batches))
        if self.qk_clip is not None:
            self.qk_clip.reset()
        with self.compile_watch.watching() if self.compile_watch is not None else contextlib.nullcontext():
            loss_sum, stats = forward_backward(self.model, self.runtime, batches, scale, n_tokens, len(sources))
        if self.param_gather is not None:
            self.param_gather.sweep()
        # every token's loss lives on one (pp, dp, cp) rank and on all tp ranks alike
        comm.all_reduce(loss_sum, self.dims["world"])
        loss_sum /= self.dims.tp
        metrics, mtp_sum = mtp_losses(stats.mtp_loss_sums, m.mtp.depth, m.mtp.loss_weight, self.dims, n_tokens,
                                      self.device)
        if mtp_sum:  # log the next-token loss (comparable with MTP off) and the objective apart
            metrics["loss_objective"] = loss_sum.item() / n_tokens
            loss_sum -= mtp_sum
        row_scales, clip_metrics = self.qk_clip.row_scales() if self.qk_clip is not None else ({}, {})
        metrics.update(clip_metrics)
        grad_norm, applied = self.optimizer.step(lr_at(self.step, t), row_scales=row_scales)
        metrics.update(balance_routers(self.model, stats, self.dims, frozen=self.kind.routers_frozen))
        metrics.update(document_attention_metrics(batches, self.dims, self.device))
        metrics.update(source_losses(stats, sources, self.dims, self.device))
        metrics.update(self.kind.metrics(stats, self.dims, self.device))
        if self.is_logger:  # tokens per mixture source over the whole step: a pure function of the indices
            metrics.update(drawn_tokens(self.loader.dataset, first_sample, t.global_batch, t.seq_len))
        faults.maybe_signal(self.step + 1, self.dims.rank)
        self.stop_signal = self.stop.agreed(self.dims["world"], self.device)  # the same on every rank
        return StepResult(loss_sum.item() / n_tokens, grad_norm, applied, metrics)

    # -- checkpoints --------------------------------------------------------------------------------
    def _train_state(self) -> dict:
        return {"step": self.step, "nonfinite_skipped": self.nonfinite_skipped, "data": self.loader.state_dict()}

    def checkpoint_root(self) -> Path:
        return run_dir.checkpoint_root(self.cfg)

    @contextlib.contextmanager
    def params_present(self):
        """A context within which every parameter of this rank's model and every master is up to date and present
        (a deferring offloaded optimizer's updates done; ZeRO-3 gathers them all)."""
        self.optimizer.flush()
        with self.param_gather.gathered() if self.param_gather is not None else contextlib.nullcontext():
            yield

    def save(self) -> Path:
        with self.params_present():
            bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(p).all()]
            if bad:  # the non-finite guard skips such updates; never write them
                raise FloatingPointError(f"refusing to save non-finite parameters: {bad[:5]}")
            return self.checkpointer.save(self.step, self.parallel, self.optimizer, self._train_state())

    def try_resume(self, path: Path | None = None) -> Path | None:
        """Load `path` (default: the newest committed checkpoint of checkpoint.dir), if any."""
        with self.params_present():
            path, train = self.checkpointer.resume(self.parallel, self.optimizer, self._train_state(), path)
        if path is not None and self.param_gather is not None:  # ZeRO-3: the shards from the loaded masters
            for shard in self.optimizer.shards:
                shard.gather_params()
        if path is not None:
            self.step = int(train["step"])
            self.nonfinite_skipped = int(train["nonfinite_skipped"])
            self.loader.load_state_dict(train["data"])
        return path

    # -- the loop -----------------------------------------------------------------------------------
    def fit(self, keep_final_state: bool = False, plan: run_dir.RunPlan | None = None) -> TrainResult:
        """Train to train.steps. `plan`: main()'s run-directory decision, made before the process group
        (computed here, on every rank alike, when absent). Ctrl-C raises `Interrupted` once an
        asynchronous save in flight is done, with metrics.jsonl closed; SIGTERM / SIGUSR1 raise `Stopped`
        after the step in progress and its checkpoint."""
        logger = start_run(self, plan or run_dir.check(self.cfg))  # resume or init_from, the loggers, the banner
        result = TrainResult(optimizer_state_bytes=self.optimizer.state_bytes())
        self.stop.install()
        try:
            self._loop(logger, result)
            self.checkpointer.wait()
            if self.optimizer.ema is not None:
                self.optimizer.ema.wait()
        except KeyboardInterrupt:
            raise Interrupted(interrupted_line(self.checkpointer, self.checkpoint_root(), self.step, logger)) from None
        finally:
            self.stop.restore()
            logger.close()
        if self.stop_signal and self.step < self.cfg.train.steps:
            raise Stopped(self.stop_signal, self.step, ckpt.latest_checkpoint(self.checkpoint_root()))
        if keep_final_state:
            with self.params_present():
                result.final_state = full_state_dict(self.parallel, self.dims)
        return result

    def _loop(self, logger: MetricsLogger, result: TrainResult) -> None:
        cfg, t = self.cfg, self.cfg.train
        first, saved = self.step, None
        while self.step < t.steps:
            self.dims.counter.reset()
            start = time.perf_counter()
            lr = lr_at(self.step, t)
            with traced_step(self, self.step + 1 == t.trace_step):
                step = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if not step.applied:  # the non-finite guard: stops past train.max_nonfinite_steps
                self.nonfinite_skipped += 1
                tell_skipped(self.step + 1, step, self.nonfinite_skipped, t.max_nonfinite_steps, logger)
            self.step += 1
            metrics = self.row(step, lr, elapsed, self.nonfinite_skipped)
            if self.compile_watch is not None:  # at the first and last steps: the counts (and start-up line)
                metrics.update(self.compile_watch.after_step(self.step == first + 1, self.step == t.steps,
                                                             self.dims["world"], logger.event))
                result.compile_per_step.append(self.compile_watch.counts())
            comm_bytes = self.dims.counter.as_dict()
            metrics.update(comm_bytes)
            metrics.update(self.dims.counter.times())  # comm/<group>/time_s, exposed_s (comm_timing.py)
            logger.log(self.step, metrics)
            result.losses.append(step.loss)
            result.grad_norms.append(step.grad_norm)
            result.comm_per_step.append(comm_bytes)
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                saved = self._save(logger)
            faults.maybe_exit(self.step, self.dims.rank)
            if self.stop_signal:
                break
        if (cfg.checkpoint.save_final or self.stop_signal) and self.step > first and saved != self.step:
            self._save(logger)  # the end of the run, so eval and to-hf find the weights (or the resume after a stop)

    def _save(self, logger: MetricsLogger) -> int:
        logger.event(f"checkpoint {'started' if self.cfg.checkpoint.async_save else 'saved'}: {self.save()}")
        return self.step


def run(cfg: Config, keep_final_state: bool = False, plan: run_dir.RunPlan | None = None) -> TrainResult:
    """Train with a validated config in this process (one rank of the job). `plan`: the run-directory
    decision (`run_dir.check`), made here, before the process group, when absent."""
    plan = plan or run_dir.check(cfg)
    return Trainer(cfg).fit(keep_final_state, plan)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m moe_lc.train", description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="recipe TOML file (see recipes/)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe key, e.g. --set train.lr=1e-3 (repeatable)")
    ap.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    ap.add_argument("--docs", action="store_true", help="with --print-config: a comment per field")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """Exit status: 0 done, 1 non-finite final loss, 2 bad recipe / checkpoint / run directory, 3 stopped
    by the non-finite guard, 130 interrupted (Ctrl-C), 128 + N stopped with a checkpoint by signal N (143
    SIGTERM, 138 SIGUSR1; moe_lc/job/stop_signal.py). Every rank returns the same status; a recipe error (the
    same on every rank) is printed by rank 0."""
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(args.recipe, args.set, world_size=world, warnings=(warnings := []))
        if not args.print_config:
            preflight(cfg, world)
            if "wandb" in cfg.train.loggers:
                import_wandb()
            plan = run_dir.check(cfg)  # may this run write into train.output_dir? (before any process group)
    except ConfigError as exc:
        return exit_on_recipe_error(exc, rank, world)
    sys.stderr.writelines(f"warning: {w}\n" for w in warnings if rank == 0)  # legal, likely mistaken
    if args.print_config:
        print(to_toml(cfg, docs=args.docs))
        return 0
    try:
        result = run(cfg, plan=plan)
        if torch.distributed.is_initialized():
            # every rank's last collective has drained before any rank tears its pairs down (a gloo
            # rank that destroys its group while a peer still reads from it can abort the peer)
            torch.distributed.barrier()
    except Stopped as exc:  # every rank stopped after the same step, its checkpoint committed
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # as after a finished run
        if rank == 0:
            print(exc, file=sys.stderr, flush=True)
        return 128 + exc.signum
    except (Interrupted, KeyboardInterrupt) as exc:
        if rank == 0:
            print(exc if isinstance(exc, Interrupted) else "interrupted before the first step", file=sys.stderr,
                  flush=True)
        return 130
    except (ConfigError, ckpt.CheckpointError) as exc:
        print(f"error{f' (rank {rank})' if world > 1 else ''}: {exc}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:
        print(f"error{f' (rank {rank})' if world > 1 else ''}: {exc}", file=sys.stderr)
        return 3
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if result.losses and not math.isfinite(result.losses[-1]):
        return 1
    return 0


def cli() -> None:
    """The `moe-train` console script: main() with the exit a multi-process job needs."""
    from moe_lc.parallel.mesh import exit_process

    exit_process(main())


if __name__ == "__main__":
    cli()
