"""What a run does before its first step, on every rank (the trainer, moe_lc/train.py, calls these): its
data from [data], and `start_run`, which acts on the run-directory plan (moe_lc/job/run_dir.py): run.json
and a cleared directory (rank 0), the resume or checkpoint.init_from, metrics.jsonl truncated after the
resumed step, the metrics logger and its sinks, config.toml, the banner and the data mixture's report.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from moe_lc.config import Config, ConfigError, to_toml
from moe_lc.data import StepLoader, dataset_from_config, load_tokenizer
from moe_lc.data.mixture_sources import format_report, mixture_report
from moe_lc.job import run_dir
from moe_lc.job.metrics import MetricsLogger, make_sinks
from moe_lc.job.preflight import init_from_checkpoint
from moe_lc.model.counting import param_counts


def build_data(cfg: Config, dp_rank: int, dp: int):
    """(tokenizer, StepLoader of data-parallel rank `dp_rank` of `dp`) from [data]; ConfigError on a bad
    tokenizer or data."""
    t = cfg.train
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
    return tokenizer, StepLoader(dataset, t.global_batch, t.micro_batch, dp_rank, dp)


def start_run(trainer, plan: run_dir.RunPlan) -> MetricsLogger:
    """Act on the run-directory plan for `trainer` (a moe_lc.train.Trainer, before its first step): run.json
    (rank 0), resume or init_from, metrics truncated after the resumed step, the loggers, config.toml and the
    banner. Returns the run's logger (the caller closes it)."""
    cfg, t, logs = trainer.cfg, trainer.cfg.train, trainer.is_logger
    out, run_id, group = Path(t.output_dir), None, torch.distributed.is_initialized()
    if group:
        torch.distributed.barrier()  # every rank has made its decision (check) before rank 0 writes
    if logs:
        run_id = trainer.checkpointer.run_id = run_dir.prepare(plan)
        trainer.checkpointer.on_commit = lambda step, path: run_dir.record_checkpoint(out, step, path)
    if group:
        torch.distributed.barrier()  # run.json and a cleared directory before anyone reads or saves
    resumed = trainer.try_resume(plan.checkpoint) if plan.action == "resume" else None
    continuing = plan.action in ("resume", "restart")
    dropped = run_dir.truncate_metrics(out, trainer.step) if continuing and logs else 0
    sinks = (make_sinks(t, out, dataclasses.asdict(cfg), run_id, trainer.step + 1 if continuing else None)
             if logs else None)  # TensorBoard hides what an interrupted run logged past the resume
    logger = MetricsLogger(out, logs, t.steps, t.log_interval, resume=continuing, sinks=sinks)
    if plan.note:
        logger.event(plan.note)
    if dropped:
        logger.event(f"{run_dir.METRICS}: dropped {dropped} line(s) logged after step {trainer.step}, the step "
                     "resumed (those steps run again)")
    if resumed is None and cfg.checkpoint.init_from:
        source = init_from_checkpoint(cfg)
        trainer.checkpointer.load_weights(source, trainer.parallel, trainer.optimizer)
        logger.event(f"weights from {source} (checkpoint.init_from); step 0, fresh optimizer and data")
    if logs:
        (out / "config.toml").write_text(to_toml(cfg))
        _banner(trainer, resumed)
        _mixture_report(trainer.loader, t, out, logger)
    return logger


def _mixture_report(loader: StepLoader, t, out: Path, logger: MetricsLogger) -> None:
    """A mixture's draw per source over this run's remaining samples (t: [train]): printed, and kept in
    <output_dir>/data_mixture.json."""
    first = loader.samples_consumed
    report = mixture_report(loader.dataset, first, t.steps * t.global_batch - first, t.seq_len)
    if report is not None and report["samples"]:
        logger.event(format_report(report))
        (out / "data_mixture.json").write_text(json.dumps(report, indent=1) + "\n")


def _banner(trainer, resumed: Path | None) -> None:
    c, t = param_counts(trainer.cfg.model), trainer.cfg.train
    print(f"moe_lc | {c['total'] / 1e6:.2f}M params ({c['activated'] / 1e6:.2f}M activated) | "
          f"{trainer.dims.describe()} | device {trainer.device} | precision {trainer.cfg.precision.recipe} | "
          f"{trainer.threads.describe()}", flush=True)
    print(f"moe_lc | {t.steps} steps x {t.global_batch} seqs x {t.seq_len} tokens, "
          f"{trainer.microbatches} micro-batches of {t.micro_batch} per rank | output {t.output_dir}"
          + (f" | resumed from {resumed}" if resumed else ""), flush=True)
