"""Hybrid context parallelism (`parallel.cp_a2a = A`): a Ulysses all-to-all over A consecutive cp ranks
inside, the zig-zag ring (cp/ring.py) over the cp / A outer positions.

Legend (BSHD, as in `moe_lc.ops.attention`): B batch, c = seq_len / (2 cp) tokens per chunk, H query heads
and J key/value heads (tp-local), D head dims. A = cp_a2a, R = cp / A ring positions. cp rank
r = o * A + a: ring position o (its index in the "cp_ring" group), a2a index a (its index in "cp_a2a").

Placement. The sequence is cut into 2 cp chunks of c tokens, and grouped into 2 R super-chunks of A
chunks each. The ring needs ring position o to hold super-chunks (o, 2R-1-o) (zig-zag over R), whole,
after the all-to-all; so each of its A ranks holds the a-th chunk of both super-chunks beforehand:

    cp rank (o, a) holds chunks (o A + a, (2R-1-o) A + a)           (`hybrid_chunk_ids`)

The all-to-all (`seq_to_heads`) sends head group p (H/A heads) of the rank's two chunks to a2a peer p;
rank (o, a) receives from every peer p its two chunks of head group a and lays them out as super-chunk o
(chunks o A + 0 .. o A + A-1) followed by super-chunk 2R-1-o: the ring's zig-zag shard over R, 2 A c
tokens of H/A heads. The ring attends over "cp_ring"; `heads_to_seq` sends the output back.
Worked example, cp = 4, A = 2 (R = 2; 8 chunks 0..7; super-chunks {0,1} {2,3} {4,5} {6,7}):

    cp rank  (o, a)  holds chunks   after the all-to-all (heads of group a)   ring over
       0     (0, 0)     0, 6        0 1 | 6 7   = super-chunks 0, 3           cp ranks 0, 2
       1     (0, 1)     1, 7        0 1 | 6 7                                 cp ranks 1, 3
       2     (1, 0)     2, 4        2 3 | 4 5   = super-chunks 1, 2
       3     (1, 1)     3, 5        2 3 | 4 5

A = 1 is `chunk_ids`' zig-zag (the plain ring), A = cp pure Ulysses (each rank holds chunks a, cp + a;
after the all-to-all the whole sequence in order). Tokens, labels, loss mask and positions are sharded by
the same chunks (parallelize.prepare_batch), so every rank's work is balanced as in the ring.

Heads. tp-local H must be divisible by A (config rule). GQA with J not divisible by A: the kv heads are
repeated (repeat_interleave) f = lcm(J, A) / J times before the all-to-all, so every a2a rank receives the
kv heads its H/A consecutive query heads read (query head h reads kv head h // (H / J) before and
after); their gradients sum back through the repeat. MLA, as `parallel.mla_ring` says: "expanded" moves its
up-projected K (D_qk = Dn + Dr) and V heads through the all-to-all and around the ring
(`HybridRingAttention`, as GQA); "latent" (`HybridLatentRingAttention`) moves only q and the output through
the all-to-all, all-gathers the latent c_kv and roped k_r (Ckv + Dr per token, shared by every head) over
"cp_a2a" and runs latent_ring.py's ring over "cp_ring", each rank up-projecting its H/A heads with its rows
of W_UKV. Values sent forward per token of this rank, DeepSeek-V3 (H = 128 heads, Ckv + Dr = 512 + 64,
D_qk = 192, D_v = 128): expanded (A-1)/A x H (192 + 192 + 128 + 128) through the all-to-all (q, k, v, out),
and ring blocks of H / A (192 + 128) values per token; latent (A-1)/A x H (192 + 128) (q, out) plus
(A-1) x 576 (the all-gather), and ring blocks of 576 values per token (A = 2: 40,960 per token through
the all-to-all and 20,480 per ring token, against 21,056 and 576). The latent ring's bytes hardly fall
with A: each of the A ranks rings the whole gathered latent, cp - A blocks of this rank's size instead of
cp - 1; what A buys it is fewer, longer ring steps.

Traffic per attention call and rank (counted by comm.py, e bytes per element, |x| the local numel of x
before the all-to-all, kv heads as repeated): "cp_a2a"/"all_to_all" forward (A-1)/A (|q|+|k|+|v|+|out|) e,
backward the same (dout, then dq, dk, dv); "cp_ring"/"send" the ring's formula (cp/ring.py) with R for cp
and the blocks' numels after the all-to-all (k and v with J f / A heads over 2 A c tokens). The latent
core: all-to-all (A-1)/A (|q|+|out|) e each way; "cp_a2a"/"all_gather" (A-1)(|c|+|k_r|) e forward,
"cp_a2a"/"reduce_scatter" the same backward; the ring's blocks c and k_r over 2 A c tokens.

Packed documents (`docs`): the ring plans from global positions; after the all-to-all ring position o
holds super-chunks (o, 2R-1-o), which is `chunk_ids(o, R)` at super-chunk size, so the ring's own
document plan is exact with no padding (same rule as the ring: none). `cp_layout = "balanced"` is refused.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from moe_lc.model.attention import LocalAttention
from moe_lc.ops.attention import AttentionBackend, get_backend, note_max_lse
from moe_lc.parallel import comm
from moe_lc.parallel.comm import Group
from moe_lc.parallel.cp.ring import KVBlocks, LoopbackRing, P2PRing, RingAttentionFunction
from moe_lc.parallel.mesh import ParallelDims


def hybrid_chunk_ids(rank: int, cp: int, a2a: int) -> tuple[int, int]:
    """The two global chunks (of 2 cp) that cp rank `rank` holds before the all-to-all (module docstring)."""
    outer, inner = divmod(rank, a2a)
    ring = cp // a2a
    return outer * a2a + inner, (2 * ring - 1 - outer) * a2a + inner


def kv_repeats(n_kv_heads: int, a2a: int) -> int:
    """How many times each tp-local kv head is repeated so that A divides the kv heads (module docstring)."""
    return math.lcm(n_kv_heads, a2a) // n_kv_heads


def _exchange(send: Tensor, group: Group) -> Tensor:
    """(A, ...) row p to a2a peer p -> (A, ...) row p from peer p (counted all-to-all)."""
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, [1] * group.size, [1] * group.size, group)
    return recv


def seq_to_heads(x: Tensor, group: Group) -> Tensor:
    """(B, 2c, H, D) this rank's two chunks, all heads -> (B, 2Ac, H/A, D) the ring position's two
    super-chunks, head group a (sharded over "cp_ring" along S, over "cp_a2a" along H)."""
    A, (B, S, H, D) = group.size, x.shape
    send = x.reshape(B, S, A, H // A, D).permute(2, 1, 0, 3, 4).contiguous()  # (A dest, 2c, B, H/A, D)
    recv = _exchange(send, group).view(A, 2, S // 2, B, H // A, D)  # (A src, chunk, c, B, H/A, D)
    return recv.permute(3, 1, 0, 2, 4, 5).reshape(B, 2 * A * (S // 2), H // A, D)


def heads_to_seq(y: Tensor, group: Group) -> Tensor:
    """Inverse of seq_to_heads: (B, 2Ac, H/A, D) -> (B, 2c, H, D)."""
    A, (B, S2, Hh, D) = group.size, y.shape
    c = S2 // (2 * A)
    send = y.reshape(B, 2, A, c, Hh, D).permute(2, 1, 3, 0, 4, 5).reshape(A, 2 * c, B, Hh, D).contiguous()
    recv = _exchange(send, group)  # (A src = head group, 2c, B, H/A, D)
    return recv.permute(2, 1, 0, 3, 4).reshape(B, 2 * c, A * Hh, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, dy):
        return heads_to_seq(dy.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, dx):
        return seq_to_heads(dx.contiguous(), ctx.group), None


def gather_seq(x: Tensor, group: Group) -> Tensor:
    """(B, 2c, ...) this rank's two chunks of a tensor without heads (MLA's latent) -> (B, 2Ac, ...) the ring
    position's two super-chunks, the same on its A ranks (counted all-gather over "cp_a2a")."""
    A, (B, S, *rest) = group.size, x.shape
    send = x.movedim(1, 0).contiguous()  # (2c, B, ...)
    recv = torch.empty((A * S, *send.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(recv, send, group)
    ordered = recv.view(A, 2, S // 2, B, *rest).transpose(0, 1).reshape(2 * A * (S // 2), B, *rest)
    return ordered.movedim(0, 1)


def scatter_seq_sum(g: Tensor, group: Group) -> Tensor:
    """Adjoint of gather_seq: (B, 2Ac, ...) every a2a rank's gradient -> (B, 2c, ...) their sum over this
    rank's own chunks (counted reduce-scatter over "cp_a2a")."""
    A, (B, S2, *rest) = group.size, g.shape
    c = S2 // (2 * A)
    send = g.movedim(1, 0).reshape(2, A, c, B, *rest).transpose(0, 1).reshape(A * 2 * c, B, *rest).contiguous()
    out = torch.empty((2 * c, B, *rest), dtype=g.dtype, device=g.device)
    comm.reduce_scatter(out, send, group)
    return out.movedim(0, 1)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, dy):
        return scatter_seq_sum(dy, ctx.group), None


def hybrid_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, a2a: Group, ring_group: Group,
                              backend: AttentionBackend | str = "auto", docs=None) -> tuple[Tensor, Tensor]:
    """q (B,2c,H,D_qk), k (B,2c,J,D_qk), v (B,2c,J,D_v) in the hybrid placement -> out (B,2c,H,D_v) (same
    placement) and lse (B, H/A, 2Ac) fp32 of this rank's head group over the ring position's sequence."""
    H, J, A = q.shape[2], k.shape[2], a2a.size
    backend = get_backend(backend, q.device) if isinstance(backend, str) else backend
    assert H % A == 0, (H, A)  # config rule: tp-local heads divisible by parallel.cp_a2a
    if J % A:
        f = kv_repeats(J, A)
        k, v = k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)
    q2, k2, v2 = (_SeqToHeads.apply(t, a2a) for t in (q, k, v))
    ring = P2PRing(ring_group) if ring_group.size > 1 else LoopbackRing(0, 1)
    out2, lse = RingAttentionFunction.apply(q2, float(scale), ring, backend, "zigzag", KVBlocks(), docs, k2, v2)
    return _HeadsToSeq.apply(out2, a2a), lse


