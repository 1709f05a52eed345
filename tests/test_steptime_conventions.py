"""What the step-time prediction (tools/plan.py --cluster) says about its conventions: model FLOPs with the
attention core counted causally and in full, checked against Megatron-LM's published FLOP formula, and a
warning for a group that would fit one NVLink domain but straddles two."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from moe_lc.config import load_config
from moe_lc.model.counting import attention_core_flops
from moe_lc.parallel.mesh import ParallelDims
from tools import plan as plan_tool
from tools.step_time.clusters import CLUSTERS
from tools.step_time.flop_conventions import MFU_CONVENTION, full_attention_core_flops, train_flops_per_token_both
from tools.step_time.nvlink_domains import domain_warnings

LLAMA_LIKE = ["recipes/published/llama3_8b_8k_h100.toml", "recipes/published/llama3_70b_8k_h100.toml"]


def _megatron_args(recipe: str) -> SimpleNamespace:
    """Megatron-LM's arguments for the recipe's dense GQA model (SwiGLU, untied head; Llama 3's vocabulary
    128,256 is a multiple of 128, so Megatron's padded vocabulary is the same)."""
    cfg = load_config(recipe, [])
    m = cfg.model
    return SimpleNamespace(seq_length=cfg.train.seq_len, num_layers=m.n_layers, hidden_size=m.dim,
                           num_attention_heads=m.n_heads, num_query_groups=m.n_kv_heads, kv_channels=m.qk_head_dim,
                           ffn_hidden_size=m.ffn_dim, padded_vocab_size=m.vocab_size, model=m)


def _megatron_full(a) -> float:
    """megatron/training/training.py `num_floating_point_operations` before 2025-03-06 (commit fdfcef8, the
    parent of 8873b55), dense SwiGLU, batch 1: attention counted in full (the S / h term)."""
    ratio = a.kv_channels * a.num_attention_heads / a.hidden_size
    return 12 * a.seq_length * a.num_layers * a.hidden_size ** 2 * (
        (1 + a.num_query_groups / a.num_attention_heads + a.seq_length / a.hidden_size) * ratio
        + a.ffn_hidden_size / a.hidden_size * 3 / 2
        + a.padded_vocab_size / (2 * a.num_layers * a.hidden_size))


def _megatron_causal(a) -> float:
    """The same function as of 2026 (`standard_self_attn_term` of MHA / GQA, dense SwiGLU, no MTP), batch 1:
    the core attention `/ 2  # causal mask`."""
    q, kv = a.kv_channels * a.num_attention_heads, a.kv_channels * a.num_query_groups
    attn = 3 * 2 * (a.hidden_size * (q + 2 * kv) + q * a.seq_length / 2 * 2 + q * a.hidden_size)
    return a.seq_length * (3 * 2 * a.hidden_size * a.ffn_hidden_size * 3 * a.num_layers + attn * a.num_layers
                           + 3 * 2 * a.hidden_size * a.padded_vocab_size)


@pytest.mark.parametrize("recipe", LLAMA_LIKE)
def test_full_attention_flops_are_megatrons_formula_and_causal_is_less_by_half_the_core(recipe):
    a = _megatron_args(recipe)
    both = train_flops_per_token_both(a.model, a.seq_length)
    assert both["full"] * a.seq_length == pytest.approx(_megatron_full(a), rel=1e-12)
    assert both["causal"] * a.seq_length == pytest.approx(_megatron_causal(a), rel=1e-12)
    # forward + backward of QK^T and PV over all S keys, per token: 3 x 2 x 2 S n d per layer; causal is half
    core_full = 3 * 2 * 2 * a.seq_length * a.num_attention_heads * a.kv_channels * a.num_layers
    assert both["full"] - both["causal"] == pytest.approx(core_full / 2, rel=1e-12)


def test_sparse_attention_counts_its_topk_either_way_and_its_indexer_over_all_keys():
    cfg = load_config("recipes/deepseek_v32_671b_128k.toml", [])
    m, S = cfg.model, cfg.train.seq_len
    d, per_key = m.dsa, m.n_heads * 2 * (m.qk_head_dim + m.value_head_dim)
    k = d.index_topk
    assert d.stage != "warmup" and S > k
    indexer_full = S * 2 * d.index_n_heads * (d.index_head_dim + 1)
    assert full_attention_core_flops(m, S) == pytest.approx(indexer_full + per_key * k, rel=1e-12)
    # causal: the indexer over S/2 keys on average; the core's first k positions see t + 1 < k keys
    causal_keys = (k * (S - k) + k * (k + 1) / 2) / S
    assert attention_core_flops(m, S) == pytest.approx(indexer_full / 2 + per_key * causal_keys, rel=1e-12)


def test_prediction_gives_tflops_both_ways_and_names_the_one_mfu_uses(capsys):
    argv = ["recipes/dense_cpu.toml", "--cluster", "h100"]
    assert plan_tool.main(argv + ["--json"]) == 0
    pred = json.loads(capsys.readouterr().out)["predicted"]
    cfg = load_config("recipes/dense_cpu.toml", [])
    both = train_flops_per_token_both(cfg.model, cfg.train.seq_len)
    assert pred["mfu_attention"] == "causal" and pred["warnings"] == []
    for convention in ("causal", "full"):
        assert pred[f"model_flops_per_token_{convention}"] == both[convention]
        assert pred[f"model_tflops_per_gpu_{convention}"] == pytest.approx(
            both[convention] * pred["tokens_per_s_per_gpu"] / 1e12, rel=1e-12)
    peak = CLUSTERS["h100"].peak_tflops("fp32") * 1e12  # dense_cpu trains in fp32
    assert pred["mfu"] == pytest.approx(pred["model_tflops_per_gpu_causal"] * 1e12 / peak, rel=1e-12)
    assert pred["model_tflops_per_gpu_full"] > pred["model_tflops_per_gpu_causal"]
    assert pred["model_tflops_per_gpu_causal"] == pytest.approx(pred["model_tflops_per_gpu"], rel=1e-12)
    assert plan_tool.main(argv) == 0
    text = capsys.readouterr().out
    assert (f"model TFLOP/s/GPU: {pred['model_tflops_per_gpu_causal']:.0f} attention causal | "
            f"{pred['model_tflops_per_gpu_full']:.0f} attention in full") in text
    assert MFU_CONVENTION in text and "warning:" not in text


def test_an_ep64_group_straddling_two_72_gpu_domains_is_warned_about():
    # DeepSeek-V3's layout (pp16 x dp128, EP64 over consecutive ranks of each 128-rank stage) on gb200: the
    # slowest rank the issue found, pipeline rank 5's first, is in EP group 640-703 across domains 8 and 9
    cfg = load_config("recipes/deepseek_v3_671b.toml", [])
    dims = ParallelDims.from_config(cfg.parallel, 2048)
    groups, gb200 = ["ep", "edp", "dp_cp", "pp", "world"], CLUSTERS["gb200"]
    (warning,) = domain_warnings(dims, groups, gb200, dims.rank_of(5, 0, 0, 0))
    assert warning.startswith("ep: 25 of 32 ep groups of 64 ranks would fit one NVLink domain of 72 GPUs")
    assert "ranks 640-703" in warning and "scale-out bandwidth (50 GB/s" in warning
    assert "not the predicted rank" in domain_warnings(dims, groups, gb200, 0)[0]  # ranks 0-63 sit in domain 0
    # domains of 64 (racks used 64 GPUs at a time) hold every EP group whole; on 8-GPU nodes EP64 spans 8 by its
    # size, which the layout asked for
    assert domain_warnings(dims, groups, replace(gb200, gpus_per_node=64), 640) == []
    assert domain_warnings(dims, groups, CLUSTERS["h800"], 640) == []


def test_plan_prints_and_lists_the_warning(capsys):
    # overlap_cpu: pp2 x dp2, ep2 folded into dp; stage 1's EP group is ranks 2-3, split by 3-GPU domains
    argv = ["recipes/overlap_cpu.toml", "--cluster", "h100", "--set", "cluster.gpus_per_node=3"]
    assert plan_tool.main(argv + ["--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["predicted"]["warnings"]
    assert any(w.startswith("ep: 1 of 2 ep groups of 2 ranks would fit one NVLink domain of 3 GPUs") for w in warnings)
    assert plan_tool.main(argv) == 0
    assert "  warning: ep: 1 of 2 ep groups" in capsys.readouterr().out
    assert plan_tool.main(argv[:-1] + ["cluster.gpus_per_node=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["warnings"] == []
