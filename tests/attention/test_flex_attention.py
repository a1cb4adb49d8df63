"""fastpe.flex_attention: user-defined score and mask modifiers on the float64 oracle and the
Numba kernels.

Expected values come from torch's own FlexAttention (eager on the CPU: forward, and gradients
of captured tensors when q, k, v need none) and, for gradients of q, k, v, from torch autograd
through an independent eager formulation (the modifiers called on broadcast index tensors); the
oracle is also checked in float64 against torch's FlexAttention in float64, and its captured
gradients against finite differences. Eight patterns share five compiled variants (each variant is a Numba compile, so
patterns are paired: a mask with a score modifier), over one shape with GQA, and Sq ≠ Sk on two.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _testkit import torch

import fastpe
from fastpe import mods

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not installed")

if torch is not None:
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

B, HQ, HKV, D = 2, 4, 2, 16
SQ = SK = 160
BLOCK = 64  # blocks of 64 over 160 positions: skipped, full, partial and tail blocks
CAP, WINDOW, CHUNK = 20.0, 48, 40


def _patterns(sq, sk):
    """name -> (score_mod, mask_mod) of torch-written modifiers, with the tensors they capture.
    Each pairs a mask with a score modifier (or none): one compiled variant per pair."""
    g = torch.Generator().manual_seed(7)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    table = torch.randn(HQ, sq + sk, generator=g)
    doc = torch.tensor([0] * 50 + [1] * 70 + [2] * (max(sq, sk) - 120))
    prefix = torch.tensor([30, 70])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcap(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP)

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * torch.abs(q_idx - kv_idx)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + sk]

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    def chunked_local(b, h, q_idx, kv_idx):
        return q_idx // CHUNK == kv_idx // CHUNK

    return {
        "causal+softcap": (softcap, causal),
        "window+alibi": (alibi, sliding_window),
        "document+relative_bias": (relative_bias, document),
        "prefix_lm": (None, prefix_lm),
        "chunked_local": (None, chunked_local),
    }, dict(slopes=slopes, table=table, doc=doc, prefix=prefix)


def _qkv(sq, sk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, HQ, sq, D, generator=g, dtype=dtype),
        torch.randn(B, HKV, sk, D, generator=g, dtype=dtype),
        torch.randn(B, HKV, sk, D, generator=g, dtype=dtype),
    )


def _torch_reference(q, k, v, score_mod, mask_mod):
    """torch's FlexAttention (eager, no gradients on the CPU): (out, lse)."""
    block_mask = None
    if mask_mod is not None:
        block_mask = torch_block_mask(
            mask_mod, B, None, q.shape[2], k.shape[2], device="cpu", BLOCK_SIZE=BLOCK
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile", "return_lse"
        return torch_flex(
            q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True
        )  # fmt: skip


def _eager(q, k, v, score_mod, mask_mod):
    """An independent formulation for autograd: the modifiers on broadcast index tensors."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    idx = [torch.arange(n).view(*(-1 if a == i else 1 for a in range(4))) for i, n in
           enumerate(s.shape)]  # fmt: skip
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), -torch.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def _close(got, want, tol, what):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf pattern"
    finite = torch.isfinite(want)
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    bound = tol * max(1.0, want[finite].abs().max().item() if finite.any() else 0.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


SHAPES = [(name, SQ, SK) for name in _patterns(SQ, SK)[0]]
SHAPES += [("causal+softcap", 96, SK), ("document+relative_bias", 200, 120)]


@pytest.mark.parametrize("pattern,sq,sk", SHAPES)
def test_forward_matches_torch_flex_attention(pattern, sq, sk):
    score_mod, mask_mod = _patterns(sq, sk)[0][pattern]
    q, k, v = _qkv(sq, sk, torch.float32)
    want_out, want_lse = _torch_reference(q, k, v, score_mod, mask_mod)
    block_mask = None
    if mask_mod is not None:
        block_mask = fastpe.create_block_mask(mask_mod, B, None, sq, sk, BLOCK_SIZE=BLOCK)
    for backend in ("numba", "numpy"):
        out, lse = fastpe.flex_attention(
            q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True, backend=backend
        )
        assert out.dtype == torch.float32 and out.shape == want_out.shape
        _close(out, want_out, 2e-5, f"{backend} out")
        _close(lse, want_lse, 2e-5, f"{backend} lse")
    # the float64 oracle against torch's FlexAttention in float64
    q64, k64, v64 = (x.double() for x in (q, k, v))
    want_out, want_lse = _torch_reference(q64, k64, v64, score_mod, mask_mod)
    out, lse = fastpe.flex_attention(
        q64, k64, v64, score_mod, block_mask, enable_gqa=True, return_lse=True, backend="numpy"
    )
    _close(out, want_out, 1e-12, "oracle out (float64)")
    _close(lse, want_lse, 1e-12, "oracle lse (float64)")


@pytest.mark.parametrize("pattern,sq,sk", [("window+alibi", SQ, SK), ("causal+softcap", 96, SK)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_inputs_on_numba(pattern, sq, sk, dtype, monkeypatch):
    """bfloat16 / float16 q, k, v (read by the kernels as their bits, widened tile by tile, also
    in the paired 128-key tiles of 64-key blocks) give exactly the float32 call on the widened
    values, rounded to the input dtype, and are within half-precision error of the oracle. (On
    a CPU with AVX512-BF16 the forward multiplies bfloat16 pairs instead, switched off here:
    tests/attention/test_pair_products.py checks that path.)"""
    from fastpe.kernels.numba import _pair_products

    monkeypatch.setattr(_pair_products, "available", lambda: False)
    score_mod, mask_mod = _patterns(sq, sk)[0][pattern]
    half = [x.to(getattr(torch, dtype)) for x in _qkv(sq, sk, torch.float32, seed=3)]
    block_mask = fastpe.create_block_mask(mask_mod, B, None, sq, sk, BLOCK_SIZE=BLOCK)

    def run(q, k, v, backend="numba"):
        return fastpe.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                     return_lse=True, backend=backend)  # fmt: skip

    out, lse = run(*half)
    assert out.dtype == half[0].dtype and lse.dtype == torch.float32
    widened_out, widened_lse = run(*(x.float() for x in half))
    assert torch.equal(out, widened_out.to(out.dtype))
    assert torch.equal(lse, widened_lse)
    want_out, want_lse = run(*(x.double() for x in half), backend="numpy")
    _close(out, want_out, 1e-2, f"{dtype} out")
    _close(lse, want_lse, 1e-5, f"{dtype} lse")


def test_rows_without_keys_give_zero_and_minus_inf():
    """Queries of the third document see no key when there are only 120 keys."""
    score_mod, mask_mod = _patterns(200, 120)[0]["document+relative_bias"]
    q, k, v = _qkv(200, 120, torch.float32)
    block_mask = fastpe.create_block_mask(mask_mod, B, None, 200, 120, BLOCK_SIZE=BLOCK)
    out, lse = fastpe.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                     return_lse=True)  # fmt: skip
    assert torch.all(out[:, :, 120:] == 0) and torch.all(torch.isneginf(lse[:, :, 120:]))
    assert torch.isfinite(lse[:, :, :120]).all()


@pytest.mark.parametrize(
    "pattern,sq,sk,trained",
    [
        ("causal+softcap", SQ, SK, None),
        ("window+alibi", 120, 200, "slopes"),
        ("document+relative_bias", 200, 120, "table"),
    ],
)
def test_backward_matches_torch_autograd(pattern, sq, sk, trained):
    """dq, dk, dv equal torch autograd's; with ``trained``, the captured tensor (learned ALiBi
    slopes, a learned relative-bias table) requires grad too, and its gradient equals torch's
    FlexAttention's (eager autograd in float64: on the CPU torch differentiates captured tensors
    when q, k, v need no grad). The kernels compute in float32, the oracle in float64."""
    patterns, captured = _patterns(sq, sk)
    score_mod, mask_mod = patterns[pattern]
    q, k, v = _qkv(sq, sk, torch.float32, seed=1)
    grad_out = torch.randn(B, HQ, sq, D, generator=torch.Generator().manual_seed(2))
    block_mask = fastpe.create_block_mask(mask_mod, B, None, sq, sk, BLOCK_SIZE=BLOCK)
    make = {"table": lambda t: _relative_bias(t, sk), "slopes": _alibi, None: None}[trained]
    values = captured.get(trained)  # its dtype as in _patterns: the compiled variant's

    def grads(backend, dtype, tensor=None):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        if tensor is None:
            out = fastpe.flex_attention(*leaves, score_mod, block_mask, enable_gqa=True,
                                        backend=backend)  # fmt: skip
        else:
            out = fastpe.flex_attention(*leaves, make(tensor), block_mask, enable_gqa=True,
                                        backend=backend)  # fmt: skip
        (out * grad_out.to(dtype)).sum().backward()
        return [x.grad for x in leaves]

    want = [x.detach().double().requires_grad_() for x in (q, k, v)]
    (_eager(*want, score_mod, mask_mod) * grad_out.double()).sum().backward()
    if trained is not None:
        leaf = values.detach().double().requires_grad_()
        theirs = torch_block_mask(mask_mod, B, None, sq, sk, device="cpu", BLOCK_SIZE=BLOCK)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch_flex(*(x.double() for x in (q, k, v)), make(leaf), theirs,
                             enable_gqa=True)  # fmt: skip
        (out * grad_out.double()).sum().backward()
        want_captured = leaf.grad
        assert want_captured.abs().max() > 0.1  # the gradient is not trivially zero
    for backend, dtype, tol in (("numba", torch.float32, 5e-5), ("numpy", torch.float64, 1e-10)):
        tensor = None
        if trained is not None:
            tensor = values.detach().to(values.dtype if backend == "numba" else dtype)
            tensor.requires_grad_()
        got = grads(backend, dtype, tensor)
        for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
            assert g.dtype == dtype
            _close(g, w.grad, tol, f"{backend} {name}")
        if tensor is not None:
            assert tensor.grad.dtype == tensor.dtype and tensor.grad.shape == tensor.shape
            _close(tensor.grad, want_captured, tol, f"{backend} d{trained}")


def test_gradient_of_lse():
    """lse's gradient flows too (dlse enters as D = rowsum(dO∘O) - dlse)."""
    score_mod, mask_mod = _patterns(SQ, SK)[0]["causal+softcap"]
    q, k, v = _qkv(SQ, SK, torch.float32, seed=3)
    block_mask = fastpe.create_block_mask(mask_mod, B, None, SQ, SK, BLOCK_SIZE=BLOCK)

    def loss(backend):
        dtype = torch.float32 if backend == "numba" else torch.float64
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out, lse = fastpe.flex_attention(*leaves, score_mod, block_mask, enable_gqa=True,
                                         return_lse=True, backend=backend)  # fmt: skip
        (out.sum() + (lse * torch.linspace(-1, 1, SQ, dtype=dtype)).sum()).backward()
        return [x.grad for x in leaves]

    for got, want in zip(loss("numba"), loss("numpy"), strict=True):
        _close(got, want, 5e-5, "gradient through lse")


