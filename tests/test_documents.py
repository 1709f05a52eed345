"""Packed documents: attention stays inside each document, exactly, on one device and on the zig-zag ring.

Truth is fp64 attention with the block-diagonal causal mask written out. Document layouts cover what a
packer produces: documents that start mid-chunk, span several chunks, are shorter than one chunk, and
a sequence that is one document. The ring checks share one 4-process gloo job (cp = 2 and 4).
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import load_config
from moe_lc.model.transformer import build_model
from moe_lc.ops.attention import attention_with_lse, get_backend
from moe_lc.ops.attention_backends import ReferenceBackend
from moe_lc.ops.documents import Documents, Piece
from moe_lc.parallel.cp.ring import chunk_ids, ring_attention_with_lse, zigzag_shard, zigzag_unshard
from moe_lc.parallel.mesh import ParallelDims
from moe_lc.config import ParallelConfig
from tests.harness import RECIPES, run_workers

S = 48  # 2 * cp * chunk: chunks of 12 at cp 2, of 6 at cp 4
LAYOUTS = {
    "mixed": [[5, 1, 13, 20, 9], [48]],  # short, mid-chunk, spanning; a one-document row
    "many_short": [[3] * 16, [2, 7, 11, 4, 24]],
    "one_document": [[48], [48]],
}
SCALE = 0.3


def doc_ids(lengths) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])


def visible(lengths) -> torch.Tensor:
    """(B, S, S) bool: query i sees key j."""
    ids = doc_ids(lengths)
    n = ids.shape[1]
    return (ids[:, :, None] == ids[:, None, :]) & torch.ones(n, n, dtype=torch.bool).tril()


def masked_truth(q, k, v, lengths, dout=None):
    """fp64 attention under the block-diagonal causal mask: out, lse (and dq, dk, dv with dout)."""
    q, k, v = (x.double().detach().requires_grad_() for x in (q, k, v))
    G = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(G, 2)) * SCALE
    scores = scores.masked_fill(~visible(lengths)[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), v.repeat_interleave(G, 2))
    truth = {"out": out.detach(), "lse": lse.detach()}
    if dout is not None:
        out.backward(dout.double())
        truth.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return truth


def inputs(B=2, H=4, J=2, Dqk=12, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for shape in
                 ((B, S, H, Dqk), (B, S, J, Dqk), (B, S, J, Dv), (B, S, H, Dv)))


def rank_ranges(rank, cp, chunk):
    return tuple((c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, cp))


# --------------------------------------------------------------------------- the plan (no processes)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_pieces_cover_exactly_the_mask_and_count_its_work(layout, cp):
    """Every ring step's pieces, placed back at global positions, tile exactly the rank's rows of the
    block-diagonal causal mask; the work per rank is that mask's count (sum over its rows of the
    position inside the document + 1)."""
    lengths = LAYOUTS[layout]
    docs, mask, chunk = Documents(lengths, S), visible(lengths), S // (2 * cp)
    for rank in range(cp):
        mine = rank_ranges(rank, cp, chunk)
        rows = torch.cat([torch.arange(a, b) for a, b in mine])
        covered = torch.zeros(len(lengths), S, S, dtype=torch.int64)
        steps = docs.plan_call(mine, [rank_ranges((rank - s) % cp, cp, chunk) for s in range(cp)])
        for s, pieces in enumerate(steps):
            cols = torch.cat([torch.arange(a, b) for a, b in rank_ranges((rank - s) % cp, cp, chunk)])
            for p in pieces:
                q, k = rows[p.q], cols[p.k]
                block = torch.ones(len(q), len(k), dtype=torch.int64)
                covered[p.row, q[:, None], k[None, :]] += block.tril() if p.causal else block
        assert covered.max() <= 1
        assert torch.equal(covered[:, rows].bool(), mask[:, rows])
        assert docs.call_work == int(mask[:, rows].sum())
    if cp == 1:
        assert docs.call_work == sum(n * (n + 1) // 2 for row in lengths for n in row)


def test_a_step_with_no_shared_document_is_skipped():
    docs = Documents([[12, 12, 12, 12]], S)  # cp 2: every document is one chunk
    for rank in range(2):
        steps = docs.plan_call(rank_ranges(rank, 2, 12), [rank_ranges((rank - s) % 2, 2, 12) for s in range(2)])
        assert steps[1] == ()  # the visiting rank's chunks share no document with ours
        assert all(p.causal for p in steps[0])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_chunks_pair_heaviest_with_lightest(cp):
    """One document: the pairing is zig-zag's. Packed documents: the busiest rank never works more than
    under zig-zag, and here strictly less."""
    assert set(Documents([[S]], S).balanced_chunks(cp)) == {tuple(sorted(chunk_ids(r, cp))) for r in range(cp)}
    docs = Documents([[30, 2, 16]], S)
    work = docs.chunk_work(2 * cp)
    zigzag = max(work[list(chunk_ids(r, cp))].sum() for r in range(cp))
    balanced = max(work[list(pair)].sum() for pair in docs.balanced_chunks(cp))
    assert balanced < zigzag
    assert sorted(c for pair in docs.balanced_chunks(cp) for c in pair) == list(range(2 * cp))


def test_documents_refuse_lengths_that_do_not_tile_the_sequence():
    with pytest.raises(ValueError, match=r"row 1: document lengths \[40, 4\] must be positive and sum to .* 48"):
        Documents([[48], [40, 4]], S)
    with pytest.raises(ValueError, match="must be positive"):
        Documents([[48, 0]], S)
    with pytest.raises(ValueError, match="3 document-length rows for a batch of 2"):
        Documents.from_batch([torch.tensor([48])] * 3, 2, S)


def test_positions_restart_at_each_document():
    pos = Documents([[3, 2, 43], [48]], S).positions()
    assert pos[0, :6].tolist() == [0, 1, 2, 0, 1, 0] and pos[0, -1] == 42
    assert torch.equal(pos[1], torch.arange(S))


# --------------------------------------------------------------------------- one device


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attention_over_pieces_equals_the_masked_truth(backend, layout):
    lengths = LAYOUTS[layout]
    q, k, v, dout = inputs()
    truth = masked_truth(q, k, v, lengths, dout)
    whole = ((0, S),)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    pieces = Documents(lengths, S).plan_call(whole, [whole])[0]
    out, lse = attention_with_lse(qs, ks, vs, scale=SCALE, backend=get_backend(backend), pieces=pieces)
    out.backward(dout)
    got = {"out": out, "lse": lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    for name, want in truth.items():
        assert torch.allclose(got[name].double(), want, atol=2e-6, rtol=1e-5), name


class FakeVarlen(ReferenceBackend):
    """A varlen kernel made of the reference math, one call per packed sequence: exercises the packing,
    the waves and the scatter of the varlen path on CPU."""

    calls = 0

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        FakeVarlen.calls += 1
        outs, lses = [], []
        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
            o, l = self.forward(q[None, a:b], k[None, c:d], v[None, c:d], causal, scale)
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        grads = [[], [], []]
        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
            parts = self.backward(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b],
                                  lse[None, :, a:b].contiguous(), causal, scale)
            for acc, part in zip(grads, parts):
                acc.append(part[0])
        return tuple(torch.cat(g) for g in grads)


def test_varlen_path_equals_one_call_per_piece():
    """A cp-4 rank's step where one query range meets two key ranges of one document: the varlen path
    needs two waves there (a query row may appear once per call) and must merge them by LSE."""
    q, k, v, dout = inputs()
    docs = Documents(LAYOUTS["mixed"], S)
    mine, theirs = rank_ranges(0, 4, 6), rank_ranges(1, 4, 6)  # chunk 7 sees both of rank 1's chunks (1, 6)
    pieces = docs.pieces(mine, theirs)
    assert len({(p.row, p.q.start) for p in pieces if not p.causal}) < len([p for p in pieces if not p.causal])
    rows = torch.cat([torch.arange(a, b) for a, b in mine])
    cols = torch.cat([torch.arange(a, b) for a, b in theirs])
    q, dout, k, v = q[:, rows], dout[:, rows], k[:, cols], v[:, cols]
    FakeVarlen.calls = 0
    fake, loop = FakeVarlen(), ReferenceBackend()
    out_v, lse_v = fake.forward_pieces(q, k, v, pieces, SCALE)
    out_l, lse_l = loop.forward_pieces(q, k, v, pieces, SCALE)
    assert FakeVarlen.calls >= 2
    assert torch.allclose(out_v, out_l, atol=1e-6) and torch.equal(lse_v == float("-inf"), lse_l == float("-inf"))
    finite = lse_l > float("-inf")
    assert torch.allclose(lse_v[finite], lse_l[finite], atol=1e-6)
    for g_v, g_l in zip(fake.backward_pieces(dout, q, k, v, out_l, lse_l, pieces, SCALE),
                        loop.backward_pieces(dout, q, k, v, out_l, lse_l, pieces, SCALE)):
        assert torch.allclose(g_v, g_l, atol=1e-6)


MLA = ["model.attention=mla", "model.mla.q_lora_rank=48", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=24"]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_each_packed_document_gets_the_logits_and_loss_it_gets_alone(attention):
    """document_mask + document_positions: a packed row is its documents run one by one (fp32)."""
    cfg = load_config(RECIPES / "debug_cpu.toml", MLA if attention == "mla" else []).model
    model = build_model(cfg, seed=3)
    lengths = [7, 30, 1, 26]  # S = 64
    tokens = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(0))
    docs = Documents([lengths], 64)
    inputs_, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        packed = model(inputs_, positions=docs.positions(), docs=docs)
        packed_loss = torch.nn.functional.cross_entropy(packed[0], labels[0], reduction="none")
        start = 0
        for n in lengths:
            alone = model(inputs_[:, start:start + n])
            assert torch.allclose(packed[:, start:start + n], alone, atol=2e-5, rtol=1e-5), (start, n)
            # the document's own next-token losses (its last input predicts the next document: not its own)
            own = torch.nn.functional.cross_entropy(alone[0, :n - 1], tokens[0, start + 1:start + n], reduction="sum")
            assert torch.allclose(packed_loss[start:start + n - 1].sum(), own, rtol=1e-5, atol=1e-5)
            start += n
    assert not torch.allclose(packed, model(inputs_), atol=1e-3)  # the mask changes what it should


# --------------------------------------------------------------------------- the ring (4 processes)


def _ring_worker(rank, world):
    out = {}
    for cp in (2, 4):
        dims = ParallelDims.from_config(ParallelConfig(cp=cp), world, rank)
        dims.init_groups()
        group = dims["cp"]
        for layout, lengths in LAYOUTS.items():
            q, k, v, dout = inputs(seed=1)
            for backend in ("reference", "torch"):
                docs = Documents(lengths, S)
                qs, ks, vs = (zigzag_shard(x, group, 1).clone().requires_grad_() for x in (q, k, v))
                o, lse = ring_attention_with_lse(qs, ks, vs, SCALE, group, backend, docs=docs)
                o.backward(zigzag_shard(dout, group, 1))
                got = {"out": o.detach(), "lse": lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
                full = {n: zigzag_unshard(t, group, 2 if n == "lse" else 1) for n, t in got.items()}
                out[(cp, layout, backend)] = (full, docs.call_work)
    return out


@pytest.fixture(scope="module")
def ring_runs():
    return run_workers(_ring_worker, 4)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ring_attention_over_documents_equals_the_masked_truth(ring_runs, cp, layout):
    lengths = LAYOUTS[layout]
    q, k, v, dout = inputs(seed=1)
    truth = masked_truth(q, k, v, lengths, dout)
    mask, chunk = visible(lengths), S // (2 * cp)
    for backend in ("reference", "torch"):
        works = []
        for rank in range(cp):
            full, work = ring_runs[rank][(cp, layout, backend)]
            for name, want in truth.items():
                assert torch.allclose(full[name].double(), want, atol=3e-6, rtol=1e-5), (backend, rank, name)
            rows = torch.cat([torch.arange(a, b) for a, b in rank_ranges(rank, cp, chunk)])
            works.append(work)
            assert work == int(mask[:, rows].sum())  # what this rank computed: its rows of the mask
        assert sum(works) == int(mask.sum())


def test_piece_work_counts_the_causal_triangle_once():
    p = Piece(0, slice(0, 3), slice(0, 3), True)
    assert p.work == 6 and Piece(1, slice(2, 4), slice(0, 5), False).work == 10


def test_balance_tool_counts_what_the_ring_plans(tmp_path):
    """tools/document_balance's closed form (per row: position in document + 1) is the ring's own plan,
    for zig-zag and the balanced layout, and the tool runs end to end on a token file."""
    import json

    import numpy as np

    from tests.test_documents_training import write_packed_corpus
    from tools.document_balance import check_against_plan, main, rank_work

    for lengths in LAYOUTS.values():
        for row in lengths:
            for cp in (2, 4):
                check_against_plan(np.array(row), cp)
                docs = Documents([row], S)
                work = docs.chunk_work(2 * cp)
                want = sorted(work[list(p)].sum() for p in docs.balanced_chunks(cp))
                assert sorted(rank_work(np.array(row), cp, "balanced").tolist()) == want
    write_packed_corpus(tmp_path / "docs", n_docs=200)
    assert main(["--tokens", str(tmp_path / "docs"), "--seq-lens", "64", "--cp", "2", "4", "--samples", "16",
                 "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "balance.json").read_text())["results"][0]
    assert result["seq_len"] == 64 and set(result["cp"]) == {"2", "4"}
    for v in result["cp"].values():
        assert 1.0 <= v["balanced"]["mean"] <= v["zigzag"]["mean"]
    assert (tmp_path / "out" / "balance.png").stat().st_size > 0


def test_step_metrics_count_the_work_of_the_masked_attention():
    """attn/doc_work is one layer's score elements over the batch; the fraction is against the causal mask."""
    from moe_lc.parallel.comm import Group
    from moe_lc.parallel.parallelize import prepare_batch
    from moe_lc.job.step import document_attention_metrics

    dims = ParallelDims(1, 1, 1, 1, 1, 1, 1, 0, groups={"cp": Group("cp", [0], 0), "dp": Group("dp", [0], 0)})
    cfg = load_config(RECIPES / "debug_cpu.toml").model
    model = build_model(cfg)
    lengths = [torch.tensor([5, 20, 39]), torch.tensor([64])]
    batch = prepare_batch(torch.randint(0, 256, (2, 65)), None, dims, documents=lengths, document_mask=True)
    with torch.no_grad():
        model(batch["inputs"], positions=batch["positions"], docs=batch["docs"])
    metrics = document_attention_metrics([batch, dict(batch, docs=None)], dims, torch.device("cpu"))
    want = sum(n * (n + 1) // 2 for n in (5, 20, 39, 64))
    assert metrics["attn/doc_work"] == want
    assert metrics["attn/doc_work_fraction"] == pytest.approx(want / (2 * 64 * 65 / 2))
    assert metrics["attn/cp_imbalance"] == 1.0
    assert document_attention_metrics([dict(batch, docs=None)], dims, torch.device("cpu")) == {}
