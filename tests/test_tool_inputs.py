"""Mistakes given to the tools (ablate, schedule, plan, gpu_check, prepare_data, timeline, overlap_bench,
dryrun): each ends with one
`error: ` line and exit status 2, no traceback, no hang, and nothing stale shown as new. The tools'
main(argv) runs in-process where it can."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.harness import RECIPES, ROOT
from tools import ablate, dryrun, gpu_check, overlap_bench, plan, prepare_data, schedule, timeline
from tools.ablate_plot import plot_losses, twin_labels
from tools.ablate_settings import SETTINGS, STALE_DIR, ChangedRuns

RECIPE = str(RECIPES / "debug_cpu.toml")
TINY = ["train.seq_len=64", "train.global_batch=4", "train.micro_batch=4", "train.warmup_steps=1",
        "train.log_interval=1", "train.threads=1"]


def one_error(capsys, code: int, *fragments: str) -> str:
    """The single `error: ` line on stderr of a call that returned `code` (must be 2)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


# ---------------------------------------------------------------------------------------- 1. ablate reruns


def test_ablate_rerun_with_other_settings_is_refused_then_retrained_on_request(tmp_path, capsys):
    out = tmp_path / "abl"
    argv = [RECIPE, "--out", str(out), "--quiet", *sets(*TINY, "train.lr=1e-3")]
    assert ablate.main(argv + sets("train.steps=2")) == 0
    run = out / "base"
    assert "train.lr=1e-3" in json.loads((run / SETTINGS).read_text())["set"]
    before = losses(run)
    capsys.readouterr()

    # the same settings, spelled differently: skipped as complete
    same = [RECIPE, "--out", str(out), "--quiet", *sets(*TINY, "train.lr=0.001", "train.steps=2")]
    assert ablate.main(same) == 0
    assert "skipped: complete" in capsys.readouterr().out

    # other settings: refused before anything runs, the old run left as it was
    line = one_error(capsys, ablate.main(argv + sets("train.steps=3")), "base (train.steps 2 -> 3)", "--rerun-changed")
    assert str(out) in line and losses(run) == before

    assert ablate.main(argv + sets("train.steps=3") + ["--rerun-changed"]) == 0
    assert "settings changed (train.steps 2 -> 3); the old run moved to" in capsys.readouterr().out
    (moved,) = (out / STALE_DIR).glob("*/base")
    assert losses(moved) == before and sorted(losses(run)) == [1, 2, 3]
    rows = (out / "results.md").read_text()
    assert "| base | ok | 3 |" in rows


