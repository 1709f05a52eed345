"""Meta kernels, remembered: what makes a traced step (tools/dry_run/trace.py) fast where it repeats itself.

A meta op's outputs depend only on its inputs' metadata and its other arguments, and many meta kernels
run in Python (torch._refs, torch._prims: an elementwise op costs milliseconds), while a traced step
repeats its shapes: every layer alike, a ring's cp - 1 steps, every micro-batch. The 128K recipe's plan
(cp 32) took twice as long without this.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def _meta_tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor) and x.device.type == "meta"]


class MetaKernels:
    """`made(func, args, kwargs)`: func's outputs. An op that makes fresh tensors (no aliasing, no writes,
    Tensor returns) from meta tensors only runs once per (op, inputs' shape, stride, dtype and offset,
    other arguments with their types); a repeat gets new empty tensors of its outputs' shapes, strides
    and dtypes, checked the first time to be what empty_strided makes (else it runs every time).
    Process-wide: a meta kernel's answer does not change."""

    seen: dict = {}  # key -> [(shape, stride, dtype)] per output, or None: run it every time
    fresh: dict = {}  # op -> whether its schema makes fresh tensors

    @classmethod
    def made(cls, func, args, kwargs):
        key = cls._key(func, args, kwargs) if cls._makes_fresh(func) else None
        specs = cls.seen.get(key) if key is not None else None
        if specs is not None:
            outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs]
            return outs[0] if len(outs) == 1 else tuple(outs)
        out = func(*args, **kwargs)
        if key is not None and key not in cls.seen:
            cls.seen[key] = cls._specs(out, args, kwargs)
        return out

    @classmethod
    def _makes_fresh(cls, func) -> bool:
        if func not in cls.fresh:
            schema = func._schema
            cls.fresh[func] = (not schema.is_mutable and len(schema.returns) > 0
                               and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns))
        return cls.fresh[func]

    @staticmethod
    def _key(func, args, kwargs):
        """(func, every argument with meta tensors as their metadata), or None where a value could matter
        (a tensor not on meta) or an argument is not hashable."""
        def meta(x):
            if isinstance(x, torch.Tensor):
                if x.device.type != "meta":
                    raise TypeError
                return (x.shape, x.stride(), x.dtype, x.storage_offset())
            if isinstance(x, (list, tuple)):
                return tuple(meta(y) for y in x)
            hash(x)
            return type(x), x  # (1 and 1.0 promote differently)

        try:
            return (func, meta(args), tuple((k, meta(v)) for k, v in sorted(kwargs.items())))
        except TypeError:
            return None

    @staticmethod
    def _specs(out, args, kwargs):
        """The outputs' (shape, stride, dtype), if each is a fresh meta tensor as empty_strided makes it."""
        outs = list(out) if isinstance(out, tuple) else [out]
        inputs = {t.untyped_storage()._cdata for t in _meta_tensors((args, kwargs))}
        storages = [t.untyped_storage() for t in outs if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        if len(storages) != len(outs) or len({st._cdata for st in storages} | inputs) != len(outs) + len(inputs):
            return None
        specs = [(t.shape, t.stride(), t.dtype) for t in outs]
        made = [torch.empty_strided(*spec[:2], dtype=spec[2], device="meta") for spec in specs]
        same = all(t.storage_offset() == 0 and st.nbytes() == m.untyped_storage().nbytes()
                   for t, st, m in zip(outs, storages, made))
        return specs if same else None
