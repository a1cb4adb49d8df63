"""Tile matrix products through BLAS: ``gemm(c, a, b, trans_a, trans_b, beta)``.

``c = op(a) · op(b) + beta · c`` for 2-D C-contiguous float32 or float64 arrays of one dtype,
where ``op(x)`` is ``x`` or, when its flag is true, ``xᵀ``; ``beta`` is 0.0 (overwrite) or
1.0 (accumulate into ``c``). The flags and ``beta`` are run-time values. The shapes must agree;
the kernels call it on tiles they sized themselves, and nothing here checks them.

It calls the BLAS entry point Numba's own ``np.dot`` calls (SciPy's ``cython_blas``, through
Numba's C helper, which loads it at its first use), in one call instruction emitted into the
calling kernel. ``np.dot`` instead compiles a function of its own for every combination of
layouts and of the calling kernel's compile options — four to ten compiles of about 0.25 s
each on a kernel's first call — cannot accumulate (a product added to an accumulator went
through a temporary or a second pass), and takes a transposed operand only as a view.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._runtime import load_cython_blas

_CHAR = ir.IntType(8)
_VOID_P = ir.IntType(8).as_pointer()


def _tile(array) -> bool:
    return (
        isinstance(array, types.Array)
        and array.ndim == 2
        and array.layout == "C"
        and array.dtype in (types.float32, types.float64)
    )


@intrinsic
def gemm(typingctx, c, a, b, trans_a, trans_b, beta):
    if not (_tile(c) and _tile(a) and _tile(b)) or len({c.dtype, a.dtype, b.dtype}) != 1:
        return None  # a typing error naming the argument types
    if not (
        isinstance(trans_a, types.Boolean)
        and isinstance(trans_b, types.Boolean)
        and isinstance(beta, types.Float)
    ):
        return None
    # imported here, at typing: its module pulls in Numba's array implementations, which a
    # process loading cached kernels never needs (tens of ms of its first call)
    from numba.np.linalg import check_blas_return, get_blas_kind

    load_cython_blas()  # what numba.np.linalg.ensure_blas checks, without scipy.linalg's package
    dtype = c.dtype
    kind = get_blas_kind(dtype, "gemm")

    def codegen(context, builder, signature, args):
        ta, tb, beta_val = args[3:]
        arrays = [
            context.make_array(ty)(context, builder, value)
            for ty, value in zip(signature.args[:3], args[:3], strict=True)
        ]
        c_arr, a_arr, b_arr = arrays
        a_rows, a_cols = cgutils.unpack_tuple(builder, a_arr.shape, 2)
        b_rows, b_cols = cgutils.unpack_tuple(builder, b_arr.shape, 2)
        c_cols = cgutils.unpack_tuple(builder, c_arr.shape, 2)[1]
        rows = builder.select(ta, a_cols, a_rows)  # of op(a), = c's rows
        inner = builder.select(ta, a_rows, a_cols)
        cols = builder.select(tb, b_rows, b_cols)  # of op(b), = c's columns
        # BLAS is column-major: a row-major [r, s] array is its [s, r] transpose there, so
        # cᵀ = op(b)ᵀ · op(a)ᵀ, with b first; a flag set means "transpose" of that view
        ll_dtype = context.get_value_type(dtype)
        one = cgutils.alloca_once_value(builder, ir.Constant(ll_dtype, 1.0))
        beta_slot = cgutils.alloca_once_value(
            builder, context.cast(builder, beta_val, signature.args[5], dtype)
        )
        intp = context.get_value_type(types.intp)
        fnty = ir.FunctionType(
            ir.IntType(32),
            [_CHAR, _CHAR, _CHAR, intp, intp, intp]
            + [_VOID_P, _VOID_P, intp, _VOID_P, intp, _VOID_P, _VOID_P, intp],
        )
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        # BLAS takes no empty operand (a leading dimension of 0 is an illegal argument), as
        # np.dot does not pass one: an empty c needs nothing, an empty inner dimension leaves
        # beta · c
        zero = ir.Constant(intp, 0)
        no_output = builder.or_(
            builder.icmp_signed("==", rows, zero), builder.icmp_signed("==", cols, zero)
        )
        no_inner = builder.icmp_signed("==", inner, zero)
        with builder.if_else(builder.or_(no_output, no_inner), likely=False) as (empty, full):
            with empty:
                overwrite = builder.fcmp_ordered("==", beta_val, ir.Constant(beta_val.type, 0.0))
                with builder.if_then(builder.and_(builder.not_(no_output), overwrite)):
                    size = builder.mul(c_arr.nitems, c_arr.itemsize)
                    cgutils.memset(builder, c_arr.data, size, 0)
            with full:
                trans, no_trans = ir.Constant(_CHAR, ord("t")), ir.Constant(_CHAR, ord("n"))
                status = builder.call(
                    fn,
                    (
                        ir.Constant(_CHAR, ord(kind)),
                        builder.select(tb, trans, no_trans),
                        builder.select(ta, trans, no_trans),
                        cols,
                        rows,
                        inner,
                        builder.bitcast(one, _VOID_P),
                        builder.bitcast(b_arr.data, _VOID_P),
                        b_cols,
                        builder.bitcast(a_arr.data, _VOID_P),
                        a_cols,
                        builder.bitcast(beta_slot, _VOID_P),
                        builder.bitcast(c_arr.data, _VOID_P),
                        c_cols,
                    ),
                )
                check_blas_return(context, builder, status)  # as np.dot: failure aborts
        return context.get_dummy_value()

    return types.none(c, a, b, trans_a, trans_b, beta), codegen
