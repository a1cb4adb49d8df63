"""Capture of flex_attention's user functions: each ``score_mod`` / ``mask_mod`` is called once on
symbolic arguments (``Sym``), which record every operation into an expression DAG of ``Node``s.
From that DAG come the float64 NumPy evaluation of the oracle (``evaluate``), the score's
derivative (``derivative``, symbolic), and the Python source of the Numba tile steps
(``numba_statements``). Captured tensors and arrays (indexed by the symbolic indices) become
numbered leaves; their values are read at every call, never compiled in.

Torch functions reach ``Sym`` through ``__torch_function__`` (``torch.where(...)``, ``tensor[q_idx]``
with a ``Sym`` index, ``tensor + sym``); NumPy ufuncs through ``__array_ufunc__``; ``fastpe.mods``
offers the same functions for NumPy users and ``fastpe.mods.capture`` makes a NumPy array
indexable by symbolic indices (NumPy's own indexing cannot be intercepted).
"""

from __future__ import annotations

import math
import threading

import numpy as np


class CaptureError(TypeError):
    """A score_mod / mask_mod uses a construct fastpe cannot compile into its kernels."""


KINDS = ("bool", "int", "float")

ARGS = ("score", "b", "h", "q_idx", "kv_idx")


class Node:
    """One operation of a captured expression. ``op`` names it, ``args`` are Nodes (or, for
    ``const``, the value; for ``cap``, the captured array's number); ``kind`` is the value's
    type: "bool", "int", "float", or "array" for a partly indexed captured array. Structural
    equality and a cached hash, so equal subexpressions are one node."""

    __slots__ = ("op", "args", "kind", "_hash")

    def __init__(self, op, args, kind):
        self.op, self.args, self.kind = op, tuple(args), kind
        self._hash = hash((op, self.args, kind))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (
            isinstance(other, Node)
            and self._hash == other._hash
            and self.op == other.op
            and self.kind == other.kind
            and self.args == other.args
        )

    def __repr__(self):
        return f"{self.op}{self.args}"


def _promote(*kinds):
    return max(kinds, key=KINDS.index)


def const(value) -> Node:
    if isinstance(value, (bool, np.bool_)):
        return Node("const", (bool(value),), "bool")
    if isinstance(value, (int, np.integer)):
        return Node("const", (int(value),), "int")
    return Node("const", (float(value),), "float")


