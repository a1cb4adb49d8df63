"""Sliding windows, logit soft-capping and attention sinks (issue 13).

Expected values come from the float64 oracle, which is itself checked here against
independent formulations: a window is a boolean mask built from the query positions of
docs/math.md; a sink is one more key of value 0 whose score is given by an additive mask;
soft-capping is written out with NumPy on a tiny input. Every kernel backend is compared with
the oracle on a grid of each feature alone and combined with what attention already has.
"""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, to_fw, to_np, torch

import fastpe

O = {"backend": "numpy"}
ALL_BACKENDS = ["numpy", *KERNEL_BACKENDS]


def _qkv(rng, b, hq, hkv, sq, sk, d, dtype=np.float32, amp=1.0):
    return (
        (amp * rng.standard_normal((b, hq, sq, d))).astype(dtype),
        rng.standard_normal((b, hkv, sk, d)).astype(dtype),
        rng.standard_normal((b, hkv, sk, d)).astype(dtype),
    )


def _close(got, want, tol, what):
    got, want = to_np(got).astype(np.float64), np.asarray(to_np(want), np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{what}: -inf pattern differs"
    finite = np.isfinite(want)
    assert not np.isnan(got).any(), f"NaN in {what}"
    err = np.max(np.abs(got[finite] - want[finite]), initial=0.0)
    bound = tol * max(1.0, np.max(np.abs(want[finite]), initial=0.0))
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _window_mask(b, sq, sk, window, causal, bottom_right, lengths):
    """[B, 1, Sq, Sk] bool: the window (and causal rule) written from docs/math.md's qpos."""
    lengths = np.full(b, sk) if lengths is None else np.asarray(lengths)
    shift = lengths - sq if bottom_right else np.zeros(b, np.int64)
    qpos = (np.arange(sq)[None, :] + shift[:, None])[:, None, :, None]
    j = np.arange(sk)[None, None, None, :]
    left, right = window
    ok = np.ones((b, 1, sq, sk), bool)
    if left >= 0:
        ok &= j >= qpos - left
    if right >= 0:
        ok &= j <= qpos + right
    if causal:
        ok &= j <= qpos
    return ok


# ---------------------------------------------------------------------------------------------
# the oracle against independent formulations


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq,sk", [(5, 12), (12, 5), (9, 9)])
@pytest.mark.parametrize("window", [(3, 1), (0, 0), (2, -1), (-1, 2), (4, 0), (50, 50)])
@pytest.mark.parametrize("causal", [False, True])
def test_oracle_window_is_the_mask_of_the_docs(alignment, sq, sk, window, causal, rng):
    q, k, v = _qkv(rng, 2, 2, 2, sq, sk, 8, np.float64)
    lengths = np.array([sk, max(sk - 3, 0)])
    mask = _window_mask(2, sq, sk, window, causal, alignment == "bottom_right", lengths)
    kw = dict(causal_alignment=alignment, key_lengths=lengths, return_lse=True, **O)
    got = fastpe.attention(q, k, v, window=window, causal=causal, **kw)
    # the mask path applies no causal rule of its own: it is inside the mask
    want = fastpe.attention(q, k, v, mask=mask, **kw)
    np.testing.assert_allclose(got[0], want[0], atol=1e-14)
    np.testing.assert_array_equal(got[1], want[1])


def test_oracle_zero_width_window_reads_the_key_at_the_query_position(rng):
    q, k, v = _qkv(rng, 1, 2, 1, 4, 9, 8, np.float64)
    out = fastpe.attention(q, k, v, window=(0, 0), **O)  # bottom-right: query i sits at i + 5
    np.testing.assert_allclose(out[0], np.broadcast_to(v[0, 0, 5:9], (2, 4, 8)), atol=1e-15)


def test_oracle_softcap_by_hand(rng):
    q, k, v = _qkv(rng, 1, 1, 1, 3, 4, 2, np.float64, amp=4.0)
    bias = rng.standard_normal((3, 4))
    cap, scale = 1.5, 0.7
    s = cap * np.tanh(scale * (q[0, 0] @ k[0, 0].T) / cap) + bias  # capped, then the mask added
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ v[0, 0]
    got = fastpe.attention(q, k, v, softcap=cap, scale=scale, mask=bias, **O)
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-13)


