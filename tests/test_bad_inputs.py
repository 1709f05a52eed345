"""A catalogue of bad inputs: each ends with one clear error (exit status 2, no traceback) that names
the field, value and rule, before any training work is lost."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_lc.job.preflight import _available_ram
from moe_lc.train import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "debug_cpu.toml")
FAST = ["--set", "train.steps=1", "--set", "train.seq_len=64", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=4", "--set", "train.warmup_steps=0"]  # no warning before the error


def sets(*items):
    out = []
    for item in items:
        out += ["--set", item]
    return out


def write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


# (id, argv builder (tmp_path -> argv), WORLD_SIZE, expected message fragment)
CASES = [
    # files and syntax
    ("malformed-toml", lambda t: [write(t, "r.toml", "[train\nsteps = 1")], 1, "malformed TOML"),
    ("missing-recipe", lambda t: [str(t / "nope.toml")], 1, "recipe file not found"),
    ("extends-cycle", lambda t: [write(t, "a.toml", 'extends = "a.toml"')], 1, "extends cycle"),
    ("extends-not-string", lambda t: [write(t, "r.toml", "extends = 3")], 1, "extends=3 must be a path string"),
    ("unknown-section", lambda t: [RECIPE, *sets("modle.dim=3")], 1, "unknown section [modle] (did you mean 'model'?)"),
    ("unknown-key", lambda t: [RECIPE, *sets("train.setps=3")], 1, "unknown key train.setps (did you mean 'steps'?)"),
    ("section-not-table", lambda t: [write(t, "r.toml", "model = 3")], 1, "[model] must be a table, got int"),
    ("key-before-section", lambda t: [write(t, "r.toml", "steps = 3\n[train]\nlr = 1e-3\n")], 1,
     "r.toml: `steps = 3` sits before any [section] header (did you mean [train] steps?)"),
    ("key-before-section-shared", lambda t: [write(t, "r.toml", "ffn_dim = 64\n[train]\n")], 1,
     "`ffn_dim = 64` sits before any [section] header (a key of [model] and [model.moe]"),
    ("wrong-type-str", lambda t: [RECIPE, *sets("train.steps=ten")], 1, "train.steps='ten' must be an integer, got str"),
    ("wrong-type-float", lambda t: [RECIPE, *sets("train.steps=1.5")], 1, "train.steps=1.5 must be an integer, got float"),
    ("wrong-type-bool", lambda t: [RECIPE, *sets("checkpoint.resume=1")], 1, "checkpoint.resume=1 must be true/false"),
    ("bad-set-syntax", lambda t: [RECIPE, "--set", "lr=3"], 1, "expected SECTION.KEY=VALUE"),
    ("list-of-wrong-type", lambda t: [RECIPE, *sets("parallel.pp_stage_layers=[1.5]")], 1,
     "parallel.pp_stage_layers=[1.5] must be a list of an integer"),
    # model rules
    ("kv-heads", lambda t: [RECIPE, *sets("model.n_kv_heads=3")], 1, "model.n_kv_heads=3 must divide model.n_heads=4"),
    ("topk", lambda t: [RECIPE, *sets("model.moe.topk=9")], 1, "model.moe.topk=9 must lie in [1, n_routed_experts=8]"),
    ("groups", lambda t: [RECIPE, *sets("model.moe.n_groups=3")], 1, "model.moe.n_groups=3 must divide model.moe.n_routed_experts=8"),
    ("topk-groups", lambda t: [RECIPE, *sets("model.moe.topk_groups=5")], 1, "model.moe.topk_groups=5 must lie in [1, n_groups=4]"),
    ("vocab-small", lambda t: [RECIPE, *sets("model.vocab_size=200")], 1, "model.vocab_size=200 must be >= 259"),
    ("rope-odd", lambda t: [RECIPE, *sets("model.n_heads=8", "model.n_kv_heads=8", "model.dim=120")], 1,
     "must be even for RoPE"),
    ("yarn-factor", lambda t: [RECIPE, *sets("model.rope.scaling=yarn", "model.rope.factor=0.5")], 1,
     "model.rope.factor=0.5 must be >= 1"),
    ("mla-ranks", lambda t: [RECIPE, *sets("model.attention=mla")], 1, "model.mla.kv_lora_rank=0 must be > 0"),
    ("score-func", lambda t: [RECIPE, *sets("model.moe.score_func=relu")], 1, "model.moe.score_func='relu' must be one of"),
    # layouts
    ("world-mismatch", lambda t: [RECIPE, *sets("parallel.dp=3")], 4, "parallel.pp*dp*cp*tp=3 must equal the world size 4"),
    ("tp-heads", lambda t: [RECIPE, *sets("parallel.tp=3")], 3, "parallel.tp=3 must divide model.n_heads=4"),
    ("ep-divides", lambda t: [RECIPE, *sets("parallel.ep=3")], 4, "parallel.ep=3 must divide dp*cp*tp=4"),
    ("ep-experts", lambda t: [RECIPE, *sets("parallel.ep=16")], 16, "parallel.ep=16 must divide model.moe.n_routed_experts=8"),
    ("cp-seq", lambda t: [RECIPE, *sets("parallel.cp=4", "train.seq_len=100")], 4, "train.seq_len=100 must be divisible by 8"),
    ("batch", lambda t: [RECIPE, *sets("train.global_batch=6")], 2, "train.global_batch=6 must be divisible by micro_batch*dp=8"),
    ("pp-layers", lambda t: [RECIPE, *sets("parallel.pp=8")], 8, "model.n_layers=4 is fewer than the 8 pipeline stages"),
    ("dualpipe-odd", lambda t: [RECIPE, *sets("parallel.pp=3", "parallel.pp_schedule=dualpipe", "model.n_layers=6")], 3,
     "dualpipe needs pp even"),
    ("mtp-1f1b", lambda t: [RECIPE, *sets("parallel.pp=2", "model.mtp.depth=1")], 2, "needs pp_schedule 'dualpipe' or 'dualpipev'"),
    ("ranks-per-node", lambda t: [RECIPE, *sets("parallel.ranks_per_node=3")], 4, "parallel.ranks_per_node=3 must divide the world size 4"),
    ("stage-layers", lambda t: [RECIPE, *sets("parallel.pp=2", "parallel.pp_stage_layers=[1,1]")], 2,
     "parallel.pp_stage_layers=[1, 1] must list 2 positive block counts summing to model.n_layers=4"),
    ("node-groups", lambda t: [RECIPE, *sets("parallel.ep=4", "parallel.ranks_per_node=2", "model.moe.n_groups=1",
                                             "model.moe.topk_groups=1")], 4, "must be a multiple of the 2 nodes"),
    ("cp-a2a-zero", lambda t: [RECIPE, *sets("parallel.cp_a2a=0")], 1, "parallel.cp_a2a=0 must be > 0"),
    ("cp-a2a-divides", lambda t: [RECIPE, *sets("parallel.cp=2", "parallel.cp_a2a=3")], 2,
     "parallel.cp_a2a=3 must divide parallel.cp=2"),
    # training
    ("lr", lambda t: [RECIPE, *sets("train.lr=-1")], 1, "train.lr=-1.0 must be > 0"),
    ("warmup", lambda t: [RECIPE, *sets("train.warmup_steps=-1")], 1, "train.warmup_steps=-1 must be >= 0"),
    ("precision", lambda t: [RECIPE, *sets("precision.recipe=fp16")], 1, "precision.recipe='fp16' must be one of"),
    ("recompute", lambda t: [RECIPE, *sets("recompute.selective=norm,softmax")], 1, "recompute.selective='softmax' must be one of"),
    ("zero-heads", lambda t: [RECIPE, *sets("model.n_heads=0")], 1, "model.n_heads=0 must be > 0"),
    ("zero-dim", lambda t: [RECIPE, *sets("model.dim=0")], 1, "model.dim=0 must be > 0"),
    ("zero-micro-batch", lambda t: [RECIPE, *sets("train.micro_batch=0")], 1, "train.micro_batch=0 must be > 0"),
    ("negative-eps", lambda t: [RECIPE, *sets("train.eps=-1e-8")], 1, "train.eps=-1e-08 must be >= 0"),
    ("nan-clip", lambda t: [RECIPE, *sets("train.grad_clip=nan")], 1, "train.grad_clip=nan must be a finite number"),
    ("inf-lr", lambda t: [RECIPE, *sets("train.lr=inf")], 1, "train.lr=inf must be a finite number"),
    ("inf-timeout", lambda t: [RECIPE, *sets("parallel.timeout_s=inf")], 1, "parallel.timeout_s=inf must be a finite"),
    ("huge-int", lambda t: [RECIPE, *sets("model.dim=123456789012345678901")], 1, "is out of range"),
    ("huge-model", lambda t: [RECIPE, *sets("model.dim=1000000000")], 1, "parameters: even spread evenly over 1 rank"),
    ("recipe-is-dir", lambda t: [str(t)], 1, "is a directory, not a TOML file"),
    ("recipe-not-utf8", lambda t: [_binary_file(t)], 1, "not UTF-8 text"),
    ("output-dir-is-file", lambda t: [RECIPE, *sets(f"train.output_dir={_binary_file(t)}")], 1,
     "is a file, not a directory"),
    ("output-dir-dev-null", lambda t: [RECIPE, *sets("train.output_dir=/dev/null")], 1,
     "train.output_dir='/dev/null': /dev/null is a character device, not a directory"),
    ("checkpoint-dir-dev-null", lambda t: [RECIPE, *sets("checkpoint.dir=/dev/null/ckpt")], 1,
     "checkpoint.dir='/dev/null/ckpt': /dev/null is a character device, not a directory"),
    ("output-dir-in-proc", lambda t: [RECIPE, *sets("train.output_dir=/proc/moe_lc_run")], 1,
     "train.output_dir='/proc/moe_lc_run': /proc is on the kernel's proc filesystem, where no run directory"),
    ("checkpoint-dir-in-sys", lambda t: [RECIPE, *sets("checkpoint.dir=/sys/moe_lc/ckpt")], 1,
     "checkpoint.dir='/sys/moe_lc/ckpt': /sys is on the kernel's sysfs filesystem"),
    ("output-dir-unwritable", lambda t: [RECIPE, *sets(f"train.output_dir={_read_only_dir(t) / 'run'}")], 1,
     "/ro/run': cannot create it: "),
    # devices and kernels
    ("cuda-without-gpu", lambda t: [RECIPE, *sets("train.device=cuda")], 1,
     "train.device='cuda': torch sees no CUDA device"),
    ("flash-attn-on-cpu", lambda t: [RECIPE, *sets("train.device=cpu", "model.attn_backend=flash_attn")], 1,
     "model.attn_backend='flash_attn': it runs on CUDA only, and train.device resolves to cpu"),
    ("flash-attn4-on-cpu", lambda t: [RECIPE, *sets("train.device=cpu", "model.attn_backend=flash_attn4")], 1,
     "model.attn_backend='flash_attn4': it runs on CUDA only"),
    ("activations-too-big", lambda t: [RECIPE, *sets("train.seq_len=1048576")], 1,
     "train.seq_len=1048576 with train.micro_batch=4: one micro-batch needs at least"),
    ("old-flat-key", lambda t: [RECIPE, *sets("model.rope_factor=4")], 1, "model.rope_factor moved to model.rope.factor"),
    # data
    ("tokens-no-path", lambda t: [RECIPE, *sets("data.source=tokens")], 1, "data.path is empty"),
    ("tokens-missing", lambda t: [RECIPE, *FAST, *sets("data.source=tokens", f"data.path={t / 'none'}")], 1, "data:"),
    ("tokens-truncated", lambda t: [RECIPE, *FAST, *sets("data.source=tokens", f"data.path={_token_file(t, truncate=True)}")],
     1, "truncated or corrupt"),
    ("tokens-tokenizer", lambda t: [RECIPE, *FAST, *sets("data.source=tokens", f"data.path={_token_file(t, tokenizer='other')}")],
     1, "was built with tokenizer 'other'"),
    ("tokenizer-spec", lambda t: [RECIPE, *FAST, *sets("data.tokenizer=gpt2")], 1, "data.tokenizer='gpt2'"),
    ("synthetic-short", lambda t: [RECIPE, *sets("data.source=synthetic", "train.seq_len=32")], 1,
     "train.seq_len=32 must be >= 64 for synthetic"),
    ("tokens-empty-prepare", lambda t: [RECIPE, *FAST, *sets("data.source=tokens", f"data.path={_prepared(t, docs=0)}")],
     1, f"data: split 'train' of {{t}}/c holds no documents (c.train.shards.json lists no shards)"),
    ("mixture-empty-prepare", lambda t: [RECIPE, *FAST, *sets(_mixture(_prepared(t, docs=0)))], 1,
     "data: data source 'c': split 'train' of"),
    ("mixture-concat-by-null", lambda t: [RECIPE, *FAST, *sets(_mixture(_prepared(t), 'concat_by = "repo"'))], 1,
     "data: data source 'c': concat_by='repo': no document has a value for it (null or empty in all 20)"),
    ("mixture-no-document-kept", lambda t: [RECIPE, *FAST, *sets(_mixture(_prepared(t), "min_doc_tokens = 1000"))], 1,
     "data: data source 'c': no document has between 1000 and any number of tokens (the longest has 101)"),  # once
    # checkpoints
    ("ckpt-corrupt-metadata", lambda t: [RECIPE, *FAST, *sets(f"checkpoint.dir={_corrupt_checkpoint(t)}", "checkpoint.resume=true")],
     1, "unreadable checkpoint metadata"),
    ("ckpt-other-model", lambda t: [RECIPE, *FAST, *sets(f"checkpoint.dir={_checkpoint(t)}", "checkpoint.resume=true",
                                                         "model.dim=64")], 1, "cannot load"),
    ("ckpt-missing-shard", lambda t: [RECIPE, *FAST, *sets(f"checkpoint.dir={_checkpoint(t, drop_shard=True)}",
                                                           "checkpoint.resume=true")], 1, "cannot load"),
]


def _binary_file(tmp: Path) -> str:
    path = tmp / "binary.toml"
    path.write_bytes(b"\xff\xfe[train]\n")
    return str(path)


def _read_only_dir(tmp: Path) -> Path:
    path = tmp / "ro"
    path.mkdir()
    path.chmod(0o500)
    return path


# cases this machine cannot pose: (id -> why)
SKIP = {**({"output-dir-unwritable": "runs as root, whom chmod does not stop (the /proc and /sys cases stand "
                                     "for a directory nobody can make)"} if os.geteuid() == 0 else {}),
        **({"cuda-without-gpu": "torch sees a GPU here"} if torch.cuda.is_available() else {}),
        **({"activations-too-big": "this machine has more memory than the case's 123 GiB floor"}
           if _available_ram() > 123 * 2**30 else {})}


def _token_file(tmp: Path, truncate: bool = False, tokenizer: str = "byte") -> Path:
    from moe_lc.data import write_token_file

    prefix = tmp / "tok"
    for split in ("train", "val"):
        write_token_file(f"{prefix}.{split}", np.arange(2000) % 250, tokenizer, 259, "test")
    if truncate:
        bin_path = Path(f"{prefix}.train.bin")
        bin_path.write_bytes(bin_path.read_bytes()[:1001])
    return prefix


def _prepared(tmp: Path, docs: int = 20) -> Path:
    """A prepare_data output (PREFIX c) of `docs` 100-token documents whose metadata field "repo" is null
    in every one; docs=0: the manifests of a prepare that found no documents (earlier versions wrote them)."""
    from moe_lc.data.shards import SplitShards
    from moe_lc.data.tokenizer import ByteTokenizer

    prefix = tmp / "c"
    for split in ("train", "val"):
        shards = SplitShards(str(prefix), split, ByteTokenizer(), 1 << 20, ("repo",), "test")
        for k in range(docs):
            shards.add(np.full(100, 65 + k, dtype=np.uint16), {"repo": None}, (k, 0))
        shards.finish()
    return prefix


def _mixture(prefix: Path, extra: str = "") -> str:
    return f'data.sources=[{{source = "stdlib", weight = 0.5}}, {{path = "{prefix}", weight = 0.5{", " + extra if extra else ""}}}]'


def _checkpoint(tmp: Path, drop_shard: bool = False) -> Path:
    """A real checkpoint of the debug model (1 step)."""
    root = tmp / "ckpt"
    rc = main([RECIPE, *FAST, *sets(f"train.output_dir={tmp / 'run'}", "checkpoint.interval=1", f"checkpoint.dir={root}")])
    assert rc == 0
    if drop_shard:
        for shard in (root / "step_00000001").glob("*.distcp"):
            shard.unlink()
    return root


def _corrupt_checkpoint(tmp: Path) -> Path:
    root = _checkpoint(tmp)
    (root / "step_00000001" / ".metadata").write_bytes(b"\x00 not a pickle")
    return root


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_error(case, tmp_path, capsys, monkeypatch):
    name, argv, world, expected = case
    if name in SKIP:
        pytest.skip(SKIP[name])
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = argv(tmp_path)
    capsys.readouterr()  # drop the output of fixtures that trained a model
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code = main(args if any("output_dir" in a for a in args) else args + ["--set", f"train.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: "), err
    assert expected.replace("{t}", str(tmp_path)) in err, err
    assert "Traceback" not in err


def test_the_catalogue_is_large():
    assert len(CASES) >= 30


def _fake_compiler(tmp: Path) -> Path:
    """A 'C++ compiler' that answers --version and fails to build anything."""
    path = tmp / "fake-cxx"
    path.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho "fake-cxx: error: cannot build" >&2\nexit 1\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("compiler, expected", [
    ("missing", "train.compile=true: torch.compile's CPU backend (inductor) needs a C++ compiler, and none answers "
                "(tried {cxx}: the CXX environment variable, else g++)"),
    ("broken", "train.compile=true: the C++ compiler {cxx} (inductor's: $CXX, else g++) cannot build a shared library "
               "(fake-cxx: error: cannot build)"),
])
def test_compile_without_a_working_cpp_compiler_stops_at_start(compiler, expected, tmp_path, capsys, monkeypatch):
    """The compiler inductor would use (torch._inductor.config.cpp.cxx, read from $CXX when torch starts)
    is asked before any model is built: one line instead of inductor's traceback at step 1."""
    from torch._inductor import config as inductor_config

    cxx = str(tmp_path / "no" / "g++") if compiler == "missing" else str(_fake_compiler(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "1")
    # torch's own patch: monkeypatch's undo deletes the attribute from the config proxy (seen with pytest 9.2),
    # which breaks every later compile in this process
    with inductor_config.patch({"cpp.cxx": (None, cxx)}):
        code = main([RECIPE, *FAST, *sets("train.compile=true", f"train.output_dir={tmp_path / 'out'}")])
    assert inductor_config.cpp.cxx != (None, cxx)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert expected.format(cxx=cxx) in err, err
    assert not (tmp_path / "out").exists()


def test_compile_with_cxx_pointing_nowhere_stops_at_start(tmp_path):
    """As a user meets it: CXX set in the environment of a fresh process."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "moe_lc.train", RECIPE, *FAST, *sets("train.compile=true",
                           f"train.output_dir={tmp_path / 'out'}")], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "CXX": str(tmp_path / "no-g++"), "WORLD_SIZE": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 2, proc.stderr  # the header and the rule
    assert f"none answers (tried {tmp_path / 'no-g++'}: the CXX environment variable" in proc.stderr


def _dryrun(argv):
    from tools.dryrun import main as dryrun_main

    return dryrun_main(argv)


ENTRY_POINTS = {"train": lambda argv: main(argv), "print-config": lambda argv: main([*argv, "--print-config"]),
                "dryrun": _dryrun}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_cp_a2a_zero_is_one_rule_at_every_entry_point(entry, tmp_path, capsys, monkeypatch):
    """parallel.cp_a2a = 0 once divided by zero in the layout rule (a ZeroDivisionError traceback from train,
    --print-config and the dry run); now the section rule names it and the layout rules wait for it."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = ENTRY_POINTS[entry]([RECIPE, *sets("parallel.cp_a2a=0", f"train.output_dir={tmp_path / 'out'}")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err == "error: invalid recipe (1 problem):\n  - parallel.cp_a2a=0 must be > 0\n", err


def _numeric_keys(cls, path: str):
    """Dotted names of every int and float field of a section class, sub-tables included."""
    import dataclasses
    from typing import get_type_hints

    hints = get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[fl.name]):
            yield from _numeric_keys(hints[fl.name], f"{path}.{fl.name}")
        elif hints[fl.name] in (int, float):
            yield f"{path}.{fl.name}"


