"""Half precision q/k/v read as bits by the Numba attention kernel, and its small-call (serial,
unsplit) and parallel paths.

Expected values: the same kernel on the inputs widened to float32, rounded by torch (round to
nearest even), and fastpe's float64 oracle (backend="numpy").
"""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import NUMBA, same_bits, torch

import fastpe

pytestmark = pytest.mark.skipif(torch is None, reason="torch not installed")
O = {"backend": "numpy"}
HALF = ["float16", "bfloat16"]


def _attention_cases(rng):
    """(name, q, k, v, options) in float32: GQA prefill, decode with split keys, strided views,
    masks, key lengths and fused RoPE."""

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    cos, sin = fastpe.rope_table(700, 16, device="cpu")
    base = t(2, 4, 40, 32)
    yield "gqa causal", t(2, 4, 37, 32), t(2, 2, 300, 32), t(2, 2, 300, 32), {"causal": True}
    yield "decode split keys", t(1, 8, 1, 32), t(1, 2, 700, 32), t(1, 2, 700, 32), {"causal": True}
    yield "strided", base[:, :, ::2], base[:, ::2, 1:39], base[:, 1::2, 2:40], {"causal": True}
    mask = torch.from_numpy(rng.random((2, 1, 9, 50)) > 0.3)
    yield "bool mask", t(2, 4, 9, 32), t(2, 4, 50, 32), t(2, 4, 50, 32), {"mask": mask}
    lengths = torch.tensor([50, 17])
    yield "key lengths", t(2, 4, 9, 32), t(2, 4, 50, 32), t(2, 4, 50, 32), {"key_lengths": lengths}
    rope = {"cos": cos, "sin": sin}
    yield "fused rope", t(1, 4, 20, 32), t(1, 2, 600, 32), t(1, 2, 600, 32), {"rope": rope}


@pytest.mark.parametrize("backend", NUMBA)
@pytest.mark.parametrize("dtype", HALF)
def test_half_attention_reads_bits_and_equals_the_widened_call(backend, dtype, rng, monkeypatch):
    """Half q/k/v are widened tile by tile inside the kernel: bit for bit what the kernel gives
    on the same values widened to float32 beforehand, rounded once (fused RoPE included: the
    rotated q/k stay float32); and within one rounding of the float64 oracle. (On CPUs with
    AVX512-BF16, bfloat16 calls with wide row tiles multiply bfloat16 pairs instead, which
    tests/attention/test_pair_products.py checks; here that path is switched off.)"""
    from fastpe.kernels.numba import _pair_products

    monkeypatch.setattr(_pair_products, "available", lambda: False)
    tdtype = getattr(torch, dtype)
    for name, q, k, v, kw in _attention_cases(rng):
        q, k, v = (a.to(tdtype) for a in (q, k, v))
        got = fastpe.attention(q, k, v, backend=backend, **kw)
        widened = fastpe.attention(q.float(), k.float(), v.float(), backend=backend, **kw)
        assert got.dtype == tdtype, name
        same_bits(got, widened.to(tdtype))
        want = fastpe.attention(q.double(), k.double(), v.double(), **kw, **O)
        # one rounding of a float32 result: half an ulp of the largest output, plus float32's
        half_ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
        tol = half_ulp * want.abs().max().item() + 1e-5
        assert (got.double() - want).abs().max().item() <= tol, name


@pytest.mark.parametrize("backend", NUMBA)
@pytest.mark.parametrize("dtype", HALF)
def test_half_attention_makes_no_float32_copy_of_its_inputs(backend, dtype, monkeypatch, rng):
    """No full-tensor widening on the way in: neither Tensor.float() nor .to(float32) is called
    on q, k or v (the old path widened each with .float() before the kernel)."""
    tdtype = getattr(torch, dtype)
    q, k, v = (
        torch.from_numpy(rng.standard_normal(s)).to(tdtype)
        for s in ((1, 4, 16, 32), (1, 2, 300, 32), (1, 2, 300, 32))
    )
    fastpe.attention(q, k, v, backend=backend)  # compiled before the spy goes in
    inputs = {a.data_ptr() for a in (q, k, v)}  # detached views share it
    widened = []
    real_float, real_to = torch.Tensor.float, torch.Tensor.to

    def spy_float(self, *args, **kwargs):
        if self.data_ptr() in inputs:
            widened.append("float")
        return real_float(self, *args, **kwargs)

    def spy_to(self, *args, **kwargs):
        if self.data_ptr() in inputs and torch.float32 in (*args, kwargs.get("dtype")):
            widened.append("to")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", spy_float)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    out = fastpe.attention(q, k, v, causal=True, backend=backend)
    assert out.dtype == tdtype and not widened, widened


@pytest.mark.parametrize("per_head", [False, True], ids=["block-items", "head-items"])
@pytest.mark.parametrize("threshold", [1 << 40, -1], ids=["serial", "parallel"])
@pytest.mark.parametrize("sq", [1, 40], ids=["decode-loops", "prefill-panels"])
def test_attention_serial_and_parallel_paths_match_the_oracle(per_head, threshold, sq, monkeypatch):
    """Decode-sized attention runs serially and unsplit, with its few-row tiles multiplied by
    loops on K and V in place, wider tiles by panel products on K and V packed (up front, or by
    each head's work item); larger calls run in parallel, splitting the keys when the items
    cannot fill the threads. Every combination, with window, soft-capping, sinks (counted once
    across splits) and key lengths, must match the float64 oracle."""
    pytest.importorskip("numba")
    from fastpe.kernels.numba import attention as kernel

    monkeypatch.setattr(kernel, "SERIAL_WORK", threshold)
    monkeypatch.setattr(
        kernel, "items_per_head", lambda heads, threads, n_splits: per_head and n_splits == 1
    )
    # 2 (batch, kv head) items and 3 key tiles: split in two when parallel on 2+ threads (sq 1)
    b, hq, hkv, sk, d = 1, 8, 2, 700, 32
    # other inputs for each case: an output row a path failed to write could otherwise hold
    # the previous case's answer, in memory the allocator handed out again
    rng = np.random.default_rng([per_head, threshold > 0, sq])
    q, k, v = (
        torch.from_numpy(rng.standard_normal(s).astype(np.float32))
        for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
    )
    kw = {
        "causal": True,
        "window": (500, 0),
        "softcap": 3.0,
        "return_lse": True,
        "sinks": torch.linspace(-1.0, 2.0, hq),
        "key_lengths": torch.tensor([613]),
    }
    got, got_lse = fastpe.attention(q, k, v, backend="numba", **kw)
    want, want_lse = fastpe.attention(q, k, v, **kw, **O)
    assert (got.double() - want.double()).abs().max().item() < 3e-5
    assert (got_lse.double() - want_lse.double()).abs().max().item() < 3e-5
