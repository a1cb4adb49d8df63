"""Plans shared by every layer of one step, for callers that pass the metadata tensors
themselves on each layer's call (``fastpe.flash_attn``, the transformers integrations).

A model runs its layers one after another with the same metadata tensors — the same
``cache_seqlens`` and ``block_table`` objects, or the same ``cu_seqlens`` — so the first layer's
call makes the plan (one device read, one upload) and the others find it here. A plan is found
again only for the very same tensor objects at the same version: torch bumps a tensor's version
on every in-place change (``copy_``, ``+=``, indexed assignment), so updating the metadata in
place for the next step, or passing new tensors, makes a new plan. Only GPU tensors that carry
a version are planned this way; NumPy arrays, CPU tensors and tensors made under
``torch.inference_mode`` (which have no version) are checked on every call, as before.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from collections import OrderedDict

from fastpe import _arrays

_KEPT = 8  # plans kept: one per metadata set a step uses (full and sliding-window layers, ...)
_plans: OrderedDict = OrderedDict()
_lock = threading.Lock()


def _identity(x):
    """What makes a metadata value the same one again: (id, version) of a tensor, the value of
    an int or None; None for a value that cannot be told apart from a changed one."""
    if x is None or isinstance(x, numbers.Integral):
        return ("value", int(x) if x is not None else None)
    if not _arrays.is_tensor(x):
        return None
    try:
        return ("tensor", id(x), x._version)
    except RuntimeError:  # an inference tensor: no version counter
        return None


def step_plan(make, metadata: tuple, shapes: tuple, q):
    """The plan ``make()`` builds for ``metadata`` (the tensors and ints it reads), made once
    and reused while the same tensors at the same version come back with the same ``shapes``
    for a ``q`` on the same GPU; None when the call should check its metadata itself (``q`` not
    on a GPU, host arrays or tensors without a version among the metadata, torch.compile)."""
    import torch

    if not _arrays.on_gpu(q) or torch.compiler.is_compiling():
        return None
    identities = tuple(_identity(x) for x in metadata)
    if None in identities:
        return None
    key = (identities, shapes, q.device)
    tensors = [x for x in metadata if _arrays.is_tensor(x)]
    with _lock:
        entry = _plans.get(key)
        # the very same objects: an id alone may be a freed tensor's, reused
        if entry is not None and all(ref() is x for ref, x in zip(entry[0], tensors, strict=True)):
            _plans.move_to_end(key)
            return entry[1]
    plan = make()
    refs = [weakref.ref(x) for x in tensors]
    with _lock:
        _plans[key] = (refs, plan)
        while len(_plans) > _KEPT:
            _plans.popitem(last=False)
    return plan
