"""The launches ``fastpe triton-report`` compiles: each kernel's arguments come from its
launcher's own ``launch_args``, called on meta tensors (no memory, no GPU) shaped like a typical
call, and go through the JIT's own binder (``triton_report._source``), so the specialisations
(unit strides become constants, 16-divisible sizes and pointers are marked so) come out as they
would on a GPU. The variants are the feature combinations each kernel is compiled with."""

from __future__ import annotations

from fastpe._options import AttentionOptions

# the feature combinations of tests/attention/test_backends.py::ATTN_CASES (+ MHA, positions,
# non-interleaved RoPE), as the options of the forward's launch_args (T5: (buckets,
# bidirectional); RoPE: "interleaved" or "neox_positions"; mask: "bool" or "float")
ATTENTION_VARIANTS = {
    "plain": {},
    "plain_mha": {"mha": True},
    "causal": {"causal": True},
    "bool_mask": {"mask": "bool"},
    "float_mask": {"mask": "float"},
    "key_lengths": {"key_lengths": True},
    "alibi": {"alibi_slopes": True, "causal": True},
    "t5": {"relative_bias": (32, True)},
    "rope": {"rope": "interleaved", "causal": True},
    "rope_neox_positions": {"rope": "neox_positions"},
    "window_softcap_sinks": {"causal": True, "window": True, "softcap": True, "sinks": True},
    "everything": {
        "causal": True,
        "mask": "bool",
        "key_lengths": True,
        "alibi_slopes": True,
        "relative_bias": (32, False),
        "rope": "interleaved",
        "window": True,
        "softcap": True,
        "sinks": True,
    },
}
# the cheap default (CI) subset
QUICK_ATTENTION_VARIANTS = ("causal", "window_softcap_sinks", "everything")


def _meta(shape, dtype):
    import torch

    return torch.empty(
        shape, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype, device="meta"
    )


