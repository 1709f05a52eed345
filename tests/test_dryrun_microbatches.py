"""The dry run traces the fewest micro-batches whose pipeline schedule peaks as the whole step does
(tools/dry_run/microbatches.py): the planner's walk and a traced step give the same peak, less only the
inputs of the micro-batches left out, which the dry run states."""

import random

import pytest

from moe_lc.config import load_config
from moe_lc.parallel.pipeline import build_schedule
from tests.harness import RECIPES
from tools.dry_run.microbatches import fewest_microbatches, input_bytes, with_microbatches
from tools.dry_run.rank_trace import microbatch_note, trace_rank
from tools.planner.pipeline_memory import schedule_peak

RECIPE = str(RECIPES / "debug_cpu.toml")


def test_the_128k_recipe_traces_32_of_its_120_micro_batches():
    cfg = load_config(RECIPES / "deepseek_v3_671b_128k.toml")
    assert cfg.train.microbatches(cfg.parallel.dp) == 120
    assert fewest_microbatches(cfg, 120) == 32
    note = microbatch_note(with_microbatches(cfg, cfg.parallel.dp, 32), 120, 32)
    assert note.startswith("micro-batches: 32 of the step's 120 per pipeline traced") and "all 120" in note


def _peaks(schedule, pp: int, seed: int) -> list[float]:
    """schedule_peak (most saved, peak) of every rank for random stage sizes, phase counts, held W bytes and loss-head spikes."""
    rng = random.Random(seed)
    stages = range(schedule.n_stages)
    sizes, phases = {s: rng.uniform(1, 100) for s in stages}, {s: rng.randint(1, 6) for s in stages}
    held, spikes = {s: rng.uniform(0, 50) for s in stages}, {s: rng.uniform(0, 30) for s in stages}
    return [x for rank in range(pp) for x in schedule_peak(schedule, rank, sizes, phases, held, spikes)]


@pytest.mark.parametrize("name, pp, m, fewest", [("dualpipe", 4, 20, 8), ("dualpipev", 4, 20, 8), ("1f1b", 4, 13, 4),
                                                 ("zbh1", 4, 13, 4), ("interleaved_1f1b", 4, 24, 8)])
def test_the_fewest_micro_batches_give_the_planners_walk_the_same_peak_for_any_stage_sizes(name, pp, m, fewest):
    v = 2 if name == "interleaved_1f1b" else None
    cfg = load_config(RECIPE, [f"parallel.pp={pp}", f"parallel.pp_schedule={name}", "model.n_layers=16",
                               f"train.global_batch={4 * m}", "train.micro_batch=4"]
                      + ([f"parallel.pp_chunks={v}"] if v else []), check=False)
    assert fewest_microbatches(cfg, m) == fewest
    whole, few = build_schedule(name, pp, m, v), build_schedule(name, pp, fewest, v)
    for seed in range(20):
        assert _peaks(few, pp, seed) == pytest.approx(_peaks(whole, pp, seed), rel=1e-12)  # sums in another order
    fewer = [k for k in range(1, fewest) if _buildable(name, pp, k, v)]
    if fewer:  # below it the walk peaks lower: the count matters there
        less = build_schedule(name, pp, fewer[-1], v)
        assert any(_peaks(less, pp, seed) != pytest.approx(_peaks(whole, pp, seed), rel=1e-9) for seed in range(20))


def _buildable(name: str, pp: int, m: int, v) -> bool:
    try:
        build_schedule(name, pp, m, v)
    except ValueError:
        return False
    return True


def test_no_pipeline_traces_every_micro_batch():
    cfg = load_config(RECIPE, ["train.global_batch=64", "train.micro_batch=4"])
    assert fewest_microbatches(cfg, 16) == 16


@pytest.mark.parametrize("cp", [1, 2])
def test_a_traced_step_of_the_fewest_micro_batches_peaks_as_the_whole_step_less_their_inputs(cp):
    """DualPipe pp 2 (x cp 2): 8 micro-batches, of which the schedule needs 6 to pass every state. Traced
    both ways, the peak differs by exactly the inputs of the 2 left out, and the saved activations not at all."""
    cfg = load_config(RECIPE, ["parallel.pp=2", "parallel.pp_schedule=dualpipe", f"parallel.cp={cp}",
                               "train.global_batch=16", "train.micro_batch=2", "train.warmup_steps=0"],
                      world_size=2 * cp)
    assert fewest_microbatches(cfg, 8) == 6
    whole = trace_rank(cfg, 2 * cp, 0)
    few = trace_rank(with_microbatches(cfg, 1, 6), 2 * cp, 0)
    assert few["saved_bytes"] == whole["saved_bytes"] > 0
    assert few["peak_by_category"]["saved"] == whole["peak_by_category"]["saved"]
    assert whole["peak_bytes"] - few["peak_bytes"] == input_bytes(cfg, cp, 2) > 0