def _dtype_kind(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "bool"
    if dtype.kind in "iu":
        return "int"
    return "float"


# --------------------------------------------------------------------------- tracing state


class _Trace(threading.local):
    arrays: list | None = None  # the captured arrays of the function being traced
    where: str = ""  # "score_mod" / "mask_mod", for errors


_trace = _Trace()


def _captured(obj) -> int:
    """The number of captured array ``obj`` (a torch tensor or NumPy array) in this trace."""
    arrays = _trace.arrays
    for i, known in enumerate(arrays):
        if known is obj:
            return i
    arrays.append(obj)
    return len(arrays) - 1


def _array_of(obj):
    """(array, is_array): ``obj`` unwrapped from ``fastpe.mods.capture`` when wrapped."""
    from fastpe.mods import Captured

    if isinstance(obj, Captured):
        return obj.array, True
    if isinstance(obj, np.ndarray):
        return obj, True
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj, True
    return obj, False


def _torch():
    import sys

    return sys.modules.get("torch")


def _array_dtype(array):
    torch = _torch()
    if torch is not None and isinstance(array, torch.Tensor):
        return {torch.bool: np.bool_}.get(array.dtype) or (
            np.dtype(str(array.dtype).removeprefix("torch."))
            if array.dtype not in (torch.bfloat16, torch.float16)
            else np.dtype(np.float32)
        )
    return array.dtype


def lift(value) -> Node:
    """A Node for an operand: a Sym's node, a constant, or a captured 0-d array."""
    if isinstance(value, Sym):
        if value.node.kind == "array":
            raise CaptureError(
                f"{_trace.where} uses a captured array indexed by fewer indices than it has "
                "dimensions: index every dimension (e.g. bias[h, q_idx - kv_idx])"
            )
        return value.node
    if isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        return const(value)
    array, is_array = _array_of(value)
    if is_array:
        if array.ndim == 0:
            return index(value, ()).node
        raise CaptureError(
            f"{_trace.where} uses a captured array of shape {tuple(array.shape)} whole: "
            "index it with the index arguments (e.g. doc_id[q_idx]) to get one value"
        )
    raise CaptureError(
        f"{_trace.where} uses a {type(value).__name__} value, which fastpe cannot compile: "
        "use numbers, the arguments, captured tensors/arrays indexed by them, and the "
        "functions listed in docs/flex-attention.md"
    )


def index(array_obj, idx) -> Sym:
    """array[idx] with symbolic indices: a captured array read in the kernel."""
    if isinstance(array_obj, Sym):  # a partly indexed captured array indexed further
        base, earlier, ndim = array_obj.node.args[0], array_obj.node.args[1:], None
        ndim = base.args[2]
    else:
        array, _ = _array_of(array_obj)
        number = _captured(array)
        ndim = array.ndim
        base = Node("cap", (number, str(np.dtype(_array_dtype(array))), ndim), "array")
        earlier = ()
    if not isinstance(idx, tuple):
        idx = (idx,)
    nodes = []
    for item in idx:
        if item is None or item is Ellipsis or isinstance(item, slice):
            raise CaptureError(
                f"{_trace.where} indexes a captured array with {item!r}: slices, None and "
                "... are not supported; index each dimension with an integer expression"
            )
        node = lift(item)
        if node.kind != "int":
            raise CaptureError(
                f"{_trace.where} indexes a captured array with a {node.kind} value: indices "
                "must be integer expressions of b, h, q_idx, kv_idx"
            )
        nodes.append(node)
    indices = (*earlier, *nodes)
    if len(indices) > ndim:
        raise CaptureError(
            f"{_trace.where} indexes a captured array of {ndim} dimensions with "
            f"{len(indices)} indices"
        )
    kind = "array" if len(indices) < ndim else _dtype_kind(base.args[1])
    return Sym(Node("index", (base, *indices), kind))


# --------------------------------------------------------------------------- operations


def unary(op, x) -> Sym:
    node = lift(x)
    if op in ("neg", "abs"):
        kind = "int" if node.kind == "bool" else node.kind
    elif op == "not":
        kind = node.kind
    elif op == "sign":
        kind = node.kind if node.kind != "bool" else "int"
    elif op in ("to_float",):
        kind = "float"
    elif op == "to_int":
        kind = "int"
    elif op == "to_bool":
        kind = "bool"
    else:
        kind = "float"
    return Sym(Node(op, (node,), kind))


def binary(op, a, b) -> Sym:
    x, y = lift(a), lift(b)
    if op in ("eq", "ne", "lt", "le", "gt", "ge"):
        kind = "bool"
    elif op in ("and", "or", "xor"):
        if "float" in (x.kind, y.kind):
            raise CaptureError(f"{_trace.where} applies &, | or ^ to a float value")
        kind = "bool" if x.kind == y.kind == "bool" else "int"
    elif op in ("truediv", "pow_float"):
        kind = "float"
    elif op == "pow":
        kind = _promote(x.kind, y.kind, "int")
    elif op in ("min", "max"):
        kind = _promote(x.kind, y.kind)
    else:  # add sub mul floordiv mod
        kind = _promote(x.kind, y.kind, "int")
    return Sym(Node(op, (x, y), kind))


def where(cond, a, b) -> Sym:
    c, x, y = lift(cond), lift(a), lift(b)
    return Sym(Node("where", (c, x, y), _promote(x.kind, y.kind)))


def _clamp(x, low=None, high=None):
    out = x
    if low is not None:
        out = binary("max", out, low)
    if high is not None:
        out = binary("min", out, high)
    return out


_UNARY = {
    "tanh": "tanh",
    "exp": "exp",
    "exp2": "exp2",
    "log": "log",
    "log2": "log2",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "sigmoid": "sigmoid",
    "sin": "sin",
    "cos": "cos",
    "abs": "abs",
    "absolute": "abs",
    "neg": "neg",
    "negative": "neg",
    "__neg__": "neg",
    "__abs__": "abs",
    "sign": "sign",
    "relu": "relu",
    "logical_not": "not",
    "bitwise_not": "not",
    "__invert__": "not",
    "float": "to_float",
    "double": "to_float",
    "half": "to_float",
    "bfloat16": "to_float",
    "int": "to_int",
    "long": "to_int",
    "bool": "to_bool",
}

_BINARY = {
    "add": "add",
    "__add__": "add",
    "sub": "sub",
    "subtract": "sub",
    "__sub__": "sub",
    "mul": "mul",
    "multiply": "mul",
    "__mul__": "mul",
    "div": "truediv",
    "divide": "truediv",
    "true_divide": "truediv",
    "__truediv__": "truediv",
    "floor_divide": "floordiv",
    "__floordiv__": "floordiv",
    "remainder": "mod",
    "__mod__": "mod",
    "pow": "pow",
    "__pow__": "pow",
    "power": "pow",
    "float_power": "pow",
    "minimum": "min",
    "fmin": "min",
    "maximum": "max",
    "fmax": "max",
    "eq": "eq",
    "__eq__": "eq",
    "equal": "eq",
    "ne": "ne",
    "__ne__": "ne",
    "not_equal": "ne",
    "lt": "lt",
    "__lt__": "lt",
    "less": "lt",
    "le": "le",
    "__le__": "le",
    "less_equal": "le",
    "gt": "gt",
    "__gt__": "gt",
    "greater": "gt",
    "ge": "ge",
    "__ge__": "ge",
    "greater_equal": "ge",
    "logical_and": "and",
    "bitwise_and": "and",
    "__and__": "and",
    "logical_or": "or",
    "bitwise_or": "or",
    "__or__": "or",
    "logical_xor": "xor",
    "bitwise_xor": "xor",
    "__xor__": "xor",
}

_REVERSED = {"__radd__": "add", "__rsub__": "sub", "__rmul__": "mul", "__rtruediv__": "truediv",
             "__rfloordiv__": "floordiv", "__rmod__": "mod", "__rpow__": "pow", "__rand__": "and",
             "__ror__": "or", "__rxor__": "xor"}  # fmt: skip

_TYPE_CASTS = {"float": "to_float", "int": "to_int", "bool": "to_bool"}


def _cast_to(x, dtype):
    """x.to(dtype) / x.type(dtype) / astype: by the dtype's family."""
    name = str(dtype).removeprefix("torch.")
    if name.startswith(("float", "bfloat", "half", "double")):
        return unary("to_float", x)
    if name.startswith(("int", "uint", "long")):
        return unary("to_int", x)
    if name == "bool":
        return unary("to_bool", x)
    raise CaptureError(f"{_trace.where} casts to {dtype!r}, which fastpe cannot compile")


def apply(name, args, kwargs):
    """The operation ``name`` (a torch or NumPy function's name) on operands that include a Sym."""
    kwargs = dict(kwargs or {})
    if kwargs.get("out", 0) is None:  # out=None is the default: drop it; any other out refused
        del kwargs["out"]
    if name == "__getitem__":
        return index(args[0], args[1])
    if name == "where" and len(args) == 3:
        return where(*args)
    if name in ("clamp", "clip"):
        low = kwargs.pop("min", args[1] if len(args) > 1 else None)
        high = kwargs.pop("max", args[2] if len(args) > 2 else None)
        return _clamp(args[0], low, high)
    if name in ("to", "type", "astype", "type_as"):
        target = args[1] if len(args) > 1 else kwargs.get("dtype")
        if name == "type_as":
            target = getattr(target, "dtype", target)
        return _cast_to(args[0], target)
    if name in _UNARY and len(args) == 1 and not kwargs:
        return unary(_UNARY[name], args[0])
    if name in _BINARY and len(args) == 2 and not kwargs:
        return binary(_BINARY[name], args[0], args[1])
    if name in _REVERSED and len(args) == 2 and not kwargs:
        return binary(_REVERSED[name], args[1], args[0])
    raise CaptureError(
        f"{_trace.where} calls {name}, which fastpe cannot compile into its kernels; the "
        "supported functions are listed in docs/flex-attention.md (where, tanh, exp, log, "
        "sqrt, sigmoid, abs, minimum, maximum, clamp, casts, and the operators)"
    )


def _refuse(what, instead):
    raise CaptureError(
        f"{_trace.where} uses a symbolic argument {what}; fastpe captures the function once "
        f"on symbolic arguments, so its value is not known: {instead}"
    )


class Sym:
    """A symbolic value inside a traced score_mod / mask_mod."""

    __slots__ = ("node",)
    __array_priority__ = 1000  # NumPy scalars and arrays defer binary operators to us

    def __init__(self, node):
        self.node = node

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<symbolic {self.node.kind}: {self.node!r}>"

    # Python control flow and conversions cannot be captured
    def __bool__(self):
        _refuse(
            "as a Python bool (an if, and, or, not, or a chained comparison such as a < b < c)",
            "use torch.where(cond, x, y) (fastpe.mods.where for NumPy) and &, |, ~ instead",
        )

    def __index__(self):
        _refuse(
            "as a Python integer (range(), a list index, int(), or indexing a NumPy array)",
            "index torch tensors directly, wrap NumPy arrays in fastpe.mods.capture(array)",
        )

    def __int__(self):
        self.__index__()

    def __float__(self):
        _refuse(
            "as a Python float (math.* functions, float())",
            "use torch.tanh / torch.exp / ... (fastpe.mods.tanh ... for NumPy) instead",
        )

    def __array__(self, *args, **kwargs):
        _refuse(
            "as a NumPy array (np.asarray, or indexing a NumPy array)",
            "wrap NumPy arrays you index in fastpe.mods.capture(array)",
        )

    def __iter__(self):
        _refuse("in a loop or unpacking", "write the computation without Python loops")

    def __len__(self):
        _refuse("with len()", "write the computation without it")

    def __getitem__(self, idx):
        if self.node.kind != "array":
            raise CaptureError(f"{_trace.where} indexes a scalar symbolic value")
        return index(self, idx)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        return apply(name, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            raise CaptureError(f"{_trace.where} uses np.{ufunc.__name__}.{method}")
        return apply(ufunc.__name__, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return apply(func.__name__, args, kwargs)

    # methods as torch tensors have them
    def __getattr__(self, name):
        if name in _UNARY:
            return lambda: unary(_UNARY[name], self)
        if name in _BINARY or name in ("clamp", "clip", "to", "type", "astype", "type_as", "where"):
            if name == "where":  # Tensor.where(condition, other)
                return lambda cond, other: where(cond, self, other)
            return lambda *a, **k: apply(name, (self, *a), k)
        raise AttributeError(
            f"{_trace.where}: symbolic values have no attribute {name!r} that fastpe can "
            "compile (see docs/flex-attention.md)"
        )


def _operator(name, op, reverse=False):
    if reverse:
        return lambda self, other: binary(op, other, self)
    return lambda self, other: binary(op, self, other)


for _name, _op in _BINARY.items():
    if _name.startswith("__"):
        setattr(Sym, _name, _operator(_name, _op))
for _name, _op in _REVERSED.items():
    setattr(Sym, _name, _operator(_name, _op, reverse=True))
Sym.__neg__ = lambda self: unary("neg", self)
Sym.__pos__ = lambda self: self
Sym.__abs__ = lambda self: unary("abs", self)
Sym.__invert__ = lambda self: unary("not", self)


# --------------------------------------------------------------------------- capture


class Captured:
    """One captured function: its expression and the arrays it reads (in leaf order)."""

    def __init__(self, node, arrays):
        self.node, self.arrays = node, arrays


def capture(func, role: str) -> Captured:
    """Trace ``func`` (``role``: "score_mod" or "mask_mod") once on symbolic arguments."""
    if not callable(func):
        raise TypeError(f"{role} must be a function; got {type(func).__name__}")
    names = ARGS if role == "score_mod" else ARGS[1:]
    args = [Sym(Node(n, (), "float" if n == "score" else "int")) for n in names]
    saved = _trace.arrays, _trace.where
    _trace.arrays, _trace.where = [], role
    try:
        try:
            result = func(*args)
        except CaptureError:
            raise
        except Exception as error:
            raise CaptureError(
                f"fastpe could not capture {role} {getattr(func, '__name__', func)!r}: calling "
                f"it on symbolic arguments raised {type(error).__name__}: {error}. "
                "docs/flex-attention.md lists what a modifier may use"
            ) from error
        node = lift(result)
        arrays = _trace.arrays
    finally:
        _trace.arrays, _trace.where = saved
    if role == "mask_mod" and node.kind != "bool":
        node = Node("ne", (node, const(0)), "bool")
    if role == "score_mod" and node.kind != "float":
        node = Node("to_float", (node,), "float")
    return Captured(node, arrays)


def nodes_in_order(*roots) -> list[Node]:
    """Every node reachable from ``roots``, each once, operands before their users."""
    seen, order = set(), []

    def visit(node):
        stack = [(node, False)]
        while stack:
            current, done = stack.pop()
            if done:
                if current not in seen:
                    seen.add(current)
                    order.append(current)
                continue
            if current in seen:
                continue
            stack.append((current, True))
            for arg in reversed(current.args):
                if isinstance(arg, Node) and arg not in seen:
                    stack.append((arg, False))

    for root in roots:
        if root is not None:
            visit(root)
    return order


def renumber(captured: Captured, offset: int) -> Node:
    """The expression with its captured arrays numbered from ``offset`` (two functions, one
    kernel argument list)."""
    memo = {}
    for node in nodes_in_order(captured.node):
        if node.op == "cap":
            number, dtype, ndim = node.args
            memo[node] = Node("cap", (number + offset, dtype, ndim), node.kind)
        elif node.op == "const" or not node.args:
            memo[node] = node
        else:
            memo[node] = Node(node.op, tuple(memo.get(a, a) for a in node.args), node.kind)
    return memo[captured.node]


# --------------------------------------------------------------------------- derivative

ZERO, ONE = const(0.0), const(1.0)


def _n(op, *args, kind="float"):
    return Node(op, args, kind)


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return _n("add", a, b)


def _mul(a, b):
    if a is None or b is None:
        return None
    if a == ONE:
        return b
    if b == ONE:
        return a
    return _n("mul", a, b)


SCORE = Node("score", (), "float")


def derivative(root: Node, wrt: Node = SCORE) -> Node | None:
    """∂root/∂wrt as an expression (None: zero), by the chain rule on the DAG. ``wrt`` is the
    score, or one read of a captured array (an ``index`` node: ``gradient_leaves``)."""
    grads: dict[Node, Node | None] = {}
    for node in nodes_in_order(root):
        grads[node] = ONE if node == wrt else _local_derivative(node, grads)
    return grads[root]


def gradient_leaves(root: Node, caps) -> list[tuple[Node, Node]]:
    """(read, ∂root/∂read) of each float read of a captured array numbered in ``caps`` that
    ``root`` depends on differentiably: the gradient of such an array is the sum, over every
    score, of dZ·∂root/∂read scattered to the element the read indexes (``flat_index``)."""
    leaves = []
    for node in nodes_in_order(root):
        if node.op == "index" and node.kind == "float" and node.args[0].args[0] in caps:
            grad = derivative(root, node)
            if grad is not None:
                leaves.append((node, grad))
    return leaves


def trained_reads(root: Node, caps) -> tuple[Node, ...]:
    """The reads of ``gradient_leaves``: what a variant's backward differentiates (a key of its
    generated module)."""
    return tuple(read for read, _ in gradient_leaves(root, caps))


def read_gradient_roots(root: Node, reads) -> dict[str, Node]:
    """What a backward step computes for each of ``reads``: ``dread<e>``, ∂root/∂read e, and
    ``at<e>``, the position of the element it reads (``flat_index``)."""
    roots = {}
    for e, read in enumerate(reads):
        roots[f"dread{e}"] = derivative(root, read)
        roots[f"at{e}"] = flat_index(read)
    return roots


def flat_index(read: Node) -> Node:
    """The C-order position of the element a captured-array read takes (as the kernel reads
    it: negative indices from the end, clamped into the array)."""
    return Node("flat", (read,), "int")


def _local_derivative(node, grads):
    op, args = node.op, node.args
    leaves = ("const", "cap", "index", "score", "b", "h", "q_idx", "kv_idx")
    if node.kind != "float" or op in leaves:
        return None
    d = [grads.get(a) if isinstance(a, Node) else None for a in args]
    if all(x is None for x in d):
        return None
    a = args[0]
    if op == "add":
        return _add(d[0], d[1])
    if op == "sub":
        return _add(d[0], None if d[1] is None else _n("neg", d[1]))
    if op == "mul":
        return _add(_mul(d[0], args[1]), _mul(a, d[1]))
    if op == "truediv":
        b = args[1]
        first = None if d[0] is None else _n("truediv", d[0], b)
        second = None if d[1] is None else _n("neg", _n("truediv", _mul(node, d[1]), b))
        return _add(first, second)
    if op == "neg":
        return _n("neg", d[0])
    if op == "to_float":
        return d[0]
    if op == "where":
        return _n("where", args[0], d[1] or ZERO, d[2] or ZERO)
    if op in ("min", "max"):
        pick = _n("le" if op == "min" else "ge", args[0], args[1], kind="bool")
        return _n("where", pick, d[0] or ZERO, d[1] or ZERO)
    if op == "tanh":
        return _mul(_n("sub", ONE, _n("mul", node, node)), d[0])
    if op == "exp":
        return _mul(node, d[0])
    if op == "exp2":
        return _mul(_n("mul", node, const(math.log(2.0))), d[0])
    if op == "log":
        return _n("truediv", d[0], a)
    if op == "log2":
        return _n("truediv", d[0], _n("mul", a, const(math.log(2.0))))
    if op == "sqrt":
        return _n("truediv", d[0], _n("mul", const(2.0), node))
    if op == "rsqrt":
        return _mul(_n("mul", const(-0.5), _n("truediv", node, a)), d[0])
    if op == "sigmoid":
        return _mul(_n("mul", node, _n("sub", ONE, node)), d[0])
    if op == "sin":
        return _mul(_n("cos", a), d[0])
    if op == "cos":
        return _mul(_n("neg", _n("sin", a)), d[0])
    if op == "abs":
        return _mul(_n("sign", a), d[0])
    if op == "relu":
        return _n("where", _n("gt", a, ZERO, kind="bool"), d[0], ZERO)
    if op == "sign":
        return None
    if op == "pow":
        b = args[1]
        first = None
        if d[0] is not None:
            first = _mul(_n("mul", b, _n("pow", a, _n("sub", b, ONE))), d[0])
        second = None if d[1] is None else _mul(_n("mul", node, _n("log", a)), d[1])
        return _add(first, second)
    if op in ("floordiv", "mod"):
        return None  # piecewise constant in the score (torch gives 0 too)
    raise CaptureError(f"fastpe cannot differentiate {op} with respect to the score")


# --------------------------------------------------------------------------- NumPy evaluation


def evaluate(root: Node, env: dict, arrays: list) -> np.ndarray:
    """The expression over broadcast arrays: env maps "score", "b", "h", "q_idx", "kv_idx" to
    float64 / int64 arrays; ``arrays`` are the captured arrays as NumPy (float64 / int64 /
    bool). Negative indices count from the end, as in NumPy and torch; indices out of range
    raise IndexError."""
    values = {}
    with np.errstate(all="ignore"):
        for node in nodes_in_order(root):
            values[node] = _evaluate_node(node, values, env, arrays)
    return values[root]


_NP_UNARY = {
    "tanh": np.tanh, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
    "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos, "abs": np.abs, "neg": np.negative,
    "sign": np.sign,
}  # fmt: skip
_NP_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
    "floordiv": np.floor_divide, "mod": np.mod, "min": np.minimum, "max": np.maximum,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal, "and": np.bitwise_and, "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}  # fmt: skip


def _as_kind(value, kind):
    return np.asarray(value, {"bool": np.bool_, "int": np.int64, "float": np.float64}[kind])


def _evaluate_node(node, values, env, arrays):
    op, args = node.op, node.args
    if op in ARGS:
        return env[op]
    if op == "const":
        return _as_kind(args[0], node.kind)
    if op == "cap":
        return None
    if op == "index":
        array = arrays[args[0].args[0]]
        idx = tuple(values[a] for a in args[1:])
        return _as_kind(array[idx], node.kind)
    x = [values[a] for a in args]
    if op in _NP_UNARY:
        return _as_kind(_NP_UNARY[op](x[0]), node.kind)
    if op in _NP_BINARY:
        a, b = x
        if op in ("add", "sub", "mul", "min", "max", "floordiv", "mod"):
            a, b = _as_kind(a, node.kind), _as_kind(b, node.kind)
        return _as_kind(_NP_BINARY[op](a, b), node.kind)
    if op == "not":
        return np.logical_not(x[0]) if node.kind == "bool" else np.invert(x[0])
    if op == "where":
        return _as_kind(np.where(x[0], x[1], x[2]), node.kind)
    if op == "pow":
        a, b = _as_kind(x[0], node.kind), _as_kind(x[1], node.kind)
        return np.power(a, b)
    if op == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x[0]))
    if op == "rsqrt":
        return 1.0 / np.sqrt(x[0])
    if op == "relu":
        return np.maximum(x[0], 0.0)
    if op in ("to_float", "to_int", "to_bool"):
        return _as_kind(np.trunc(x[0]) if op == "to_int" else x[0], node.kind)
    raise AssertionError(op)


# --------------------------------------------------------------------------- Numba source

# The ops written alike in the generated Numba and Triton steps (operands as {0}, {1}, {2});
# each target's table below adds the rest.
_COMMON_FORMAT = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "truediv": "({0} / {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})", "and": "({0} & {1})", "or": "({0} | {1})",
    "xor": "({0} ^ {1})", "neg": "(-{0})", "to_bool": "({0} != 0)",
}  # fmt: skip

