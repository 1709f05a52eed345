"""The planner and the dry run on DeepSeek-V4 (issue #66): block kinds by attention layer type and router, hash
layers traced with token ids, mHC's widened stream, and V4-Flash planned at its published size.

The traced saved bytes of every V4 block are what a real CPU forward keeps (`measure_saved_bytes`), block by
block, under each recompute policy; the dry run of the CPU recipe holds the planner to a traced step
(tests/test_dryrun.py's CPU recipes); V4-Flash's first and last pipeline ranks are held to theirs (slow).
"""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from moe_lc.config import RecomputeConfig, load_config
from moe_lc.model.counting import param_counts
from moe_lc.model.hash_router import HashRouter
from moe_lc.model.transformer import Transformer
from moe_lc.parallel.layer_plan import LayerPlanOptions, apply_layer_plan
from tests.harness import RECIPES, ROOT
from tools.dry_run.hash_routing import balanced_table, trace_tokens
from tools.dry_run.trace import balanced_select
from tools.planner.activation_memory import measure_saved_bytes, stage_estimate
from tools.planner.block_trace import block_kind, one_block_of_each_kind, trace_parts
from tools.planner.saved_table import REPLAY, STREAM, saved_tables

TINY = str(RECIPES / "debug_v4_cpu.toml")
FLASH = str(RECIPES / "deepseek_v4_flash.toml")
SMALL = ["train.seq_len=64", "train.micro_batch=2"]


def test_v4_blocks_are_kinds_by_attention_type_and_router_and_the_traced_model_keeps_one_of_each():
    m = load_config(FLASH).model
    kinds = [block_kind(m, i) for i in range(m.n_layers)]
    # V4-Flash: 2 window-only layers, then CSA / HCA alternating; the first 3 MoE layers hash-routed
    assert kinds[:5] == ["sliding moe hash", "sliding moe hash", "csa moe hash", "hca moe", "csa moe"]
    assert set(kinds) == {"sliding moe hash", "csa moe hash", "hca moe", "csa moe"}
    small = one_block_of_each_kind(m)
    assert [block_kind(small, i) for i in range(small.n_layers)] == \
        ["sliding moe hash", "csa moe hash", "hca moe", "csa moe"]
    # a model whose blocks differ only by dense / MoE keeps its two kinds and its one block of each
    debug = load_config(str(RECIPES / "debug_cpu.toml")).model
    assert {block_kind(debug, i) for i in range(debug.n_layers)} == {"dense", "moe"}
    assert one_block_of_each_kind(debug).n_layers == 2


@pytest.mark.parametrize("vocab, experts, topk, tokens", [(129280, 256, 6, 4096), (512, 8, 2, 8 * 129)])
def test_trace_token_ids_through_the_balanced_table_load_every_expert_alike(vocab, experts, topk, tokens):
    """V4-Flash's 4K tokens x 6 over 256 experts, and the tiny recipe's micro-batch: exactly balanced."""
    m = replace(load_config(TINY).model, vocab_size=vocab)
    ids = trace_tokens(m, (1, tokens), torch.device("cpu"))
    table = balanced_table(vocab, experts, topk)
    assert table.shape == (vocab, topk) and all(len(set(row.tolist())) == topk for row in table[:1000])
    load = torch.bincount(table[ids.flatten()].flatten(), minlength=experts)
    assert load.min() == load.max() == tokens * topk // experts
    # a model without hash layers is traced on zeros, as before
    assert not trace_tokens(load_config(str(RECIPES / "debug_cpu.toml")).model, (2, 9), torch.device("cpu")).any()


