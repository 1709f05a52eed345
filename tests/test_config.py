"""Recipes: loading, extends, overrides, and every-error-at-once validation messages."""

from pathlib import Path

import pytest

from moe_lc.config import Config, ConfigError, load_config, to_toml, validate

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def write(tmp_path, text, name="r.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def errors_of(path, overrides=(), world_size=None):
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), world_size=world_size)
    return info.value.errors


@pytest.mark.parametrize("recipe", sorted(RECIPES.rglob("*.toml")), ids=lambda p: str(p.relative_to(RECIPES)))
def test_every_shipped_recipe_validates(recipe):
    assert isinstance(load_config(recipe), Config)


def test_printed_config_round_trips(tmp_path):
    cfg = load_config(RECIPES / "debug_cpu.toml", ["train.lr=1e-3", "model.moe.score_func=softmax"])
    path = write(tmp_path, to_toml(cfg))
    assert load_config(path) == cfg


def test_extends_merges_base_then_override(tmp_path):
    write(tmp_path, "[train]\nlr = 0.5\nsteps = 7\n[model]\ndim = 64\nn_heads = 2\nn_kv_heads = 1\n", "base.toml")
    child = write(tmp_path, 'extends = "base.toml"\n[train]\nsteps = 9\n')
    cfg = load_config(child)
    assert (cfg.train.lr, cfg.train.steps, cfg.model.dim) == (0.5, 9, 64)


def test_extends_cycle_is_reported(tmp_path):
    write(tmp_path, 'extends = "b.toml"\n', "a.toml")
    write(tmp_path, 'extends = "a.toml"\n', "b.toml")
    assert "extends cycle" in errors_of(tmp_path / "a.toml")[0]


def test_set_overrides_are_typed():
    cfg = load_config(RECIPES / "debug_cpu.toml", ["train.lr=1e-4", "precision.recipe=bf16", "checkpoint.resume=true",
                                                   "data.synthetic_tasks=passkey,multikey_needle", "train.seq_len=256"])
    assert cfg.train.lr == 1e-4 and cfg.precision.recipe == "bf16" and cfg.checkpoint.resume is True
    assert cfg.data.synthetic_tasks == ["passkey", "multikey_needle"] and cfg.train.seq_len == 256


def test_int_field_accepts_no_float_and_float_field_accepts_int():
    cfg = load_config(RECIPES / "debug_cpu.toml", ["train.lr=1"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    errs = errors_of(RECIPES / "debug_cpu.toml", ["train.steps=1.5"])
    assert errs == ["train.steps=1.5 must be an integer, got float"]


def test_unknown_keys_and_sections_suggest_the_right_name():
    errs = errors_of(RECIPES / "debug_cpu.toml", ["train.learning_rate=1", "modle.dim=3", "model.n_expert=4"])
    assert "unknown section [modle] (did you mean 'model'?)" in errs
    assert "unknown key train.learning_rate" in errs  # nothing close enough to suggest
    assert "unknown key model.n_expert (did you mean 'n_experts'?)" not in errs
    assert any(e.startswith("unknown key model.n_expert (did you mean") for e in errs)


def test_a_removed_key_says_what_to_set_instead(tmp_path):
    """parallel.microbatches could only equal the count the batch keys give: an old recipe (or --set) that
    states it gets one line naming the keys that set the count."""
    want = ("parallel.microbatches was removed: the micro-batches per step are train.global_batch / "
            "(train.micro_batch * dp), derived; set train.micro_batch or train.global_batch instead")
    assert errors_of(RECIPES / "debug_cpu.toml", ["parallel.microbatches=2"]) == [want]
    old = tmp_path / "old.toml"
    old.write_text(f'extends = "{(RECIPES / "debug_cpu.toml").as_posix()}"\n[parallel]\nmicrobatches = 0\n')
    assert errors_of(old) == [want]


def test_all_violations_reported_at_once_with_field_value_rule():
    errs = errors_of(RECIPES / "debug_cpu.toml", [
        "parallel.tp=3", "model.moe.topk=0", "train.lr=-1", "precision.recipe=fp16", "train.micro_batch=5"])
    joined = "\n".join(errs)
    assert "parallel.tp=3 must divide model.n_heads=4" in joined
    assert "model.moe.topk=0 must lie in [1, n_routed_experts=8]" in joined
    assert "train.lr=-1.0 must be > 0" in joined
    assert "precision.recipe='fp16' must be one of 'fp32', 'bf16', 'fp8'" in joined
    assert "train.micro_batch=5 must divide train.global_batch=16" in joined
    assert len(errs) >= 5


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.dp=3"], 4, "parallel.pp*dp*cp*tp=3 must equal the world size 4"),
    (["parallel.tp=3"], 4, "parallel.pp*cp*tp=3 must divide the world size"),
    (["parallel.ep=3"], 4, "parallel.ep=3 must divide dp*cp*tp=4"),
    (["parallel.ep=16"], 16, "parallel.ep=16 must divide model.moe.n_routed_experts=8"),
    (["parallel.cp=2", "train.seq_len=130"], 2, "train.seq_len=130 must be divisible by 4"),
    (["train.global_batch=12"], 8, "train.global_batch=12 must be divisible by micro_batch*dp=32"),
    (["parallel.pp=8"], 8, "model.n_layers=4 is fewer than the 8 pipeline stages"),
    (["parallel.ep=4", "parallel.ranks_per_node=2", "model.moe.n_groups=1", "model.moe.topk_groups=1"], 4,
     "model.moe.n_groups=1 must be a multiple of the 2 nodes"),
    (["parallel.ranks_per_node=3"], 4, "parallel.ranks_per_node=3 must divide the world size 4"),
    (["model.n_kv_heads=3"], 1, "model.n_kv_heads=3 must divide model.n_heads=4"),
    (["model.moe.n_groups=3"], 1, "model.moe.n_groups=3 must divide model.moe.n_routed_experts=8"),
    (["model.vocab_size=200"], 1, "model.vocab_size=200 must be >= 259 for the byte tokenizer"),
])
def test_layout_rules(overrides, world, message):
    errs = errors_of(RECIPES / "debug_cpu.toml", overrides, world_size=world)
    assert any(message in e for e in errs), errs


