"""DeepSeek-V4's attention with model.v4_attention.core = "tiled" (the default: moe_lc/ops/v4_sparse_core.py's core
in query tiles, moe_lc/ops/v4_index_topk.py's top-k over entry tiles, the indexer loss from the scores and the
attention's mass at the picks) against "reference" (moe_lc/model/v4_core.py's sink_attention with (B, S, n) masks and
the indexer's full scores): one module of each layer type, its output and every gradient (the indexer's from its KL
loss included) on the plain sequence and on packed documents; what autograd keeps holds no (S, n) tensor; and the
tiny V4 recipe trains alike for 5 steps (fp32, 1e-5) on one process, with packed documents, and under cp2 zig-zag."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.model.v4_attention import V4Attention
from moe_lc.model.v4_core import TiledV4Core, V4Core
from moe_lc.ops.documents import Documents
from tests.harness import RECIPES, reference, run_layout
from tests.test_v4_parallel import assert_close

DIM, HEADS = 64, 4
TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
# index_topk 3 cuts below the entries most queries see; S = 52: n = 13 CSA entries, 6 HCA ones (no dim collides)
TINY = V4AttentionConfig(head_dim=32, q_lora_rank=24, rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=8,
                         csa_compress_rate=4, hca_compress_rate=8, index_n_heads=4, index_head_dim=16, index_topk=3,
                         yarn_factor=1.0, index_loss_weight=0.7)
S = 52


def module(layer_type: str, core: str) -> V4Attention:
    torch.manual_seed(0)
    attn = V4Attention(DIM, HEADS, dataclasses.replace(TINY, core=core), layer_type)
    with torch.no_grad():
        for p in attn.parameters():  # sinks and position biases too: none at a neutral 0
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return attn.train()  # CSA: the indexer trains on its loss


def run(attn, x, positions, docs=None):
    """-> (out, d out / d x, {name: grad}) for the loss sum(out * w), w fixed."""
    x = x.detach().requires_grad_(True)
    out = attn(x, positions, positions, docs)
    w = torch.sin(torch.arange(out.numel(), dtype=torch.float32)).view_as(out)
    (out * w).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in attn.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("layer_type", TYPES)
def test_tiled_module_equals_the_reference(layer_type, packed):
    tiled, ref = module(layer_type, "tiled"), module(layer_type, "reference")
    assert isinstance(tiled.core, TiledV4Core) and isinstance(ref.core, V4Core)
    torch.manual_seed(1)
    x = torch.randn(2, S, DIM)
    docs = Documents([[23, 19, 10], [5, 47]], S) if packed else None  # partial windows at every rate
    positions = docs.positions() if packed else torch.arange(S)
    got, want = run(tiled, x, positions, docs), run(ref, x, positions, docs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    if layer_type == "compressed_sparse_attention":  # the indexer loss reached all 5 of its parameters
        assert sum(n.startswith("indexer.") for n in got[2]) == 5
    for n, g in want[2].items():
        torch.testing.assert_close(got[2][n], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=n)


def saved_shapes(attn, x, positions, docs=None) -> tuple[list, int]:
    """(shapes, bytes) of every storage autograd keeps in one forward of `attn` (parameters left out)."""
    params = {p.untyped_storage()._cdata for p in attn.parameters()}
    kept, shapes = {}, []

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params:
            shapes.append(tuple(t.shape))
            kept[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x.requires_grad_(True), positions, positions, docs)
    return shapes, sum(kept.values())


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("layer_type", TYPES[1:])
def test_tiled_layer_keeps_no_tensor_of_queries_by_entries(layer_type, packed):
    """No saved tensor has both a query dim (S rows) and an entry dim (n) — the reference keeps several — and the
    layer keeps less than the reference's."""
    m, lengths = TINY.compress_rate(layer_type), [[23, 19, 10], [5, 47]] if packed else [[S], [S]]
    n = max(sum(L // m for L in row) for row in lengths)  # entries, padded to the row with most
    x = torch.randn(2, S, DIM)
    docs = Documents(lengths, S) if packed else None
    positions = docs.positions() if packed else torch.arange(S)
    shapes, tiled = saved_shapes(module(layer_type, "tiled"), x.clone(), positions, docs)
    ref_shapes, ref = saved_shapes(module(layer_type, "reference"), x.clone(), positions, docs)
    both = lambda shape: S in shape and n in shape  # noqa: E731
    assert any(both(s) for s in ref_shapes)  # the test sees the reference's (B, S, n) masks / probabilities
    assert not [s for s in shapes if both(s)], shapes
    assert tiled < ref, (tiled, ref)


@pytest.mark.parametrize("segments", [False, True], ids=["plain", "segments"])
@pytest.mark.parametrize("layer_type", TYPES)
def test_tiled_core_saved_bytes_count_what_autograd_keeps(layer_type, segments):
    """v4_counting.tiled_core_saved_bytes (the planner's floor reads it) = the storages the tiled core keeps, per token
    (fp32: c = 4), the sinks left out (a parameter): q, kv, out, lse, the entries, the picks or the visible counts
    (ranges with segments), the segments."""
    from moe_lc.model.v4_counting import tiled_core_saved_bytes
    from moe_lc.ops.v4_sparse_core import sparse_sink_attention

    m, d = TINY.compress_rate(layer_type), TINY.head_dim
    n = S // m if m else 0
    torch.manual_seed(3)
    q = torch.randn(1, S, HEADS, d, requires_grad=True)
    kv = torch.randn(1, S, d, requires_grad=True)
    sinks = torch.zeros(HEADS, requires_grad=True)
    entries = torch.randn(1, n, d, requires_grad=True) if m else None
    ready = torch.div(torch.arange(S) + 1, m or 1, rounding_mode="floor")[None]
    which = {}
    if layer_type == "compressed_sparse_attention":
        which["picked"] = torch.randint(-1, n, (1, S, min(TINY.index_topk, n)))
    elif m:
        which["visible"] = torch.stack([torch.zeros_like(ready), ready], -1) if segments else ready
    seg = {"segments": torch.zeros(1, S, dtype=torch.int64)} if segments else {}
    kept = {}

    def pack(t):
        kept[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sparse_sink_attention(q, kv, TINY.sliding_window, 0.1, sinks, entries, **which, **seg)
    kept.pop(sinks.untyped_storage()._cdata)
    assert sum(kept.values()) / S == pytest.approx(tiled_core_saved_bytes(TINY, HEADS, layer_type, S, 4, segments),
                                                   rel=1e-12)


# ------------------------------------------------------------------------------- the tiny recipe, 5 steps

RECIPE = RECIPES / "debug_v4_cpu.toml"
# tests/test_v4_cp.py's batch (seed 2 there: a near-tie of the CSA top-k flipped under cp2 at seed 1)
BATCH = ["train.seed=2", "train.steps=5", "train.seq_len=128", "train.global_batch=2", "train.micro_batch=1",
         "train.warmup_steps=1", "train.optimizer=sgd", "train.lr=0.05"]
DOCS = ["data.source=tokens", "data.document_mask=true", "data.document_positions=true"]
REFERENCE_CORE = ["model.v4_attention.core=reference"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.test_documents_training import write_packed_corpus

    prefix = tmp_path_factory.mktemp("packed") / "docs"
    write_packed_corpus(prefix)
    return [f"data.path={prefix}"]


@pytest.mark.parametrize("layout", ["one_process", "documents", "cp2_zigzag"])
def test_tiny_v4_trains_alike_with_either_core(layout, corpus):
    extra = DOCS + corpus if layout == "documents" else []
    want = reference(RECIPE, BATCH + extra + REFERENCE_CORE)
    if layout == "cp2_zigzag":
        got = run_layout(RECIPE, BATCH + ["parallel.cp=2", "parallel.dp=1"], world=2)
    else:
        got = run_layout(RECIPE, BATCH + extra, world=1)
    assert_close(want, got)


def test_an_unknown_core_is_refused_in_one_line():
    from moe_lc.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, ["model.v4_attention.core=fused"])
    assert [line for line in info.value.errors if "core" in line] == \
        ["model.v4_attention.core='fused' must be one of 'tiled', 'reference'"]
