"""Process-wide settings shared by every CPU kernel module: threads, disk cache, BLAS.

Imported (through ``njit``) by each kernel module; ``import fastpe`` never gets here.

- Threads: a parallel kernel is compiled once, as an ordinary (serial, GIL-free) function of
  the range of work items it runs; calling it splits the items into chunks that fastpe's own
  worker threads and the calling thread take in turn. fastpe does not use Numba's ``parallel=True``
  (``prange``): that compiles the kernel body a second time inside a generated ufunc, and
  again as a serial twin for small calls, which made a first call's compile about 40% longer;
  Numba's thread pools also need care around ``fork()`` (OpenMP's kills a forked child, TBB's
  cannot shut down while other threads use it). fastpe's workers are plain Python threads that
  wait on a queue (they never spin on a core when idle); a forked child starts its own; any
  number of threads may call kernels at once. The thread count is Numba's
  (``NUMBA_NUM_THREADS``, or ``numba.set_num_threads``).
- Disk cache: entries are keyed also by a digest of every kernel file here, since Numba itself
  notices changes only in the file that holds a kernel (not in helpers imported from others).
  With no writable cache location (read-only install, no writable home, unusable
  NUMBA_CACHE_DIR) ``cache=True`` raises at decoration; fastpe then compiles in memory and warns
  once.
- BLAS: kernels that call BLAS from fastpe's threads limit it to one thread while they run
  (``single_threaded_blas``); the limit is process-wide, so it is taken under a lock.
- Compile notice: a kernel compile (a cache miss) still running after ``NOTICE_AFTER`` seconds
  logs one line on the ``fastpe`` logger — which kernel, that it happens once, where it is
  cached, and that ``fastpe warmup`` compiles ahead — unless FASTPE_QUIET_COMPILE=1. Every
  compile of a fastpe kernel is also recorded in ``compiled_kernels`` (warmup and the tests count
  them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import os
import pathlib
import queue
import threading
import warnings

import numba
from numba.core import config, event
from numba.core import types as nbtypes
from numba.core.caching import FunctionCache

# --------------------------------------------------------------------------- threads


def thread_count() -> int:
    """The threads a parallel kernel uses: Numba's setting (``numba.set_num_threads`` once
    Numba's own pool runs, else ``NUMBA_NUM_THREADS``, which defaults to the CPU count).
    Reading it never starts Numba's pool."""
    from numba.np.ufunc import parallel

    if parallel._is_initialized:
        return numba.get_num_threads()
    return int(config.NUMBA_NUM_THREADS)


# chunks per thread: items differ in cost (causal attention's query blocks see more or fewer
# keys), so threads take small chunks in turn rather than one equal share each
CHUNKS_PER_THREAD = 4


class _Run:
    """One call of a parallel kernel: ``chunks`` slices of ``range(items)``, taken in turn."""

    def __init__(self, kernel, args: tuple, items: int, chunks: int):
        self.kernel, self.args, self.items, self.chunks = kernel, args, items, chunks
        self._next = itertools.count()  # next() is atomic under the GIL
        self._done = 0
        self._finished = threading.Condition(threading.Lock())
        self.error: BaseException | None = None

    def work(self) -> None:
        while (chunk := next(self._next)) < self.chunks:
            first = self.items * chunk // self.chunks
            stop = self.items * (chunk + 1) // self.chunks
            try:
                if self.error is None:
                    self.kernel(*self.args, first, stop)
            except BaseException as error:  # raised again in the calling thread
                self.error = error
            with self._finished:
                self._done += 1
                if self._done == self.chunks:
                    self._finished.notify_all()

    def wait(self) -> None:
        with self._finished:
            while self._done < self.chunks:
                self._finished.wait()