def note_head_group_lse(holder, lse_BhS: Tensor, a2a: Group) -> None:
    """QK-clip's probes (moe_lc/parallel/qk_clip.py, qk_guard.py) for this rank's head group: lse (B, H/A, S')
    -> each sample's per-head max at the group's place among the module's H heads, -inf at the others (the
    all-reduces over dp x cp, or the guard's over cp, which hold the a2a peers, fill them in)."""
    if not (getattr(holder, "max_lse_probe", False) or getattr(holder, "bound_probe", False)):
        return
    B, h = lse_BhS.shape[:2]
    full = lse_BhS.new_full((B, h * a2a.size, 1), float("-inf"))
    full[:, a2a.rank * h:(a2a.rank + 1) * h, 0] = lse_BhS.detach().float().amax(dim=2)
    note_max_lse(holder, full)


class HybridRingAttention(nn.Module):
    """Drop-in for LocalAttention under cp > 1 with parallel.cp_a2a > 1: (q (B,S,H,D_qk), k, v (B,S,J,D_v))
    -> (B,S,H,D_v), S this rank's two chunks in the hybrid placement (`hybrid_chunk_ids`)."""

    def __init__(self, a2a: Group, ring: Group, backend: str = "auto"):
        super().__init__()
        self.a2a, self.ring, self.backend_name = a2a, ring, backend
        self._backend = None

    def forward(self, q, k, v, scale: float, docs=None) -> Tensor:
        if self._backend is None:
            self._backend = get_backend(self.backend_name, q.device)
        out, lse = hybrid_attention_with_lse(q, k, v, scale, self.a2a, self.ring, self._backend, docs)
        note_head_group_lse(self, lse, self.a2a)
        return out

    def extra_repr(self) -> str:
        return f"backend={self.backend_name}, cp_a2a={self.a2a.size}, cp_ring={self.ring.size}"