def _relative_bias(table, sk):
    """relative_bias of ``_patterns`` over the given table (with a float32 table, its variant)."""

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + sk]

    return relative_bias


def _alibi(slopes):
    """alibi of ``_patterns`` over the given slopes (with float64 slopes, its variant)."""

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * torch.abs(q_idx - kv_idx)

    return alibi


def test_captured_gradients_pass_gradcheck():
    """Finite differences in float64 (the oracle) on a tiny case: a relative-bias table, ALiBi
    slopes, a per-head soft-cap scale and a 0-d temperature read by score_mod, the table also
    read by mask_mod (whose reads have no gradient: the block structure is piecewise constant in
    them)."""
    sq, sk, hq = 5, 4, 2
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, h, s, 3, generator=g, dtype=torch.float64) for h, s in
               ((hq, sq), (1, sk), (1, sk)))  # fmt: skip
    table = torch.randn(hq, sq + sk, generator=g, dtype=torch.float64)
    table[table.abs() < 0.05] = 0.5  # keep the mask's threshold (0) away from the values
    slopes = torch.tensor([0.3, 0.7], dtype=torch.float64)
    caps = torch.tensor([1.5, 4.0], dtype=torch.float64)
    temperature = torch.tensor(0.8, dtype=torch.float64)

    def run(q, table, slopes, caps, temperature):
        def score_mod(score, b, h, q_idx, kv_idx):
            biased = score * temperature + table[h, q_idx - kv_idx + sk]
            biased = biased - slopes[h] * (q_idx - kv_idx)
            return caps[h] * torch.tanh(biased / caps[h])

        def mask_mod(b, h, q_idx, kv_idx):
            return (table[h, q_idx - kv_idx + sk] > 0) | (q_idx == kv_idx)

        return fastpe.flex_attention(q, k, v, score_mod, enable_gqa=True, backend="numpy",
                                     mask_mod=mask_mod)  # fmt: skip

    inputs = [x.clone().requires_grad_() for x in (q, table, slopes, caps, temperature)]
    assert torch.autograd.gradcheck(run, inputs)


