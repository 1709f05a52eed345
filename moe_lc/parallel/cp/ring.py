"""Context parallelism: zig-zag sequence sharding and ring attention over the "cp" mesh axis.

Legend (BSHD, as in `moe_lc.ops.attention`): B batch, S this rank's sequence = 2 chunks of C
tokens (the full sequence is 2 * cp * C), H query heads, J key/value heads (both tp-local under
tensor parallelism), D_qk query/key head dim, D_v value head dim. Every activation here is sharded
over the "cp" axis along S in the zig-zag layout; heads and batch are whatever the caller holds.

Zig-zag layout. The sequence is cut into 2*cp chunks; cp rank r holds chunks r and 2cp-1-r, in
that order (`chunk_ids`). Tokens, labels, loss mask and position ids are sharded the same way
(`prepare_batch`), so RoPE rotates every token by its true position and the summed token loss
over all ranks is the single-device loss.

Ring. At step s = 0 .. cp-1 rank r holds the K/V block of rank src = (r - s) mod cp; blocks move
one rank forward per step (send to r+1, receive from r-1) and the next transfer is in flight
while the current block is computed. Which part of the block each rank computes follows from the
chunk positions alone (`block_plan`: query chunk a sees key chunk b fully if b < a, causally if
b == a, not at all if b > a). For the zig-zag layout this gives the standard scheme, 2 chunk-pairs
of work per step on every rank:
  step 0 (src == r): all queries x all keys, causal (local diagonal: two half chunk-pairs + one);
  src < r:           all queries x the first key chunk (chunk src), no mask;
  src > r:           the second query chunk x all keys, no mask.
A contiguous split (rank r holds chunks 2r, 2r+1) is also planned, for comparison: rank r then does
2 + 4r chunk-pairs (`attention_work`). Partial outputs are merged with their log-sum-exp in fp32.

Backward recomputes per block from the merged (out, lse) (the backend interface allows that),
sends the K/V blocks around once more, and lets a dK/dV accumulator (fp32) travel with each block;
after cp steps every accumulator has visited every rank and one more hop returns it to its owner.

Traffic per attention call and rank (counted by comm.py as "cp"/"send"), e = bytes per element of
the blocks, |K|, |V| = their local numels:  forward (cp-1)(|K|+|V|)e;  backward (cp-1)(|K|+|V|)e +
cp(|K|+|V|)*4. What the blocks are is the ring's codec: GQA's K and V (`KVBlocks`), or MLA's latent
c_kv and shared RoPE key, up-projected on arrival (latent_ring.py), then |K|+|V| = S (Ckv + Dr).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from moe_lc.model.attention import LocalAttention
from moe_lc.ops.attention import AttentionBackend, get_backend, note_max_lse
from moe_lc.ops.attention_backends import lse_merge_weights
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.mesh import ParallelDims

LAYOUTS = ("zigzag", "contiguous")

# --------------------------------------------------------------------------- layout and schedule


def chunk_ids(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two global chunks (of 2*cp) that cp rank `rank` holds, in local order."""
    if layout == "zigzag":
        return rank, 2 * cp - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"unknown sequence layout {layout!r}; valid: {', '.join(LAYOUTS)}")


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step: local query chunks [q0, q1) against the visiting K/V
    block's chunks [kv0, kv1); causal = top-left aligned mask over the concatenated chunks."""

    q: tuple[int, int]
    kv: tuple[int, int]
    causal: bool

    @property
    def work(self) -> float:
        """Attention work in chunk-pairs (C x C score blocks); a causal diagonal chunk counts half."""
        n_pairs = (self.q[1] - self.q[0]) * (self.kv[1] - self.kv[0])
        return n_pairs / 2 if self.causal else float(n_pairs)  # causal blocks are square (block_plan)

    def q_slice(self, chunk: int) -> slice:
        return slice(self.q[0] * chunk, self.q[1] * chunk)

    def kv_slice(self, chunk: int) -> slice:
        return slice(self.kv[0] * chunk, self.kv[1] * chunk)


