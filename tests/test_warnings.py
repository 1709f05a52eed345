"""Legal settings that are likely mistakes: one `warning: ` line each on stderr, printed once (rank 0),
and the run goes on. A clean recipe, or a printed config that repeats the defaults, prints none."""

from pathlib import Path

import pytest

from moe_lc.config import load_config, to_toml
from moe_lc.train import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "debug_cpu.toml")
DENSE = str(ROOT / "recipes" / "dense_cpu.toml")
SHIPPED = sorted((ROOT / "recipes").rglob("*.toml"))


def sets(*items):
    return [arg for item in items for arg in ("--set", item)]


def empty_recipe(tmp: Path) -> str:
    (tmp / "empty.toml").write_text("# to be written\n[train]\n")
    return str(tmp / "empty.toml")


# (id, argv builder (tmp_path -> argv), expected fragment of the one warning)
CASES = [
    ("synthetic-tasks-never-drawn", lambda t: [RECIPE, *sets("data.synthetic_tasks=multikey_needle")],
     "warning: data.synthetic_tasks=['multikey_needle'] is set, but data.synthetic_weight = 0"),
    ("yarn-shorter-than-seq-len", lambda t: [RECIPE, *sets("model.rope.scaling=yarn", "model.rope.original_seq_len=64",
                                                           "model.rope.factor=1.5")],
     "warning: train.seq_len=128 is beyond what YaRN is scaled for: model.rope.original_seq_len x factor = 64 x 1.5"),
    ("warmup-beyond-steps", lambda t: [RECIPE, *sets("train.steps=5")],
     "warning: train.warmup_steps=20 exceeds train.steps=5"),
    ("empty-recipe", lambda t: [empty_recipe(t)], "empty.toml sets no keys: every field takes its default"),
    ("capacity-drops-most", lambda t: [RECIPE, *sets("model.moe.capacity_factor=0.0001")],
     "warning: model.moe.capacity_factor=0.0001 drops at least 99.2% of the routed copies even with perfectly "
     "balanced routing: capacity ceil(0.0001 x 512 tokens per router call x topk 2 / 8 experts) = 1 per expert, "
     "against the 128 each gets"),
    ("balancing-without-experts", lambda t: [DENSE, *sets("model.moe.z_loss_weight=1e-3", "model.moe.capacity_factor=1")],
     "warning: model.moe.z_loss_weight=0.001, capacity_factor=1 set, but the model has no MoE layers "
     "(model.moe.n_routed_experts = 0): they do nothing"),
    ("aux-loss-on-dense-blocks", lambda t: [RECIPE, *sets("model.moe.n_dense_layers=4", "model.moe.aux_loss_weight=1e-4")],
     "warning: model.moe.aux_loss_weight=0.0001 set, but the model has no MoE layers (model.moe.n_dense_layers = "
     "n_layers = 4): it does nothing"),
    ("document-mask-on-synthetic", lambda t: [RECIPE, *sets("data.source=synthetic", "data.document_mask=true")],
     "warning: data.document_mask = true with data.source='synthetic': every synthetic sample is one document, so "
     "it changes nothing"),
]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_likely_mistake_gives_one_warning_line(case, tmp_path, capsys):
    _, argv, expected = case
    assert main([*argv(tmp_path), "--print-config"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: "), err
    assert expected in err, err


def test_the_run_goes_on_after_a_warning(tmp_path, capsys):
    argv = [RECIPE, *sets("train.steps=1", "train.seq_len=64", "train.global_batch=4", "train.micro_batch=4",
                          f"train.output_dir={tmp_path / 'run'}")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "step 1/1" in out
    expected = ("warning: train.warmup_steps=20 exceeds train.steps=1: the run ends inside the warmup and never "
                "trains at train.lr=0.0015")
    assert [line for line in err.splitlines() if line.startswith("warning: ")] == [expected], err


def test_a_small_capacity_warns_and_the_console_shows_the_share_dropped(tmp_path, capsys):
    argv = [RECIPE, *sets("train.steps=1", "train.warmup_steps=0", "model.moe.capacity_factor=0.0001",
                          f"train.output_dir={tmp_path / 'run'}")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    warned = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and warned[0].startswith("warning: model.moe.capacity_factor=0.0001 drops at least 99.2%")
    (line,) = [line for line in out.splitlines() if line.startswith("step 1/1")]
    dropped = float(line.split("| dropped ")[1].split("%")[0])
    assert 99.2 <= dropped < 100  # the worst layer's share: at least the balanced floor


def test_only_rank_0_warns(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert main([RECIPE, *sets("train.steps=5"), "--print-config"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_clean_recipe_gives_no_warning(capsys):
    assert main([RECIPE, "--print-config"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("recipe", SHIPPED, ids=[str(p.relative_to(ROOT / "recipes")) for p in SHIPPED])
def test_no_shipped_recipe_warns(recipe):
    warnings = []
    load_config(recipe, check=False, warnings=warnings)  # the world-size rules are test_config's
    assert warnings == []


def test_a_printed_config_repeating_the_defaults_does_not_warn(tmp_path):
    """to_toml writes every key (run directories, converted checkpoints): data.synthetic_tasks = ["passkey"]
    with synthetic_weight = 0 is then the default, not a choice."""
    printed = tmp_path / "config.toml"
    printed.write_text(to_toml(load_config(RECIPE)))
    warnings = []
    load_config(printed, warnings=warnings)
    assert warnings == []


@pytest.mark.parametrize("overrides", [["data.synthetic_weight=0.5"], ["data.source=synthetic"]])
def test_synthetic_tasks_that_are_drawn_do_not_warn(overrides):
    warnings = []
    load_config(RECIPE, ["data.synthetic_tasks=multikey_needle", *overrides], warnings=warnings)
    assert warnings == []


@pytest.mark.parametrize("overrides", [["model.moe.capacity_factor=1.25"], ["model.moe.capacity_factor=0.95"],
                                       ["data.source=synthetic", "data.document_mask=false"],
                                       ["data.document_mask=true"]])
def test_settings_that_take_effect_do_not_warn(overrides):
    warnings = []
    load_config(RECIPE, overrides, warnings=warnings)
    assert warnings == []


def test_the_capacity_warning_counts_the_tokens_of_one_router_call():
    """Under cp x tp a router call sees micro_batch x seq_len / (cp x tp) tokens: 4 x 128 / 4 = 128, 16 per
    expert with topk 1 of 8; capacity_factor 0.5 keeps 8 of them."""
    warnings = []
    load_config(RECIPE, ["model.moe.capacity_factor=0.5", "model.moe.topk=1", "parallel.cp=2", "parallel.tp=2"],
                world_size=4, warnings=warnings)
    assert warnings == ["model.moe.capacity_factor=0.5 drops at least 50.0% of the routed copies even with perfectly "
                        "balanced routing: capacity ceil(0.5 x 128 tokens per router call x topk 1 / 8 experts) = 8 "
                        "per expert, against the 16 each gets; 1.0-1.25 drops a few percent (0 = no capacity)"]