# Python source of each op for the generated Numba tile step, operands as {0}, {1}, {2}.
# ``_tanh`` / ``_exp`` / ``_sigmoid`` come from kernels/numba/_flex_math.py: vectorisable
# float32-accurate forms when the tile is float32, libm when float64.
_NB_FORMAT = {
    **_COMMON_FORMAT,
    "floordiv": "({0} // {1})", "mod": "({0} % {1})", "pow": "({0} ** {1})",
    "min": "min({0}, {1})", "max": "max({0}, {1})", "abs": "abs({0})",
    "where": "({1} if {0} else {2})",
    "tanh": "_tanh({0}, IS_F32)", "exp": "_exp({0}, IS_F32)", "exp2": "_exp2f({0}, IS_F32)",
    "log": "math.log({0})", "log2": "math.log2({0})", "sqrt": "math.sqrt({0})",
    "rsqrt": "(1.0 / math.sqrt({0}))", "sigmoid": "_sigmoid({0}, IS_F32)",
    "sin": "math.sin({0})", "cos": "math.cos({0})", "sign": "_sign({0})",
    "relu": "max({0}, 0.0)", "to_float": "np.float64({0})", "to_int": "np.int64({0})",
}  # fmt: skip


def _cast_source(text, node_kind, want_kind):
    if node_kind == want_kind or want_kind == "bool":
        return text
    return f"np.float64({text})" if want_kind == "float" else f"np.int64({text})"


