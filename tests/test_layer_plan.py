"""The layer plan is the one place that decides what a module does (moe_lc/parallel/layer_plan.py):
no code outside it assigns a decided attribute, nothing changes a built model's modules while it
trains, and two rules deciding one attribute differently are refused."""

from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

import pytest
from torch import nn

from moe_lc.config import PrecisionConfig, RecomputeConfig, load_config
from moe_lc.model.fp8_cache import swiglu_fp8_cached
from moe_lc.model.transformer import build_model
from moe_lc.ops.fp8_linear import HoldFp8ForWgrad, KeepFp8ForWgrad
from moe_lc.parallel.layer_plan import DECIDED, LayerPlan, LayerPlanOptions, apply_layer_plan
from tests.harness import FAST, RECIPES, run_workers

ROOT = Path(__file__).resolve().parents[1]
RECIPE = RECIPES / "debug_cpu.toml"
PLAN_FILE = ROOT / "moe_lc" / "parallel" / "layer_plan.py"


def _assignments(tree: ast.AST):
    """(line, attribute, target text, enclosing function) of every `x.attr = ...` / setattr(x, "attr", ...)."""
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            targets = []
            if isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in (child.targets if isinstance(child, ast.Assign) else [child.target]):
                    targets += t.elts if isinstance(t, ast.Tuple) else [t]
            for t in targets:
                if isinstance(t, ast.Attribute):
                    found.append((child.lineno, t.attr, ast.unparse(t.value), func))
            if isinstance(child, ast.Call) and getattr(child.func, "id", None) == "setattr" and len(child.args) == 3 \
                    and isinstance(child.args[1], ast.Constant):
                found.append((child.lineno, child.args[1].value, ast.unparse(child.args[0]), func))
            visit(child, inner)

    visit(tree, None)
    return found


# Where else a decided attribute may be assigned, and why.
ALLOWED = {("moe_lc/parallel/pipeline/stage.py", "_shell"): "the pipeline split assembles a new shell module, "
                                                            "leaving out the embedding / head a stage lacks"}


