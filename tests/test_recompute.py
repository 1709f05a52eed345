"""Recomputation: same fp32 losses as keeping everything, less saved activation memory, loads once."""

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.config import RecomputeConfig
from moe_lc.model.forward_stats import ForwardStats
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from moe_lc.model.transformer import build_model
from moe_lc.train import run
from tests.harness import RECIPES, assert_equivalent, reference, run_layout

RECIPE = RECIPES / "debug_cpu.toml"
SMALL = ["train.steps=3", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.warmup_steps=2",
         "train.log_interval=100"]


@pytest.mark.parametrize("policy, items", [("selective", "norm,swiglu,attention"), ("full", "norm")])
def test_recompute_gives_exactly_the_same_losses(tmp_path, policy, items):
    base = run(load_config(RECIPE, SMALL + [f"train.output_dir={tmp_path}/a"]), keep_final_state=True)
    again = run(load_config(RECIPE, SMALL + [f"train.output_dir={tmp_path}/b", f"recompute.policy={policy}",
                                             f"recompute.selective={items}"]), keep_final_state=True)
    assert again.losses == base.losses  # bit for bit
    assert again.grad_norms == base.grad_norms
    assert all(torch.equal(again.final_state[k], v) for k, v in base.final_state.items())


def test_router_recompute_is_exact_in_bf16(tmp_path):
    """selective "router" rebuilds the router's fp32 input from bf16 (an exact upcast): bit-identical."""
    bf16 = SMALL + ["precision.recipe=bf16", "recompute.policy=selective"]
    base = run(load_config(RECIPE, bf16 + [f"train.output_dir={tmp_path}/a", "recompute.selective=norm,swiglu"]),
               keep_final_state=True)
    again = run(load_config(RECIPE, bf16 + [f"train.output_dir={tmp_path}/b", "recompute.selective=norm,swiglu,router"]),
                keep_final_state=True)
    assert again.losses == base.losses and again.grad_norms == base.grad_norms
    assert all(torch.equal(again.final_state[k], v) for k, v in base.final_state.items())


def saved_bytes(model, tokens, stats=None):
    """Bytes of distinct storages autograd keeps for backward during one forward (booking into `stats`)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:], stats=stats)
    return sum(seen.values()), loss


def test_recompute_policies_save_less_and_count_loads_once():
    cfg = load_config(RECIPE).model
    tokens = torch.randint(0, 259, (2, 65), generator=torch.Generator().manual_seed(0))
    results = {}
    for policy, items in [("none", ()), ("selective", ("norm",)), ("selective", ("norm", "swiglu")),
                          ("selective", ("norm", "swiglu", "attention")), ("full", ())]:
        model = build_model(cfg, seed=0)
        apply_layer_plan(model, options=LayerPlanOptions(recompute=RecomputeConfig(policy, list(items))))
        stats = ForwardStats()
        nbytes, loss = saved_bytes(model, tokens, stats)
        loss.backward()  # replays the routers under "full"
        loads = torch.stack([stats.routing[m.router]["loads"] for m in model.moe_layers().values()])
        results[(policy, items)] = (nbytes, loss.item(), loads)
    none_bytes, none_loss, none_loads = results[("none", ())]
    ladder = [results[k][0] for k in results]
    assert ladder == sorted(ladder, reverse=True) and ladder[-1] < 0.25 * none_bytes, ladder
    assert none_loads.sum() == 2 * 64 * cfg.moe.topk * len(none_loads)  # each routed copy once
    for nbytes, loss, loads in results.values():
        assert loss == none_loss
        assert torch.equal(loads, none_loads)  # a replayed router does not count its tokens again


def test_full_recompute_composes_with_dualpipe_split_backward():
    base = ["train.steps=3", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2", "train.micro_batch=1"]
    ref = reference(RECIPE, base)
    for extra in (["recompute.policy=full"], ["recompute.policy=selective", "recompute.selective=norm,swiglu,attention"]):
        got = run_layout(RECIPE, base + extra + ["parallel.pp=2", "parallel.pp_schedule=dualpipe"], world=2)
        assert_equivalent(ref, got, rtol=1e-5)


@pytest.mark.parametrize("policy, items", [("full", ()), ("selective", ("norm", "swiglu", "attention"))])
def test_deferred_weight_grads_survive_recomputation(policy, items):
    """Split backward (B now, W later) under checkpointing: the deferred W must reach the Parameter,
    not the alias that saved-tensor hooks hand back (a bug this test caught once)."""
    from moe_lc.ops.linear import GroupedLinear, Linear, WeightGradStore
    from moe_lc.parallel.pipeline.overlap import PhasedRun

    cfg = load_config(RECIPE).model
    tokens = torch.randint(0, 259, (2, 33), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32)

    def grads(policy, items, split):
        model = build_model(cfg, seed=0)
        apply_layer_plan(model, options=LayerPlanOptions(recompute=RecomputeConfig(policy, list(items))))
        store = WeightGradStore()
        for module in model.modules():
            if isinstance(module, (Linear, GroupedLinear)):
                module.wgrad_store = store
        run = PhasedRun(model.phases(positions, tokens[:, 1:]), tokens[:, :-1])
        run.forward_all()
        run.backward_all(None, 1.0, store if split else None)
        if split:
            assert len(store) > 0
            store.flush()
        return {n: p.grad for n, p in model.named_parameters()}

    want, got = grads("none", (), False), grads(policy, items, True)
    for name, g in want.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-6)


MLA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16"]


def test_mla_up_projection_recompute_composes_with_dualpipe_ep_and_dp():
    """selective "mla_up" (keep MLA's latents, rebuild the up-projections in backward) under pp2 DualPipe x
    dp2 with ep2 folded in, against one process without recomputation: fp32 within 1e-5."""
    base = ["train.steps=3", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2", "train.micro_batch=1",
            *MLA]
    ref = reference(RECIPE, base)
    got = run_layout(RECIPE, base + ["recompute.policy=selective", "recompute.selective=norm,swiglu,mla_up",
                                     "parallel.pp=2", "parallel.pp_schedule=dualpipe", "parallel.ep=2", "parallel.dp=2"],
                     world=4)
    assert_equivalent(ref, got, rtol=1e-5)


def test_mla_up_needs_mla():
    from moe_lc.config import ConfigError

    with pytest.raises(ConfigError, match="recompute.selective item 'mla_up' recomputes MLA's up-projections"):
        load_config(RECIPE, ["recompute.policy=selective", "recompute.selective=mla_up"])