class _Workers:
    """fastpe's worker threads: daemon threads blocked on a queue until a call hands them work
    (an idle worker costs no CPU). Started on first use, up to the largest count asked for."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0

    def _serve(self) -> None:
        while True:
            self._queue.get().work()

    def run(self, kernel, args: tuple, items: int, threads: int) -> None:
        helpers = min(threads, items) - 1
        if helpers <= 0:
            kernel(*args, 0, items)
            return
        with self._lock:
            while self._started < helpers:
                threading.Thread(target=self._serve, name="fastpe-cpu", daemon=True).start()
                self._started += 1
        run = _Run(kernel, args, items, min(items, CHUNKS_PER_THREAD * threads))
        for _ in range(helpers):
            self._queue.put(run)
        run.work()  # the calling thread takes chunks too (its kernel calls release the GIL)
        # a chunk still running on a worker must end before the outputs are read; a worker
        # that finds no chunk left (another call kept it busy) just returns
        run.wait()
        if run.error is not None:
            raise run.error


_workers = _Workers()


class ParallelKernel:
    """A kernel whose last two parameters ``first, stop`` bound the work items it runs (a plain
    ``for item in range(first, stop)`` loop), compiled once, without the GIL.

    ``kernel(*args, items=n)`` runs ``range(n)`` across fastpe's threads; ``threads=1`` runs it
    whole on the calling thread (calls too small to be worth waking a worker). ``.dispatcher``
    is the compiled function, for other kernels to call; attribute access (``py_func``,
    ``signatures``…) reaches it too."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        functools.update_wrapper(
            self, dispatcher.py_func if hasattr(dispatcher, "py_func") else dispatcher
        )

    def __call__(self, *args, items: int, threads: int | None = None):
        _workers.run(self.dispatcher, args, items, thread_count() if threads is None else threads)

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)


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


