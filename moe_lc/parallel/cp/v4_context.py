"""DeepSeek-V4's attention under context parallelism: the `context` seam of a V4 module over the "cp" mesh axis
(DeepSeek's scheme, report arXiv 2606.19348 sections 3.4.3 and 4.2: the rows a window or a pooling window needs
from the previous chunk exchanged, the compressed entries and indexer keys all-gathered, the indexer's top-k and
the attention local). What a rank computes is moe_lc/model/v4_layout.py's plan; this file moves the rows.

Legend: B batch, S the whole sequence, cp ranks, L a span's length, h = max(W - 1, c m - 1) halo rows
(`v4_layout.halo_rows`), D model dim, d head dim, E indexer head dim, m tokens per entry, e bytes per element.

Layouts (parallel.cp_layout): "zigzag" (the sequence in 2cp chunks of C = S / 2cp, rank r holding chunks r and
2cp-1-r: two spans, balanced causal work) or "contiguous" (rank r holds rows r S/cp .. (r+1) S/cp - 1: one span,
as DeepSeek's V4 training splits the sequence; the window and CSA's top-k cost the same on every rank, HCA's dense
attention over the visible entries grows with the rank, and the indexer's scores over them too). Rules (the
recipe's, moe_lc/config/attention_kinds.py): a span's length is a multiple of every compress rate (so each rank pools
whole windows and every rank pools the same number of entries) and at least the halo h (the rows before a span come
from the one span before it).

    halo       a span's h earlier rows of x (B, h, D) are the tail of the span ending where it starts: sent point to
               point by the rank holding it (`halo_routes`; zig-zag: chunk r's from rank r - 1, chunk 2cp-1-r's
               from rank r + 1, rank cp - 1's second chunk's from its own first; contiguous: from rank r - 1), the
               extended rows [halo | span] per span. Backward: each halo's gradient sent back, added to its
               tail's. x rather than the projections (wa's q latent and KV, the compressors' Ca rows and gates):
               one tensor, one exchange, and the per-row GEMMs on h extra rows per span (h / L of the layer's
               per-row work); the projections would move (W - 1) d + 2 m (2 d + 2 E) values per span instead
               of h D (V4-Flash: 70K vs 520K; either is small beside a CSA layer's gathered entries).
    entries    each rank pools the entries whose last row it holds (B, L_total / m, d), all-gathered over "cp"
               and put in global entry order (`EntryGrid.order`); CSA's indexer keys (B, L_total / m, E) the same.
               Both gathers are in flight while the module projects its queries (wq_b, the layer's largest
               per-row GEMM). Backward: reduce-scatter (the indexer keys' only where the indexer loss trains).

Bytes per rank, layer and micro-batch (counted by comm.py as "cp" all_gather / reduce_scatter / send; `v4_cp_bytes`):

    all_gather      forward   (cp - 1) e B S/(cp m) (d + E_csa)     E_csa = E for CSA, else 0; none for window layers
    reduce_scatter  backward  the same, less the keys' where the indexer loss does not train
    send            both      e B h D per halo sent (forward) and per halo gradient sent back (backward): zig-zag
                              2 ([r > 0] + [r < cp - 1]) halos, contiguous [r > 0] + [r < cp - 1]

With packed documents the entries a rank pools vary with the documents: the exchange is padded to the most any
rank pools in the micro-batch (at most S / (cp m) + documents per span; DeepSeek pads to S / m + 1 as well).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from moe_lc.model.v4_layout import EntryGrid, RowLayout, halo_rows, needs_document_positions, plan_rows
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group

CP_LAYOUTS = ("zigzag", "contiguous")


def rank_spans(rank: int, cp: int, S: int, layout: str) -> tuple[tuple[int, int], ...]:
    """((global start, length), ...) of the rows cp rank `rank` holds, in local order (parallel/parallelize.py
    places the micro-batch the same way: chunks (r, 2cp-1-r), or (2r, 2r+1) of 2cp, i.e. one span)."""
    C = S // (2 * cp)
    if layout == "zigzag":
        return (rank * C, C), ((2 * cp - 1 - rank) * C, C)
    if layout == "contiguous":
        return ((2 * rank * C, 2 * C),)
    raise ValueError(f"parallel.cp_layout={layout!r} with DeepSeek-V4 attention: one of {', '.join(CP_LAYOUTS)}")


class StartAllGather(torch.autograd.Function):
    """t (...) on each cp rank -> (cp numel(t),) every rank's, flat, in rank order, *in flight*: `box["work"]` is the
    all-gather to wait on (`WaitAllGather`) before anything reads the result (the collective writes it after this
    returns: so a fresh tensor, no view); backward: each rank's slice of the gradient summed over the ranks
    (reduce-scatter)."""

    @staticmethod
    def forward(ctx, t: Tensor, group: Group, box: dict):
        ctx.group, ctx.shape = group, t.shape
        out = t.new_empty(group.size * t.numel())
        box["work"] = comm.all_gather(out, t.contiguous().view(-1), group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty(ctx.shape.numel())
        comm.reduce_scatter(out, grad.contiguous(), ctx.group)
        return out.view(ctx.shape), None, None


class WaitAllGather(torch.autograd.Function):
    """The all-gather StartAllGather put in flight, waited for; identity for autograd."""

    @staticmethod
    def forward(ctx, gathered: Tensor, box: dict):
        box.pop("work").wait()
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def halo_routes(spans_by_rank: list, rank: int) -> tuple[list, list, list]:
    """Where each span's h earlier rows come from: the tail of the span that ends where it starts. Returns this rank's
    (sends [(peer, my span j)], receives [(peer, my span i)], local copies [(my span j, my span i)]), each sorted by
    the receiving span's start, so two ranks pair their messages in the same order."""
    holder = {start + length: (r, j) for r, mine in enumerate(spans_by_rank) for j, (start, length) in enumerate(mine)}
    sends, recvs, local = [], [], []
    for r, mine in enumerate(spans_by_rank):
        for i, (start, _) in enumerate(mine):
            if start == 0:
                continue
            src, j = holder[start]
            if r == rank and src == rank:
                local.append((start, j, i))
            elif r == rank:
                recvs.append((start, src, i))
            elif src == rank:
                sends.append((start, r, j))
    return [(p, j) for _, p, j in sorted(sends)], [(p, i) for _, p, i in sorted(recvs)], \
        [(j, i) for _, j, i in sorted(local)]


