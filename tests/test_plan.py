"""tools/plan.py: published ZeRO figures, and the planner held to measurement.

Saved activations and traffic are traced (tools/planner/block_trace.py: one block of each kind forward and
backward on the meta device): the traced bytes must equal what a real CPU forward keeps
(`measure_saved_bytes`), part by part and under every recompute policy, and what a split backward
leaves for W what the W closures of a real CPU backward hold. Optimizer-state bytes and counted
communication bytes of real multi-rank runs (tests.harness.run_layout) must equal the plan exactly
(the all-to-alls, which follow the routing while the trace routes evenly, within 10%), and their
saved activations the plan's (to the byte; EP's within 10%). The 671B plan runs in under 30 s, and
DualPipe's mirror ranks get the same figures.
"""

import ast
import gc
import json
import subprocess
import sys
import time

import pytest
import torch

from moe_lc.config import PrecisionConfig, RecomputeConfig, load_config
from moe_lc.model.mtp import mtp_targets
from moe_lc.model.transformer import Transformer
from moe_lc.ops.linear import GroupedLinear, Linear, WeightGradStore
from moe_lc.parallel.comm import Group
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from moe_lc.parallel.parallelize import prepare_batch
from moe_lc.parallel.placement import ParamPlacement
from moe_lc.optim import AdamW
from moe_lc.parallel.zero.optimizer import ZeroOptimizer, ZeroOptions
from tests.harness import FAST, RECIPES, ROOT, run_layout, run_workers
from tools.planner.activation_memory import POLICIES, UNCHECKED, estimate, held_checkpoint_inputs, measure_saved_bytes
from tools.planner.block_trace import block_kind, forget_traces, trace_parts
from tools.dry_run.trace import HostLiterals, StepTracer, balanced_select
from tools.dry_run.meta_kernels import MetaKernels
from tools.planner.placement_semantics import zero_comm, zero_memory
from tools.planner.plan import plan

RECIPE = RECIPES / "debug_cpu.toml"
GB = 1e9
SMALL = ["train.steps=2", "train.seq_len=64", "train.global_batch=8", "train.warmup_steps=1"]


# -- published figures ----------------------------------------------------------------------------
def test_mixed_precision_adam_is_16_bytes_per_param():
    assert zero_memory(1, 1, stage=0) == 16
    assert zero_memory(7e9, 1, stage=0) / GB == pytest.approx(112)


def test_zero_memory_70b_on_16_gpus():
    got = [zero_memory(70e9, 16, stage) / GB for stage in range(4)]
    assert got == pytest.approx([1120, 332.5, 201.25, 70])
    assert got[2] == pytest.approx(201.3, abs=0.051)  # the published figure, rounded half up


def test_zero_communication_volume():
    psi = 1e9
    assert [zero_comm(psi, s) for s in range(4)] == [2 * psi, 2 * psi, 2 * psi, 3 * psi]
    assert zero_comm(psi, 1) != 4 * psi  # seed 004's "ZeRO-1 = 4P" is wrong (and so is its ZeRO-2 = 3P)
    assert zero_comm(psi, 3) / zero_comm(psi, 0) == 1.5  # the ZeRO paper's 1.5x
    assert zero_comm(psi, 1, n=16) == pytest.approx(2 * psi * 15 / 16)  # ring: (N-1)/N per phase


# -- the layout model, without processes --------------------------------------------------------------
def _fake_group(name, n):
    return Group(name, list(range(n)), 0)


@pytest.mark.parametrize("n, bucket_mb, moments", [(1, 32.0, "fp32"), (3, 0.05, "fp32"), (4, 0.01, "bf16"),
                                                   (7, 0.2, "bf16")])
