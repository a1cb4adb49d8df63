"""Compile the CPU kernels a workload will use, ahead of its first call (``fastpe warmup``).

Numba compiles a kernel once per *specialisation* — argument dtypes, array dimensions and
layouts — and fastpe keeps each compiled kernel in a parallel and a serial twin (calls too small
to be worth waking the thread pool run on the calling thread), and attention compiles
decode-shaped (few query rows per kv head) and prefill-shaped calls apart. A workload's
first calls would compile each of them on the spot, seconds apiece. ``warmup`` makes those calls
itself — the real public ops, on small inputs of the same kinds (dtype, framework, options) and
of the sizes that pick each twin and path — so that every specialisation lands in the disk
cache, and a later process loads it in milliseconds.

The plan is made of items, one per (op, dtype) with the workload's features; each item runs in
a worker process (``jobs``), and at the end one more fresh process repeats every call and counts
what it still had to compile, so "0 compiles" in the check is the proof that later processes
start warm. Workers that need the same kernel (the helpers every attention item shares) compile
it once: the others wait for it on the cache's compile lock (``_runtime._KernelCache``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

from fastpe import api
from fastpe._options import AttentionOptions

# the ops whose CPU kernels warmup knows how to call (every public op)
OPS = api.OPS
DTYPES = ("float32", "float64", "float16", "bfloat16")
# the attention options a workload's calls may use: the options record's features (the lse
# changes no kernel), then what else decides which kernels run
_OPTIONS = tuple(feature for feature in AttentionOptions.FEATURES.values() if feature != "lse")
FEATURES = (*_OPTIONS, "mask", "decode", "paged", "backward")
# the features each op takes (others in the set are ignored for that op)
_OP_FEATURES = {
    "attention": {*_OPTIONS, "mask", "decode", "backward"},
    "attention_varlen": {*_OPTIONS, "decode", "backward"},
    "attention_kvcache": {*_OPTIONS, "paged"},
    "apply_rope": {"backward"},
    "embed": {"backward"},
}


@dataclasses.dataclass(frozen=True)
class Item:
    """One warmup task: an op in a dtype with the features its calls use, on inputs shaped like
    the workload's heads (the shapes themselves do not matter to the compiled code)."""

    op: str
    dtype: str
    features: tuple[str, ...] = ()
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    window: int = 4
    softcap: float = 30.0

    @property
    def label(self) -> str:
        return " ".join([self.op, self.dtype, *self.features])


@dataclasses.dataclass
class Result:
    item: Item
    seconds: float
    compiled: list[str]  # kernels this item compiled (empty: all were in the cache)
    error: str | None = None


# --------------------------------------------------------------------------- model configs


