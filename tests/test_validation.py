"""Bad input gets a clear error naming the argument — never a crash or a silent wrong answer."""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import to_fw, torch

import fastpe

O = {"backend": "numpy"}
f32 = np.float32


def _qkv(b=1, hq=2, hkv=2, sq=3, sk=4, d=8):
    r = np.random.default_rng(0)
    return (
        r.standard_normal((b, hq, sq, d)).astype(f32),
        r.standard_normal((b, hkv, sk, d)).astype(f32),
        r.standard_normal((b, hkv, sk, d)).astype(f32),
    )


def raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"num_positions": -1, "dim": 8}, ValueError, "num_positions must be >= 0"),
        ({"num_positions": 4, "dim": 7}, ValueError, "dim must be even"),
        ({"num_positions": 4, "dim": 2.0}, TypeError, "dim must be an integer"),
        ({"num_positions": 4, "dim": 2, "freq": "tensor2tensor"}, ValueError, "dim must be >= 4"),
        ({"num_positions": 4, "dim": 8, "layout": "split"}, ValueError, "layout must be one of"),
        ({"num_positions": 4, "dim": 8, "freq": "fairseq"}, ValueError, "freq must be one of"),
        ({"num_positions": 4, "dim": 8, "base": 0}, ValueError, "base must be > 0"),
        ({"num_positions": 4, "dim": 8, "base": float("nan")}, ValueError, "base must be finite"),
        ({"num_positions": 4, "dim": 8, "offset": -2}, ValueError, "offset must be >= 0"),
        ({"num_positions": 4, "dim": 8, "dtype": "int32"}, TypeError, "dtype must be one of"),
        ({"num_positions": 4, "dim": 8, "dtype": "bfloat16"}, TypeError, "need a torch device"),
        ({"num_positions": 4, "dim": 8, "backend": "cuda"}, ValueError, "backend must be one of"),
    ],
)
def test_sinusoidal_table_errors(kwargs, exc, match):
    raises(exc, match, fastpe.sinusoidal_table, **kwargs)


def test_sinusoidal_table_bad_device():
    pytest.importorskip("torch")
    raises(ValueError, "device must be None", fastpe.sinusoidal_table, 4, 8, device="tpu")


def test_relative_transform_errors():
    raises(TypeError, "k must be an integer", fastpe.relative_transform, 1.5, 8)
    raises(ValueError, "dim must be even", fastpe.relative_transform, 1, 9)
    raises(ValueError, "layout must be one of", fastpe.relative_transform, 1, 8, layout="x")


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((7,), {}, ValueError, "rotary_dim must be even"),
        ((0,), {}, ValueError, "rotary_dim must be >= 2"),
        ((8,), {"scaling": {"rope_type": "ntk"}}, ValueError, "rope_type'\\] must be one of"),
        ((8,), {"scaling": {"rope_type": "linear"}}, ValueError, "'factor'\\] is required"),
        (
            (8,),
            {"scaling": {"rope_type": "linear", "factor": 2, "fator": 3}},
            ValueError,
            "unknown keys",
        ),
        (
            (8,),
            {
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8,
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                }
            },
            ValueError,
            "original_max_position_embeddings",
        ),
        (
            (8,),
            {"scaling": {"rope_type": "dynamic", "factor": 2}},
            ValueError,
            "max_position_embeddings",
        ),
        (
            (8,),
            {
                "scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1, 1],
                    "long_factor": [1, 1, 1, 1],
                    "original_max_position_embeddings": 8,
                    "factor": 2,
                }
            },
            ValueError,
            "4 entries",
        ),
        ((8,), {"scaling": "linear"}, TypeError, "scaling must be None or a dict"),
        ((8,), {"scaling": {"rope_theta": 500.0}, "base": 100.0}, ValueError, "conflicts"),
        ((8,), {"seq_len": -1}, ValueError, "seq_len must be >= 0"),
    ],
)
def test_rope_inv_freq_errors(args, kwargs, exc, match):
    raises(exc, match, fastpe.rope_inv_freq, *args, **kwargs)
    if "seq_len" not in kwargs:  # rope_table takes the length from num_positions
        raises(exc, match, fastpe.rope_table, 4, *args, **kwargs)


