"""Functions for flex_attention's ``score_mod`` / ``mask_mod`` written against NumPy arrays.

With torch tensors, modifiers use ``torch.where``, ``torch.tanh``, ... and index captured
tensors directly. With NumPy arrays they use these: each works on symbolic arguments (while
fastpe captures the function) and on ordinary numbers and arrays (so the function still runs
by hand). NumPy's own indexing cannot see symbolic indices, so a NumPy array the function
indexes is wrapped once in ``capture``: ``doc = fastpe.mods.capture(doc_id)``, then
``doc[q_idx] == doc[kv_idx]``. See docs/flex-attention.md.
"""

from __future__ import annotations

import numpy as np

from fastpe import _flex_expr


class Captured:
    """A NumPy array that modifiers index with symbolic indices (``capture(array)``). Its
    values are read at every call: changing them in place changes the result, without a
    recompile."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __getitem__(self, idx):
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(item, _flex_expr.Sym) for item in items):
            return _flex_expr.index(self, idx)
        return self.array[idx]

    @property
    def shape(self):
        return self.array.shape

    @property
    def ndim(self):
        return self.array.ndim


def capture(array) -> Captured:
    """Make a NumPy array indexable by a modifier's symbolic indices."""
    array = np.asarray(array)
    return Captured(array)


def _symbolic(*args):
    return any(isinstance(a, _flex_expr.Sym) for a in args)


def where(condition, x, y):
    """``x`` where ``condition`` holds, else ``y`` (np.where)."""
    if _symbolic(condition, x, y):
        return _flex_expr.where(condition, x, y)
    return np.where(condition, x, y)


def _unary(name, numpy_func):
    def func(x):
        if _symbolic(x):
            return _flex_expr.unary(name, x)
        return numpy_func(x)

    func.__name__ = func.__qualname__ = name
    func.__doc__ = f"{name}(x), elementwise."
    return func


def _binary(name, numpy_func):
    def func(x, y):
        if _symbolic(x, y):
            return _flex_expr.binary(name, x, y)
        return numpy_func(x, y)

    func.__name__ = func.__qualname__ = {"min": "minimum", "max": "maximum"}.get(name, name)
    func.__doc__ = f"{func.__name__}(x, y), elementwise."
    return func


tanh = _unary("tanh", np.tanh)
exp = _unary("exp", np.exp)
exp2 = _unary("exp2", np.exp2)
log = _unary("log", np.log)
log2 = _unary("log2", np.log2)
sqrt = _unary("sqrt", np.sqrt)
sin = _unary("sin", np.sin)
cos = _unary("cos", np.cos)
sign = _unary("sign", np.sign)
sigmoid = _unary("sigmoid", lambda x: 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64))))
minimum = _binary("min", np.minimum)
maximum = _binary("max", np.maximum)


def clamp(x, min=None, max=None):  # noqa: A002 - torch.clamp's keyword names
    """x limited to [min, max] (either may be None)."""
    if _symbolic(x, min, max):
        return _flex_expr._clamp(x, min, max)
    return np.clip(x, min, max)


__all__ = [
    "Captured",
    "capture",
    "clamp",
    "cos",
    "exp",
    "exp2",
    "log",
    "log2",
    "maximum",
    "minimum",
    "sigmoid",
    "sign",
    "sin",
    "sqrt",
    "tanh",
    "where",
]
