"""merge_attention's gradients (docs/math.md#merge-gradients).

The float64 oracle's hand-written backward is checked with ``torch.autograd.gradcheck`` (finite
differences of the oracle's own forward) and against torch autograd through a plain-torch merge
written here; every backend's gradients (through ``fastpe.merge_attention`` under autograd) are
checked against that plain-torch merge; empty parts (lse = −inf) get exactly zero gradients,
never NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS

import fastpe
from fastpe import reference

torch = pytest.importorskip("torch")
import fastpe.torch_ops  # noqa: E402, F401  (registers torch.ops.fastpe)


def plain_merge(out_a, lse_a, out_b, lse_b):
    """The merge as a user writes it in torch (finite lse only)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out, lse


class OracleMerge(torch.autograd.Function):
    """The oracle's forward and its hand-written backward, as one autograd function."""

    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b):
        ctx.save_for_backward(out_a, lse_a, out_b, lse_b)
        out, lse = reference.merge_attention(
            *(t.detach().numpy() for t in (out_a, lse_a, out_b, lse_b))
        )
        return torch.from_numpy(out), torch.from_numpy(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        inputs = [t.detach().numpy() for t in ctx.saved_tensors]
        grads = reference.merge_attention_backward(grad_out.numpy(), grad_lse.numpy(), *inputs)
        return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in grads)


def _parts(seed, shape=(2, 3, 4, 5)):
    gen = torch.Generator().manual_seed(seed)
    out_a, out_b = (torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(2))
    lse_a, lse_b = (
        3 * torch.randn(shape[:3], dtype=torch.float64, generator=gen) for _ in range(2)
    )
    return out_a, lse_a, out_b, lse_b, gen


def test_oracle_merge_gradcheck():
    # on the oracle's float64 arrays: the public op returns lse in float32, too coarse for
    # finite differences
    out_a, lse_a, out_b, lse_b, _ = _parts(0)
    args = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    assert torch.autograd.gradcheck(OracleMerge.apply, args)


def test_oracle_merge_backward_matches_plain_torch():
    out_a, lse_a, out_b, lse_b, gen = _parts(1)
    args = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    grad_out = torch.randn(out_a.shape, dtype=torch.float64, generator=gen)
    grad_lse = torch.randn(lse_a.shape, dtype=torch.float64, generator=gen)  # lse is used too
    got = torch.autograd.grad(OracleMerge.apply(*args), args, (grad_out, grad_lse))
    want = torch.autograd.grad(plain_merge(*args), args, (grad_out, grad_lse))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-13)