def _sees(q_chunk: int, kv_chunk: int) -> str | None:
    return "full" if kv_chunk < q_chunk else "causal" if kv_chunk == q_chunk else None


def block_plan(q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...]) -> Block | None:
    """The one attention call that covers exactly what queries in `q_chunks` see of `kv_chunks`
    (global chunk ids in local order); None when nothing is visible. Raises AssertionError when the
    visible part is not one rectangle (not the case for the layouts here)."""
    seen = [[_sees(a, b) for b in kv_chunks] for a in q_chunks]
    rows = [i for i, row in enumerate(seen) if any(row)]
    cols = [j for j in range(len(kv_chunks)) if any(row[j] for row in seen)]
    if not rows:
        return None
    block = Block((rows[0], rows[-1] + 1), (cols[0], cols[-1] + 1), any("causal" in row for row in seen))
    for i, row in enumerate(seen):  # the call's mask must reproduce `seen` exactly
        for j, want in enumerate(row):
            inside = block.q[0] <= i < block.q[1] and block.kv[0] <= j < block.kv[1]
            local = _sees(q_chunks[i], kv_chunks[j]) if block.causal else "full"
            assert want == (local if inside else None), (q_chunks, kv_chunks, block)
    if block.causal:
        assert block.q == block.kv and list(q_chunks) == sorted(q_chunks), (q_chunks, kv_chunks)
    return block


def ring_schedule(rank: int, cp: int, layout: str = "zigzag") -> list[Block | None]:
    """Per ring step s, what `rank` computes against the K/V block of rank (rank - s) mod cp."""
    mine = chunk_ids(rank, cp, layout)
    return [block_plan(mine, chunk_ids((rank - s) % cp, cp, layout)) for s in range(cp)]


def attention_work(cp: int, layout: str = "zigzag") -> list[float]:
    """Chunk-pairs of attention each cp rank computes per call (the ring's own schedule)."""
    return [sum(b.work for b in ring_schedule(r, cp, layout) if b is not None) for r in range(cp)]


# --------------------------------------------------------------------------- sharding


def rank_chunks(rank: int, cp: int, layout: str = "zigzag", docs=None) -> tuple[int, int]:
    """The chunks cp rank `rank` holds: the micro-batch's own placement when its packed documents have
    one (parallel.cp_layout = "balanced", `Documents.balanced_chunks`), else `chunk_ids`."""
    if docs is not None and docs.chunks is not None:
        return docs.chunks[rank]
    return chunk_ids(rank, cp, layout)


def zigzag_shard(t: Tensor, group: Group, dim: int, chunks: tuple[int, int] | None = None) -> Tensor:
    """Full sequence along `dim` (length 2*cp*C, replicated) -> this rank's chunks (r, 2cp-1-r), or
    `chunks`, concatenated (length 2*C, sharded over the cp axis). A view-based copy; differentiable."""
    if group.size == 1:
        return t
    n_chunks = 2 * group.size
    if t.shape[dim] % n_chunks:
        raise ValueError(f"sequence length {t.shape[dim]} (dim {dim}) must be divisible by 2*cp={n_chunks}")
    pieces = t.chunk(n_chunks, dim=dim)
    return torch.cat([pieces[i] for i in chunks or chunk_ids(group.rank, group.size)], dim=dim)


@torch.no_grad()
def zigzag_unshard(t: Tensor, group: Group, dim: int) -> Tensor:
    """Inverse of zigzag_shard: every rank's (.., 2*C, ..) shard -> the full sequence on every rank
    (one all-gather over the cp axis; no gradient)."""
    if group.size == 1:
        return t
    cp = group.size
    local = t.movedim(dim, 0).contiguous()
    gathered = torch.empty((cp * local.shape[0], *local.shape[1:]), dtype=t.dtype, device=t.device)
    comm.all_gather(gathered, local, group)
    pieces = gathered.chunk(2 * cp, dim=0)  # rank r's chunks are pieces 2r, 2r+1
    order = [None] * (2 * cp)
    for r in range(cp):
        for i, c in enumerate(chunk_ids(r, cp)):
            order[c] = pieces[2 * r + i]
    return torch.cat(order, dim=0).movedim(0, dim)