def _with_sink_key(q, k, v, sinks, mask=None):
    """The same call with the sink as a real key: k = v = 0 (score 0), plus sinks[h] added by a
    float mask; every other key keeps its mask value."""
    b, hq, sq, _ = q.shape
    pad = np.zeros(k.shape[:2] + (1, k.shape[3]), k.dtype)
    k2, v2 = np.concatenate([k, pad], 2), np.concatenate([v, pad[..., : v.shape[3]]], 2)
    extra = np.zeros((b, hq, sq, k.shape[2] + 1))
    if mask is not None:
        extra[..., :-1] = np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask
    extra[..., -1] = sinks[None, :, None]
    return q, k2, v2, extra


@pytest.mark.parametrize("causal", [False, True])
def test_oracle_sink_is_a_key_of_value_zero(causal, rng):
    q, k, v = _qkv(rng, 2, 4, 2, 6, 11, 8, np.float64)
    sinks = rng.standard_normal(4) * 2
    mask = rng.random((2, 4, 6, 11)) < 0.8
    mask[0, 0, 0] = False  # a row with no key but the sink
    got = fastpe.attention(q, k, v, sinks=sinks, mask=mask, causal=causal, return_lse=True, **O)
    # with the extra key at j = Sk, the causal rule must not hide it: top-left, written in mask
    causal_ok = np.tril(np.ones((6, 11), bool), 11 - 6) if causal else True
    q2, k2, v2, extra = _with_sink_key(q, k, v, sinks, mask & causal_ok)
    want = fastpe.attention(q2, k2, v2, mask=extra, return_lse=True, **O)
    np.testing.assert_allclose(got[0], want[0], atol=1e-14)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-14)
    assert np.all(got[0][0, 0, 0] == 0.0) and got[1][0, 0, 0] == np.float32(sinks[0])


# ---------------------------------------------------------------------------------------------
# every kernel backend against the oracle