def test_apply_rope_errors(fw):
    x = to_fw(np.zeros((1, 2, 4, 8), f32), fw)
    cos, sin = (to_fw(t, fw) for t in fastpe.rope_table(6, 8, **O))
    ap = fastpe.apply_rope
    raises(ValueError, "x must have 4 dimensions", ap, x[0], cos, sin, **O)
    raises(
        TypeError,
        "x must have a float dtype",
        ap,
        to_fw(np.zeros((1, 2, 4, 8), np.int32), fw),
        cos,
        sin,
        **O,
    )
    raises(ValueError, "same shape", ap, x, cos, sin[:, :2], **O)
    raises(
        ValueError,
        "rotary dim R = 10",
        ap,
        x,
        to_fw(np.zeros((6, 5), f32), fw),
        to_fw(np.zeros((6, 5), f32), fw),
        **O,
    )
    raises(
        IndexError,
        "positions 3 … 6 are needed but cos/sin has only 6 rows",
        ap,
        x,
        cos,
        sin,
        positions=3,
        **O,
    )
    raises(
        IndexError,
        "positions contains 6 at index \\[2\\]",
        ap,
        x,
        cos,
        sin,
        positions=to_fw(np.array([0, 1, 6, 2]), fw),
        **O,
    )
    raises(
        IndexError,
        "contains -1",
        ap,
        x,
        cos,
        sin,
        positions=to_fw(np.array([[0, 1, -1, 2]]), fw),
        **O,
    )
    raises(
        ValueError, "shape \\[S\\]", ap, x, cos, sin, positions=to_fw(np.array([0, 1, 2]), fw), **O
    )
    raises(
        TypeError,
        "positions must have an integer dtype",
        ap,
        x,
        cos,
        sin,
        positions=to_fw(np.zeros(4), fw),
        **O,
    )
    raises(ValueError, "positions must be >= 0", ap, x, cos, sin, positions=-1, **O)
    raises(ValueError, "layout must be one of", ap, x, cos, sin, layout="sbhd", **O)
    raises(TypeError, "inplace must be True or False", ap, x, cos, sin, inplace="yes", **O)


def test_apply_rope_group_errors(fw):
    cos, sin = (to_fw(t, fw) for t in fastpe.rope_table(8, 4, **O))
    q = to_fw(np.zeros((1, 2, 3, 4), f32), fw)
    raises(ValueError, "non-empty tuple", fastpe.apply_rope, (), cos, sin, **O)
    raises(
        ValueError,
        "x\\[1\\] has batch and sequence \\(1, 5\\)",
        fastpe.apply_rope,
        (q, to_fw(np.zeros((1, 2, 5, 4), f32), fw)),
        cos,
        sin,
        **O,
    )
    raises(ValueError, "x must have 4 dimensions", fastpe.apply_rope, (q, q[0]), cos, sin, **O)


def test_apply_rope_read_only_inplace():
    x = np.zeros((1, 1, 2, 4), f32)
    x.setflags(write=False)
    cos, sin = fastpe.rope_table(2, 4, **O)
    raises(ValueError, "writeable", fastpe.apply_rope, x, cos, sin, inplace=True, **O)


