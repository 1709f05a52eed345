"""DeepSeek-V4's attention as a registry kind (model.attention = "v4", recipes/debug_v4_cpu.toml): each block builds
its layer type's module, the blocks hand it positions (its own rope tables), counts follow the types, sinks and
position biases start at zero, what is not built is refused in one line, decoding with its cache equals the
uncached model, and the tiny recipe trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lc.config import ConfigError, load_config
from moe_lc.config.attention_kinds import attention_kind, kind_of_module
from moe_lc.model import decode
from moe_lc.model.counting import attention_core_flops, attention_params, param_counts, train_flops_per_token
from moe_lc.model.memory_floor import block_floor
from moe_lc.model.transformer import build_model

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "debug_v4_cpu.toml"
TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]


def tiny(*overrides: str):
    return load_config(RECIPE, list(overrides))


def test_blocks_build_their_layer_type_through_the_registry():
    cfg = tiny().model
    model = build_model(cfg, seed=0)
    kind = attention_kind(cfg)
    assert kind.name == "v4" and {kind_of_module(b.attn) for b in model.layers.values()} == {kind}
    assert [b.attn.layer_type for b in model.layers.values()] == TYPES
    assert [b.attn.indexer is not None for b in model.layers.values()] == [False, True, False, True]
    params = dict(model.named_parameters())
    assert param_counts(cfg)["total"] == sum(p.numel() for p in params.values())
    for i, b in enumerate(model.layers.values()):
        assert attention_params(cfg, i) == sum(p.numel() for p in b.attn.parameters()), i
    zero = [n for n in params if n.endswith(("sinks", "position_bias"))]  # transformers' _init_weights: zeros
    assert len(zero) == 4 + 3 + 2 and all(not params[n].any() for n in zero)
    assert params["layers.1.attn.wq_b.weight"].std() > 0.5 * cfg.init_std


def test_counts_are_per_layer_type():
    cfg, S = tiny().model, 128
    per_layer = [attention_core_flops(cfg, S, i) for i in range(cfg.n_layers)]
    assert per_layer[1] == per_layer[3] and len(set(per_layer)) == 3  # CSA twice; window only, HCA differ
    assert attention_core_flops(cfg, S) == pytest.approx(sum(per_layer) / cfg.n_layers)
    floors = [block_floor(cfg, i, 4, "none") for i in range(cfg.n_layers)]
    assert floors[1] == floors[3] and floors[0] < floors[2] < floors[1]  # entries (and their shares) add bytes
    assert train_flops_per_token(cfg, S) > 0


def test_the_blocks_hand_v4_positions_not_rope_tables():
    """The model's `rope` gives (positions, positions); a row shifted by its positions computes what a fresh
    sequence does for its own window-only first layer: the positions really reach the module."""
    cfg = tiny("model.residual=plain", "model.moe.hash_layers=0").model
    model = build_model(cfg, seed=0)
    positions = torch.arange(7, 19)
    assert all(t is positions for t in model.rope(positions))
    tokens = torch.randint(0, 256, (1, 12))
    assert not torch.allclose(model(tokens), model(tokens, positions=positions))


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=4", "parallel.tp=4 must divide model.v4_attention.o_groups=2 (each tp rank projects whole output "
                      "groups)"),
    ("data.document_mask=true", "data.document_mask=true and data.document_positions=false with model.attention = "
                                "'v4': set both"),
    ("model.qk_norm=head", "model.qk_norm='head' is not read by model.attention = 'v4'"),
])
def test_what_is_not_built_is_refused_in_one_line(override, message):
    world = {"parallel.tp=4": 4}.get(override)
    overrides = [override, "parallel.dp=1"] if world else [override]
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, overrides, world_size=world)
    assert sum(line.startswith(message) for line in info.value.errors) == 1, info.value.errors


def test_cached_decoding_equals_the_uncached_model():
    # mHC's stream and the hash layer included (V4's own caches: tests/test_v4_decode.py)
    cfg = tiny().model
    model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(0, 256, (2, 21))  # past an HCA entry (16) and several CSA entries
    assert torch.equal(decode.generate_greedy(model, prompt, 6), decode.generate_uncached(model, prompt, 6))


def test_the_tiny_recipe_trains(tmp_path):
    from moe_lc.train import run

    cfg = tiny("train.steps=8", "train.warmup_steps=2", f"train.output_dir={tmp_path}", "train.log_interval=100")
    losses = run(cfg).losses
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