class HybridLatentRingAttention(nn.Module):
    """MLA's latent ring under hybrid cp (parallel.mla_ring = "latent"), drop-in for LatentRingAttention:
    (q (B,S,H,Dn+Dr), c (B,S,Ckv), k_r (B,S,Dr), scale, mla) -> (B,S,H,Dv), S in the hybrid placement. q goes
    through the all-to-all (head group a); the latent c and k_r, shared by every head, are all-gathered over
    "cp_a2a" (gradients reduce-scattered back); the latent ring (latent_ring.py) runs over "cp_ring" with the
    rows of W_UKV of head group a, so each rank up-projects only its heads (W_UKV's gradient: those rows here,
    the rest from the other a2a ranks, summed over "dp_cp" as for every dense weight)."""

    def __init__(self, a2a: Group, ring: Group, backend: str = "auto"):
        super().__init__()
        self.a2a, self.ring, self.backend_name = a2a, ring, backend
        self._backend = None

    def forward(self, q: Tensor, c: Tensor, k_r: Tensor, scale: float, mla, docs=None) -> Tensor:
        from moe_lc.parallel.cp.latent_ring import LatentBlocks

        if self._backend is None:
            self._backend = get_backend(self.backend_name, q.device)
        A, a = self.a2a.size, self.a2a.rank
        heads = mla.n_heads // A
        rows = heads * (mla.nope_dim + mla.v_dim)  # W_UKV's rows are head-major: (h, Dn + Dv)
        w = mla.wkv_b.weight[a * rows:(a + 1) * rows]
        codec = LatentBlocks(mla.wkv_b.gemms, heads, mla.nope_dim, mla.v_dim)
        ring = P2PRing(self.ring) if self.ring.size > 1 else LoopbackRing(0, 1)
        q2 = _SeqToHeads.apply(q, self.a2a)
        c2, kr2 = _GatherSeq.apply(c, self.a2a), _GatherSeq.apply(k_r, self.a2a)
        out2, lse = RingAttentionFunction.apply(q2, float(scale), ring, self._backend, "zigzag", codec, docs, c2, kr2, w)
        note_head_group_lse(self, lse, self.a2a)
        return _HeadsToSeq.apply(out2, self.a2a)

    def extra_repr(self) -> str:
        return f"backend={self.backend_name}, cp_a2a={self.a2a.size}, cp_ring={self.ring.size}, latent"


def hybrid_context_parallel_plan(model: nn.Module, dims: ParallelDims, plan, latent: tuple = ()) -> None:
    """Plan every LocalAttention core swapped for HybridRingAttention over dims' "cp_a2a" and "cp_ring" groups,
    or HybridLatentRingAttention for a module type in `latent` (MLA with parallel.mla_ring = "latent")
    (parallel/layer_plan.py calls it instead of cp/ring.py's `context_parallel_plan` when cp_a2a > 1; the rest
    of context parallelism, per token, is the ring's: see there)."""
    for module in model.modules():
        if isinstance(getattr(module, "core", None), LocalAttention):
            core = HybridLatentRingAttention if type(module) in latent else HybridRingAttention
            plan.set(module, core=core(dims["cp_a2a"], dims["cp_ring"], module.core.backend_name))