# --------------------------------------------------------------------------- transports


class P2PRing:
    """Shifts tensors one step along the cp group: send to rank+1, receive from rank-1 (counted)."""

    def __init__(self, group: Group):
        self.group, self.rank, self.size = group, group.rank, group.size

    def shift(self, tensors: list[Tensor]) -> "_InFlight":
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        received = [torch.empty_like(t) for t in tensors]
        ops = [comm.p2p_op("send", t, nxt, self.group) for t in tensors]
        ops += [comm.p2p_op("recv", buf, prev, self.group) for buf in received]
        return _InFlight(comm.batch_isend_irecv(ops, self.group), received, tensors)


class LoopbackRing:
    """Stands in for P2PRing on one device (benchmarks): every rank's block is this rank's own,
    so one cp rank's exact compute schedule runs without any communication."""

    def __init__(self, rank: int, size: int):
        self.group, self.rank, self.size = None, rank, size

    def shift(self, tensors: list[Tensor]) -> "_InFlight":
        return _InFlight([], list(tensors), [])


class _InFlight:
    def __init__(self, works: list, received: list[Tensor], sent: list[Tensor]):
        self._works, self._received, self._sent = works, received, sent  # keep sent buffers alive

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], []
        return self._received


# --------------------------------------------------------------------------- ring attention


def _merge_(out_BSHD: Tensor, lse_BHS: Tensor, part_out: Tensor, part_lse: Tensor, rows: slice) -> None:
    """Online softmax in fp32: fold a partial (out, lse) over some keys into the accumulators. Rows that
    neither has reached (lse -inf on both sides: packed documents) stay (0, -inf)."""
    acc_out, acc_lse = out_BSHD[:, rows], lse_BHS[:, :, rows]
    new_lse, old_w, new_w = lse_merge_weights(acc_lse, part_lse)  # (B, H, s)
    acc_out.mul_(old_w.transpose(1, 2).unsqueeze(-1)).add_(part_out.float() * new_w.transpose(1, 2).unsqueeze(-1))
    acc_lse.copy_(new_lse)


class KVBlocks:
    """What travels the ring for attention with its own K/V (GQA): k (B,S,J,D_qk) and v (B,S,J,D_v)
    themselves. A ring codec: `expand` gives the K/V of a visiting block's key columns, `grads` turns
    their gradients into the block tensors' (and the codec's weights') gradients."""

    n_blocks = 2

    def expand(self, blocks, weights, cols):
        return blocks[0][:, cols], blocks[1][:, cols]

    def grads(self, dk, dv, blocks, weights, cols):
        return (dk, dv), ()


@dataclass(frozen=True)
class StepCall:
    """What one ring step computes: local query `rows` against the visiting block's key columns `cols`,
    either as one call (`causal` mask or none) or, for packed documents, as `pieces` (their key
    columns relative to `cols`)."""

    rows: slice
    cols: slice
    causal: bool = False
    pieces: tuple | None = None

    def forward(self, backend: AttentionBackend, q, k_b, v_b, scale):
        if self.pieces is None:
            return backend.forward(q[:, self.rows], k_b, v_b, self.causal, scale)
        return backend.forward_pieces(q, k_b, v_b, self.pieces, scale)

    def backward(self, backend: AttentionBackend, dout, q, k_b, v_b, out, lse, scale):
        if self.pieces is None:
            r = self.rows
            return backend.backward(dout[:, r], q[:, r], k_b, v_b, out[:, r], lse[:, :, r].contiguous(), self.causal, scale)
        return backend.backward_pieces(dout, q, k_b, v_b, out, lse, self.pieces, scale)


