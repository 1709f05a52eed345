"""Saved-tensor plumbing shared by the plug-ins that change what backward keeps (recomputation,
moe_lc/model/recompute.py; FP8 activation caching, moe_lc/model/fp8_cache.py): autograd's
saved-tensor hooks, nested so that each handles only the tensors it owns and hands the rest to the
hooks around it (an outer checkpoint, the memory tools)."""

from __future__ import annotations

import torch


def enclosing_hooks():
    """The saved-tensor hooks in force here (pack, unpack), or None (torch keeps them on a stack)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def recompute_from(source, output, remake, consumer, *args):
    """consumer(output, *args), where any copy of `output` the consumer's autograd saves is dropped
    and rebuilt as remake(source) in backward (saved-tensor hooks). `output` must be remake(source).
    Several at once: `source` a tuple (remake(*source)), `output` a tuple that remake returns, whose
    tensors are passed to the consumer in order; remake runs once per backward."""
    many = isinstance(output, tuple)
    sources, outputs = (source, output) if many else ((source,), (output,))
    # the storages' identity, not their data_ptr: on the meta device (the dry run) every data_ptr is 0
    storages = {t.untyped_storage()._cdata: i for i, t in enumerate(outputs)}
    remade = []
    # what the consumer saves besides the outputs goes to the hooks around us (an outer checkpoint, a
    # memory measurement), as if these hooks were not here
    outer = enclosing_hooks()

    def pack(t):
        i = storages.get(t.untyped_storage()._cdata) if isinstance(t, torch.Tensor) else None
        if i is None:
            return t if outer is None else ("outer", outer[0](t))
        return ("recompute", i, t.shape, t.stride(), t.storage_offset())

    def unpack(packed):
        if isinstance(packed, tuple) and packed and packed[0] == "recompute":
            _, i, shape, stride, offset = packed
            if not remade:
                with torch.no_grad():
                    again = remake(*sources)
                remade.extend(again if many else (again,))
            return remade[i].as_strided(shape, stride, offset)
        if isinstance(packed, tuple) and packed and packed[0] == "outer":
            return outer[1](packed[1])
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(*outputs, *args)