def test_decided_attributes_are_assigned_only_by_the_layer_plan():
    """Outside layer_plan.py, a decided attribute is only given its default by a constructor
    (`self.<...>.attr = ...` in an __init__: the model's modules and the one Linear), or in ALLOWED."""
    bad = []
    files = [p for d in ("moe_lc", "tools", "eval") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50
    for path in files:
        if path == PLAN_FILE:
            continue
        rel = str(path.relative_to(ROOT))
        for line, attr, target, func in _assignments(ast.parse(path.read_text(), str(path))):
            root = target.split(".")[0]
            constructor_default = func == "__init__" and root == "self"
            if attr in DECIDED and not constructor_default and root != "ctx" and (rel, func) not in ALLOWED:
                bad.append(f"{rel}:{line}: {target}.{attr} (in {func})")
    assert not bad, "decided outside the layer plan:\n" + "\n".join(bad)


def test_the_scan_sees_assignments_it_must_refuse():
    """The scan above finds what it exists to find (a test that cannot fail is a defect)."""
    planted = "def f(m):\n    m.attn.core = 1\n    m.tp, x = 2, 3\n    setattr(m, 'gemms', 4)\n"
    found = {(attr, target) for _, attr, target, _ in _assignments(ast.parse(planted))}
    assert {("core", "m.attn"), ("tp", "m"), ("gemms", "m")} <= found


def test_one_decision_per_attribute():
    model = build_model(load_config(RECIPE).model, seed=0)
    plan = LayerPlan(model)
    plan.set(model.layers["0"].attn, n_heads=2)
    plan.set(model.layers["0"].attn, n_heads=2)  # the same decision twice is fine
    with pytest.raises(AssertionError, match=r"decides layers\.0\.attn\.n_heads twice: 2 and 1"):
        plan.set(model.layers["0"].attn, n_heads=1)
    with pytest.raises(AssertionError, match="'colour' is not a layer-plan decision"):
        plan.set(model, colour="red")


def test_fp8_swiglu_cache_replaces_the_selective_swiglu_replay_and_keeps_linear_inputs_once():
    """One rule per seam: with FP8 caching of SwiGLU and selective "swiglu" recomputation both asked, the
    activation keeps gate|up in FP8 only; the down projection, whose input that rebuilds, holds its
    operands in FP8 only for a deferred W; attention's wo likewise (the core keeps its output), and the
    shared experts' up projection (the router's replay keeps their common input in the compute dtype)."""
    model = build_model(load_config(RECIPE).model, seed=0)
    plan = apply_layer_plan(model, options=LayerPlanOptions(
        precision=PrecisionConfig(recipe="fp8", fp8_backend="emulate", fp8_cache=["linear", "swiglu"]),
        recompute=RecomputeConfig(policy="selective", selective=["norm", "swiglu"])))
    moe = next(iter(model.moe_layers().values()))
    for ffn in (moe.experts, moe.shared):
        assert ffn.activation is swiglu_fp8_cached
        assert isinstance(ffn.w2.keep_input, HoldFp8ForWgrad)
    assert type(moe.experts.w13.keep_input) is KeepFp8ForWgrad and type(moe.shared.w13.keep_input) is HoldFp8ForWgrad
    attn = model.layers["0"].attn
    assert isinstance(attn.wo.keep_input, HoldFp8ForWgrad) and type(attn.wqkv.keep_input) is KeepFp8ForWgrad
    assert model.head.gemms.name == "plain" and "head" not in plan.settings  # the head stays out of FP8
    assert "layers.0.attn.replay = run_now" in plan.describe()


def _train_watching_setattr(rank: int, world: int, overrides: list[str]):
    """Build the rank's trainer, then train two steps recording every attribute assignment on one of the
    model's modules made from outside that module's own methods and outside torch and moe_lc/model."""
    from moe_lc.train import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(RECIPE, FAST + overrides + [f"train.output_dir={tmp}/run"], world_size=world)
        trainer = Trainer(cfg)
        modules = {id(m) for chunk in trainer.parallel.chunks for m in chunk.modules()}
        seen, original = [], nn.Module.__setattr__

        def watching(module, name, value):
            caller = sys._getframe(1)
            where = caller.f_code.co_filename
            inside = caller.f_locals.get("self") is module or "/torch/" in where or "/moe_lc/model/" in where
            if id(module) in modules and not inside:
                seen.append(f"{type(module).__name__}.{name} from {Path(where).name}:{caller.f_lineno}")
            original(module, name, value)

        nn.Module.__setattr__ = watching
        try:
            for _ in range(2):
                trainer.train_step()
        finally:
            nn.Module.__setattr__ = original
        return seen


@pytest.mark.parametrize("layout", [["parallel.pp=2", "parallel.pp_schedule=zbh1", "precision.recipe=fp8",
                                     "precision.fp8_backend=emulate", "precision.fp8_cache=['linear']",
                                     "recompute.policy=selective"],
                                    ["parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.ep=2",
                                     "parallel.dp=2"]])
def test_nothing_sets_a_module_attribute_while_the_model_trains(layout):
    world = 4 if "parallel.dp=2" in layout else 2
    overrides = ["train.steps=2", "train.seq_len=32", "train.global_batch=8", "train.micro_batch=1", *layout]
    for rank, seen in enumerate(run_workers(_train_watching_setattr, world, overrides, timeout_s=300)):
        assert not seen, f"rank {rank}: module attributes set after build: {sorted(set(seen))}"


def test_the_plan_lends_mtp_the_embedding_a_pipeline_stage_lacks():
    """mtp_embed is a decision of the plan (the model's embedding, borrowed): under DualPipe the last stage's
    chunk, which holds the MTP modules and no embedding, calls the one its rank's first stage holds; no other
    chunk borrows it."""
    from moe_lc.parallel.pipeline import build_schedule
    from moe_lc.parallel.pipeline.stage import split_for_rank, stage_layers

    cfg = load_config(RECIPE, ["model.mtp.depth=1"])
    model = build_model(cfg.model, seed=0)
    plan = apply_layer_plan(model)
    assert "<model>.mtp_embed = Borrowed(Embedding)" in plan.describe()
    schedule = build_schedule("dualpipe", 2, 4)
    union, chunks, _ = split_for_rank(model, schedule, 0, stage_layers(cfg.model, schedule.n_stages, 128))
    (last,) = [c for c in chunks if c.mtp is not None]
    assert last.embed is None and last.mtp_embed.module is union.embed is model.embed
    assert all(c.mtp_embed is None for c in chunks if c is not last)
    assert not any("mtp_embed" in name for name, _ in last.named_parameters())  # borrowed, not registered twice
