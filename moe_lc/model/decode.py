"""Incremental decoding: a KV cache for GQA, MLA's latent cache, the prompt's prefill (also under CP),
and greedy generation, on a built `Transformer` (the eval side: no gradients, no pipeline, no TP/EP).

Legend: B batch, S prompt length, T tokens cached so far, n tokens fed in one call, H query heads, J
key/value heads (G = H // J queries per kv head), Dh GQA head dim, C kv_lora_rank (MLA's latent), Dn /
Dr / Dv MLA's nope / rope / value head dims, D model dim, V vocabulary.

What a layer caches, and how it attends over its cache, is its attention kind's `decode`
(moe_lc/config/attention_kinds.py):
  GQA  k, v (B, T, J, Dh): the roped keys and the values, as the core saw them (model/attention.py
       `GQADecode`).
  MLA  c (B, T, C): the normalized latent; k_r (B, T, Dr): the shared key's RoPE part, roped; a step
       attends over them in DeepSeek-V3's "absorbed" form (model/mla.py `MLADecode`).
  V4   its own layer cache (`new_layer`): the window's last W-1 rows, the compressed entries, the compressors'
       partial windows, CSA's indexer keys; the prompt is a step from an empty cache
       (model/v4_decode.py `V4Decode`).

The residual stream and the routing are the model's own too: the embedding widened into the stream
(`model.stream.widen`: mHC's hc_mult copies), each sublayer read from it and written back by its block's
residual (`attn_res` / `ffn_res`: plain h + f(norm(h)), or mHC's maps), the stream read out by
`model.stream_head` (mHC's HyperHead) before the final norm; an MoE layer gets the new tokens' ids (a
hash-routed layer routes by them).

Every piece of the model's math is the module's own: embedding, norms, projections, the rope tables
(`model.rope`), `out_proj`, the FFN / MoE modules and the head. Only the attention over the cache is
the kind's decode code (a masked softmax in fp32: n new queries against T cached keys, which no backend
of ops/attention.py takes, their causal mask being top-left aligned for S_q == S_k only).

Prefill runs each block's attention through the module's own core seam, so under context parallelism
the prompt goes through the zig-zag ring exactly as in training (GQA's `core`, MLA's `attend`: the
latent ring). How the prompt is laid out comes from outside, as the model never imports parallel code:
a model wrapper with `shard(tokens) -> (local tokens, their positions)` and `gather(t, S)` (eval's
`ContextParallelLM`: zig-zag shards, `zigzag_unshard`) is used as the layout; a plain model is one
`WholeSequence`. The per-rank zig-zag shards of K/V (or of the latents) are gathered once after the
prompt (one all-gather per cached tensor and layer), the padding that made the prompt divisible by
2 cp is cut off, and from then on every rank decodes identically on the full cache, with no further
communication. That keeps the per-token work replicated (cp ranks do the same
decode) and the cache unsharded (each rank holds the whole prompt's cache); decoding is memory-bound
and short next to a 128K prompt, so the prompt is what the ring is for. A kind that keeps its own cache
(V4) runs the whole prompt on every rank instead, in query chunks of its window (model/v4_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_lc.config.attention_kinds import kind_of_module, load
from moe_lc.model.moe import MoE


@dataclass
class LayerCache:
    """One attention layer's cache: preallocated (B, capacity, ...) buffers, the first `length` rows valid.
    GQA: ("k", "v"); MLA: ("c", "k_r")."""

    buffers: dict[str, torch.Tensor]

    def write(self, start: int, **values: torch.Tensor) -> None:
        for name, value in values.items():
            self.buffers[name][:, start:start + value.shape[1]] = value

    def read(self, length: int) -> dict[str, torch.Tensor]:
        return {name: buf[:, :length] for name, buf in self.buffers.items()}


@dataclass
class KVCache:
    """Every layer's cache (by block name) and how many tokens it holds. `rewind(n)` forgets all but the
    first n tokens (teacher-forced scoring of an answer, then generation from the same prompt)."""

    layers: dict[str, LayerCache]
    capacity: int
    length: int = 0
    gathered_from_cp: int = field(default=1)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} tokens to {length}")
        for layer in self.layers.values():  # a kind's own layer cache (V4's) rewinds itself
            if hasattr(layer, "rewind"):
                layer.rewind(length)
        self.length = length


class WholeSequence:
    """The layout of a prompt on one process: every token here, positions 0 .. S-1."""

    parts = 1

    def shard(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens_BS, torch.arange(tokens_BS.shape[1], device=tokens_BS.device)

    def gather(self, t_BS: torch.Tensor, length: int) -> torch.Tensor:
        return t_BS


def unwrap(model) -> tuple[torch.nn.Module, object]:
    """(the Transformer, the prompt's layout) of a model `eval.model_io.load_model` returned: a wrapper
    with `shard` / `gather` (ContextParallelLM) is its own layout around `.model`."""
    if hasattr(model, "shard") and hasattr(model, "gather") and hasattr(model, "model"):
        return model.model, model
    return model, WholeSequence()


def new_cache(model, batch: int, capacity: int) -> KVCache:
    """Empty buffers for `batch` sequences of up to `capacity` tokens, in the model's dtype and device."""
    model, _ = unwrap(model)
    p = next(model.parameters())
    layers = {}
    for name, block in model.layers.items():
        kind = decoder(block.attn)
        if hasattr(kind, "new_layer"):  # the kind keeps its own layer cache (V4)
            layers[name] = kind.new_layer(block.attn, batch, capacity, p)
            continue
        shapes = kind.shapes(block.attn)
        layers[name] = LayerCache({k: torch.zeros(batch, capacity, *s, dtype=p.dtype, device=p.device)
                                   for k, s in shapes.items()})
    return KVCache(layers, capacity)


def decoder(attn):
    """The decode cache of `attn`'s attention kind: shapes(attn), prefill(attn, x, cos, sin) -> (out, {cached
    name: (B, S, ...)}), step(attn, x, cos, sin, cache, start) -> out (its docstrings in the kind's file); or, a
    kind that keeps its own layer cache, new_layer(attn, batch, capacity, like) and step (the prompt a step at 0)."""
    kind = kind_of_module(attn)
    if kind is None:
        raise TypeError(f"no cache layout for attention module {type(attn).__name__}")
    return load(kind.decode)


def _logits(model, h) -> torch.Tensor:
    """The stream h (B, n, D) or mHC's (B, n, N, D) -> fp32 logits (B, n, V)."""
    if model.stream_head is not None:
        h = model.stream_head(h)
    return model.head(model.norm(h)).float()


def _embed(model, tokens_Bn: torch.Tensor) -> torch.Tensor:
    """Token ids -> the residual stream (B, n, D), or mHC's hc_mult copies (B, n, N, D)."""
    return model.stream.widen(model.cfg, model.embed(tokens_Bn))


def _block(block, h, attend, tokens_Bn: torch.Tensor):
    """One block on the stream h: attention (`attend(x)` (B, n, D) -> out, the kind's cache path) and the FFN, each
    reading the stream and writing back to it through the block's residual (plain: h + f(norm(h)); mHC: its
    maps); an MoE layer gets the tokens' ids (B, n) (a hash-routed one routes by them)."""
    x, *carried = block.attn_res.split(h)
    h = block.attn_res.merge(h, attend(block.attn_norm(x)), *carried)
    x, *carried = block.ffn_res.split(h)
    x = block.ffn_norm(x)
    out = block.ffn(x, tokens=tokens_Bn) if isinstance(block.ffn, MoE) else block.ffn(x)
    return block.ffn_res.merge(h, out, *carried)


# --------------------------------------------------------------------------- prefill, extend, generate


@torch.no_grad()
def prefill(model, tokens_BS: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the prompt, fill `cache` with its S tokens (from position 0); -> fp32 logits of its last
    position (B, V). Under CP (a `ContextParallelLM`) the prompt runs through the ring and the cache is
    gathered (module docstring)."""
    model, layout = unwrap(model)
    device = next(model.parameters()).device
    S = tokens_BS.shape[1]
    if S > cache.capacity:
        raise ValueError(f"a prompt of {S} tokens does not fit a cache of {cache.capacity}")
    if not all(isinstance(layer, LayerCache) for layer in cache.layers.values()):
        layout = WholeSequence()  # a kind's own cache (V4's) is filled from the whole prompt, on every cp rank
    local_BS, positions = layout.shard(tokens_BS.to(device))
    cos, sin = model.rope(positions)
    h = _embed(model, local_BS)
    kept = {}
    for name, block in model.layers.items():
        kind, layer = decoder(block.attn), cache.layers[name]

        def attend(x, kind=kind, layer=layer, name=name, attn=block.attn):
            if isinstance(layer, LayerCache):
                out, kept[name] = kind.prefill(attn, x, cos, sin)
                return out
            return kind.step(attn, x, cos, sin, layer, 0)  # the prompt: a step from the empty cache

        h = _block(block, h, attend, local_BS)
    for name, held in kept.items():
        cache.layers[name].write(0, **{k: layout.gather(t, S) for k, t in held.items()})
    for layer in cache.layers.values():  # what a kind's own cache rewinds to (V4: the prompt's end)
        if hasattr(layer, "mark"):
            layer.mark()
    h = layout.gather(h, S)
    cache.length, cache.gathered_from_cp = S, layout.parts
    return _logits(model, h[:, -1:])[:, 0]


@torch.no_grad()
def extend(model, tokens_Bn: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Feed n more tokens after the cached ones (causal among themselves); -> fp32 logits (B, n, V)."""
    model, _ = unwrap(model)
    device = next(model.parameters()).device
    tokens_Bn = tokens_Bn.to(device)
    start, n = cache.length, tokens_Bn.shape[1]
    if start + n > cache.capacity:
        raise ValueError(f"{start} cached + {n} new tokens exceed the cache's {cache.capacity}")
    cos, sin = model.rope(torch.arange(start, start + n, device=device))
    h = _embed(model, tokens_Bn)
    for name, block in model.layers.items():
        step, layer = decoder(block.attn).step, cache.layers[name]
        h = _block(block, h, lambda x: step(block.attn, x, cos, sin, layer, start), tokens_Bn)
    cache.length = start + n
    return _logits(model, h)


def _stopped(tokens_Bt: torch.Tensor, stop_ids: tuple[int, ...]) -> torch.Tensor:
    """(B,) bool: the row has produced one of `stop_ids`."""
    if not stop_ids:
        return torch.zeros(tokens_Bt.shape[0], dtype=torch.bool, device=tokens_Bt.device)
    return torch.isin(tokens_Bt, torch.tensor(stop_ids, device=tokens_Bt.device)).any(-1)


@torch.no_grad()
def greedy_from(model, first_logits_BV: torch.Tensor, cache: KVCache, max_new_tokens: int,
                stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """Greedy continuation of the cached prompt whose last logits are `first_logits_BV` -> (B, t) token ids,
    t <= max_new_tokens: stops early once every row has produced a stop id (rows that stopped first keep
    going; callers cut each row at its first stop id)."""
    if max_new_tokens < 1:
        return first_logits_BV.new_zeros(first_logits_BV.shape[0], 0, dtype=torch.long)
    out = [first_logits_BV.argmax(-1)]
    while len(out) < max_new_tokens and not _stopped(torch.stack(out, 1), stop_ids).all():
        out.append(extend(model, out[-1][:, None], cache)[:, -1].argmax(-1))
    return torch.stack(out[:max_new_tokens], 1)


@torch.no_grad()
def generate_greedy(model, prompt_BS: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """Greedy decoding with the cache: prefill once, then one token per step -> (B, t) new token ids."""
    if max_new_tokens < 1:
        return prompt_BS.new_zeros(prompt_BS.shape[0], 0)
    cache = new_cache(model, prompt_BS.shape[0], prompt_BS.shape[1] + max_new_tokens)
    return greedy_from(model, prefill(model, prompt_BS, cache), cache, max_new_tokens, stop_ids)


@torch.no_grad()
def generate_uncached(model, prompt_BS: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """The reference: greedy decoding that runs the whole sequence through `model` for every new token
    (O(t S^2) instead of O(t S)); the cached path must produce the same tokens."""
    device = next(model.parameters()).device
    seq, new = prompt_BS.to(device), []
    while len(new) < max_new_tokens and not (new and _stopped(torch.stack(new, 1), stop_ids).all()):
        new.append(model(seq).float()[:, -1].argmax(-1))
        seq = torch.cat([seq, new[-1][:, None]], 1)
    return torch.stack(new, 1) if new else prompt_BS.new_zeros(prompt_BS.shape[0], 0)