def _all_numeric_keys():
    from moe_lc.config.sections import SECTIONS

    return [key for name, cls in SECTIONS.items() for key in _numeric_keys(cls, name)]


DSA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16", "model.dsa.enabled=true", "model.dsa.index_topk=16",
       "model.dsa.index_n_heads=4", "model.dsa.index_head_dim=16"]


@pytest.mark.parametrize("key", _all_numeric_keys())
def test_a_numeric_key_at_zero_or_below_is_a_rule_or_legal(key):
    """Every numeric key at 0 and -1, on the debug MoE (GQA) and on it with DSA (whose rules apply only when
    on), against the recipe's own world (the dry run) and one process (train): the recipe either loads, or
    stops with rules that name the key; never another exception (parallel.cp_a2a = 0 was a ZeroDivisionError)."""
    from moe_lc.config import ConfigError, load_config

    for base in ([], DSA):
        for value in (0, -1):
            for world in (None, 1):
                try:
                    load_config(RECIPE, [*base, f"{key}={value}"], world_size=world, warnings=[])
                except ConfigError as exc:
                    assert any(key in line for line in exc.errors), (value, world, exc.errors)


def test_every_numeric_key_is_scanned():
    keys = _all_numeric_keys()
    assert len(keys) >= 80 and "parallel.cp_a2a" in keys and "model.dsa.index_topk" in keys
