"""Update rules apart from ZeRO-1's buffers (moe_lc/optim): AdamW's and SGD's math against torch.optim,
the rule's state declaration as the one source of checkpoint keys and planner bytes, whole-parameter
buckets (each parameter whole on one owner, the same training as cut buckets), SGD under dp2 with an exact
resume, and the refusal of another rule's checkpoint."""


import pytest
import torch
from torch import nn

from moe_lc.job import checkpoint as ckpt
from moe_lc.config import ConfigError, load_config, to_toml
from moe_lc.config.choices import Optimizer, names
from moe_lc.model.counting import param_counts
from moe_lc.model.transformer import Transformer
from moe_lc.optim import RULES, SGD, AdamW
from moe_lc.parallel.comm import Group
from moe_lc.parallel.placement import ParamPlacement
from moe_lc.parallel.zero.optimizer import (GRAD_NORM_BYTES_PER_ELEMENT, GRAD_NORM_CHUNK, ShardedParams, ZeroOptimizer,
                                            ZeroOptions)
from moe_lc.parallel.zero.layout import bucket_elems, bucket_sizes
from moe_lc.train import Trainer
from tests.harness import (FAST, RECIPES, assert_equivalent, interrupted_and_resumed, reference,
                           run_workers)
from tools.planner.plan import plan

RECIPE = RECIPES / "debug_cpu.toml"
SMALL = FAST + ["train.steps=3", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
                "train.warmup_steps=1"]
SGD_KEYS = ["train.optimizer=sgd", "train.lr=0.1"]


def test_rules_are_the_recipe_choices_and_documented():
    assert set(RULES) == set(names(Optimizer))
    text = to_toml(load_config(RECIPE), docs=True)
    assert "adamw | sgd" in text and "sgd_momentum" in text
    with pytest.raises(ConfigError, match=r"train.optimizer='lion' must be one of 'adamw', 'sgd'"):
        load_config(RECIPE, ["train.optimizer=lion"])
    with pytest.raises(ConfigError, match=r"train.sgd_momentum=1.0 must lie in \[0, 1\)"):
        load_config(RECIPE, ["train.optimizer=sgd", "train.sgd_momentum=1.0"])
    warned: list[str] = []
    load_config(RECIPE, ["train.optimizer=sgd", "precision.adam_moments=bf16"], warnings=warned)
    load_config(RECIPE, ["train.sgd_momentum=0.5"], warnings=warned)
    assert warned == ["precision.adam_moments='bf16' sets AdamW's moments; train.optimizer='sgd' keeps its state "
                      "in fp32", "train.sgd_momentum=0.5 is set, but train.optimizer='adamw' does not read it"]


def test_rules_sit_below_zero_and_import_no_layout():
    """A rule is math on tensors: moe_lc.optim imports nothing of the package but itself (ZeRO, in
    moe_lc.parallel, imports the rules, never the other way)."""
    from tests.test_package_layout import import_graph

    graph = import_graph()
    rules = {m: deps for m, deps in graph.items() if m.startswith("moe_lc.optim")}
    assert set(rules) == {"moe_lc.optim", "moe_lc.optim.rule", "moe_lc.optim.adamw", "moe_lc.optim.sgd",
                          "moe_lc.optim.muon"}
    assert all(d.startswith("moe_lc.optim") for deps in rules.values() for d in deps), rules
    assert "moe_lc.optim.rule" in graph["moe_lc.parallel.zero.optimizer"]


# -- the math, on one process -----------------------------------------------------------------------
def _one_rank(name: str) -> Group:
    return Group(name, [0], 0)


