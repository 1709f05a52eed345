"""Multi-token prediction on DeepSeek-V4 (moe_lc/model/mtp.py, StreamMTPModule): the module is DeepSeek's MTPBlock
and its loss the formula; the tiny V4 recipe with model.mtp.depth = 1 trains on one process, equals one process
under pp2 DualPipe for 10 steps (issue #66's must-show: the MTP module on pipeline rank 0 with the embedding it
shares, mHC's (B, S, 4, D) stream crossing the stage boundary), under DualPipeV and tp2, and resumes exactly; 1F1B
with MTP stays refused; the planner counts and traces the module.

Equivalence is held under SGD with the tolerance of tests/test_v4_parallel.py, which explains both. The MTP module's
own HyperHead bias (mtp.0.stream_head.bias) is the same rounding-noise case as the model's: ~1e-4 relative between
layouts at ~3e-11 absolute, let through by the 1e-9 absolute term; every other tensor is within 1e-5 relative."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.model.block import run_phases
from moe_lc.model.mtp import StreamMTPModule, mtp_targets
from moe_lc.model.transformer import build_model
from moe_lc.train import run
from tests.harness import RECIPES, reference, run_layout
from tests.test_v4_parallel import assert_close

RECIPE = RECIPES / "debug_v4_cpu.toml"
MTP = ["model.mtp.depth=1"]
SGD = ["train.seq_len=64", "train.global_batch=4", "train.micro_batch=1", "train.warmup_steps=1",
       "train.optimizer=sgd", "train.lr=0.05"]
# three hash layers over a [2, 2] split: both stages route by token id; the MTP block (id 4) is learned-routed
PP = ["model.moe.hash_layers=3", "parallel.pp_stage_layers=[2,2]", "parallel.pp=2", "parallel.dp=1"]


def tiny_model(*overrides: str):
    cfg = load_config(RECIPE, MTP + ["model.v4_attention.index_loss_weight=0", *overrides])
    return build_model(cfg.model, seed=0)


def test_the_mtp_module_reads_the_stream_and_is_a_window_only_learned_block():
    """DeepSeek-V4's MTPBlock: e_proj / h_proj (no concatenation), its own HyperHead and norm, block id n_layers
    with sliding-window attention (V4-Flash's compress_ratios[n_layers] = 0) and a learned router."""
    model = tiny_model()
    module = model.mtp[0]
    assert isinstance(module, StreamMTPModule)
    assert module.block.attn.layer_type == "sliding_attention" and module.block.layer_id == 4
    assert not hasattr(module.block.ffn.router, "tid2eid")
    names = {n for n, _ in module.named_parameters() if not n.startswith("block.")}
    assert names == {"hnorm.weight", "enorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight",
                     "stream_head.fn.weight", "stream_head.bias", "stream_head.scale"}
    hca = tiny_model("model.v4_attention.mtp_layer_type=heavily_compressed_attention").mtp[0]
    assert hca.block.attn.layer_type == "heavily_compressed_attention"


def test_the_depth_loss_is_the_formula_on_the_main_models_stream():
    """loss_1 = CE(head(norm_1(HyperHead_1(Block_1(e_proj(enorm(emb)) + h_proj(hnorm(h)))))), t_(i+2)), h the main
    model's last stream (B, S, 4, D) before its own HyperHead; the total adds mtp.loss_weight times it."""
    model = tiny_model().eval()
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 33))
    targets = mtp_targets(tokens, None, 1)
    total = model(tokens[:, :-1], labels=tokens[:, 1:], mtp=targets)
    main = model(tokens[:, :-1], labels=tokens[:, 1:])
    h = run_phases(model.phases(torch.arange(32), tokens=tokens[:, :-1])[:-1], tokens[:, :-1])  # before the read-out
    assert h.shape == (2, 32, 4, 64)
    m = model.mtp[0]
    cos, sin = model.rope(torch.arange(32))
    emb = model.embed(targets["inputs"][:, 0])
    x = m.e_proj(m.enorm(emb)).unsqueeze(2) + m.h_proj(m.hnorm(h))
    logits = model.head(m.norm(m.stream_head(m.block(x, cos, sin))))
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 2:].flatten(), reduction="sum")
    torch.testing.assert_close(total - main, model.mtp_loss_weight * want, rtol=1e-5, atol=1e-4)


def test_tiny_v4_with_mtp_trains(tmp_path):
    result = run(load_config(RECIPE, MTP + ["train.steps=12", "train.seq_len=64", f"train.output_dir={tmp_path}",
                                            "train.log_interval=100"]))
    assert result.losses[-1] < 0.85 * result.losses[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["mtp_loss/depth1"] < 0.9 * rows[0]["mtp_loss/depth1"]
    assert rows[-1]["loss_objective"] > rows[-1]["loss"]  # the objective adds the weighted MTP loss


def test_tiny_v4_with_mtp_under_pp2_dualpipe_equals_one_process():
    """Must-show 2 of issue #66: pp2 DualPipe with MTP, 10 steps, fp32, rtol 1e-5."""
    steps = ["train.steps=10"]
    ref = reference(RECIPE, SGD + MTP + steps + ["model.moe.hash_layers=3"])
    got = run_layout(RECIPE, SGD + MTP + steps + PP + ["parallel.pp_schedule=dualpipe"], world=2)
    assert len(ref.losses) == 10
    assert_close(ref, got)
    assert "mtp.0.e_proj.weight" in got.final_state and "mtp.0.stream_head.fn.weight" in got.final_state


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.dp=1"],
                                    ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=dualpipev"]],
                         ids=["tp2", "pp2_dualpipev"])