class HaloExchange(torch.autograd.Function):
    """tails (B, spans, h, D): each span's last h rows -> halos (B, spans, h, D): the h rows before each span (zeros
    before the sequence's start), sent point to point over "cp" by whoever holds them; backward: each halo's gradient
    sent back to the tail it came from."""

    @staticmethod
    def forward(ctx, tails: Tensor, routes, group: Group):
        ctx.routes, ctx.group = routes, group
        return _route(tails, *routes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        sends, recvs, local = ctx.routes
        back = [(j, i) for i, j in local]  # the same routes, reversed: halo slot i's gradient to tail slot j
        return _route(grad.contiguous(), recvs, sends, back, ctx.group), None, None


def _route(src: Tensor, sends: list, recvs: list, local: list, group: Group) -> Tensor:
    """out[:, i] = src[:, j] along every route (j on `sends`' side, i on `recvs`'); a slot with none stays zero."""
    out = torch.zeros_like(src)
    bufs = [torch.empty_like(src[:, 0]) for _ in recvs]
    ops = [comm.p2p_op("send", src[:, j].contiguous(), peer, group) for peer, j in sends]
    ops += [comm.p2p_op("recv", buf, peer, group) for (peer, _), buf in zip(recvs, bufs)]
    for work in comm.batch_isend_irecv(ops, group):
        work.wait()
    for (_, i), buf in zip(recvs, bufs):
        out[:, i] += buf
    for j, i in local:
        out[:, i] += src[:, j]
    return out


class V4ContextRows:
    """The `context` seam of a V4Attention (moe_lc/model/v4_attention.py) under cp > 1 (module docstring)."""

    def __init__(self, group: Group, layout: str = "zigzag"):
        self.group, self.layout_name, self.ranks = group, layout, group.size
        self._cache: dict = {}
        self._routes = None

    def layout(self, attn, x_BSD: Tensor, positions: Tensor, docs) -> RowLayout:
        """This rank's extended rows and entry grid for module `attn`'s halo and rate (cached per micro-batch)."""
        if docs is not None:
            needs_document_positions(positions)
        B, S_loc = x_BSD.shape[:2]
        key = (B, S_loc, attn.halo, attn.compress_rate, attn.overlap, positions.dim())
        held = self._cache.get(key)
        if held is None or held[0] is not docs:
            held = docs, self._plan(attn, B, S_loc * self.ranks, positions.dim() == 2, docs, x_BSD.device)
            self._cache = {k: v for k, v in self._cache.items() if v[0] is docs} | {key: held}
        return held[1]

    def _plan(self, attn, B: int, S: int, doc_positions: bool, docs, device) -> RowLayout:
        cp, h = self.ranks, attn.halo
        spans = [rank_spans(r, cp, S, self.layout_name) for r in range(cp)]
        for start, length in spans[0]:
            if length < h or (attn.compress_rate and length % attn.compress_rate):
                raise ValueError(f"a cp span of {length} rows must be >= the {h} rows before it that its window and "
                                 f"pooling windows read, and a multiple of the compress rate {attn.compress_rate}")
        bounds = docs.bounds if docs is not None else [np.array([0, S])] * B
        rows = plan_rows(bounds, S, spans, self.group.rank, h, attn.compress_rate, attn.overlap, doc_positions, device)
        self._routes = halo_routes(spans, self.group.rank)
        return rows

    def extend(self, x_BSD: Tensor, rows: RowLayout) -> Tensor:
        """x (B, S_loc, D) -> the extended rows (B, S_ext, D): each span's h earlier rows, then its own."""
        h = rows.halo
        if h == 0:
            return x_BSD
        ends = np.cumsum([length for _, length in rows.spans])
        tails = torch.stack([x_BSD[:, end - h:end] for end in ends], dim=1)  # (B, spans, h, D)
        halos = HaloExchange.apply(tails, self._routes, self.group)
        starts = [0, *ends[:-1]]
        return torch.cat([t for i, (a, b) in enumerate(zip(starts, ends)) for t in (halos[:, i], x_BSD[:, a:b])], dim=1)

    def gather_later(self, pooled_Bnd: Tensor, grid: EntryGrid):
        """(B, n_own, d) this rank's pooled entries -> a call giving (B, n, d) every rank's, in global entry order:
        the all-gather is in flight until then (the module computes its queries meanwhile)."""
        B, n_own, d = pooled_Bnd.shape
        box = {}
        in_flight = StartAllGather.apply(pooled_Bnd, self.group, box)

        def wait() -> Tensor:
            every = WaitAllGather.apply(in_flight, box).view(self.ranks, B, n_own, d).transpose(0, 1)
            every = every.reshape(B, self.ranks * n_own, d)
            return every.gather(1, grid.order[..., None].expand(-1, -1, d))
        return wait

    def __repr__(self) -> str:
        return f"V4ContextRows(cp={self.ranks}, {self.layout_name})"


def v4_cp_bytes(layer_type: str, m, S: int, B: int, cp: int, layout: str, itemsize: int, indexer_trains: bool,
                rank: int) -> dict[str, int]:
    """Bytes cp rank `rank` counts over "cp" for one V4 layer of `layer_type` and one micro-batch of B sequences of S
    tokens without packed documents (module docstring), by op: "all_gather" (forward: entries, CSA's index keys),
    "reduce_scatter" (backward: their gradients; the keys' where the indexer loss trains), "send" (the halo rows
    forward, their gradients backward), and per pass, "forward" and "backward". m: the [model] section. A fully
    recomputed block (recompute.policy = "full") runs the forward's again in backward."""
    a = m.v4_attention
    rate = a.compress_rate(layer_type)
    overlap = layer_type == "compressed_sparse_attention"
    row = B * halo_rows(a.sliding_window, rate, overlap) * m.dim * itemsize
    sends, recvs, _ = halo_routes([rank_spans(r, cp, S, layout) for r in range(cp)], rank)
    n_own = S // cp // rate if rate else 0
    entries = (cp - 1) * B * n_own * a.head_dim * itemsize
    keys = (cp - 1) * B * n_own * a.index_head_dim * itemsize if overlap else 0
    gathered, scattered = entries + keys, entries + (keys if indexer_trains else 0)
    return {"all_gather": gathered, "reduce_scatter": scattered, "send": row * (len(sends) + len(recvs)),
            "forward": gathered + row * len(sends), "backward": scattered + row * len(recvs)}
