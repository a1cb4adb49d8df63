"""Backward passes of apply_rope and embed (issue 15).

Expected gradients come from torch autograd through independent eager code: transformers'
``apply_rotary_pos_emb`` (and a plain interleaved rotation), ``nn.functional.embedding`` plus the
positional rows, in float64. The float64 oracle's hand-written backward is checked with
``torch.autograd.gradcheck`` (finite differences of the oracle's forward); every kernel backend
is checked on the shared grid. Half precision: error against the float64 truth at most 2x that
of the same eager code run in that dtype (flash-attention's rule).
"""

from __future__ import annotations

import copy
import math

import pytest
from _testkit import KERNEL_BACKENDS, SHAPES_GRID

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import fastpe  # noqa: E402
import fastpe.nn  # noqa: E402
import fastpe.torch_ops  # noqa: E402, F401  (registers torch.ops.fastpe)

F = torch.nn.functional
O = {"backend": "numpy"}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Independent eager references


def eager_rope(x, cos, sin, positions, interleaved, layout):
    """transformers' apply_rotary_pos_emb (rotate_half pairs) or a plain interleaved rotation,
    on the first R = 2·cos.shape[1] features; positions [B, S]; plain torch ops only."""
    bshd = layout == "bshd"
    if bshd:
        x = x.transpose(1, 2)
    half = cos.shape[1]
    c, s = cos[positions], sin[positions]  # [B, S, R/2]
    rot, tail = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        c, s = c[:, None], s[:, None]
        rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:  # HF's duplicated [B, S, R] tables, unsqueezed at dim 1 for [B, H, S, D]
        rot, _ = apply_rotary_pos_emb(rot, rot, torch.cat([c, c], -1), torch.cat([s, s], -1))
    out = torch.cat([rot, tail], dim=-1)
    return out.transpose(1, 2) if bshd else out


def eager_embed(ids, weight, positions, pe, pe_table, scale, tt_ids=None, tt_weight=None):
    out = F.embedding(ids, weight) * scale
    if pe == "table":
        out = out + F.embedding(positions, pe_table)
    elif pe == "sinusoidal":
        table = fastpe.sinusoidal_table(
            int(positions.max()) + 1, weight.shape[1], dtype="float64", **O
        )
        out = out + torch.from_numpy(table).to(weight.dtype)[positions]
    if tt_ids is not None:
        out = out + F.embedding(tt_ids, tt_weight)
    return out


def _positions(kind, b, s, limit, gen):
    """(value passed to fastpe, [B, S] int64 tensor for the eager code)."""
    if kind == "none":
        return None, torch.arange(s).expand(b, s)
    if kind == "offset":
        return limit - s, (limit - s + torch.arange(s)).expand(b, s)
    if kind == "seq":
        p = torch.randint(0, limit, (s,), generator=gen)
        return p, p.expand(b, s)
    p = torch.randint(0, limit, (b, s), generator=gen)
    return p, p