@pytest.mark.parametrize("rule_name", ["adamw", "adamw-fused", "sgd", "sgd-whole"])
def test_rules_match_torch_optim_bit_for_bit(rule_name):
    """ZeRO-1 on one rank with small buckets (parameters land in several) against torch.optim on the same
    gradients: AdamW with decoupled decay and a no-decay parameter (op by op, and through the fused kernel
    that CUDA runs by default, here on its CPU twin), SGD with momentum (torch's weight decay is coupled
    L2, so SGD runs without)."""
    torch.manual_seed(0)
    shapes = [(70, 50), (130,), (30, 40, 2), (9, 11)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    lr = 1e-2
    if rule_name.startswith("adamw"):
        fused = rule_name == "adamw-fused"
        rule = AdamW(beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, fused=fused)
        ref = torch.optim.AdamW([{"params": copies[:1] + copies[2:]}, {"params": copies[1:2], "weight_decay": 0.0}],
                                lr=lr, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, foreach=False,
                                fused=fused or None)
    else:
        rule = SGD(momentum=0.9, whole_params=rule_name == "sgd-whole")
        ref = torch.optim.SGD(copies, lr=lr, momentum=0.9, foreach=False)
    named = [(f"p{i}", p, ParamPlacement()) for i, p in enumerate(params)]
    opt = ZeroOptimizer([("dp_cp", named, _one_rank("dp_cp"))], _one_rank("world"), rule, ZeroOptions(bucket_mb=0.02),
                        no_decay={"p1"})
    assert len(opt.shards[0].buckets) > 1
    for _ in range(4):
        grads = [torch.randn(s) for s in shapes]
        opt.begin_step(1)
        sum((p * g).sum() for p, g in zip(params, grads)).backward()  # each p.grad = g, through ZeRO's hooks
        opt.step(lr)
        for c, g in zip(copies, grads):
            c.grad = g.clone()
        ref.step()
    for p, c in zip(params, copies):
        assert torch.equal(p.detach(), c.detach())


# -- the declaration: checkpoint keys, planner bytes ---------------------------------------------------
@pytest.mark.parametrize("keys, states", [([], {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}),
                                          (["precision.adam_moments=bf16"],
                                           {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}),
                                          (SGD_KEYS, {"momentum_buffer": torch.float32}),
                                          (SGD_KEYS + ["train.sgd_momentum=0"], {}),
                                          (["train.optimizer=muon"],
                                           {"momentum": torch.float32, "exp_avg_sq": torch.float32})])
def test_state_declaration_gives_buffers_checkpoint_keys_and_planner_bytes(tmp_path, keys, states):
    cfg = load_config(RECIPE, SMALL + keys + [f"train.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    opt = trainer.optimizer
    assert {s.name: s.dtype for s in opt.rule.states()} == states
    assert all({k: t.dtype for k, t in s.state.items()} == states for s in opt.shards)
    saved = trainer.checkpointer.state(trainer.parallel, opt, {})["optim"]
    assert saved["rule"] == cfg.train.optimizer
    assert all(set(entry) == {"master", *states} for entry in saved["params"].values())
    rank = plan(cfg, 1).ranks[0]
    assert rank.optimizer_state_bytes() == opt.state_bytes()
    psi = param_counts(cfg.model)["total"]
    assert opt.state_bytes() == psi * (4 + sum(dtype.itemsize for dtype in states.values()))
    largest_shard = max(s.master.numel() for s in opt.shards)  # the update runs one shard at a time
    reduced = 4 * sum(s.master.numel() for s in opt.shards)  # ZeRO-1's reduced shards, all made at the step
    grad_norm = GRAD_NORM_BYTES_PER_ELEMENT * min(GRAD_NORM_CHUNK, largest_shard)  # one chunk's squares, weights
    rule = opt.rule.update_bytes_per_element * largest_shard
    assert rank.transients["optimizer step"] == max(grad_norm, rule) + reduced


def test_a_checkpoint_without_a_rule_name_resumes_as_adamw(tmp_path):
    """Checkpoints written before the rules had names hold AdamW's master / exp_avg / exp_avg_sq and no
    optim.rule: they resume as AdamW, every optimizer tensor restored."""
    first = Trainer(load_config(RECIPE, SMALL + [f"train.output_dir={tmp_path}/a"]))
    for _ in range(2):
        first.train_step()
    state = first.checkpointer.state(first.parallel, first.optimizer, first._train_state())
    assert {k for entry in state["optim"]["params"].values() for k in entry} == {"master", "exp_avg", "exp_avg_sq"}
    del state["optim"]["rule"]
    path = ckpt.save_checkpoint(tmp_path / "ckpt", 2, state, is_writer=True)
    assert "optim.rule" not in ckpt.checkpoint_keys(path)
    second = Trainer(load_config(RECIPE, SMALL + [f"train.output_dir={tmp_path}/b"]))
    assert second.checkpointer.resume(second.parallel, second.optimizer, second._train_state(), path)[0] == path
    for a, b in zip(first.optimizer.shards, second.optimizer.shards):
        assert torch.equal(a.master, b.master)
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert second.optimizer.step_count == 2


# -- whole-parameter buckets -------------------------------------------------------------------------
class _MatricesWhole(SGD):
    """Whole 2-D parameters only (the shape of what a Newton-Schulz rule asks for)."""

    def whole(self, name, shape):
        return len(shape) == 2


def _debug_params():
    return [(n, p, ParamPlacement()) for n, p in Transformer(load_config(RECIPE).model).named_parameters()]


@pytest.mark.parametrize("rule", [SGD(whole_params=True), _MatricesWhole()], ids=["all-whole", "matrices-whole"])
def test_whole_parameters_sit_whole_on_one_balanced_owner(rule):
    """dp 3, small buckets: every wanted parameter lies whole in exactly one rank's shard, whole and cut
    parameters never share a bucket, the planner's bucket sizes are the allocated ones, and the owners'
    element counts differ by at most the largest whole parameter."""
    n, mb = 3, 0.1
    named = _debug_params()
    wanted = {name for name, p, _ in named if rule.whole(name, p.shape)}
    owners: dict[str, list[int]] = {}
    elements = []
    for r in range(n):
        params = _debug_params()  # ShardedParams rewires the parameters into its buffers: a fresh copy per rank
        shard = ShardedParams("dp_cp", params, Group("dp_cp", list(range(n)), r), rule, ZeroOptions(bucket_mb=mb))
        for b in shard.buckets:
            kinds = {shard.names[id(p)] in wanted for p, _ in b.params}
            assert len(kinds) == 1
        for o in shard.view.params:
            if o.name in wanted:
                assert o.whole and tuple(o.shape) == tuple(dict((k, p) for k, p, _ in named)[o.name].shape)
                owners.setdefault(o.name, []).append(r)
        elements.append(sum(o.hi - o.lo for o in shard.view.params if o.name in wanted))
    assert {k: len(v) for k, v in owners.items()} == dict.fromkeys(wanted, 1)
    numels = [p.numel() for _, p, _ in named]
    assert [b.size for b in shard.buckets] == bucket_sizes(numels, bucket_elems(mb), n,
                                                           [name in wanted for name, _, _ in named])
    largest = max(p.numel() for name, p, _ in named if name in wanted)
    assert max(elements) - min(elements) <= largest, elements


def _layouts_worker(rank, world):
    """Train the debug model 3 steps on dp 2 with SGD twice, on cut buckets and on whole-parameter
    buckets (same initial weights, same data); return both final parameter sets and the per-rank
    sizes of the whole-bucket shards."""
    from moe_lc.config import ParallelConfig, model_config
    from moe_lc.model.transformer import build_model
    from moe_lc.parallel.mesh import ParallelDims
    from moe_lc.parallel.parallelize import no_weight_decay_names, parallelize, zero_param_groups

    d = ParallelDims.from_config(ParallelConfig(), world, rank)
    d.init_groups()
    out = {}
    for whole in (False, True):
        parallel = parallelize(build_model(model_config(attn_backend="reference"), seed=0), d)
        model = parallel.module
        opt = ZeroOptimizer(zero_param_groups(parallel, d), d["world"], SGD(0.9, 0.1, whole_params=whole),
                            ZeroOptions(bucket_mb=0.05), no_decay=no_weight_decay_names(model))
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            tokens = torch.randint(0, 259, (2, 33), generator=gen)
            opt.begin_step(1)
            model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
            opt.step(lr=0.1)
        out[whole] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_whole_parameter_buckets_train_like_cut_buckets_under_dp2():
    """SGD is elementwise: under dp 2 (with weight decay and its no-decay ranges) the whole-parameter
    layout gives bit-identical parameters to the element-offset one (no grad clipping: the norm's
    fp64 sum runs over the shards in another order)."""
    for result in run_workers(_layouts_worker, 2):
        for name, cut in result[False].items():
            assert torch.equal(cut, result[True][name]), name


# -- SGD under dp2: equal to one process, exact resume, refused as AdamW ------------------------------
def test_sgd_trains_under_dp2_resumes_exactly_and_refuses_to_resume_as_adamw(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    base = SGD_KEYS + ["train.steps=6", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=2",
                       "train.warmup_steps=2"]
    ref = reference(RECIPE, base)
    full, resumed = interrupted_and_resumed(RECIPE, base + ["parallel.dp=2"], [], world=2, ckpt=ckpt_dir)
    assert_equivalent(ref, full, rtol=1e-5)
    assert full.losses[-1] < full.losses[0] - 1.0
    assert full.optimizer_state_bytes == [(4 + 4) * param_counts(load_config(RECIPE).model)["total"] // 2] * 2
    assert resumed.losses == full.losses[3:]
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())

    as_adamw = Trainer(load_config(RECIPE, FAST + [f"train.output_dir={tmp_path}/adamw", f"checkpoint.dir={ckpt_dir}"]))
    with pytest.raises(ckpt.CheckpointError) as err:
        as_adamw.try_resume()
    assert str(err.value) == (f"{ckpt_dir / 'step_00000006'} holds the optimizer state of train.optimizer='sgd', not "
                              "'adamw': resume with train.optimizer='sgd', or start from its weights "
                              "(checkpoint.init_from)")