def test_embed_errors(fw):
    w = to_fw(np.zeros((10, 8), f32), fw)
    ids = to_fw(np.array([[1, 2, 3]]), fw)
    em = fastpe.embed
    raises(
        IndexError,
        "ids contains 10 at index \\[0, 1\\], outside \\[0, 10\\)",
        em,
        to_fw(np.array([[1, 10, 3]]), fw),
        w,
        **O,
    )
    raises(IndexError, "ids contains -1", em, to_fw(np.array([[-1, 1, 3]]), fw), w, **O)
    raises(
        TypeError, "ids must have an integer dtype", em, to_fw(np.array([[1.0, 2.0]]), fw), w, **O
    )
    raises(ValueError, "ids must have 2 dimensions", em, to_fw(np.array([1, 2]), fw), w, **O)
    raises(ValueError, "weight must have 2 dimensions", em, ids, to_fw(np.zeros(8, f32), fw), **O)
    raises(
        ValueError, "embedding dim must be even", em, ids, to_fw(np.zeros((10, 7), f32), fw), **O
    )
    raises(ValueError, "pe must be one of", em, ids, w, pe="learned", **O)
    raises(ValueError, "needs pe_table", em, ids, w, pe="table", **O)
    raises(
        ValueError,
        "only read with pe='table'",
        em,
        ids,
        w,
        pe_table=to_fw(np.zeros((4, 8), f32), fw),
        **O,
    )
    raises(
        ValueError,
        "D = 8 columns",
        em,
        ids,
        w,
        pe="table",
        pe_table=to_fw(np.zeros((4, 6), f32), fw),
        **O,
    )
    raises(
        IndexError,
        "positions 2 … 4 are needed but pe_table has only 4 rows",
        em,
        ids,
        w,
        pe="table",
        pe_table=to_fw(np.zeros((4, 8), f32), fw),
        positions=2,
        **O,
    )
    raises(ValueError, "given together", em, ids, w, token_type_ids=ids, **O)
    raises(
        IndexError,
        "token_type_ids contains 3",
        em,
        ids,
        w,
        token_type_ids=to_fw(np.array([[0, 3, 1]]), fw),
        token_type_weight=to_fw(np.zeros((2, 8), f32), fw),
        **O,
    )
    raises(
        ValueError,
        "shape of ids",
        em,
        ids,
        w,
        token_type_ids=to_fw(np.array([[0, 1]]), fw),
        token_type_weight=to_fw(np.zeros((2, 8), f32), fw),
        **O,
    )
    raises(ValueError, "scale must be finite", em, ids, w, scale=float("inf"), **O)


def test_attention_errors(fw):
    q, k, v = (to_fw(a, fw) for a in _qkv())
    at = fastpe.attention
    raises(ValueError, "q must have 4 dimensions", at, q[0], k, v, **O)
    raises(
        ValueError, "multiple of k/v heads", at, q, *(to_fw(a, fw) for a in _qkv(hkv=3)[1:]), **O
    )
    raises(ValueError, "k's head dim 4 must equal q's head dim 8", at, q, k[..., :4], v, **O)
    raises(ValueError, "v must be \\[B, Hkv, Sk, Dv\\]", at, q, k, v[:, :, :2], **O)
    raises(
        ValueError, "share batch size", at, q, to_fw(np.concatenate([_qkv()[1]] * 2), fw), v, **O
    )
    raises(TypeError, "share one dtype", at, q, to_fw(_qkv()[1].astype(np.float64), fw), v, **O)
    raises(
        ValueError,
        "does not broadcast to \\[B, Hq, Sq, Sk\\] = \\[1, 2, 3, 4\\]",
        at,
        q,
        k,
        v,
        mask=to_fw(np.ones((3, 5), bool), fw),
        **O,
    )
    raises(
        TypeError, "mask must be bool", at, q, k, v, mask=to_fw(np.ones((3, 4), np.int64), fw), **O
    )
    raises(
        ValueError, "NaN or \\+inf", at, q, k, v, mask=to_fw(np.full((3, 4), np.nan, f32), fw), **O
    )
    raises(
        IndexError, "key_lengths contains 5", at, q, k, v, key_lengths=to_fw(np.array([5]), fw), **O
    )
    raises(
        ValueError,
        "key_lengths must have shape \\[B\\]",
        at,
        q,
        k,
        v,
        key_lengths=to_fw(np.array([1, 2]), fw),
        **O,
    )
    raises(
        ValueError,
        "causal_alignment must be one of",
        at,
        q,
        k,
        v,
        causal=True,
        causal_alignment="left",
        **O,
    )
    raises(TypeError, "causal must be True or False", at, q, k, v, causal=1, **O)
    raises(ValueError, "scale must be finite", at, q, k, v, scale=float("nan"), **O)
    cos, sin = (to_fw(t, fw) for t in fastpe.rope_table(4, 8, **O))
    raises(
        ValueError, "rope must be a dict with keys cos, sin", at, q, k, v, rope={"cos": cos}, **O
    )
    raises(
        ValueError, "rope must be a dict", at, q, k, v, rope={"cos": cos, "sin": sin, "pos": 1}, **O
    )
    raises(
        IndexError,
        "rope\\['q_positions'\\]: positions 2 … 4",
        at,
        q,
        k,
        v,
        rope={"cos": cos, "sin": sin, "q_positions": 2},
        **O,
    )
    raises(
        ValueError,
        "alibi_slopes must have shape",
        at,
        q,
        k,
        v,
        alibi_slopes=to_fw(np.ones(3, f32), fw),
        **O,
    )
    raises(
        ValueError,
        "alibi_slopes must be finite",
        at,
        q,
        k,
        v,
        alibi_slopes=to_fw(np.array([1, np.inf], f32), fw),
        **O,
    )
    raises(
        ValueError,
        "relative_bias\\['table'\\] must have shape \\[num_buckets, Hq\\] = \\[32, 2\\]",
        at,
        q,
        k,
        v,
        relative_bias={"table": to_fw(np.zeros((32, 3), f32), fw)},
        **O,
    )
    raises(
        ValueError,
        "max_distance'\\] must be >= 9",
        at,
        q,
        k,
        v,
        relative_bias={"table": to_fw(np.zeros((32, 2), f32), fw), "max_distance": 8},
        **O,
    )
    raises(
        ValueError, "must be a dict with key table", at, q, k, v, relative_bias={"buckets": 3}, **O
    )