def test_builtins_written_as_modifiers_match_the_builtin_options():
    q, k, v = _qkv(SQ, SK, torch.float32)
    patterns, captured = _patterns(SQ, SK)
    score_mod, mask_mod = patterns["causal+softcap"]
    block_mask = fastpe.create_block_mask(mask_mod, B, None, SQ, SK, BLOCK_SIZE=BLOCK)
    got = fastpe.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
    want = fastpe.attention(q, k, v, causal=True, softcap=CAP, backend="numba")
    _close(got, want, 2e-5, "softcap + causal")
    score_mod, mask_mod = patterns["window+alibi"]
    block_mask = fastpe.create_block_mask(mask_mod, B, None, SQ, SK, BLOCK_SIZE=BLOCK)
    got = fastpe.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
    want = fastpe.attention(q, k, v, causal=True, window=(WINDOW - 1, 0),
                            alibi_slopes=captured["slopes"], backend="numba")  # fmt: skip
    _close(got, want, 2e-5, "ALiBi + window")


def test_changed_captured_tensor_changes_result_without_recompile():
    from fastpe.kernels.numba import _runtime
    from fastpe.kernels.numba import flex_attention as kernels

    patterns, captured = _patterns(SQ, SK)
    score_mod, mask_mod = patterns["document+relative_bias"]
    q, k, v = _qkv(SQ, SK, torch.float32)
    block_mask = fastpe.create_block_mask(mask_mod, B, None, SQ, SK, BLOCK_SIZE=BLOCK)
    before = fastpe.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
    variants, compiles = len(kernels.compiled_variants), len(_runtime.compiled_kernels)
    captured["table"].mul_(-2.0)  # the bias the kernel reads
    captured["doc"][100:] = 3  # the document ids (the block mask still covers the new mask)
    after = fastpe.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
    assert (len(kernels.compiled_variants), len(_runtime.compiled_kernels)) == (variants, compiles)
    want = fastpe.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, backend="numpy")
    _close(after, want, 2e-5, "after the change")
    assert (after - before).abs().max() > 0.1


