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
  parallel region at once (Numba releases the GIL inside parallel regions). fastpe's parallel
  kernels pass through a gate that admits one region at a time under ``workqueue``, and that
  ``fork()`` waits on under every layer (TBB cannot fork while a region runs). A child forked
  while other live threads had used TBB (TBB cannot shut down then) runs every kernel on its
  serial twin, with a warning, instead of risking a hang.
- Serial twins: each parallel kernel also has a serial compile under another name (the disk
  cache does not tell compile options apart), for that child and for calls too small to wake
  the pool.
- Disk cache: entries are keyed also by a digest of every kernel file here, since Numba itself
  notices changes only in the file that holds a kernel (not in helpers imported from others).
  With no writable cache location (read-only install, no writable home, unusable
  NUMBA_CACHE_DIR) ``cache=True`` raises at decoration; fastpe then compiles in memory and warns
  once.
- BLAS: kernels that call BLAS from Numba's threads limit it to one thread while they run
  (``single_threaded_blas``); the limit is process-wide, so it is taken under a lock.
- Compile notice: a kernel compile (a cache miss) still running after ``NOTICE_AFTER`` seconds
  logs one line on the ``fastpe`` logger — which kernel, that it happens once, where it is
  cached, and that ``fastpe warmup`` compiles ahead — unless FASTPE_QUIET_COMPILE=1. Every
  compile of a fastpe kernel is also recorded in ``compiled_kernels`` (warmup and the tests count
  them).
- LLVM passes: a kernel is optimised and emitted once, with its helpers and its parallel loop
  body linked in, not again in each of the libraries Numba makes for them
  (``_link_only_codegen``); fastpe's dispatchers keep those link-only overloads away from Python
  calls (``_KernelDispatcher``), and the disk cache keeps a helper's code to link, never loaded
  for a Python call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import sys
import threading
import time
import types
import warnings
import weakref

import numba
from numba.core import config, event, sigutils
from numba.core import types as nbtypes
from numba.core.caching import FunctionCache
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import CPUDispatcher
from numba.core.runtime import rtsys

from . import _link_only_codegen
from ._link_only_codegen import is_link_only

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


def _loaded_libgomp() -> str | None:
    """The GNU OpenMP runtime torch runs its thread pool on, when torch is imported and one is
    mapped into the process (torch's wheels bundle it as libgomp.so.1); else None."""
    if "torch" not in sys.modules or not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(maxsplit=1)[-1]
            if os.path.basename(path).startswith("libgomp"):
                return path
    return None


_OMPPOOL = "numba.np.ufunc.omppool"
# Numba's Linux wheels link their OpenMP layer against the file name "libgomp.so.1.0.0", which
# no loaded runtime answers to (the dynamic loader matches a library already in the process by
# its soname, "libgomp.so.1"): the layer would load a second GNU OpenMP runtime, with its own
# threads, beside torch's
_NEEDED_FILE, _NEEDED_SONAME = b"\0libgomp.so.1.0.0\0", b"\0libgomp.so.1\0"


def _share_torch_openmp() -> bool:
    """Load Numba's OpenMP layer bound to the GNU OpenMP runtime torch already loaded, so that
    fastpe's parallel kernels and torch's ops run on one pool of threads; True if it is.

    Two pools on the same cores fight: after each op, torch's idle threads spin for
    milliseconds on the cores Numba's workers need, and the reverse. On one pool, the threads
    torch leaves spinning pick fastpe's work up at once. Where the layer names its runtime by
    file name, the module is loaded from an in-memory copy whose dependency names the soname
    instead (the same length or shorter, so no offset in the file moves); the copy is Numba's
    own machine code, never written to disk."""
    if _loaded_libgomp() is None or _OMPPOOL in sys.modules:
        return False
    from importlib import machinery, util

    spec = util.find_spec(_OMPPOOL)
    if spec is None or spec.origin is None:
        return False
    image = pathlib.Path(spec.origin).read_bytes()
    if image.count(_NEEDED_FILE) == 1:
        image = image.replace(_NEEDED_FILE, _NEEDED_SONAME.ljust(len(_NEEDED_FILE), b"\0"))
    elif _NEEDED_SONAME not in image:  # another OpenMP runtime (Intel's, LLVM's): not torch's
        return False
    fd = os.memfd_create("numba-omppool")
    try:
        with open(fd, "wb", closefd=False) as file:
            file.write(image)
        path = f"/proc/self/fd/{fd}"
        loader = machinery.ExtensionFileLoader(_OMPPOOL, path)
        module = util.module_from_spec(util.spec_from_file_location(_OMPPOOL, path, loader=loader))
        loader.exec_module(module)  # dlopen: the mapping outlives the descriptor
    except (OSError, ImportError):
        return False
    finally:
        os.close(fd)
    sys.modules[_OMPPOOL] = module
    return True


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
        config.THREADING_LAYER = "omp" if _share_torch_openmp() else "forksafe"
    if str(config.THREADING_LAYER).lower() not in ("omp", "workqueue"):  # TBB may be picked
        _load_pip_tbb()
    numba.get_num_threads()  # launches the threads with the configured layer
    return numba.threading_layer()


