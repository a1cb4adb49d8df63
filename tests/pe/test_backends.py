"""Every kernel backend against the float64 oracle on the shared test grid: the sinusoidal and
RoPE tables, apply_rope and embed.

Parametrised over the backends the registry has (never the oracle itself); a combination a
backend cannot run is skipped with its reasons. Tolerances per dtype; for float16/bfloat16: error
vs the oracle at most 2x that of a plain computation in that dtype.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, SHAPES_GRID, check_close, grid, to_fw, to_np, torch

import fastpe

O = {"backend": "numpy"}
TOL = {"float32": 2e-6, "float64": 1e-12}


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("layout", ["interleaved", "concat"])
@pytest.mark.parametrize("freq", ["paper", "tensor2tensor"])
# Triton's interpreter: all but the 300 x 130 table, whose far offset (2^20) the 2^31 case also
# reaches; the same kernel on a bigger tile
@pytest.mark.parametrize(
    "n,dim,offset",
    grid(
        [(1, 4, 0), (37, 6, 5), (300, 130, 2**20 - 300), (8, 16, 2**31 + 3)], [0, 1, 3], unpack=True
    ),
)
def test_sinusoidal_table(backend, fw, layout, freq, n, dim, offset):
    kw = {
        "layout": layout,
        "freq": freq,
        "offset": offset,
        "device": None if fw == "numpy" else "cpu",
    }
    truth = fastpe.sinusoidal_table(n, dim, dtype="float64", **{**kw, "device": None}, **O)
    got = fastpe.sinusoidal_table(n, dim, **kw, backend=backend)
    assert str(got.dtype).endswith("float32")
    # the accuracy promise: within 1e-6 of the float64 truth at every position up to 2^20
    check_close(got, truth, 1e-6 if offset < 2**21 else 1e-5, "float32 table")
    # in float64 the argument p·ω itself is only known to ~p·2^-53, by any method
    check_close(
        fastpe.sinusoidal_table(n, dim, dtype="float64", **kw, backend=backend),
        truth,
        1e-14 + 4 * (offset + n) * 2.0**-53,
        "float64 table",
    )


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}]
)
@pytest.mark.parametrize("n,rdim,offset", [(1, 2, 0), (129, 10, 3), (64, 128, 2**20 - 64)])
def test_rope_table(backend, fw, scaling, n, rdim, offset):
    truth = fastpe.rope_table(n, rdim, scaling=scaling, offset=offset, dtype="float64", **O)
    device = None if fw == "numpy" else "cpu"
    got = fastpe.rope_table(n, rdim, scaling=scaling, offset=offset, device=device, backend=backend)
    for g, t in zip(got, truth, strict=True):
        check_close(g, t, 1.5e-6, "rope table")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tables_low_precision_round_once(backend, dtype):
    truth = fastpe.sinusoidal_table(50, 24, offset=1000, dtype="float64", **O)
    got = fastpe.sinusoidal_table(50, 24, offset=1000, dtype=dtype, device="cpu", backend=backend)
    assert got.dtype == getattr(torch, dtype)
    # exactly the correctly rounded truth (torch's float64 -> half rounding is to nearest even)
    rounded = torch.from_numpy(truth).to(getattr(torch, dtype))
    assert torch.equal(got, rounded) or (got.double() - rounded.double()).abs().max() <= 2**-10


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES_GRID)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("pos_kind", ["none", "offset", "seq", "batch"])
def test_apply_rope(backend, fw, shape, interleaved, layout, pos_kind, rng):
    b, h, s, d = shape
    rdim = d if d % 4 else d // 2  # full and partial rotary
    x = rng.standard_normal((b, h, s, d) if layout == "bhsd" else (b, s, h, d)).astype(np.float32)
    cos, sin = fastpe.rope_table(s + 9, rdim, **O)
    positions = {
        "none": None,
        "offset": 9,
        "seq": rng.integers(0, s + 9, size=s),
        "batch": rng.integers(0, s + 9, size=(b, s)),
    }[pos_kind]
    args = (to_fw(x, fw), to_fw(cos, fw), to_fw(sin, fw))
    kw = {
        "interleaved": interleaved,
        "layout": layout,
        "positions": positions
        if positions is None or isinstance(positions, int)
        else to_fw(positions, fw),
    }
    before = x.copy()
    got = fastpe.apply_rope(*args, **kw, backend=backend)
    np.testing.assert_array_equal(to_np(args[0]), before)  # input untouched
    check_close(got, fastpe.apply_rope(*args, **kw, **O), TOL["float32"], "apply_rope")
    same = fastpe.apply_rope(*args, inplace=True, **kw, backend=backend)
    assert same is args[0]
    check_close(args[0], to_np(got), 0, "in-place result")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_apply_rope_non_contiguous(backend, fw, dtype, rng):
    x = to_fw(rng.standard_normal((2, 6, 10, 16)).astype(dtype), fw)[:, ::2, 1:9]  # strided view
    cos, sin = (to_fw(t, fw) for t in fastpe.rope_table(20, 12, dtype=dtype, **O))
    got = fastpe.apply_rope(x, cos, sin, positions=3, backend=backend)
    check_close(
        got, fastpe.apply_rope(x, cos, sin, positions=3, **O), TOL[dtype], "strided apply_rope"
    )
    # elements of a row 2 apart (the kernel rotates a contiguous copy), new and in place
    gapped = to_fw(rng.standard_normal((2, 3, 10, 32)).astype(dtype), fw)[..., ::2]
    want = fastpe.apply_rope(gapped, cos, sin, positions=3, **O)
    got = fastpe.apply_rope(gapped, cos, sin, positions=3, backend=backend)
    check_close(got, want, TOL[dtype], "apply_rope on rows with gaps")
    assert fastpe.apply_rope(gapped, cos, sin, positions=3, inplace=True, backend=backend) is gapped
    check_close(gapped, to_np(got), 0, "in place on rows with gaps")


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("pe", ["sinusoidal", "table", None])
@pytest.mark.parametrize("layout,freq", [("interleaved", "paper"), ("concat", "tensor2tensor")])
@pytest.mark.parametrize("types", [False, True])
@pytest.mark.parametrize("pos_kind", ["none", "offset", "batch"])
def test_embed(backend, fw, pe, layout, freq, types, pos_kind, rng):
    b, s, v, d = 3, 7, 50, 12
    weight = rng.standard_normal((v, d)).astype(np.float32)
    ids = rng.integers(0, v, size=(b, s))
    table = rng.standard_normal((40, d)).astype(np.float32) if pe == "table" else None
    positions = {"none": None, "offset": 20, "batch": rng.integers(0, 33, size=(b, s))}[pos_kind]
    kw = {
        "pe": pe,
        "pe_table": to_fw(table, fw),
        "layout": layout,
        "freq": freq,
        "scale": math.sqrt(d),
        "positions": positions if not isinstance(positions, np.ndarray) else to_fw(positions, fw),
    }
    if types:
        kw |= {
            "token_type_ids": to_fw(rng.integers(0, 2, size=(b, s)), fw),
            "token_type_weight": to_fw(rng.standard_normal((2, d)).astype(np.float32), fw),
        }
    got = fastpe.embed(to_fw(ids, fw), to_fw(weight, fw), **kw, backend=backend)
    check_close(
        got, fastpe.embed(to_fw(ids, fw), to_fw(weight, fw), **kw, **O), TOL["float32"], "embed"
    )


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_embed_far_positions_and_errors(backend, fw, dtype, rng):
    weight = to_fw(rng.standard_normal((10, 8)).astype(dtype), fw)
    ids = to_fw(rng.integers(0, 10, size=(2, 3)), fw)
    far = to_fw(np.array([[2**20, 5, 2**31 + 7], [0, 2**20 - 1, 17]]), fw)
    got = fastpe.embed(ids, weight, positions=far, backend=backend)
    tol = 1e-9 if dtype == "float64" else 1e-6
    check_close(got, fastpe.embed(ids, weight, positions=far, **O), tol, "far positions")
    with pytest.raises(IndexError, match="ids contains 10"):
        fastpe.embed(to_fw(np.array([[10]]), fw), weight, backend=backend)


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope_low_precision(backend, dtype, inplace, rng):
    """Half types: within 2x the error of the plain same-dtype formula, and in place too."""
    tdtype = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal((2, 3, 20, 24))).to(tdtype)
    cos, sin = fastpe.rope_table(40, 16, device="cpu")
    positions = torch.from_numpy(rng.integers(0, 40, size=(2, 20)))
    want = fastpe.apply_rope(x.double(), cos.double(), sin.double(), positions=positions, **O)
    c, s = cos.to(tdtype)[positions][:, None], sin.to(tdtype)[positions][:, None]
    a, b = x[..., :8], x[..., 8:16]
    plain = torch.cat([a * c - b * s, b * c + a * s, x[..., 16:]], -1)  # HF-style, all in `dtype`
    arg = x.clone() if inplace else x
    got = fastpe.apply_rope(arg, cos, sin, positions=positions, inplace=inplace, backend=backend)
    assert got.dtype == tdtype and (got is arg) == inplace
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (plain.double() - want).abs().max().item() + 1e-6, err


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("pe", ["sinusoidal", "table"])
def test_embed_low_precision(backend, dtype, pe, rng):
    tdtype = getattr(torch, dtype)
    weight = torch.from_numpy(rng.standard_normal((30, 16))).to(tdtype)
    table = torch.from_numpy(rng.standard_normal((40, 16))).to(tdtype) if pe == "table" else None
    ids = torch.from_numpy(rng.integers(0, 30, size=(3, 9)))
    kw = {"pe": pe, "pe_table": table, "scale": 4.0, "positions": 7}
    want = fastpe.embed(
        ids, weight.double(), **{**kw, "pe_table": None if table is None else table.double()}, **O
    )
    pe_rows = (
        table[7:16]
        if pe == "table"
        else fastpe.sinusoidal_table(9, 16, offset=7, device="cpu").to(tdtype)
    )
    plain = weight[ids] * 4.0 + pe_rows  # the eager recipe, in `dtype`
    got = fastpe.embed(ids, weight, **kw, backend=backend)
    assert got.dtype == tdtype
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (plain.double() - want).abs().max().item() + 1e-6, err


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_bfloat16_rounds_to_nearest_even(backend, rng):
    """bf16 in, bf16 out: exactly the float32 result rounded by torch (round-to-nearest-even),
    including ties — the widening and rounding done on uint16 bits must not drift from it."""
    x = torch.from_numpy(rng.standard_normal((1, 4, 64, 32)).astype(np.float32)).to(torch.bfloat16)
    cos, sin = fastpe.rope_table(64, 32, device="cpu")
    got = fastpe.apply_rope(x, cos, sin, backend=backend)
    via_float32 = fastpe.apply_rope(x.float(), cos, sin, backend=backend).to(torch.bfloat16)
    assert torch.equal(got, via_float32)
    weight = torch.from_numpy(rng.standard_normal((50, 32)).astype(np.float32)).to(torch.bfloat16)
    ids = torch.from_numpy(rng.integers(0, 50, size=(2, 40)))
    got = fastpe.embed(ids, weight, scale=3.0, backend=backend)
    assert torch.equal(
        got, fastpe.embed(ids, weight.float(), scale=3.0, backend=backend).to(torch.bfloat16)
    )


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope_q_and_k_together(backend, fw, layout, inplace, rng):
    """A (q, k) tuple — different head counts (GQA) — is rotated like two single calls."""
    shape = (lambda h: (2, h, 7, 24)) if layout == "bhsd" else (lambda h: (2, 7, h, 24))
    q = to_fw(rng.standard_normal(shape(6)).astype(np.float32), fw)
    k = to_fw(rng.standard_normal(shape(2)).astype(np.float32), fw)
    cos, sin = (to_fw(t, fw) for t in fastpe.rope_table(16, 16, **O))
    positions = to_fw(rng.integers(0, 16, size=(2, 7)), fw)
    kw = {"positions": positions, "layout": layout}
    want = [fastpe.apply_rope(t, cos, sin, **kw, **O) for t in (q, k)]
    args = ((q, k) if not inplace else (to_fw(to_np(q), fw), to_fw(to_np(k), fw)), cos, sin)
    got = fastpe.apply_rope(*args, inplace=inplace, **kw, backend=backend)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w, given in zip(got, want, args[0], strict=True):
        check_close(g, w, TOL["float32"], "grouped apply_rope")
        assert (g is given) == inplace
