"""The attention registry (moe_lc/config/attention_kinds.py): every reference resolves in a layer that may
read it, nothing outside the registry and the kinds' own files decides by kind, and a new kind (here a
variant of MLA, the pattern DeepSeek Sparse Attention follows) is one module plus one entry."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from moe_lc.config import RecomputeConfig, load_config
from moe_lc.config.attention_kinds import ATTENTION_KINDS, AttentionSpec, CoreSeams, attention_kind, load
from moe_lc.config.choices import AttentionKind, RecomputeItem, names
from moe_lc.model import decode
from moe_lc.model.counting import param_counts
from moe_lc.model.mla import MLAttention
from moe_lc.model.recompute import mla_up_replayed
from moe_lc.model.transformer import build_model
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from tests.harness import RECIPES

ROOT = Path(__file__).resolve().parents[1]
MODEL, PARALLEL, CONVERT = ("moe_lc.model.",), ("moe_lc.model.", "moe_lc.parallel."), ("moe_lc.convert.",)
# field -> the layers its references may sit in (qk_clip_rows: read by moe_lc/parallel/qk_clip.py, above the model;
# the training fields: lr_scales read by moe_lc/parallel/parallelize.py, the others by moe_lc/job/)
READER = {"module": MODEL, "params": MODEL, "vector_params": MODEL, "saved_bytes": MODEL, "decode": MODEL,
          "tp_rule": PARALLEL, "tp_groups": PARALLEL, "local": PARALLEL, "ring": PARALLEL, "expanded_ring": PARALLEL,
          "hf_pieces": CONVERT, "hf_family": CONVERT, "core_flops": MODEL,
          "extra_plan": PARALLEL, "qk_clip_rows": MODEL,
          "lr_scales": MODEL, "routers_frozen": MODEL, "fresh_params": MODEL, "step_metrics": PARALLEL,
          "build": MODEL, "positions": MODEL}


def references(kind: AttentionSpec):
    """(field, "module:name") of every reference an entry holds."""
    for field in dataclasses.fields(kind):
        value = getattr(kind, field.name)
        if isinstance(value, CoreSeams):
            yield from ((field.name, ref) for ref in dataclasses.astuple(value) if ref is not None)
        elif isinstance(value, str) and ":" in value:
            yield field.name, value


def test_every_reference_resolves_in_a_layer_its_reader_may_import():
    seen = set()
    for kind in ATTENTION_KINDS.values():
        for field, ref in references(kind):
            seen.add(field)
            assert ref.startswith(READER[field]), (kind.name, field, ref)
            assert callable(load(ref)), (kind.name, field, ref)
    assert seen == set(READER)  # (an unclassified field fails above, on READER[field])


def test_the_recipe_choices_are_the_registry():
    """model.attention's choices are the base kinds; a kind's own recompute item is a recipe choice."""
    assert {k.attention for k in ATTENTION_KINDS.values()} == set(names(AttentionKind))
    for attention in names(AttentionKind):
        assert [k.variant for k in ATTENTION_KINDS.values() if k.attention == attention].count(None) == 1
    assert {k.up_item for k in ATTENTION_KINDS.values()} - {None} <= set(names(RecomputeItem))


# --------------------------------------------------------------------------- nothing else decides by kind

KIND_FILES = {"moe_lc/config/attention_kinds.py", "moe_lc/model/attention.py", "moe_lc/model/mla.py",
              "moe_lc/parallel/cp/latent_ring.py", "moe_lc/model/dsa.py", "moe_lc/parallel/dsa_plan.py"}
COMPARISON = re.compile(r"\battention\s*[!=]=|[!=]=\s*[\"'](?:" + "|".join(ATTENTION_KINDS) + r")[\"']")
MODULE_CLASSES = {k.module.split(":")[1] for k in ATTENTION_KINDS.values()}


def offences(source: str) -> list[str]:
    """Comparisons of model.attention (or of anything with a kind's name) and imports of a kind's module."""
    found = [m.group(0) for m in COMPARISON.finditer(source)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"import {a.name}" for a in node.names if a.name in MODULE_CLASSES]
    return found


def test_the_scan_finds_a_planted_comparison_and_import():
    planted = ("if cfg.attention == 'mla':\n    pass\nfrom moe_lc.model.mla import (LocalAttention,\n"
               "    MLAttention)\nfrom moe_lc.model.attention import Attention\nkind = m.attention != \"gqa\"\n"
               "ok = name == 'gqa'\n")
    assert len(offences(planted)) == 5
    assert offences("from moe_lc.model.mla import attend\nx = attention_kind(cfg).name\n") == []


def test_only_the_registry_and_the_kinds_files_decide_by_kind():
    found = {}
    for top in ("moe_lc", "tools", "eval"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in KIND_FILES and (hits := offences(path.read_text())):
                found[rel] = hits
    assert not found, found


# --------------------------------------------------------------------------- a new kind: one module, one entry


class ProbeMLA(MLAttention):
    """A variant's module: MLA itself, under a kind of its own (DeepSeek Sparse Attention adds its indexer)."""


PROBE = dataclasses.replace(ATTENTION_KINDS["mla"], name="probe", label="probe", variant=lambda m: m.n_layers == 3,
                            module=f"{__name__}:ProbeMLA")
MLA = ["model.attention=mla", "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=8", "model.n_layers=3", "model.dim=32",
       "model.moe.n_routed_experts=4", "model.moe.n_groups=2", "model.moe.ffn_dim=32", "model.ffn_dim=64"]


def test_a_variant_is_one_module_and_one_entry(monkeypatch):
    """An entry whose `variant` holds is the kind of an MLA model: its blocks build its module, the layer
    plan gives it the base kind's seams, decoding and counting follow, and it computes what MLA does."""
    cfg = load_config(RECIPES / "debug_cpu.toml", MLA).model
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 12))
    base = build_model(cfg, seed=1)
    monkeypatch.setitem(ATTENTION_KINDS, "probe", PROBE)
    assert attention_kind(cfg) is PROBE
    assert attention_kind(dataclasses.replace(cfg, n_layers=4)) is ATTENTION_KINDS["mla"]
    model = build_model(cfg, seed=1)
    assert {type(b.attn) for b in model.layers.values()} == {ProbeMLA}
    assert param_counts(cfg)["total"] == sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(model(tokens), base(tokens), rtol=0, atol=0)
    plan = apply_layer_plan(model, options=LayerPlanOptions(recompute=RecomputeConfig(policy="selective",
                                                                               selective=["mla_up"])))
    assert {b.attn.attend for b in model.layers.values()} == {mla_up_replayed}
    assert "layers.0.attn.attend = mla_up_replayed" in plan.describe()
    model.eval()
    assert torch.equal(decode.generate_greedy(model, tokens, 5), decode.generate_uncached(model, tokens, 5))


