"""``s_aux`` (attention sinks, transformers' name for gpt-oss's) in every ``fastpe.flash_attn``
function, against a float64 softmax written here with one sink logit per head in the
denominator; errors name ``s_aux``; transformers' continuous-batching adapters pass it through.
(The serving adapter layer, ``fastpe/backends/_serving.py``, is covered by the serving tests.)
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS

import fastpe
from fastpe import flash_attn

torch = pytest.importorskip("torch")

BACKENDS = ["numpy", *KERNEL_BACKENDS]


def softmax_with_sink(q, k, v, sink, causal):
    """One sequence: q [Sq, Hq, D], k/v [Sk, Hkv, D], sink [Hq] -> out [Sq, Hq, Dv] (float64).
    exp(sink[h]) joins every row's denominator and adds no value; causal is bottom-right."""
    sq, hq, d = q.shape
    sk, hkv, dv = v.shape
    out = np.zeros((sq, hq, dv))
    for h in range(hq):
        g = h // (hq // hkv)  # GQA: consecutive query heads share a key head
        scores = q[:, h] @ k[:, g].T / np.sqrt(d)
        if causal:
            allowed = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
            scores = np.where(allowed, scores, -np.inf)
        top = np.maximum(scores.max(axis=1, initial=-np.inf), sink[h])
        weights = np.exp(scores - top[:, None])
        denominator = weights.sum(axis=1) + np.exp(sink[h] - top)
        out[:, h] = weights @ v[:, g] / denominator[:, None]
    return out


def tensors(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def f64(x):
    return x.detach().double().numpy()


def sinks(rng, heads):
    # large enough that a dropped sink shows: several rows' mass goes to the sink
    return torch.from_numpy((rng.standard_normal(heads) * 2 + 1).astype(np.float32))


def close(out, expected):
    np.testing.assert_allclose(f64(out), expected, rtol=1e-4, atol=1e-5)


def dense_reference(q, k, v, s_aux, causal):
    return np.stack(
        [
            softmax_with_sink(f64(q[b]), f64(k[b]), f64(v[b]), f64(s_aux), causal)
            for b in range(q.shape[0])
        ]
    )


def varlen_reference(q, k, v, cu_q, cu_k, s_aux, causal):
    return np.concatenate(
        [
            softmax_with_sink(
                f64(q[cu_q[b] : cu_q[b + 1]]),
                f64(k[cu_k[b] : cu_k[b + 1]]),
                f64(v[cu_k[b] : cu_k[b + 1]]),
                f64(s_aux),
                causal,
            )
            for b in range(len(cu_q) - 1)
        ]
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_s_aux(backend, causal, rng):
    q, k, v = tensors(rng, 2, 5, 4, 8), tensors(rng, 2, 7, 2, 8), tensors(rng, 2, 7, 2, 8)
    s_aux = sinks(rng, 4)
    with fastpe.use_backend(backend):
        out = flash_attn.flash_attn_func(q, k, v, causal=causal, s_aux=s_aux)
    close(out, dense_reference(q, k, v, s_aux, causal))


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_packed_funcs_s_aux(backend, rng):
    qkv = tensors(rng, 2, 6, 3, 4, 8)
    q, kv = tensors(rng, 2, 5, 4, 8), tensors(rng, 2, 7, 2, 2, 8)
    s_aux = sinks(rng, 4)
    with fastpe.use_backend(backend):
        out_qkv = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True, s_aux=s_aux)
        out_kv = flash_attn.flash_attn_kvpacked_func(q, kv, causal=True, s_aux=s_aux)
    close(out_qkv, dense_reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], s_aux, True))
    close(out_kv, dense_reference(q, kv[:, :, 0], kv[:, :, 1], s_aux, True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_funcs_s_aux(backend, causal, rng):
    cu_q = np.array([0, 3, 4, 8], np.int32)
    cu_k = np.array([0, 5, 7, 11], np.int32)
    q, k, v = tensors(rng, 8, 4, 8), tensors(rng, 11, 2, 8), tensors(rng, 11, 2, 8)
    kv = torch.stack([k, v], dim=1)
    qkv = torch.stack([q, tensors(rng, 8, 4, 8), tensors(rng, 8, 4, 8)], dim=1)
    s_aux = sinks(rng, 4)
    tq, tk = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    with fastpe.use_backend(backend):
        out = flash_attn.flash_attn_varlen_func(q, k, v, tq, tk, 4, 5, causal=causal, s_aux=s_aux)
        out_kv = flash_attn.flash_attn_varlen_kvpacked_func(
            q, kv, tq, tk, 4, 5, causal=causal, s_aux=s_aux
        )
        out_qkv = flash_attn.flash_attn_varlen_qkvpacked_func(
            qkv, tq, 4, causal=causal, s_aux=s_aux
        )
    expected = varlen_reference(q, k, v, cu_q, cu_k, s_aux, causal)
    close(out, expected)
    close(out_kv, expected)
    close(out_qkv, varlen_reference(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_q, cu_q, s_aux, causal))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_s_aux(backend, paged, rng):
    batch, sq, new, hq, hkv, d = 2, 2, 2, 4, 2, 8
    lengths = np.array([3, 5])
    if paged:  # blocks of 4 positions; sequence b reads blocks table[b]
        table = np.array([[2, 0], [1, 3]], np.int32)
        k_cache, v_cache = tensors(rng, 4, 4, hkv, d), tensors(rng, 4, 4, hkv, d)
    else:
        table = None
        k_cache, v_cache = tensors(rng, batch, 8, hkv, d), tensors(rng, batch, 8, hkv, d)
    q, k, v = (
        tensors(rng, batch, sq, hq, d),
        tensors(rng, batch, new, hkv, d),
        tensors(rng, batch, new, hkv, d),
    )
    s_aux = sinks(rng, hq)

    def sequence(cache, b):  # [positions, Hkv, D] of sequence b, before the append
        return f64(cache[table[b]].reshape(-1, hkv, d) if paged else cache[b])

    old = [(sequence(k_cache, b), sequence(v_cache, b)) for b in range(batch)]
    with fastpe.use_backend(backend):
        out = flash_attn.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=torch.from_numpy(lengths.astype(np.int32)),
            block_table=None if table is None else torch.from_numpy(table),
            causal=True,
            s_aux=s_aux,
        )
    for b, n in enumerate(lengths):
        keys = np.concatenate([old[b][0][:n], f64(k[b])])
        values = np.concatenate([old[b][1][:n], f64(v[b])])
        close(out[b], softmax_with_sink(f64(q[b]), keys, values, f64(s_aux), True))


def test_s_aux_none_is_no_sink(rng):
    q, k, v = tensors(rng, 1, 3, 2, 8), tensors(rng, 1, 3, 2, 8), tensors(rng, 1, 3, 2, 8)
    plain = flash_attn.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(flash_attn.flash_attn_func(q, k, v, causal=True, s_aux=None), plain)
    # a sink of logit 0 takes weight from every row: s_aux is not ignored
    assert not torch.allclose(
        flash_attn.flash_attn_func(q, k, v, causal=True, s_aux=torch.zeros(2)), plain
    )


def test_s_aux_gradient_matches_sinks(rng):
    q, k, v = tensors(rng, 1, 4, 2, 8), tensors(rng, 1, 4, 2, 8), tensors(rng, 1, 4, 2, 8)
    s_aux = sinks(rng, 2).requires_grad_()
    flash_attn.flash_attn_func(q, k, v, causal=True, s_aux=s_aux).sum().backward()
    sinks_too = s_aux.detach().clone().requires_grad_()
    fastpe.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, sinks=sinks_too
    ).sum().backward()
    torch.testing.assert_close(s_aux.grad, sinks_too.grad)