def test_merge_attention_errors():
    out = np.zeros((1, 2, 3, 4), f32)
    lse = np.zeros((1, 2, 3), f32)
    raises(ValueError, "same shape", fastpe.merge_attention, out, lse, out[:, :1], lse, **O)
    raises(
        ValueError,
        "lse_b must have shape \\[B, H, S\\]",
        fastpe.merge_attention,
        out,
        lse,
        out,
        lse[..., :2],
        **O,
    )
    raises(ValueError, "NaN", fastpe.merge_attention, out, lse, out, np.full_like(lse, np.nan), **O)


def test_mixed_frameworks_rejected():
    if torch is None:
        pytest.skip("torch not installed")
    q, k, v = _qkv()
    raises(
        TypeError,
        "all torch tensors on one device",
        fastpe.attention,
        torch.from_numpy(q),
        k,
        v,
        **O,
    )


def test_numpy_half_precision_rejected():
    q = np.zeros((1, 1, 2, 4), np.float16)
    raises(
        TypeError, "float16/bfloat16 are accepted as torch tensors", fastpe.attention, q, q, q, **O
    )


def test_inputs_never_modified(fw):
    r = np.random.default_rng(3)
    arrays = {
        "q": r.standard_normal((1, 2, 3, 4)),
        "k": r.standard_normal((1, 1, 5, 4)),
        "v": r.standard_normal((1, 1, 5, 4)),
        "mask": r.standard_normal((3, 5)),
    }
    given = {name: to_fw(a, fw) for name, a in arrays.items()}
    cos, sin = fastpe.rope_table(8, 4, dtype="float64", **O)
    fastpe.attention(
        given["q"],
        given["k"],
        given["v"],
        mask=given["mask"],
        causal=True,
        return_lse=True,
        rope={"cos": to_fw(cos, fw), "sin": to_fw(sin, fw)},
        **O,
    )
    for name, a in arrays.items():
        np.testing.assert_array_equal(np.asarray(given[name]), a, err_msg=name)