THREADING_LAYER = _start_threads()


def threading_layer() -> str:
    """The Numba threading layer fastpe's kernels run on ("tbb", "omp" or "workqueue")."""
    return THREADING_LAYER


class _LaunchGate:
    """Counts the parallel regions in flight; ``fork()`` waits for them to end.

    Numba's TBB layer shuts TBB's workers down before ``fork()`` so the child can start its own;
    a region still running makes that fail. The gate's before-fork hook runs from ``os.fork()``
    ahead of the C-level ``pthread_atfork`` handlers TBB uses: it waits until no region runs and
    keeps new ones out until the fork is done. ``workqueue`` cannot run two regions at once (it
    aborts the process), so there the gate also admits one at a time.
    """

    def __init__(self, limit: int | None):
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._limit = limit
        self._forking = False
        self.users = weakref.WeakSet()  # threads that ever ran a region

    def enter(self) -> None:
        with self._cond:
            while self._forking or (self._limit is not None and self._active >= self._limit):
                self._cond.wait()
            self._active += 1
            self.users.add(threading.current_thread())

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()  # held through fork(): no thread can enter a region meanwhile
        self._forking = True
        while self._active:
            self._cond.wait()

    def after_fork(self) -> None:  # parent and child: the forking thread holds the lock in both
        self._forking = False
        self._cond.notify_all()
        self._cond.release()


_gate = _LaunchGate(limit=1 if THREADING_LAYER == "workqueue" else None)

# TBB shuts down for fork() only when the fork comes from the thread that started Numba's pool and
# no other live thread ever ran a region (each such thread stays attached to TBB until it exits);
# otherwise TBB prints "Unable to join threads to shut down before fork()" and the child's first
# parallel region may hang. Such a child runs every kernel on its serial twin instead.
_POOL_THREAD = threading.get_ident()
_serial_only = False
_fork_breaks_pool = False


def _pool_survives_fork() -> bool:
    """Whether a child forked now can run parallel regions. GNU OpenMP never can: its pool's
    threads are gone in the child, where torch's own ops hang and Numba's OpenMP layer
    terminates the process at the first parallel region."""
    if THREADING_LAYER == "omp":
        return False
    if THREADING_LAYER != "tbb":
        return True
    me = threading.current_thread()
    return threading.get_ident() == _POOL_THREAD and not any(
        thread is not me and thread.is_alive() for thread in list(_gate.users)
    )


_serial_warned = False


def _warn_serial_only() -> None:
    """Once per process, at the first kernel call that runs serially for want of its pool (not
    at the fork: most forked children — DataLoader workers, say — never call fastpe)."""
    global _serial_warned
    if _serial_warned:
        return
    _serial_warned = True
    if THREADING_LAYER == "omp":
        why = (
            "fastpe's CPU kernels share torch's OpenMP thread pool, which does not survive "
            "fork() (torch's own parallel ops hang in such a child)"
        )
    else:
        why = (
            "this process was forked while other threads had run parallel CPU kernels (or from "
            "a thread other than the one that started Numba's thread pool), so TBB's threads "
            "could not be shut down for the fork"
        )
    warnings.warn(
        f"fastpe: {why}; fastpe's CPU kernels run on one thread in this forked process. Use "
        "the spawn or forkserver start method (or fork before the first fastpe call) to keep "
        "them parallel.",
        RuntimeWarning,
        stacklevel=4,
    )


