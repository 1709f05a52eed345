"""tools/curves.py: metrics.jsonl keys of several runs as panels; chained stages continue their steps."""

import json

from tools.curves import main, running_mean, series


def _run(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chained_stages_continue_their_steps_and_runs_without_a_key_are_left_out(tmp_path):
    a = _run(tmp_path / "warmup", [{"step": 1, "loss": 2.0, "dsa/topk_mass": 0.5}, {"step": 2, "loss": 1.5}])
    b = _run(tmp_path / "sparse", [{"step": 1, "loss": 1.4, "dsa/indexer_kl": 0.3}, {"step": 2, "loss": 1.2}])
    curves, starts = series([a, b], ["loss", "dsa/indexer_kl", "dsa/topk_mass"], chain=True)
    assert curves["loss"] == {"warmup": [(1, 2.0), (2, 1.5)], "sparse": [(3, 1.4), (4, 1.2)]}
    assert curves["dsa/indexer_kl"] == {"sparse": [(3, 0.3)]} and curves["dsa/topk_mass"] == {"warmup": [(1, 0.5)]}
    assert starts == [2]
    apart, no_starts = series([a, b], ["loss"])
    assert apart["loss"]["sparse"] == [(1, 1.4), (2, 1.2)] and no_starts == []
    out = tmp_path / "curves.png"
    assert main([str(a), str(b), "--keys", "loss,dsa/indexer_kl", "--chain", "--smooth", "2", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_a_resumed_runs_relogged_step_counts_once(tmp_path):
    run = _run(tmp_path / "r", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}, {"step": 2, "loss": 1.8}])
    assert series([run], ["loss"])[0]["loss"]["r"] == [(1, 2.0), (2, 1.8)]


def test_running_mean_averages_up_to_n_values_back():
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([1.0, 3.0], 1) == [1.0, 3.0]


def test_a_missing_run_or_key_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no metrics" in capsys.readouterr().err
    a = _run(tmp_path / "a", [{"step": 1, "loss": 1.0}])
    assert main([str(a), "--keys", "gnorm", "--out", str(tmp_path / "x.png")]) == 2
    assert "none of the runs logged" in capsys.readouterr().err
