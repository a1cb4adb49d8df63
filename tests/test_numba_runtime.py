"""The Numba runtime under fork, threads, a read-only install and BLAS thread limits.

Every case runs in a subprocess of its own: the failures under test kill or hang the process
(Numba's OpenMP layer kills a forked child; its workqueue layer aborts on concurrent parallel
regions; a dead pool worker hangs ``multiprocessing``), and each script sets its own deadlines
below the subprocess timeout, so a hang fails the test instead of hanging CI.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds for a whole script, compiles included; scripts give up well before

# Expected values come from fastpe's float64 NumPy oracle (backend="numpy").
PRELUDE = """
import os, sys, threading, time
import numpy as np
import fastpe
import scipy.linalg.cython_blas  # the BLAS Numba's np.dot calls, loaded before any limit is set

def table_ok(n):
    got = fastpe.sinusoidal_table(n, 16, backend="numba")
    return bool(np.allclose(got, fastpe.sinusoidal_table(n, 16, backend="numpy"), atol=1e-6, rtol=0))

rng = np.random.default_rng(7)
# above attention's serial threshold (B·Hq·Sq·Sk·(D + Dv) = 11M > 2^20): a parallel region runs
q = rng.standard_normal((2, 4, 37, 16)).astype(np.float32)
k = rng.standard_normal((2, 2, 1200, 16)).astype(np.float32)
v = rng.standard_normal((2, 2, 1200, 16)).astype(np.float32)
expected_attention = fastpe.attention(q, k, v, causal=True, backend="numpy")

def attention_ok():
    got = fastpe.attention(q, k, v, causal=True, backend="numba")
    return bool(np.allclose(got, expected_attention, atol=1e-5, rtol=1e-5))