def _call(function, rng, s_aux):
    q4, k4 = tensors(rng, 1, 3, 4, 8), tensors(rng, 1, 3, 2, 8)
    q3, k3 = tensors(rng, 3, 4, 8), tensors(rng, 3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    calls = {
        "flash_attn_func": lambda: flash_attn.flash_attn_func(q4, k4, k4, s_aux=s_aux),
        "flash_attn_varlen_func": lambda: flash_attn.flash_attn_varlen_func(
            q3, k3, k3, cu, cu, 3, 3, s_aux=s_aux
        ),
        "flash_attn_with_kvcache": lambda: flash_attn.flash_attn_with_kvcache(
            q4, tensors(rng, 1, 4, 2, 8), tensors(rng, 1, 4, 2, 8), cache_seqlens=3, s_aux=s_aux
        ),
    }
    return calls[function]()


@pytest.mark.parametrize(
    "function", ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
)
@pytest.mark.parametrize(
    "s_aux, error, match",
    [
        (torch.zeros(3), ValueError, r"s_aux must have shape \[Hq\] = \[4\]"),
        (torch.tensor([0.0, float("nan"), 0.0, 0.0]), ValueError, "s_aux"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "s_aux"),
    ],
)
def test_s_aux_errors_name_it(function, s_aux, error, match, rng):
    with pytest.raises(error, match=match):
        _call(function, rng, s_aux)


def test_s_aux_is_keyword_only():
    for name in flash_attn.__all__:
        parameter = inspect.signature(getattr(flash_attn, name)).parameters["s_aux"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameter.default is None, name


def test_transformers_adapters_wrap_flash_attn(rng):
    """register_flash's functions are fastpe.flash_attn's, with the signature transformers
    inspects: s_aux declared (else it drops gpt-oss's sinks), no block_table (else it passes
    its paged table, which the varlen function refuses)."""
    pytest.importorskip("transformers")
    from fastpe.integrations import transformers as adapters

    for function in (adapters._flash_func, adapters._flash_varlen_func):
        parameters = inspect.signature(function).parameters
        assert "s_aux" in parameters and "block_table" not in parameters
    s_aux = sinks(rng, 4)
    q, k, v = tensors(rng, 2, 5, 4, 8), tensors(rng, 2, 7, 2, 8), tensors(rng, 2, 7, 2, 8)
    torch.testing.assert_close(
        adapters._flash_func(q, k, v, causal=True, s_aux=s_aux),
        flash_attn.flash_attn_func(q, k, v, causal=True, s_aux=s_aux),
        rtol=0,
        atol=0,
    )
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = tensors(rng, 8, 4, 8), tensors(rng, 8, 2, 8), tensors(rng, 8, 2, 8)
    out = adapters._flash_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, s_aux=s_aux
    )
    close(out, varlen_reference(q, k, v, cu.numpy(), cu.numpy(), s_aux, True))
