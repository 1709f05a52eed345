"""The staged long-context extension (tools/extend.py, recipes/longctx/): the chain's wiring, the
cluster-size recipes, the summary and figure, and (slow) the whole pipeline at reduced scale."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lc.config import ConfigError
from tests.harness import RECIPES, ROOT
from tools.extend import (DEFAULT_STAGES, passkey_table, plan_stages, run_pipeline, scored, summary_markdown,
                          yarn_inference_sets)

LONGCTX = RECIPES / "longctx"


def test_cpu_chain_starts_each_stage_from_the_previous_one(tmp_path):
    runs = tmp_path / "runs"
    base, two, four = plan_stages(list(DEFAULT_STAGES), runs, tmp_path / "out", [])
    assert [s.name for s in (base, two, four)] == ["base", "extend_2k", "extend_4k"]
    assert [s.seq_len for s in (base, two, four)] == [256, 2048, 4096]
    assert [s.nproc for s in (base, two, four)] == [1, 1, 2]  # the 4K stage on cp = 2 ranks
    assert base.rope["scaling"] == "none"
    # YaRN's factor is each stage's length over the base's, from the base's original length
    assert [(s.rope["factor"], s.rope["original_seq_len"]) for s in (two, four)] == [(8.0, 256), (16.0, 256)]
    assert f"train.output_dir={runs / 'base'}" in base.overrides
    assert not any(o.startswith("checkpoint.init_from") for o in base.overrides)
    assert f"checkpoint.init_from={runs / 'base' / 'checkpoints'}" in two.overrides
    assert f"checkpoint.init_from={runs / 'extend_2k' / 'checkpoints'}" in four.overrides
    assert yarn_inference_sets(base, four) == ["model.rope.scaling=yarn", "model.rope.factor=16.0",
                                               "model.rope.original_seq_len=256"]


def test_cluster_pair_validates_at_64_ranks(tmp_path):
    """The full-size 4K -> 32K -> 128K pair: both stages validate as 64-rank layouts."""
    stages = plan_stages([str(LONGCTX / "moe16b_extend_32k.toml"), str(LONGCTX / "moe16b_extend_128k.toml")],
                         tmp_path, tmp_path, [])
    assert [(s.nproc, s.seq_len, s.rope["factor"]) for s in stages] == [(64, 32768, 8.0), (64, 131072, 32.0)]
    assert all(s.rope["original_seq_len"] == 4096 for s in stages)


def test_a_stage_without_a_final_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.interval=7 must divide train.steps="):
        plan_stages(list(DEFAULT_STAGES), tmp_path, tmp_path, ["checkpoint.interval=7"])


def test_reuse_scores_keeps_only_results_of_the_final_step_with_the_same_eval(tmp_path):
    """--reuse-scores: a results.json is kept when it scores the stage's last step with the same lengths,
    samples and tasks; anything else (an earlier step, other lengths, samples or tasks, none) is scored again."""
    import argparse

    stage = plan_stages(list(DEFAULT_STAGES), tmp_path / "runs", tmp_path / "out", [])[0]
    args = argparse.Namespace(lengths="1024,2048", samples=10, tasks="passkey,niah_single_1")
    assert not scored(stage, args)
    stage.eval_dir.mkdir(parents=True)
    same = {"step": stage.steps, "samples": 10, "lengths": [1024, 2048], "tasks": {"passkey": {}, "niah_single_1": {}}}
    for change, kept in (({}, True), ({"step": stage.steps - 1}, False), ({"samples": 5}, False),
                         ({"lengths": [1024]}, False), ({"tasks": {"passkey": {}}}, False)):
        (stage.eval_dir / "results.json").write_text(json.dumps({**same, **change}))
        assert scored(stage, args) is kept, change


def _fake_results(exact: dict[int, float], ppl: dict[int, float]) -> dict:
    lengths = sorted(exact)
    grid = {str(x): {"0": {"exact": exact[x], "n": 1}, "1": {"exact": exact[x], "n": 1}} for x in lengths}
    return {"lengths": lengths, "tasks": {
        "passkey": {"by_length": {str(x): {"exact": exact[x]} for x in lengths}, "grid": grid},
        "perplexity": {"by_length": {str(x): {"ppl": ppl[x]} for x in lengths}}}}


def test_summary_table_and_figure(tmp_path):
    from eval import plots

    curves = {"base (trained at 256)": _fake_results({256: 1.0, 4096: 0.0}, {256: 3.0, 4096: 40.0}),
              "extend_4k (trained at 4096)": _fake_results({256: 1.0, 4096: 0.95}, {256: 3.1, 4096: 2.9}),
              "base + YaRN x16, no training": _fake_results({256: 0.5, 4096: 0.1}, {256: 3.5, 4096: 9.0})}
    table = passkey_table(curves)
    assert table["extend_4k (trained at 4096)"]["4096"] == {"passkey": 0.95, "multikey_needle": None, "ppl": 2.9}
    md = summary_markdown({"table": table, "stages": [], "commands": ["python -m moe_lc.train x"]}, curves)
    assert "| extend_4k (trained at 4096) | 1.00 / - / 3.10 | 0.95 / - / 2.90 |" in md
    path = plots.extension_figure(curves, tmp_path / "longctx.png", [256, 4096])
    assert path.stat().st_size > 10_000


def test_evals_without_perplexity_say_so_in_the_perplexity_panel():
    """An eval run without the perplexity task (the DSA chain's: passkey and niah_single_1) left the right
    panel an empty axis; it now says why, and a run with perplexity keeps its log-scale panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from eval.plots import _extension_lines

    res = _fake_results({1024: 1.0, 4096: 0.5}, {1024: 3.0, 4096: 4.0})
    no_ppl = {"lengths": res["lengths"], "tasks": {"passkey": res["tasks"]["passkey"]}}
    for curves, empty in (({"a": no_ppl}, True), ({"a": res}, False)):
        fig, (acc, ppl) = plt.subplots(1, 2)
        _extension_lines(acc, ppl, curves, [4096])
        assert (not ppl.axison) is empty
        assert any("no perplexity" in t.get_text() for t in ppl.texts) is empty
        assert ppl.get_yscale() == ("linear" if empty else "log")
        plt.close(fig)


@pytest.mark.slow
def test_extension_pipeline_at_reduced_scale(tmp_path):
    """base at 128 tokens -> extended to 512 (4x, cp = 2 ranks) with the recipes' settings, through
    tools/extend.py as a user runs it. At 512 the base model is past its trained length and its held-out
    perplexity blows up; the extended one stays near its short-context perplexity. ~4 minutes."""
    base = tmp_path / "base.toml"
    base.write_text(f'extends = "{LONGCTX / "base.toml"}"\n[train]\nsteps = 400\nseq_len = 128\n'
                    'warmup_steps = 20\nthreads = 1\n[checkpoint]\ninterval = 400\n[data]\nsynthetic_tasks = ["passkey"]\n'
                    'synthetic_weight = 0.25\n')
    extend = tmp_path / "extend_512.toml"
    extend.write_text(f'extends = "{LONGCTX / "extend_4k.toml"}"\n[model.rope]\nfactor = 4.0\n'
                      'original_seq_len = 128\n[train]\nsteps = 60\nseq_len = 512\nglobal_batch = 8\n'
                      'micro_batch = 4\nlr = 5e-4\n[checkpoint]\ninterval = 60\n')
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "tools/extend.py", str(base), str(extend), "--runs", str(tmp_path / "runs"),
                           "--out", str(out), "--lengths", "128,512", "--samples", "2", "--ppl-tokens", "4096",
                           "--tasks", "passkey,perplexity"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    table = summary["table"]
    base_row, ext_row = table["base (trained at 128)"], table["extend_512 (trained at 512)"]
    yarn_row = table["base + YaRN x4, no training"]
    print({k: {n: r["ppl"] for n, r in v.items()} for k, v in table.items()})
    assert ext_row["512"]["ppl"] < 0.5 * base_row["512"]["ppl"]
    assert ext_row["512"]["ppl"] < 1.15 * ext_row["128"]["ppl"]
    assert yarn_row["512"]["ppl"] < base_row["512"]["ppl"]  # YaRN alone already helps, as in the paper
    assert (out / "longctx.png").stat().st_size > 10_000
    assert "extend_512" in (out / "summary.md").read_text()
    assert Path(summary["stages"][1]["eval_dir"]).joinpath("results.json").exists()