_LEAF_LEVEL = {"b": "row", "h": "row", "q_idx": "row", "kv_idx": "key", "score": "cell"}
_NUMPY_DTYPE = {"bool": "np.bool_", "int": "np.int64", "float": "np.float64"}


def _level(levels):
    """Where a node's value changes: "none" (once per call), "row" (per query row), "key" (per
    key: computed once per tile into an array), "cell" (per score)."""
    levels = set(levels) - {"none"}
    if "cell" in levels or {"row", "key"} <= levels:
        return "cell"
    return levels.pop() if levels else "none"


def numba_statements(roots: dict):
    """Python statements computing the expressions in ``roots`` (name -> Node) for one score,
    as four lists: ``setup`` (once per tile, before its loops), ``keys`` (inside a loop over
    the tile's keys ``c``: what depends on kv_idx only, such as ``doc_id[kv_idx]``, stored in
    arrays), ``row`` (per query row: what depends on b, h, q_idx only) and ``cell`` (per score,
    reading the key arrays first). Each root's value is assigned to its name. Captured arrays
    are ``caps[i]``; an index out of range sets ``bad`` (and reads element 0 instead)."""
    order = nodes_in_order(*roots.values())
    names: dict[Node, str] = {}
    level: dict[Node, str] = {}
    lists = {"none": [], "key": [], "row": [], "cell": []}
    stored = []  # key-level values: (name, kind)
    for number, node in enumerate(order):
        op, args = node.op, node.args
        if op in ARGS:
            names[node], level[node] = op, _LEAF_LEVEL[op]
            continue
        if op in ("cap", "const"):
            level[node] = "none"
            if op == "cap":
                names[node] = f"caps[{args[0]}]"
                continue
            value = args[0]
            names[node] = (
                repr(value)
                if not isinstance(value, float) or math.isfinite(value)
                else ("np.inf" if value > 0 else "-np.inf" if value < 0 else "np.nan")
            )
            continue
        level[node] = _level(level[a] for a in args if isinstance(a, Node))
        out = lists[level[node]]
        name = f"t{number}"
        if level[node] == "key":
            stored.append((name, node.kind))
        if op == "flat":
            read = args[0]
            array = names[read.args[0]]
            out.append(f"{name} = 0")
            for axis in range(len(read.args) - 1):
                out.append(f"{name} = {name} * {array}.shape[{axis}] + {names[read]}_{axis}")
        elif op == "index":
            array = names[args[0]]
            parts = []
            for axis, index_node in enumerate(args[1:]):
                ix = f"{name}_{axis}"
                extent = f"{array}.shape[{axis}]"
                out.append(f"{ix} = {names[index_node]}")
                out.append(f"{ix} = {ix} + {extent} if {ix} < 0 else {ix}")
                out.append(f"bad |= ({ix} < 0) | ({ix} >= {extent})")
                out.append(f"{ix} = min(max({ix}, 0), {extent} - 1)")
                parts.append(ix)
            subscript = ", ".join(parts) if parts else "0"
            out.append(f"{name} = {array}[{subscript}]")
        elif op == "not":
            operand = names[args[0]]
            out.append(f"{name} = {'not ' if node.kind == 'bool' else '~'}{operand}")
        else:
            operands = [names[a] for a in args]
            if op in ("add", "sub", "mul", "min", "max", "floordiv", "mod", "pow"):
                operands = [
                    _cast_source(t, a.kind, node.kind) for t, a in zip(operands, args, strict=True)
                ]
            elif op == "where":
                operands = [operands[0]] + [
                    _cast_source(t, a.kind, node.kind)
                    for t, a in zip(operands[1:], args[1:], strict=True)
                ]
            elif op in ("eq", "ne", "lt", "le", "gt", "ge") and "float" in (
                args[0].kind,
                args[1].kind,
            ):
                operands = [
                    _cast_source(t, a.kind, "float") for t, a in zip(operands, args, strict=True)
                ]
            out.append(f"{name} = {_NB_FORMAT[op].format(*operands)}")
        names[node] = name
    for name, kind in stored:
        lists["none"].append(f"k_{name} = np.empty(n, dtype={_NUMPY_DTYPE[kind]})")
        lists["key"].append(f"k_{name}[c] = {name}")
    loads = [f"{name} = k_{name}[c]" for name, _ in stored]
    cell = loads + lists["cell"]
    for target, node in roots.items():
        where = level[node]
        (cell if where in ("key", "cell") else lists["row"]).append(f"{target} = {names[node]}")
    return lists["none"], lists["key"], lists["row"], cell