def test_zero_layout_matches_the_optimizer_built_in_process(n, bucket_mb, moments):
    """The ZeRO-1 optimizer on fake groups of size n (no communication happens while it is built):
    bucket sizes (padding included) and state bytes equal the plan's."""
    overrides = [f"parallel.zero_bucket_mb={bucket_mb}", f"precision.adam_moments={moments}",
                 "train.global_batch=84", "train.micro_batch=1"]
    cfg = load_config(RECIPE, overrides + [f"parallel.dp={n}"], world_size=n)
    model = Transformer(cfg.model)
    groups = {"dp_cp": [], "edp": []}
    for name, p in model.named_parameters():
        groups["edp" if ".experts." in name else "dp_cp"].append((name, p, ParamPlacement()))
    rule = AdamW(moments_dtype=torch.bfloat16 if moments == "bf16" else torch.float32)
    opt = ZeroOptimizer([(g, ps, _fake_group(g, n)) for g, ps in groups.items()], _fake_group("world", n), rule,
                        ZeroOptions(bucket_mb=bucket_mb))
    rank = plan(cfg, n).ranks[0]
    assert {s.name: [b.size for b in s.buckets] for s in opt.shards} == rank.buckets
    assert opt.state_bytes() == rank.optimizer_state_bytes()
    assert rank.memory["params"] == sum(s.param_store.buffer.numel() * 4 for s in opt.shards)
    # the reduced shard has no storage outside the optimizer step (reduced in place: zero/grad_sync.py)
    assert rank.memory["grads"] == sum(s.grad_sync.buffer.numel() * 4 for s in opt.shards)
    assert all(s.grad_shard.untyped_storage().nbytes() == 0 for s in opt.shards)


MLA = ["model.attention=mla", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8",
       "model.mla.v_head_dim=16"]
DSA = MLA + ["model.mla.q_lora_rank=48", "model.dsa.enabled=true", "model.dsa.index_topk=16",
             "model.dsa.index_n_heads=4", "model.dsa.index_head_dim=16"]
TRACE_CASES = {
    "gqa-fp32": [], "gqa-bf16": ["precision.recipe=bf16"],
    "softmax-aux-B1": ["model.moe.score_func=softmax", "model.moe.aux_loss_weight=0.01", "train.micro_batch=1"],
    "masked-data": ["data.source=synthetic", "train.seq_len=128"],
    "mla": MLA, "mla-qlora-bf16": MLA + ["model.mla.q_lora_rank=48", "precision.recipe=bf16"],
    "mla-dv-ne-dqk": MLA + ["model.mla.qk_nope_head_dim=8"],
    "mtp1": ["model.mtp.depth=1"], "weighted-swiglu-bf16": ["model.moe.weighted_swiglu=true", "precision.recipe=bf16"],
    "mtp2-mla-bf16-B1": MLA + ["model.mtp.depth=2", "precision.recipe=bf16", "train.micro_batch=1"],
}


def _cpu_model(cfg, policy="none", selective=()):
    """The recipe's single-device model on the CPU, in its compute dtype, under a recompute policy."""
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(cfg.precision.compute_dtype).train()
    apply_layer_plan(model, options=LayerPlanOptions(recompute=RecomputeConfig(policy, list(selective))))
    return model


def _cpu_step_inputs(cfg):
    B, S = cfg.train.micro_batch, cfg.train.seq_len
    tokens = torch.randint(0, 259, (B, S + 1))
    mask = torch.ones(B, S) if cfg.data.has_loss_mask else None
    mtp = mtp_targets(tokens, mask, cfg.model.mtp.depth) if cfg.model.mtp.depth else None
    return dict(inputs=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask, mtp=mtp)


def _traced(cfg, policy="none", selective=()):
    c = 4 if cfg.precision.recipe == "fp32" else 2
    return estimate(cfg.model, cfg.train.micro_batch, cfg.train.seq_len, c, policy=policy, selective=tuple(selective),
                    loss_mask=cfg.data.has_loss_mask)


def _assert_traced_equals_measured(traced, measured):
    for i, predicted in traced.layers.items():
        assert measured[f"layer{i}"] == predicted, i
    for part in ("embed", "rope", "head"):  # the head: final norm, head, loss and the MTP modules
        assert measured.get(part, 0) == getattr(traced, part), part
    assert sum(measured.values()) == traced.total


@pytest.mark.parametrize("overrides", TRACE_CASES.values(), ids=TRACE_CASES.keys())
def test_traced_saved_bytes_equal_a_measured_cpu_forward(overrides):
    """The planner's figure (one block of each kind traced on the meta device) is what a real forward of
    the whole model on the CPU keeps for backward, part by part, to the byte."""
    cfg = load_config(RECIPE, ["train.seq_len=64", *overrides])
    model, batch = _cpu_model(cfg), _cpu_step_inputs(cfg)
    measured = measure_saved_bytes(model, lambda: model(batch.pop("inputs"), **batch))
    _assert_traced_equals_measured(_traced(cfg), measured)


