"""Process-wide Numba settings shared by every kernel module: threading layer, disk cache, BLAS.

Imported (through ``njit``) by each kernel module before its first decorator runs, so the
threading layer is chosen before Numba launches its threads; ``import fastpe`` never gets here.

- Threading layer: Numba's default on Linux is GNU OpenMP, whose thread pool does not survive
  ``fork()`` — Numba then kills any forked child that runs a parallel kernel (DataLoader workers,
  pre-fork servers, ``multiprocessing`` with fork). Unless the user chose a layer, fastpe asks for
  Numba's "forksafe" choice: TBB where its library loads (a dependency on Linux x86-64, loaded
  from pip's location here), else ``workqueue`` on Linux (OpenMP elsewhere, where it is
  fork-safe). TBB is also thread-safe and starts a parallel region as fast as OpenMP;
  ``workqueue`` takes tens of microseconds and aborts the process when two threads enter a
  parallel region at once (Numba releases the GIL inside parallel regions), so under it fastpe's
  parallel kernels take a process-wide lock.
- Disk cache: with no writable cache location (read-only install, no writable home, unusable
  NUMBA_CACHE_DIR) ``cache=True`` raises at decoration; fastpe then compiles in memory and warns
  once.
- BLAS: kernels that call BLAS from Numba's threads limit it to one thread while they run
  (``single_threaded_blas``); the limit is process-wide, so it is taken under a lock.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings

import numba
from numba.core import config

# Numba's own default order; any other value was put there by the user (config file or code)
_DEFAULT_PRIORITY = ["tbb", "omp", "workqueue"]


def _user_chose_layer() -> bool:
    """True when the environment, a .numba_config.yaml or code already picked the layer."""
    return (
        "NUMBA_THREADING_LAYER" in os.environ
        or "NUMBA_THREADING_LAYER_PRIORITY" in os.environ
        or str(config.THREADING_LAYER).lower() != "default"
        or list(config.THREADING_LAYER_PRIORITY) != _DEFAULT_PRIORITY
    )


def _load_pip_tbb() -> None:
    """Make a pip-installed TBB visible to Numba.

    pip puts libtbb.so.12 in <prefix>/lib, which is not on the dynamic loader's search path, and
    Numba's tbbpool extension carries no rpath to it: Numba would report TBB missing. Once the
    library is loaded by its full path, Numba's own dlopen("libtbb.so.12") finds it by its
    soname. A TBB the loader already finds (conda, the system) is left alone: two TBB runtimes
    in one process would fight over the same threads."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    from importlib import metadata

    try:
        ctypes.CDLL("libtbb.so.12")
        return
    except OSError:
        pass
    try:
        files = metadata.files("tbb") or []
    except metadata.PackageNotFoundError:
        return
    for file in files:
        if file.name == "libtbb.so.12":
            with contextlib.suppress(OSError):  # then Numba falls back to the next layer
                ctypes.CDLL(str(file.locate()))
            return


def _start_threads() -> str:
    """Choose the threading layer (unless the user did) and start Numba's threads now.

    Starting them here, rather than at the first parallel call, fixes the choice: Numba's
    compiler reloads its config from the environment when a NUMBA_* variable changes, which would
    otherwise put the default layer back before the threads start."""
    try:
        return numba.threading_layer()  # already running: whatever started it chose
    except ValueError:
        pass
    if not _user_chose_layer():
        config.THREADING_LAYER = "forksafe"
    if str(config.THREADING_LAYER).lower() not in ("omp", "workqueue"):  # TBB may be picked
        _load_pip_tbb()
    numba.get_num_threads()  # launches the threads with the configured layer
    return numba.threading_layer()


THREADING_LAYER = _start_threads()


def threading_layer() -> str:
    """The Numba threading layer fastpe's kernels run on ("tbb", "omp" or "workqueue")."""
    return THREADING_LAYER


# workqueue is the one layer that cannot run two parallel regions at once
_SERIALIZE_LAUNCHES = THREADING_LAYER == "workqueue"
_launch_lock = threading.Lock()


class _SerializedKernel:
    """A parallel kernel called under ``_launch_lock`` (Numba releases the GIL inside parallel
    regions, and two concurrent regions abort the process under ``workqueue``). Attribute access
    (``py_func``, ``signatures``…) reaches the dispatcher."""

    def __init__(self, dispatcher):
        self._dispatcher = dispatcher
        functools.update_wrapper(self, dispatcher.py_func)

    def __call__(self, *args, **kwargs):
        with _launch_lock:
            return self._dispatcher(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._dispatcher, name)


_no_cache_warned = False


def _warn_no_cache(error: Exception) -> None:
    global _no_cache_warned
    if _no_cache_warned:
        return
    _no_cache_warned = True
    warnings.warn(
        "fastpe: Numba found no writable cache directory (NUMBA_CACHE_DIR, the package's "
        "__pycache__, the user cache directory), so the CPU kernels are compiled in memory and "
        "recompiled in every process. Set NUMBA_CACHE_DIR to a writable directory to keep them. "
        f"({error})",
        RuntimeWarning,
        stacklevel=3,
    )


def njit(**options):
    """``numba.njit(**options)`` for fastpe's kernels.

    ``cache=True`` falls back to an in-memory compile (with one warning per process) when Numba
    has nowhere to write its cache, instead of failing every call; ``parallel=True`` kernels are
    serialised when the threading layer requires it.
    """
    cache = options.pop("cache", False)

    def decorate(func):
        dispatcher = numba.njit(**options)(func)
        if cache and hasattr(dispatcher, "enable_caching"):  # not under NUMBA_DISABLE_JIT
            try:
                dispatcher.enable_caching()
            except RuntimeError as error:  # "cannot cache function ...: no locator available"
                _warn_no_cache(error)
        if options.get("parallel") and _SERIALIZE_LAUNCHES and hasattr(dispatcher, "py_func"):
            return _SerializedKernel(dispatcher)
        return dispatcher

    return decorate


@functools.cache
def _blas_controller():
    # Numba's np.dot calls scipy's BLAS: load it first so the controller can see it
    import scipy.linalg.cython_blas  # noqa: F401
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


_blas_lock = threading.Lock()
_blas_limiter = None  # the active limit, if any (a forked child restores it)


@contextlib.contextmanager
def single_threaded_blas():
    """BLAS limited to one thread while the block runs: Numba's threads already fill the cores,
    and a threaded BLAS inside each of them oversubscribes.

    The limit is process-wide and restored on exit, so concurrent callers take turns: with
    overlapping limits one caller would save another's "1" as the original and restore it last,
    leaving every later matmul of the process single-threaded. threadpoolctl also lets only the
    thread that set an OpenBLAS limit change it again, so each limit is set and restored by the
    same thread, inside the lock.
    """
    global _blas_limiter
    with _blas_lock:
        limiter = _blas_controller().limit(limits=1, user_api="blas")
        _blas_limiter = limiter
        try:
            with limiter:  # __exit__ restores and releases threadpoolctl's thread ownership
                yield
        finally:
            _blas_limiter = None


def _after_fork_in_child():
    """Locks held by another thread at fork() would stay held forever in the child."""
    global _launch_lock, _blas_lock, _blas_limiter
    _launch_lock = threading.Lock()
    _blas_lock = threading.Lock()
    if _blas_limiter is not None:  # another thread was inside single_threaded_blas
        limiter, _blas_limiter = _blas_limiter, None
        with contextlib.suppress(Exception):
            limiter.restore_original_limits()


os.register_at_fork(after_in_child=_after_fork_in_child)