def _renamed(func, suffix: str):
    """A copy of ``func`` under another qualified name: Numba's disk cache is keyed by the
    function's name, code and argument types, not by compile options, so a serial and a parallel
    compile of one function would overwrite each other's cache entries (and the parallel kernel
    then loads the serial machine code, or crashes)."""
    twin = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    twin.__kwdefaults__ = func.__kwdefaults__
    twin.__qualname__ = f"{func.__qualname__}__{suffix}"
    twin.__module__ = func.__module__
    return twin


class ParallelKernel:
    """A ``parallel=True`` kernel and its serial twin (``prange`` runs as ``range``).

    Calling it runs the parallel compile through ``_gate`` (Numba releases the GIL inside
    parallel regions, so other Python threads run, and may fork, meanwhile) — or the serial twin
    in a process forked where TBB could not shut down. ``.serial`` is the twin, for calls too
    small to be worth waking the pool. Attribute access (``py_func``, ``signatures``…) reaches
    the parallel dispatcher."""

    def __init__(self, func, options: dict, cache: bool):
        self._parallel = _dispatcher(func, dict(options, parallel=True), cache)
        self.serial = _dispatcher(_renamed(func, "serial"), options, cache)
        functools.update_wrapper(self, func)

    def __call__(self, *args, **kwargs):
        if _serial_only:
            _warn_serial_only()
            return self.serial(*args, **kwargs)
        _gate.enter()
        try:
            return self._parallel(*args, **kwargs)
        finally:
            _gate.leave()

    def __getattr__(self, name):
        return getattr(self._parallel, name)


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


COMPILE_WAIT_LIMIT = 900.0  # seconds a process waits for another's compile before its own


class _KernelCache(FunctionCache):
    """Numba's disk cache, keyed also by every kernel file: Numba notices a change only in the
    file that holds the kernel, not in the jitted helpers it imports from the others (the half
    conversions, the attention tile steps), and would load stale machine code.

    One compile per function at a time across processes: on a cache miss the process takes an
    exclusive lock on the function's ``.lock`` file next to its index, looks in the cache again
    (another process may have just saved the kernel: it loads that instead of compiling it
    again), and holds the lock until its own compile is saved (or has failed). Without it,
    processes that start together on an empty cache — ranks of a distributed job, server or
    DataLoader workers, parallel test workers, ``fastpe warmup``'s workers — each compile every
    kernel, seconds of CPU apiece on shared cores, and their writes to the function's one index
    file could drop each other's entries. The lock is ``flock``'s (released by the kernel when a
    process dies); a process that waits longer than ``COMPILE_WAIT_LIMIT`` compiles anyway."""

    _held = None  # the open lock file while this process compiles the function

    def _index_key(self, sig, codegen):
        return (*super()._index_key(sig, codegen), _kernel_sources_digest())

    def load_overload(self, sig, target_context):
        found = self._load_cached(sig, target_context)
        if found is not None or self._held is not None or not self._enabled:
            return found
        self._held = _lock_file(os.path.join(self._cache_path, self._cache_file._index_name))
        if self._held is None:
            return None
        found = self._load_cached(sig, target_context)  # saved while this process waited
        if found is not None:
            self.release()
        return found  # None: this process compiles it, under the lock

    def _load_cached(self, sig, target_context):
        # Numba's load_overload first refreshes the typing and target contexts: it imports and
        # installs every registry Numba has (its np, cpython, typed and random
        # implementations), a third of a warm process's first call. Loading machine code needs
        # none of it, only the runtime its code links against; a compile refreshes them itself.
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            found = self._load_overload(sig, target_context)
        if found is not None and is_link_only(found.library) and _compile_notice.idle:
            return None  # code to link, saved by a kernel's compile: a Python call needs more
        return found

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        finally:
            self.release()

    def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()  # closing the file releases its flock


