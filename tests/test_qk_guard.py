"""QK-clip's forward guard (moe_lc/parallel/qk_guard.py, `train.qk_clip_guard`): on the run built to grow its
logits (Muon at a high rate), where K2's rule alone lets one update's growth pass tau, no training forward's
exact max logit exceeds tau; a tau never reached changes nothing, bit for bit; runs where it scales on many
steps equal one process under dp2, cp2 (GQA's ring, MLA's latent ring, DSA's sparse stage and warm-up), pp2 DualPipe, tp2,
recomputation (selective "attention" under cp2, full under dp2) and hybrid cp4 (a2a 2); its all-reduce over cp is the planner's bytes; the config needs train.qk_clip."""

import json
import math

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.model import attention as attention_module
from moe_lc.parallel.qk_guard import GuardedCore, LogitGuard
from tests.harness import FAST, RECIPES, assert_equivalent, reference, run_layout
from tests.test_qk_clip import CLIPPING, DSA_SPARSE, GROWING, MLA_SMALL, STEPS

RECIPE = RECIPES / "debug_cpu.toml"
TAU = 8.0


def train_with_kept_max_logits(tmp_path, overrides: list[str]):
    """One process: (metrics rows, per step the exact max logit of every attention call the forward kept:
    a guarded call's second pass where it ran one, replays in backward included)."""
    from moe_lc.train import Trainer, run

    steps: list[list[float]] = []
    calls: list[float] = []
    core_forward, guard_forward, train_step = (attention_module.LocalAttention.forward, GuardedCore.forward,
                                               Trainer.train_step)

    def local(self, q, k, v, scale, docs=None):
        kk = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2).float()
        s = torch.einsum("bqhd,bkhd->bhqk", q.detach().float(), kk.detach()) * scale
        calls.append(s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf).amax().item())
        return core_forward(self, q, k, v, scale, docs)

    def guarded(self, q, *args, **kwargs):
        out = guard_forward(self, q, *args, **kwargs)
        steps[-1].append(calls[-1])  # the call whose output the forward kept
        return out

    def step(self):
        steps.append([])
        return train_step(self)

    cfg = load_config(RECIPE, FAST + overrides + [f"train.output_dir={tmp_path}/run", "checkpoint.save_final=false"])
    attention_module.LocalAttention.forward, GuardedCore.forward, Trainer.train_step = local, guarded, step
    try:
        run(cfg)
    finally:
        attention_module.LocalAttention.forward, GuardedCore.forward, Trainer.train_step = (core_forward,
                                                                                           guard_forward, train_step)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, [max(s) for s in steps]


def test_the_guard_holds_every_forwards_max_logit_at_or_under_tau(tmp_path):
    """Muon at lr 0.05 on the debug MoE, tau = 8 (where K2's rule alone measures 7.6-8.8, tests/test_qk_clip.py):
    with the guard every step's exact max logit over the calls it kept is at or under tau (fp32 rounding), the
    guard scales on several steps (`attn/qk_guard_hits`), and the weights' own statistic still passes tau
    (what K2's rescaling reads)."""
    rows, kept = train_with_kept_max_logits(tmp_path, GROWING + [f"train.qk_clip={TAU}", "train.qk_clip_guard=true"])
    assert max(kept) <= TAU * (1 + 1e-6), kept
    assert max(kept) > 0.9 * TAU, kept  # the run reaches tau: the bound is what holds it
    hits = [r["attn/qk_guard_hits"] for r in rows]
    assert sum(h > 0 for h in hits) >= 3, hits
    assert max(r["attn/max_lse"] for r in rows) > TAU


def test_a_guard_whose_tau_is_never_reached_changes_nothing(tmp_path):
    """train.qk_clip = 1e9 with the guard against QK-clip off: the same losses and final weights, bit for bit."""
    from moe_lc.train import run

    base = FAST + STEPS + ["train.steps=4", "checkpoint.save_final=false"]
    off = run(load_config(RECIPE, base + [f"train.output_dir={tmp_path}/off"]), keep_final_state=True)
    on = run(load_config(RECIPE, base + ["train.qk_clip=1e9", "train.qk_clip_guard=true",
                                         f"train.output_dir={tmp_path}/on"]), keep_final_state=True)
    assert on.losses == off.losses
    assert all(torch.equal(on.final_state[k], v) for k, v in off.final_state.items())


def test_the_guard_scales_a_samples_head_to_tau_and_leaves_the_rest():
    """A call whose bound passes tau in one (sample, head) runs again with that sample's queries of that head
    scaled by tau / bound; the other pairs keep factor 1, and a call under tau runs once."""
    guard, seen = LogitGuard(2.0, None), []
    bound = torch.tensor([[1.0, 4.0], [0.5, 1.5]])

    def call(q):
        seen.append(q)
        return q.sum(), bound if len(seen) == 1 else bound * 0.5

    q = torch.ones(2, 3, 2, 4)
    guard.run(call, q)
    assert len(seen) == 2 and guard.hits == 1
    assert torch.equal(guard.gamma, torch.tensor([[1.0, 0.5], [1.0, 1.0]]))
    assert torch.equal(seen[1][0, :, 1], torch.full((3, 4), 0.5)) and torch.equal(seen[1][1], q[1])
    seen.clear()
    bound = torch.tensor([[1.0, 2.0], [0.5, 1.5]])  # at tau: nothing to do
    guard.run(call, q)
    assert len(seen) == 1 and guard.gamma is None