def _attention_launch(dtype, d, variant):
    import torch

    from fastpe.kernels.triton import attention

    opts = ATTENTION_VARIANTS[variant]
    b, hq, s = 2, 8, 1024
    hkv = hq if opts.get("mha") else 2
    positions = _meta((s,), torch.int64) if opts.get("rope") == "neox_positions" else None
    table = _meta((s, d // 2), torch.float32)
    buckets, bidirectional = opts.get("relative_bias", (0, False))
    mask = opts.get("mask")
    return attention.launch_args(
        _meta((b, hq, s, d), dtype),
        _meta((b, hkv, s, d), dtype),
        _meta((b, hkv, s, d), dtype),
        _meta((1, b, hq, s, d), dtype),
        _meta((1, b, hq, s), torch.float32),
        options=AttentionOptions(
            scale=0.125,
            causal=opts.get("causal", False),
            bottom_right=True,
            window=(4095, 0) if opts.get("window") else None,
            softcap=50.0 if opts.get("softcap") else None,
            sinks=_meta((hq,), torch.float32) if opts.get("sinks") else None,
            # a [Hq] slope vector broadcast over batch
            alibi_slopes=_meta((hq,), torch.float32) if opts.get("alibi_slopes") else None,
        ),
        keys_per_split=s,
        # a [B, 1, S, S] mask broadcast over heads
        mask=_meta((b, 1, s, s), torch.bool if mask == "bool" else dtype).expand(b, hq, s, s)
        if mask
        else None,
        key_lengths=_meta((b,), torch.int64) if opts.get("key_lengths") else None,
        relative_bias=(_meta((buckets, hq), torch.float32), buckets, 128, bidirectional)
        if buckets
        else None,
        rope=(table, table, opts["rope"] == "interleaved", (positions, 0), (positions, 0))
        if opts.get("rope")
        else None,
    )


def _backward_launch(kernel, dtype, d, variant):
    import torch

    from fastpe.kernels.triton import attention_backward as bw

    b, hq, hkv, s = 2, 16, 4, 1024
    # q, k, v, dO in the case's dtype; lse, delta and the gradients in fp32
    q, kv = _meta((b, hq, s, d), dtype), _meta((b, hkv, s, d), dtype)
    rows = _meta((b, hq, s), torch.float32)
    dq, dkv = _meta((b, hq, s, d), torch.float32), _meta((b, hkv, s, d), torch.float32)
    every = variant == "everything"
    inputs = dict(
        options=AttentionOptions(
            scale=0.125,
            causal=True,
            bottom_right=True,
            softcap=1.0 if every else None,
            alibi_slopes=_meta((b, hq), torch.float32) if every else None,
        ),
        mask=_meta((b, 1, s, s), torch.bool).expand(b, hq, s, s) if every else None,
        key_lengths=_meta((b,), torch.int64) if every else None,
        relative_bias=(_meta((32, hq), torch.float32), 32, 128, True) if every else None,
    )
    if kernel == "attention_dkdv":
        return bw.dkdv_launch_args(q, kv, kv, q, rows, rows, dkv, dkv, **inputs)
    q_blocks = -(-s // bw.tiles(d, d, kv.dtype, biased=every)[1][0])
    dtable = _meta((b, hq, q_blocks, 32) if every else (1,), torch.float32)
    return bw.dq_launch_args(q, kv, kv, q, rows, rows, dq, dtable, **inputs)


def _paged_launch(dtype, d, variant, target):
    import torch

    from fastpe.kernels.triton import attention_paged

    batch, hq, hkv, pages, page_size = 8, 32, 8, 256, 16
    max_q, max_k = (1 if variant == "decode" else 1024), pages * page_size
    total_q, every = batch * max_q, variant == "everything"
    lengths = _meta((batch,), torch.int64)
    return attention_paged.launch_args(
        _meta((total_q, hq, d), dtype),
        _meta((batch * max_k, hkv, d), dtype),
        _meta((batch * max_k, hkv, d), dtype),
        _meta((1, total_q, hq, d), dtype),
        _meta((1, total_q, hq), torch.float32),
        q_start=lengths,
        q_len=lengths,
        k_len=lengths,
        page_start=_meta((batch, pages), torch.int64),
        page_size=page_size,
        max_q=max_q,
        max_k=max_k,
        keys_per_split=max_k,
        options=AttentionOptions(
            scale=0.125,
            causal=True,
            bottom_right=True,
            window=(2 * max_k + 1, 0) if every else None,
            softcap=50.0 if every else None,
            sinks=_meta((hq,), torch.float32) if every else None,
            alibi_slopes=_meta((hq,), torch.float32).expand(batch, hq) if every else None,
        ),
        capability=target,
    )


def _pe_launch(kernel, dtype, d, variant):
    import torch

    from fastpe.kernels.triton import apply_rope, embed, rope_table, sinusoidal_table

    half, positions = d // 2, 4096
    if kernel == "sinusoidal_table":
        out, omega = _meta((positions, d), dtype), _meta((half,), torch.float64)
        return sinusoidal_table.launch_args(out, omega, 0, variant == "interleaved")
    if kernel == "rope_table":
        cos, inv_freq = _meta((positions, half), dtype), _meta((half,), torch.float64)
        return rope_table.launch_args(cos, cos, inv_freq, 0, 1.0)
    if kernel == "apply_rope":  # q [2, 32, S, D] and k [2, 8, S, D] in one launch
        b, s = 2, 1024
        rot_half = half // 2 if variant == "partial" else half
        xs = (_meta((b, 32, s, d), dtype), _meta((b, 8, s, d), dtype))
        outs = tuple(_meta(x.shape, dtype) for x in xs)
        table = _meta((positions, rot_half), dtype)
        pos = None if variant == "neox" else _meta((s,), torch.int64)
        return apply_rope.launch_args(
            xs,
            outs,
            table,
            table,
            pos,
            0,
            interleaved=variant == "interleaved",
            layout="bhsd",
            inverse=variant == "inverse",
        )
    if kernel == "embed":
        b, s, vocab = 8, 1024, 32000
        pe, types, has_positions = {
            "sinusoidal": ("sinusoidal", False, False),
            "table_positions": ("table", False, True),
            "none_types": (None, True, False),
            "sinusoidal_types_positions": ("sinusoidal", True, True),
        }[variant]
        ids = _meta((b, s), torch.int64)
        return embed.launch_args(
            ids,
            _meta((vocab, d), dtype),
            _meta((b * s, d), dtype),
            ids if has_positions else None,
            0,
            scale=1.0,
            pe=pe,
            pe_table=_meta((positions, d), dtype) if pe == "table" else None,
            omega=_meta((half,), torch.float64) if pe == "sinusoidal" else None,
            token_type_ids=ids if types else None,
            token_type_weight=_meta((2, d), dtype) if types else None,
        )
    if kernel == "scatter_rows":  # embed's backward: one program per (row, column block)
        tokens, vocab = 8192, 32000
        index = _meta((tokens,), torch.int64)
        return embed.scatter_rows_launch_args(
            index, index, index, _meta((tokens, d), dtype), _meta((vocab, d), dtype), 1.0
        )
    raise ValueError(f"unknown kernel {kernel!r}")


def _flex_modifiers(variant):
    """(score_mod, mask_mod) of a flex_attention report variant, capturing meta tensors:
    "causal_softcap" (a derivative in the backward, no captured tensor) and
    "document_bias" (a document mask and a relative-bias table, both captured and indexed;
    "trained_bias": the table requires grad, so the dQ pass adds to its gradient)."""
    import torch

    s = 1024
    if variant == "causal_softcap":

        def softcap(score, b, h, q_idx, kv_idx):
            return 30.0 * torch.tanh(score / 30.0)

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return softcap, causal
    doc = _meta((s,), torch.int64)
    table = _meta((16, 2 * s), torch.float32)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + s]

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return bias, document


def _flex_launch(kernel, dtype, d, variant, target):
    import torch

    from fastpe import _flex_expr, _flex_triton
    from fastpe.kernels.triton import flex_attention as fx

    b, hq, hkv, s, block = 2, 16, 4, 1024, 128
    score_mod, mask_mod = _flex_modifiers(variant)
    captured = _flex_expr.capture(score_mod, "score_mod")
    score, caps = captured.node, list(captured.arrays)
    captured = _flex_expr.capture(mask_mod, "mask_mod")
    mask = _flex_expr.renumber(captured, len(caps))
    caps += captured.arrays
    reads, dcaps = (), None
    if variant == "trained_bias":
        reads = _flex_expr.trained_reads(score, (0,))
        dcaps = [_meta((c.numel(),), torch.float32) for c in caps]
    module, checks, has_grad = _flex_triton.variant(score, mask, reads)
    n = s // block
    # a block mask made with B and H None (broadcast), as create_block_mask(fn, None, None, ...)
    lists = tuple((_meta((1, 1, n), torch.int32), _meta((1, 1, n, n), torch.int32)) for _ in "fp")
    q, kv = _meta((b, hq, s, d), dtype), _meta((b, hkv, s, d), dtype)
    rows = _meta((b, hq, s), torch.float32)
    if kernel == "flex_forward":
        return fx.forward_launch_args(
            q, kv, kv, q, rows, _meta((1,), torch.int32), module=module, lists=lists, caps=caps,
            blocks=(block, block), scale=0.125, checks=checks,
        )  # fmt: skip
    grads = (_meta((b, hq, s, d), torch.float32), *(_meta((b, hkv, s, d), torch.float32),) * 2)
    return fx.backward_launch_args(
        kernel == "flex_dq", q, kv, kv, q, rows, rows, grads, module=module, lists=lists,
        blocks=(block, block), caps=caps, scale=0.125, has_grad=has_grad, capability=target,
        dcaps=dcaps,
    )  # fmt: skip


def launch(kernel, dtype, d, variant, target=90):
    """(kernel, grid, args, constexprs) of one report case, from its launcher's launch_args,
    for compute capability ``target`` (the paged kernel's tiles depend on it). The attention
    forward's constexprs lack the autotuned block sizes (the case's config)."""
    import torch

    from fastpe.kernels.triton import attention

    if kernel == "attention":
        return _attention_launch(dtype, d, variant)
    if kernel in ("attention_dkdv", "attention_dq"):
        return _backward_launch(kernel, dtype, d, variant)
    if kernel == "attention_paged":
        return _paged_launch(dtype, d, variant, target)
    if kernel.startswith("flex_"):
        return _flex_launch(kernel, dtype, d, variant, target)
    if kernel == "merge":
        # split-KV merges fp32 parts into fp32; merge_attention merges parts in the input dtype
        part = torch.float32 if variant == "split_kv" else getattr(torch, dtype)
        n, rows = 4, 2 * 8 * 1024
        return attention.merge_launch_args(
            _meta((n, rows, d), part),
            _meta((n, rows), torch.float32),
            _meta((rows, d), part),
            _meta((rows,), torch.float32),
        )
    return _pe_launch(kernel, dtype, d, variant)


def launched(dtype, d, variant) -> bool:
    """False for RoPE variants the launcher never runs (it rotates q and k beforehand and
    launches the kernel without HAS_ROPE, a variant compiled on its own)."""
    from fastpe.kernels.triton import attention

    flags = launch("attention", dtype, d, variant)[3]
    biased = attention._per_element_bias(flags)
    return not flags["HAS_ROPE"] or attention._rope_in_kernel(d, dtype == "float32", biased)


def jit_function(kernel):
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):  # the autotuner wraps the JITFunction
        kernel = kernel.fn
    return kernel


def attention_configs(dtype, d, variant, target):
    """[(config, pickable)]: every config in the autotune list, and whether ``_prune`` keeps it
    on ``target`` for a prefill (Sq = 1024) or a decode (Sq = 1) call of this shape."""
    from fastpe.kernels.triton import attention

    kernel, _, args, constexprs = launch("attention", dtype, d, variant)
    named = dict(zip(jit_function(kernel).arg_names, args, strict=False))
    configs = attention._gpu_configs()
    kept = set()
    for sq in (1, 1024):
        lengths = {"tuning_lengths": (sq, sq)}  # powers of two: their own tuning lengths
        for c in attention._prune(configs, {**named, **lengths}, capability=target, **constexprs):
            kept.add(id(c))
    return [(c, id(c) in kept) for c in configs]


def config_tuple(meta: dict, num_warps: int, num_stages: int) -> tuple:
    return (*sorted(meta.items()), ("num_warps", num_warps), ("num_stages", num_stages))


KERNEL_VARIANTS = {
    "sinusoidal_table": ("interleaved", "concat"),
    "rope_table": ("default",),
    "apply_rope": ("neox", "interleaved", "partial", "inverse"),
    "embed": ("sinusoidal", "table_positions", "none_types", "sinusoidal_types_positions"),
    "scatter_rows": ("default",),
    "merge": ("split_kv", "merge_attention"),
    "attention_dkdv": ("causal", "everything"),
    "attention_dq": ("causal", "everything"),
    "attention_paged": ("decode", "prefill", "everything"),
    "flex_forward": ("causal_softcap", "document_bias"),
    "flex_dkdv": ("causal_softcap", "document_bias"),
    "flex_dq": ("causal_softcap", "document_bias", "trained_bias"),
}
