"""`python -m moe_lc.convert` on bad inputs and occupied outputs: one line, exit 2, nothing lost or mixed.

- --out: from-hf never writes into a training run (even with --overwrite), replaces an earlier
  conversion only with --overwrite and then whole; to-hf likewise for a Hugging Face model directory;
  an --out that is a file, holds the input, or cannot be written is refused before any weight is read.
  A conversion that fails half-way leaves the earlier --out byte-identical and no staging debris.
- Inputs: a truncated shard, an invalid config.json, a garbage tokenizer (convert, training's
  data.tokenizer, load_tokenizer), the [hf] extra missing, a run with no checkpoint: one line each.
- to-hf writes bos / eos ids and the index (also for one shard), and transformers loads the result.
- from-hf sizes the recipe's [train] for the machine (CPU without CUDA, GPU with; --train-for picks) and
  says so in its header. (Interruptions and stale staging copies: tests/test_convert_interrupt.py.)
- Each family added after the first four refuses, in one line naming the field, what it cannot express
  (a sliding window, clip_qkv, sparse steps, a partial rotary factor outside glm4_moe);
  to-hf names the field that leaves a model without a transformers family.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_lc.config import MoEConfig, load_config, model_config
from moe_lc.convert import ConvertError, from_hf, to_hf
from moe_lc.convert.__main__ import main
from moe_lc.convert.hf_config import family_of
from moe_lc.convert.hf_files import HFWeights
from moe_lc.data import load_tokenizer
from tests import hf_models

# the modules (the package's from_hf / to_hf attributes are the functions)
from_hf_module = importlib.import_module("moe_lc.convert.from_hf")
to_hf_module = importlib.import_module("moe_lc.convert.to_hf")

transformers = pytest.importorskip("transformers")  # a dev dependency: `pip install -e '.[dev]'`
from safetensors.torch import load_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers (config.json bos/eos 1/2, tokenizer's <|begin|> <|end|>)."""
    directory = tmp_path_factory.mktemp("llama") / "hf"
    hf_models.save_model(hf_models.llama(), directory)
    return directory