def test_tiny_v4_with_mtp_under_a_short_layout_equals_one_process(layout):
    """3 steps. tp2: the MTP module's e_proj / h_proj replicated on the sequence shard, its block split as the main
    blocks are. DualPipeV: one block a chunk, the MTP module with the embedding on pipeline rank 0."""
    steps = ["train.steps=3"]
    assert_close(reference(RECIPE, SGD + MTP + steps), run_layout(RECIPE, SGD + MTP + steps + layout, world=2))


def test_mtp_under_1f1b_is_refused_in_one_line():
    """1F1B puts the embedding and the last stage on different ranks; MTP shares the embedding (as with V3)."""
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, MTP + PP + ["parallel.pp_schedule=1f1b"], world_size=2)
    assert [line for line in info.value.errors if "mtp" in line] == [
        "model.mtp.depth=1 with parallel.pp=2 needs pp_schedule 'dualpipe' or 'dualpipev' (the MTP modules share "
        "the embedding, which must sit on the last stage's rank)"]


def test_an_unknown_mtp_layer_type_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, MTP + ["model.v4_attention.mtp_layer_type=dense"])
    refusal = "model.v4_attention.mtp_layer_type='dense' must be one of"
    assert any(line.startswith(refusal) for line in info.value.errors), info.value.errors


@pytest.mark.parametrize("policy", ["none", "full"])
def test_the_planner_counts_and_traces_the_mtp_module(policy):
    """Parameters counted from the config alone equal the built module's (its mHC maps and HyperHead included), and
    the traced head (read-out, loss and the MTP module) keeps what a real CPU forward keeps, to the byte."""
    from moe_lc.model.counting import param_counts
    from tests.test_v4_plan import SMALL, TINY, _cpu_v4_model
    from tools.dry_run.hash_routing import trace_tokens
    from tools.planner.activation_memory import measure_saved_bytes, stage_estimate

    cfg = load_config(TINY, SMALL + [f"recompute.policy={policy}"] + MTP)
    model = _cpu_v4_model(cfg, policy)
    assert param_counts(cfg.model)["mtp"] == sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    tokens = trace_tokens(cfg.model, (cfg.train.micro_batch, cfg.train.seq_len + 1), torch.device("cpu"))
    measured = measure_saved_bytes(model, lambda: model(tokens[:, :-1], labels=tokens[:, 1:],
                                                        mtp=mtp_targets(tokens, None, 1)))
    without = measure_saved_bytes(model, lambda: model(tokens[:, :-1], labels=tokens[:, 1:]))
    assert measured["head"] > without["head"]  # the MTP module's saved tensors are booked under the head
    assert measured["head"] == stage_estimate(cfg).head


@pytest.mark.slow  # ~25 s: a traced step of the model
def test_pp2_dualpipe_with_mtp_dry_runs_within_2_percent_of_the_planner():
    import subprocess
    import sys

    from tests.harness import ROOT

    sets = MTP + ["parallel.pp=2", "parallel.dp=1", "parallel.pp_schedule=dualpipe", "train.micro_batch=2",
                  "train.global_batch=8"]
    command = [sys.executable, str(ROOT / "tools" / "dryrun.py"), str(RECIPE), "--ranks", "all-roles", "--json",
               *[f"--set={s}" for s in sets]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for report in json.loads(out.stdout)["ranks"]:
        memory, comm = report["comparison"]["memory"], report["comparison"]["comm"]
        assert all(memory[state][0] == memory[state][1] for state in ("params", "grads", "optimizer"))
        for what in ("saved activations", "peak"):
            assert memory[what][0] == pytest.approx(memory[what][1], rel=0.02), (report["rank"], what)
        assert all(traced == planned for traced, planned, _ in comm.values()), comm


def test_a_v4_run_with_mtp_stopped_at_step_5_resumes_exactly(tmp_path):
    """Muon as the recipe trains; 10 steps uninterrupted, then steps 6-10 again from the step-5 checkpoint."""
    ckpt = tmp_path / "ckpt"
    saving = MTP + ["train.seq_len=64", "train.steps=10", "checkpoint.interval=5", f"checkpoint.dir={ckpt}"]
    full = run_layout(RECIPE, saving, world=1)
    shutil.rmtree(ckpt / "step_00000010")
    resumed = run_layout(RECIPE, saving + ["checkpoint.resume=true"], world=1)
    assert resumed.losses == full.losses[5:]
    assert resumed.final_state.keys() == full.final_state.keys()
    assert any(k.startswith("mtp.0.") for k in full.final_state)
    assert all(torch.equal(resumed.final_state[k], v) for k, v in full.final_state.items())