def test_numpy_arrays_with_fastpe_mods():
    """NumPy inputs: the same modifiers written with fastpe.mods (one variant with torch's)."""
    q, k, v = (x.numpy() for x in _qkv(SQ, SK, torch.float32))
    patterns, _ = _patterns(SQ, SK)
    doc = mods.capture(np.array([0] * 50 + [1] * 70 + [2] * 40))

    def softcap(score, b, h, q_idx, kv_idx):
        return CAP * mods.tanh(score / CAP)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = fastpe.create_block_mask(causal, None, None, SQ, SK, BLOCK_SIZE=BLOCK)
    out, lse = fastpe.flex_attention(q, k, v, softcap, block_mask, enable_gqa=True,
                                     return_lse=True)  # fmt: skip
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    want_out, want_lse = _torch_reference(*(torch.from_numpy(x) for x in (q, k, v)),
                                          *patterns["causal+softcap"])  # fmt: skip
    _close(torch.from_numpy(out), want_out, 2e-5, "out")
    _close(torch.from_numpy(lse), want_lse, 2e-5, "lse")
    # a mask given as mask_mod= (block mask made per call) reading a captured NumPy array
    got = fastpe.flex_attention(q, k, v, enable_gqa=True, backend="numpy",
                                mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])  # fmt: skip
    want, _ = _torch_reference(*(torch.from_numpy(x) for x in (q, k, v)), None,
                               patterns["document+relative_bias"][1])  # fmt: skip
    _close(torch.from_numpy(got), want, 1e-5, "document mask from a NumPy array")


