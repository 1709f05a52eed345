"""tools/ablate.py: grid parsing, one run per combination, reports, resuming, and failed runs."""

import csv
import json
import subprocess
import sys

import pytest

from tests.harness import RECIPES, ROOT
from tools.ablate import collect, combinations, is_complete, parse_grid, run_ablation, split_values

RECIPE = str(RECIPES / "debug_cpu.toml")
TINY = ["train.steps=3", "train.seq_len=64", "train.global_batch=4", "train.micro_batch=4",
        "train.warmup_steps=1", "train.log_interval=1", "train.threads=1"]


def test_grid_parsing_and_run_names():
    grid = parse_grid(["train.lr=1e-3,3e-3", "model.moe.score_func=sigmoid,softmax"])
    assert grid == [("train.lr", ["1e-3", "3e-3"]), ("model.moe.score_func", ["sigmoid", "softmax"])]
    combos = combinations(grid)
    assert [c.name for c in combos] == ["lr=1e-3__score_func=sigmoid", "lr=1e-3__score_func=softmax",
                                        "lr=3e-3__score_func=sigmoid", "lr=3e-3__score_func=softmax"]
    assert combos[1].overrides() == ["train.lr=1e-3", "model.moe.score_func=softmax"]
    assert split_values("[passkey],[passkey,variable_tracking]") == ["[passkey]", "[passkey,variable_tracking]"]
    # keys sharing their last component keep the full key in the name
    assert combinations(parse_grid(["model.dim=64", "x.dim=1"]))[0].name == "model.dim=64__x.dim=1"
    for bad in (["train.lr"], ["lr=1,2"], ["train.lr=1,,2"], ["train.lr=1", "train.lr=2"]):
        with pytest.raises(ValueError, match="--grid"):
            parse_grid(bad)


def test_completeness_uses_the_last_record_of_each_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0 * s}) for s in (1, 2, 2, 3))
        + '\n{"step": 4, "lo')  # a line cut short by a killed run
    assert is_complete(tmp_path, 3) and not is_complete(tmp_path, 4)


def test_runs_every_combination_writes_reports_and_resumes(tmp_path):
    out = tmp_path / "abl"
    log = []
    grid = parse_grid(["train.lr=1e-3,3e-3", "model.moe.score_func=sigmoid,softmax"])
    results = run_ablation(RECIPE, grid, TINY, out, echo=log.append)
    assert [r.status for r in results] == ["ok"] * 4, [r.error for r in results]
    assert all(r.steps == 3 and r.final_loss < r.losses[0][1] and r.tokens_per_s > 0 for r in results)
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [row["run"] for row in rows] == [r.combo.name for r in results]
    assert {row["train.lr"] for row in rows} == {"1e-3", "3e-3"} and all(row["status"] == "ok" for row in rows)
    md = (out / "results.md").read_text()
    assert "| run | train.lr | model.moe.score_func | status | steps | final_loss" in md
    assert (out / "loss_curves.png").stat().st_size > 1000
    assert any(line.strip().startswith("step 3/3") for line in log)  # progress per run
    for r in results:  # each run had its own output directory
        assert (out / r.combo.name / "metrics.jsonl").is_file() and (out / r.combo.name / "tb").is_dir()

    # a second invocation skips finished runs and rewrites the same table
    stamps = {r.combo.name: (out / r.combo.name / "metrics.jsonl").stat().st_mtime_ns for r in results}
    log.clear()
    again = run_ablation(RECIPE, grid, TINY, out, echo=log.append)
    assert sum("skipped: complete" in line for line in log) == 4
    assert {r.combo.name: (out / r.combo.name / "metrics.jsonl").stat().st_mtime_ns for r in again} == stamps
    assert [r.final_loss for r in again] == [r.final_loss for r in results]


def test_cli_reports_failed_and_invalid_runs_and_continues_under_torchrun(tmp_path):
    """data.source=tokens with a missing file validates but the trainer fails; micro_batch=3 does not
    divide the global batch (invalid, never launched); the stdlib runs finish through torchrun."""
    out = tmp_path / "abl"
    sets = TINY + ["train.steps=2", "data.path=/nonexistent/corpus", "parallel.dp=2"]
    cmd = [sys.executable, str(ROOT / "tools" / "ablate.py"), RECIPE, "--grid", "data.source=tokens,stdlib",
           "--grid", "train.micro_batch=3,2", "--out", str(out), "--nproc", "2", "--quiet"]
    proc = subprocess.run(cmd + [x for s in sets for x in ("--set", s)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    rows = {row["run"]: row for row in csv.DictReader(open(out / "results.csv"))}
    assert rows["source=stdlib__micro_batch=2"]["status"] == "ok", rows
    assert "dp=2" in (out / "source=stdlib__micro_batch=2" / "train.log").read_text()
    failed = rows["source=tokens__micro_batch=2"]
    assert failed["status"] == "failed" and "/nonexistent/corpus" in failed["error"], failed
    for name in ("source=tokens__micro_batch=3", "source=stdlib__micro_batch=3"):
        assert rows[name]["status"] == "invalid" and "micro_batch=3 must divide" in rows[name]["error"]
    assert "FAILED (exit" in proc.stdout and "3 of 4 runs did not finish" in proc.stdout
    assert "step 2/2" not in proc.stdout  # --quiet: one line per run
    assert (out / "loss_curves.png").is_file() and "| failed |" in (out / "results.md").read_text()
    assert collect(combinations(parse_grid(["x.y=1"]))[0], out, 3).status == "not run"