def read_model_config(source) -> dict:
    """The attention shape of a transformers model config: a ``config.json`` path, a directory
    holding one, a dict, a ``PretrainedConfig`` or a Hub name found in the local Hugging Face
    cache (nothing is downloaded).

    Returns {"heads", "kv_heads", "head_dim", "window", "softcap", "sinks", "dtype", "name"}."""
    config = _load_config(source)
    if isinstance(config.get("text_config"), dict):  # multimodal configs nest the language model
        config = {**config["text_config"], "model_type": config.get("model_type")}
    heads = config.get("num_attention_heads")
    if not heads:
        raise ValueError(f"{_name(source)}: the config has no num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads)
    if not head_dim:
        raise ValueError(f"{_name(source)}: the config has neither head_dim nor hidden_size")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    dtype = dtype.removeprefix("torch.")
    from fastpe.integrations.transformers import config_attention_options

    return {
        "name": _name(source),
        "heads": int(heads),
        "kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        **config_attention_options(config),
        "dtype": dtype if dtype in DTYPES else "float32",
    }


def _name(source) -> str:
    return source if isinstance(source, str | os.PathLike) else type(source).__name__


def _load_config(source) -> dict:
    if isinstance(source, dict):
        return source
    if hasattr(source, "to_dict"):  # a transformers PretrainedConfig
        return source.to_dict()
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        found = _cached_hub_config(os.fspath(source))
        if found is None:
            raise FileNotFoundError(
                f"{os.fspath(source)}: no such config.json or directory, and no model of that "
                f"name in the local Hugging Face cache (warmup never downloads)"
            )
        path = found
    with open(path) as f:
        return json.load(f)


def _cached_hub_config(name: str) -> str | None:
    """config.json of a Hub model already in the local Hugging Face cache, or None."""
    if name.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(name, "config.json")
    return found if isinstance(found, str) else None


# --------------------------------------------------------------------------- the plan


def plan(ops=None, dtypes=None, features=None, model_config=None, flash=False) -> list[Item]:
    """The warmup items for ``ops`` x ``dtypes`` with ``features``, or for a model config.

    With ``model_config``, the defaults are those of a transformers model running through
    ``register()`` (``flash``: ``register_flash()``, whose calls go to attention_varlen and
    attention): the attention op in the config's dtype, causal, prefill and decode shapes, with
    the config's sliding window, softcap and sinks; ``ops``/``dtypes``/``features`` given
    explicitly replace those defaults (features are added to the config's)."""
    shape = {}
    if model_config is not None:
        model = read_model_config(model_config)
        shape = {k: model[k] for k in ("heads", "kv_heads", "head_dim")}
        # the options the config turns on are features, with their values (sinks: a flag; the
        # calls make their own)
        options = {name: model[name] for name in _OPTIONS if model.get(name)}
        shape |= {name: value for name, value in options.items() if value is not True}
        ops = ops or (["attention_varlen", "attention"] if flash else ["attention"])
        dtypes = dtypes or [model["dtype"]]
        features = {"causal", "decode", *(features or ()), *options}
    ops = list(dict.fromkeys(ops or ["attention"]))
    dtypes = list(dict.fromkeys(dtypes or ["float32"]))
    features = set(features or ())
    for kind, given, known in (
        ("op", ops, OPS),
        ("dtype", dtypes, DTYPES),
        ("feature", features, FEATURES),
    ):
        unknown = [x for x in given if x not in known]
        if unknown:
            raise ValueError(f"unknown {kind} {unknown}; choose from {', '.join(known)}")
    items = []
    for op in ops:
        mine = tuple(f for f in FEATURES if f in features and f in _OP_FEATURES.get(op, ()))
        for dtype in dtypes:
            items.append(Item(op, dtype, mine, **shape))
    return items


# --------------------------------------------------------------------------- the calls


class _Maker:
    """Inputs of one item's framework and dtype: NumPy for float32/float64, torch for the half
    types (NumPy has no bfloat16) and for gradients."""

    def __init__(self, item: Item):
        self.item = item
        self.rng = np.random.default_rng(0)
        self.torch = item.dtype in ("float16", "bfloat16") or "backward" in item.features
        if self.torch:
            import torch

            self._torch = torch

    def floats(self, *shape, grad=False):
        x = self.rng.standard_normal(shape).astype(np.float32)
        if not self.torch:
            return x.astype(self.item.dtype)
        t = self._torch.from_numpy(x).to(getattr(self._torch, self.item.dtype))
        return t.requires_grad_(grad and "backward" in self.item.features)

    def ints(self, values, dtype=np.int64):
        x = np.asarray(values, dtype=dtype)
        return self._torch.from_numpy(x) if self.torch else x

    def host(self, x):  # a float32 array in the item's framework (tables, slopes, sinks)
        x = np.asarray(x, np.float32)
        return self._torch.from_numpy(x) if self.torch else x

    def backward(self, out):
        if self.torch and "backward" in self.item.features:
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()


def _serial_limits() -> tuple[int, int]:
    """(attention work, elements) above which the kernels run parallel rather than serially:
    read from the kernel modules, so the sizes below keep picking each twin if they change."""
    from fastpe.kernels.numba import apply_rope, attention

    return attention.SERIAL_WORK, apply_rope.SERIAL_ELEMENTS


def _attention_kwargs(item: Item, make: _Maker, positions: int) -> dict:
    f = set(item.features)
    kwargs = {"causal": "causal" in f}
    if "window" in f:
        kwargs["window"] = (item.window - 1, 0) if "causal" in f else (item.window, item.window)
    if "softcap" in f:
        kwargs["softcap"] = item.softcap
    if "sinks" in f:
        kwargs["sinks"] = make.floats(item.heads)
    if "alibi" in f:
        kwargs["alibi_slopes"] = make.host(2.0 ** -np.arange(1, item.heads + 1))
    if "rope" in f:
        import fastpe

        cos, sin = fastpe.rope_table(positions, item.head_dim, backend="numpy")
        kwargs["rope"] = {"cos": make.host(cos), "sin": make.host(sin)}
    return kwargs


def _long(work_limit: int, per_key: int) -> int:
    """A length whose call does more than ``work_limit`` work at ``per_key`` per key²/key."""
    return int(math.isqrt(work_limit // per_key)) + 17


def _calls(item: Item):
    """(description, thunk) for each call of the item."""
    import fastpe

    make = _Maker(item)
    work, elements = _serial_limits()
    h, hkv, d, dt = item.heads, item.kv_heads, item.head_dim, item.dtype
    calls = []
    if item.op in ("sinusoidal_table", "rope_table"):
        fn = getattr(fastpe, item.op)
        # half tables exist only as torch tensors, which a device= asks for
        where = {"device": "cpu"} if make.torch else {}
        for n in (8, elements // 64 + 8):
            calls.append(
                (f"{n} positions", lambda n=n: fn(n, 64, dtype=dt, backend="numba", **where))
            )
    elif item.op == "apply_rope":
        for seq in (4, elements // (h * d) + 4):
            cos, sin = fastpe.rope_table(seq + 8, d, backend="numpy")
            cos, sin = make.host(cos), make.host(sin)

            def rope(seq=seq, cos=cos, sin=sin):
                q, k = make.floats(1, h, seq, d, grad=True), make.floats(1, hkv, seq, d, grad=True)
                make.backward(fastpe.apply_rope(q, cos, sin, backend="numba"))
                # the (q, k) pair of a decode step, in one launch
                make.backward(fastpe.apply_rope((q, k), cos, sin, positions=3, backend="numba"))
                x = make.floats(1, seq, h, d, grad=True)
                make.backward(fastpe.apply_rope(x, cos, sin, layout="bshd", backend="numba"))
                # in place, the kernel reads and writes one array: compiled apart
                q, k = make.floats(1, seq, h, d), make.floats(1, seq, hkv, d)
                fastpe.apply_rope(q, cos, sin, layout="bshd", inplace=True, backend="numba")
                fastpe.apply_rope(
                    (q, k), cos, sin, positions=3, layout="bshd", inplace=True, backend="numba"
                )

            calls.append((f"{seq} positions", rope))
    elif item.op == "embed":
        for seq in (4, elements // 64 + 4):

            def embed(seq=seq):
                weight = make.floats(100, 64, grad=True)
                ids = make.ints(np.arange(seq) % 100)[None]
                for pe in ("sinusoidal", None):
                    make.backward(fastpe.embed(ids, weight, pe=pe, backend="numba"))
                table = make.floats(seq, 64)
                make.backward(
                    fastpe.embed(ids, weight, pe="table", pe_table=table, backend="numba")
                )

            calls.append((f"{seq} tokens", embed))
    elif item.op == "merge_attention":

        def merge():
            out_a, out_b = make.floats(1, h, 16, d), make.floats(1, h, 16, d)
            lse = make.host(np.zeros((1, h, 16)))
            fastpe.merge_attention(out_a, lse, out_b, lse, backend="numba")

        calls.append(("16 positions", merge))
    elif item.op == "attention":
        # serial: Sq 16 is decode-shaped (K and V read in place) with one query head per kv
        # head, Sq 17 prefill-shaped (K and V packed) whatever the heads; parallel: a long prefill
        sizes = [(16, 16), (17, 17), (_long(work, h * 2 * d),) * 2]
        if "decode" in item.features:  # one query row against a long or short cache
            sizes += [(1, 16), (1, work // (h * 2 * d) + 300)]
        for sq, sk in sizes:

            def attend(sq=sq, sk=sk):
                q = make.floats(1, h, sq, d, grad=True)
                k, v = make.floats(1, hkv, sk, d, grad=True), make.floats(1, hkv, sk, d, grad=True)
                kwargs = _attention_kwargs(item, make, sk)
                if "mask" in item.features:  # a padding mask as transformers builds it
                    mask = np.ones((1, 1, sq, sk), bool)
                    kwargs["mask"] = make._torch.from_numpy(mask) if make.torch else mask
                out, lse = fastpe.attention(q, k, v, return_lse=True, backend="numba", **kwargs)
                make.backward(out)
                if "mask" in item.features:
                    # transformers builds a padding mask for padded batches only; its other
                    # calls, without one, may run the version compiled without any score
                    # modifier (docs/first-calls.md)
                    unmasked = {key: value for key, value in kwargs.items() if key != "mask"}
                    make.backward(fastpe.attention(q, k, v, backend="numba", **unmasked))
                if sq == 1 and "backward" not in item.features:  # split-key decoding merges
                    fastpe.merge_attention(out, lse, out, lse, backend="numba")

            calls.append((f"Sq {sq} Sk {sk}", attend))
    elif item.op == "attention_varlen":
        sizes = [(16, 16), (_long(work, h * 2 * d),) * 2]
        if "decode" in item.features:
            sizes += [(1, 16), (1, work // (h * 2 * d) + 300)]
        for sq, sk in sizes:

            def varlen(sq=sq, sk=sk):
                q = make.floats(2 * sq, h, d, grad=True)
                k, v = (
                    make.floats(2 * sk, hkv, d, grad=True),
                    make.floats(2 * sk, hkv, d, grad=True),
                )
                cu_q, cu_k = (
                    make.ints([0, sq, 2 * sq], np.int32),
                    make.ints([0, sk, 2 * sk], np.int32),
                )
                kwargs = _attention_kwargs(item, make, sk)
                make.backward(
                    fastpe.attention_varlen(q, k, v, cu_q, cu_k, backend="numba", **kwargs)
                )

            calls.append((f"2 x Sq {sq} Sk {sk}", varlen))
    elif item.op == "attention_kvcache":
        for sq, sk in [
            (1, 16),
            (1, work // (h * 2 * d) + 300),
            (16, 32),
            (_long(work, h * 2 * d), _long(work, h * 2 * d) + 16),
        ]:

            def kvcache(sq=sq, sk=sk):
                kwargs = _attention_kwargs(item, make, sk + sq)
                rope = kwargs.pop("rope", None)
                if rope is not None:
                    kwargs.update(rotary_cos=rope["cos"], rotary_sin=rope["sin"])
                lengths = make.ints([sk - sq], np.int32)
                q = make.floats(1, sq, h, d)
                k_new, v_new = make.floats(1, sq, hkv, d), make.floats(1, sq, hkv, d)
                k_cache, v_cache = make.floats(1, sk, hkv, d), make.floats(1, sk, hkv, d)
                fastpe.attention_kvcache(
                    q,
                    k_cache,
                    v_cache,
                    k_new,
                    v_new,
                    cache_seqlens=lengths,
                    backend="numba",
                    **kwargs,
                )
                if "paged" in item.features:  # pages of 16 rows, in reverse order
                    pages = -(-sk // 16)
                    k_pages, v_pages = (
                        make.floats(pages, 16, hkv, d),
                        make.floats(pages, 16, hkv, d),
                    )
                    table = make.ints(np.arange(pages)[::-1].copy()[None], np.int32)
                    fastpe.attention_kvcache(
                        q,
                        k_pages,
                        v_pages,
                        k_new,
                        v_new,
                        cache_seqlens=lengths,
                        block_table=table,
                        backend="numba",
                        **kwargs,
                    )

            calls.append((f"Sq {sq} cache {sk}", kvcache))
    return calls


def run_item(item: Item) -> Result:
    """Make every call of ``item`` in this process; what it compiled (by kernel name)."""
    from fastpe.kernels.numba import _runtime

    start = time.perf_counter()
    before = len(_runtime.compiled_kernels)
    try:
        for _, call in _calls(item):
            call()
    except Exception as exc:  # noqa: BLE001 - reported per item; the other items still run
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return Result(item, time.perf_counter() - start, _runtime.compiled_kernels[before:], error)
    return Result(item, time.perf_counter() - start, _runtime.compiled_kernels[before:])


def _run_items(items: list[Item]) -> list[Result]:  # a worker's whole share (the check pass)
    return [run_item(item) for item in items]


def _quiet_worker() -> None:
    # the workers' own compile notices would repeat what the progress lines already say
    os.environ["FASTPE_QUIET_COMPILE"] = "1"


# --------------------------------------------------------------------------- the driver


@dataclasses.dataclass
class Report:
    results: list[Result]
    check: list[Result]  # the fresh process's pass: compiles it still needed
    cache_dir: str | None
    seconds: float
    jobs: int

    @property
    def ok(self) -> bool:
        return not any(r.error for r in self.results + self.check)

    def summary(self) -> str:
        compiled = sum(len(r.compiled) for r in self.results)
        lines = [
            f"warmup: {len(self.results)} item(s) in {self.seconds:.1f} s "
            + (f"on {self.jobs} worker process(es)" if self.jobs > 0 else "in this process")
            + f"; {compiled} kernel compile(s)"
            + ("" if compiled else " (everything was already in the cache)")
        ]
        for r in self.results:
            status = f"failed: {r.error}" if r.error else f"{len(r.compiled)} compiled"
            lines.append(f"  {r.item.label:48s} {r.seconds:6.1f} s  {status}")
        if self.check:
            again = sorted({name for r in self.check for name in r.compiled})
            lines.append(
                "check: a fresh process loaded every kernel from the cache"
                if not again
                else f"check: a fresh process had to compile {len(again)} kernel(s) again, now "
                f"cached: {', '.join(again)}"
            )
        lines.append(
            f"cache: {self.cache_dir}"
            if self.cache_dir
            else "cache: none (no writable cache directory: set NUMBA_CACHE_DIR), so nothing "
            "was kept for later processes"
        )
        return "\n".join(lines)


# the ops whose items compile for tens of seconds (the attention kernels and their twins)
_HEAVY = {"attention", "attention_varlen", "attention_kvcache"}


def default_jobs(items: list[Item]) -> int:
    """Worker processes for ``items``: one per heavy item up to one per CPU, or none (this
    process) for at most one heavy item. Each worker pays a Python start and the numba import
    before compiling, which only long compiles repay: on the 2-core CI machine, under load,
    float32 + bfloat16 attention took 33 s on 2 workers against 41 s on 1, while the four table
    and RoPE ops took 17-24 s on 2 workers against 11-16 s on 1."""
    heavy = sum(item.op in _HEAVY for item in items)
    return min(heavy, os.cpu_count() or 1) if heavy > 1 else 0


def warmup(
    ops=None,
    dtypes=None,
    features=None,
    *,
    model_config=None,
    flash=False,
    jobs=None,
    check=True,
    progress=True,
) -> Report:
    """Compile, and keep in the disk cache, the CPU kernels a workload will call.

    ``ops`` (default ["attention"]), ``dtypes`` (default ["float32"]) and ``features``
    (``causal window softcap sinks alibi rope mask decode paged backward``: those the workload's
    calls use together) — or ``model_config`` (a transformers config, ``config.json`` path or
    directory; see ``plan``). Items run in ``jobs`` worker processes (0: in this process;
    default: ``default_jobs``), then with ``check`` a fresh process makes every call again and
    reports (and compiles) anything still missing. ``progress`` prints a
    line per item on stderr. Returns a ``Report`` (``print(report.summary())``).
    """
    items = plan(ops, dtypes, features, model_config, flash)
    jobs = default_jobs(items) if jobs is None else jobs
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    if jobs > 0 and cache_directory() is None:
        # workers could keep nothing for this process: compile here, where it is used
        say(
            "fastpe warmup: no writable kernel cache (set NUMBA_CACHE_DIR), compiling in this "
            "process only"
        )
        jobs = 0
    start = time.perf_counter()
    results: list[Result] = []

    def done(result: Result) -> None:
        results.append(result)
        status = f"failed: {result.error}" if result.error else f"{len(result.compiled)} compiled"
        say(f"[{len(results)}/{len(items)}] {result.item.label}  {result.seconds:.1f} s  {status}")

    where = f"{jobs} worker process(es)" if jobs > 0 else "this process"
    say(f"fastpe warmup: {len(items)} item(s) in {where}")
    if jobs <= 0:
        quiet = os.environ.get("FASTPE_QUIET_COMPILE")
        os.environ["FASTPE_QUIET_COMPILE"] = "1"  # the progress lines say it already
        try:
            for item in items:
                done(run_item(item))
        finally:
            if quiet is None:
                del os.environ["FASTPE_QUIET_COMPILE"]
            else:
                os.environ["FASTPE_QUIET_COMPILE"] = quiet
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a fresh interpreter per worker (a fork of this process would inherit its
        # Numba threads and, under a test runner or a server, much else)
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_quiet_worker) as pool:
            from concurrent.futures import as_completed

            for future in as_completed([pool.submit(run_item, item) for item in items]):
                done(future.result())
    order = {item: i for i, item in enumerate(items)}
    results.sort(key=lambda r: order[r.item])
    checked: list[Result] = []
    if check and cache_directory() is not None:
        say("check: a fresh process repeats every call…")
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=context, initializer=_quiet_worker) as pool:
            checked = pool.submit(_run_items, items).result()
    return Report(results, checked, cache_directory(), time.perf_counter() - start, jobs)


# --------------------------------------------------------------------------- the cache


def cache_directory() -> str | None:
    """Where fastpe's compiled CPU kernels are kept (None: nowhere writable, in-memory only)."""
    from fastpe.kernels.numba import _runtime

    return _runtime.cache_directory()


def cache_stats() -> dict:
    """{"directory", "bytes", "kernels" (compiled specialisations), "functions", "variants"
    (generated flex_attention modules)}."""
    from fastpe.kernels.numba import _runtime

    return _runtime.cache_stats()


def clear_cache() -> dict:
    """Remove fastpe's compiled kernels and generated flex_attention variants from the cache
    (nothing else); what was removed."""
    from fastpe.kernels.numba import _runtime

    return _runtime.clear_cache()
