"""The eval command line on a user's mistakes: each is one `error:` line, exit status 2, no traceback,
found before any model is loaded; an earlier eval's results are never silently replaced; progress
lines; figures whose legends name the styles they draw and whose series stay visible."""

import json
import re

import matplotlib
import matplotlib.figure
import pytest
import torch

import eval.run as eval_run
from eval import plots

matplotlib.use("Agg")


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model is a test failure: every mistake must be found before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(eval_run, "load_model", refuse)


def fails(argv, capsys) -> list[str]:
    """Run main in-process; assert exit status 2 and no traceback; the stderr lines (each `error: ...`)."""
    code = eval_run.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), err
    return lines


def fails_once(argv, capsys, pattern: str) -> str:
    lines = fails(argv, capsys)
    assert len(lines) == 1, lines
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


# the checkpoint does not exist: a flag's mistake must be reported before the checkpoint is even looked for
BAD_FLAGS = [
    (["--lengths", "abc"], r"--lengths 'abc': 'abc' is not an integer"),
    (["--lengths", "0"], r"--lengths '0': 0 is below 2"),
    (["--lengths", "-5"], r"--lengths '-5': -5 is below 2"),
    (["--lengths", "128,,256"], r"--lengths '128,,256': item 2 is empty"),
    (["--lengths", "128,"], r"item 2 is empty"),
    (["--lengths", "128,128"], r"128 is listed twice"),
    (["--depths", "0.5,x"], r"--depths '0.5,x': 'x' is not a number"),
    (["--depths", "1.5"], r"1.5 is outside \[0, 1\]"),
    (["--depths", "-0.1"], r"-0.1 is outside \[0, 1\]"),
    (["--depths", ""], r"--depths '': item 1 is empty"),
    (["--tasks", "bogus"], r"--tasks 'bogus': unknown task 'bogus'; choose from passkey, multikey_needle"),
    (["--tasks", "passkey,,perplexity"], r"item 2 is empty"),
    (["--task-param", "passkey.bogus=3"], r"--task-param 'passkey.bogus=3': passkey takes no parameters$"),
    (["--task-param", "multikey_needle.bogus=3"], r"no parameter 'bogus'; its parameters: n_keys$"),
    (["--task-param", "variable_tracking.n_hop=3"], r"its parameters: n_chains, n_hops$"),
    (["--task-param", "bogus.n_keys=3"], r"unknown task 'bogus'; tasks with parameters: multikey_needle, variable_tr"),
    (["--task-param", "n_keys=3"], r"--task-param 'n_keys=3': expected TASK.NAME=VALUE"),
    (["--task-param", "multikey_needle.n_keys"], r"expected TASK.NAME=VALUE"),
    (["--task-param", "multikey_needle.n_keys=0"], r"multikey_needle: n_keys=0 must be in \[1, \d+\]"),
    (["--task-param", "multikey_needle.n_keys=two"], r"n_keys='two' must be an integer"),
    (["--task-param", "variable_tracking.n_hops=2.5"], r"n_hops=2.5 must be an integer"),
    (["--samples", "0"], r"--samples 0 must be >= 1"),
    (["--seed", "-1"], r"--seed -1 must be >= 0"),
    (["--batch-size", "0"], r"--batch-size 0 must be >= 1"),
    (["--stride", "0"], r"--stride 0 must be >= 1"),
    (["--samples", "x"], r"argument --samples: invalid int value: 'x'"),
    (["--device", "gpu"], r"argument --device: invalid choice: 'gpu'"),
    (["--haystack", "/bin/ls"], r"^error: --haystack /bin/ls is not UTF-8 text: a NUL byte at offset \d+ in its first "
                                r"8 KiB; give a UTF-8 text file or a token-file prefix$"),
]