def test_ablate_names_every_changed_run_and_reads_runs_made_before_settings_were_kept(tmp_path):
    """No training: run directories written by hand. A run with an old-style ablate_run.json (its
    command line) is compared by that; one with training output and no record counts as changed."""
    out = tmp_path / "abl"
    grid = ablate.parse_grid(["train.lr=1e-3,3e-3", "model.moe.score_func=sigmoid"])
    names = [c.name for c in ablate.combinations(grid)]
    for name, lr in zip(names, ("1e-3", "3e-3")):
        (out / name).mkdir(parents=True)
        (out / name / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    cmd = [sys.executable, "-m", "moe_lc.train", RECIPE, *sets("train.steps=20", "train.lr=1e-3",
                                                              "model.moe.score_func=sigmoid")]
    (out / names[0] / "ablate_run.json").write_text(json.dumps({"status": "ok", "command": cmd}))
    with pytest.raises(ChangedRuns) as info:
        ablate.run_ablation(RECIPE, grid, ["train.steps=40"], out, echo=lambda _: None)
    message = str(info.value)
    assert "\n" not in message and f"{names[0]} (train.steps 20 -> 40)" in message
    assert f"{names[1]} (settings unknown (no {SETTINGS}))" in message and "2 run(s)" in message
    assert not (out / names[1] / "train.log").exists()  # nothing ran


@pytest.mark.slow  # test_ablate.py's every-combination run resumes in the default run
def test_ablate_resumes_an_interrupted_run_with_the_same_settings(tmp_path, capsys, monkeypatch):
    """The first invocation dies after step 2 (its checkpoint committed); the rerun resumes it instead
    of refusing it or starting over, and the run ends complete."""
    out = tmp_path / "abl"
    argv = [RECIPE, "--out", str(out), "--quiet", *sets(*TINY, "train.steps=3", "checkpoint.interval=1")]
    monkeypatch.setenv("MOE_LC_FAULT", "exit@2")
    assert ablate.main(argv) == 1
    assert sorted(losses(out / "base")) == [1, 2]
    monkeypatch.delenv("MOE_LC_FAULT")
    capsys.readouterr()
    assert ablate.main(argv) == 0, capsys.readouterr()
    log = (out / "base" / "train.log").read_text()
    assert "resumed from" in log and "step_00000002" in log, log[-2000:]
    assert sorted(losses(out / "base")) == [1, 2, 3] and not (out / STALE_DIR).exists()


def test_ablate_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    one_error(capsys, ablate.main([RECIPE, "--out", str(tmp_path / "f")]), "--out", "is a file")
    one_error(capsys, ablate.main([RECIPE, "--out", str(tmp_path / "f" / "abl")]), "is a file, not a directory")


# ---------------------------------------------------------------------------------------- 2. the loss plot


def test_loss_plot_has_integer_steps_and_names_curves_that_coincide(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    curve = [(1, 5.0), (2, 4.6), (3, 4.1)]
    runs = [ablate.RunResult(ablate.Combo(name, {}), "ok", losses=list(c))
            for name, c in (("none", curve), ("full", curve), ("sel", [(1, 5.0), (2, 4.7), (3, 4.3)]))]
    plot_losses(runs, tmp_path / "loss_curves.png", "t")
    ax = figures[0].axes[0]
    assert all(float(t).is_integer() for t in ax.xaxis.get_majorticklocs())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["none (ok)", "full (= none) (ok)", "sel (ok)"]
    styles = [(line.get_linestyle(), line.get_marker()) for line in ax.lines]
    assert len(set(styles)) == 3
    assert twin_labels([("a", [(1, 1.0)]), ("b", [(1, 1.0)]), ("c", [(1, 1.0)])]) == ["a", "b (= a)", "c (= a)"]


# ---------------------------------------------------------------------------------------- 3.-4. schedule


def test_schedule_too_large_ends_quickly_with_a_size_that_fits(tmp_path):
    png = tmp_path / "x.png"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "schedule.py"), "--schedule", "dualpipe", "--pp", "64",
                           "--microbatches", "4096", "--png", str(png)], capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 30
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: --pp 64 x --microbatches 4096 is 262,144 stage-micro-batches")
    assert "--microbatches (e.g. 512)" in proc.stderr and not png.exists()


