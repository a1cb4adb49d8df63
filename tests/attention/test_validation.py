"""Bad input to attention and merge_attention gets a clear error naming the argument — never a
crash or a silent wrong answer."""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import raises, to_fw, torch

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