def test_oracle_merge_backward_empty_parts_get_zero():
    out_a, lse_a, out_b, lse_b, gen = _parts(2)
    lse_a[0, 0, :2] = -torch.inf  # part a saw no key in two rows
    out_a[0, 0, 0] = torch.nan  # whatever an empty part holds is ignored
    out_a[0, 0, 1] = torch.inf
    lse_a[1, 2, 3] = lse_b[1, 2, 3] = -torch.inf  # neither part saw a key
    grad_out = torch.randn(out_a.shape, dtype=torch.float64, generator=gen)
    grad_lse = torch.randn(lse_a.shape, dtype=torch.float64, generator=gen)
    arrays = [t.numpy() for t in (grad_out, grad_lse, out_a, lse_a, out_b, lse_b)]
    d_out_a, d_lse_a, d_out_b, d_lse_b = reference.merge_attention_backward(*arrays)
    for g in (d_out_a, d_lse_a, d_out_b, d_lse_b):
        assert np.isfinite(g).all()
    assert (d_out_a[0, 0, :2] == 0).all() and (d_lse_a[0, 0, :2] == 0).all()
    for g in (d_out_a, d_out_b):
        assert (g[1, 2, 3] == 0).all()
    assert d_lse_a[1, 2, 3] == 0 and d_lse_b[1, 2, 3] == 0
    # where a is empty, b is the whole merge (out = out_b, lse = lse_b): its gradients pass through
    np.testing.assert_array_equal(d_out_b[0, 0, :2], arrays[0][0, 0, :2])
    np.testing.assert_allclose(d_lse_b[0, 0, :2], arrays[1][0, 0, :2], rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# Every backend, through torch autograd


def _grads_of(fn, args, grad_out, grad_lse):
    return torch.autograd.grad(fn(*args), args, (grad_out, grad_lse))


@pytest.mark.parametrize("backend", ["numpy", *KERNEL_BACKENDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backend_gradients_match_plain_torch(backend, dtype):
    out_a, lse_a, out_b, lse_b, gen = _parts(3, shape=(2, 3, 7, 12))
    grad_out = torch.randn(out_a.shape, dtype=torch.float64, generator=gen)
    grad_lse = torch.randn(lse_a.shape, dtype=torch.float64, generator=gen)
    want = _grads_of(
        plain_merge,
        [t.clone().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)],
        grad_out,
        grad_lse,
    )
    args = [
        t.to(dtype) if i % 2 == 0 else t.float() for i, t in enumerate((out_a, lse_a, out_b, lse_b))
    ]
    args = [t.requires_grad_() for t in args]

    def merge(*xs):
        return fastpe.merge_attention(*xs, backend=backend)

    got = _grads_of(merge, args, grad_out.to(dtype), grad_lse.float())
    for g, w, a in zip(got, want, args, strict=True):
        assert g.dtype == a.dtype and g.shape == a.shape
        torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-5)


@pytest.mark.parametrize("backend", ["numpy", *KERNEL_BACKENDS])
def test_backend_empty_parts_get_zero_gradients(backend):
    out_a, lse_a, out_b, lse_b, gen = _parts(4)
    lse_a[0, 0, :2] = -torch.inf
    out_a[0, 0, 0] = torch.nan  # ignored by the merge, and by its gradients
    lse_a[1, 2, 3] = lse_b[1, 2, 3] = -torch.inf
    args = [t.float().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    grad_out = torch.randn(out_a.shape, generator=gen)
    grad_lse = torch.randn(lse_a.shape, generator=gen)
    out, lse = fastpe.merge_attention(*args, backend=backend)
    d_out_a, d_lse_a, d_out_b, d_lse_b = torch.autograd.grad((out, lse), args, (grad_out, grad_lse))
    for g in (d_out_a, d_lse_a, d_out_b, d_lse_b):
        assert torch.isfinite(g).all()
    assert (d_out_a[0, 0, :2] == 0).all() and (d_lse_a[0, 0, :2] == 0).all()
    assert (d_out_a[1, 2, 3] == 0).all() and (d_out_b[1, 2, 3] == 0).all()
    assert d_lse_a[1, 2, 3] == 0 and d_lse_b[1, 2, 3] == 0
    torch.testing.assert_close(d_out_b[0, 0, :2], grad_out[0, 0, :2], rtol=0, atol=0)
    torch.testing.assert_close(d_lse_b[0, 0, :2], grad_lse[0, 0, :2], rtol=0, atol=1e-6)


def test_opcheck_with_autograd():
    out_a, lse_a, out_b, lse_b, gen = _parts(6)
    args = [t.float().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    ops = torch.ops.fastpe
    torch.library.opcheck(ops.merge_attention.default, (*args, ""))
    grads = (torch.randn(out_a.shape, generator=gen), torch.randn(lse_a.shape, generator=gen))
    detached = [t.detach() for t in args]
    torch.library.opcheck(ops.merge_attention_backward.default, (*grads, *detached, ""))


def test_backward_op_rejects_a_wrong_gradient_shape():
    out_a, lse_a, out_b, lse_b, _ = _parts(7)
    parts = [t.float() for t in (out_a, lse_a, out_b, lse_b)]
    with pytest.raises(ValueError, match=r"grad_lse must have the output's shape \(2, 3, 4\)"):
        torch.ops.fastpe.merge_attention_backward(
            torch.zeros(out_a.shape), torch.zeros(2, 3, 5), *parts, ""
        )


def test_compile_fullgraph_backward():
    out_a, lse_a, out_b, lse_b, gen = _parts(8)
    args = [t.float().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    weights = torch.randn(out_a.shape, generator=gen)

    def loss(*xs):
        out, lse = fastpe.merge_attention(*xs)
        return (out * weights).sum() + lse.exp().sum()

    def plain(*xs):
        out, lse = plain_merge(*xs)
        return (out * weights).sum() + lse.exp().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")  # raises on a graph break
    got = torch.autograd.grad(compiled(*args), args)
    want = torch.autograd.grad(plain(*args), args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
