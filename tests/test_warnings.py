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


MLA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16"]
DSA = [*MLA, "model.dsa.enabled=true", "model.dsa.index_topk=16", "model.dsa.index_n_heads=4",
       "model.dsa.index_head_dim=16"]  # the sparse stage, top-16 of the debug recipe's 128 tokens
TORCHRUN = "TORCHRUN"  # an argv marker: run with the environment torchrun gives a worker of several per machine
TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "test", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}


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
    ("dsa-keys-without-enabled", lambda t: [RECIPE, *sets(*MLA, "model.dsa.stage=warmup", "model.dsa.index_topk=16")],
     "warning: model.dsa.stage='warmup', index_topk=16 set, but DeepSeek Sparse Attention is off (model.dsa.enabled "
     "= false): they do nothing, and the model trains as dense MLA with every weight training"),
    ("dsa-default-key-without-enabled", lambda t: [RECIPE, *sets(*MLA, "model.dsa.stage=sparse")],
     "warning: model.dsa.stage='sparse' set, but DeepSeek Sparse Attention is off"),
    ("dsa-keys-on-gqa", lambda t: [RECIPE, *sets("model.dsa.index_topk=16")],
     "warning: model.dsa.index_topk=16 set, but DeepSeek Sparse Attention is off (model.dsa.enabled = false; it also "
     "needs model.attention = 'mla', not 'gqa'): it does nothing"),
    ("dsa-topk-covers-the-sequence", lambda t: [RECIPE, *sets(*DSA, "model.dsa.index_topk=128")],
     "warning: model.dsa.index_topk=128 is at or above train.seq_len=128, the keys a query selects from (the whole "
     "sequence, under cp too): every query keeps every key it sees, so the sparse stage computes dense MLA's "
     "attention"),
    ("dsa-warmup-from-random-weights", lambda t: [RECIPE, *sets(*DSA, "model.dsa.stage=warmup")],
     "warning: model.dsa.stage='warmup' without checkpoint.init_from: the warm-up freezes everything but the "
     "indexers, so they learn to imitate the attention of a randomly initialised model"),
    ("qk-clip-below-ln-seq-len", lambda t: [RECIPE, *sets("train.qk_clip=4")],
     "warning: train.qk_clip=4 is below ln(128) = 4.85: QK-clip bounds a head's largest logit by its largest "
     "log-sum-exp, which is 4.85 already for a query attending evenly over its 128 keys, so every head is clipped "
     "every step"),
    ("qk-clip-below-ln-topk", lambda t: [RECIPE, *sets(*DSA, "train.qk_clip=2.5")],
     "warning: train.qk_clip=2.5 is below ln(16) = 2.77: QK-clip bounds a head's largest logit by its largest "
     "log-sum-exp, which is 2.77 already for a query attending evenly over its 16 keys (model.dsa.index_topk, the "
     "sparse stage's selection)"),
    ("offloaded-optimizer-under-torchrun",
     lambda t: [RECIPE, *sets("parallel.placement.optimizer=offloaded"), TORCHRUN],
     "warning: parallel.placement.optimizer = 'offloaded' runs the update on this process's torch CPU threads, and "
     "torchrun set OMP_NUM_THREADS=1 for it (one thread): set train.threads"),
]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_likely_mistake_gives_one_warning_line(case, tmp_path, capsys, monkeypatch):
    _, argv, expected = case
    args = argv(tmp_path)
    if TORCHRUN in args:
        args.remove(TORCHRUN)
        for k, v in TORCHRUN_ENV.items():
            monkeypatch.setenv(k, v)
    assert main([*args, "--print-config"]) == 0
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
                                       ["data.document_mask=true"], DSA, [*DSA, "model.dsa.index_topk=127"],
                                       [*DSA, "model.dsa.stage=warmup", "checkpoint.init_from=runs/mla"],
                                       [*DSA, "model.dsa.stage=warmup", "model.dsa.index_topk=4096",
                                        "checkpoint.init_from=runs/mla"],  # the warm-up attends densely anyway
                                       [*MLA, "model.dsa.enabled=false"], ["train.qk_clip=4.9"],
                                       [*DSA, "train.qk_clip=2.8"], ["parallel.placement.optimizer=offloaded"]])
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


def test_a_printed_dsa_config_repeating_the_defaults_does_not_warn(tmp_path):
    """An MLA run's config.toml writes [model.dsa] whole, with enabled = false and every default: not a choice."""
    printed = tmp_path / "config.toml"
    printed.write_text(to_toml(load_config(RECIPE, MLA)))
    warnings = []
    load_config(printed, warnings=warnings)
    assert warnings == []


@pytest.mark.parametrize("env, device, warns", [
    (TORCHRUN_ENV, "auto", True), (TORCHRUN_ENV, "cuda", True),
    (TORCHRUN_ENV, "cpu", False),  # a CPU run: every op is on those threads, the start-up line says how many
    ({}, "auto", False),  # one process without torchrun: train.threads = 0 takes the idle cores
    ({"TORCHELASTIC_RUN_ID": "test"}, "cuda", False),  # torchrun with one process per machine leaves OMP alone
    ({"TORCHELASTIC_RUN_ID": "test", "OMP_NUM_THREADS": "8"}, "cuda", False),
])
def test_the_offloaded_optimizer_warns_only_where_torchrun_gave_one_thread(env, device, warns, monkeypatch):
    for k in ("TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    warnings = []
    load_config(RECIPE, ["parallel.placement.optimizer=offloaded", f"train.device={device}"], warnings=warnings)
    assert len(warnings) == warns and all("torchrun set OMP_NUM_THREADS=1" in w for w in warnings), warnings


def test_under_cp_the_top_k_is_compared_with_the_whole_sequence():
    """Under cp each rank holds seq_len / cp query rows, but its queries select from every earlier key of the
    ring (moe_lc/ops/dsa_ring.py `select`): a top-64 of 128 tokens on cp 2 is sparse, a top-128 is not."""
    def warned(topk):
        warnings = []
        load_config(RECIPE, [*DSA, "parallel.cp=2", f"model.dsa.index_topk={topk}"], world_size=2, warnings=warnings)
        return warnings

    assert warned(64) == []
    (line,) = warned(128)
    assert line.startswith("model.dsa.index_topk=128 is at or above train.seq_len=128, the keys a query selects from "
                           "(the whole sequence, under cp too)"), line