def test_an_unknown_attention_is_one_choice_error():
    with pytest.raises(ValueError, match="model.attention='nsa' must be one of 'gqa', 'mla'") as info:
        load_config(RECIPES / "debug_cpu.toml", ["model.attention=nsa"])
    assert len(info.value.errors) == 1


# --------------------------------------------------------------------------- a kind's training part: its entry


def probe_lr_scales(m, lr: float):
    """The probe's stage trains its attention only, at half the rate (DSA's warm-up trains its indexer only)."""
    return lambda name: 0.5 if ".attn." in f".{name}" else 0.0


def probe_routers_frozen(m) -> bool:
    return True


def probe_fresh_params(m) -> str:
    return "mtp."  # the stage adds the MTP modules: a checkpoint.init_from without them is fine


def probe_step_metrics(m, stats, dims, device) -> dict:
    return {"probe/layers": float(m.n_layers)}


TRAINING_PROBE = dataclasses.replace(
    PROBE, lr_scales=f"{__name__}:probe_lr_scales", routers_frozen=f"{__name__}:probe_routers_frozen",
    fresh_params=f"{__name__}:probe_fresh_params", step_metrics=f"{__name__}:probe_step_metrics",
    step_reductions=(("world", 8, "the probe's sums (1 fp64)"),))
SHORT = ["train.steps=2", "train.global_batch=4", "train.micro_batch=2", "train.seq_len=16", "train.warmup_steps=1",
         "train.optimizer=sgd"]


def test_a_kind_declares_its_training_part_in_its_entry(monkeypatch, tmp_path):
    """The trainer, its preflight and the planner honour a kind's training fields with no edit outside its
    entry: only what `lr_scales` lets train changes (the routers' biases stay: `routers_frozen`), its
    `step_metrics` reach metrics.jsonl, checkpoint.init_from may lack its `fresh_params`, and the planner
    counts its `step_reductions`."""
    from moe_lc.config import ConfigError
    from moe_lc.job.preflight import init_from_checkpoint
    from moe_lc.train import run
    from tests.harness import FAST
    from tools.planner.layout import mesh, trainer_traffic

    monkeypatch.setitem(ATTENTION_KINDS, "probe", TRAINING_PROBE)
    cfg = load_config(RECIPES / "debug_cpu.toml", FAST + MLA + SHORT + [f"train.output_dir={tmp_path}/a",
                                                                   "checkpoint.save_final=true"])
    assert attention_kind(cfg.model) is TRAINING_PROBE
    start = build_model(cfg.model, cfg.train.seed).state_dict()
    result = run(cfg, keep_final_state=True)
    changed = {n for n, v in start.items() if not torch.equal(result.final_state[n], v.float())}
    assert changed <= {n for n in start if ".attn." in n}  # the routers' expert_bias buffers among the rest
    assert {n for n in start if n.endswith(("attn.wkv_b.weight", "attn.wo.weight"))} <= changed
    rows = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["probe/layers"] for row in rows] == [3.0, 3.0]

    grown = FAST + MLA + SHORT + ["model.mtp.depth=1", f"checkpoint.init_from={tmp_path}/a/checkpoints",
                                  f"train.output_dir={tmp_path}/b"]
    assert run(load_config(RECIPES / "debug_cpu.toml", grown)).losses  # the MTP modules start fresh
    monkeypatch.setitem(ATTENTION_KINDS, "probe", dataclasses.replace(TRAINING_PROBE, fresh_params=None))
    with pytest.raises(ConfigError, match="lacks"):
        init_from_checkpoint(load_config(RECIPES / "debug_cpu.toml", grown))

    traffic = trainer_traffic(cfg, mesh(cfg, 2), [])
    assert [(t.group, t.bytes) for t in traffic if t.what == "the probe's sums (1 fp64)"] == [("world", 8.0)]