@pytest.mark.parametrize("policy, selective, precision, model", [
    ("full", [], "fp32", []), ("full", [], "bf16", ["model.mtp.depth=1"]), ("selective", ["norm", "swiglu"], "fp32", []),
    ("selective", ["norm", "swiglu", "attention"], "bf16", []), ("selective", ["attention"], "fp32", []),
    ("selective", ["attention"], "fp32", MLA), ("selective", ["attention"], "bf16", MLA + ["model.mla.qk_nope_head_dim=8"]),
    ("selective", ["norm", "swiglu", "attention"], "bf16", MLA + ["model.mla.q_lora_rank=48"]),
    ("selective", ["mla_up"], "fp32", MLA + ["model.mla.q_lora_rank=48"]),
    ("selective", ["norm", "swiglu", "mla_up"], "bf16", MLA + ["model.mla.q_lora_rank=48"]),
    ("selective", ["attention", "mla_up"], "bf16", MLA),
    ("selective", ["norm", "swiglu"], "fp32", ["model.moe.weighted_swiglu=true"]),
    ("selective", ["norm", "swiglu"], "bf16", ["model.moe.weighted_swiglu=true"]),
    ("selective", ["norm", "swiglu", "router"], "bf16", []),
    ("selective", ["router", "mla_up"], "bf16", MLA + ["model.moe.weighted_swiglu=true"])],
    ids=["full-fp32", "full-bf16-mtp", "norm-swiglu", "all-bf16", "attention", "mla-attention", "mla-attention-dv-ne-dqk",
         "mla-all-qlora-bf16", "mla-up-qlora", "mla-up-norm-swiglu-bf16", "mla-up-attention-no-qlora-bf16",
         "weighted-swiglu", "weighted-swiglu-bf16", "router-bf16", "router-mla-up-weighted-bf16"])
def test_traced_saved_bytes_under_each_recompute_policy_equal_a_measured_forward(policy, selective, precision, model):
    """Under a recompute policy the traced figure (the traced model runs with the policy's seams) is what
    the CPU model under that policy keeps, to the byte, and below what it keeps under policy "none" (issue
    8; MLA's selective "attention" replays the queries' RoPE and the core like GQA's, issue 23)."""
    cfg = load_config(RECIPE, ["train.seq_len=64", f"precision.recipe={precision}", *model])
    cpu, batch = _cpu_model(cfg, policy, selective), _cpu_step_inputs(cfg)
    measured = measure_saved_bytes(cpu, lambda: cpu(batch.pop("inputs"), **batch))
    traced, none = _traced(cfg, policy, selective), _traced(cfg)
    _assert_traced_equals_measured(traced, measured)
    assert all(traced.layers[i] < none.layers[i] for i in traced.layers)
    assert traced.recompute_working > 0 == none.recompute_working


@pytest.mark.parametrize("items", [["linear"], ["linear", "swiglu", "attn_out"]], ids=["linear", "every-cache"])
def test_traced_fp8_cached_bytes_equal_a_measured_forward_routed_alike(items):
    """FP8 activation caching (FP8 GEMMs, emulated on the CPU) on MLA with MTP under DeepSeek-V3's selective
    items: the traced bytes are the CPU model's, to the byte, when it routes as the trace does (evenly:
    an expert's FP8 copies carry a scale per 128 of its rows, so their bytes follow the routing)."""
    cfg = load_config(RECIPE, ["train.seq_len=64", "precision.recipe=fp8", *MLA, "model.mla.q_lora_rank=48",
                               "model.mtp.depth=1"])
    selective = ("norm", "swiglu", "mla_up", "router")
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(torch.bfloat16).train()
    options = LayerPlanOptions(precision=PrecisionConfig(recipe="fp8", fp8_backend="emulate", fp8_cache=items),
                               recompute=RecomputeConfig("selective", list(selective)))
    apply_layer_plan(model, options=options, route=balanced_select)
    batch = _cpu_step_inputs(cfg)
    measured = measure_saved_bytes(model, lambda: model(batch.pop("inputs"), **batch))
    traced = estimate(cfg.model, cfg.train.micro_batch, cfg.train.seq_len, 2, policy="selective", selective=selective,
                      fp8_cache=tuple(items))
    _assert_traced_equals_measured(traced, measured)