# --------------------------------------------------------------------------- Triton source

# Triton source of each op of the generated score/mask step, operands as {0}, {1}, {2}, each
# already of the kind the op needs. // and % are Python's floor forms (Triton's integer ones
# round toward zero), ``_fx_float_*`` their float forms; ``_tanh`` is the dense kernels'
# accurate fp32 tanh; the ``_fx_*`` helpers come from kernels/triton/flex_attention.py.
_TT_FORMAT = {
    **_COMMON_FORMAT,
    "floordiv": "_fx_floordiv({0}, {1})", "mod": "_fx_mod({0}, {1})", "pow": "_fx_pow({0}, {1})",
    "min": "tl.minimum({0}, {1})", "max": "tl.maximum({0}, {1})", "abs": "tl.abs({0})",
    "where": "tl.where({0}, {1}, {2})",
    "tanh": "_tanh({0})", "exp": "tl.exp({0})", "exp2": "tl.exp2({0})",
    "log": "tl.log({0})", "log2": "tl.log2({0})", "sqrt": "tl.sqrt_rn({0})",
    "rsqrt": "(1.0 / tl.sqrt_rn({0}))", "sigmoid": "(1.0 / (1.0 + tl.exp(-{0})))",
    "sin": "tl.sin({0})", "cos": "tl.cos({0})", "sign": "_fx_sign({0})",
    "relu": "tl.maximum({0}, 0.0)", "to_float": "{0}", "to_int": "{0}",
}  # fmt: skip
_TT_DTYPE = {"bool": "tl.int1", "int": "tl.int64", "float": "tl.float32"}
_TT_FLOAT_OPERANDS = ("truediv", "tanh", "exp", "exp2", "log", "log2", "sqrt", "rsqrt",
                      "sigmoid", "sin", "cos", "relu")  # fmt: skip


