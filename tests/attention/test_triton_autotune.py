"""The Triton forward's autotuning: a decoding loop, whose key length grows by one per token,
must not benchmark the configs again at every new length (on a GPU each tuning costs ~0.1 s per
config, and a new tuning inside CUDA-graph capture fails). Run through Triton's interpreter with
two configs and the benchmark replaced by a counter."""

from __future__ import annotations

import pytest
from _testkit import torch

import fastpe

triton = pytest.importorskip("triton")
if torch is None:
    pytest.skip("the Triton kernels take torch tensors", allow_module_level=True)


@pytest.fixture
def benchmarked(monkeypatch):
    """The configs the forward kernel's autotuner benchmarks, in order (two configs, a fresh
    tuning cache; the GPU-only pruning is bypassed, the interpreter cannot time them)."""
    if fastpe.backends()["triton"] != "available":
        pytest.skip(fastpe.backends()["triton"])
    from fastpe.kernels.triton import attention

    tuner = attention._attention_kernel
    configs = [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": n}, num_warps=4, num_stages=1) for n in (16, 32)
    ]
    seen = []

    def bench(*args, config, **kwargs):
        seen.append(config)
        return float(configs.index(config) + 1)  # the first config is the fastest

    monkeypatch.setattr(tuner, "configs", configs)
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(tuner, "prune_configs", lambda kwargs: configs)
    monkeypatch.setattr(tuner, "_bench", bench)
    return seen


def _decode(sk: int, **options):
    gen = torch.Generator().manual_seed(sk)
    q = torch.randn(1, 2, 1, 16, generator=gen)
    k, v = torch.randn(1, 2, sk, 16, generator=gen), torch.randn(1, 2, sk, 16, generator=gen)
    out = fastpe.attention(q, k, v, backend="triton", **options)
    want = fastpe.attention(q.double(), k.double(), v.double(), backend="numpy", **options)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_decode_steps_tune_once_per_doubling_of_the_length(benchmarked):
    for sk in (256, 257, 258):  # three decode steps: one tuning
        _decode(sk)
    assert len(benchmarked) == 2, benchmarked  # both configs, benchmarked once
    _decode(512)  # twice the length: tuned again
    assert len(benchmarked) == 4, benchmarked
    # a soft-cap prunes the configs differently (the widest tiles spill with it): its own
    # tuning, not the capless call's choice
    _decode(512, softcap=30.0)
    assert len(benchmarked) == 6, benchmarked


def test_tuning_length_rounds_down_to_a_power_of_two():
    from fastpe.kernels.triton.attention import tuning_length

    assert [tuning_length(n) for n in (0, 1, 2, 3, 63, 64, 65, 4095, 4096, 8191)] == [
        1,
        1,
        2,
        2,
        32,
        64,
        64,
        2048,
        4096,
        4096,
    ]