def test_malformed_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[train\nsteps = 3\n")
    (err,) = errors_of(path)
    assert str(path) in err and "malformed TOML" in err


def test_missing_recipe_file(tmp_path):
    (err,) = errors_of(tmp_path / "nope.toml")
    assert "recipe file not found" in err


def test_wrong_type_in_file(tmp_path):
    path = write(tmp_path, '[train]\nsteps = "ten"\n[checkpoint]\nresume = 1\n')
    errs = errors_of(path)
    assert "train.steps='ten' must be an integer, got str" in errs
    assert "checkpoint.resume=1 must be true/false, got int" in errs


def test_bad_set_syntax():
    (err,) = errors_of(RECIPES / "debug_cpu.toml", ["lr=3"])
    assert "expected SECTION.KEY=VALUE" in err


def test_default_config_is_valid():
    validate(Config())


def test_registries_implement_exactly_the_recipe_choices():
    """Each Literal choice type of moe_lc.config.choices is the key set of the registry that implements
    it, so a name can be neither accepted without an implementation nor implemented without a name."""
    from moe_lc.config import choices
    from moe_lc.data.synthetic import TASKS
    from moe_lc.job.lr_schedule import SCHEDULES
    from moe_lc.job.metrics import LOGGERS
    from moe_lc.model.capacity import DROP_POLICIES
    from moe_lc.model.recompute import POLICIES, SELECTIVE_ITEMS
    from moe_lc.ops import attention, fp8_linear
    from moe_lc.parallel.ep.dispatch import DISPATCHERS
    from moe_lc.parallel.pipeline.schedules import BUILDERS

    pairs = {
        "AttnBackend": set(attention._BACKEND_CLASSES) | {"auto"},
        "PPSchedule": set(BUILDERS),
        "ExpertDispatch": set(DISPATCHERS),
        "LrSchedule": set(SCHEDULES),
        "SyntheticTask": set(TASKS),
        "Fp8Scaling": set(fp8_linear.SCALINGS),
        "Fp8Backend": set(fp8_linear.BACKENDS),
        "RecomputePolicy": set(POLICIES),
        "RecomputeItem": set(SELECTIVE_ITEMS),
        "Logger": set(LOGGERS),
        "DropPolicy": set(DROP_POLICIES),
    }
    for name, registry in pairs.items():
        assert registry == set(choices.names(getattr(choices, name))), name


def test_docs_list_every_choice_and_nested_table():
    text = to_toml(load_config(RECIPES / "debug_cpu.toml"), docs=True)
    for table in ("[model]", "[model.moe]", "[model.rope]", "[model.mla]", "[model.mtp]", "[parallel]", "[data]"):
        assert table in text
    assert "auto | reference | torch | cudnn | flash_attn | flash_attn4" in text
    assert "gpipe | 1f1b | interleaved_1f1b | zbh1 | dualpipe | dualpipev" in text