def _grads(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    return torch.autograd.grad(outs, inputs, grad_out)


def _close(got, want, tol, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert not torch.isnan(got).any(), f"NaN in {what}"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.double().abs().max().item() if want.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


# ---------------------------------------------------------------------------------------------
# The oracle: gradcheck (finite differences of its own forward) and plain torch autograd


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_oracle_rope_gradcheck(interleaved, layout):
    gen = _gen(1)
    q = (
        torch.randn(2, 3, 5, 10, dtype=torch.float64, generator=gen)
        if layout == "bhsd"
        else torch.randn(2, 5, 3, 10, dtype=torch.float64, generator=gen)
    )
    k = q[:, :1] if layout == "bhsd" else q[:, :, :1]
    k = k.clone()
    cos, sin = fastpe.rope_table(9, 6, dtype="float64", device="cpu", **O)  # partial rotary
    positions = torch.tensor([[0, 8, 3, 3, 1], [2, 2, 7, 0, 5]])

    def single(x):
        return fastpe.apply_rope(
            x, cos, sin, positions=positions, interleaved=interleaved, layout=layout, **O
        )

    def group(q, k):
        return fastpe.apply_rope(
            (q, k), cos, sin, positions=positions, interleaved=interleaved, layout=layout, **O
        )

    assert torch.autograd.gradcheck(single, (q.requires_grad_(),))
    assert torch.autograd.gradgradcheck(single, (q,))  # the backward's backward: the rotation
    assert torch.autograd.gradcheck(group, (q, k.requires_grad_()))
    grad = torch.randn(q.shape, dtype=torch.float64, generator=gen)
    (got,) = _grads(single, [q], grad)
    (want,) = _grads(lambda x: eager_rope(x, cos, sin, positions, interleaved, layout), [q], grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_oracle_embed_gradcheck():
    gen = _gen(2)
    w, pt, tw = (torch.randn(n, 6, dtype=torch.float64, generator=gen) for n in (7, 9, 2))
    ids = torch.tensor([[1, 2, 1, 6], [0, 1, 3, 1]])  # repeated ids accumulate
    pos = torch.tensor([[0, 8, 8, 2], [1, 1, 1, 1]])
    tt = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0]])

    def fn(w, pt, tw):
        return fastpe.embed(
            ids,
            w,
            pe="table",
            pe_table=pt,
            positions=pos,
            scale=1.7,
            token_type_ids=tt,
            token_type_weight=tw,
            **O,
        )

    args = [t.requires_grad_() for t in (w, pt, tw)]
    assert torch.autograd.gradcheck(fn, args)
    grad = torch.randn(2, 4, 6, dtype=torch.float64, generator=gen)
    got = _grads(fn, args, grad)
    want = _grads(lambda w, pt, tw: eager_embed(ids, w, pos, "table", pt, 1.7, tt, tw), args, grad)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-14)
    # closed form: a row named by no id gets exactly zero; row 1 (four tokens) sums four rows
    assert torch.equal(got[0][4], torch.zeros(6)) and torch.equal(got[0][5], torch.zeros(6))
    torch.testing.assert_close(got[0][1], 1.7 * (grad[0, 0] + grad[0, 2] + grad[1, 1] + grad[1, 3]))