def _lock_file(index_path: str):
    """The open, exclusively locked ``<index>.lock`` file, or None where it cannot be had (no
    flock on this platform or file system, or ``COMPILE_WAIT_LIMIT`` passed)."""
    try:
        import fcntl
    except ImportError:  # Windows: compile without waiting, as Numba does
        return None
    try:
        handle = open(index_path + ".lock", "a")  # noqa: SIM115 - closed by release()
    except OSError:
        return None
    waited, delay = 0.0, 0.01
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            pass
        except OSError:  # a file system without locks
            handle.close()
            return None
        if waited >= COMPILE_WAIT_LIMIT:
            handle.close()
            return None
        if waited < NOTICE_AFTER <= waited + delay:
            logger.info(
                "fastpe: waiting for another process compiling the kernel of %s",
                os.path.basename(index_path),
            )
        time.sleep(delay)
        waited += delay
        delay = min(delay * 2, 0.25)


class _KernelDispatcher(CPUDispatcher):
    """Numba's dispatcher, for link-only overloads (``_link_only_codegen``): a helper compiled
    inside a kernel's compile has code to link and no machine code, so its entry point is a null
    address. Such an overload serves the compiles of the kernels that call the helper (their
    typing finds it in ``overloads``) but stays out of the table Python calls are dispatched
    through; a call from Python with that signature (the tests call helpers directly) drops it
    and compiles the helper in full."""

    def add_overload(self, cres):
        if is_link_only(cres.library):
            self.overloads[tuple(cres.signature.args)] = cres
        else:
            super().add_overload(cres)

    def compile(self, sig):
        with global_compiler_lock:  # (reentrant) no other thread's compile changes depth now
            if _compile_notice.idle:  # not inside a compile: a call from Python
                args = tuple(sigutils.normalize_signature(sig)[0])
                existing = self.overloads.get(args)
                if existing is not None and is_link_only(existing.library):
                    del self.overloads[args]
            return super().compile(sig)


def _dispatcher(func, options: dict, cache: bool):
    dispatcher = numba.njit(**options)(func)
    if type(dispatcher) is CPUDispatcher:  # not under NUMBA_DISABLE_JIT
        dispatcher.__class__ = _KernelDispatcher
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
    ``ParallelKernel`` (launch gate, serial twin).
    """
    cache = options.pop("cache", False)
    parallel = options.pop("parallel", False)

    def decorate(func):
        if parallel and not numba.config.DISABLE_JIT:
            return ParallelKernel(func, options, cache)
        return _dispatcher(func, options, cache)

    return decorate


def read_only(array):
    """A read-only view of a NumPy array. Numba types read-only and writable arrays apart and
    compiles a kernel for each: every array a kernel only reads goes in read-only, whether the
    caller's was (a broadcast mask, a cached table) or not — one compile instead of two."""
    view = array.view()
    view.flags.writeable = False
    return view


@functools.cache
def _blas_controller():
    # the kernels' products call scipy's BLAS (_blas.gemm): load it first so the controller sees it
    load_cython_blas()
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


_CYTHON_BLAS = "scipy.linalg.cython_blas"
_cython_blas_lock = threading.Lock()


def load_cython_blas() -> None:
    """Imports SciPy's ``cython_blas``, the BLAS the kernels call through Numba's C helper
    (which imports it by name at its first product).

    Imported the usual way it runs ``scipy.linalg``'s package first: 0.2–0.3 s of imports
    (f2py, numpy.testing, the array-API layer) that nothing here uses, a quarter of a warm
    process's first kernel call. While ``scipy.linalg`` is not imported, the extension is loaded
    alone, under its own name, and a finder on ``sys.meta_path`` makes a later import of
    ``scipy.linalg`` expose it as its ``cython_blas`` attribute as usual. Anything unexpected
    (another layout of SciPy) falls back to the usual import."""
    with _cython_blas_lock:
        if _CYTHON_BLAS in sys.modules:
            return
        if "scipy.linalg" not in sys.modules:
            try:
                _load_extension_alone(_CYTHON_BLAS)
                return
            except Exception:  # noqa: BLE001 - the usual import below says what is wrong
                sys.modules.pop(_CYTHON_BLAS, None)
        import scipy.linalg.cython_blas  # noqa: F401