@pytest.fixture(scope="module")
def conversion(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "ours"
    from_hf(source, out, log=quiet)
    return out


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every directory under `directory`, by relative path."""
    return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes() for p in directory.rglob("*")}


def debris(out: Path) -> list[str]:
    """Staging or set-aside directories left beside `out`."""
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def cli(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def refused(capsys, pattern: str, *argv) -> str:
    rc, err = cli(capsys, *argv)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    return err


def training_run(directory: Path) -> Path:
    (directory / "checkpoints" / "step_00000010").mkdir(parents=True)
    (directory / "checkpoints" / "step_00000010" / "data.distcp").write_bytes(b"weights")
    (directory / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (directory / "config.toml").write_text("[train]\nsteps = 10\n")
    return directory


# -- --out --------------------------------------------------------------------------------------------

def test_from_hf_never_writes_into_a_training_run(source, tmp_path, capsys):
    run = training_run(tmp_path / "run")
    before = snapshot(run)
    for extra in ([], ["--overwrite"]):
        refused(capsys, r"--out .*run is not empty and not an earlier conversion \(it holds checkpoints/, "
                        r"config.toml, metrics.jsonl\)", "from-hf", source, "--out", run, *extra)
    assert snapshot(run) == before and not debris(run)


def test_from_hf_replaces_an_earlier_conversion_only_with_overwrite(source, conversion, tmp_path, capsys):
    out = tmp_path / "ours"
    shutil.copytree(conversion, out)
    (out / "tokenizer" / "stale.txt").write_text("from an older conversion")
    before = snapshot(out)
    refused(capsys, r"is an earlier conversion \(it holds checkpoint/, recipe.toml, tokenizer/\): pass --overwrite",
            "from-hf", source, "--out", out)
    assert snapshot(out) == before
    rc, err = cli(capsys, "from-hf", source, "--out", out, "--overwrite")
    assert rc == 0, err
    after = snapshot(out)
    assert "tokenizer/stale.txt" not in after and not debris(out)
    assert after.keys() == snapshot(conversion).keys()
    assert load_config(out / "recipe.toml").checkpoint.init_from == str(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(capsys, "from-hf", source, "--out", empty)[0] == 0 and (empty / "recipe.toml").is_file()


def test_a_failed_conversion_leaves_the_earlier_one_intact(source, conversion, tmp_path, monkeypatch):
    out = tmp_path / "ours"
    shutil.copytree(conversion, out)
    before = snapshot(out)
    real = from_hf_module.save_checkpoint

    def dies_half_way(root, *args, **kw):
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / "half_written").write_bytes(b"x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(from_hf_module, "save_checkpoint", dies_half_way)
    with pytest.raises(RuntimeError, match="disk full"):
        from_hf(source, out, overwrite=True, log=quiet)
    assert snapshot(out) == before and not debris(out)

    # something appearing at --out while converting (a run started there) is not replaced
    fresh = tmp_path / "fresh"

    def run_appears(root, *args, **kw):
        training_run(fresh)
        return real(root, *args, **kw)

    monkeypatch.setattr(from_hf_module, "save_checkpoint", run_appears)
    with pytest.raises(ConvertError, match="not an earlier conversion"):
        from_hf(source, fresh, log=quiet)
    assert snapshot(fresh) == snapshot(training_run(tmp_path / "twin")) and not debris(fresh)


def test_to_hf_out_rules(conversion, tmp_path, capsys):
    a_file = tmp_path / "model.bin"
    a_file.write_bytes(b"keep")
    refused(capsys, r"--out .*model.bin is a file, not a directory", "to-hf", conversion, "--out", a_file)
    assert a_file.read_bytes() == b"keep"
    run = training_run(tmp_path / "run")
    before = snapshot(run)
    for extra in ([], ["--overwrite"]):
        refused(capsys, r"not a Hugging Face model directory \(it holds checkpoints/, config.toml, metrics.jsonl\)",
                "to-hf", conversion, "--out", run, *extra)
    assert snapshot(run) == before and not debris(run)
    refused(capsys, r"--out .*ours holds the input .*step_00000000", "to-hf", conversion, "--out", conversion,
            "--overwrite")
    hf = tmp_path / "hf"
    assert cli(capsys, "to-hf", conversion, "--out", hf)[0] == 0
    (hf / "stale.safetensors").write_bytes(b"from an older export")
    before = snapshot(hf)
    refused(capsys, r"is a Hugging Face model directory \(it holds config.json, .*\): pass --overwrite",
            "to-hf", conversion, "--out", hf)
    assert snapshot(hf) == before
    assert cli(capsys, "to-hf", conversion, "--out", hf, "--overwrite")[0] == 0
    assert not (hf / "stale.safetensors").exists() and not debris(hf)


def test_unwritable_out_is_refused_before_any_weight_is_read(source, conversion, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(HFWeights, "__init__", lambda *a, **k: pytest.fail("a safetensors file was opened"))
    monkeypatch.setattr(to_hf_module, "_read_group", lambda *a, **k: pytest.fail("a checkpoint tensor was read"))
    out = Path("/proc/moe_lc_convert_out")  # not writable, even by root
    refused(capsys, r"--out /proc/moe_lc_convert_out: cannot write in /proc", "from-hf", source, "--out", out)
    refused(capsys, r"--out /proc/moe_lc_convert_out: cannot write in /proc", "to-hf", conversion, "--out", out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0o555 (the /proc test covers root)")
def test_read_only_directory_is_refused(source, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        refused(capsys, r"cannot write in .*ro \(Permission denied\)", "from-hf", source, "--out", ro / "out")
    finally:
        ro.chmod(0o755)


# -- bad inputs ---------------------------------------------------------------------------------------

def hf_copy(source: Path, directory: Path) -> Path:
    shutil.copytree(source, directory)
    return directory


def test_truncated_shard_is_named(source, tmp_path, capsys):
    hf = hf_copy(source, tmp_path / "hf")
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[:-100])
    refused(capsys, r"model.safetensors: unreadable safetensors file \(.*\): truncated", "from-hf", hf, "--out",
            tmp_path / "out")
    (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    refused(capsys, r"model-00001-of-00002.safetensors: unreadable safetensors file", "from-hf", hf, "--out",
            tmp_path / "out")
    (hf / "model-00001-of-00002.safetensors").write_bytes(data)
    refused(capsys, r"model-00002-of-00002.safetensors: missing \(named in model.safetensors.index.json\)",
            "from-hf", hf, "--out", tmp_path / "out")
    (hf / "model.safetensors.index.json").write_text("{not json")
    refused(capsys, r"model.safetensors.index.json: not a safetensors index", "from-hf", hf, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not debris(tmp_path / "out")


@pytest.mark.parametrize("edit, message", [
    (lambda c: "{not json", r"config.json is not valid JSON \(Expecting property name"),
    (lambda c: "[1, 2]", r"config.json is not a JSON object"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}),
     r"config.json has no 'hidden_size' \(model_type='llama' needs it\)"),
    (lambda c: json.dumps({**c, "rope_parameters": "yarn"}), r"config.json: rope_parameters='yarn' is not an object"),
    (lambda c: json.dumps({**c, "hidden_size": "64"}), r"config.json: hidden_size='64' is not an integer"),
    (lambda c: json.dumps({**c, "rms_norm_eps": [1]}), r"config.json: a field of model_type='llama' has the wrong "
                                                       r"type \(TypeError"),
    (lambda c: json.dumps({**c, "max_position_embeddings": "long"}), r"max_position_embeddings='long' is not an "
                                                                     r"integer"),
])
def test_invalid_config_json_is_one_line(source, tmp_path, capsys, edit, message):
    hf = hf_copy(source, tmp_path / "hf")
    (hf / "config.json").write_text(edit(json.loads((source / "config.json").read_text())))
    refused(capsys, message, "from-hf", hf, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, text, message", [
    ("tokenizer.json", '{"version": "1.0", "model"', r"tokenizer.json is not a tokenizer the `tokenizers` library "
                                                     r"can load \(.*\): a truncated or partial download"),
    ("tokenizer.json", "<html>404</html>", r"tokenizer.json is not a tokenizer the `tokenizers` library can load"),
    ("tokenizer_config.json", "{", r"tokenizer_config.json is not valid JSON"),
])
def test_garbage_tokenizer_is_refused_not_copied(source, tmp_path, capsys, name, text, message):
    hf = hf_copy(source, tmp_path / "hf")
    (hf / name).write_text(text)
    refused(capsys, message, "from-hf", hf, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_garbage_tokenizer_in_a_recipe_or_load_tokenizer(conversion, tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("garbage{")
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizer the `tokenizers` library can load"):
        load_tokenizer(str(bad))  # what tools/prepare_data.py --tokenizer and eval call
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes((conversion / "tokenizer" / "tokenizer.json").read_bytes())
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"tok/tokenizer_config.json is not valid JSON"):
        load_tokenizer(str(tmp_path / "tok"))
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'extends = "{conversion / "recipe.toml"}"\n[data]\ntokenizer = "{bad}"\n')
    refused(capsys, r"to-hf: data.tokenizer=.*tokenizer.json is not a tokenizer", "to-hf", conversion, "--out",
            tmp_path / "hf", "--recipe", recipe)
    train = [sys.executable, "-m", "moe_lc.train", str(recipe), "--set", f"train.output_dir={tmp_path / 'run'}",
             "--set", "train.steps=1", "--set", "data.source=synthetic"]
    done = subprocess.run(train, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"data.tokenizer='{bad}': {bad} is not a tokenizer" in done.stderr, done.stderr


@pytest.mark.parametrize("module", ["safetensors", "tokenizers"])
def test_missing_hf_extra_is_named(source, conversion, tmp_path, capsys, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    for command, src in (("from-hf", source), ("to-hf", conversion)):
        refused(capsys, rf"{command} needs the '{module}' package of the \[hf\] extra: pip install -e '\.\[hf\]'",
                command, src, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    if module == "tokenizers":
        with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
            load_tokenizer(str(conversion / "tokenizer"))


def test_to_hf_of_a_run_without_checkpoint_says_how_to_get_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    refused(capsys, r"to-hf: .*run holds no committed checkpoint .*: train with checkpoint.save_final = true or "
                    r"checkpoint.interval > 0", "to-hf", run, "--out", tmp_path / "hf")
    refused(capsys, r"to-hf: .*nowhere does not exist \(expected a run's train.output_dir", "to-hf",
            tmp_path / "nowhere", "--out", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# -- what to-hf writes --------------------------------------------------------------------------------

def test_to_hf_writes_token_ids_and_an_index_transformers_loads(source, conversion, tmp_path):
    out = tmp_path / "hf"
    to_hf(conversion, out, log=quiet)
    config = json.loads((out / "config.json").read_text())
    want = json.loads((source / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (want["bos_token_id"], want["eos_token_id"]) == (1, 2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    weights = load_file(out / "model.safetensors")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(source).float().eval()
    tokens = torch.randint(0, hf_models.VOCAB, (1, 32))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, original(tokens).logits)
    # without from-hf's record of the source ids: the ids the recipe's tokenizer gave training
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'extends = "{conversion / "recipe.toml"}"\n[data]\ntokenizer = "{source}"\n')
    to_hf(conversion, tmp_path / "hf2", recipe=recipe, log=quiet)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    tok = load_tokenizer(str(source))
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok._tok.token_to_id("<|begin|>"),
                                                                tok._tok.token_to_id("<|end|>"))


def test_converted_recipe_shows_a_recipe_that_extends_it(conversion, tmp_path):
    """The example in recipe.toml's header, written out as my_run.toml, is a recipe whose run to-hf finds."""
    lines = (conversion / "recipe.toml").read_text().splitlines()
    example = [line.removeprefix("#     ") for line in lines if line.startswith("#     ")]
    (tmp_path / "my_run.toml").write_text("\n".join(example) + "\n")
    cfg = load_config(tmp_path / "my_run.toml")
    assert cfg.train.output_dir == "runs/my_run" and cfg.checkpoint.init_from == str(conversion)
    assert any("to-hf runs/my_run" in line for line in lines)


@pytest.fixture(scope="module")
def long_source(tmp_path_factory) -> Path:
    """The tiny Llama with max_position_embeddings 8192 (a GPU recipe's seq_len 4096, a CPU's 256)."""
    config = hf_models.llama()
    config.max_position_embeddings = 8192
    directory = tmp_path_factory.mktemp("llama8k") / "hf"
    hf_models.save_model(config, directory)
    return directory


def train_sizes(out: Path) -> tuple[int, int, int]:
    t = load_config(out / "recipe.toml").train
    return t.seq_len, t.global_batch, t.micro_batch


CPU_LINE = "# [train] is sized for a CPU (--train-for cpu{}): seq_len = 256, global_batch = 8, micro_batch = 4."
GPU_LINE = "# [train] is sized for a GPU (--train-for gpu{}): seq_len = 4096, global_batch = 16, micro_batch = 8."


def test_recipe_train_sizes_follow_the_machine(long_source, tmp_path, capsys, monkeypatch):
    """Without CUDA the recipe's [train] is CPU-sized (a 30-step example at the GPU sizes ran 39 s a step),
    with CUDA GPU-sized; --train-for picks either; the header says which, why and the other's sizes."""
    here = "gpu" if torch.cuda.is_available() else "cpu"  # this machine, unpatched
    from_hf(long_source, tmp_path / "here", log=quiet)
    assert train_sizes(tmp_path / "here") == {"cpu": (256, 8, 4), "gpu": (4096, 16, 8)}[here]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from_hf(long_source, tmp_path / "cpu", log=quiet)
    lines = (tmp_path / "cpu" / "recipe.toml").read_text().splitlines()
    assert train_sizes(tmp_path / "cpu") == (256, 8, 4)
    assert CPU_LINE.format(", the default without CUDA") in lines, lines[:12]
    assert ("# For a GPU set seq_len = 4096, global_batch = 16, micro_batch = 8 in your [train], or convert with "
            "--train-for gpu") in lines, lines[:12]
    assert cli(capsys, "from-hf", long_source, "--out", tmp_path / "gpu", "--train-for", "gpu")[0] == 0
    assert train_sizes(tmp_path / "gpu") == (4096, 16, 8)
    assert GPU_LINE.format("") in (tmp_path / "gpu" / "recipe.toml").read_text().splitlines()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert from_hf_module.default_train_for() == "gpu"
    monkeypatch.undo()  # DCP's writer would then look for a CUDA stream
    monkeypatch.setattr(from_hf_module, "default_train_for", lambda: "gpu")
    from_hf(long_source, tmp_path / "cuda", log=quiet)
    lines = (tmp_path / "cuda" / "recipe.toml").read_text().splitlines()
    assert train_sizes(tmp_path / "cuda") == (4096, 16, 8)
    assert GPU_LINE.format(", the default where torch sees CUDA") in lines, lines[:12]
    assert ("# For a CPU set seq_len = 256, global_batch = 8, micro_batch = 4 in your [train], or convert with "
            "--train-for cpu") in lines, lines[:12]
    from_hf(long_source, tmp_path / "cpu2", train_for="cpu", log=quiet)
    assert train_sizes(tmp_path / "cpu2") == (256, 8, 4)
    with pytest.raises(ConvertError, match=r"train_for='tpu': expected one of gpu, cpu"):
        from_hf(long_source, tmp_path / "tpu", train_for="tpu", log=quiet)


# -- the families added after the first four -------------------------------------------------------

@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family -> a saved tiny random model of tests/hf_models.NEW_FAMILIES, made on first use."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = tmp_path_factory.mktemp(family) / "hf"
            hf_models.save_model(hf_models.NEW_FAMILIES[family](), made[family])
        return made[family]
    return get


@pytest.mark.parametrize("family, edit, message", [
    ("mixtral", {"sliding_window": 4096}, r"sliding_window=4096 is not supported"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported \(only the first k layers"),
    ("qwen2_moe", {"use_sliding_window": True}, r"use_sliding_window=True is not supported"),
    ("olmoe", {"clip_qkv": 8.0}, r"clip_qkv=8.0 is not supported"),
    ("qwen3", {"use_sliding_window": True}, r"use_sliding_window=True is not supported"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types=\[.*\] is not supported"),
    ("llama3", {"rope_parameters": {**hf_models.LLAMA3, "partial_rotary_factor": 0.5}},
     r"partial_rotary_factor=0.5 is not supported for model_type='llama'"),
    ("glm4_moe", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
])
def test_new_family_refuses_what_it_cannot_express(family_dir, tmp_path, capsys, monkeypatch, family, edit, message):
    source = family_dir(family)
    capsys.readouterr()  # save_pretrained's progress bar
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **edit}))
    (hf / "model.safetensors").symlink_to(source / "model.safetensors")
    monkeypatch.setattr(HFWeights, "get", lambda *a: pytest.fail("a weight was read"))
    refused(capsys, message, "from-hf", hf, "--out", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def gqa_moe(**moe) -> object:
    """A GQA MoE config, softmax top-2 of 8 renormalized, no shared expert (mixtral's) unless `moe` says."""
    keys = dict(n_dense_layers=0, n_routed_experts=8, n_shared_experts=0, ffn_dim=32, topk=2, n_groups=1,
                topk_groups=1, score_func="softmax", norm_topk_prob=True, bias_update_speed=0.0)
    return model_config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, moe=MoEConfig(**{**keys, **moe}))


@pytest.mark.parametrize("cfg, message", [
    (gqa_moe(n_shared_experts=1), r"n_shared_experts=1 without shared_expert_gate"),
    (gqa_moe(routed_scaling_factor=2.0), r"routed_scaling_factor=2.0 has no GQA MoE family"),
    (gqa_moe(n_groups=4, topk_groups=2), r"n_groups=4 \(group-limited softmax routing is DeepSeek-V2's"),
    (gqa_moe(norm_topk_prob=False), r"norm_topk_prob = false without qk_norm: mixtral always renormalizes"),
    (gqa_moe(n_dense_layers=1), r"n_dense_layers=1: mixtral has no dense layers"),
])
def test_to_hf_names_why_a_gqa_moe_model_has_no_family(cfg, message):
    assert family_of(gqa_moe()) == "mixtral" and family_of(gqa_moe(score_func="sigmoid")) == "glm4_moe"
    with pytest.raises(ConvertError, match=message):
        family_of(cfg)
