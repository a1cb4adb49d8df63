"""Half precision read and written as bits by the CPU kernels of apply_rope and embed, and their
small-call fast paths.

Expected values: torch's own float32 -> float16/bfloat16 rounding (round to nearest even), and
fastpe's float64 oracle (backend="numpy"); the serial kernels must equal the parallel ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, NUMBA, same_bits, torch

import fastpe

pytestmark = pytest.mark.skipif(torch is None, reason="torch not installed")
O = {"backend": "numpy"}
HALF = ["float16", "bfloat16"]


# numba only: the Triton interpreter flushes bfloat16 subnormals to zero (254 patterns differ)
@pytest.mark.parametrize("backend", NUMBA)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, 2.0**-10, 3.0, 65504 / 65519])
def test_embed_every_half_value_rounds_like_torch(backend, dtype, scale):
    """Every bit pattern of the half type (normals, subnormals, ties, inf, NaN) scaled in float32
    and rounded: exactly torch's rounding of the same float32 product, overflow to inf included."""
    tdtype = getattr(torch, dtype)
    weight = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(tdtype)
    weight = weight.reshape(-1, 8)
    ids = torch.arange(weight.shape[0])[None]
    got = fastpe.embed(ids, weight, pe=None, scale=scale, backend=backend)[0]
    assert got.dtype == tdtype
    same_bits(got, (weight.float() * np.float32(scale)).to(tdtype))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope_half_rounds_once_like_torch(backend, dtype, inplace, rng):
    """Half in, half out: the float32 rotation rounded once by torch's rule, bit for bit."""
    tdtype = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal((2, 4, 33, 32)).astype(np.float32)).to(tdtype)
    cos, sin = fastpe.rope_table(40, 24, device="cpu")
    positions = torch.from_numpy(rng.integers(0, 40, size=(2, 33)))
    want = fastpe.apply_rope(x.float(), cos, sin, positions=positions, backend=backend).to(tdtype)
    arg = x.clone() if inplace else x
    got = fastpe.apply_rope(arg, cos, sin, positions=positions, inplace=inplace, backend=backend)
    assert (got is arg) == inplace and got.dtype == tdtype
    same_bits(got, want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("table_dtype", HALF)
@pytest.mark.parametrize("x_dtype", ["float32", *HALF])
def test_apply_rope_half_tables_equal_widened_tables(backend, table_dtype, x_dtype, rng):
    """Half cos/sin tables (read as bits, one row at a time) give exactly what the same tables
    widened to float32 give, and stay within the half type's error of the float64 oracle."""
    x = torch.from_numpy(rng.standard_normal((1, 3, 5, 16)).astype(np.float32))
    x = x.to(getattr(torch, x_dtype))
    cos, sin = fastpe.rope_table(64, 16, dtype=table_dtype, device="cpu")
    got = fastpe.apply_rope(x, cos, sin, positions=50, backend=backend)
    widened = fastpe.apply_rope(x, cos.float(), sin.float(), positions=50, backend=backend)
    assert got.dtype == x.dtype
    assert torch.equal(got, widened)
    want = fastpe.apply_rope(x.double(), cos.double(), sin.double(), positions=50, **O)
    tol = {"float32": 2e-6, "float16": 4e-3, "bfloat16": 3e-2}[x_dtype]
    assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("op", ["apply_rope", "embed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_serial_and_parallel_kernels_agree(op, dtype, monkeypatch, rng):
    """Small calls run a serial copy of the kernel: it must give what the parallel one gives,
    on the same inputs, whichever the size threshold picks."""
    pytest.importorskip("numba")
    if fastpe.backends()["numba"] != "available":
        pytest.skip(fastpe.backends()["numba"])
    import importlib

    module = importlib.import_module(f"fastpe.kernels.numba.{op}")
    tdtype = getattr(torch, dtype)
    if op == "apply_rope":
        x = torch.from_numpy(rng.standard_normal((1, 32, 1, 128)).astype(np.float32)).to(tdtype)
        cos, sin = fastpe.rope_table(4096, 128, device="cpu")

        def call():
            return fastpe.apply_rope(x, cos, sin, positions=[2048], backend="numba")
    else:
        weight = torch.from_numpy(rng.standard_normal((100, 64)).astype(np.float32)).to(tdtype)
        ids = torch.from_numpy(rng.integers(0, 100, size=(1, 3)))

        def call():
            return fastpe.embed(ids, weight, positions=4000, scale=2.0, backend="numba")

    results = []
    for threshold in (1 << 30, -1):  # everything serial, then everything parallel
        monkeypatch.setattr(module, "SERIAL_ELEMENTS", threshold)
        results.append(call())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "dtypes",
    [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
        ("bfloat16", "float16"),
    ],
)
def test_apply_rope_pair_in_one_launch_equals_single_calls(layout, interleaved, dtypes, rng):
    """A one-token (q, k) is rotated by one serial launch for both: bit for bit what two single
    calls give (partial rotary, GQA head counts, strided bshd views, half bits of either type),
    and within one rounding of the float64 oracle."""
    pytest.importorskip("numba")
    cos, sin = fastpe.rope_table(4096, 96, device="cpu")  # R 96 < D 128: the tail is copied
    shape = (lambda h: (2, h, 1, 128)) if layout == "bhsd" else (lambda h: (2, 1, h, 128))
    q, k = (
        torch.from_numpy(rng.standard_normal(shape(h)).astype(np.float32)).to(getattr(torch, t))
        for h, t in zip((32, 8), dtypes, strict=True)
    )
    kw = {"positions": torch.tensor([[2048], [7]]), "interleaved": interleaved, "layout": layout}
    got = fastpe.apply_rope((q, k), cos, sin, backend="numba", **kw)
    rotated = (q.clone(), k.clone())  # in place: one launch too, the caller's tensors returned
    done = fastpe.apply_rope(rotated, cos, sin, backend="numba", inplace=True, **kw)
    assert done[0] is rotated[0] and done[1] is rotated[1]
    for g, x, r, dtype in zip(got, (q, k), rotated, dtypes, strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape
        same_bits(g, fastpe.apply_rope(x, cos, sin, backend="numba", **kw))
        same_bits(r, g)
        want = fastpe.apply_rope(x.double(), cos.double(), sin.double(), **kw, **O)
        half_ulp = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
        tol = 2 * half_ulp * want.abs().max().item() + 1e-6
        assert (g.double() - want).abs().max().item() <= tol


def test_float16_kernels_compile_without_numba_ir_warnings(tmp_path):
    # the float16 rounding used to be an inline overload body, which Numba's inliner mishandled:
    # every fp16 kernel compile printed NumbaIRAssumptionWarnings. A fresh cache forces a compile.
    import os
    import subprocess
    import sys

    script = (
        "import warnings, torch, fastpe\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    cos, sin = fastpe.rope_table(16, 16, device='cpu')\n"
        "    fastpe.apply_rope(torch.randn(1, 2, 8, 16).half(), cos, sin, backend='numba')\n"
        "print(sorted({w.category.__name__ for w in caught}))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "NumbaIRAssumptionWarning" not in done.stdout, done.stdout


@pytest.mark.skipif(not NUMBA, reason="numba not installed")
def test_float16_integer_conversions_round_like_torch():
    """The float16 conversions for CPUs without F16C, in integer steps (F16C machines, CI's
    included, use the instructions), against torch: every float16 widened (a NaN keeps its
    payload, closed form), and float32 values of every sign, exponent and top mantissa with ties,
    near-ties and odd low bits rounded (subnormal results, overflow to inf and NaNs included)."""
    from fastpe.kernels.numba._half import _float32_to_fp16_integer, _fp16_to_float32_integer
    from numba import njit

    @njit
    def convert(bits, values, widened, narrowed):
        for i in range(bits.size):
            widened[i] = _fp16_to_float32_integer(bits[i])
        for i in range(values.size):
            narrowed[i] = _float32_to_fp16_integer(values[i])

    bits = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)
    top = np.arange(1 << 19, dtype=np.uint32) << np.uint32(13)
    values = np.concatenate([top | low for low in (0, 0x1000, 0xFFF, 0x1001, 0x1FFF)])
    values = values.view(np.float32)
    widened, narrowed = np.empty(bits.size, np.float32), np.empty(values.size, np.int16)
    convert(bits, values, widened, narrowed)

    want = torch.from_numpy(bits).view(torch.float16).float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(widened[~nan].view(np.uint32), want[~nan].view(np.uint32))
    h = bits[nan].view(np.uint16).astype(np.uint32)
    payload = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
    assert np.array_equal(widened[nan].view(np.uint32), payload)
    want = torch.from_numpy(values).to(torch.float16).view(torch.int16).numpy()
    assert np.array_equal(narrowed, want)