def test_attention_window_softcap_sinks_errors(fw):
    q, k, v = (to_fw(a, fw) for a in _qkv())
    at = fastpe.attention
    raises(ValueError, "window\\[0\\] must be >= -1; got -2", at, q, k, v, window=(-2, 0), **O)
    raises(ValueError, "window\\[1\\] must be >= -1; got -5", at, q, k, v, window=[3, -5], **O)
    raises(
        TypeError, "window\\[0\\] must be an integer; got 1.5", at, q, k, v, window=(1.5, 0), **O
    )
    raises(
        TypeError, "window\\[1\\] must be an integer; got True", at, q, k, v, window=(1, True), **O
    )
    raises(TypeError, "window must be None or a pair", at, q, k, v, window=4, **O)
    raises(TypeError, "window must be None or a pair", at, q, k, v, window=(1, 2, 3), **O)
    raises(TypeError, "window must be None or a pair", at, q, k, v, window="12", **O)
    raises(ValueError, "softcap must be > 0; got 0.0", at, q, k, v, softcap=0.0, **O)
    raises(ValueError, "softcap must be > 0; got -1.0", at, q, k, v, softcap=-1, **O)
    raises(
        ValueError,
        "softcap must be finite and > 0; got nan",
        at,
        q,
        k,
        v,
        softcap=float("nan"),
        **O,
    )
    raises(
        ValueError,
        "softcap must be finite and > 0; got inf",
        at,
        q,
        k,
        v,
        softcap=float("inf"),
        **O,
    )
    raises(TypeError, "softcap must be a real number", at, q, k, v, softcap="30", **O)
    raises(
        ValueError,
        "sinks must have shape \\[Hq\\] = \\[2\\]; got \\(3,\\)",
        at,
        q,
        k,
        v,
        sinks=to_fw(np.zeros(3, f32), fw),
        **O,
    )
    raises(
        ValueError,
        "sinks must have shape \\[Hq\\] = \\[2\\]; got \\(1, 2\\)",
        at,
        q,
        k,
        v,
        sinks=to_fw(np.zeros((1, 2), f32), fw),
        **O,
    )
    raises(
        TypeError,
        "sinks must have a float dtype",
        at,
        q,
        k,
        v,
        sinks=to_fw(np.zeros(2, np.int64), fw),
        **O,
    )
    for bad in (np.nan, np.inf, -np.inf):
        raises(
            ValueError,
            "sinks must be finite",
            at,
            q,
            k,
            v,
            sinks=to_fw(np.array([0.0, bad], f32), fw),
            **O,
        )
    # np.int64 entries are integers too
    at(q, k, v, window=(np.int64(1), np.int32(-1)), **O)


# ---------------------------------------------------------------------------------------------
# Data-dependent checks on tensors: reduced where the data lives (issue 16, item 3).


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_range_checks_reduce_tensors_in_place(monkeypatch):
    """Valid ids/lengths never leave the device (here: never become NumPy); narrow int dtypes
    are compared without wrapping; a bad one is still named with its index."""
    from fastpe._validate import check_position, check_range

    def no_host_copy(self, *args, **kwargs):
        raise AssertionError("a valid tensor was copied to the host")

    monkeypatch.setattr(torch.Tensor, "numpy", no_host_copy)
    check_range("ids", torch.tensor([[0, 4], [3, 1]], dtype=torch.int32), 0, 5)
    check_range("ids", torch.tensor([7], dtype=torch.int32), 0, 2**32)
    check_position("positions", torch.tensor([0, 2**32 - 1]))
    monkeypatch.undo()  # the error path may copy: it locates the bad entry
    with pytest.raises(IndexError, match=r"ids contains 5 at index \[1, 0\], outside \[0, 5\)"):
        check_range("ids", torch.tensor([[0, 4], [5, 1]], dtype=torch.uint8), 0, 5)
    with pytest.raises(ValueError, match=r"positions contains 4294967296 at index \[1\]"):
        check_position("positions", torch.tensor([3, 2**32]))


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_value_checks_skip_device_tensors_unless_asked(monkeypatch):
    """Checks that guard only the result (finite ALiBi/T5 tables, positions < 2^32) do not read
    accelerator tensors (a host sync per call) unless FASTPE_CHECK_DEVICE_DATA=1. A meta tensor
    stands in for a CUDA one: it has a device but no data, so any read of it raises."""
    from fastpe._validate import check_finite, check_position, check_range

    slopes = torch.empty(8, device="meta")
    positions = torch.empty(16, dtype=torch.int64, device="meta")
    monkeypatch.delenv("FASTPE_CHECK_DEVICE_DATA", raising=False)
    check_finite("alibi_slopes", slopes)
    check_position("positions", positions)
    with pytest.raises((RuntimeError, NotImplementedError)):  # memory-safety checks always read
        check_range("ids", positions, 0, 10)
    monkeypatch.setenv("FASTPE_CHECK_DEVICE_DATA", "1")
    with pytest.raises((RuntimeError, NotImplementedError)):
        check_finite("alibi_slopes", slopes)
    with pytest.raises((RuntimeError, NotImplementedError)):
        check_position("positions", positions)
    # on the CPU the checks always run
    monkeypatch.delenv("FASTPE_CHECK_DEVICE_DATA")
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        check_finite("alibi_slopes", torch.tensor([1.0, float("inf")]))