def _cpu_v4_model(cfg, policy: str):
    """The tiny V4 model on the CPU under `policy`, routing as the trace does: balanced learned routers and the
    balanced hash tables."""
    torch.manual_seed(0)
    model = Transformer(cfg.model).train()
    for router in (mod for mod in model.modules() if isinstance(mod, HashRouter)):
        router.tid2eid.copy_(balanced_table(cfg.model.vocab_size, router.n_experts, router.topk))
    apply_layer_plan(model, options=LayerPlanOptions(recompute=RecomputeConfig(policy, ["norm", "swiglu"])),
                     route=balanced_select)
    return model


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_traced_v4_saved_bytes_equal_a_measured_cpu_forward_block_by_block(policy):
    """Every block of the tiny recipe (window + hash, CSA, HCA, CSA again: one traced block stands for two) keeps
    what the traced block of its kind keeps, to the byte: mHC's maps and Sinkhorn's intermediates, the indexer,
    the compressors; under full recomputation the RMSNorms' inputs that only a checkpoint inside the block's
    checkpoint held are not kept (they die in the forward)."""
    cfg = load_config(TINY, SMALL + [f"recompute.policy={policy}"])
    model = _cpu_v4_model(cfg, policy)
    B, S = cfg.train.micro_batch, cfg.train.seq_len
    tokens = trace_tokens(cfg.model, (B, S + 1), torch.device("cpu"))
    measured = measure_saved_bytes(model, lambda: model(tokens[:, :-1], labels=tokens[:, 1:]))
    traced = stage_estimate(cfg)
    assert {f"layer{i}": int(n) for i, n in traced.layers.items()} == \
        {k: v for k, v in measured.items() if k.startswith("layer")}
    for part in ("embed", "rope", "head"):  # the head: mHC's read-out, final norm, head and loss
        assert measured.get(part, 0) == getattr(traced, part), part
    assert traced.layers[1] == traced.layers[3]  # the two CSA blocks: one kind


def test_the_stream_between_v4_blocks_is_mhcs_widened_one():
    """What a pipeline stage sends per micro-batch: (B, S, hc_mult, D) in the compute dtype."""
    cfg = load_config(TINY, SMALL)
    m, t = cfg.model, cfg.train
    assert trace_parts(cfg).hidden == t.micro_batch * t.seq_len * m.mhc.hc_mult * m.dim * 4


def test_saved_table_puts_mhc_in_a_term_of_its_own_alike_in_every_kind():
    """--saved: mHC's maps are their own term (they run outside any module's forward: the counter names them by
    their HyperConnection), the same bytes in every block kind; the terms add up to the block."""
    cfg = load_config(TINY, SMALL)
    tables = {t.kind: t for t in saved_tables(cfg)}
    assert set(tables) == {"sliding moe hash", "csa moe", "hca moe"}
    stream = {kind: t.by_term[STREAM] for kind, t in tables.items()}
    assert len(set(stream.values())) == 1, stream
    m, tokens = cfg.model, cfg.train.micro_batch * cfg.train.seq_len
    n, d = m.mhc.hc_mult, m.dim
    # at least the stream itself (4 N D, fp32) and its normalized copy (4 N D) per sublayer, the 20 Sinkhorn rounds'
    # N x N fp32 intermediates (DeepSeek-V4's accounting, moe_lc/model/residual_stream.py)
    assert stream["csa moe"] >= tokens * 2 * (4 * n * d + 4 * n * d + (2 * m.mhc.sinkhorn_iters + 3) * n * n * 4)
    traced = trace_parts(cfg)
    assert all(t.total == traced.saved[kind] for kind, t in tables.items())
    assert tables["csa moe"].by_term["attention"] > tables["sliding moe hash"].by_term["attention"]  # its indexer


def test_under_full_recompute_a_v4_block_keeps_its_replay_inputs_alone():
    """--saved under full recomputation: nothing but what the block runs again from (its input stream:
    tests/test_v4_recompute.py), listed as its own term."""
    cfg = load_config(TINY, SMALL + ["recompute.policy=full"])
    for table in saved_tables(cfg):
        assert set(table.by_term) == {REPLAY}, (table.kind, table.by_term)


