"""Regressions from issue 11 found at the validation layer: aliasing, copies, eager/graph
agreement, devices, broadcast positions. (Kernel-level ones live in attention/test_edges.py.)"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, to_np, torch

import fastpe

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")
BACKENDS = ["numpy", *KERNEL_BACKENDS]


# --- 3. in-place RoPE on overlapping views is refused (it would rotate shared rows twice)


@needs_torch
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(1, 2, 5, 8).expand(3, 2, 5, 8),
        lambda: torch.zeros(64).as_strided((1, 2, 5, 8), (0, 8, 4, 1)),
        lambda: torch.zeros(64).as_strided((1, 1, 5, 8), (40, 40, 0, 1)),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_rope_refuses_overlapping_views(make, backend):
    x = make()
    cos, sin = fastpe.rope_table(16, 8)
    with pytest.raises(ValueError, match="inplace=True needs an x whose elements occupy distinct"):
        fastpe.apply_rope(
            x, torch.from_numpy(cos), torch.from_numpy(sin), inplace=True, backend=backend
        )


def test_inplace_rope_refuses_overlapping_numpy_views():
    x = np.lib.stride_tricks.as_strided(np.zeros(64), (1, 2, 5, 8), (0, 0, 32, 8))
    cos, sin = fastpe.rope_table(16, 8)
    with pytest.raises(ValueError, match="strides"):
        fastpe.apply_rope(x, cos, sin, inplace=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_rope_still_accepts_distinct_strided_views(backend, rng):
    base = rng.standard_normal((2, 3, 10, 8))
    cos, sin = fastpe.rope_table(16, 8, dtype="float64")
    expected = fastpe.apply_rope(base[:, :, ::2], cos, sin, backend="numpy")
    view = base[:, :, ::2]
    fastpe.apply_rope(view, cos, sin, inplace=True, backend=backend)
    np.testing.assert_allclose(base[:, :, ::2], expected, atol=1e-12)


# --- 10. validating an additive mask makes no copy of its size


def test_mask_validation_copies_nothing_of_its_size():
    q = np.zeros((1, 1, 2048, 8), np.float32)
    mask = np.zeros((1, 1, 2048, 2048), np.float32)  # 16 MiB
    tracemalloc.start()
    try:
        fastpe.explain("attention", q, q, q, mask=mask)  # validates exactly like the call
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < mask.nbytes / 8, (
        f"validation allocated {peak} bytes for a {mask.nbytes}-byte mask"
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_mask_with_nan_or_plus_inf_still_refused(bad):
    q = np.zeros((1, 1, 3, 4), np.float32)
    mask = np.zeros((3, 3), np.float32)
    mask[1, 2] = bad
    with pytest.raises(ValueError, match="must not contain NaN or \\+inf"):
        fastpe.attention(q, q, q, mask=mask)


# --- 14. eager and graph (autograd-recording) paths accept the same values


@needs_torch
@pytest.mark.parametrize("positions", [np.int64(3), [3, 4, 5, 6, 7], (3, 4, 5, 6, 7)])
def test_graph_path_accepts_what_eager_accepts(positions):
    x = torch.randn(1, 2, 5, 8)
    cos, sin = (torch.from_numpy(t) for t in fastpe.rope_table(16, 8))
    eager = fastpe.apply_rope(x, cos, sin, positions=positions)
    graph = fastpe.apply_rope(x.clone().requires_grad_(), cos, sin, positions=positions)
    torch.testing.assert_close(graph.detach(), eager)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    weight = torch.randn(10, 8)
    eager = fastpe.embed(ids, weight, positions=positions)
    graph = fastpe.embed(ids, weight.clone().requires_grad_(), positions=positions)
    torch.testing.assert_close(graph.detach(), eager)


@needs_torch
def test_numpy_positions_with_tensors_refused_on_both_paths():
    x = torch.randn(1, 2, 5, 8)
    cos, sin = (torch.from_numpy(t) for t in fastpe.rope_table(16, 8))
    for xx in (x, x.clone().requires_grad_()):
        with pytest.raises(TypeError, match="all torch tensors on one device"):
            fastpe.apply_rope(xx, cos, sin, positions=np.arange(5))


@needs_torch
def test_fused_embedding_takes_a_numpy_past_length():
    from fastpe.nn import FusedEmbedding

    module = FusedEmbedding.from_embedding(torch.nn.Embedding(10, 8))  # trainable weight
    ids = torch.tensor([[1, 2, 3]])
    got = module(ids, past_key_values_length=np.int64(5))
    torch.testing.assert_close(got.detach(), module(ids, past_key_values_length=5).detach())


@needs_torch
def test_rope_group_shapes_are_checked_under_compile():
    cos, sin = (torch.from_numpy(t) for t in fastpe.rope_table(16, 8))

    @torch.compile(fullgraph=True, backend="eager")
    def rotate(q, k):
        return fastpe.apply_rope((q, k), cos, sin)

    with pytest.raises(Exception, match="every tensor of x must share"):
        rotate(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8))


# --- 15. a CUDA device without CUDA is a fastpe error naming the argument


@needs_torch
@pytest.mark.skipif(torch is not None and torch.cuda.is_available(), reason="needs no CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda(device):
    with pytest.raises(ValueError, match=f"device='{device}' asks for a CUDA tensor"):
        fastpe.sinusoidal_table(4, 8, device=device)
    with pytest.raises(ValueError, match="asks for a CUDA tensor"):
        fastpe.rope_table(4, 8, device=device)


# --- 18. positions [1, S] broadcast over the batch (transformers' position_ids)


@pytest.mark.parametrize("fw", ["numpy", pytest.param("torch", marks=needs_torch)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_of_shape_1_by_s_broadcast(fw, backend, rng):
    def arr(a):
        return a if fw == "numpy" else torch.from_numpy(np.ascontiguousarray(a))

    pos = np.array([[4, 9, 2, 7, 0]])
    cos, sin = fastpe.rope_table(16, 8)
    x = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)
    want = fastpe.apply_rope(x, cos, sin, positions=pos[0], backend="numpy")
    got = fastpe.apply_rope(arr(x), arr(cos), arr(sin), positions=arr(pos), backend=backend)
    np.testing.assert_allclose(to_np(got), want, atol=2e-6)

    ids = rng.integers(0, 10, (3, 5))
    weight = rng.standard_normal((10, 8)).astype(np.float32)
    want = fastpe.embed(ids, weight, positions=pos[0], backend="numpy")
    got = fastpe.embed(arr(ids), arr(weight), positions=arr(pos), backend=backend)
    np.testing.assert_allclose(to_np(got), want, atol=2e-6)

    q = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)
    rope = {"cos": cos, "sin": sin, "q_positions": pos, "k_positions": pos}
    want = fastpe.attention(
        q, q, q, rope={**rope, "q_positions": pos[0], "k_positions": pos[0]}, backend="numpy"
    )
    got = fastpe.attention(
        arr(q), arr(q), arr(q), backend=backend, rope={k: arr(v) for k, v in rope.items()}
    )
    np.testing.assert_allclose(to_np(got), want, atol=2e-6)


# --- 13. torch.compile with scaling dicts: new values recompile, NumPy scalars are numbers


@needs_torch
@pytest.mark.parametrize("fullgraph", [True, False])
def test_rope_table_under_compile_with_changing_scaling(fullgraph):
    def table(scaling):
        return fastpe.rope_table(16, 8, scaling=scaling, device="cpu")[1]

    compiled = torch.compile(table, fullgraph=fullgraph, backend="eager")
    dicts = [{"rope_type": "linear", "factor": f} for f in (2.0, 4.0, np.float32(8.0))]
    dicts.append(
        {
            "rope_type": "llama3",
            "factor": np.float64(8.0),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": np.int64(8),
        }
    )
    dicts.append(
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 2.0, 3.0, 4.0],
            "long_factor": [np.float32(1.5)] * 4,
            "original_max_position_embeddings": 8,
            "max_position_embeddings": 32,
        }
    )
    for scaling in dicts:
        eager = fastpe.rope_table(16, 8, scaling=scaling)[1]
        np.testing.assert_allclose(compiled(scaling).numpy(), eager, rtol=1e-6, atol=1e-7)


# --- 11. positions beyond the supported range [0, 2^32) are refused by name, on every op


@pytest.mark.parametrize("far", [2**32, 2**63 - 1, 2**70])
def test_far_positions_refused_by_name(far):
    ids, weight = np.zeros((1, 3), np.int64), np.zeros((4, 8), np.float32)
    cos, sin = fastpe.rope_table(8, 8)
    x = np.zeros((1, 1, 3, 8), np.float32)
    supported = "outside the supported range \\[0, 2\\*\\*32"
    with pytest.raises(ValueError, match=f"positions = .*{supported}"):
        fastpe.embed(ids, weight, positions=far)
    if far < 2**64:
        with pytest.raises(ValueError, match=f"positions contains {far} .*{supported}"):
            fastpe.embed(ids, weight, positions=np.array([0, 1, far], dtype=np.uint64))
    with pytest.raises(ValueError, match=f"offset = .*{supported}"):
        fastpe.sinusoidal_table(2, 8, offset=far)
    with pytest.raises(ValueError, match=f"offset = .*{supported}"):
        fastpe.rope_table(2, 8, offset=far)
    with pytest.raises((ValueError, IndexError), match="positions"):
        fastpe.apply_rope(x, cos, sin, positions=far)
    # the last supported positions still work
    fastpe.embed(ids, weight, positions=2**32 - 3)


# --- 17. with key_lengths, bottom-right alignment (causal, fused RoPE's default query positions)
# follows each sequence's length: row b equals the call on that sequence's keys alone


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_kv_cache_equals_each_sequence_alone(backend, rng):
    b, hq, hkv, sq, sk, d = 3, 4, 2, 3, 9, 8
    lengths = np.array([9, 5, 3])
    q = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, sk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, sk, d)).astype(np.float32)
    cos, sin = fastpe.rope_table(16, d)
    options = {
        "causal": True,
        "rope": {"cos": cos, "sin": sin},
        "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
    }
    if backend == "triton":
        pytest.importorskip("torch")
        got = fastpe.attention(
            *(torch.from_numpy(t) for t in (q, k, v)),
            backend=backend,
            key_lengths=torch.from_numpy(lengths),
            causal=True,
            alibi_slopes=torch.from_numpy(options["alibi_slopes"]),
            rope={"cos": torch.from_numpy(cos), "sin": torch.from_numpy(sin)},
        )
    else:
        got = fastpe.attention(q, k, v, key_lengths=lengths, backend=backend, **options)
    for row, length in enumerate(lengths):
        alone = fastpe.attention(
            q[row : row + 1],
            k[row : row + 1, :, :length],
            v[row : row + 1, :, :length],
            backend="numpy",
            **options,
        )
        np.testing.assert_allclose(to_np(got)[row : row + 1], alone, atol=2e-5)