def _triton_const(value, kind):
    """A constant of ``kind`` as a Triton scalar tensor (Python literals would be constexprs,
    which lack ``.to`` and make ``tl.where`` of two constants a Python value)."""
    if kind == "float":
        value = float(value)
        text = repr(value) if math.isfinite(value) else f'float("{value}")'
    elif kind == "int":
        text = repr(int(value))
    else:
        text = repr(bool(value))
    return f"tl.full((), {text}, {_TT_DTYPE[kind]})"


def triton_statements(roots: dict) -> list[str]:
    """Triton statements computing the expressions in ``roots`` (name -> Node) over a tile:
    ``score`` fp32 [rows, cols], ``b`` and ``h`` int scalars, ``q_idx`` int32 [rows, 1],
    ``kv_idx`` int32 [1, cols]; values broadcast, so what depends on q_idx only is computed per
    row and a captured value indexed by h alone is one load. Floats are fp32, integers int64,
    bools int1. Captured array i is ``caps[i]`` = (pointer, shape, strides); an index out of
    range sets ``bad`` (a bool tile) and reads the nearest element, never outside the array.
    Each root's value is assigned to its name."""
    names: dict[Node, str] = {}
    lines = ["bad = tl.zeros((1, 1), tl.int1)"]

    def operand(node, kind):
        text = names[node]
        if kind is None or node.kind == kind:
            return text
        return f"{text}.to({_TT_DTYPE[kind]})"

    for number, node in enumerate(nodes_in_order(*roots.values())):
        op, args = node.op, node.args
        if op in ARGS:
            names[node] = op
            continue
        if op == "cap":
            names[node] = f"caps[{args[0]}]"
            continue
        if op == "const":
            names[node] = _triton_const(args[0], node.kind)
            continue
        name = f"t{number}"
        if op == "flat":  # (after its read, whose clamped indices it reuses)
            read = args[0]
            position = "tl.full((), 0, tl.int64)"
            for axis in range(len(read.args) - 1):
                position = f"({position}) * {names[read.args[0]]}[1][{axis}] + {names[read]}_{axis}"
            lines.append(f"{name} = {position}")
        elif op == "index":
            array = names[args[0]]
            offset = []
            for axis, index_node in enumerate(args[1:]):
                ix, extent = f"{name}_{axis}", f"{array}[1][{axis}]"
                lines += [
                    f"{ix} = {operand(index_node, 'int')}",
                    f"{ix} = tl.where({ix} < 0, {ix} + {extent}, {ix})",
                    f"bad = bad | ({ix} < 0) | ({ix} >= {extent})",
                    f"{ix} = tl.minimum(tl.maximum({ix}, 0), {extent} - 1)",
                ]
                offset.append(f" + {ix} * {array}[2][{axis}]")
            value = f"tl.load({array}[0]{''.join(offset)})"
            lines.append(f"{name} = {value}.to({_TT_DTYPE[node.kind]})")
        elif op == "not":
            negated = f"({names[args[0]]} == 0)" if node.kind == "bool" else f"(~{names[args[0]]})"
            lines.append(f"{name} = {negated}")
        else:
            if op in ("eq", "ne", "lt", "le", "gt", "ge"):
                kind = _promote(args[0].kind, args[1].kind, "int")
                operands = [operand(a, kind) for a in args]
            elif op in ("and", "or", "xor"):
                operands = [operand(a, node.kind) for a in args]
            elif op == "where":
                operands = [operand(args[0], "bool")] + [operand(a, node.kind) for a in args[1:]]
            elif op in _TT_FLOAT_OPERANDS:
                operands = [operand(a, "float") for a in args]
            elif op in ("to_float", "to_int", "to_bool"):
                operands = [operand(args[0], None if op == "to_bool" else node.kind)]
            else:  # arithmetic, min, max, neg, abs, sign, pow: in the node's kind
                operands = [operand(a, node.kind) for a in args]
            form = _TT_FORMAT[op]
            if op in ("floordiv", "mod", "pow") and node.kind == "float":
                form = form.replace("_fx_", "_fx_float_")
            lines.append(f"{name} = {form.format(*operands)}")
        names[node] = name
    for target, node in roots.items():
        lines.append(f"{target} = {names[node]}")
    return lines