def _case(name, rng, fw):
    """(q, k, v, kwargs) for one grid case; float32 arrays in framework ``fw``."""
    b, hq, hkv, sq, sk, d = 2, 4, 2, 7, 19, 8
    kw = {}
    amp = 1.0
    if name.startswith("swap"):  # Sq > Sk
        sq, sk = 19, 7
    if name.startswith("decode"):  # one query, keys split across threads / programs
        b, sq, sk = 1, 1, 700
    parts = name.split("+")
    for part in parts:
        if part in ("swap", "decode"):
            continue
        if part == "window":
            kw["window"] = (3, 2)
        elif part == "lwin":
            kw["window"] = (4, 0)
        elif part == "left_only":
            kw["window"] = (2, -1)
        elif part == "right_only":
            kw["window"] = (-1, 1)
        elif part == "zero":
            kw["window"] = (0, 0)
        elif part == "huge":
            kw["window"] = (1000, 1000)
        elif part == "bigwin":
            kw["window"] = (300, 0)
        elif part == "softcap":
            kw["softcap"] = 2.0
            amp = 4.0  # scores well beyond the cap
        elif part == "sinks":
            kw["sinks"] = np.array([-1.0, 0.5, 3.0, 0.0][:hq], np.float32)
        elif part == "causal":
            kw["causal"] = True
        elif part == "topleft":
            kw["causal_alignment"] = "top_left"
        elif part == "lengths":
            kw["key_lengths"] = np.array([sk, 2] if b == 2 else [sk - 37], np.int64)
        elif part == "empty":
            kw["key_lengths"] = np.array([0, sk] if b == 2 else [0], np.int64)
        elif part == "mha":
            hkv = hq
        elif part == "alibi":
            kw["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
        elif part == "t5":
            kw["relative_bias"] = {"table": rng.standard_normal((32, hq)).astype(np.float32)}
        elif part == "rope":
            cos_sin = rng.standard_normal((2, max(sq, sk) + 8, d // 2)).astype(np.float32)
            kw["rope"] = {"cos": cos_sin[0], "sin": cos_sin[1]}
        elif part == "boolmask":
            m = rng.random((b, 1, sq, sk)) < 0.8
            kw["mask"] = m
        elif part == "addmask":
            kw["mask"] = rng.standard_normal((sq, sk)).astype(np.float32)
        else:
            raise AssertionError(part)
    q, k, v = _qkv(rng, b, hq, hkv, sq, sk, d, amp=amp)
    for key in ("sinks", "key_lengths", "alibi_slopes", "mask"):
        if key in kw:
            kw[key] = to_fw(kw[key], fw)
    if "relative_bias" in kw:
        kw["relative_bias"]["table"] = to_fw(kw["relative_bias"]["table"], fw)
    if "rope" in kw:
        kw["rope"] = {key: to_fw(val, fw) for key, val in kw["rope"].items()}
    return [to_fw(a, fw) for a in (q, k, v)], kw


GRID = [
    "window",
    "lwin+causal",
    "lwin+causal+topleft",
    "left_only",
    "right_only",
    "zero",
    "huge+causal",
    "swap+lwin+causal",
    "swap+lwin+causal+topleft",
    "swap+window+sinks",
    "softcap",
    "sinks",
    "sinks+empty",
    "window+empty+sinks+causal",
    "lwin+causal+lengths+softcap+sinks",
    "lwin+causal+topleft+lengths+sinks",
    "window+softcap+sinks+alibi",
    "lwin+causal+alibi+lengths",
    "window+t5+sinks",
    "lwin+causal+rope+softcap",
    "window+boolmask+sinks",
    "window+addmask+softcap+mha",
    "lwin+causal+softcap+sinks+alibi+t5+rope+addmask+lengths",
    "decode+bigwin+causal+sinks",
    "decode+bigwin+causal+softcap+lengths",
    "decode+sinks+mha",
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", GRID)
def test_kernels_match_the_oracle(backend, fw, case, rng):
    if backend == "triton" and fw == "numpy":
        pytest.skip("triton takes torch tensors")
    args, kw = _case(case, rng, fw)
    got, got_lse = fastpe.attention(*args, return_lse=True, **kw, backend=backend)
    want, want_lse = fastpe.attention(*args, return_lse=True, **kw, **O)
    _close(got, want, 3e-5, f"{case} out")
    _close(got_lse, want_lse, 3e-5, f"{case} lse")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_sinks_equal_an_extra_key(backend, fw, rng):
    """Every backend: sinks = one more key of value 0 with its score given by a float mask."""
    if backend == "triton" and fw == "numpy":
        pytest.skip("triton takes torch tensors")
    q, k, v = _qkv(rng, 2, 4, 2, 5, 30, 8)
    sinks = np.array([-2.0, 0.0, 1.0, 4.0], np.float32)
    q2, k2, v2, extra = _with_sink_key(q, k, v, sinks)
    got = fastpe.attention(
        *(to_fw(a, fw) for a in (q, k, v)), sinks=to_fw(sinks, fw), return_lse=True, backend=backend
    )
    want = fastpe.attention(q2, k2, v2, mask=extra.astype(np.float32), return_lse=True, **O)
    _close(got[0], want[0], 3e-5, "out")
    _close(got[1], want[1], 3e-5, "lse")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("window", [None, (40, 0)])
def test_split_keys_with_sinks_merge_exactly(backend, fw, window, rng):
    """Split-KV decoding by hand: the sink goes to one part only; merging gives the whole."""
    if backend == "triton" and fw == "numpy":
        pytest.skip("triton takes torch tensors")
    q, k, v = _qkv(rng, 1, 4, 2, 1, 200, 8)
    sinks = np.array([-2.0, 0.0, 1.0, 4.0], np.float32)
    t = lambda a: to_fw(a, fw)  # noqa: E731
    kw = dict(return_lse=True, backend=backend)
    whole = fastpe.attention(t(q), t(k), t(v), sinks=t(sinks), window=window, **kw)
    n = 170
    # part a holds keys 0 … n-1: the whole's window (query at 199) reaches down to 199 - 40
    visible = None if window is None else t(np.arange(n) >= 199 - window[0])
    part_a = fastpe.attention(
        t(q), t(k[:, :, :n]), t(v[:, :, :n]), sinks=t(sinks), mask=visible, **kw
    )
    part_b = fastpe.attention(t(q), t(k[:, :, n:]), t(v[:, :, n:]), window=window, **kw)
    out, lse = fastpe.merge_attention(*part_a, *part_b, backend=backend)
    _close(out, whole[0], 3e-5, "out")
    _close(lse, whole[1], 3e-5, "lse")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_window_skips_tiles_it_never_reads(backend, fw, rng):
    """Keys outside every query's window are never read: NaN there does not reach the output."""
    if backend == "triton" and fw == "numpy":
        pytest.skip("triton takes torch tensors")
    q, k, v = _qkv(rng, 1, 2, 2, 4, 900, 8)
    want = fastpe.attention(q, k, v, window=(5, 0), causal=True, **O)
    k[:, :, :880] = np.nan  # bottom-right: the queries sit at 896 … 899 and see 891 … 899
    v[:, :, :880] = np.nan
    got = fastpe.attention(
        to_fw(q, fw), to_fw(k, fw), to_fw(v, fw), window=(5, 0), causal=True, backend=backend
    )
    _close(got, want, 3e-5, "out")


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_custom_op_passes_the_new_options(rng):
    """Under autograd recording the call goes through fastpe::attention's flat schema."""
    q, k, v = (torch.from_numpy(a) for a in _qkv(rng, 1, 2, 1, 5, 9, 8))
    sinks = torch.tensor([0.5, -1.0])
    kw = dict(window=(2, 0), causal=True, softcap=3.0, sinks=sinks, return_lse=True, **O)
    eager = fastpe.attention(q, k, v, **kw)
    recorded = fastpe.attention(q.clone().requires_grad_(), k, v, **kw)
    _close(recorded[0].detach(), eager[0], 1e-6, "out")
    _close(recorded[1], eager[1], 1e-6, "lse")
    with pytest.raises(ValueError, match="window\\[1\\] must be >= -1"):
        fastpe.attention(q.clone().requires_grad_(), k, v, window=(2, -3), **O)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        fastpe.attention(q.clone().requires_grad_(), k, v, softcap=0.0, **O)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("how", ["no_keys", "all_padding", "window_past_the_keys"])
def test_rows_with_only_the_sink(backend, fw, how, rng):
    """A row that sees no key but the sink: out = 0 and lse = the sink."""
    if backend == "triton" and fw == "numpy":
        pytest.skip("triton takes torch tensors")
    b, hq, hkv, sq, sk, d = 2, 4, 2, 50, (0 if how == "no_keys" else 40), 8
    q, k, v = (to_fw(a, fw) for a in _qkv(rng, b, hq, hkv, sq, sk, d))
    sinks = np.array([-3.0, 0.0, 0.25, 7.5], np.float32)
    kw = dict(sinks=to_fw(sinks, fw), return_lse=True, backend=backend)
    empty = slice(None)
    if how == "all_padding":
        kw["key_lengths"] = to_fw(np.zeros(b, np.int64), fw)
    elif how == "window_past_the_keys":  # top-left: queries 40 … 49 sit past the last key
        kw.update(window=(0, 0), causal_alignment="top_left")
        empty = slice(sk, None)
    out, lse = fastpe.attention(q, k, v, **kw)
    np.testing.assert_array_equal(to_np(out)[:, :, empty], 0.0)
    want = np.broadcast_to(sinks[None, :, None], (b, hq, sq))[:, :, empty]
    np.testing.assert_array_equal(to_np(lse)[:, :, empty], want)


def test_numba_softcap_tanh_accuracy():
    """The Numba kernel's float32 soft-cap (a rational tanh) against float64 tanh over the whole
    float32 range that matters (tiny to saturated scores, both signs): within 4e-7 of the cap,
    never above it, and exactly odd."""
    pytest.importorskip("numba")
    from fastpe.kernels.numba._attention_common import _softcap

    mags = np.concatenate([np.geomspace(1e-30, 1e4, 200_000), np.linspace(0, 12, 200_001)])
    s = np.concatenate([mags, -mags]).astype(np.float32)
    for cap in (1.0, 2.0**-3, 50.0):
        got = s.copy()[None]
        _softcap(got, cap)
        want = cap * np.tanh(s.astype(np.float64) / cap)
        assert np.abs(got[0] - want).max() <= 4e-7 * cap
        assert np.abs(got[0]).max() <= cap * (1 + 2.0**-22)
        n = mags.size
        np.testing.assert_array_equal(got[0, :n], -got[0, n:])


def test_every_launcher_takes_the_shared_options():
    """``AttentionOptions.launched`` is how every backend hands the options to its
    launchers: the oracle takes them as keywords (``keywords()``) and must take each, the Numba
    launchers must read every field of the record, the Triton launchers take the record whole
    (a new option that a launcher lacks fails here, not in one backend's call)."""
    import importlib
    import inspect

    from fastpe import reference
    from fastpe._options import AttentionOptions

    given = set(AttentionOptions(scale=1.0).keywords())
    if fastpe.backends.numba.unavailable_reason() is None:
        _numba_launchers_read_every_option(AttentionOptions(scale=1.0), given)
    launchers = [reference.attention, reference.attention_backward, reference.attention_varlen]

    def parameters(fn) -> set[str]:
        names = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in names.values()):
            # the oracle's attention and its backward pass **options on to _attention_logits
            return {*names, *inspect.signature(reference._attention_logits).parameters}
        return set(names)

    for launcher in launchers:
        missing = given - parameters(launcher)
        assert not missing, f"{launcher.__qualname__} lacks {sorted(missing)}"

    # the Triton launchers take the launched record whole, as ``options``, and no option
    # besides it as a keyword of its own
    if fastpe.backends.triton.unavailable_reason() is None:
        for module, name in (
            ("attention", "attention_triton"),
            ("attention_backward", "attention_backward_triton"),
            ("attention_paged", "attention_paged_triton"),
        ):
            launcher = getattr(importlib.import_module(f"fastpe.kernels.triton.{module}"), name)
            names = set(inspect.signature(launcher).parameters)
            assert "options" in names, f"{name} does not take options"
            assert not given & names, f"{name} takes {sorted(given & names)} besides options"


def _numba_launchers_read_every_option(options, given):
    """The Numba launchers take the record whole (``options=``): each call must read every
    launched field of it, so that a new option no launcher applies fails here."""
    from fastpe.kernels.numba.attention import attention_numba
    from fastpe.kernels.numba.attention_backward import attention_backward_numba
    from fastpe.kernels.numba.attention_paged import attention_paged_numba

    class Reads:
        """The record, noting which fields are read."""

        def __init__(self, record):
            self.record, self.names = record, set()

        def __getattr__(self, name):
            self.names.add(name)
            return getattr(self.record, name)

    x = np.ones((1, 1, 2, 4), np.float32)
    lse = np.zeros((1, 1, 2), np.float32)
    rows = np.ones((2, 1, 4), np.float32)  # one sequence of 2 queries and 2 keys, one page
    one, two = np.zeros(1, np.int64), np.full(1, 2, np.int64)
    calls = {
        "attention_numba": lambda o: attention_numba(x, x, x, options=o),
        "attention_backward_numba": lambda o: attention_backward_numba(
            x, x, x, x, lse, x, options=o
        ),
        "attention_paged_numba": lambda o: attention_paged_numba(
            rows,
            rows,
            rows,
            q_start=one,
            q_len=two,
            k_len=two,
            page_start=one[:, None],
            page_size=2,
            options=o,
        ),
    }
    for name, call in calls.items():
        spy = Reads(options.launched(np.asarray))
        call(spy)
        missing = given - spy.names
        assert not missing, f"{name} ignores {sorted(missing)}"