def test_step_time_model_predicts_v4_with_its_attention_flops(capsys):
    """--cluster on V4: its blocks' kernels traced by kind (hash layers with token ids), its attention FLOPs
    from moe_lc/model/v4_counting.py; in full (no causal mask) a query reads its whole window and every entry."""
    from moe_lc.model.counting import train_flops_per_token
    from tools.plan import main

    assert main([TINY, "--cluster", "h100", "--json", *[f"--set={s}" for s in SMALL]]) == 0
    pred = json.loads(capsys.readouterr().out)["predicted"]
    assert pred["step_s"] > 0 and pred["tokens_per_s_per_gpu"] > 0
    m = load_config(TINY).model
    assert pred["model_flops_per_token_causal"] == pytest.approx(train_flops_per_token(m, 64))
    assert pred["model_flops_per_token_full"] > pred["model_flops_per_token_causal"]


def test_v4_flash_has_its_published_parameter_counts():
    """V4-Flash is 284B total / 13B activated (arXiv 2606.19348): the counts of the recipe's shape, exactly
    284,332,230,231 and 13,270,091,351 (DeepSeek's convention: the output head counts, the embedding lookup
    does not; the published 13B is rounded)."""
    c = param_counts(load_config(FLASH).model)
    assert c["total"] == pytest.approx(284e9, rel=0.005)
    assert c["activated"] == pytest.approx(13e9, rel=0.025)
    assert c["routed_experts"] == 43 * 256 * 3 * 4096 * 2048


@pytest.mark.slow  # ~1 min: four 4K-token blocks traced, eight pipeline ranks planned
def test_v4_flash_fits_80_gb_on_every_pipeline_rank():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), FLASH, "--json"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = json.loads(out.stdout)["ranks"]
    assert len(ranks) == 8
    assert all(r["peak_bytes"] < 80e9 for r in ranks), [r["peak_bytes"] / 2**30 for r in ranks]


@pytest.mark.slow  # ~3 min: the first and last pipeline ranks' steps traced at 4K
def test_v4_flash_dry_run_of_first_and_last_rank_within_3_percent_of_the_planner():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "dryrun.py"), FLASH, "--json"], capture_output=True,
                         text=True, timeout=1200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout)["ranks"]
    assert [r["coords"]["pp"] for r in reports][0] == 0 and reports[-1]["coords"]["pp"] == 7
    for report in reports:
        memory = report["comparison"]["memory"]
        for state in ("params", "grads", "optimizer"):
            assert memory[state][0] == memory[state][1], (report["rank"], state)
        for what in ("saved activations", "peak"):
            traced, planned = memory[what]
            assert traced == pytest.approx(planned, rel=0.03), (report["rank"], what, traced, planned)
        assert all(traced == planned for traced, planned, _ in report["comparison"]["comm"].values())
        assert not report["problems"] and report["update_applied"]


@pytest.mark.slow  # ~25 s: two ranks' steps traced
def test_tiny_v4_on_pp2_dp2_ep2_dry_runs_within_2_percent_of_the_planner_sending_the_widened_stream():
    """Every pipeline role of the tiny recipe on 8 ranks: states exact, saved bytes and the peak within 2%, every
    counted byte as planned; each stage send is one (B, S, hc_mult, D) fp32 stream (2 micro-batches a rank)."""
    sets = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "train.micro_batch=2"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "dryrun.py"), TINY, "--ranks", "all-roles", "--json",
                          *[f"--set={s}" for s in sets]], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout)["ranks"]
    assert [r["coords"]["pp"] for r in reports] == [0, 1]
    m = load_config(TINY).model
    for report in reports:
        memory, comm = report["comparison"]["memory"], report["comparison"]["comm"]
        assert all(memory[state][0] == memory[state][1] for state in ("params", "grads", "optimizer"))
        for what in ("saved activations", "peak"):
            assert memory[what][0] == pytest.approx(memory[what][1], rel=0.02), (report["rank"], what)
        assert all(traced == planned for traced, planned, _ in comm.values()), comm
        assert comm["comm/pp/send_bytes"][0] == 2 * 2 * 128 * m.mhc.hc_mult * m.dim * 4
