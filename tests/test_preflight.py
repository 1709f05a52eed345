"""Preflight's device and memory checks. The memory floor (moe_lc/model/memory_floor.py) is a floor (never
above the planner's estimate, which is checked against measurement), refuses a 1M-token debug run within
seconds, and passes every shipped recipe at its own world size on the machine it is meant for. (The
catalogue of whole-run refusals, paths included, is tests/test_bad_inputs.py.)"""

import itertools
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_lc.config import ConfigError, MLAConfig, load_config
from moe_lc.model.memory_floor import block_floor
from moe_lc.ops.attention import unusable_reason
from moe_lc.ops.device import GpuSpec, meta_as_gpu
from moe_lc.job.preflight import _available_ram, attention_error, device_errors, memory_errors
from tools.planner.activation_memory import estimate

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "debug_cpu.toml"
SHIPPED = sorted((ROOT / "recipes").rglob("*.toml"))
GPU_RECIPES = {"deepseek_v3_671b.toml", "moe16b_128k.toml", "longctx/moe16b_extend_32k.toml",
               "longctx/moe16b_extend_128k.toml", "megatron_deepseek_v3_h100.toml",
               "qwen3_235b_a22b_128k.toml", "longctx/v4_flash_1m.toml"}  # and recipes/published/; the rest run on CPU (tests, tools/extend.py)
CPU_BUDGET = 4 * 2**30  # per rank: a small laptop's share, well under what the CPU recipes get


def _models():
    debug = load_config(RECIPE).model
    mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    return {"moe": debug, "dense": load_config(ROOT / "recipes" / "dense_cpu.toml").model,
            "weighted": replace(debug, moe=replace(debug.moe, weighted_swiglu=True)),
            "no-shared": replace(debug, moe=replace(debug.moe, n_shared_experts=0)),
            "mla": replace(debug, attention="mla", mla=mla),
            "mla-q-lora": replace(debug, attention="mla", mla=replace(mla, q_lora_rank=24))}


# name -> (compute bytes, Linear inputs may be FP8, precision.fp8_cache)
PRECISIONS = {"fp32": (4, False, ()), "bf16": (2, False, ()), "fp8": (2, True, ()),
              "fp8-cache-all": (2, True, ("linear", "swiglu", "attn_out")),
              "bf16-cache-swiglu": (2, False, ("swiglu",))}
EVERY_ITEM = ("norm", "swiglu", "attention", "mla_up", "router")
POLICIES = {"none": ("none", ()), "selective": ("selective", ("norm", "swiglu")),
            "attention": ("selective", ("attention",)), "every-item": ("selective", EVERY_ITEM), "full": ("full", ())}


@pytest.mark.parametrize("model", ["moe", "dense", "mla", *(pytest.param(m, marks=pytest.mark.slow)
                                                           for m in ("weighted", "no-shared", "mla-q-lora"))])
def test_the_block_floor_is_under_the_planners_estimate(model):
    m = _models()[model]
    for (prec, (c, fp8_linear, cache)), (name, (policy, items)), tp, cp in itertools.product(
            PRECISIONS.items(), POLICIES.items(), (1, 2), (1, 2)):
        est = estimate(m, 2, 256, c, policy=policy, selective=items, tp=tp, cp=cp, fp8_cache=cache)
        tokens = 2 * 256 / cp
        for i, planned in est.layers.items():
            floor = block_floor(m, i, c, policy, fp8_linear, cache, cp) * tokens / tp
            assert 0 < floor <= planned, (model, prec, name, tp, cp, i, floor, planned)


def test_the_floor_refuses_a_million_tokens_within_seconds(tmp_path):
    if _available_ram() > 123 * 2**30:
        pytest.skip("this machine has more memory than the 123 GiB floor of one such micro-batch")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moe_lc.train", str(RECIPE), "--set", "train.seq_len=1048576",
                           "--set", f"train.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, check=False)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n  - ") == 1, proc.stderr
    for fragment in ("train.seq_len=1048576 with train.micro_batch=4: one micro-batch needs at least 123.0 GiB",
                     "lower train.micro_batch or train.seq_len, or raise parallel.cp"):
        assert fragment in proc.stderr, proc.stderr
    assert elapsed < 30, elapsed


def test_scores_count_only_where_the_backend_keeps_them():
    reference = load_config(RECIPE, ["train.seq_len=16384", "model.attn_backend=reference"])
    (line,) = memory_errors(reference, 1, torch.device("cpu"), 8 * 2**30)
    assert "the (S x S) attention scores 32.0 GiB" in line and "use model.attn_backend = 'auto'" in line, line
    fused = load_config(RECIPE, ["train.seq_len=16384"])  # auto: torch's CPU flash kernel
    assert memory_errors(fused, 1, torch.device("cpu"), 8 * 2**30) == []


def _at_its_world(recipe: Path):
    """(config, world): its own degrees, or with dp = 0 the smallest dp its rules allow."""
    p = load_config(recipe, check=False).parallel
    for dp in [p.dp] if p.dp else [1, 2, 4, 8]:
        world = p.pp * p.cp * p.tp * dp
        try:
            return load_config(recipe, world_size=world), world
        except ConfigError:
            continue
    return load_config(recipe, world_size=world), world  # raises, naming the rule


@pytest.mark.parametrize("recipe", SHIPPED, ids=[str(p.relative_to(ROOT / "recipes")) for p in SHIPPED])
def test_every_shipped_recipe_passes_at_its_world_size(recipe):
    name = str(recipe.relative_to(ROOT / "recipes"))
    cfg, world = _at_its_world(recipe)
    if name in GPU_RECIPES or name.startswith("published/"):  # an 80 GB H100 per rank, as the dry run sees it
        with meta_as_gpu(GpuSpec()) as gpu:
            assert memory_errors(cfg, world, torch.device("meta"), gpu.memory_bytes) == []
    else:
        assert memory_errors(cfg, world, torch.device("cpu"), CPU_BUDGET) == []


def test_cuda_tells_a_cpu_build_from_a_gpu_build_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    (line,) = device_errors("cuda")
    assert line.startswith("train.device='cuda': torch sees no CUDA device (this torch ") and "is a CPU build" in line
    assert line.endswith("use train.device=cpu or auto"), line
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    (line,) = device_errors("cuda")
    assert "(no GPU visible: this torch is built for CUDA 12.9, but torch.cuda.is_available() is False" in line
    assert device_errors("cpu") == device_errors("auto") == []


def test_attention_backends_say_why_they_cannot_run():
    cpu = torch.device("cpu")
    assert [attention_error(name, cpu) for name in ("auto", "reference", "torch")] == [None] * 3
    assert "it runs on CUDA only, and train.device resolves to cpu" in attention_error("flash_attn", cpu)
    with meta_as_gpu(GpuSpec(capability=(8, 0))):
        reason = unusable_reason("flash_attn4", "meta")
    assert "it needs compute capability >= 9.0 (Hopper, Blackwell); this GPU is 8.0" in reason, reason