def _load_extension_alone(name: str) -> None:
    import scipy

    package, _, leaf = name.rpartition(".")
    folder = os.path.join(os.path.dirname(scipy.__file__), *package.split(".")[1:])
    spec = importlib.machinery.PathFinder.find_spec(name, [folder])
    if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
        raise ImportError(f"{name} is not an extension module in {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    sys.meta_path.insert(0, _AttachToPackage(package, leaf, module))


class _AttachToPackage:
    """A ``sys.meta_path`` finder that finds nothing itself: when ``package`` is imported, it
    sets ``package.<leaf>`` to a submodule imported before it (the import system sets that
    attribute only when it loads the submodule itself), then leaves ``sys.meta_path``."""

    def __init__(self, package: str, leaf: str, module):
        self.package, self.leaf, self.module = package, leaf, module

    def find_spec(self, name, path=None, target=None):
        if name != self.package:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_package = spec.loader.exec_module

        def exec_module(module):
            run_package(module)
            setattr(module, self.leaf, self.module)

        spec.loader.exec_module = exec_module
        return spec


_blas_lock = threading.Lock()


@contextlib.contextmanager
def single_threaded_blas():
    """BLAS limited to one thread while the block runs: Numba's threads already fill the cores,
    and a threaded BLAS inside each of them oversubscribes.

    The limit is process-wide and restored on exit, so concurrent callers take turns: with
    overlapping limits one caller would save another's "1" as the original and restore it last,
    leaving every later matmul of the process single-threaded. threadpoolctl also lets only the
    thread that set an OpenBLAS limit change it again, so each limit is set and restored by the
    same thread, inside the lock. ``fork()`` takes the lock too (``_before_fork``).
    """
    with _blas_lock:
        with _blas_controller().limit(limits=1, user_api="blas"):
            yield  # (__exit__ restores and releases threadpoolctl's thread ownership)


def _before_fork():
    """Waits until no thread is inside ``single_threaded_blas``, no parallel region runs and no
    thread compiles, and keeps it so until the fork is done. OpenBLAS changes its thread count
    under a lock of its own, and starts its pool again under it after a fork: a thread doing so
    while another forks leaves that lock held forever in the child, whose first BLAS limit then
    hangs; Numba's compiler lock held by a compiling thread would hang the child's first
    compile the same way. The order is the one a kernel call takes them in: the BLAS lock,
    the gate, then (compiling inside both) the compiler lock."""
    global _fork_breaks_pool
    _blas_lock.acquire()
    _gate.before_fork()
    global_compiler_lock.acquire()
    _fork_breaks_pool = not _pool_survives_fork()


def _after_fork_in_parent():
    global_compiler_lock.release()
    _gate.after_fork()
    _blas_lock.release()


def _after_fork_in_child():
    """The forking thread held the locks; the child's copies are its own."""
    global _blas_lock, _serial_only
    global_compiler_lock.release()  # (held by this thread, which the child's is)
    _gate.after_fork()
    _serial_only = _serial_only or _fork_breaks_pool
    _blas_lock = threading.Lock()


# --------------------------------------------------------------------------- compile notice

logger = logging.getLogger("fastpe")
NOTICE_AFTER = 1.0  # seconds: compiles shorter than this pass silently
compiled_kernels: list[str] = []  # every fastpe kernel this process compiled (not loaded), in order
_KERNEL_PACKAGE = __name__.rpartition(".")[0]  # fastpe.kernels.numba


def kernel_name(dispatcher) -> str:
    """'attention._attention_numba (serial)' for a fastpe dispatcher."""
    func = dispatcher.py_func
    module = func.__module__.rpartition(".")[2]
    name, twin, _ = func.__qualname__.partition("__serial")
    return f"{module}.{name}" + (" (serial)" if twin else "")


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
        self.depth = 0  # compiles run under Numba's global compiler lock: one thread at a time
        self._timer = None
        self.compiling_ours = False  # the outermost compile running is a fastpe kernel's

    @property
    def idle(self) -> bool:
        """No compile is running (read under the compiler lock: in this thread, none)."""
        return self.depth == 0

    def on_start(self, ev):
        dispatcher = ev.data["dispatcher"]
        ours = getattr(dispatcher.py_func, "__module__", "").startswith(_KERNEL_PACKAGE)
        self.depth += 1
        if self.depth > 1 or not ours:
            return
        self.compiling_ours = True
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
        if getattr(ev, "_exc_details", None) is not None:  # Numba's is_failed reads it inverted
            # a failed compile saves nothing: let the next process (or call) try
            cache = getattr(ev.data["dispatcher"], "_cache", None)
            if isinstance(cache, _KernelCache):
                cache.release()
        self.depth -= 1
        if self.depth == 0:
            self.compiling_ours = False
            if self._timer is not None:
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


_compile_notice = _CompileNotice()
event.register("numba:compile", _compile_notice)
LINK_ONLY = _link_only_codegen.install(
    compiling_ours=lambda: _compile_notice.compiling_ours,
    compiling_nested=lambda: _compile_notice.depth > 1,
)


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


# generated kernel modules (flex_attention's score/mask variants, fastpe/_generated.py) live in
# this folder under cache_directory(); Numba keeps the compiled code of each source folder in a
# folder of its own
VARIANTS_FOLDER = "flex_variants"
_CACHE_SUFFIXES = (".nbi", ".nbc", ".lock")  # Numba's index and data files, and our locks


def variants_directory() -> str | None:
    """Where generated kernel modules are written (None: nowhere writable, kept in memory)."""
    root = cache_directory()
    return None if root is None else os.path.join(root, VARIANTS_FOLDER)


def _compiled_folder_of(source: pathlib.Path) -> str | None:
    """The folder Numba keeps the compiled kernels of the module file ``source`` in."""
    namespace = {"__name__": source.stem}
    exec(compile("def probe():\n    pass\n", str(source), "exec"), namespace)
    try:
        return _KernelCache(namespace["probe"])._cache_path
    except RuntimeError:
        return None


def _entries(folder, stems) -> list[pathlib.Path]:
    """Numba's files (and our lock files) of the modules named ``stems`` in ``folder``."""
    if folder is None or not os.path.isdir(folder):
        return []
    prefixes = tuple(f"{stem}." for stem in stems)
    return [
        path
        for path in pathlib.Path(folder).iterdir()
        if path.suffix in _CACHE_SUFFIXES and path.name.startswith(prefixes)
    ]


def _cache_entries(directory: str) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """fastpe's files in the cache: (Numba's files of the kernel modules here and of the
    generated variant modules, the variant modules' sources). In-tree (the package's
    __pycache__) the folder also holds Python's .pyc files, which are left alone."""
    kernels = _entries(
        directory, [path.stem for path in pathlib.Path(__file__).parent.glob("*.py")]
    )
    folder = pathlib.Path(directory, VARIANTS_FOLDER)
    sources = sorted(folder.glob("*.py")) if folder.is_dir() else []
    if sources:
        kernels += _entries(_compiled_folder_of(sources[0]), [path.stem for path in sources])
    return kernels, sources


def cache_stats() -> dict:
    """{"directory", "bytes", "kernels" (compiled specialisations), "functions", "variants"
    (generated flex_attention modules)}."""
    directory = cache_directory()
    compiled, sources = (
        _cache_entries(directory) if directory and os.path.isdir(directory) else ([], [])
    )
    return {
        "directory": directory,
        "bytes": sum(path.stat().st_size for path in compiled + sources),
        "kernels": sum(path.suffix == ".nbc" for path in compiled),
        "functions": sum(path.suffix == ".nbi" for path in compiled),
        "variants": len(sources),
    }


def clear_cache() -> dict:
    """Remove fastpe's compiled kernels and generated variant modules from the cache; the stats
    of what was removed."""
    removed = cache_stats()
    if removed["directory"] and os.path.isdir(removed["directory"]):
        compiled, sources = _cache_entries(removed["directory"])
        for path in compiled + sources:
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                path.unlink()
    return removed


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
