"""DeepSeek-V4's attention over packed documents (moe_lc/model/v4_layout.py): no window or compressed entry crosses a
document. A micro-batch row packing several documents, positions restarting in each, gives every document the
outputs and input gradients it gets alone, and the parameters' gradients are the sum over the documents alone;
one document through the packed path is the plain path. Every layer type, documents whose lengths leave partial
pooling windows, a CSA top-k below the entries a query sees. Context parallelism with packed documents:
tests/test_v4_cp.py."""

from __future__ import annotations

import pytest
import torch

from moe_lc.config.v4_attention import V4AttentionConfig
from moe_lc.model.v4_attention import V4Attention
from moe_lc.ops.documents import Documents

DIM, HEADS = 64, 4
TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
TINY = V4AttentionConfig(head_dim=32, q_lora_rank=24, rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=8,
                         csa_compress_rate=4, hca_compress_rate=8, index_n_heads=4, index_head_dim=16, index_topk=3,
                         yarn_factor=1.0, layer_types=list(TYPES))


def module(layer_type: str, seed: int = 0) -> V4Attention:
    torch.manual_seed(seed)
    attn = V4Attention(DIM, HEADS, TINY, layer_type)
    with torch.no_grad():
        for p in attn.parameters():  # sinks and position biases too: none may sit at a neutral 0
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return attn.eval()  # no indexer loss: its normalization is per call


def run(attn, x, positions, docs=None):
    """-> (out, d out / d x, {name: grad}) for the loss sum(out * w), w fixed."""
    x = x.detach().requires_grad_(True)
    attn.zero_grad(set_to_none=True)
    out = attn(x, positions, positions, docs)
    w = torch.sin(torch.arange(out.numel(), dtype=torch.float32)).view_as(out)
    (out * w).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layer_type", TYPES)
def test_packed_documents_equal_each_document_alone(layer_type):
    attn = module(layer_type)
    lengths = [[23, 19, 10], [5, 47]]  # partial windows at every rate; a document shorter than one window
    S = 52
    torch.manual_seed(1)
    x = torch.randn(2, S, DIM)
    docs = Documents(lengths, S)
    out, dx, grads = run(attn, x, docs.positions(), docs)
    want_grads = {}
    for b, row in enumerate(lengths):
        start = 0
        for L in row:
            xs = x[b:b + 1, start:start + L]
            w_full = torch.sin(torch.arange(out.numel(), dtype=torch.float32)).view_as(out)[b:b + 1, start:start + L]
            xs = xs.detach().requires_grad_(True)
            attn.zero_grad(set_to_none=True)
            alone = attn(xs, torch.arange(L), torch.arange(L))
            (alone * w_full).sum().backward()
            torch.testing.assert_close(out[b:b + 1, start:start + L], alone.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(dx[b:b + 1, start:start + L], xs.grad, rtol=1e-5, atol=1e-6)
            for n, p in attn.named_parameters():
                if p.grad is not None:
                    want_grads[n] = want_grads.get(n, 0) + p.grad
            start += L
    assert want_grads.keys() == grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.parametrize("layer_type", TYPES)
def test_one_document_through_the_packed_path_is_the_plain_path(layer_type):
    attn = module(layer_type)
    torch.manual_seed(2)
    x = torch.randn(2, 44, DIM)
    docs = Documents([[44], [44]], 44)
    got = run(attn, x, docs.positions(), docs)
    want = run(attn, x, torch.arange(44))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for n, g in want[2].items():
        torch.testing.assert_close(got[2][n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_documents_without_their_positions_are_refused():
    attn = module("heavily_compressed_attention")
    docs = Documents([[20, 24]], 44)
    with pytest.raises(ValueError, match=r"positions \(B, S\) restarting in each document"):
        attn(torch.randn(1, 44, DIM), torch.arange(44), torch.arange(44), docs)