def test_tracer_remembers_meta_kernels_only_where_they_make_fresh_tensors():
    """The trace runs an op's meta kernel once per (inputs' metadata, other arguments) when the op makes
    fresh tensors (tools/dry_run/meta_kernels.py: a 128K ring repeats its shapes cp - 1 times): a repeat
    gets new tensors of the same shape, stride and dtype; a scalar's type is part of the key; views and
    in-place ops still run."""
    x, i = torch.empty(4, 6, device="meta"), torch.empty(3, dtype=torch.int64, device="meta")  # no values
    with StepTracer(), HostLiterals():
        first = x.t() @ x
        remembered = len(MetaKernels.seen)
        again = x.t() @ x
        assert len(MetaKernels.seen) == remembered and again.untyped_storage()._cdata != first.untyped_storage()._cdata
        assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
        assert [(i + 1).dtype, (i + 1.0).dtype, (i + 1).dtype] == [torch.int64, torch.float32, torch.int64]
        assert x.view(24).untyped_storage()._cdata == x.untyped_storage()._cdata
        assert x.add_(1) is x


def test_policies_keep_less_and_replay_more_from_none_to_selective_to_full():
    """On the debug model (fp32 and bf16) every block keeps less under selective recomputation than under
    none and less again under full (only its input), and its backward re-creates more."""
    for precision in ("fp32", "bf16"):
        cfg = load_config(RECIPE, [f"precision.recipe={precision}"])
        none, selective, full = (_traced(cfg, p, ("norm", "swiglu") if p == "selective" else ()) for p in POLICIES)
        for i in none.layers:
            assert none.layers[i] > selective.layers[i] > full.layers[i] > 0, (precision, i)
        assert 0 == none.recompute_working < selective.recompute_working < full.recompute_working
        # full replays blocks only; the final norm keeps its compute-dtype input under every policy
        assert none.head == full.head == selective.head


