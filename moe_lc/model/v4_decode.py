"""Decoding with DeepSeek-V4's own caches (the "v4" kind's `decode`, moe_lc/model/decode.py): per layer, what the
next tokens read, and nothing that grows faster than the compressed entries.

Legend: B batch, n tokens fed in one call (c of them in one query chunk), d head dim (key = value), H heads,
W sliding window, m tokens per compressed entry, N entries made so far, E / G the indexer's head dim / heads,
k index_topk, D model dim.

What a layer keeps (`V4LayerCache`; transformers src/transformers/models/deepseek_v4/modeling_deepseek_v4.py,
DeepseekV4HCACache / DeepseekV4CSACache hold the same things):
  window     (B, <= W-1, d)   the last W-1 roped, normalized KV rows: a query sees itself and the W-1 before it
  entries    (B, N, d)        CSA / HCA: the compressed entries made so far (append-only; entry w holds tokens
                              w m .. (w+1) m - 1, so it never changes once made)
  pending    (B, < m, 2 c d)  each compressor's partial window: wkv_gate's rows (kv | gate logits, before the
                              position bias) of the tokens after the last complete window
  prev_a     (B, m, d) x 2    CSA's overlap: the last complete window's Ca rows and their gate logits (entry w
                              pools window w-1's Ca with window w's Cb)
  index keys (B, N, E)        CSA: the indexer's own compressed keys, with its own pending rows and prev_a
A call with n tokens (a decode step, n = 1; a teacher-forced answer; the prompt itself, from an empty cache)
projects them, closes the windows they complete (v4_compressor.gated_pool on the same slots, in the same order,
as the full forward) and attends in query chunks of c = W: each query over its window rows (cache + the new
rows before it), its readable entries (HCA: every complete one; CSA: the indexer's top-k of the N, gathered) and
the sink. Per token and layer that is O(W + k) for the attention and O(N) for the indexer's scores: never O(T).

Bytes a sequence holds per layer, V4-Flash's shapes (d = 512, E = 128, W = 128, m = 4 / 128), bf16:
  sliding_attention              127 KiB fixed (127 rows of d), nothing per token
  compressed_sparse_attention    320 B per token (256 entries + 64 index keys) + 127 KiB window
                                 + < 25 KiB partial windows and Ca rows (both compressors)
  heavily_compressed_attention   8 B per token + 127 KiB window + < 254 KiB partial window (127 rows of 2 d)
against 2 d = 1 KiB per token for an uncompressed shared-KV cache (and MLA's (512 + 64) 2 = 1152 B). Flash's 43
layers (2 window-only, 21 CSA, 20 HCA) hold 7.2 GB for a 1M-token (2^20) sequence, against 46 GB uncompressed.
transformers' caches hold the same tensors (its CSA overlap gate logits in fp32 after the bias); its decode
attends every compressed entry of a CSA layer under a mask, where this one gathers the k picked.

Rewinding (KVCache.rewind): the entries are append-only, and every other piece is replaced, not written in
place, so the state at the prompt's end (`mark`, taken by decode.prefill) is a handful of references: a
cache rewinds to that length (a teacher-forced answer, then generation from the same prompt), to no other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from moe_lc.model.v4_attention import unweighted_rms_norm
from moe_lc.model.v4_compressor import gated_pool, visible_entries
from moe_lc.model.v4_rope import apply_tail_rope


@dataclass
class CompressorState:
    """One compressor's cache: `entries` (B, capacity // m, width) preallocated, the first `count` made;
    `pending` (B, r < m, 2 c width) its partial window; CSA: `prev_kv`, `prev_gate` (B, m, width), the last
    complete window's Ca rows and gate logits (None before the first)."""

    entries: torch.Tensor
    pending: torch.Tensor
    count: int = 0
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None

    def made(self) -> torch.Tensor:
        return self.entries[:, :self.count]