@functools.cache
def _kernel_sources_digest() -> str:
    """A digest of every kernel source file of this folder, read once per process."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class _KernelCache(FunctionCache):
    """Numba's disk cache, keyed also by every kernel file: Numba notices a change only in the
    file that holds the kernel, not in the jitted helpers it imports from the others (the half
    conversions, the attention tile steps), and would load stale machine code."""

    def _index_key(self, sig, codegen):
        return (*super()._index_key(sig, codegen), _kernel_sources_digest())


def _dispatcher(func, options: dict, cache: bool):
    dispatcher = numba.njit(**options)(func)
    if cache and hasattr(dispatcher, "enable_caching"):  # not under NUMBA_DISABLE_JIT
        try:
            dispatcher._cache = _KernelCache(dispatcher.py_func)  # what enable_caching() sets
        except RuntimeError as error:  # "cannot cache function ...: no locator available"
            _warn_no_cache(error)
    return dispatcher


def njit(**options):
    """``numba.njit(**options)`` for fastpe's kernels.

    ``cache=True`` falls back to an in-memory compile (with one warning per process) when Numba
    has nowhere to write its cache, instead of failing every call; ``parallel=True`` makes a
    ``ParallelKernel`` (the function's last two parameters bound its work items).
    """
    cache = options.pop("cache", False)
    parallel = options.pop("parallel", False)

    def decorate(func):
        if parallel:
            return ParallelKernel(_dispatcher(func, dict(options, nogil=True), cache))
        return _dispatcher(func, options, cache)

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
    """The parent's worker threads do not exist in a forked child, and locks held by another
    thread at fork() would stay held forever: the child starts afresh."""
    global _workers, _blas_lock, _blas_limiter
    _workers = _Workers()
    _blas_lock = threading.Lock()
    if _blas_limiter is not None:  # another thread was inside single_threaded_blas
        limiter, _blas_limiter = _blas_limiter, None
        with contextlib.suppress(Exception):
            limiter.restore_original_limits()


# --------------------------------------------------------------------------- compile notice

logger = logging.getLogger("fastpe")
NOTICE_AFTER = 1.0  # seconds: compiles shorter than this pass silently
compiled_kernels: list[str] = []  # every fastpe kernel this process compiled (not loaded), in order
_KERNEL_PACKAGE = __name__.rpartition(".")[0]  # fastpe.kernels.numba


def kernel_name(dispatcher) -> str:
    """'attention._attention_numba' for a fastpe dispatcher."""
    func = dispatcher.py_func
    return f"{func.__module__.rpartition('.')[2]}.{func.__qualname__}"


def _argument_dtype(args) -> str:
    """The dtype of the kernel's first array argument (the input: q, x, the table)."""
    first = next((str(a.dtype) for a in args if isinstance(a, nbtypes.Array)), "")
    # half inputs travel as their bits (see attention.py): name them as the user knows them
    return {"uint16": "bfloat16", "int16": "float16"}.get(first, first)


class _CompileNotice(event.Listener):
    """Times each outermost compile of a fastpe kernel (helpers compile nested inside it).

    Numba raises "numba:compile" only on a cache miss (a kernel loaded from the disk cache
    raises nothing), so a cache hit never prints. A timer thread logs the notice only if the
    compile is still running after NOTICE_AFTER seconds: most small kernels finish before, and
    the user learns why the call is slow while waiting rather than after. LLVM runs through
    ctypes, which releases the GIL, so the timer fires on time."""

    def __init__(self):
        self._depth = 0  # compiles run under Numba's global compiler lock: one thread at a time
        self._timer = None

    def on_start(self, ev):
        dispatcher = ev.data["dispatcher"]
        ours = getattr(dispatcher.py_func, "__module__", "").startswith(_KERNEL_PACKAGE)
        self._depth += 1
        if self._depth > 1 or not ours:
            return
        name = kernel_name(dispatcher)
        compiled_kernels.append(name)
        if os.environ.get("FASTPE_QUIET_COMPILE", "") not in ("", "0"):
            return
        where = getattr(dispatcher._cache, "_cache_path", None)
        self._timer = threading.Timer(
            NOTICE_AFTER, _notice, (name, _argument_dtype(ev.data["args"]), where)
        )
        self._timer.daemon = True
        self._timer.start()

    def on_end(self, ev):
        self._depth -= 1
        if self._depth == 0 and self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _notice(name: str, dtype: str, where: str | None) -> None:
    kept = (
        f"cached in {where} for later processes"
        if where
        else "not cached (no writable cache directory: set NUMBA_CACHE_DIR), so every process"
        " compiles it again"
    )
    logger.warning(
        "fastpe: compiling CPU kernel %s for %s arrays: a one-time cost of seconds, %s; "
        "`fastpe warmup` compiles ahead (FASTPE_QUIET_COMPILE=1 hides this line)",
        name,
        dtype or "these",
        kept,
    )


event.register("numba:compile", _CompileNotice())


# --------------------------------------------------------------------------- the disk cache


def _cache_probe():  # a function of this folder: its cache locator is every kernel's
    pass


def cache_directory() -> str | None:
    """The directory Numba keeps fastpe's compiled kernels in (every kernel file is in this
    folder, so they share one), or None when no location is writable."""
    try:
        return _KernelCache(_cache_probe)._cache_path
    except RuntimeError:  # no locator: read-only install and no usable NUMBA_CACHE_DIR
        return None


def _cache_entries(directory: str) -> list[pathlib.Path]:
    """fastpe's files in the cache directory: Numba's index (.nbi) and data (.nbc) files of the
    kernel modules here. In-tree (the package's __pycache__) the folder also holds Python's
    .pyc files, which are left alone."""
    modules = tuple(f"{path.stem}." for path in pathlib.Path(__file__).parent.glob("*.py"))
    return [
        path
        for path in pathlib.Path(directory).iterdir()
        if path.suffix in (".nbi", ".nbc") and path.name.startswith(modules)
    ]


def cache_stats() -> dict:
    """{"directory", "bytes", "kernels" (compiled specialisations), "functions"}."""
    directory = cache_directory()
    entries = _cache_entries(directory) if directory and os.path.isdir(directory) else []
    return {
        "directory": directory,
        "bytes": sum(path.stat().st_size for path in entries),
        "kernels": sum(path.suffix == ".nbc" for path in entries),
        "functions": sum(path.suffix == ".nbi" for path in entries),
    }


def clear_cache() -> dict:
    """Remove fastpe's compiled kernels from the cache; the stats of what was removed."""
    removed = cache_stats()
    if removed["directory"]:
        for path in _cache_entries(removed["directory"]):
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                path.unlink()
    return removed


os.register_at_fork(after_in_child=_after_fork_in_child)