@pytest.mark.parametrize("flags,pattern", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_before_anything_loads(flags, pattern, tmp_path, capsys, no_model):
    fails_once([tmp_path / "no_such_run", *flags], capsys, pattern)


def test_every_mistake_is_reported_at_once(tmp_path, capsys, no_model):
    argv = [tmp_path / "no_such_run", "--lengths", "abc", "--samples", "0", "--task-param", "passkey.x=1"]
    lines = fails(argv, capsys)
    assert sorted(line.split()[1] for line in lines) == ["--lengths", "--samples", "--task-param"], lines


def test_cuda_without_a_gpu_says_which_case(tmp_path, capsys, no_model, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    fails_once([tmp_path / "x", "--device", "cuda"], capsys, r"--device cuda: this torch .* is a CPU-only build")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails_once([tmp_path / "x", "--device", "cuda"], capsys, r"--device cuda: torch .* \(CUDA 12.8\) sees no GPU")


def test_a_checkpoint_that_does_not_fit_the_recipe_is_named(tiny_run, tmp_path, capsys, no_model):
    """A 4-layer checkpoint under n_layers=3 would load its first three layers and drop the fourth."""
    fails_once([tiny_run, "--set", "model.n_layers=3", "--out", tmp_path / "a"], capsys,
               r"does not fit the recipe's model .*the checkpoint holds \d+ tensors: layers\.3\..* that the recipe's "
               r"model lacks")
    fails_once([tiny_run, "--set", "model.n_layers=5", "--out", tmp_path / "b"], capsys,
               r"the checkpoint lacks \d+ tensors: layers\.4\.")
    assert not (tmp_path / "a").exists()  # refused before the output folder was made


def test_an_output_path_that_cannot_be_a_folder(tiny_run, tmp_path, capsys, no_model):
    (tmp_path / "file").write_text("x")
    fails_once([tiny_run, "--out", tmp_path / "file"], capsys, r"output folder: .*file is a file, not a folder")
    fails_once([tiny_run, "--out", tmp_path / "file" / "sub"], capsys, r"output folder: cannot make .*sub")


def _eval(run_dir, *flags):
    return eval_run.main([str(run_dir), "--lengths", "400", "--depths", "0", "--samples", "1", "--ppl-tokens", "600",
                          "--threads", "1", *map(str, flags)])


def test_an_earlier_eval_is_refused_and_overwrite_replaces_it_whole(tiny_run, capsys):
    folder = tiny_run / "eval" / "step_00000001"  # the default folder
    assert _eval(tiny_run, "--tasks", "passkey,multikey_needle") == 0
    first = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert {"results.json", "passkey_heatmap.png", "multikey_needle_heatmap.png",
            "accuracy_by_length.png"} <= set(first)
    (folder / "eval.log").write_text("a log beside the results")  # as tools/extend.py leaves one
    capsys.readouterr()

    line = fails_once([tiny_run, "--tasks", "passkey"], capsys,
                      r"already holds an earlier eval \(results\.json, .*\); pass --overwrite .* or --out DIR")
    assert str(folder) in line
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "eval.log"} == first  # byte-identical

    # --overwrite that fails (a recipe that does not fit) keeps the earlier results too
    fails([tiny_run, "--overwrite", "--set", "model.n_layers=3"], capsys)
    assert (folder / "results.json").read_bytes() == first["results.json"]

    assert _eval(tiny_run, "--tasks", "perplexity", "--overwrite") == 0
    now = {p.name for p in folder.iterdir()}
    assert now == {"results.json", "perplexity.png", "eval.log"}, now  # no figure of the earlier task set
    assert set(json.loads((folder / "results.json").read_text())["tasks"]) == {"perplexity"}


def test_an_eval_that_lands_in_the_folder_meanwhile_is_kept(tiny_run, tmp_path, capsys, monkeypatch):
    """Two evals into one folder at once: the one that finishes second writes beside, not over, the first."""
    load = eval_run.load_model

    def other_eval_finishes(*args, **kwargs):
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "results.json").write_text('{"other": 1}')
        return load(*args, **kwargs)
    monkeypatch.setattr(eval_run, "load_model", other_eval_finishes)
    assert _eval(tiny_run, "--tasks", "passkey", "--out", tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {"other": 1}
    assert set(json.loads((tmp_path / "out_2" / "results.json").read_text())["tasks"]) == {"passkey"}
    assert f"writing to {tmp_path / 'out_2'} instead" in capsys.readouterr().out


def test_progress_line_per_task_and_length(tiny_run, tmp_path, capsys):
    assert eval_run.main([str(tiny_run), "--tasks", "passkey,perplexity", "--lengths", "128,200", "--depths", "0",
                          "--samples", "1", "--ppl-tokens", "600", "--threads", "1", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 task(s) x 2 length(s) = 4 cells" in lines[0]
    cells = [line for line in lines if line.startswith("[")]
    assert [re.match(r"\[(\d)/4 \d+m\d\ds\] (\w+) length (\d+):", c).groups() for c in cells] == [
        ("1", "passkey", "128"), ("2", "passkey", "200"), ("3", "perplexity", "128"), ("4", "perplexity", "200")]


# ---------------------------------------------------------------------------------------------- figures


@pytest.fixture
def drawn(monkeypatch):
    """Figures as saved (their artists stay readable after the plot function closes them)."""
    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def _series(kind_scores: dict[int, float], chance: float) -> dict:
    return {"by_length": {str(x): {"exact": v, "token_acc": v, "n": 1} for x, v in kind_scores.items()},
            "chance": {"token": chance}}


def test_accuracy_legend_names_each_style_as_drawn_and_equal_series_stay_apart(tmp_path, drawn):
    zeros = {128: 0.0, 256: 0.0, 512: 0.0}
    results = {"passkey": _series(zeros, 0.102), "multikey_needle": _series(zeros, 0.102),
               "variable_tracking": _series(zeros, 0.164)}
    plots.accuracy_by_length(results, tmp_path / "acc.png", "untrained")
    fig = drawn[-1]
    handles, labels = fig.axes[0].get_legend_handles_labels()
    named = {"(solid)": "-", "(dashed)": "--", "(dotted)": ":"}
    assert len(labels) == 3 * 2 + 2  # exact + per token per task; one chance line per distinct level
    for handle, label in zip(handles, labels):
        style = [s for word, s in named.items() if word in label]
        assert style == [handle.get_linestyle()], (label, handle.get_linestyle())
    assert any("passkey, multikey_needle" in label for label in labels)  # a shared chance level says so
    points = {(round(float(x), 6), float(y)) for line in fig.axes[0].get_lines() if line.get_marker() == "o"
              for x, y in zip(line.get_xdata(), line.get_ydata())}
    assert len(points) == 3 * 3  # three all-zero tasks at three lengths: nine separate markers


def test_extension_perplexity_axis_has_plain_tick_labels(tmp_path, drawn):
    def res(ppl):
        return {"tasks": {"passkey": {"by_length": {"256": {"exact": 1.0}, "4096": {"exact": 0.0}},
                                      "grid": {"256": {"0": {"exact": 1.0}}, "4096": {"0": {"exact": 0.0}}}},
                          "perplexity": {"by_length": {"256": {"ppl": ppl[0]}, "4096": {"ppl": ppl[1]}}}}}
    plots.extension_figure({"base (trained at 256)": res((3.0, 40.0)), "long (trained at 4096)": res((3.1, 2.9))},
                           tmp_path / "longctx.png", [256, 4096])
    fig = drawn[-1]
    ppl = next(ax for ax in fig.axes if "perplexity" in ax.get_ylabel())
    labels = [t.get_text() for t in ppl.get_yticklabels() if t.get_text()]
    assert len(labels) >= 3 and all(re.fullmatch(r"[\d,.]+", t) for t in labels), labels
    assert not [t.get_text() for t in ppl.get_yticklabels(minor=True) if t.get_text()]
    assert [t.get_text() for t in ppl.get_xticklabels()] == ["256", "4K"]