def test_the_layer_plan_wraps_each_attention_core_and_says_so_on_one_line():
    from moe_lc.parallel.build import build_rank_model
    from moe_lc.parallel.mesh import ParallelDims

    cfg = load_config(RECIPE, ["train.qk_clip=5", "train.qk_clip_guard=true"])
    built = build_rank_model(cfg, ParallelDims.from_config(cfg.parallel, 1, 0, "cpu"))
    cores = [m.attn.core for m in built.module.layers.values()]
    assert all(isinstance(c, GuardedCore) and c.guard.tau == 5 for c in cores)
    assert len({id(c.guard) for c in cores}) == len(cores)  # one per module: hits per layer, gamma per call
    assert "layers.0.attn.core = GuardedCore( qk_clip_guard tau=5 (inner): LocalAttention(backend=auto) )" in \
        built.decisions
    plain = build_rank_model(load_config(RECIPE, ["train.qk_clip=5"]), ParallelDims.from_config(cfg.parallel, 1, 0, "cpu"))
    assert not any(isinstance(m.attn.core, GuardedCore) for m in plain.module.layers.values())


def test_the_guard_needs_qk_clip_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, ["train.qk_clip_guard=true"])
    assert err.value.errors == ["train.qk_clip_guard holds train.qk_clip's tau in the forward: set train.qk_clip "
                                "= tau too"]


# -- under every layout: equal to one process ------------------------------------------------------------------
GUARDED = CLIPPING + ["train.qk_clip_guard=true"]
LAYOUTS = {
    "dp2": ([], ["parallel.dp=2"], 2),
    "cp2": ([], ["parallel.cp=2"], 2),
    "mla_cp2_latent_ring": (MLA_SMALL + ["train.lr=0.005", "train.qk_clip=3.6"], ["parallel.cp=2"], 2),
    "dsa_sparse_cp2": (DSA_SPARSE + ["train.steps=5", "train.seq_len=64", "train.micro_batch=4", "train.lr=1.5e-3",
                                     "train.qk_clip=2.84"], ["parallel.cp=2"], 2),
    # the warm-up: attention frozen, so the guard scales every step; the indexer's target is what attention used
    "dsa_warmup_cp2": (DSA_SPARSE + ["train.steps=4", "train.seq_len=64", "train.micro_batch=4", "model.dsa.stage=warmup",
                                     "model.dsa.indexer_lr=1e-2", "train.qk_clip=2.84"], ["parallel.cp=2"], 2),
    "pp2_dualpipe": (["train.micro_batch=1"], ["parallel.pp=2", "parallel.pp_schedule=dualpipe"], 2),
    "tp2": ([], ["parallel.tp=2"], 2),
    # the core replayed in backward: the guard runs again there, its all-reduce with it, the same decision
    "cp2_recompute_attention": (["recompute.policy=selective", "recompute.selective=attention"], ["parallel.cp=2"], 2),
    "dp2_recompute_full": (["recompute.policy=full"], ["parallel.dp=2"], 2),
    "cp4_a2a2": ([], ["parallel.cp=4", "parallel.cp_a2a=2"], 4),
}


# the default run keeps what only the guard does: tensor parallelism's head split, the core replayed in
# backward (the guard decides again there), and the frozen-attention warm-up; the layouts that
# tests/test_qk_clip.py already holds for clipping (dp2, cp2, the latent ring, DSA's sparse stage, DualPipe)
# and the four-rank ones run with -m slow
DEFAULT = {"tp2", "cp2_recompute_attention", "dsa_warmup_cp2", "dp2_recompute_full"}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[] if k in DEFAULT else [pytest.mark.slow]) for k in LAYOUTS])
def test_guarded_runs_train_like_one_process(layout):
    model, extra, world = LAYOUTS[layout]
    ref = reference(RECIPE, GUARDED + model)
    hits = [r["attn/qk_guard_hits"] for r in ref.metrics]
    assert sum(h > 0 for h in hits) >= 2, hits
    got = run_layout(RECIPE, GUARDED + model + extra, world=world)
    assert_equivalent(ref, got, rtol=1e-5)
    for a, b in zip(ref.metrics, got.metrics):
        assert b["attn/max_lse"] == pytest.approx(a["attn/max_lse"], rel=1e-5)


def test_the_guards_all_reduce_is_the_planners_bytes():
    """cp2: every step's counted bytes equal the planner's, the guard's all-reduce over cp among them (the
    per-sample bound, B x H fp32, once per attention call and again per replay)."""
    from tools.planner.plan import plan

    base = CLIPPING + ["train.steps=2", "parallel.cp=2"]
    got = run_layout(RECIPE, base + ["train.qk_clip_guard=true"], world=2)
    want = plan(load_config(RECIPE, FAST + base + ["train.qk_clip_guard=true"], world_size=2), 2).ranks[0].comm_per_step()
    without = plan(load_config(RECIPE, FAST + base, world_size=2), 2).ranks[0].comm_per_step()
    added = want.get("comm/cp/all_reduce_bytes", 0) - without.get("comm/cp/all_reduce_bytes", 0)
    assert added > 0, (want, without)
    assert all(step == want for step in got.comm_per_rank[0]), (want, got.comm_per_rank[0])
