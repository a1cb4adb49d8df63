"""Machine code for what runs, and only that: each of fastpe's kernels is optimised and emitted
by LLVM once, with everything it calls linked in, instead of once per code library it links.

Numba gives every function it compiles a code library of its own and finalises each one in
full: LLVM's whole module optimisation pipeline, then machine code in the JIT engine. A kernel
then links the libraries of what it calls and runs both again over all of it. Only the kernel's
own machine code ever runs. Two kinds of library are finalised that way for nothing:

- the helpers a kernel calls (fastpe's tile steps, Numba's implementations of ``np.empty``,
  ``min``…), each compiled the first time a kernel's typing reaches it;
- the chain Numba builds for a ``prange`` loop: the loop body (a "gufunc"), a wrapper that runs
  it over a chunk of iterations and a wrapper that hands the chunks to the threading layer.

While one of fastpe's kernels compiles, both kinds are finalised as link-only: their functions
get a light per-function clean-up (LLVM's level 1, not Numba's 3) and are linked into the
kernel, which optimises and emits the whole once (docs/first-calls.md has the time it saves).
They also go without the wrappers Numba builds around every function for calls from Python and
through C function pointers. Numba's bookkeeping still asks each for the address of its Python
entry point: it is 0 (Numba's answer for an undefined symbol), and fastpe's dispatchers keep
such an overload out of the table that Python calls go through (``_runtime._KernelDispatcher``).
The disk cache keeps a helper's code to link (LLVM bitcode) instead of machine code, so that a
kernel compiled later, in another process, links the helper without typing it again; a Python
call never loads such an entry. The environment pointer a link-only function's code reads (in
error paths) is set once the kernel that holds its code is in the JIT engine, as Numba sets a
cached kernel's when loading it.

Other programs' Numba compiles in the same process are left as they are, and so is everything
on a Numba whose code libraries lack the methods used here (then fastpe compiles as before).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from llvmlite import binding as llvm
from numba.core import lowering
from numba.core.registry import cpu_target

# the names Numba gives the loop body's library (the body function's name), the chunk wrapper's
# (the wrapper object's repr) and the thread-pool wrapper's
_BODY_PREFIX = "__numba_parfor_gufunc"
_CHUNK_WRAPPER_PREFIX = "<numba.np.ufunc.wrappers._GufuncWrapper"
_POOL_WRAPPER_NAME = "parallelgufuncwrapper"

_WRAPPERS = ("create_cpython_wrapper", "create_cfunc_wrapper")  # Lower's entry-point builders
_LINK_ONLY_KIND = "fastpe-link-only"  # a cache entry holding a link-only library's code to link
# LLVM's optimisation level for a link-only function's own clean-up (Numba's is 3): the kernel
# that links it runs the full pipeline over it again. At 1 the first calls of the seven main ops
# and a bfloat16 attention took 1.07x less time than at 3 (a bfloat16 backward's 1.32x), the
# kernels' speed unchanged (bench/results/cpu-2core-avx512-compile-light-helpers.txt); at 0 the
# kernel's pipeline had so much more to do that a first attention call took longer.
_LINK_ONLY_OPT = 1

_NEEDED = (
    "_optimize_functions",
    "_optimize_final_module",
    "_finalize_final_module",
    "_finalize_dynamic_globals",
    "_verify_declare_only_symbols",
    "get_pointer_to_function",
    "serialize_using_object_code",
    "_unserialize",
    "_get_module_for_linking",
)


def _parfor_intermediate(name) -> bool:
    name = str(name)
    return (
        name.startswith(_BODY_PREFIX)
        or name.startswith(_CHUNK_WRAPPER_PREFIX)
        or name == _POOL_WRAPPER_NAME
    )


def is_link_only(library) -> bool:
    return getattr(library, "_link_only", False)


def install(compiling_ours: Callable[[], bool], compiling_nested: Callable[[], bool]) -> bool:
    """Finalise helpers and parfor intermediates as link-only while ``compiling_ours()`` (the
    outermost compile running is one of fastpe's kernels); helpers are the libraries made while
    ``compiling_nested()`` (a compile runs inside that kernel's). False where this Numba does
    not have what it needs (nothing is changed then)."""
    codegen = cpu_target.target_context.codegen()
    base = getattr(codegen, "_library_class", None)
    if (
        base is None
        or not all(hasattr(base, name) for name in _NEEDED)
        or not hasattr(codegen, "set_env")
        or not all(hasattr(lowering.Lower, name) for name in _WRAPPERS)
    ):
        return False
    if getattr(base, "_fastpe_link_only", False):  # installed already
        return True

    class LinkOnlyAwareLibrary(base):
        _fastpe_link_only = True

        def __init__(self, codegen, name):
            super().__init__(codegen, name)
            self._link_only = compiling_ours() and (
                compiling_nested() or _parfor_intermediate(name)
            )

        def _optimize_functions(self, ll_module):
            if not self._link_only:
                super()._optimize_functions(ll_module)
                return
            # the kernel runs LLVM's full pipeline over this code again once it is linked in:
            # here only the cheap clean-up that keeps the module small to link and to cache
            ll_module.data_layout = self._codegen._data_layout
            for func in ll_module.functions:
                passes, builder = self._codegen._function_pass_manager(opt=_LINK_ONLY_OPT)
                passes.run(func, builder)

        def _optimize_final_module(self):
            if not self._link_only:  # a link-only module is optimised in the kernel
                super()._optimize_final_module()

        def _finalize_final_module(self):
            if not self._link_only:
                super()._finalize_final_module()
                _set_pending_environments()
                return
            self._finalize_dynamic_globals()
            self._verify_declare_only_symbols()
            self._finalized = True  # linkable, never added to the JIT engine

        def get_pointer_to_function(self, name):
            if self._link_only:
                return 0  # no machine code: Numba's answer for an undefined symbol
            return super().get_pointer_to_function(name)

        def serialize_using_object_code(self):  # what the disk cache saves
            if not self._link_only:
                return super().serialize_using_object_code()
            return (self.name, _LINK_ONLY_KIND, self._get_module_for_linking().as_bitcode())

        @classmethod
        def _unserialize(cls, codegen, state):
            name, kind, bitcode = state
            if kind != _LINK_ONLY_KIND:
                return super()._unserialize(codegen, state)
            library = codegen.create_library(name)
            library._link_only = True
            library._final_module = library._shared_module = llvm.parse_bitcode(bitcode)
            library._finalize_final_module()
            return library

    set_env = codegen.set_env
    # environment name -> Environment not yet in the engine (weak: its overload keeps it)
    pending = weakref.WeakValueDictionary()

    def set_env_when_defined(env_name, env):
        # a link-only function's environment has no address in the engine until a kernel
        # holding its code is added
        if codegen._engine.get_global_value_address(env_name):
            set_env(env_name, env)
        else:
            pending[env_name] = env

    def _set_pending_environments():
        for env_name in [n for n in pending if codegen._engine.get_global_value_address(n)]:
            set_env(env_name, pending.pop(env_name))

    codegen._library_class = LinkOnlyAwareLibrary
    codegen.set_env = set_env_when_defined
    for name in _WRAPPERS:
        setattr(lowering.Lower, name, _not_for_link_only(getattr(lowering.Lower, name)))
    return True


def _not_for_link_only(make_wrapper):
    """``make_wrapper`` (a Lower method building an entry point for calls from Python or through
    a C function pointer), skipped for a link-only library: it would never run, and building,
    optimising and parsing it was a tenth of a helper's compile."""

    def unless_link_only(lower, *args, **kwargs):
        if not is_link_only(lower.library):
            make_wrapper(lower, *args, **kwargs)

    return unless_link_only