def test_block_masks_from_torch_and_mask_mod_keyword():
    patterns, _ = _patterns(SQ, SK)
    _, mask_mod = patterns["chunked_local"]
    ours = fastpe.create_block_mask(mask_mod, None, None, SQ, SK, BLOCK_SIZE=BLOCK)
    theirs = torch_block_mask(mask_mod, None, None, SQ, SK, device="cpu", BLOCK_SIZE=BLOCK)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert np.array_equal(getattr(ours, name), getattr(theirs, name).numpy()), name
    assert np.array_equal(ours.to_dense(), theirs.to_dense().numpy())
    q, k, v = _qkv(SQ, SK, torch.float32)
    want = fastpe.flex_attention(q, k, v, block_mask=ours, enable_gqa=True)
    assert torch.equal(fastpe.flex_attention(q, k, v, block_mask=theirs, enable_gqa=True), want)
    # mask_mod= makes its block mask per call, in blocks of 128: other tiles, same values
    _close(
        fastpe.flex_attention(q, k, v, mask_mod=mask_mod, enable_gqa=True), want, 1e-6, "mask_mod="
    )


def _bad_if(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return score
    return score * 2


def _bad_loop(score, b, h, q_idx, kv_idx):
    for _ in range(q_idx):
        score = score + 1
    return score


def _bad_function(score, b, h, q_idx, kv_idx):
    return torch.erfinv(score)


def _bad_numpy_index(score, b, h, q_idx, kv_idx):
    return score + np.arange(10.0)[q_idx]


def _bad_whole_tensor(score, b, h, q_idx, kv_idx):
    return score + torch.ones(3)


@pytest.mark.parametrize(
    "func,message",
    [
        (_bad_if, "as a Python bool"),
        (_bad_loop, "as a Python integer"),
        (_bad_function, "calls erfinv"),
        (_bad_numpy_index, "fastpe.mods.capture"),
        (_bad_whole_tensor, "index it with the index arguments"),
    ],
)
def test_uncapturable_functions_get_clear_errors(func, message):
    q, k, v = _qkv(8, 8, torch.float32)
    with pytest.raises(fastpe.flex.CaptureError, match=message):
        fastpe.flex_attention(q, k, v[:, :, :, :], func, enable_gqa=True, backend="numpy")


def test_refusals():
    q, k, v = _qkv(SQ, SK, torch.float32)
    patterns, _ = _patterns(SQ, SK)
    score_mod, mask_mod = patterns["document+relative_bias"]
    block_mask = fastpe.create_block_mask(mask_mod, B, None, SQ, SK, BLOCK_SIZE=BLOCK)
    small_table = torch.zeros(HQ, 10)  # distances reach 2·SK: indices out of range

    def short_bias(score, b, h, q_idx, kv_idx):  # relative_bias's variant, another table
        return score + small_table[h, q_idx - kv_idx + SK]

    for backend in ("numba", "numpy"):
        with pytest.raises(IndexError):
            fastpe.flex_attention(q, k, v, short_bias, block_mask, enable_gqa=True,
                                  backend=backend)  # fmt: skip
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fastpe.flex_attention(q, k, v)
    with pytest.raises(fastpe.BackendNotSupportedError, match="runs on CUDA tensors"):
        fastpe.flex_attention(*(x.to("meta") for x in (q, k, v)), enable_gqa=True)
    with pytest.raises(fastpe.BackendNotSupportedError, match="not NumPy arrays"):
        fastpe.flex_attention(q.numpy(), k.numpy(), v.numpy(), enable_gqa=True, backend="triton")
    small = fastpe.create_block_mask(mask_mod, B, None, 64, 64, BLOCK_SIZE=BLOCK)
    with pytest.raises(ValueError, match="block_mask covers 64 queries"):
        fastpe.flex_attention(q, k, v, block_mask=small, enable_gqa=True)


def test_torch_compile_runs_it_as_a_graph_break():
    """Dynamo cannot trace the capture or the NumPy kernels: flex_attention runs eagerly inside
    a compiled function, forward and backward, with the eager result."""
    q, k, v = _qkv(16, 16, torch.float32)
    score_mod, mask_mod = _patterns(16, 16)[0]["causal+softcap"]

    def loss(q):
        out = fastpe.flex_attention(
            2.0 * q, k, v, score_mod, mask_mod=mask_mod, enable_gqa=True, backend="numpy"
        )
        return out.square().sum()

    leaf, compiled_leaf = q.clone().requires_grad_(), q.clone().requires_grad_()
    loss(leaf).backward()
    torch.compile(loss)(compiled_leaf).backward()
    assert torch.allclose(compiled_leaf.grad, leaf.grad, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- Triton (interpreter)

TRITON_SHAPES = [
    ("causal+softcap", 40, 40),
    ("window+alibi", 40, 40),
    ("document+relative_bias", 48, 40),
    ("prefix_lm", 40, 40),
    ("chunked_local", 40, 40),
]


def _triton_or_skip():
    from fastpe.backends import triton as triton_backend

    why = triton_backend.unavailable_reason()
    if why:
        pytest.skip(f"triton: {why}")


@pytest.mark.parametrize("pattern,sq,sk", TRITON_SHAPES)
def test_triton_matches_torch_flex_attention_and_the_oracle(pattern, sq, sk):
    """The generated Triton kernels (interpreted on CPU tensors: tiny shapes, blocks of 16 so
    that tiles are skipped, full, partial and cut short), forward against torch's FlexAttention
    and backward against the float64 oracle, with GQA (and Sq ≠ Sk on one pattern)."""
    _triton_or_skip()
    patterns, _ = _patterns(sq, sk)
    score_mod, mask_mod = patterns[pattern]
    q, k, v = _qkv(sq, sk, torch.float32, seed=4)
    block_mask = fastpe.create_block_mask(mask_mod, B, None, sq, sk, BLOCK_SIZE=16)
    want_out, want_lse = _torch_reference(q, k, v, score_mod, mask_mod)
    grad_out = torch.randn(B, HQ, sq, D, generator=torch.Generator().manual_seed(5))

    def run(backend, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out, lse = fastpe.flex_attention(*leaves, score_mod, block_mask, enable_gqa=True,
                                         return_lse=True, backend=backend)  # fmt: skip
        (out * grad_out.to(dtype)).sum().backward()
        return out, lse, [x.grad for x in leaves]

    out, lse, grads = run("triton", torch.float32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    _close(out, want_out, 2e-5, "triton out")
    _close(lse, want_lse, 2e-5, "triton lse")
    _, _, want_grads = run("numpy", torch.float64)
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert got.dtype == torch.float32
        _close(got, want, 5e-5, f"triton {name}")


@pytest.mark.parametrize(
    "pattern,sq,sk,trained",
    [("window+alibi", 40, 40, "slopes"), ("document+relative_bias", 48, 40, "table")],
)
def test_triton_trains_captured_tensors(pattern, sq, sk, trained):
    """The gradient of a captured tensor that requires grad (learned ALiBi slopes: one element
    per head, read by every score of it; a relative-bias table: one element per diagonal) from
    the Triton backward's atomic adds equals the float64 oracle's (checked against torch's
    FlexAttention and finite differences above), with q, k, v's gradients alongside, on a
    float32 and a bfloat16 tensor."""
    _triton_or_skip()
    patterns, captured = _patterns(sq, sk)
    _, mask_mod = patterns[pattern]
    make = {"table": lambda t: _relative_bias(t, sk), "slopes": _alibi}[trained]
    q, k, v = _qkv(sq, sk, torch.float32, seed=9)
    block_mask = fastpe.create_block_mask(mask_mod, B, None, sq, sk, BLOCK_SIZE=16)
    grad_out = torch.randn(B, HQ, sq, D, generator=torch.Generator().manual_seed(10))

    def run(backend, dtype, tensor_dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        tensor = captured[trained].detach().to(tensor_dtype).requires_grad_()
        out = fastpe.flex_attention(*leaves, make(tensor), block_mask, enable_gqa=True,
                                    backend=backend)  # fmt: skip
        (out * grad_out.to(dtype)).sum().backward()
        return [x.grad for x in leaves], tensor.grad

    want_grads, want_captured = run("numpy", torch.float64, torch.float64)
    assert want_captured.abs().max() > 0.1  # the gradient is not trivially zero
    for tensor_dtype, tol in ((torch.float32, 5e-5), (torch.bfloat16, 1e-2)):
        grads, got_captured = run("triton", torch.float32, tensor_dtype)
        assert got_captured.dtype == tensor_dtype
        _close(got_captured, want_captured, tol, f"triton d{trained} ({tensor_dtype})")
        for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
            _close(got, want, tol if tensor_dtype == torch.float32 else 2e-2, f"triton {name}")


def test_triton_reads_captured_tensors_at_every_call():
    """A captured tensor changed between calls changes the result without a new variant (the
    tensors are kernel arguments); an index out of range raises."""
    _triton_or_skip()
    from fastpe.kernels.triton import flex_attention as kernels

    sq = sk = 40
    patterns, captured = _patterns(sq, sk)
    score_mod, mask_mod = patterns["document+relative_bias"]
    q, k, v = _qkv(sq, sk, torch.float32)
    block_mask = fastpe.create_block_mask(mask_mod, B, None, sq, sk, BLOCK_SIZE=16)
    run = lambda backend: fastpe.flex_attention(q, k, v, score_mod, block_mask,  # noqa: E731
                                                enable_gqa=True, backend=backend)  # fmt: skip
    before = run("triton")
    variants = len(kernels.compiled_variants)
    captured["table"].mul_(-2.0)
    captured["doc"][:20] = 1  # the block mask (blocks of 16) still covers the new mask
    after = run("triton")
    assert len(kernels.compiled_variants) == variants
    _close(after, run("numpy"), 2e-5, "after the change")
    assert (after - before).abs().max() > 0.1
    small_table = torch.zeros(HQ, 10)

    def short_bias(score, b, h, q_idx, kv_idx):  # relative_bias's variant, another table
        return score + small_table[h, q_idx - kv_idx + sk]

    with pytest.raises(IndexError):
        fastpe.flex_attention(q, k, v, short_bias, block_mask, enable_gqa=True, backend="triton")


def test_triton_steps_compute_every_operation_as_the_oracle():
    """The generated Triton steps against the float64 oracle on one small tile: Python's floor
    forms of // and % on negative integers, powers, the float functions, casts, the bitwise
    and logical operators, a 0-d captured tensor and a bool one."""
    _triton_or_skip()
    sq = sk = 16
    q, k, v = _qkv(sq, sk, torch.float32, seed=6)
    offset = torch.tensor(0.25)
    allowed = torch.rand(B, sk, generator=torch.Generator().manual_seed(8)) > 0.3

    def every_op(score, b, h, q_idx, kv_idx):
        rel = q_idx - kv_idx
        ints = (rel // 3) * 2 + rel % 5 - torch.where(rel > 0, rel**2, -rel) + (rel ^ h)
        floats = (
            score**2 * 0.1 + torch.sqrt(torch.abs(score)) - torch.sigmoid(score)
            + (score // 0.7) * 0.1 + (score % 0.7) + torch.sign(score) * 0.2
            + torch.clamp(score, -1.0, 1.0) + torch.exp2(-torch.abs(score)) + torch.sin(score)
            + torch.log(1.0 + torch.exp(score)) - torch.relu(score) * offset
        )  # fmt: skip
        return floats + ints.float() * 0.01 + (score > 0).float() * 0.3

    def mask(b, h, q_idx, kv_idx):
        return (allowed[b, kv_idx] & ~((q_idx | kv_idx) % 7 == 3)) | (q_idx == kv_idx)

    got = fastpe.flex_attention(q, k, v, every_op, mask_mod=mask, enable_gqa=True,
                                backend="triton")  # fmt: skip
    want = fastpe.flex_attention(q, k, v, every_op, mask_mod=mask, enable_gqa=True,
                                 backend="numpy")  # fmt: skip
    _close(got, want, 2e-5, "every operation")
