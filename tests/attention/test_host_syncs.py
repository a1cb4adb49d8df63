"""Host syncs per call on GPU tensors, counted without a GPU.

fastpe's host code is traced on CPU tensors that it takes for GPU tensors (``_arrays.on_gpu``
answers True), with the Triton kernels themselves stubbed out (the interpreter would read every
tensor). ``SyncTrace`` records each torch call that on CUDA would stall the host:

- device reads, which wait for the GPU to reach them: ``Tensor.item``, ``__bool__``,
  ``__int__``, ``__float__``, ``__index__`` (a Python number or truth value from a tensor),
  ``tolist``, ``numpy``/``cpu``/``.to("cpu")`` (a host copy), ``torch.equal`` (returns a Python
  bool), and the ops whose output size depends on the data: ``nonzero``, ``unique``,
  ``masked_select``, ``repeat_interleave`` without ``output_size``, indexing with a bool tensor;
- blocking uploads of host data: ``.to(device)``/``.cuda()`` of a tensor made from host data
  (``torch.from_numpy``, or ``as_tensor``/``tensor`` of a list or array without ``device=``),
  ``torch.as_tensor``/``torch.tensor``/``Tensor.new_tensor`` of host data with ``device=``,
  and ``copy_`` from such a tensor (pageable host memory: cudaMemcpy returns when the copy is
  staged, which waits for the stream).

Not counted: ``torch._assert_async`` (a check on the device that stops later work there, with
no host wait), ``aminmax``/``any``/``all`` without a Python conversion (their results stay on
the device), shapes, strides, ``data_ptr``, allocations and device-to-device ops.

The planned calls must make none; the plan-less calls of the same step, the contrast that
lets this test fail, make some.
"""

import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import fastpe  # noqa: E402
from fastpe import _arrays  # noqa: E402
from fastpe.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402

READS = frozenset(
    {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "cpu", "equal"}
    | {"nonzero", "unique", "masked_select", "__array__"}
)
FACTORIES_OF_DATA = frozenset({"as_tensor", "tensor", "new_tensor"})


class SyncTrace(torch.overrides.TorchFunctionMode):
    """Counts device reads and blocking uploads (see the module docstring). Every tensor is a
    "device" tensor but those made from host data (tracked by id while alive)."""

    def __init__(self):
        super().__init__()
        self.reads, self.uploads = [], []
        self._host: set[int] = set()
        self._from_numpy = torch.from_numpy

    def _mark_host(self, tensor):
        if isinstance(tensor, torch.Tensor) and id(tensor) not in self._host:
            self._host.add(id(tensor))
            weakref.finalize(tensor, self._host.discard, id(tensor))
        return tensor

    def is_host(self, tensor) -> bool:
        return id(tensor) in self._host

    def __enter__(self):
        torch.from_numpy = lambda array: self._mark_host(self._from_numpy(array))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [
            a
            for a in (*args, *kwargs.values())
            if isinstance(a, torch.Tensor)
            or isinstance(a, (list, tuple))
            and any(isinstance(x, torch.Tensor) for x in a)
        ]
        tensors = [t for a in tensors for t in (a if isinstance(a, (list, tuple)) else [a])]
        on_device = [t for t in tensors if isinstance(t, torch.Tensor) and not self.is_host(t)]
        result = func(*args, **kwargs)
        if name in READS and on_device:
            self.reads.append(name)
            return result if name == "equal" else self._mark_host(self._distinct(result, args))
        to_device = kwargs.get("device", next((a for a in args[1:] if _is_device(a)), None))
        if name in ("to", "cuda") and tensors and self.is_host(args[0]):
            if name == "cuda" or to_device is not None and to_device != "cpu":
                self.uploads.append(name)
                return self._distinct(result, args)
        if name == "to" and on_device and to_device == "cpu":
            self.reads.append("to('cpu')")
            return self._mark_host(self._distinct(result, args))
        if name in FACTORIES_OF_DATA and not on_device:
            if kwargs.get("device") is not None or name == "new_tensor":
                self.uploads.append(name)
                return result
            return self._mark_host(result)
        if name == "copy_" and on_device[:1] == [args[0]] and self.is_host(args[1]):
            self.uploads.append("copy_ from host")
        if name == "__getitem__" and on_device:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.reads.append("bool index")
        if name == "repeat_interleave" and on_device and "output_size" not in kwargs:
            self.reads.append(name)
        if tensors and not on_device or not tensors and kwargs.get("device") is None:
            if name not in ("__get__", "__set__"):
                for out in result if isinstance(result, tuple) else (result,):
                    self._mark_host(out)
        return result

    @staticmethod
    def _distinct(result, args):
        """A copy between host and device is a new tensor on CUDA; on the CPU torch returns
        the tensor itself, which must not change sides: a distinct tensor stands for it."""
        return result.clone() if args and result is args[0] else result

    @property
    def counts(self) -> tuple[int, int]:
        return len(self.reads), len(self.uploads)


