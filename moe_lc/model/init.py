"""Parameter initialization that depends only on (seed, parameter name): the same values on any device,
dtype and layout, so a parallel run starts exactly where a single device would.

Rules (`init_rules`): RMSNorm and LayerNorm weights 1 (and the parameters a module names in `init_ones`: mHC's
gating factors), biases 0 (and those a module names in `init_zeros`: DeepSeek-V4's attention sinks and
compressor position biases), every other weight Normal(0, std) with the output
projections (wo, w2) scaled by 1/sqrt(2 L), GPT-2 style. Normal values are drawn on the CPU in fp32
from a generator seeded by (seed, name) over the *full* (single-device) tensor, row after row.

`normal_rows` streams that draw in row chunks, so a rank can keep only its slice of a large
parameter (an expert block, a vocabulary shard) without ever holding the full tensor: torch's CPU
normal fill draws its uniforms in order and transforms them in groups of 16 (the last 16 redone at
the end), so consecutive calls on one generator give the one-call values whenever each chunk but
the last holds a multiple of 16 elements and the last ends where the tensor ends
(tests/test_model.py checks this against the one-call draw).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from moe_lc.model.norm import RMSNorm
from moe_lc.ops.linear import GroupedLinear, Linear

CHUNK_ELEMS = 1 << 24  # 64 MiB of fp32 per drawn chunk


def param_seed(seed: int, name: str) -> int:
    """Each parameter's init stream depends only on (seed, its name): layout-independent init."""
    return zlib.crc32(f"{seed}:{name}".encode())


@dataclass(frozen=True)
class InitRule:
    kind: str  # "ones" | "zeros" | "normal"
    std: float = 0.0


def init_rules(model: nn.Module, std: float, n_layers: int) -> dict[str, InitRule]:
    """{parameter name: how it is initialized} (see the module docstring)."""
    out_std = std / (2 * n_layers) ** 0.5
    rules, seen = {}, set()
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied parameter (the head's weight is embed.weight): its first name only
                continue
            seen.add(id(param))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, (RMSNorm, nn.LayerNorm)) or p_name in getattr(module, "init_ones", ()):
                rules[name] = InitRule("ones")
            elif p_name == "bias" or p_name in getattr(module, "init_zeros", ()):
                rules[name] = InitRule("zeros")
            else:
                is_out = isinstance(module, (Linear, GroupedLinear)) and mod_name.rsplit(".", 1)[-1] in ("wo", "w2")
                rules[name] = InitRule("normal", out_std if is_out else std)
    return rules


def normal_rows(shape: tuple[int, ...], seed: int, name: str, chunk_elems: int = CHUNK_ELEMS
                ) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, fp32 rows) chunks of the full tensor's seeded standard-normal draw, in order."""
    g = torch.Generator().manual_seed(param_seed(seed, name))
    shape = tuple(shape)
    if len(shape) == 0 or math.prod(shape) < 16 or len(shape) == 1:
        yield 0, torch.randn(shape, generator=g)  # small or 1-D: one draw (chunking buys nothing)
        return
    rows, row_elems = shape[0], math.prod(shape[1:])
    step = max(chunk_elems // row_elems, 1)
    step = -(-step // (16 // math.gcd(row_elems, 16))) * (16 // math.gcd(row_elems, 16))  # 16 | step*row_elems
    start = 0
    while start < rows:
        stop = rows if rows - start <= step or (rows - start - step) * row_elems < 16 else start + step
        yield start, torch.randn((stop - start, *shape[1:]), generator=g)
        start = stop


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float, n_layers: int) -> None:
    """Initialize every parameter of a single-device model in place (full tensors)."""
    params = dict(model.named_parameters())
    for name, rule in init_rules(model, std, n_layers).items():
        param = params[name]
        if rule.kind == "normal":
            param.copy_(torch.cat([rows for _, rows in normal_rows(param.shape, seed, name)]) * rule.std)
        else:
            param.fill_(1.0 if rule.kind == "ones" else 0.0)


def cast_params_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast parameters only (model.to(dtype) would also cast the fp32 router bias and RoPE tables)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def init_buffers(model: nn.Module) -> None:
    """(Re)compute every buffer of a model whose storage was allocated empty (built on the meta device)."""
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
