"""Each parallel kernel optimised and turned into machine code by LLVM once, not four times.

Numba compiles a ``prange`` loop as a chain of code libraries, each finalised on its own: the
loop body (a "gufunc"), a wrapper that runs the body over a chunk of iterations, a wrapper that
hands the chunks to the threading layer, and finally the kernel, which links all three. Every
library links the previous one's code, re-runs LLVM's whole optimisation pipeline over it and
emits machine code for all of it, although only the kernel's machine code ever runs (and only
the kernel's is saved in the disk cache). For fastpe's attention kernels, whose loop bodies are
the whole tile loop, the three intermediate passes were about a quarter of a first call.

While a fastpe kernel compiles, the three intermediate libraries are finalised as link-only:
their functions keep Numba's per-function optimisation and are linked into the kernel, which
optimises and emits the whole once. Nothing asks them for machine code: Numba only builds an
unused Python entry point for the loop body, whose address is then 0 (as Numba reports for any
undefined symbol) and whose environment pointer is left unset. That is also what a kernel
loaded from the disk cache has, where the body's code comes from the kernel's object.

Other programs' Numba compiles in the same process are left as they are, and so is everything
on a Numba whose code libraries lack the methods used here (then fastpe compiles as before).
"""

from __future__ import annotations

from collections.abc import Callable

from numba.core.registry import cpu_target

# the names Numba gives the loop body's library (the body function's name), the chunk wrapper's
# (the wrapper object's repr) and the thread-pool wrapper's
_BODY_PREFIX = "__numba_parfor_gufunc"
_CHUNK_WRAPPER_PREFIX = "<numba.np.ufunc.wrappers._GufuncWrapper"
_POOL_WRAPPER_NAME = "parallelgufuncwrapper"

_NEEDED = (
    "_optimize_final_module",
    "_finalize_final_module",
    "_finalize_dynamic_globals",
    "_verify_declare_only_symbols",
    "get_pointer_to_function",
)


def _parfor_intermediate(name) -> bool:
    name = str(name)
    return (
        name.startswith(_BODY_PREFIX)
        or name.startswith(_CHUNK_WRAPPER_PREFIX)
        or name == _POOL_WRAPPER_NAME
    )


def install(compiling_ours: Callable[[], bool]) -> bool:
    """Finalise the parfor intermediates as link-only while ``compiling_ours()`` (the outermost
    compile running is one of fastpe's kernels); False where this Numba does not have what it
    needs (nothing is changed then)."""
    codegen = cpu_target.target_context.codegen()
    base = getattr(codegen, "_library_class", None)
    if (
        base is None
        or not all(hasattr(base, name) for name in _NEEDED)
        or not hasattr(codegen, "set_env")
    ):
        return False
    if getattr(base, "_fastpe_link_only", False):  # installed already
        return True

    class LinkOnlyAwareLibrary(base):
        _fastpe_link_only = True

        def __init__(self, codegen, name):
            super().__init__(codegen, name)
            self._link_only = compiling_ours() and _parfor_intermediate(name)

        def _optimize_final_module(self):
            if not self._link_only:  # a link-only module is optimised in the kernel
                super()._optimize_final_module()

        def _finalize_final_module(self):
            if not self._link_only:
                super()._finalize_final_module()
                return
            self._finalize_dynamic_globals()
            self._verify_declare_only_symbols()
            self._finalized = True  # linkable, never added to the JIT engine

        def get_pointer_to_function(self, name):
            if self._link_only:
                return 0  # no machine code: Numba's answer for an undefined symbol
            return super().get_pointer_to_function(name)

    set_env = codegen.set_env

    def set_env_where_defined(env_name, env):
        # the loop body's environment has no address in the engine (its library was never
        # added); it is unused, as in a kernel loaded from the disk cache
        if codegen._engine.get_global_value_address(env_name):
            set_env(env_name, env)

    codegen._library_class = LinkOnlyAwareLibrary
    codegen.set_env = set_env_where_defined
    return True