def step_calls(rank: int, cp: int, chunk: int, layout: str = "zigzag", docs=None) -> list[StepCall | None]:
    """Per ring step, what `rank` computes (None: nothing, the block only passes through). Without
    documents: the rectangle `ring_schedule` plans. With `docs` (moe_lc/ops/documents.py): the pieces
    where this rank's chunks and the visiting ones share a document; a step with none is skipped."""
    if docs is None:
        return [None if b is None else StepCall(b.q_slice(chunk), b.kv_slice(chunk), b.causal)
                for b in ring_schedule(rank, cp, layout)]

    def ranges(r):
        return tuple((c * chunk, (c + 1) * chunk) for c in rank_chunks(r, cp, layout, docs))

    calls = []
    for pieces in docs.plan_call(ranges(rank), [ranges((rank - s) % cp) for s in range(cp)]):
        if not pieces:
            calls.append(None)
            continue
        lo, hi = min(p.k.start for p in pieces), max(p.k.stop for p in pieces)
        shifted = tuple(replace(p, k=slice(p.k.start - lo, p.k.stop - lo)) for p in pieces)
        calls.append(StepCall(slice(None), slice(lo, hi), pieces=shifted))
    return calls


class RingAttentionFunction(torch.autograd.Function):
    """(q (B,S,H,D_qk), *blocks, *weights) -> out (B,S,H,D_v) in q.dtype, lse (B,H,S) fp32, causal over
    the full sequence (and inside each packed document with `docs`); q, the blocks, out and lse zig-zag
    sharded over cp. `codec` says what the blocks are: K/V themselves (`KVBlocks`), or MLA's latents
    up-projected with `weights` on arrival (moe_lc/parallel/cp/latent_ring.py).

    Forward: cp steps; at each, post the shift of the current blocks, compute the planned part with
    backend.forward and merge it, then wait for the next blocks. Backward: the same ring for the
    blocks, plus a fp32 gradient accumulator per block tensor that travels one step behind its block
    and ends at its owner; the weights' gradients (fp32) stay on this rank.
    """

    @staticmethod
    def forward(ctx, q, scale: float, ring, backend: AttentionBackend, layout: str, codec, docs, *tensors):
        out, lse, state = ring_forward(q, scale, ring, backend, layout, codec, docs, tensors)
        ctx.save_for_backward(*state.pop("saved"))
        ctx.state = state
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        dq, *d_tensors = ring_backward(dout, ctx.saved_tensors, **ctx.state)
        return (dq, None, None, None, None, None, None, *d_tensors)


def ring_forward(q, scale: float, ring, backend: AttentionBackend, layout: str, codec, docs, tensors):
    """RingAttentionFunction's forward without autograd -> (out, lse, state for ring_backward), state["saved"]
    the tensors to keep. Plain functions so that a test can run cp ranks as threads on one GPU: autograd
    runs every backward of a CUDA device on one engine thread, where ranks waiting on each other deadlock."""
    schedule = step_calls(ring.rank, ring.size, q.shape[1] // 2, layout, docs)
    own = [t.contiguous() for t in tensors[:codec.n_blocks]]
    weights = tensors[codec.n_blocks:]
    out = lse = None
    blocks = own
    for step, call in enumerate(schedule):
        last = step == ring.size - 1
        in_flight = None if last else ring.shift(blocks)
        if call is not None:
            k_b, v_b = codec.expand(blocks, weights, call.cols)
            if out is None:
                out = q.new_zeros((*q.shape[:3], v_b.shape[-1]), dtype=torch.float32)
                lse = q.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32)
            part_out, part_lse = call.forward(backend, q, k_b, v_b, scale)
            _merge_(out, lse, part_out, part_lse, call.rows)
        if not last:
            blocks = in_flight.wait()
    out = out.to(q.dtype)
    state = {"saved": (q, out, lse, *own, *weights), "scale": scale, "ring": ring, "backend": backend,
             "schedule": schedule, "codec": codec}
    return out, lse, state