@dataclass
class V4LayerCache:
    """A V4 layer's cache (module docstring): `window` (B, <= W-1, d); `compressor` / `index_keys`: the
    CompressorState of its compressor and its indexer's (None where the layer has none); `length` tokens seen."""

    window: torch.Tensor
    compressor: CompressorState | None
    index_keys: CompressorState | None
    length: int = 0
    saved: tuple | None = field(default=None, repr=False)

    def _state(self) -> tuple:
        return (self.length, self.window, *(replace(s) if s is not None else None
                                            for s in (self.compressor, self.index_keys)))

    def mark(self) -> None:
        """Remember this state (the prompt's end) to rewind to: references only (module docstring)."""
        self.saved = self._state()

    def rewind(self, length: int) -> None:
        if length == self.length:
            return
        if self.saved is None or self.saved[0] != length:
            mark = "no mark" if self.saved is None else f"its mark at {self.saved[0]}"
            raise ValueError(f"a DeepSeek-V4 cache of {self.length} tokens rewinds only to the end of its prompt "
                             f"({mark}), not to {length}: its window and partial windows before are gone")
        self.length, self.window, self.compressor, self.index_keys = self.saved
        self.saved = self._state()  # copies again: what runs next must not advance the mark's counts


def _compressor_state(comp, batch: int, capacity: int, like: torch.Tensor) -> CompressorState:
    rows = 2 * (2 if comp.overlap else 1) * comp.entry_dim  # wkv_gate's output: kv and gate logits, c d each
    entries = like.new_zeros(batch, capacity // comp.rate, comp.entry_dim)
    return CompressorState(entries, like.new_zeros(batch, 0, rows))


def compress_rows(comp, state: CompressorState, x_BnD: torch.Tensor, rope) -> None:
    """Feed n new rows to `comp` (a v4_compressor.Compressor): its projections join the partial window, and every
    window they complete becomes an entry, pooled and roped exactly as Compressor.forward pools it."""
    m, d = comp.rate, comp.entry_dim
    rows = torch.cat([state.pending, comp.wkv_gate(x_BnD)], dim=1)  # (B, r + n, 2 c d): [kv | gate] per row
    B, k = rows.shape[0], rows.shape[1] // m
    state.pending = rows[:, k * m:].clone()  # a copy: a view would keep every row of a prompt alive
    if k == 0:
        return
    windows = rows[:, :k * m].view(B, k, m, -1)
    if comp.overlap and state.prev_kv is not None:  # window w-1's Ca for entry w; its Cb and entry are dropped
        z = torch.zeros_like(state.prev_kv)
        windows = torch.cat([torch.cat([state.prev_kv, z, state.prev_gate, z], dim=-1)[:, None], windows], dim=1)
    kv, gate = windows.chunk(2, dim=-1)
    pooled = gated_pool(kv, gate + comp.position_bias, m, comp.overlap)[:, -k:]
    if comp.overlap:
        state.prev_kv, state.prev_gate = kv[:, -1, :, :d].clone(), gate[:, -1, :, :d].clone()
    cos, sin = rope(torch.arange(state.count, state.count + k, device=rows.device) * m)
    entries = comp.run_region(apply_tail_rope, comp.kv_norm(pooled).view(B, k, 1, d), cos, sin).view(B, k, d)
    state.entries[:, state.count:state.count + k] = entries
    state.count += k


def sink_attention_rows(q, keys, key_seen, entries, entry_seen, scale: float, sinks) -> torch.Tensor:
    """One softmax per query over its window keys, entries and sink (v4_core.sink_attention's logits, for c
    queries against explicit keys). q (B, c, H, d); keys (B, L, d), key_seen (c, L) bool; entries (B, K, d)
    shared or (B, c, K, d) per query, entry_seen (B, c, K) bool, or both None; sinks (H,) or None -> (B, c, H, d)."""
    B, c, H, _ = q.shape
    qf = q.float()
    s_w = torch.einsum("bchd,bld->bchl", qf, keys.float()) * scale
    parts = [s_w.masked_fill(~key_seen[None, :, None, :], float("-inf"))]
    per_query = entries is not None and entries.dim() == 4
    if entries is not None:
        s_e = torch.einsum("bchd,bckd->bchk" if per_query else "bchd,bkd->bchk", qf, entries.float()) * scale
        parts.append(s_e.masked_fill(~entry_seen[:, :, None, :], float("-inf")))
    if sinks is not None:
        parts.append(sinks.float().view(1, 1, H, 1).expand(B, c, H, 1))
    p = torch.cat(parts, dim=-1).softmax(dim=-1)
    L = keys.shape[1]
    out = torch.einsum("bchl,bld->bchd", p[..., :L], keys.float())
    if entries is not None:
        K = entries.shape[-2]
        out = out + torch.einsum("bchk,bckd->bchd" if per_query else "bchk,bkd->bchd", p[..., L:L + K], entries.float())
    return out.to(q.dtype)


def readable_entries(attn, cache: V4LayerCache, x_BcD, c_q, positions):
    """The entries queries at `positions` (c,) read -> (entries, seen) for sink_attention_rows, or (None, None):
    HCA every complete one (B, N, d); CSA the indexer's top-k gathered per query (B, c, k, d), -1 slots unseen."""
    if cache.compressor is None:
        return None, None
    B = x_BcD.shape[0]
    made = cache.compressor.made()
    if attn.indexer is None:
        ready = visible_entries(positions, attn.compressor.rate)  # (c,)
        seen = torch.arange(made.shape[1], device=made.device) < ready[:, None]
        return made, seen.expand(B, -1, -1)
    ix, keys = attn.indexer, cache.index_keys.made()
    scores = ix.scores_over(keys, x_BcD, c_q, positions, attn.rope, ix.seen(positions, keys.shape[1], B))
    picked = ix.pick(scores, positions)  # (B, c, k'), -1: an empty slot
    rows = torch.arange(B, device=made.device)[:, None, None]
    return made[rows, picked.clamp(min=0)], picked >= 0


class V4Decode:
    """The "v4" kind's decode (moe_lc/model/decode.py): the kind owns its layer cache (`new_layer`), and the prompt
    is a `step` from an empty one. Called with decode.py's (cos, sin) = model.rope(positions) = (positions,
    positions) (v4_rope.PositionsOnly)."""

    @staticmethod
    def new_layer(attn, batch: int, capacity: int, like: torch.Tensor) -> V4LayerCache:
        """An empty cache for `batch` sequences of up to `capacity` tokens, in `like`'s dtype and device."""
        comp = _compressor_state(attn.compressor, batch, capacity, like) if attn.compressor is not None else None
        index = _compressor_state(attn.indexer.compressor, batch, capacity, like) if attn.indexer is not None else None
        return V4LayerCache(like.new_zeros(batch, 0, attn.head_dim), comp, index)

    @staticmethod
    def step(attn, x_BnD: torch.Tensor, positions: torch.Tensor, _positions, cache: V4LayerCache,
             start: int) -> torch.Tensor:
        """n tokens at positions start .. start+n-1 (the layer's normalized input x (B, n, D)) after the cached
        ones -> the layer's output (B, n, D); the cache advanced past them (module docstring)."""
        if start != cache.length:
            raise ValueError(f"a V4 layer cache holding {cache.length} tokens was fed tokens from position {start}")
        B, n, _ = x_BnD.shape
        W, d = attn.window, attn.head_dim
        c_q, kv = attn.wa(x_BnD).split([attn.q_lora_rank, d], dim=-1)
        c_q = attn.q_norm(c_q)
        cos, sin = attn.rope(positions)
        q = apply_tail_rope(unweighted_rms_norm(attn.wq_b(c_q).view(B, n, attn.n_heads, d), attn.eps), cos, sin)
        kv = apply_tail_rope(attn.kv_norm(kv).view(B, n, 1, d), cos, sin).view(B, n, d)
        if cache.compressor is not None:  # entries first: a query reads those its own token completes
            compress_rows(attn.compressor, cache.compressor, x_BnD, attn.rope)
        if cache.index_keys is not None:
            compress_rows(attn.indexer.compressor, cache.index_keys, x_BnD, attn.rope)
        held = cache.window.shape[1]
        rows = torch.cat([cache.window, kv], dim=1)  # row j at position start - held + j
        row_pos = torch.arange(start - held, start + n, device=x_BnD.device)
        outs = []
        for a in range(0, n, W):  # a chunk's queries read at most the W-1 rows before it
            b = min(a + W, n)
            lo = max(0, held + a - (W - 1))
            pos, keys_pos = positions[a:b], row_pos[lo:held + b]
            key_seen = (keys_pos[None, :] <= pos[:, None]) & (keys_pos[None, :] > pos[:, None] - W)
            entries, entry_seen = readable_entries(attn, cache, x_BnD[:, a:b], c_q[:, a:b], pos)
            outs.append(sink_attention_rows(q[:, a:b], rows[:, lo:held + b], key_seen, entries, entry_seen,
                                            attn.softmax_scale, attn.sinks))
        cache.window = rows[:, rows.shape[1] - min(W - 1, rows.shape[1]):].clone()  # not a view of every row
        cache.length = start + n
        o = apply_tail_rope(torch.cat(outs, dim=1), cos, -sin)  # the value's rotation undone
        return attn.out_proj(attn.wo, lambda: attn.grouped_out(o))