def blas_threads():
    from threadpoolctl import threadpool_info
    return sorted(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")

def wait_child(pid, seconds):  # the child's exit code (negative: killed by that signal)
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            sys.exit("forked child hung")
        time.sleep(0.02)

def run_threads(target, count, seconds):
    threads = [threading.Thread(target=target, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        print("threads hung", flush=True)
        os._exit(2)
"""


# The layer fastpe picks (TBB where installed, else workqueue on Linux) and workqueue forced by
# the user, so that the lock serialising kernels under workqueue is exercised wherever TBB is.
# "torch": torch imported (and its OpenMP pool started) before fastpe, as in a model's process
LAYERS = [
    pytest.param(None, id="fastpe-layer"),
    pytest.param("workqueue", id="workqueue"),
    pytest.param("torch", id="torch-openmp"),
]
TORCH_FIRST = (
    "import torch\nassert float((torch.ones(256, 256) @ torch.ones(256, 256))[0, 0]) == 256\n"
)


def run_script(body: str, tmp_path, env=None, cwd=None, layer=None) -> str:
    """Run PRELUDE + body as a file (spawned children re-import it) in ``env`` (default: this
    environment with NUMBA_THREADING_LAYER set to ``layer``, or unset for None); kill its whole
    process group and fail on timeout; fail with its output unless it exits 0 and prints an "ok"
    line (interpreter shutdown may still print warnings after it)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_THREADING_LAYER")}
        if layer not in (None, "torch"):
            env["NUMBA_THREADING_LAYER"] = layer
    script = tmp_path / "script.py"
    script.write_text((TORCH_FIRST if layer == "torch" else "") + PRELUDE + textwrap.dedent(body))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd or tmp_path,
        start_new_session=True,  # forked grandchildren die with it on timeout
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"script hung for {TIMEOUT}s:\n{output}")
    assert proc.returncode == 0 and "ok" in output.splitlines(), (
        f"exit {proc.returncode}:\n{output}"
    )
    return output


@pytest.mark.parametrize("layer", LAYERS)
def test_forked_child_runs_parallel_kernels(tmp_path, layer):
    # Under GNU OpenMP (Numba's default on Linux) the child was killed with SIGTERM.
    run_script(
        """
        assert table_ok(37) and attention_ok()  # the parent's threads are running
        pid = os.fork()
        if pid == 0:
            os._exit(0 if table_ok(53) and attention_ok() else 3)
        code = wait_child(pid, 120)
        assert code == 0, f"forked child exited with {code}"  # -15: Numba's OpenMP fork guard
        assert table_ok(64)  # and the parent still works
        print("ok")
        """,
        tmp_path,
        layer=layer,
    )


@pytest.mark.parametrize(
    "method, layer",
    [
        ("fork", None),
        ("fork", "workqueue"),
        ("fork", "torch"),
        ("spawn", None),
        ("forkserver", None),
    ],
)
def test_multiprocessing_pool_runs_parallel_kernels(tmp_path, method, layer):
    # With fork, every pool worker was killed on its first kernel and Pool.map hung.
    run_script(
        f"""
        def work(n):
            return table_ok(n) and attention_ok()

        if __name__ == "__main__":
            assert work(5)  # the parent uses Numba's threads before the pool starts
            import multiprocessing
            with multiprocessing.get_context("{method}").Pool(2) as pool:
                results = pool.map_async(work, [3, 11, 29, 64]).get(timeout=150)
            assert results == [True] * 4, results
            print("ok")
        """,
        tmp_path,
        layer=layer,
    )


@pytest.mark.parametrize("layer", LAYERS)
def test_fork_while_other_threads_run_kernels(tmp_path, layer):
    # A server forking while its threads serve requests: locks held by those threads at fork()
    # must not deadlock the child.
    run_script(
        """
        # warm up first: a fork while another thread is importing a module leaves that
        # module's import lock held in the child (CPython's hazard, not Numba's); the small
        # call compiles the serial twin the children run on where the pool cannot follow a
        # fork (torch's OpenMP pool), which would otherwise compile in each child, slowly on
        # the cores the serving threads keep busy
        assert attention_ok() and table_ok(29)
        small = fastpe.attention(q[:, :, :1], k[:, :, :8], v[:, :, :8], backend="numba")
        assert np.isfinite(small).all()
        stop = False
        def serve():
            while not stop:
                assert attention_ok() and table_ok(29)
        threads = [threading.Thread(target=serve, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                os._exit(0 if attention_ok() and table_ok(31) else 3)
            assert wait_child(pid, 60) == 0
        stop = True
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        print("ok")
        """,
        tmp_path,
        layer=layer,
    )


def test_fork_waits_for_a_thread_inside_the_blas_limit(tmp_path):
    # OpenBLAS changes its thread count (and restarts its pool after a fork) under a lock of its
    # own: a child forked while another thread set or restored the limit inherited that lock
    # held and hung at its first BLAS limit (seen in test_fork_while_other_threads_run_kernels
    # above). fork() now waits until no thread is inside single_threaded_blas: the child sees
    # the block done and the original thread count back.
    run_script(
        """
        from fastpe.kernels.numba import _runtime as runtime
        original = blas_threads()
        inside, done = threading.Event(), threading.Event()

        def hold():
            with runtime.single_threaded_blas():
                inside.set()
                time.sleep(0.5)
                done.set()  # (inside the block: the fork may come as soon as it is left)

        holder = threading.Thread(target=hold)
        holder.start()
        assert inside.wait(30)
        pid = os.fork()
        if pid == 0:
            with runtime.single_threaded_blas():  # a limit of its own, set and restored
                pass
            os._exit(0 if done.is_set() and blas_threads() == original else 3)
        assert wait_child(pid, 60) == 0
        holder.join(30)
        assert blas_threads() == original
        print("ok")
        """,
        tmp_path,
    )


def test_fork_waits_for_a_compile_in_another_thread(tmp_path):
    # A server forking while another thread compiles a kernel (its first call): the child
    # inherited Numba's compiler lock held and hung at its own first compile. fork() now waits
    # until no thread compiles.
    run_script(
        """
        import numba
        from numba.core.compiler_lock import global_compiler_lock
        from fastpe.kernels.numba import _runtime  # noqa: F401 (fastpe's fork hooks)
        inside, done = threading.Event(), threading.Event()

        def compile_slowly():  # holds the lock as Numba's compiler does while it compiles
            with global_compiler_lock:
                inside.set()
                time.sleep(0.5)
                done.set()

        holder = threading.Thread(target=compile_slowly)
        holder.start()
        assert inside.wait(30)
        pid = os.fork()
        if pid == 0:
            @numba.njit
            def plus_one(x):
                return x + 1

            os._exit(0 if done.is_set() and plus_one(1) == 2 else 3)
        assert wait_child(pid, 30) == 0
        holder.join(30)
        print("ok")
        """,
        tmp_path,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch's wheels bundle libgomp")
def test_kernels_share_torchs_openmp_pool(tmp_path):
    # Two pools on two cores fought: after each torch op its idle OpenMP threads spun on the
    # cores fastpe's TBB workers needed. With torch imported first, fastpe's parallel kernels run
    # on torch's own GNU OpenMP runtime: one runtime in the process, all its threads used; a
    # forked child (where that pool is gone) computes on one thread and says so once.
    pytest.importorskip("torch")
    run_script(
        """
        import warnings
        import numba
        import fastpe.kernels.numba._runtime as runtime
        assert attention_ok()
        assert runtime.threading_layer() == "omp", runtime.threading_layer()
        runtimes = {line.rsplit(maxsplit=1)[-1] for line in open("/proc/self/maps")
                    if os.path.basename(line.rsplit(maxsplit=1)[-1]).startswith("libgomp")}
        assert len(runtimes) == 1 and os.path.dirname(torch.__file__) in runtimes.pop(), runtimes

        @runtime.njit(parallel=True)
        def spread(out):
            for i in numba.prange(out.shape[0]):
                out[i] = numba.get_thread_id()

        def threads_used():  # the most threads seen in 20 calls (workers may wake late)
            most = 0
            for _ in range(20):
                out = np.zeros(4096, np.int64)
                spread(out)
                most = max(most, len(set(out.tolist())))
            return most

        assert threads_used() == numba.get_num_threads(), threads_used()
        pid = os.fork()
        if pid == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ok = attention_ok() and table_ok(31) and threads_used() == 1
                ok = ok and attention_ok()  # the notice comes once
            said = [w for w in caught if "one thread" in str(w.message)]
            os._exit(0 if ok and len(said) == 1 else 3)
        assert wait_child(pid, 120) == 0
        assert attention_ok() and threads_used() == numba.get_num_threads()  # parent unchanged
        print("ok")
        """,
        tmp_path,
        layer="torch",
    )


def test_child_of_a_fork_tbb_cannot_survive_runs_serially(tmp_path):
    # Forked while another live thread had used TBB (or from another thread than the pool's),
    # TBB cannot shut down for fork ("Unable to join threads...") and the child's first parallel
    # region hung now and then (CI, 1 run in 3). The child must get right answers, every time,
    # and say why it runs on one thread.
    run_script(
        """
        import warnings
        import fastpe.kernels.numba._runtime as runtime
        if runtime.THREADING_LAYER != "tbb":
            print("ok"); sys.exit(0)  # the hazard and the fallback are TBB's
        assert attention_ok()
        release = threading.Event()
        def linger():  # attaches to TBB and stays alive through the forks
            attention_ok(); release.wait(120)
        worker = threading.Thread(target=linger, daemon=True)
        worker.start()
        time.sleep(0.5)
        def child_ok():
            return attention_ok() and table_ok(31) and runtime._serial_only
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ok = child_ok()
                said = any("run on one thread" in str(w.message) for w in caught)
                os._exit(0 if said and ok else 3)
            assert wait_child(pid, 120) == 0
        assert not runtime._serial_only and attention_ok()  # the parent stays parallel
        # a fork from a thread other than the pool's is the same hazard
        results = []
        def fork_here():
            pid = os.fork()
            if pid == 0:
                os._exit(0 if child_ok() else 3)
            results.append(wait_child(pid, 120))
        forker = threading.Thread(target=fork_here)
        forker.start(); forker.join(150)
        assert results == [0], results
        release.set()
        print("ok")
        """,
        tmp_path,
    )


def test_serial_and_parallel_twins_keep_their_own_cache(tmp_path):
    # Numba's disk cache is keyed by function name, code and types, not compile options: the
    # serial and parallel compiles of one kernel overwrote each other's entries, so in the next
    # process the "parallel" kernel ran the serial machine code (one thread) or crashed.
    (tmp_path / "twin.py").write_text(
        textwrap.dedent(
            """
            import numba
            import numpy as np
            from fastpe.kernels.numba._runtime import njit

            @njit(parallel=True, cache=True)
            def spread(out):
                for i in numba.prange(out.shape[0]):
                    out[i] = numba.get_thread_id()
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(
        NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path), NUMBA_NUM_THREADS="2"
    )
    for first in ("serial", "parallel", "serial", "parallel"):  # compile, then load, both orders
        run_script(
            f"""
            from twin import spread
            import time
            def threads_used(kernel, calls):
                # the most threads seen in `calls` calls, stopping at 2 or after 15 s: on a
                # loaded CPU (TBB lets the calling thread take every chunk) the worker can miss
                # many calls in a row
                most, deadline = 0, time.monotonic() + 15
                for _ in range(calls):
                    out = np.full(1 << 20, -1.0)
                    kernel(out)
                    most = max(most, len(np.unique(out)))
                    if most == 2 or time.monotonic() > deadline:
                        break
                return most
            order = ["{first}", "parallel" if "{first}" == "serial" else "serial"]
            for name in order:
                serial = name == "serial"
                used = threads_used(spread.serial if serial else spread, 20 if serial else 10**6)
                assert used == (1 if name == "serial" else 2), (name, used)
            print("ok")
            """,
            tmp_path,
            env=env,
        )


@pytest.mark.parametrize("layer", LAYERS)
def test_threads_call_parallel_kernels_concurrently(tmp_path, layer):
    # Under the workqueue layer, concurrent parallel regions abort the whole process.
    run_script(
        """
        errors = []
        def work():
            try:
                for i in range(25):
                    assert attention_ok(), "attention"
                    assert table_ok(17 + i), "table"
            except BaseException as exc:
                errors.append(repr(exc))
        assert attention_ok()  # compile before the threads race
        sys.setswitchinterval(1e-5)
        run_threads(work, 4, 240)
        assert not errors, errors
        print("ok")
        """,
        tmp_path,
        layer=layer,
    )


@pytest.mark.parametrize("layer", LAYERS)
def test_blas_threads_restored_after_concurrent_attention(tmp_path, layer):
    # Overlapping per-call limits saved each other's "1" as the original: afterwards every
    # matmul of the process ran on one thread ([1, 1] instead of [3, 3] here).
    run_script(
        """
        from threadpoolctl import threadpool_limits
        assert attention_ok()
        # 3 BLAS threads, set from a thread that then exits: threadpoolctl lets only the thread
        # that set an OpenBLAS limit change it again while it lives
        setter = threading.Thread(target=lambda: threadpool_limits(limits=3, user_api="blas"))
        setter.start(); setter.join()
        before = blas_threads()
        assert before and min(before) == 3, before

        errors = []
        def work():
            try:
                for _ in range(150):
                    assert attention_ok()
            except BaseException as exc:
                errors.append(repr(exc))
        sys.setswitchinterval(1e-6)  # interleave the threads as much as possible
        run_threads(work, 4, 240)
        assert not errors, errors
        after = blas_threads()
        assert after == before, (before, after)
        print("ok")
        """,
        tmp_path,
        layer=layer,
    )


def test_single_threaded_blas_limits_and_restores(tmp_path):
    run_script(
        """
        from fastpe.kernels.numba._runtime import single_threaded_blas
        from threadpoolctl import threadpool_limits
        setter = threading.Thread(target=lambda: threadpool_limits(limits=3, user_api="blas"))
        setter.start(); setter.join()
        assert set(blas_threads()) == {3}, blas_threads()
        with single_threaded_blas():
            assert set(blas_threads()) == {1}, blas_threads()
        assert set(blas_threads()) == {3}, blas_threads()
        try:
            with single_threaded_blas():
                raise KeyError("inside")
        except KeyError:
            pass
        assert set(blas_threads()) == {3}, blas_threads()
        print("ok")
        """,
        tmp_path,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's layers are checked")
def test_threading_layer_is_fork_safe_unless_the_user_chose(tmp_path):
    run_script(
        """
        assert table_ok(9)
        import numba
        from fastpe.kernels.numba._runtime import threading_layer
        assert numba.threading_layer() == threading_layer(), threading_layer()
        from importlib import metadata
        try:
            metadata.files("tbb")  # pip's TBB, a dependency on Linux x86-64, must be found
            expected = ("tbb",)
        except metadata.PackageNotFoundError:
            expected = ("tbb", "workqueue")
        assert threading_layer() in expected, (threading_layer(), expected)
        print("ok")
        """,
        tmp_path,
    )
    env = dict(os.environ, NUMBA_THREADING_LAYER="omp")
    run_script(
        """
        assert table_ok(9)
        import numba
        assert numba.threading_layer() == "omp", numba.threading_layer()
        print("ok")
        """,
        tmp_path,
        env=env,
    )
    run_script(
        """
        import numba
        numba.config.THREADING_LAYER = "omp"  # chosen in code before fastpe's first kernel
        assert table_ok(9)
        assert numba.threading_layer() == "omp", numba.threading_layer()
        print("ok")
        """,
        tmp_path,
    )


def _read_only_install(tmp_path) -> pathlib.Path:
    """fastpe laid out as installed (fastpe/kernels inside fastpe), with nowhere to cache.

    chmod stops other users; a root test process ignores it, so every place Numba could write
    to is also made impossible for anyone: a plain file named __pycache__ in each package
    folder, and HOME / XDG_CACHE_HOME (the user cache directory) pointing at a file."""
    site = tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "fastpe", site / "fastpe", ignore=ignore)
    shutil.copytree(ROOT / "kernels", site / "fastpe" / "kernels", ignore=ignore)
    for folder in [site, *site.rglob("*")]:
        if folder.is_dir():
            (folder / "__pycache__").write_text("")
    for path in [site, *site.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    return site


def test_read_only_install_without_cache_still_runs_numba(tmp_path):
    # Numba raised "cannot cache function ...: no locator available" on every op.
    site = _read_only_install(tmp_path)
    not_a_dir = tmp_path / "home-is-a-file"
    not_a_dir.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(PYTHONPATH=str(site), HOME=str(not_a_dir), XDG_CACHE_HOME=str(not_a_dir))
    try:
        run_script(
            f"""
            import warnings
            assert fastpe.__file__.startswith({str(site)!r}), fastpe.__file__
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert table_ok(21)
                cos, sin = fastpe.rope_table(19, 8, backend="numba")
                ref_cos, ref_sin = fastpe.rope_table(19, 8, backend="numpy")
                assert np.allclose(cos, ref_cos, atol=1e-6) and np.allclose(sin, ref_sin, atol=1e-6)
            notes = [w for w in caught if "no writable cache" in str(w.message)]
            assert len(notes) == 1, [str(w.message) for w in caught]  # once per process
            assert "NUMBA_CACHE_DIR" in str(notes[0].message)
            print("ok")
            """,
            tmp_path,
            env=env,
        )
    finally:
        for path in [site, *site.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


def test_cache_notices_a_change_in_an_imported_helper(tmp_path):
    # Numba keys its disk cache on the file that holds a kernel only: after an edit to a jitted
    # helper the kernel imports from another file (here the half conversions in _half.py), the
    # next process loaded the old machine code. fastpe keys entries on every kernel file too.
    site = tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "fastpe", site / "fastpe", ignore=ignore)
    shutil.copytree(ROOT / "kernels", site / "fastpe" / "kernels", ignore=ignore)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(PYTHONPATH=str(site), NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    body = """
        from fastpe.kernels.numba.apply_rope import _apply_rope_kernel
        x = np.ones((1, 2, 3, 8), np.float32)
        cos, sin = fastpe.rope_table(4, 8, backend="numpy")
        fastpe.apply_rope(x, cos, sin, backend="numba")
        stats = _apply_rope_kernel.serial.stats
        print("hits", sum(stats.cache_hits.values()), "misses", sum(stats.cache_misses.values()))
        print("ok")
        """
    counts = []
    for edit in (False, False, True):
        if edit:  # a change that alters no behaviour, in the helper file only
            with open(site / "fastpe" / "kernels" / "numba" / "_half.py", "a") as f:
                f.write("\n# edited\n")
        output = run_script(body, tmp_path, env=env)
        counts.append(next(line for line in output.splitlines() if line.startswith("hits")))
    assert counts == ["hits 0 misses 1", "hits 1 misses 0", "hits 0 misses 1"], counts


def test_processes_compile_a_kernel_once_and_a_failed_compile_frees_it(tmp_path):
    # Processes that start together on an empty cache (ranks, workers) each compiled every
    # kernel; the compile lock makes one compile while the others wait and load its result. A
    # compile made slow on purpose (a listener that sleeps as it starts) keeps them together.
    (tmp_path / "slow.py").write_text(
        textwrap.dedent(
            """
            import time
            from numba.core import event
            from fastpe.kernels.numba._runtime import njit

            class _Slow(event.Listener):
                def on_start(self, ev):
                    time.sleep(1.5)
                def on_end(self, ev):
                    pass

            event.register("numba:compile", _Slow())

            @njit(cache=True)
            def twice(x):
                return 2 * x
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path))
    run_script(
        """
        import multiprocessing as mp

        def together(barrier, results):
            from slow import twice
            barrier.wait()
            assert twice(21.0) == 42.0
            results.put(twice.stats.cache_misses.total())  # compiles (loads are hits)

        def fails_then_waits(failed, done):
            from slow import twice
            try:
                twice(None)  # 2 * None: the compile fails at typing
            except Exception:
                pass
            failed.set()
            done.wait(60)

        def after_failure(failed, results):
            from slow import twice
            failed.wait(60)
            start = time.monotonic()
            twice(3)
            results.put(time.monotonic() - start)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            barrier, results = ctx.Barrier(3), ctx.Queue()
            procs = [ctx.Process(target=together, args=(barrier, results)) for _ in range(3)]
            [p.start() for p in procs]
            compiles = [results.get(timeout=120) for _ in procs]
            [p.join() for p in procs]
            assert sorted(compiles) == [0, 0, 1], compiles
            failed, done = ctx.Event(), ctx.Event()
            first = ctx.Process(target=fails_then_waits, args=(failed, done))
            second = ctx.Process(target=after_failure, args=(failed, results))
            first.start(); second.start()
            seconds = results.get(timeout=120)
            done.set(); first.join(); second.join()
            assert seconds < 30, seconds  # not held until COMPILE_WAIT_LIMIT by the failure
            print("ok")
        """,
        tmp_path,
        env=env,
    )


def test_kernels_are_optimised_once_with_what_they_call_linked_in(tmp_path):
    # Numba finalises every library in full: each helper a kernel calls and the three libraries
    # it wraps a prange body in, each re-optimised and emitted before the kernel links them and
    # does it again. fastpe's kernels finalise all of those as link-only: LLVM's module passes
    # run once per kernel (and once for Numba's runtime library). Other code's functions in the
    # same process keep Numba's own path; the kernels' cached machine code loads and runs in a
    # new process.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    script = """
        import numba
        from numba.core import codegen
        from fastpe.kernels.numba import _runtime

        optimised = []  # the libraries that ran LLVM's module passes, in order
        run = codegen.CPUCodeLibrary._optimize_final_module
        def recording(self):
            optimised.append(str(self.name))
            run(self)
        codegen.CPUCodeLibrary._optimize_final_module = recording
        levels = set()  # the per-function pass levels asked for (None: Numba's own)
        passes = codegen.JITCPUCodegen._function_pass_manager
        def recording_level(self, **kwargs):
            levels.add(kwargs.get("opt"))
            return passes(self, **kwargs)
        codegen.JITCPUCodegen._function_pass_manager = recording_level

        def intermediates(names):
            return [n for n in names if n.startswith("__numba_parfor_gufunc")
                    or n == "parallelgufuncwrapper" or "_GufuncWrapper" in n]

        assert _runtime.LINK_ONLY
        assert table_ok(300)
        assert attention_ok()  # a parallel kernel calling a dozen helpers
        compiled = list(_runtime.compiled_kernels)
        print("compiled", compiled)
        if {loaded}:
            assert compiled == [], compiled
        else:
            assert compiled == [
                "sinusoidal_table._sinusoidal_table_numba", "attention._attention_numba"
            ], compiled
            assert [n for n in optimised if n != "nrt"] == [
                "_sinusoidal_table_numba", "_attention_numba"
            ], optimised
            # the helpers' own clean-up is light: the kernel optimises their code in full
            assert levels == {{None, 1}}, levels
            # a call without soft-cap, mask or biases compiles none of their code
            from fastpe.kernels.numba import _attention_common as common
            modifiers = (common._apply_modifiers, common._softcap, common._apply_tile_masks)
            assert not any(f.signatures for f in modifiers), modifiers

        levels.clear()

        optimised.clear()

        @numba.njit
        def their_helper(x):
            return 2.0 * x

        @numba.njit(parallel=True)
        def theirs(x):
            out = np.empty_like(x)
            for i in numba.prange(x.shape[0]):
                out[i] = their_helper(x[i])
            return out

        x = np.arange(1000.0)
        assert np.array_equal(theirs(x), 2.0 * x)
        assert len(intermediates(optimised)) == 3, optimised
        assert "their_helper" in optimised, optimised
        assert levels == {{None}}, levels
        print("ok")
        """
    for loaded in (False, True):  # compile into the empty cache, then load from it
        run_script(script.format(loaded=loaded), tmp_path, env=env)


TOY_KERNELS = """
import sys
from fastpe.kernels.numba import _runtime

sys.modules["fastpe.kernels.numba.toy"] = sys.modules[__name__]  # as if in fastpe's kernel folder

def helper(x):
    return 2.0 * x

def kernel(x):
    return helper(x) + 1.0

def other_kernel(x):
    return helper(x) - 1.0

for f in (helper, kernel, other_kernel):
    f.__module__ = "fastpe.kernels.numba.toy"
helper = _runtime.njit(cache=True)(helper)
kernel = _runtime.njit(cache=True)(kernel)
other_kernel = _runtime.njit(cache=True)(other_kernel)
"""


def test_a_helper_compiled_inside_a_kernel_still_runs_from_python(tmp_path):
    # A helper compiled inside a kernel's compile is link-only: code for the kernel to link, a
    # null entry point, and LLVM bitcode in the disk cache. Calling it from Python afterwards
    # (with the signature the kernel used) compiles it in full instead of jumping to that
    # address, in that process and in a new one whose cache holds the bitcode; a kernel compiled
    # in a new process links the cached helper without compiling it.
    (tmp_path / "toy_kernels.py").write_text(TOY_KERNELS)  # once: Numba's cache keys its stamp
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path))
    script = """
        from fastpe.kernels.numba import _runtime
        from fastpe.kernels.numba._link_only_codegen import is_link_only
        from toy_kernels import helper, kernel, other_kernel
        from numba.core import event

        compiles = []  # every compile, nested ones included

        class Record(event.Listener):
            def on_start(self, ev):
                compiles.append(ev.data["dispatcher"].py_func.__name__)

            def on_end(self, ev):
                pass

        event.register("numba:compile", Record())

        if {phase} == 0:  # empty cache
            assert kernel(3.0) == 7.0
            (compiled,) = helper.overloads.values()
            assert is_link_only(compiled.library) == _runtime.LINK_ONLY
            assert helper(3.0) == 6.0
            (compiled,) = helper.overloads.values()
            assert not is_link_only(compiled.library)
            assert kernel(5.0) == 11.0
            expected = ["kernel", "helper", "helper"]
        elif {phase} == 1:  # the helper's cache entry is its full compile: start again
            import shutil
            shutil.rmtree(os.environ["NUMBA_CACHE_DIR"])
            assert kernel(3.0) == 7.0
            expected = ["kernel", "helper"]
        else:  # the cache holds the kernel and the helper's code to link
            assert other_kernel(3.0) == 5.0  # links the cached helper
            assert helper(3.0) == 6.0  # a Python call does not load the bitcode entry
            assert kernel(3.0) == 7.0  # loaded
            expected = ["other_kernel", "helper"]
        assert compiles == expected, compiles
        print("ok")
        """
    for phase in (0, 1, 2):
        run_script(script.format(phase=phase), tmp_path, env=env)


def test_a_warm_process_loads_kernels_without_compiler_setup(tmp_path):
    # Loading cached machine code skips what only compiling needs: Numba's context refresh
    # (every registry it has) and scipy.linalg's package (only its cython_blas extension is
    # loaded, for the kernels' products). The kernel still gives the oracle's values; a compile
    # later in the process still sees every registry; scipy.linalg imported afterwards still
    # exposes cython_blas as usual.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), FASTPE_QUIET_COMPILE="1")
    script = tmp_path / "warm.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import numpy as np
            import fastpe
            from fastpe.kernels.numba import _runtime

            rng = np.random.default_rng(3)
            q, k, v = (rng.standard_normal((1, 4, 300, 32)).astype(np.float32) for _ in range(3))
            expected = fastpe.attention(q, k, v, causal=True, backend="numpy")
            got = fastpe.attention(q, k, v, causal=True, backend="numba")
            assert np.allclose(got, expected, atol=1e-5, rtol=1e-5)
            if sys.argv[1] == "fill":
                print("ok")
                sys.exit()

            assert _runtime.compiled_kernels == [], _runtime.compiled_kernels
            assert "scipy.linalg" not in sys.modules
            assert "numba.np.arraymath" not in sys.modules  # refresh imports it

            import numba

            @numba.njit
            def theirs(x):  # np.sum and array arithmetic: registries the refresh installs
                return np.sum(2.0 * x)

            assert theirs(np.array([3.0, 1.0, 2.0])) == 12.0
            table = fastpe.sinusoidal_table(300, 16, backend="numba")  # a new fastpe compile
            assert _runtime.compiled_kernels == ["sinusoidal_table._sinusoidal_table_numba"]
            expected_table = fastpe.sinusoidal_table(300, 16, backend="numpy")
            assert np.allclose(table, expected_table, atol=1e-6, rtol=0)

            import scipy.linalg.cython_blas

            assert "sgemm" in scipy.linalg.cython_blas.__pyx_capi__
            from scipy.linalg import cython_blas

            assert cython_blas is sys.modules["scipy.linalg.cython_blas"]
            a = np.arange(4.0).reshape(2, 2)
            assert np.array_equal(scipy.linalg.blas.dgemm(1.0, a, a), a @ a)
            print("ok")
            """
        )
    )
    for step in ("fill", "load"):
        result = subprocess.run(
            [sys.executable, str(script), step],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=TIMEOUT,
            check=False,
        )
        assert result.returncode == 0 and "ok" in result.stdout.splitlines(), (
            f"{step}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