def _reachable_tensors(obj, out: dict, seen: set, depth: int = 0) -> None:
    """Every tensor a W closure can reach (its cells, their tuples, dataclasses and closures), by storage."""
    if depth > 8 or id(obj) in seen or isinstance(obj, (torch.nn.Module, type, str, int, float)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        return
    children = (obj if isinstance(obj, (list, tuple)) else obj.values() if isinstance(obj, dict) else
                [c.cell_contents for c in obj.__closure__] if callable(obj) and getattr(obj, "__closure__", None) else
                vars(obj).values() if hasattr(obj, "__dict__") else ())
    for child in children:
        _reachable_tensors(child, out, seen, depth + 1)


def _storage_ptr(t: torch.Tensor) -> int | None:
    """A tensor's storage address; None for tensors without one (the fake tensors torch.compile leaves
    alive in the process, e.g. after tests/test_compile.py, which gc.get_objects also finds)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


@pytest.mark.parametrize("precision, policy, selective, extra", [
    ("fp32", "none", (), []), ("bf16", "selective", ("norm", "swiglu"), ["model.mtp.depth=1"]),
    ("bf16", "full", (), [])], ids=["fp32-none", "bf16-selective-mtp", "bf16-full"])
def test_split_backward_holds_for_w_what_the_trace_says(precision, policy, selective, extra):
    """A split backward (B) of the real CPU model, its Linears deferring W as a pipeline schedule has them
    do: the tensors its queued W closures hold that B made (not the forward's, nor parameters) weigh
    what the planner traced per block kind and head (output gradients; inputs B rebuilt)."""
    cfg = load_config(RECIPE, ["train.seq_len=64", f"precision.recipe={precision}", f"recompute.policy={policy}",
                               f"recompute.selective={','.join(selective) or 'norm'}", *extra])
    model, batch = _cpu_model(cfg, policy, selective), _cpu_step_inputs(cfg)
    store = WeightGradStore()
    for mod in model.modules():
        if isinstance(mod, (Linear, GroupedLinear)) and mod.defer_wgrad:
            mod.wgrad_store = store
    before = []  # what exists before B (held here, so that no address is reused during B): what the forward
    with held_checkpoint_inputs(before.append), torch.autograd.graph.saved_tensors_hooks(  # saved, and the rest
            lambda t: before.append(t) or t, lambda t: t):                                  # (e.g. routing state)
        loss = model(batch.pop("inputs"), **batch)
    before += [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]  # (type(): no deprecated getattr)
    with store.deferring():
        loss.backward()
    held: dict[int, int] = {}
    _reachable_tensors([compute for _, compute in store.take()], held, set())
    known = {ptr for ptr in map(_storage_ptr, before) if ptr is not None}
    measured = sum(n for ptr, n in held.items() if ptr not in known)
    traced = trace_parts(cfg, cfg.data.has_loss_mask, backward=True)
    blocks = sum(traced.held[block_kind(cfg.model, i)] for i in range(cfg.model.n_layers))
    assert measured == blocks + traced.held["head"] > 0


# -- real layouts: plan vs measurement ------------------------------------------------------------------
# Each layout: (id, world, overrides); the other parallel dims below.
LAYOUTS = [
    ("single", 1, ["train.micro_batch=4"]),
    ("dp2-mla-mtp", 2, ["parallel.dp=2", "train.micro_batch=2", *MLA, "model.mtp.depth=1"]),
    ("dp4", 4, ["parallel.dp=4", "train.micro_batch=1"]),
    ("dp3-padded-bf16-synthetic", 3, ["parallel.dp=3", "train.global_batch=6", "train.micro_batch=1",
                                      "parallel.zero_bucket_mb=0.05", "precision.recipe=bf16",
                                      "precision.adam_moments=bf16", "data.source=synthetic", "train.seq_len=128"]),
]


def _measure_activations(rank, world, recipe, overrides):
    """Saved-tensor bytes of the first micro-batch of the trainer's own (parallelized) model."""
    from moe_lc.config import load_config
    from moe_lc.train import Trainer

    trainer = Trainer(load_config(recipe, overrides, world_size=world))
    mb = trainer.loader.next_step()[0]
    batch = prepare_batch(mb["tokens"], mb["loss_mask"], trainer.dims, trainer.cfg.model.mtp.depth)
    model = trainer.model
    return measure_saved_bytes(model, lambda: model(batch["inputs"], positions=batch["positions"],
                                                    labels=batch["labels"], loss_mask=batch["loss_mask"],
                                                    mtp=batch.get("mtp")))


def _check_layout(name, world, overrides, act_rtol=0.0):
    """Plan vs a real run of `world` ranks: optimizer bytes and counted bytes per step exactly (the
    routing-dependent EP all-to-all, marked as an estimate by the planner, within 10%), saved-activation
    bytes of one micro-batch within act_rtol (0: to the byte; None: not measured)."""
    overrides = SMALL + overrides
    cfg = load_config(RECIPE, overrides, world_size=world)
    predicted = plan(cfg, world)
    per_stage = world // cfg.parallel.pp
    got = run_layout(RECIPE, overrides, world=world)
    for r in range(world):
        rank = predicted.ranks[r // per_stage]  # ranks are laid out pp-major
        assert got.optimizer_state_bytes[r] == rank.optimizer_state_bytes(), r
        want = rank.comm_per_step()
        estimated = {t.key for t in rank.traffic if t.status != "exact"}
        for step in got.comm_per_rank[r]:
            assert step.keys() == want.keys(), (r, step, want)
            for key, value in want.items():
                expected = pytest.approx(value, rel=0.10) if key in estimated else value
                assert step[key] == expected, (r, key, step, want)
    if act_rtol is None:
        return
    if world == 1:
        measured = [_measure_activations(0, 1, str(RECIPE), overrides + FAST)]
    else:
        measured = run_workers(_measure_activations, world, str(RECIPE), overrides + FAST)
    rank = predicted.ranks[0]
    for m in measured:
        assert sum(m.values()) == (pytest.approx(rank.activations["none"], rel=act_rtol) if act_rtol else
                                   rank.activations["none"])
    print(f"{name}: optimizer {rank.optimizer_state_bytes():,} B, comm {rank.comm_per_step()}, "
          f"activations predicted {rank.activations['none']:,.0f} measured {[sum(m.values()) for m in measured]} B")


@pytest.mark.parametrize("name, world, overrides", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_plan_matches_measurement(name, world, overrides):
    assert len(plan(load_config(RECIPE, SMALL + overrides, world_size=world), world).ranks) == 1
    _check_layout(name, world, overrides)


# Layouts of the other parallel dims. PP activations are not measured here (the pipeline runtime runs
# the forward, and the in-flight count comes from the schedule walk: tools/dryrun.py holds it to a
# traced step); EP's expert-side activations follow the routing (balanced in the trace), so they get 10%.
OTHER_DIMS = [
    ("tp2", 2, ["parallel.tp=2", "parallel.dp=1", "train.micro_batch=4"], 0.0),
    ("cp2", 2, ["parallel.cp=2", "parallel.dp=1", "train.micro_batch=4"], 0.0),
    # the ring runs again in each replay of the attention core
    ("cp2-recompute-full", 2, ["parallel.cp=2", "parallel.dp=1", "train.micro_batch=4", "recompute.policy=full"], None),
    ("cp2-recompute-attention", 2, ["parallel.cp=2", "parallel.dp=1", "train.micro_batch=4",
                                    "recompute.policy=selective", 'recompute.selective=["attention"]'], None),
    ("cp2-mla-latent-recompute-mla-up", 2, ["parallel.cp=2", "parallel.dp=1", "train.micro_batch=4", *MLA,
                                            "recompute.policy=selective", 'recompute.selective=["mla_up", "attention"]'],
     None),
    ("ep2", 2, ["parallel.ep=2", "parallel.dp=2", "train.micro_batch=2"], 0.10),
    ("ep2-weighted-swiglu", 2, ["parallel.ep=2", "parallel.dp=2", "train.micro_batch=2",
                                "model.moe.weighted_swiglu=true"], 0.10),
    ("pp2", 2, ["parallel.pp=2", "parallel.dp=1", "train.micro_batch=2"], None),
    # one kv head on two tp ranks: its rows' gradients (weight, Qwen2's bias) all-reduced over tp_kv
    ("tp2-kv1-bias", 2, ["parallel.tp=2", "parallel.dp=1", "train.micro_batch=4", "model.n_kv_heads=1",
                         "model.qkv_bias=true"], None),
    # the features of issue #35 that add parameters and a tp collective (qk_norm "full")
    ("tp2-qk-norm-shared-gate", 2, ["parallel.tp=2", "parallel.dp=1", "train.micro_batch=4", "model.qk_norm=full",
                                    "model.attn_out_bias=true", "model.moe.shared_expert_gate=true",
                                    "model.moe.shared_ffn_dim=64"], 0.0),
    # what the hand-written formulas got wrong before the traffic was traced: MLA's latents gathered over tp
    # beside the blocks' activations, and the gathers a full recomputation replays (up to the last tensor
    # it needs: torch's non-reentrant checkpoint stops there)
    ("tp2-mla-recompute-full", 2, ["parallel.tp=2", "parallel.dp=1", "train.micro_batch=4", *MLA,
                                   "recompute.policy=full"], None),
    # DeepSeek Sparse Attention (issue #46): the indexer keys and the latent blocks on the cp ring, in the sparse
    # stage (a selection pass, the sparse attention and its target, the loss's backward) and in the warm-up
    # (three passes beside MLA's own dense ring); under tp the head-summed target all-reduced. Nothing about
    # DSA is written in the planner: it runs the blocks.
    ("cp2-dsa", 2, ["parallel.cp=2", "parallel.dp=1", "train.micro_batch=4", *DSA], None),
    ("cp2-dsa-warmup", 2, ["parallel.cp=2", "parallel.dp=1", "train.micro_batch=4", *DSA, "model.dsa.stage=warmup"],
     None),
    ("tp2-dsa", 2, ["parallel.tp=2", "parallel.dp=1", "train.micro_batch=4", *DSA], None),
    # DualPipeV hands the turn at the last rank over locally: no send (the schedule's actions say so)
    ("pp2-dualpipev-mtp", 2, ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=dualpipev", "train.micro_batch=1",
                              "model.mtp.depth=1"], None),
]
SLOW_DIMS = [("cp2-tp2", 4, ["parallel.cp=2", "parallel.tp=2", "parallel.dp=1", "train.micro_batch=4"], 0.0),
             ("pp2-dualpipe-dp2", 4, ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=dualpipe",
                                      "train.micro_batch=1"], None)]


@pytest.mark.parametrize("name, world, overrides, act_rtol", OTHER_DIMS, ids=[x[0] for x in OTHER_DIMS])
def test_plan_matches_measurement_on_other_dims(name, world, overrides, act_rtol):
    _check_layout(name, world, overrides, act_rtol)


@pytest.mark.slow
@pytest.mark.parametrize("name, world, overrides, act_rtol", SLOW_DIMS, ids=[x[0] for x in SLOW_DIMS])
def test_plan_matches_measurement_on_composed_dims(name, world, overrides, act_rtol):
    _check_layout(name, world, overrides, act_rtol)


def test_traced_all_to_all_keeps_the_share_an_expert_capacity_lets_through():
    """Under EP with a capacity of half the balanced load, the traced dispatch sends half the rows: every
    expert keeps ceil(0.5 T k / E) of its T k / E copies, whichever the drop policy picks (the trace drops
    by position: its affinities hold no values; by probability it lost the kept counts)."""
    def sent(*extra):
        cfg = load_config(RECIPE, ["parallel.ep=2", "parallel.dp=2", "train.micro_batch=2", "train.seq_len=64", *extra])
        return trace_parts(cfg, backward=True).comm["moe"][("ep", "all_to_all")]

    half = ["model.moe.capacity_factor=0.5"]
    assert sent(*half) == sent(*half, "model.moe.drop_policy=position") == sent() // 2 > 0


def test_planner_traffic_reads_no_model_feature():
    """What the model sends is read off its traced blocks (tools/planner/block_trace.py), not restated: the planner's
    layout and traffic code reads no attention kind, head count, ring, routing, capacity, precision or
    recompute setting (a new attention kind, say sparse attention's indexer keys on the cp ring, is
    planned by running)."""
    tree = ast.parse((ROOT / "tools" / "planner/layout.py").read_text())
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    features = {"attention", "mla", "mla_ring", "n_heads", "n_kv_heads", "head_size", "qk_norm", "qkv_bias", "dim",
                "topk", "capacity_factor", "weighted_swiglu", "aux_loss_weight", "global_aux_loss_weight",
                "fp8_dispatch", "precision", "recompute", "selective", "micro_batch", "seq_len"}
    assert not read & features, read & features


def test_zero1_traffic_is_two_psi_not_four():
    """The counted ZeRO-1 bytes (reduce-scatter of fp32 grads + all-gather of fp32 params) are
    2 psi x 4 bytes x (N-1)/N: what zero_comm says, not the seed's 4 psi."""
    cfg = load_config(RECIPE, SMALL + ["parallel.dp=4", "train.micro_batch=1"], world_size=4)
    comm = plan(cfg, 4).ranks[0].comm_per_step()
    zero_bytes = sum(v for k, v in comm.items() if k.split("/")[1] in ("dp_cp", "edp"))
    psi = sum(sum(b) for b in plan(cfg, 4).ranks[0].buckets.values())  # padded parameter count
    assert zero_bytes == zero_comm(psi, 1, n=4) * 4


# -- command line and full scale ---------------------------------------------------------------------
def test_cli_prints_the_placement_table_and_json():
    cmd = [sys.executable, str(ROOT / "tools" / "plan.py"), str(RECIPE), "--world", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for text in ("Placement", "optimizer", "reduce_scatter", "R2", "S2", "Saved activations"):
        assert text in out.stdout
    js = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)
    data = json.loads(js.stdout)
    assert data["degrees"]["dp"] == 2 and data["ranks"][0]["comm_per_step"]["comm/dp_cp/reduce_scatter_bytes"] > 0
    bad = subprocess.run(cmd[:-2] + ["--world", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "global_batch" in bad.stderr  # 16 is not divisible by 4 x 3


def test_module_entry_point_lists_the_traced_tensors_of_each_part():
    """`python -m tools.plan --terms`: every saved tensor of each part as traced, summing to the part."""
    out = subprocess.run([sys.executable, "-m", "tools.plan", str(RECIPE), "--terms"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("Saved tensors"))
    parts = {line.strip().split(":")[0]: i for i, line in enumerate(lines[first:], first) if line.startswith("  ") and
             not line.startswith("    ")}
    assert {"embed", "rope", "dense", "moe", "head"} <= parts.keys()
    traced = trace_parts(load_config(RECIPE))
    assert f"  moe: {traced.saved['moe'] / 2**20:,.2f}" in lines and "layers.1.ffn.experts" in out.stdout


@pytest.mark.parametrize("recipe", ["deepseek_v3_671b.toml", "moe16b_128k.toml"])
def test_full_scale_recipes_plan_with_their_estimates_marked(recipe):
    cfg = load_config(RECIPES / recipe)
    p = plan(cfg, None, recipe)
    rank = p.worst()
    assert rank.total_bytes > 0 and all(v >= 0 for v in rank.memory.values())
    assert any(t.status != "exact" for t in rank.traffic)  # EP all-to-all: a balanced-routing estimate
    assert rank.activation_status["none"] == UNCHECKED  # balanced routing (EP), the schedule walk (PP)


def test_671b_plan_takes_under_30_seconds_and_mirror_ranks_agree():
    """The traces cost a few blocks, not 61 layers: the 671B plan (16 pipeline ranks, every policy, the
    split backward's W) in under 30 s on a CPU. DualPipe's mirror ranks r and pp-1-r hold the same two
    stages (in the other order): the same figures, traffic included."""
    forget_traces()
    start = time.perf_counter()
    p = plan(load_config(RECIPES / "deepseek_v3_671b.toml"), None, "671b")
    assert time.perf_counter() - start < 30
    for r in range(8):
        a, b = p.ranks[r], p.ranks[15 - r]
        assert (a.memory, a.transients, a.activations, a.comm_per_step()) == \
               (b.memory, b.transients, b.activations, b.comm_per_step()), r
        assert sorted(a.layers) == sorted(b.layers)
    assert "loss head" in p.ranks[0].transients and "loss head" not in p.ranks[7].transients


# -- --search: nothing fits, progress, Ctrl-C (issue 61) ------------------------------------------------
SEARCH = [str(RECIPES / "overlap_cpu.toml"), "--world", "2", "--cluster", "h100", "--search"]


def test_search_with_nothing_that_fits_names_what_binds_and_exits_2(capsys):
    """No layout fits: no empty table and exit 0, but one `error:` line with what binds (parameters and
    gradients alone, or the smallest planned peak and its layout) and what to change; exit status 2."""
    from tools import plan as plan_tool
    from tools.step_time.clusters import resolve
    from tools.step_time.search import search

    assert plan_tool.main(SEARCH + ["--set", "cluster.hbm_gb=0.00001"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("error: none of the 5 layouts of 2 GPUs fits 1e-05 GB per GPU: parameters and gradients "
                          "alone need ") and "give more GPUs (--world) or more memory per GPU" in err
    cluster, eff = resolve("h100")
    found = search(SEARCH[0], [], 2, cluster, eff, plan, log=lambda *a, **k: None)
    peaks = {r["name"]: r["peak_gb"] for r in found["ranked"]}
    smallest = min(peaks, key=peaks.get)
    assert plan_tool.main(SEARCH + ["--set", f"cluster.hbm_gb={peaks[smallest] * 0.999}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and [ln for ln in err.splitlines() if not ln.startswith("[")] == [
        f"error: none of the 5 layouts of 2 GPUs fits {peaks[smallest] * 0.999:g} GB per GPU: the smallest planned "
        f"peak is {peaks[smallest]:.3g} GB ({smallest}); give more GPUs (--world), more memory per GPU (another "
        "--cluster, --set cluster.hbm_gb=GB) or a smaller peak (--set recompute.policy=full, a smaller "
        "train.micro_batch or train.seq_len)"]


def test_search_prints_progress_and_ctrl_c_prints_the_ranking_so_far(monkeypatch, capsys):
    """A progress line per planned layout (tried / total, elapsed, ETA, best so far) on stderr; Ctrl-C
    during the third layout's plan ends the search with the ranking of the two planned, a line saying so,
    and exit status 130."""
    from tools import plan as plan_tool

    calls = []

    def interrupted_plan(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return plan(*args, **kwargs)

    monkeypatch.setattr(plan_tool, "plan", interrupted_plan)
    assert plan_tool.main(SEARCH) == 130
    out, err = capsys.readouterr()
    progress = err.splitlines()
    assert len(progress) == 2 and progress[0].startswith("[1/5 ") and progress[1].startswith("[2/5 "), err
    assert all(", ETA " in ln and " tokens/s/GPU, peak " in ln and "| best so far: " in ln for ln in progress)
    lines = out.splitlines()
    assert lines[0] == "Interrupted (Ctrl-C) after 2 of 5 layouts: the ranking of those tried"
    ranked = [ln[5:33].strip() for ln in lines if ln[:3].strip().isdigit()]  # the table's layout column
    assert sorted(ranked) == sorted(ln.split("] ")[1].split(":")[0] for ln in progress)


def test_search_plans_the_recipes_recompute_policy_alone_to_the_same_peak():
    """--search asks plan() for the recipe's policy only (one trace per other policy fewer): the same peak,
    memory and traffic, and only that policy's saved activations listed."""
    cfg = load_config(RECIPES / "overlap_cpu.toml", world_size=4)
    full, alone = plan(cfg, 4), plan(cfg, 4, policies=(cfg.recompute.policy,))
    assert list(alone.ranks[0].activations) == [cfg.recompute.policy]
    for a, b in zip(full.ranks, alone.ranks):
        assert (a.peak_bytes(), a.memory, a.transients, a.comm_per_step()) == \
               (b.peak_bytes(), b.memory, b.transients, b.comm_per_step())
