"""``attention_kvcache`` under torch.compile: one custom op that declares its writes into
``k_cache``/``v_cache`` (``mutates_args``), so a compiled decode step appends to the caches
exactly as the eager call does; under autograd it is refused at the call (no backward)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fastpe  # noqa: E402


def _decode_inputs(paged):
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d = 3, 4, 2, 8
    q = torch.randn(b, 2, hq, d, generator=g)
    k_new, v_new = torch.randn(b, 2, hkv, d, generator=g), torch.randn(b, 2, hkv, d, generator=g)
    lengths = torch.tensor([5, 0, 9], dtype=torch.int32)
    if paged:  # 8 pages of 4 rows
        k_cache, v_cache = (
            torch.randn(8, 4, hkv, d, generator=g),
            torch.randn(8, 4, hkv, d, generator=g),
        )
        # sequence b's pages in a shuffled order; sequence 1 (2 keys) never reaches its page 2
        extra = {"block_table": torch.tensor([[3, 1, 6], [0, 7, 2], [5, 4, 2]], dtype=torch.int32)}
    else:
        k_cache, v_cache = (
            torch.randn(3, 12, hkv, d, generator=g),
            torch.randn(3, 12, hkv, d, generator=g),
        )
        extra = {"cache_batch_idx": torch.tensor([2, 0, 1])}
    angle = torch.arange(16.0)[:, None] * 0.5 ** torch.arange(4.0)
    extra.update(rotary_cos=angle.cos(), rotary_sin=angle.sin())
    return q, k_cache, v_cache, k_new, v_new, lengths, extra


@pytest.mark.parametrize("paged", [True, False])
def test_compiled_decode_step_appends_like_eager(paged):
    q, k_cache, v_cache, k_new, v_new, lengths, extra = _decode_inputs(paged)

    def step(q, k_cache, v_cache, k, v, lengths, extra):
        return fastpe.attention_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True, return_lse=True, **extra
        )

    want_caches = (k_cache.clone(), v_cache.clone())
    want_out, want_lse = step(q, *want_caches, k_new, v_new, lengths, extra)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got_out, got_lse = compiled(q, k_cache, v_cache, k_new, v_new, lengths, extra)
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_lse, want_lse)
    assert torch.equal(k_cache, want_caches[0]) and torch.equal(v_cache, want_caches[1])
    assert not torch.equal(k_cache, _decode_inputs(paged)[1])  # the step did write


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_opcheck_kvcache_op(quantized):
    """The schema, fake and declared mutations; an int8 cache's append also writes its scales."""
    from fastpe import torch_ops  # noqa: F401  (registers the ops)

    q, k_cache, v_cache, k_new, v_new, lengths, extra = _decode_inputs(False)
    scales = {"k_scale": None, "v_scale": None}
    if quantized:
        k_cache, v_cache = (
            torch.round(c * 40).clamp(-127, 127).to(torch.int8) for c in (k_cache, v_cache)
        )
        scales = {name: torch.full(k_cache.shape[:3], 0.025) for name in scales}
    # by name: the schema's order is the op's own business
    arguments = dict(
        k=k_new,
        v=v_new,
        cache_seqlens=lengths,
        cache_seqlens_int=0,
        block_table=None,
        cache_batch_idx=extra["cache_batch_idx"],
        causal=True,
        causal_alignment="bottom_right",
        scale=None,
        window_left=-1,
        window_right=-1,
        softcap=None,
        sinks=None,
        alibi_slopes=None,
        rope_cos=extra["rotary_cos"],
        rope_sin=extra["rotary_sin"],
        rope_interleaved=False,
        rope_q_positions=None,
        rope_q_positions_offset=None,
        rope_k_positions=None,
        rope_k_positions_offset=None,
        backend="",
        **scales,
    )
    torch.library.opcheck(
        torch.ops.fastpe.attention_kvcache.default, (q, k_cache, v_cache), arguments
    )


def test_int_cache_seqlens_compiles():
    q, k_cache, v_cache, k_new, v_new, _, _ = _decode_inputs(False)
    want = fastpe.attention_kvcache(
        q, k_cache.clone(), v_cache.clone(), k_new, v_new, cache_seqlens=3
    )
    compiled = torch.compile(
        lambda *a: fastpe.attention_kvcache(*a, cache_seqlens=3),
        fullgraph=True,
        backend="aot_eager",
    )
    torch.testing.assert_close(compiled(q, k_cache, v_cache, k_new, v_new), want)


@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning")  # anomaly mode's echo
def test_compiled_with_grad_raises_at_backward():
    q, k_cache, v_cache, k_new, v_new, lengths, _ = _decode_inputs(False)
    q.requires_grad_()
    compiled = torch.compile(
        lambda q: fastpe.attention_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(RuntimeError, match="attention_kvcache"):
        compiled(q).sum().backward()


def test_autograd_refused_at_the_call():
    q, k_cache, v_cache, *_ = _decode_inputs(False)
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match="attention_kvcache has no autograd"):
        fastpe.attention_kvcache(q, k_cache, v_cache, cache_seqlens=4)
    with torch.no_grad():  # inference: fine
        fastpe.attention_kvcache(q, k_cache, v_cache, cache_seqlens=4)