def _is_device(x) -> bool:
    return isinstance(x, (str, torch.device)) and str(x).split(":")[0] in ("cpu", "cuda")


class KernelStub:
    """A Triton kernel that records its launches instead of running."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.launches += 1

        return launch


@pytest.fixture
def gpu_host_code(monkeypatch):
    """CPU tensors taken for GPU tensors by fastpe, the kernels stubbed; yields the stubs."""
    from fastpe.kernels.triton import apply_rope, attention, attention_paged

    monkeypatch.setattr(_arrays, "on_gpu", lambda x: _arrays.is_tensor(x))
    stubs = {}
    for module, name in (
        (attention_paged, "_attention_paged_kernel"),
        (apply_rope, "_apply_rope_kernel"),
        (attention, "_attention_kernel"),
        (attention, "_merge_kernel"),
    ):
        stubs[name] = KernelStub()
        monkeypatch.setattr(module, name, stubs[name])
    with fastpe.use_backend("triton"):
        yield stubs


B, SQ, HQ, HKV, D, BLOCK, PAGES, LAYERS = 3, 1, 4, 2, 16, 4, 3, 3


def _decode_step():
    """One decode step of a paged cache: q, new k/v, and per-layer caches; lengths differ."""
    g = torch.Generator().manual_seed(0)
    blocks = B * PAGES + 1
    caches = [
        (
            torch.randn(blocks, BLOCK, HKV, D, generator=g),
            torch.randn(blocks, BLOCK, HKV, D, generator=g),
        )
        for _ in range(LAYERS)
    ]
    q = torch.randn(B, SQ, HQ, D, generator=g)
    k, v = (torch.randn(B, 1, HKV, D, generator=g) for _ in range(2))
    cache_seqlens = torch.tensor([0, 5, 10], dtype=torch.int32)  # device tensors in the trace
    block_table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES).flip(1).contiguous()
    rope = fastpe.rope_table(BLOCK * PAGES, D, dtype="float32", device="cpu")
    return q, k, v, caches, cache_seqlens, block_table, rope


def test_paged_decode_step_with_a_plan_makes_no_host_sync(gpu_host_code):
    q, k, v, caches, cache_seqlens, block_table, (cos, sin) = _decode_step()
    with SyncTrace() as trace:
        plan = fastpe.plan_kvcache(
            q, caches[0][0], k, cache_seqlens=cache_seqlens, block_table=block_table
        )
    # the one read of the step's metadata and the one upload of its tables
    assert trace.counts == (2, 1), (trace.reads, trace.uploads)
    for k_cache, v_cache in caches:
        with SyncTrace() as trace:
            fastpe.attention_kvcache(
                q, k_cache, v_cache, k, v, plan=plan, rotary_cos=cos, rotary_sin=sin, causal=True
            )
        assert trace.counts == (0, 0), (trace.reads, trace.uploads)
    # the kernels did run: append + rotate of q and k, then attention, per layer
    assert gpu_host_code["_attention_paged_kernel"].launches == LAYERS
    assert gpu_host_code["_apply_rope_kernel"].launches == 2 * LAYERS

    # the contrast: the same call without a plan reads the metadata back and uploads tables
    with SyncTrace() as trace:
        fastpe.attention_kvcache(
            q, *caches[0], k, v, cache_seqlens=cache_seqlens, block_table=block_table, causal=True
        )
    reads, uploads = trace.counts
    assert reads >= 2 and uploads >= 1, (trace.reads, trace.uploads)


@pytest.mark.parametrize("kind", ["float8_e4m3fn", "int8"])
def test_quantized_cache_decode_with_a_plan_makes_no_host_sync(gpu_host_code, kind):
    # the append quantizes on the device with the plan's row indices; GPU scales are checked
    # on the device
    q, k, v, caches, cache_seqlens, block_table, (cos, sin) = _decode_step()
    k_cache, v_cache = (x.to(getattr(torch, kind)) for x in caches[0])
    if kind == "int8":
        k_scale, v_scale = (torch.ones(k_cache.shape[:3]) for _ in range(2))
    else:
        k_scale, v_scale = torch.full((HKV,), 0.5), torch.full((HKV,), 0.25)
    plan = fastpe.plan_kvcache(q, k_cache, k, cache_seqlens=cache_seqlens, block_table=block_table)
    with SyncTrace() as trace:
        fastpe.attention_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            plan=plan,
            k_scale=k_scale,
            v_scale=v_scale,
            rotary_cos=cos,
            rotary_sin=sin,
            causal=True,
        )
    assert trace.counts == (0, 0), (trace.reads, trace.uploads)
    assert gpu_host_code["_attention_paged_kernel"].launches == 1


def test_varlen_with_a_plan_makes_no_host_sync(gpu_host_code):
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, HQ if i == 0 else HKV, D, generator=g) for i in range(3))
    with SyncTrace() as trace:
        plan = fastpe.plan_varlen(cu, cu)
    assert trace.counts == (2, 1), (trace.reads, trace.uploads)
    for _ in range(LAYERS):
        with SyncTrace() as trace:
            fastpe.attention_varlen(q, k, v, plan=plan, causal=True)
        assert trace.counts == (0, 0), (trace.reads, trace.uploads)
    with SyncTrace() as trace:
        fastpe.attention_varlen(q, k, v, cu, cu, causal=True)
    assert trace.counts[0] >= 2 and trace.counts[1] >= 1, (trace.reads, trace.uploads)


def test_flash_attn_functions_plan_once_per_step(gpu_host_code):
    """flash_attn_with_kvcache / flash_attn_varlen_func: the first layer's call of a step reads
    the metadata; the other layers' calls, given the same tensors, make no sync; metadata
    changed in place makes a new plan (the next step)."""
    q, k, v, caches, cache_seqlens, block_table, _ = _decode_step()
    counts = []
    for _step in range(2):
        for k_cache, v_cache in caches:
            with SyncTrace() as trace:
                flash_attn_with_kvcache(
                    q,
                    k_cache,
                    v_cache,
                    k,
                    v,
                    cache_seqlens=cache_seqlens,
                    block_table=block_table,
                    causal=True,
                )
            counts.append(trace.counts)
        cache_seqlens += 1  # the next step, in place
    first, rest = counts[0], counts[1:LAYERS] + counts[LAYERS + 1 :]
    assert first[0] >= 2 and counts[LAYERS][0] >= 2, counts
    assert rest == [(0, 0)] * (2 * LAYERS - 2), counts

    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    qp, kp, vp = (torch.randn(9, HQ if i == 0 else HKV, D) for i in range(3))
    counts = []
    for _ in range(LAYERS):
        with SyncTrace() as trace:
            flash_attn_varlen_func(qp, kp, vp, cu, cu, 5, 5, causal=True)
        counts.append(trace.counts)
    assert counts[0][0] >= 2 and counts[1:] == [(0, 0)] * (LAYERS - 1), counts


def test_device_checks_of_positions_key_lengths_and_merge_make_no_host_sync(gpu_host_code):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 3, 8, generator=g) for _ in range(3))
    cos, sin = fastpe.rope_table(16, 8, dtype="float32", device="cpu")
    key_lengths = torch.tensor([3, 2])
    positions = torch.tensor([[4, 5, 6], [1, 2, 3]])
    with SyncTrace() as trace:
        out, lse = fastpe.attention(
            q,
            k,
            v,
            key_lengths=key_lengths,
            causal=True,
            return_lse=True,
            rope=dict(cos=cos, sin=sin, k_positions=positions),
        )
    assert trace.counts == (0, 0), (trace.reads, trace.uploads)
    with SyncTrace() as trace:
        fastpe.merge_attention(out, lse, out, lse)
    assert trace.counts == (0, 0), (trace.reads, trace.uploads)
    # the device-side check still refuses a bad entry (on a CPU tensor it raises at once; on
    # CUDA at the next synchronizing call), naming the argument
    with pytest.raises(RuntimeError, match=r"key_lengths has an entry outside \[0, 4\)"):
        fastpe.attention(q, k, v, key_lengths=torch.tensor([3, 4]))


def test_a_plan_gives_the_oracle_result_over_layers():
    """The planned path's device tables (lengths, page starts, where new tokens go, rotary
    positions) against the float64 oracle's plan-less call, layer after layer."""
    q, k, v, caches, cache_seqlens, block_table, (cos, sin) = _decode_step()
    expected_caches = [(kc.clone(), vc.clone()) for kc, vc in caches]
    with fastpe.use_backend("triton"):
        plan = fastpe.plan_kvcache(
            q, caches[0][0], k, cache_seqlens=cache_seqlens, block_table=block_table
        )
    options = dict(rotary_cos=cos, rotary_sin=sin, causal=True, return_lse=True)
    for (kc, vc), (ekc, evc) in list(zip(caches, expected_caches, strict=True))[:2]:
        out, lse = fastpe.attention_kvcache(q, kc, vc, k, v, plan=plan, backend="triton", **options)
        want, want_lse = fastpe.attention_kvcache(
            q,
            ekc,
            evc,
            k,
            v,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            backend="numpy",
            **options,
        )
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(kc, ekc, atol=1e-6, rtol=1e-6)  # the appended, rotated keys
        torch.testing.assert_close(vc, evc, atol=0, rtol=0)


