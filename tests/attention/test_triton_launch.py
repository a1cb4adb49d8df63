"""The launch grids of the Triton attention forwards stay within CUDA's limits at decode batch
sizes: grid axes 1 and 2 stop at 65535 programs, axis 0 at 2^31 - 1. Computed through the
launchers' own ``launch_args`` on meta tensors (nothing is launched)."""

from __future__ import annotations

import pytest
from _testkit import torch

pytest.importorskip("triton")
if torch is None:
    pytest.skip("the Triton kernels take torch tensors", allow_module_level=True)

from fastpe._options import AttentionOptions  # noqa: E402

AXIS_LIMITS = (2**31 - 1, 65535, 65535)
BATCH, HEADS, KV_HEADS, KEYS, D = 2048, 32, 8, 4096, 128  # a decode step at batch 2048


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _within_limits(grid):
    return all(0 < n <= limit for n, limit in zip(grid, AXIS_LIMITS, strict=False))


@pytest.fixture
def on_gpu(monkeypatch):
    """split_keys as it decides on a GPU (the interpreter always splits in two)."""
    from fastpe.kernels.triton import attention

    monkeypatch.setattr(attention, "interpreted", lambda: False)
    return attention


def test_split_count_stays_far_below_the_axis_limit(on_gpu):
    # one program over ten million keys on a 132-SM GPU: the most splits there can be
    n_splits, keys_per_split, _ = on_gpu.split_keys(1, 1, 10**7, 132, torch.bfloat16)
    assert n_splits == 2 * 132
    assert n_splits * keys_per_split >= 10**7


def test_dense_forward_grid_holds_batch_times_heads_on_axis_0(on_gpu):
    n_splits, keys_per_split, part_dtype = on_gpu.split_keys(
        BATCH * HEADS, 1, KEYS, 132, torch.bfloat16
    )
    _, grid, _, _ = on_gpu.launch_args(
        _meta(BATCH, HEADS, 1, D),
        _meta(BATCH, KV_HEADS, KEYS, D),
        _meta(BATCH, KV_HEADS, KEYS, D),
        _meta(n_splits, BATCH, HEADS, 1, D, dtype=part_dtype),
        _meta(n_splits, BATCH, HEADS, 1, dtype=torch.float32),
        options=AttentionOptions(scale=D**-0.5, causal=True, bottom_right=True),
        keys_per_split=keys_per_split,
    )
    for config in on_gpu._gpu_configs():  # the grid depends on the autotuned BLOCK_M
        shape = grid(config.kwargs)
        assert shape == (BATCH * HEADS, 1, n_splits), (config, shape)  # one query block
        assert _within_limits(shape), shape
    sq = 1000  # a prefill: ceil(1000 / BLOCK_M) query blocks per (batch, head)
    _, grid, _, _ = on_gpu.launch_args(
        _meta(BATCH, HEADS, sq, D),
        _meta(BATCH, KV_HEADS, sq, D),
        _meta(BATCH, KV_HEADS, sq, D),
        _meta(1, BATCH, HEADS, sq, D),
        _meta(1, BATCH, HEADS, sq, dtype=torch.float32),
        options=AttentionOptions(scale=D**-0.5, causal=True, bottom_right=True),
        keys_per_split=sq,
    )
    assert grid({"BLOCK_M": 64}) == (BATCH * HEADS, 16, 1)
    assert _within_limits(grid({"BLOCK_M": 16}))


def test_paged_grid_holds_batch_times_heads_on_axis_0(on_gpu):
    from fastpe.kernels.triton import attention_paged

    pages, page_size = KEYS // 16, 16
    n_splits, keys_per_split, part_dtype = on_gpu.split_keys(
        BATCH * HEADS, 1, KEYS, 132, torch.bfloat16
    )
    lengths = _meta(BATCH, dtype=torch.int64)
    _, grid, _, _ = attention_paged.launch_args(
        _meta(BATCH, HEADS, D),
        _meta(BATCH * KEYS, KV_HEADS, D),
        _meta(BATCH * KEYS, KV_HEADS, D),
        _meta(n_splits, BATCH, HEADS, D, dtype=part_dtype),
        _meta(n_splits, BATCH, HEADS, dtype=torch.float32),
        q_start=lengths,
        q_len=lengths,
        k_len=lengths,
        page_start=_meta(BATCH, pages, dtype=torch.int64),
        page_size=page_size,
        max_q=1,
        max_k=KEYS,
        keys_per_split=keys_per_split,
        options=AttentionOptions(scale=D**-0.5, causal=True, bottom_right=True),
    )
    assert grid == (BATCH * HEADS, 1, n_splits)
    assert _within_limits(grid)


@pytest.mark.parametrize("long", [70, 130])
def test_paged_kernel_takes_wide_tiles_for_long_sequences(long):
    """From 64 queries a sequence, heads of 65-128 take the dense forward's tiles (tensor cores
    at its size): 64 x 64, and on sm_90 128 x 64 from 128 queries; through the interpreter
    (which takes the sm_90 tiles) in fp16 (bf16 computes through fp32 there) against the
    float64 oracle."""
    import numpy as np
    from fastpe.kernels.triton import attention_paged

    import fastpe

    if fastpe.backends()["triton"] != "available":
        pytest.skip(fastpe.backends()["triton"])
    assert attention_paged.tiles(70, 96, False, 90)["BLOCK_M"] == 64
    assert attention_paged.tiles(70, 96, False, 90)["BLOCK_N"] == 64
    assert attention_paged.tiles(63, 96, False, 90)["BLOCK_M"] == 32
    assert attention_paged.tiles(130, 96, False, 90)["BLOCK_M"] == 128
    assert attention_paged.tiles(130, 96, False, 80)["BLOCK_M"] == 64  # 128 rows spill there
    gen = torch.Generator().manual_seed(70)
    lengths = np.array([long, 3])
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), 1, 96, generator=gen).half() for _ in range(3))
    out = fastpe.attention_varlen(q, k, v, cu, cu, causal=True, backend="triton")
    want = fastpe.attention_varlen(
        q.double(), k.double(), v.double(), cu, cu, causal=True, backend="numpy"
    )
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
