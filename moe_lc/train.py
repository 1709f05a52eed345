"""Trainer: `python -m moe_lc.train RECIPE.toml [--set KEY=VALUE ...]`, torchrun-compatible.

One optimizer step = `global_batch` sequences: each data-parallel rank runs its share as
micro-batches (gradient accumulation), each micro-batch loss is the summed token loss divided by
the step's token count, so losses and gradients are the same under any valid layout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
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
from moe_lc.data import StepLoader, dataset_from_config, load_tokenizer
from moe_lc.data.mixture_sources import drawn_tokens, format_report, mixture_report, source_names
from moe_lc.job.lr_schedule import lr_at
from moe_lc.job.metrics import MetricsLogger, import_wandb, make_sinks, peak_flops
from moe_lc.model.counting import param_counts, train_flops_per_token, train_flops_with_documents
from moe_lc.ops import fp8_te
from moe_lc.ops.fp8_linear import gemm_recipe
from moe_lc.optim import build_rule
from moe_lc.parallel.qk_clip import QKClip
from moe_lc.parallel import comm
from moe_lc.parallel.build import build_rank_model, pipeline_plan
from moe_lc.parallel.mesh import ParallelDims, init_distributed
from moe_lc.parallel.zero.param_gather import install_holds
from moe_lc.parallel.parallelize import (full_state_dict, no_weight_decay_names, param_lr_scale, prepare_batch,
                                         zero_param_groups)
from moe_lc.parallel.pipeline.runtime import PipelineRuntime
from moe_lc.parallel.zero.optimizer import ZeroOptimizer
from moe_lc.job.preflight import init_from_checkpoint, preflight, resolve_device
from moe_lc.job.recipe_error_exit import exit_on_recipe_error
from moe_lc.job.timeline import traced_step
from moe_lc.job.stop_signal import StopRequest, Stopped
from moe_lc.job.step import (StepResult, balance_routers, document_attention_metrics, dsa_metrics, forward_backward,
                             mtp_losses, source_losses, step_token_count)


class Interrupted(Exception):
    """Ctrl-C during training; the message is the one line for the user (main() exits with 130)."""


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
        if p.recipe == "fp8" and p.fp8_backend == "te":  # refuse before building anything
            reason = fp8_te.unsupported_reason(self.device, gemm_recipe(p.fp8_scaling))
            if reason is not None:
                raise ConfigError([f"precision.fp8_backend='te': {reason}"])
        zero3 = cfg.parallel.placement.params == "sharded_gather"  # no rank holds its whole local model, ever
        self.parallel = build_rank_model(cfg, self.dims, self.device, pipeline=(self.schedule, self.stage_layers),
                                         route=self.route, defer_params=zero3)
        self.model = self.parallel.module.train()
        self.compile_watch = self.parallel.compile_watch  # train.compile: the layer plan compiled the regions
        self.runtime = None
        if self.schedule is not None:
            seq_local = t.seq_len // self.dims.cp // self.dims.tp  # sequence-parallel shards between stages
            self.runtime = PipelineRuntime(self.schedule, self.dims.coords()["pp"], self.parallel.chunks,
                                           self.dims["pp"], (t.micro_batch, seq_local, cfg.model.dim),
                                           p.compute_dtype, self.device, overlap=self.dims.overlap,
                                           store=self.parallel.wgrad_store)
        self.optimizer = ZeroOptimizer(
            zero_param_groups(self.parallel, self.dims, param_lr_scale(cfg)), self.dims["world"],
            build_rule(t, p, cfg.model), grad_clip=t.grad_clip, bucket_mb=cfg.parallel.zero_bucket_mb,
            no_decay=no_weight_decay_names(self.model), ema_decay=t.ema_decay, shard_groups=self.dims.groups,
            grads=cfg.parallel.placement.grads, optimizer=cfg.parallel.placement.optimizer,
            params=cfg.parallel.placement.params, optimizer_overlap=cfg.parallel.placement.optimizer_overlap,
            initial_value=self.parallel.initial_value)
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
        self.flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
        self.peak = peak_flops(self.device, p.recipe, t.peak_tflops)

    def build_data(self):
        """(tokenizer, StepLoader of this dp rank) from [data]; ConfigError on a bad tokenizer or data."""
        cfg, t = self.cfg, self.cfg.train
        try:
            tokenizer = load_tokenizer(cfg.data.tokenizer)
        except (ValueError, FileNotFoundError, ImportError) as exc:
            raise ConfigError([f"data.tokenizer={cfg.data.tokenizer!r}: {exc}"]) from None
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError([f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                               f"{tokenizer.vocab_size} tokens ({cfg.data.tokenizer})"])
        try:
            dataset = dataset_from_config(cfg.data, split="train", seq_len=t.seq_len, seed=t.seed, tokenizer=tokenizer)
        except (ValueError, FileNotFoundError) as exc:  # missing, short or mismatched data files
            raise ConfigError([f"data: {exc}"]) from None
        return tokenizer, StepLoader(dataset, t.global_batch, t.micro_batch, self.dp_rank, self.dims.dp)

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
        metrics.update(balance_routers(self.model, stats, self.dims, frozen=m.dsa.enabled and m.dsa.stage == "warmup"))
        metrics.update(document_attention_metrics(batches, self.dims, self.device))
        metrics.update(source_losses(stats, sources, self.dims, self.device))
        metrics.update(dsa_metrics(stats, m.dsa.stage if m.dsa.enabled else None, self.dims, self.device))
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
        logger = self._start(plan or run_dir.check(self.cfg))
        result = TrainResult(optimizer_state_bytes=self.optimizer.state_bytes())
        self.stop.install()
        try:
            self._loop(logger, result)
            self.checkpointer.wait()
            if self.optimizer.ema is not None:
                self.optimizer.ema.wait()
        except KeyboardInterrupt:
            raise Interrupted(self._interrupted(logger)) from None
        finally:
            self.stop.restore()
            logger.close()
        if self.stop_signal and self.step < self.cfg.train.steps:
            raise Stopped(self.stop_signal, self.step, ckpt.latest_checkpoint(self.checkpoint_root()))
        if keep_final_state:
            with self.params_present():
                result.final_state = full_state_dict(self.parallel, self.dims)
        return result

    def _start(self, plan: run_dir.RunPlan) -> MetricsLogger:
        """Act on the run-directory plan: run.json (rank 0), resume or init_from, metrics truncated after
        the resumed step, the loggers, config.toml and the banner."""
        cfg, t = self.cfg, self.cfg.train
        out, run_id, group = Path(t.output_dir), None, torch.distributed.is_initialized()
        if group:
            torch.distributed.barrier()  # every rank has made its decision (check) before rank 0 writes
        if self.is_logger:
            run_id = self.checkpointer.run_id = run_dir.prepare(plan)
            self.checkpointer.on_commit = lambda step, path: run_dir.record_checkpoint(out, step, path)
        if group:
            torch.distributed.barrier()  # run.json and a cleared directory before anyone reads or saves
        resumed = self.try_resume(plan.checkpoint) if plan.action == "resume" else None
        continuing = plan.action in ("resume", "restart")
        dropped = run_dir.truncate_metrics(out, self.step) if continuing and self.is_logger else 0
        sinks = (make_sinks(t, out, dataclasses.asdict(cfg), run_id, self.step + 1 if continuing else None)
                 if self.is_logger else None)  # TensorBoard hides what an interrupted run logged past the resume
        logger = MetricsLogger(out, self.is_logger, t.steps, t.log_interval, resume=continuing, sinks=sinks)
        if plan.note:
            logger.event(plan.note)
        if dropped:
            logger.event(f"{run_dir.METRICS}: dropped {dropped} line(s) logged after step {self.step}, the step "
                         "resumed (those steps run again)")
        if resumed is None and cfg.checkpoint.init_from:
            source = init_from_checkpoint(cfg)
            self.checkpointer.load_weights(source, self.parallel, self.optimizer)
            logger.event(f"weights from {source} (checkpoint.init_from); step 0, fresh optimizer and data")
        if self.is_logger:
            (out / "config.toml").write_text(to_toml(cfg))
            self._banner(resumed)
            self._mixture_report(out, logger)
        return logger

    def _mixture_report(self, out: Path, logger: MetricsLogger) -> None:
        """A mixture's draw per source over this run's remaining samples: printed, and kept in
        <output_dir>/data_mixture.json."""
        t, first = self.cfg.train, self.loader.samples_consumed
        report = mixture_report(self.loader.dataset, first, t.steps * t.global_batch - first, t.seq_len)
        if report is not None and report["samples"]:
            logger.event(format_report(report))
            (out / "data_mixture.json").write_text(json.dumps(report, indent=1) + "\n")

    def _loop(self, logger: MetricsLogger, result: TrainResult) -> None:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step, first, saved = t.global_batch * t.seq_len, self.step, None
        while self.step < t.steps:
            self.dims.counter.reset()
            start = time.perf_counter()
            lr = lr_at(self.step, t)
            with traced_step(self, self.step + 1 == t.trace_step):
                step = self.train_step()
            loss, grad_norm = step.loss, step.grad_norm
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if not step.applied:
                self._skipped(loss, grad_norm, logger)
            self.step += 1
            metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / elapsed,
                       "step_time": elapsed, "skipped_steps": self.nonfinite_skipped}
            if self.peak:
                flops = (self.flops_per_token * tokens_per_step if "attn/doc_work" not in step.metrics else
                         train_flops_with_documents(cfg.model, t.seq_len, tokens_per_step, step.metrics["attn/doc_work"]))
                metrics["mfu"] = flops / elapsed / (self.peak * self.dims.world)
            metrics.update(step.metrics)
            if self.compile_watch is not None:  # at the first and last steps: the counts (and start-up line)
                metrics.update(self.compile_watch.after_step(self.step == first + 1, self.step == t.steps,
                                                             self.dims["world"], logger.event))
                result.compile_per_step.append(self.compile_watch.counts())
            comm_bytes = self.dims.counter.as_dict()
            metrics.update(comm_bytes)
            metrics.update(self.dims.counter.times())  # comm/<group>/time_s, exposed_s (comm_timing.py)
            logger.log(self.step, metrics)
            result.losses.append(loss)
            result.grad_norms.append(grad_norm)
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

    def _skipped(self, loss: float, grad_norm: float, logger: MetricsLogger) -> None:
        """The non-finite guard: count a skipped update, stop past train.max_nonfinite_steps."""
        t = self.cfg.train
        self.nonfinite_skipped += 1
        logger.event(f"step {self.step + 1}: non-finite loss/grad norm ({loss}, {grad_norm}); update "
                     f"skipped ({self.nonfinite_skipped}/{t.max_nonfinite_steps})")
        if self.nonfinite_skipped > t.max_nonfinite_steps:
            raise FloatingPointError(
                f"stopping: {self.nonfinite_skipped} steps with a non-finite loss or grad norm "
                f"(train.max_nonfinite_steps={t.max_nonfinite_steps}); last checkpoint is intact")

    def _interrupted(self, logger: MetricsLogger) -> str:
        """Ctrl-C: wait for an asynchronous save in flight (a second Ctrl-C abandons it: its .tmp directory
        is never read); the one line for the user."""
        abandoned = ""
        if self.checkpointer.saving:
            logger.event("interrupted: waiting for the checkpoint being saved (Ctrl-C again to abandon it)")
            try:
                self.checkpointer.wait(barrier=False)
            except (KeyboardInterrupt, ckpt.CheckpointError):
                abandoned = "; the checkpoint being saved was abandoned"
        latest = ckpt.latest_checkpoint(self.checkpoint_root())
        where = (f"last checkpoint: {latest} (resume with --set checkpoint.resume=true)" if latest
                 else "no checkpoint saved (set checkpoint.interval)")
        return f"interrupted at step {self.step}; {where}{abandoned}"

    def _banner(self, resumed: Path | None) -> None:
        c = param_counts(self.cfg.model)
        t = self.cfg.train
        print(f"moe_lc | {c['total'] / 1e6:.2f}M params ({c['activated'] / 1e6:.2f}M activated) | "
              f"{self.dims.describe()} | device {self.device} | precision {self.cfg.precision.recipe} | "
              f"{self.threads.describe()}", flush=True)
        print(f"moe_lc | {t.steps} steps x {t.global_batch} seqs x {t.seq_len} tokens, "
              f"{self.microbatches} micro-batches of {t.micro_batch} per rank | output {t.output_dir}"
              + (f" | resumed from {resumed}" if resumed else ""), flush=True)


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