# ---------------------------------------------------------------------------------------------
# Every kernel backend on the shared grid, against autograd through the eager references


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES_GRID)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("pos_kind", ["none", "offset", "seq", "batch"])
def test_rope_backward_grid(backend, shape, interleaved, layout, pos_kind):
    b, h, s, d = shape
    gen = _gen(3)
    rdim = d if d % 4 else d // 2  # full and partial rotary
    hk = max(1, h // 2)  # a GQA-like k with fewer heads, rotated in the same call
    shaped = (
        (lambda heads: (b, heads, s, d)) if layout == "bhsd" else (lambda heads: (b, s, heads, d))
    )
    q, k = torch.randn(shaped(h), generator=gen), torch.randn(shaped(hk), generator=gen)
    cos, sin = fastpe.rope_table(s + 9, rdim, device="cpu", **O)
    given, positions = _positions(pos_kind, b, s, s + 9, gen)
    gq, gk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    kw = {"positions": given, "interleaved": interleaved, "layout": layout}
    before = (gq.clone(), gk.clone())
    got = _grads(
        lambda q, k: fastpe.apply_rope((q, k), cos, sin, **kw, backend=backend), [q, k], (gq, gk)
    )
    assert torch.equal(gq, before[0]) and torch.equal(gk, before[1])  # gradients untouched
    c64, s64 = cos.double(), sin.double()
    want = _grads(
        lambda q, k: (
            eager_rope(q, c64, s64, positions, interleaved, layout),
            eager_rope(k, c64, s64, positions, interleaved, layout),
        ),
        [q.double(), k.double()],
        (gq.double(), gk.double()),
    )
    for g, w, name in zip(got, want, ("dq", "dk"), strict=True):
        assert g.dtype == torch.float32
        _close(g, w, 2e-6, name)
    (single,) = _grads(lambda q: fastpe.apply_rope(q, cos, sin, **kw, backend=backend), [q], gq)
    assert torch.equal(single, got[0])  # one tensor or a group: the same kernel


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_rope_backward_dtypes(backend, dtype):
    gen = _gen(4)
    q = torch.randn(2, 4, 37, 24, generator=gen).to(DTYPES[dtype])
    cos, sin = (t.to(DTYPES[dtype]) for t in fastpe.rope_table(40, 24, device="cpu", **O))
    grad = torch.randn(q.shape, generator=gen).to(DTYPES[dtype])
    positions = torch.randint(0, 40, (2, 37), generator=gen)
    (got,) = _grads(
        lambda x: fastpe.apply_rope(x, cos, sin, positions=positions, backend=backend), [q], grad
    )
    assert got.dtype == q.dtype
    (truth,) = _grads(
        lambda x: eager_rope(x, cos.double(), sin.double(), positions, False, "bhsd"),
        [q.double()],
        grad.double(),
    )
    if dtype == "float64":
        _close(got, truth, 1e-13, "float64 dq")
        return
    (plain,) = _grads(lambda x: eager_rope(x, cos, sin, positions, False, "bhsd"), [q], grad)
    plain_err = (plain.double() - truth).abs().max().item()
    err = (got.double() - truth).abs().max().item()
    assert err <= 2 * plain_err + 1e-6, (err, plain_err)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("pe", ["sinusoidal", "table", None])
@pytest.mark.parametrize("types", [False, True])
@pytest.mark.parametrize("pos_kind", ["none", "offset", "batch"])
def test_embed_backward_grid(backend, pe, types, pos_kind):
    b, s, v, d = 3, 7, 5, 12  # 21 tokens over 5 ids: every row repeats
    gen = _gen(5)
    weight = torch.randn(v, d, generator=gen)
    ids = torch.randint(0, v, (b, s), generator=gen)
    table = torch.randn(40, d, generator=gen) if pe == "table" else None
    given, positions = _positions(pos_kind, b, s, 33, gen)
    tt_ids = torch.randint(0, 2, (b, s), generator=gen) if types else None
    tt_weight = torch.randn(2, d, generator=gen) if types else None
    grad = torch.randn(b, s, d, generator=gen)
    tensors = [t for t in (weight, table, tt_weight) if t is not None]

    def split(args):
        it = iter(args)
        return next(it), (next(it) if pe == "table" else None), (next(it) if types else None)

    def ours(*args):
        w, pt, tw = split(args)
        return fastpe.embed(
            ids,
            w,
            positions=given,
            pe=pe,
            pe_table=pt,
            scale=math.sqrt(d),
            token_type_ids=tt_ids,
            token_type_weight=tw,
            backend=backend,
        )

    def eager(*args):
        w, pt, tw = split(args)
        return eager_embed(ids, w, positions, pe, pt, math.sqrt(d), tt_ids, tw)

    got = _grads(ours, tensors, grad)
    want = _grads(eager, [t.double() for t in tensors], grad.double())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        _close(g, w, 2e-6, "embed gradient")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_embed_backward_dtypes(backend, dtype):
    gen = _gen(6)
    kind = DTYPES[dtype]
    weight, table = torch.randn(11, 16, generator=gen), torch.randn(50, 16, generator=gen)
    ids = torch.randint(0, 11, (4, 50), generator=gen)  # ~18 tokens per row: sums of many terms
    grad = torch.randn(4, 50, 16, generator=gen)
    args = [weight.to(kind), table.to(kind)]

    def ours(w, pt):
        return fastpe.embed(ids, w, pe="table", pe_table=pt, scale=2.0, backend=backend)

    def eager(w, pt):
        return eager_embed(ids, w, torch.arange(50).expand(4, 50), "table", pt, 2.0)

    got = _grads(ours, args, grad.to(kind))
    truth = _grads(eager, [a.double() for a in args], grad.to(kind).double())
    plain = _grads(eager, args, grad.to(kind))  # the same eager code in this dtype
    for g, t, p in zip(got, truth, plain, strict=True):
        assert g.dtype == kind
        if dtype == "float64":
            _close(g, t, 1e-13, "float64 gradient")
        else:
            err, plain_err = ((x.double() - t).abs().max().item() for x in (g, p))
            assert err <= 2 * plain_err + 1e-6, (err, plain_err)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_embed_backward_empty_and_expanded_grad(backend):
    weight = torch.randn(6, 8, requires_grad=True)
    out = fastpe.embed(torch.zeros((2, 0), dtype=torch.int64), weight, backend=backend)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(6, 8))
    weight.grad = None
    ids = torch.tensor([[5, 5, 0]])
    # .sum() hands back an expanded (stride-0) gradient
    fastpe.embed(ids, weight, scale=3.0, backend=backend).sum().backward()
    want = torch.zeros(6, 8)
    want[5], want[0] = 6.0, 3.0
    assert torch.equal(weight.grad, want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_embed_backward_is_deterministic(backend):
    """The same bits on every run: sums follow token order (no atomics). Large enough for the
    parallel Numba kernel, with a few hot rows taking most tokens."""
    gen = _gen(7)
    weight = torch.randn(300, 64, requires_grad=True)
    ids = torch.where(
        torch.rand(8, 256, generator=gen) < 0.5,
        torch.randint(0, 3, (8, 256), generator=gen),
        torch.randint(0, 300, (8, 256), generator=gen),
    )
    grad = torch.randn(8, 256, 64, generator=gen)
    runs = [
        _grads(lambda w: fastpe.embed(ids, w, backend=backend), [weight], grad)[0] for _ in range(3)
    ]
    if backend == "numba":
        import numba

        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            runs += _grads(lambda w: fastpe.embed(ids, w, backend=backend), [weight], grad)
        finally:
            numba.set_num_threads(threads)
    for run in runs[1:]:
        assert torch.equal(run, runs[0])


# ---------------------------------------------------------------------------------------------
# What has no gradient


def test_tables_and_positions_have_no_gradient():
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    cos, sin = fastpe.rope_table(5, 8, device="cpu")
    with pytest.raises(RuntimeError, match=r"fastpe.apply_rope has no gradient w.r.t. cos and sin"):
        fastpe.apply_rope(x, cos.requires_grad_(), sin.requires_grad_()).sum().backward()
    cos, sin = cos.detach(), sin.detach()
    with pytest.raises(RuntimeError, match=r"no gradient w.r.t. sin"):
        fastpe.apply_rope((x.detach(), x.detach()), cos, sin.requires_grad_())[1].sum().backward()
    # tables built under no_grad (as transformers' rotary modules do) are constants: no error
    (dx,) = torch.autograd.grad(fastpe.apply_rope(x, cos, sin.detach()).sum(), [x])
    assert dx.shape == x.shape
    # integer positions and ids cannot require grad in torch; the sinusoidal PE has no parameter
    weight = torch.randn(4, 8, requires_grad=True)
    out = fastpe.embed(torch.tensor([[1, 1]]), weight, positions=torch.tensor([3, 0]))
    (dw,) = torch.autograd.grad(out.sum(), [weight])
    assert torch.equal(dw[1], torch.full((8,), 2.0))


# ---------------------------------------------------------------------------------------------
# torch integration: opcheck (with its autograd checks) and torch.compile of the backward


def test_opcheck_with_autograd():
    gen = _gen(8)
    q = torch.randn(2, 4, 9, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, generator=gen, requires_grad=True)
    cos, sin = fastpe.rope_table(16, 12, device="cpu")
    w = torch.randn(20, 16, generator=gen, requires_grad=True)
    pt = torch.randn(12, 16, generator=gen, requires_grad=True)
    tw = torch.randn(3, 16, generator=gen, requires_grad=True)
    ids, tt = (
        torch.randint(0, 20, (2, 5), generator=gen),
        torch.randint(0, 3, (2, 5), generator=gen),
    )
    pos = torch.randint(0, 12, (2, 5), generator=gen)
    ops = torch.ops.fastpe
    cases = [
        (ops.apply_rope.default, (q, cos, sin, torch.arange(9), 0, False, "bhsd", "")),
        (ops.apply_rope.default, (q.transpose(1, 2), cos, sin, None, 3, True, "bshd", "")),
        (ops.apply_rope_group.default, ([q, k], cos, sin, None, 2, False, "bhsd", "")),
        (ops.apply_rope_backward.default, ([q, k], cos, sin, None, 2, True, "bhsd", "")),
        (
            ops.embed.default,
            (ids, w, pos, 0, "table", pt, 4.0, 10000.0, "interleaved", "paper", tt, tw, ""),
        ),
        (
            ops.embed.default,
            (ids, w, None, 3, "sinusoidal", None, 4.0, 10000.0, "concat", "paper", None, None, ""),
        ),
        (
            ops.embed_backward.default,
            (
                torch.randn(2, 5, 16, generator=gen),
                ids,
                w.detach(),
                pos,
                0,
                "table",
                pt.detach(),
                4.0,
                10000.0,
                "interleaved",
                "paper",
                tt,
                tw.detach(),
                True,
                True,
                True,
                "",
            ),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_backward(compiler):
    gen = _gen(9)
    q = torch.randn(2, 4, 9, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, generator=gen, requires_grad=True)
    w = torch.randn(20, 16, generator=gen, requires_grad=True)
    pt = torch.randn(12, 16, generator=gen, requires_grad=True)
    ids = torch.randint(0, 20, (2, 9), generator=gen)
    cos, sin = fastpe.rope_table(16, 16, device="cpu")

    def loss(q, k, w, pt):
        x = fastpe.embed(ids, w, pe="table", pe_table=pt, positions=2, scale=4.0)  # [2, 9, 16]
        rq, rk = fastpe.apply_rope((q + x[:, None], k), cos, sin, positions=2)
        return (rq.sum(1) * rk.sum(1)).sum()

    def eager(q, k, w, pt):
        x = eager_embed(ids, w, (2 + torch.arange(9)).expand(2, 9), "table", pt, 4.0)
        positions = (2 + torch.arange(9)).expand(2, 9)
        rq = eager_rope(q + x[:, None], cos, sin, positions, False, "bhsd")
        rk = eager_rope(k, cos, sin, positions, False, "bhsd")
        return (rq.sum(1) * rk.sum(1)).sum()

    compiled = torch.compile(loss, fullgraph=True, backend=compiler)  # raises on a graph break
    args = [q, k, w, pt]
    got = torch.autograd.grad(compiled(*args), args)
    want = torch.autograd.grad(eager(*args), args)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# fastpe.nn modules train: one optimizer step matches the same step through plain torch


def test_fused_embedding_trains_like_nn_embedding():
    torch.manual_seed(0)
    word, position, types = (
        torch.nn.Embedding(30, 16),
        torch.nn.Embedding(12, 16),
        torch.nn.Embedding(2, 16),
    )
    head = torch.nn.Linear(16, 3)
    ours = torch.nn.ModuleList([word, position, types, head])
    theirs = copy.deepcopy(ours)
    fused = fastpe.nn.FusedEmbedding.from_embedding(
        word, position_embedding=position, token_type_embedding=types, scale="sqrt"
    )
    ids = torch.randint(0, 30, (3, 10))
    ids[:, :4] = 7  # a repeated id
    tt = torch.randint(0, 2, (3, 10))
    target = torch.randint(0, 3, (3, 10))

    def step(module_list, embed):
        optimizer = torch.optim.Adam(module_list.parameters(), lr=0.1)
        hidden = torch.nn.functional.layer_norm(embed(), (16,))
        loss = F.cross_entropy(module_list[3](hidden).flatten(0, 1), target.flatten())
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in module_list.parameters()]
        optimizer.step()
        return loss.detach(), grads

    loss, grads = step(ours, lambda: fused(ids, token_type_ids=tt))
    w, p, t, _ = theirs
    want_loss, want_grads = step(theirs, lambda: w(ids) * 4.0 + p(torch.arange(10))[None] + t(tt))
    torch.testing.assert_close(loss, want_loss)
    for g, e in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sinusoidal_fused_embedding_trains():
    torch.manual_seed(1)
    word = torch.nn.Embedding(25, 12)
    theirs = copy.deepcopy(word)
    fused = fastpe.nn.FusedEmbedding.from_embedding(word, scale="sqrt", layout="concat")
    ids = torch.randint(0, 25, (2, 6))
    target = torch.randn(2, 6, 12)
    table = torch.from_numpy(fastpe.sinusoidal_table(6, 12, layout="concat", **O))
    for module, embed in (
        (word, lambda: fused(ids)),
        (theirs, lambda: theirs(ids) * math.sqrt(12) + table),
    ):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        F.mse_loss(embed(), target).backward()
        optimizer.step()
    torch.testing.assert_close(word.weight, theirs.weight, rtol=1e-6, atol=1e-6)


def test_rope_attention_block_trains_like_transformers():
    """q/k projections rotated by fastpe.apply_rope((q, k)) in a tiny GQA attention block vs the
    same block with transformers' apply_rotary_pos_emb: same loss, gradients and updated weights."""
    torch.manual_seed(2)
    proj = torch.nn.ModuleDict(
        {
            "q": torch.nn.Linear(32, 4 * 8),
            "k": torch.nn.Linear(32, 2 * 8),
            "v": torch.nn.Linear(32, 2 * 8),
        }
    )
    theirs = copy.deepcopy(proj)
    rotary = fastpe.nn.RotaryEmbedding(8, base=500.0, max_position_embeddings=32)
    x = torch.randn(2, 11, 32)
    position_ids = torch.tensor([list(range(3, 14)), list(range(11))])
    hf_cos, hf_sin = rotary(x, position_ids)  # transformers' [B, S, R] tables
    cos, sin = fastpe.rope_table(32, 8, base=500.0, device="cpu")

    def block(p, rotate):
        q = p["q"](x).view(2, 11, 4, 8).transpose(1, 2)
        k = p["k"](x).view(2, 11, 2, 8).transpose(1, 2)
        v = p["v"](x).view(2, 11, 2, 8).transpose(1, 2)
        q, k = rotate(q, k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.square().mean()

    results = []
    for p, rotate in (
        (proj, lambda q, k: fastpe.apply_rope((q, k), cos, sin, positions=position_ids)),
        (theirs, lambda q, k: apply_rotary_pos_emb(q, k, hf_cos, hf_sin)),
    ):
        optimizer = torch.optim.SGD(p.parameters(), lr=1.0)
        loss = block(p, rotate)
        loss.backward()
        results.append((loss.detach(), [w.grad.clone() for w in p.parameters()]))
        optimizer.step()
    (loss, grads), (want_loss, want_grads) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    for g, e in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    for a, b in zip(proj.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_embed_backward_few_hot_rows_in_parallel(backend):
    """Two token types over 2048 tokens: rows too few to share out, so the Numba kernel splits
    them into column blocks (a path the small grid does not reach)."""
    gen = _gen(10)
    weight, types = torch.randn(50, 256, generator=gen), torch.randn(2, 256, generator=gen)
    ids = torch.randint(0, 50, (8, 256), generator=gen)
    tt = torch.randint(0, 2, (8, 256), generator=gen)
    grad = torch.randn(8, 256, 256, generator=gen)

    def ours(w, tw):
        return fastpe.embed(
            ids, w, pe=None, token_type_ids=tt, token_type_weight=tw, backend=backend
        )

    got = _grads(ours, [weight, types], grad)
    want = _grads(
        lambda w, tw: eager_embed(ids, w, None, None, None, 1.0, tt, tw),
        [weight.double(), types.double()],
        grad.double(),
    )
    for g, w in zip(got, want, strict=True):
        _close(g, w, 2e-6, "embed gradient")


def test_backward_runs_on_the_forward_calls_backend(monkeypatch):
    """A forward run inside use_backend(...) keeps that backend for its backward, which runs
    after the block has closed."""
    from fastpe.backends import REGISTRY

    calls = []
    impl = REGISTRY[("numpy", "embed_backward")]
    real = impl.run
    monkeypatch.setattr(impl, "run", lambda inp: calls.append(1) or real(inp))
    weight = torch.randn(5, 4, requires_grad=True)
    with fastpe.use_backend("numpy"):
        out = fastpe.embed(torch.tensor([[1, 2]]), weight)
    out.sum().backward()
    assert calls == [1]
    assert torch.equal(weight.grad[1], torch.ones(4))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_rope_group_with_a_frozen_tensor(backend):
    gen = _gen(11)
    q, k = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)
    cos, sin = fastpe.rope_table(6, 8, device="cpu")
    q.requires_grad_()
    rq, rk = fastpe.apply_rope((q, k), cos, sin, backend=backend)
    (dq,) = torch.autograd.grad((rq * rq.detach()).sum() + rk.sum(), [q])
    assert k.grad is None
    want = _grads(
        lambda x: eager_rope(x, cos, sin, torch.arange(6).expand(2, 6), False, "bhsd"),
        [q],
        rq.detach(),
    )
    _close(dq, want[0], 2e-6, "dq")