def test_schedule_drawing_too_large_prints_the_numbers_and_refuses_the_png(tmp_path, capsys):
    png = tmp_path / "x.png"
    line = one_error(capsys, schedule.main(["--schedule", "1f1b", "--pp", "8", "--microbatches", "1300",
                                            "--png", str(png), "--json"]), "not written", "20,800 boxes")
    assert "--microbatches 1250" in line and not png.exists()
    assert schedule.main(["--schedule", "1f1b", "--pp", "8", "--microbatches", "1300", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["microbatches"] == 1300


def test_schedule_wide_drawing_is_capped_and_unlabelled():
    width, height, dpi = schedule._figure_size(64, 50_000.0)
    assert width == schedule.MAX_WIDTH_IN and width * height * dpi**2 <= schedule.MAX_PIXELS * 1.0001
    boxes = schedule._Boxes(inch=0.01)
    boxes.add(0, 1.0, 0, "red", 12)  # 0.01 in: no room for "12"
    assert boxes.labels == []


@pytest.mark.parametrize("costs, bad", [
    ("F=abc", "'F=abc': 'abc' is not a number"), ("F", "'F': expected KEY=NUMBER"),
    ("F=1,X=2", "'X=2': unknown cost 'X'"), ("F=1,F=2", "'F=2': F is given twice"),
    ("F=inf", "'F=inf': 'inf' is not a finite number"), ("F=1,B=2,W=3", "'F=1,B=2,W=3': costs need"),
])
def test_schedule_malformed_costs(costs, bad, capsys):
    one_error(capsys, schedule.main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--costs", costs]),
              "--costs", bad)


def test_schedule_png_paths(tmp_path, capsys):
    argv = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--png"]
    one_error(capsys, schedule.main(argv + [str(tmp_path)]), "--png", "names a directory")
    (tmp_path / "f").write_text("x")
    one_error(capsys, schedule.main(argv + [str(tmp_path / "f" / "x.png")]), "is a file, not a directory")
    png = tmp_path / "new" / "deeper" / "x.png"
    assert schedule.main(argv + [str(png)]) == 0 and png.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------- 5. plan


@pytest.mark.parametrize("world", ["0", "-4"])
def test_plan_world_must_be_positive(world, capsys):
    one_error(capsys, plan.main([RECIPE, "--world", world]), f"--world must be a positive integer, got {world}")


# ---------------------------------------------------------------------------------------- 6. gpu_check


def test_gpu_check_validates_every_argument_before_any_step(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(gpu_check, "STEP_FUNCS", {s: (lambda a, o, s=s: ran.append(s)) for s in gpu_check.STEPS})
    out = tmp_path / "gc"
    one_error(capsys, gpu_check.main(["--dry-run", "--out", str(out), "--parts", "attention,bogus"]),
              "--parts: unknown part(s) bogus; choose from attention, gemm, grouped_gemm, model_step, layer")
    one_error(capsys, gpu_check.main(["--out", str(out), "--steps", "env,tset", "--wheels", str(tmp_path / "no")]),
              "unknown step(s) tset", f"--wheels {tmp_path / 'no'}: not a directory")
    one_error(capsys, gpu_check.main(["--out", str(out), "--bench-arg=--nope"]), "--bench-arg: unrecognized arguments")
    (tmp_path / "f").write_text("x")
    one_error(capsys, gpu_check.main(["--out", str(tmp_path / "f")]), "--out", "is a file")
    assert ran == [] and not out.exists()
    assert gpu_check.main(["--dry-run", "--out", str(out / "a" / "b"), "--steps", "env,bench"]) == 0
    assert ran == ["env", "bench"] and (out / "a" / "b" / "summary.md").is_file()


# ---------------------------------------------------------------------------------------- 7. prepare_data


def _corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world\n" * 20)
    (corpus / "b.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00" + bytes(range(256)))  # a binary named .txt
    (corpus / "c.txt").write_bytes("caf\xe9 latin-1\n".encode("latin-1"))
    return corpus


def test_prepare_data_refuses_a_binary_input_and_skips_binaries_in_directories(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    one_error(capsys, prepare_data.main(["/bin/ls", "--out", str(tmp_path / "o")]),
              "input /bin/ls is not UTF-8 text: a NUL byte at offset")
    one_error(capsys, prepare_data.main([str(corpus / "c.txt"), "--out", str(tmp_path / "o")]),
              f"input {corpus / 'c.txt'} is not UTF-8 text: byte 0xe9 at offset 3")
    assert not list(tmp_path.glob("o.*"))
    prefix = tmp_path / "new" / "dir" / "c"  # missing parents are made
    assert prepare_data.main([str(corpus), "--out", str(prefix), "--val-fraction", "0"]) == 0
    printed = capsys.readouterr().out
    assert "1 files (1 text)" in printed and "skipped 2 files that are not UTF-8 text" in printed
    meta = json.loads((tmp_path / "new" / "dir" / "c.train.shards.json").read_text())
    assert meta["n_tokens"] == len("hello world\n" * 20) + 1  # a.txt and its EOS only


def test_prepare_data_output_paths(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    one_error(capsys, prepare_data.main([str(corpus), "--out", str(tmp_path)]), "names a directory", "PREFIX")
    (tmp_path / "f").write_text("x")
    one_error(capsys, prepare_data.main([str(corpus), "--out", str(tmp_path / "f" / "c")]),
              f"--out {tmp_path / 'f' / 'c'}: {tmp_path / 'f'} is a file, not a directory")
    one_error(capsys, prepare_data.main([str(corpus), "--out", "/proc/no_such_dir/c"]), "cannot create directory")
    (tmp_path / "c.val.shards.json").mkdir()
    one_error(capsys, prepare_data.main([str(corpus), "--out", str(tmp_path / "c")]), "c.val.shards.json is a directory")
    one_error(capsys, prepare_data.main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]), "input not found")
    one_error(capsys, prepare_data.main([str(corpus), "--out", str(tmp_path / "o"), "--tokenizer", "nope"]),
              "--tokenizer: unknown tokenizer 'nope'")


def test_prepare_data_inputs_without_a_document_are_refused_and_nothing_is_published(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "only.txt").write_text("")
    (tmp_path / "nulls.jsonl").write_text('{"text": null}\n{"text": ""}\n')
    expected = "every input is empty (1 file, {} bytes; empty files and records whose 'text' is empty or null " \
               "are skipped); nothing was written"
    for given in ("empty.jsonl", "folder"):  # empty files: refused before any work
        out = tmp_path / "o" / given.split(".")[0]
        one_error(capsys, prepare_data.main([str(tmp_path / given), "--out", str(out), "--workers", "1"]),
                  f"no documents in {tmp_path / given}: {expected.format(0)}")
        assert not list(out.parent.glob(f"{out.name}.*"))
    out = tmp_path / "o" / "nulls"  # found while tokenizing: the last line, after the progress bar
    assert prepare_data.main([str(tmp_path / "nulls.jsonl"), "--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: no documents in {tmp_path / 'nulls.jsonl'}: {expected.format(28)}", err
    assert not list(out.parent.glob(f"{out.name}.*"))  # no manifest (a run cannot read it), no state


def test_prepare_data_reads_every_kind_in_a_directory_by_default(tmp_path, capsys):
    import gzip

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.jsonl").write_text('{"text": "first record"}\n{"text": "second record"}\n')
    with gzip.open(corpus / "sub" / "b.jsonl.gz", "wt") as fh:
        fh.write('{"text": "gzipped record"}\n')
    (corpus / "c.txt").write_text("a text file\n")
    (corpus / "notes.md").write_text("not a kind prepare_data reads by default\n")
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet needs the [data] extra (pyarrow)")
    pq.write_table(__import__("pyarrow").table({"text": ["a parquet row", "another"]}), corpus / "d.parquet")
    assert prepare_data.main([str(corpus), "--out", str(tmp_path / "p"), "--val-fraction", "0", "--workers", "1"]) == 0
    assert "4 files (1 text, 2 jsonl, 1 parquet)" in capsys.readouterr().out
    meta = json.loads((tmp_path / "p.train.shards.json").read_text())
    assert meta["n_documents"] == 6
    one_error(capsys, prepare_data.main([str(corpus / "sub"), "--out", str(tmp_path / "q"), "--glob", "*.txt"]),
              f"no input files matching *.txt under {corpus / 'sub'}")


def test_prepare_data_refuses_a_metadata_field_no_input_has(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"text": "one", "repo": "x"}\n{"text": "two", "id": 3}\n')
    (tmp_path / "t.txt").write_text("text\n")
    inputs = [str(tmp_path / "d.jsonl"), str(tmp_path / "t.txt")]
    one_error(capsys, prepare_data.main([*inputs, "--out", str(tmp_path / "o"), "--meta-fields", "repo,nope"]),
              "error: --meta-fields: no input has the field 'nope' (fields offered: JSON Lines (first 100 records "
              "of each file): id, repo; text files: dir, path)")
    one_error(capsys, prepare_data.main([*inputs, "--out", str(tmp_path / "o"), "--split-by", "nope"]),
              "error: --split-by: no input has the field 'nope'")
    assert not list(tmp_path.glob("o.*"))
    # a field some input has is kept (null where a document lacks it)
    assert prepare_data.main([*inputs, "--out", str(tmp_path / "o"), "--meta-fields", "repo,dir", "--workers", "1",
                              "--val-fraction", "0"]) == 0


def test_prepare_data_names_the_flag_that_is_out_of_range(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    one_error(capsys, prepare_data.main([str(corpus), "--out", str(tmp_path / "o"), "--workers", "0"]),
              "error: --workers=0 must be >= 1")
    line = one_error(capsys, prepare_data.main([str(corpus), "--out", str(tmp_path / "o"), "--shard-tokens", "0"]),
                     "error: --shard-tokens=0 must be >= 1")
    assert "--workers" not in line


# ---------------------------------------------------------------------------------------- 8. timeline, overlap_bench, dryrun


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    from moe_lc.train import main as train

    run = tmp_path_factory.mktemp("traced") / "run"
    assert train([RECIPE, *sets(*TINY, "train.steps=2", "train.trace_step=2", f"train.output_dir={run}")]) == 0
    return run


def test_timeline_mistakes_are_one_line_and_write_nothing(traced_run, tmp_path, capsys):
    capsys.readouterr()
    png = tmp_path / "t.png"
    one_error(capsys, timeline.main([str(traced_run), "--window", "abc"]),
              "error: --window 'abc' must be START:END seconds with START < END (e.g. 0:")
    one_error(capsys, timeline.main([str(traced_run), "--png", str(png), "--window", "100:200"]),
              "error: --window '100:200' starts after the traced step ends at ", "nothing to draw")
    one_error(capsys, timeline.main([str(traced_run), "--png", "/proc/tl.png"]), "error: --png /proc/tl.png: cannot ")
    assert not png.exists()
    broken = tmp_path / "broken" / "timeline"
    broken.mkdir(parents=True)
    (broken / "rank0.json").write_text((traced_run / "timeline" / "rank0.json").read_text()[:100])
    one_error(capsys, timeline.main([str(tmp_path / "broken")]),
              f"error: {broken / 'rank0.json'}: not a complete timeline record (")
    one_error(capsys, timeline.main([str(tmp_path / "nope")]), f"error: {tmp_path / 'nope'}: no such run folder")
    one_error(capsys, timeline.main([str(tmp_path)]), "holds no rank*.json: train with --set train.trace_step=N")
    assert timeline.main([str(traced_run), "--png", str(png), "--window", "0:0.001"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_overlap_bench_refuses_an_out_it_cannot_make_before_any_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(overlap_bench, "run_one", lambda *a: pytest.fail("a run started"))
    one_error(capsys, overlap_bench.main(["--out", "/proc/ob"]), "error: --out /proc/ob: cannot create directory")
    (tmp_path / "f").write_text("x")
    one_error(capsys, overlap_bench.main(["--out", str(tmp_path / "f")]), "--out", "is a file")


@pytest.mark.parametrize("ranks, message", [("x", "--ranks 'x': expected first,last, all-roles or global ranks"),
                                            ("0,9", "--ranks '0,9': ranks [9] outside the world of 1")])
def test_dryrun_ranks_mistakes_exit_2_before_the_planner(ranks, message, capsys, monkeypatch):
    monkeypatch.setattr(dryrun, "plan", lambda *a: pytest.fail("the planner ran"))
    one_error(capsys, dryrun.main([RECIPE, "--ranks", ranks]), f"error: {message}")