def ring_backward(dout, saved, scale, ring, backend, schedule, codec) -> tuple:
    """-> (dq, *d_blocks, *d_weights) for ring_forward's inputs (q, *tensors)."""
    q, out, lse, *rest = saved
    n = codec.n_blocks
    own, weights = rest[:n], rest[n:]
    dq = torch.zeros_like(q, dtype=torch.float32)
    dweights = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    blocks, acc_in_flight = own, None
    for step, call in enumerate(schedule):
        last = step == ring.size - 1
        blocks_in_flight = None if last else ring.shift(blocks)
        if step == 0:  # this rank's own blocks: their accumulators start here
            acc = [torch.zeros_like(t, dtype=torch.float32) for t in own]
        if call is not None:
            k_b, v_b = codec.expand(blocks, weights, call.cols)
            dq_b, dk_b, dv_b = call.backward(backend, dout, q, k_b, v_b, out, lse, scale)
            dq[:, call.rows] += dq_b.float()
            d_blocks, d_weights = codec.grads(dk_b, dv_b, blocks, weights, call.cols)
            for dw_acc, dw in zip(dweights, d_weights):
                dw_acc += dw.float()
        if step > 0:  # the accumulators of the blocks we hold arrive from the previous rank
            acc = acc_in_flight.wait()
        if call is not None:
            for a, d in zip(acc, d_blocks):
                a[:, call.cols] += d.float()
        if not last:
            blocks = blocks_in_flight.wait()
        acc_in_flight = ring.shift(acc)  # one step behind its block; the last hop returns it home
    acc = acc_in_flight.wait()
    return (dq.to(q.dtype), *(a.to(t.dtype) for a, t in zip(acc, own)),
            *(d.to(w.dtype) for d, w in zip(dweights, weights)))


def ring_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, group: Group | None = None,
                            backend: AttentionBackend | str = "auto", layout: str = "zigzag",
                            ring=None, docs=None) -> tuple[Tensor, Tensor]:
    """Causal attention over the full sequence from zig-zag shards (layouts: see RingAttentionFunction).
    Pass `group` (the cp group) or a `ring` (P2PRing / LoopbackRing). lse carries no gradient. docs: the
    micro-batch's packed documents (moe_lc/ops/documents.py) to attend inside each, or None."""
    if q.shape[1] % 2:
        raise ValueError(f"local sequence length {q.shape[1]} must be even (two chunks per cp rank)")
    if isinstance(backend, str):
        backend = get_backend(backend, q.device)
    ring = ring if ring is not None else P2PRing(group)
    return RingAttentionFunction.apply(q, float(scale), ring, backend, layout, KVBlocks(), docs, k, v)


class RingAttention(nn.Module):
    """Drop-in for LocalAttention under cp > 1: (q (B,S,H,D_qk), k, v (B,S,J,D_v)) -> (B,S,H,D_v),
    S the zig-zag shard of this cp rank; same backend choice as the LocalAttention it replaces."""

    def __init__(self, group: Group, backend: str = "auto"):
        super().__init__()
        self.group, self.backend_name = group, backend
        self._backend = None

    def forward(self, q, k, v, scale: float, docs=None) -> Tensor:
        if self._backend is None:
            self._backend = get_backend(self.backend_name, q.device)
        out, lse = ring_attention_with_lse(q, k, v, scale, self.group, self._backend, docs=docs)
        note_max_lse(self, lse)
        return out

    def extra_repr(self) -> str:
        return f"backend={self.backend_name}, cp={self.group.size}"


def context_parallel_plan(model: nn.Module, dims: ParallelDims, plan, rings: dict | None = None) -> None:
    """Plan every LocalAttention core swapped for zig-zag ring attention over the "cp" group (into the
    layer plan, moe_lc/parallel/layer_plan.py). `rings`: {attention module type: ring core class}, its
    attention kind's ring (moe_lc/config/attention_kinds.py: MLA's latent ring, latent_ring.py, whose
    `attend` seam the plan matches); RingAttention for a core not listed.

    Everything else is per token and needs no change: prepare_batch shards tokens, labels, mask and
    positions; dense gradients are summed over "dp_cp", experts over "edp" (which contains cp). The
    sequence-wise balance loss sees each sequence whole: its expert counts are summed over the cp (and
    tp) ranks holding the sequence's chunks (parallel/ep/balance_plan.py)."""
    group, rings = dims["cp"], rings or {}
    for module in model.modules():
        if isinstance(getattr(module, "core", None), LocalAttention):
            plan.set(module, core=rings.get(type(module), RingAttention)(group, module.core.backend_name))