def test_plan_misuse_is_refused_by_name():
    q, k, v, caches, cache_seqlens, block_table, _ = _decode_step()
    plan = fastpe.plan_kvcache(
        q, caches[0][0], k, cache_seqlens=cache_seqlens, block_table=block_table
    )
    with pytest.raises(ValueError, match="cache_seqlens come from the plan"):
        fastpe.attention_kvcache(q, *caches[0], k, v, plan=plan, cache_seqlens=cache_seqlens)
    with pytest.raises(ValueError, match=r"plan was made for \(3, 1, 1, 10, 4\)"):
        fastpe.attention_kvcache(q[:2], *caches[0], k[:2], v[:2], plan=plan)
    with pytest.raises(TypeError, match="needs cache_seqlens .* or a plan"):
        fastpe.attention_kvcache(q, *caches[0])
    varlen = fastpe.plan_varlen(np.array([0, 2, 5]), np.array([0, 2, 5]))
    with pytest.raises(ValueError, match="q has 4 packed rows; the plan's cu_seqlens_q end at 5"):
        fastpe.attention_varlen(
            np.zeros((4, 2, 8)), np.zeros((5, 2, 8)), np.zeros((5, 2, 8)), plan=varlen
        )


def test_patch_rotary_compares_the_halves_once_per_forward(gpu_host_code):
    from fastpe.integrations.transformers_rope import _make_replacement

    fallbacks = []
    rotate = _make_replacement(lambda *args, **kwargs: fallbacks.append(args))
    cos, sin = (torch.cat([t, t], dim=-1)[None] for t in fastpe.rope_table(5, 8, device="cpu"))
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    counts = []
    for _layer in range(LAYERS):
        with SyncTrace() as trace:
            rotate(q, k, cos, sin)
        counts.append(trace.counts)
    assert counts == [(2, 0)] + [(0, 0)] * (LAYERS - 1), counts  # two torch.equal, then none
    cos.mul_(1.0)  # changed in place (the next forward's tables): compared again
    with SyncTrace() as trace:
        rotate(q, k, cos, sin)
    assert trace.reads == ["equal", "equal"] and not fallbacks
