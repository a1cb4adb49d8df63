"""The public ops: validate once into an inputs record, then dispatch (and ``explain``).

The mathematics of every op is in docs/math.md, the dtype and error policy in
docs/dtypes-and-errors.md.

Arrays in, arrays out: a NumPy array in gives a NumPy array out; a torch tensor in gives a torch
tensor on the same device. ``backend=`` picks "numpy" (float64 oracle), "numba" (CPU) or
"triton" (CUDA); None means ``use_backend``'s choice, then $FASTPE_BACKEND, then automatic.
"""

from __future__ import annotations

import sys

from fastpe import _arrays, _kv_quant, dispatch, reference
from fastpe._inputs import (
    FREQS,
    LAYOUTS,
    ApplyRopeInputs,
    AttentionInputs,
    EmbedInputs,
    MergeAttentionInputs,
    RopeTableInputs,
    SinusoidalTableInputs,
    _check_sinusoidal_dim,
)
from fastpe._inputs_serving import (
    AttentionKVCacheInputs,
    AttentionVarlenInputs,
    KVCachePlan,
    VarlenPlan,
    check_plan,
    plan_device,
)
from fastpe._validate import (
    MAX_DIM,
    MAX_POSITION,
    check_choice,
    check_float,
    check_float_array,
    check_int,
    check_same_placement,
    is_int_scalar,
)
from fastpe.backends._serving import rows_per_block


def _torch_graph(*arrays, device=None) -> bool:
    """True when a call must go through ``torch.ops.fastpe``: under torch.compile (so the trace
    sees one opaque op, not our NumPy-level validation), or when autograd would record an input.
    Never imports torch: a caller without torch has no tensors."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if torch.compiler.is_compiling():
        return any(isinstance(a, torch.Tensor) for a in arrays) or device is not None
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in arrays
    )


def _route(record, args, options, backend, *, nested=(), graph=None):
    """One public call, its arguments said once: through the custom op ``torch_ops.call_<op>``
    when ``_torch_graph`` asks for it (``graph``: its answer, when the caller already has it),
    else validated into ``record`` and dispatched. Every tensor among the arguments counts, and
    those in ``nested`` (tables inside option dicts); a ``device`` option sends a table built
    under torch.compile to the op."""
    if graph is None:
        graph = _torch_graph(*args, *options.values(), *nested, device=options.get("device"))
    if graph:
        from fastpe import torch_ops

        return getattr(torch_ops, f"call_{record.op}")(*args, **options, backend=backend)
    return dispatch.run(record.build(*args, **options), backend)


def sinusoidal_table(
    num_positions,
    dim,
    *,
    base=10000.0,
    layout="interleaved",
    freq="paper",
    offset=0,
    dtype="float32",
    device=None,
    backend=None,
):
    """Sinusoidal positional-encoding table (Vaswani et al. 2017, §3.5).

    Returns ``[num_positions, dim]`` for positions ``offset … offset + num_positions - 1``.

    - ``freq="paper"``: ω_i = base^(-2i/dim) (paper, XLM, Marian, DistilBERT, GPT-J);
      ``freq="tensor2tensor"``: ω_i = base^(-i/(dim/2 - 1)) (fairseq, M2M100, Whisper).
    - ``layout="interleaved"``: PE[p, 2i] = sin(pω_i), PE[p, 2i+1] = cos(pω_i) (the paper);
      ``layout="concat"``: PE[p, i] = sin, PE[p, dim/2 + i] = cos (fairseq/Marian ``[sin | cos]``).

    ``dtype`` float32/float64 (float16/bfloat16 with a torch ``device``); ``device=None`` returns
    NumPy, otherwise a torch tensor on that device. Matches transformers' XLM / Marian / M2M100
    tables.
    """
    options = dict(base=base, layout=layout, freq=freq, offset=offset, dtype=dtype, device=device)
    return _route(SinusoidalTableInputs, (num_positions, dim), options, backend)


def relative_transform(k, dim, *, base=10000.0, freq="paper", layout="interleaved"):
    """The matrix T(k) [dim, dim] (float64 NumPy) with ``PE[p + k] = T(k) @ PE[p]`` for every p.

    Block-diagonal: one 2x2 rotation [[cos ωk, sin ωk], [-sin ωk, cos ωk]] per frequency, acting
    on the (sin, cos) pair of that frequency in the given ``layout``. Independent of p — the
    property for which the paper chose sinusoids. ``k`` may be negative: it is a distance between
    two supported positions, so ``|k| < 2**32``.
    """
    k = check_int("k", k, minimum=1 - MAX_POSITION, maximum=MAX_POSITION - 1)
    dim = check_int("dim", dim, minimum=2, maximum=MAX_DIM)
    freq = check_choice("freq", freq, FREQS)
    layout = check_choice("layout", layout, LAYOUTS)
    _check_sinusoidal_dim("dim", dim, freq)
    return reference.relative_transform(
        k, dim, check_float("base", base, positive=True), freq, layout
    )


def rope_table(
    num_positions,
    rotary_dim,
    *,
    base=10000.0,
    scaling=None,
    offset=0,
    dtype="float32",
    device=None,
    backend=None,
):
    """RoPE cos/sin tables ``(cos, sin)``, each ``[num_positions, rotary_dim/2]`` (halves not
    duplicated): ``cos[p, i] = attention_factor · cos((offset + p) · inv_freq[i])``, same for sin.

    ``inv_freq`` and ``attention_factor`` come from ``rope_inv_freq(rotary_dim, base=, scaling=,
    seq_len=offset + num_positions)``: a Hugging Face ``rope_scaling`` dict (linear, dynamic, yarn,
    longrope, llama3) gives the same frequencies as transformers; dynamic NTK and longrope choose
    their parameters from the table's length, as transformers does for that sequence length.
    """
    options = dict(base=base, scaling=scaling, offset=offset, dtype=dtype, device=device)
    return _route(RopeTableInputs, (num_positions, rotary_dim), options, backend)


def apply_rope(
    x, cos, sin, *, positions=None, interleaved=False, layout="bhsd", inplace=False, backend=None
):
    """Rotate ``x`` by rotary position embedding.

    ``x``: [B, H, S, D] (``layout="bhsd"``) or [B, S, H, D] (``"bshd"``); ``cos``/``sin``:
    [P, R/2] tables (``rope_table``), R <= D. Row ``positions[b, s]`` rotates token (b, s):
    ``positions`` is None (0 … S-1), an int offset (offset … offset + S - 1), or an int array
    [S] or [B, S]; every position must be < P.

    Pairs (a, b) -> (a·cos - b·sin, b·cos + a·sin), with pairs (i, i + R/2) for
    ``interleaved=False`` (GPT-NeoX / Llama / HF ``rotate_half``) or (2i, 2i + 1) for
    ``interleaved=True`` (GPT-J / RoFormer). Elements R … D-1 pass through (partial rotary).
    Returns a new array in x's dtype, or x itself, rotated, when ``inplace=True``.

    ``x`` may also be a tuple such as ``(q, k)`` — arrays with the same batch and sequence
    (head counts may differ, as with GQA) — rotated by one call and returned as a tuple, like
    transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``; the Triton backend rotates them in
    one launch.

    Differentiable w.r.t. ``x`` under torch autograd (the gradient is rotated back by -θ);
    cos/sin are constants and raise if backward needs their gradient (docs/math.md#gradients).
    """
    options = dict(positions=positions, interleaved=interleaved, layout=layout, inplace=inplace)
    if isinstance(x, (tuple, list)):
        return _apply_rope_group(tuple(x), cos, sin, options, backend)
    return _route(ApplyRopeInputs, (x, cos, sin), options, backend)


def _apply_rope_group(xs, cos, sin, options, backend):
    """``apply_rope`` on a tuple such as (q, k): each tensor validated as in a single call, one
    backend chosen for all, and the group handed to it at once (one launch on Triton)."""
    if not xs:
        raise ValueError("x must be an array or a non-empty tuple of arrays (such as (q, k))")
    _check_shared_batch_and_seq(xs, options["layout"])  # shapes only: runs under compile too
    if _torch_graph(*xs, cos, sin, options["positions"]):
        from fastpe import torch_ops

        return torch_ops.call_apply_rope_group(xs, cos, sin, backend=backend, **options)
    first = ApplyRopeInputs.build(xs[0], cos, sin, **options)
    group = [first, *(first.with_x(x) for x in xs[1:])]
    return dispatch.run_group(group, backend)


def _check_shared_batch_and_seq(xs, layout) -> None:
    seq_axis = 1 if layout == "bshd" else 2
    shapes = [tuple(getattr(x, "shape", ())) for x in xs]  # others fail their own validation
    shared = [(i, (s[0], s[seq_axis])) for i, s in enumerate(shapes) if len(s) == 4]
    for index, batch_seq in shared[1:]:
        if batch_seq != shared[0][1]:
            raise ValueError(
                f"x[{index}] has batch and sequence {batch_seq}; every tensor of x must share "
                f"x[{shared[0][0]}]'s {shared[0][1]}"
            )


def embed(
    ids,
    weight,
    *,
    positions=None,
    pe="sinusoidal",
    pe_table=None,
    scale=1.0,
    base=10000.0,
    layout="interleaved",
    freq="paper",
    token_type_ids=None,
    token_type_weight=None,
    backend=None,
):
    """Fused token embedding + positional encoding [+ token type] -> [B, S, D] in weight's dtype.

    ``out[b, s] = scale · weight[ids[b, s]] + PE(positions[b, s]) [+ token_type_weight[tt[b, s]]]``

    ``ids`` int [B, S]; ``weight`` [V, D]. ``pe="sinusoidal"`` computes the encoding of
    ``sinusoidal_table`` (``base``, ``layout``, ``freq``) for each position, ``pe="table"`` adds
    rows of ``pe_table`` [P, D] (BERT, GPT-2 learned positions), ``pe=None`` adds nothing.
    ``positions``: None (0 … S-1), an int offset (incremental decoding) or an int array [S] or
    [B, S]. ``scale`` is sqrt(D) for the paper / Marian / fairseq, 1 for BERT. An id, token type
    or (table) position outside its table raises IndexError naming the value.

    Differentiable w.r.t. ``weight``, ``pe_table`` and ``token_type_weight`` under torch autograd
    (deterministic scatter-adds, docs/math.md#embedding-gradients).
    """
    options = dict(
        positions=positions,
        pe=pe,
        pe_table=pe_table,
        scale=scale,
        base=base,
        layout=layout,
        freq=freq,
        token_type_ids=token_type_ids,
        token_type_weight=token_type_weight,
    )
    return _route(EmbedInputs, (ids, weight), options, backend)


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    causal_alignment="bottom_right",
    mask=None,
    key_lengths=None,
    scale=None,
    rope=None,
    alibi_slopes=None,
    relative_bias=None,
    window=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    backend=None,
):
    """Masked scaled dot-product attention, flash-style, in q's dtype (docs/math.md#attention).

    Half and single precision accumulate in float32, float64 in float64.

    ``q`` [B, Hq, Sq, D], ``k`` [B, Hkv, Sk, D], ``v`` [B, Hkv, Sk, Dv]; query head h reads kv
    head h // (Hq / Hkv) (GQA/MQA). ``scale`` defaults to 1/sqrt(D).

    Query i of sequence b sits at key position ``i + L_b - Sq`` with ``L_b = key_lengths[b]``
    (or Sk) for ``causal_alignment="bottom_right"`` (FlashAttention's rule for a ragged KV
    cache), or at ``i`` for ``"top_left"`` (torch SDPA's rule); the same position is used by
    ``causal`` (keys j <= that position), ALiBi, the T5 distance and fused RoPE's default query
    positions. With Sq == L_b both are identical.

    - ``mask``: bool (True = may attend, as torch SDPA) or float (added to scores, -inf blocks;
      any finite value is a score), broadcastable to [B, Hq, Sq, Sk].
    - ``key_lengths`` int [B]: keys j >= key_lengths[b] are padding.
    - ``rope``: dict(cos=, sin=, interleaved=False, q_positions=None, k_positions=None) rotates q
      and k (see ``apply_rope``) inside the kernel; default positions are 0 … Sk-1 for keys and
      the aligned positions above (clamped at 0) for queries.
    - ``alibi_slopes`` [Hq] or [B, Hq]: adds ``-slope · |query position - j|`` (FlashAttention).
    - ``relative_bias``: dict(table=[num_buckets, Hq], num_buckets=32, max_distance=128,
      bidirectional=True) adds ``table[bucket(j - query position), h]`` with T5's bucketing.
    - ``window=(left, right)``: keys ``p - left <= j <= p + right`` for a query at position p;
      -1 = unbounded on that side (FlashAttention's convention). With ``causal=True``,
      ``window=(W - 1, 0)`` is "the last W keys" (transformers' ``sliding_window=W``). Key tiles
      outside the window are never visited: cost grows with Sq·W, not Sq·Sk.
    - ``softcap=c > 0``: scores become ``c·tanh(score / c)`` after scaling, before biases and
      masks (Gemma 2).
    - ``sinks`` float [Hq]: one extra logit per head in the softmax denominator, with no value
      (gpt-oss). ``lse`` includes it; when splitting keys for ``merge_attention``, pass
      ``sinks`` to exactly one part (docs/math.md#lse-and-merging).

    A query row with no key to attend returns zeros (and lse = -inf, or the sink), never NaN.
    With ``return_lse=True`` returns ``(out, lse)``, lse [B, Hq, Sq] float32 natural-log
    log-sum-exp of the scores, for ``merge_attention``.
    """
    # the tables inside the option dicts count too: a learned T5 table alone must be recorded
    tables = [
        d.get(key)
        for d, key in ((relative_bias, "table"), (rope, "cos"), (rope, "sin"))
        if isinstance(d, dict)
    ]
    options = dict(
        causal=causal,
        causal_alignment=causal_alignment,
        mask=mask,
        key_lengths=key_lengths,
        scale=scale,
        rope=rope,
        alibi_slopes=alibi_slopes,
        relative_bias=relative_bias,
        window=window,
        softcap=softcap,
        sinks=sinks,
        return_lse=return_lse,
    )
    return _route(AttentionInputs, (q, k, v), options, backend, nested=tables)


def merge_attention(out_a, lse_a, out_b, lse_b, *, backend=None):
    """Merge two attention results over disjoint key sets into the result over their union.

    ``out_*`` [B, H, S, D], ``lse_*`` [B, H, S] (from ``attention(..., return_lse=True)``).
    ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)``;
    returns ``(out, lse)`` with lse float32. The primitive for split-KV decoding and for
    sharding a context over devices. Rows empty on both sides stay 0 with lse = -inf.
    """
    return _route(MergeAttentionInputs, (out_a, lse_a, out_b, lse_b), {}, backend)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    plan=None,
    causal=False,
    causal_alignment="bottom_right",
    scale=None,
    rope=None,
    alibi_slopes=None,
    window=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    backend=None,
):
    """``attention`` of a packed batch of variable-length sequences
    (docs/math.md#packed-variable-length-attention).

    ``q`` [total_q, Hq, D], ``k`` [total_k, Hkv, D], ``v`` [total_k, Hkv, Dv]: sequence b is
    rows ``cu_seqlens_q[b] … cu_seqlens_q[b+1] - 1`` of q and ``cu_seqlens_k[b] …
    cu_seqlens_k[b+1] - 1`` of k and v (``cu_seqlens_*`` int32/int64 [B + 1], starting at 0,
    non-decreasing, ending at the packed length). Each sequence attends only to its own keys,
    with every option of ``attention`` applied per sequence: query i of sequence b sits at key
    position ``i + Lk_b - Lq_b`` (``causal_alignment="bottom_right"``, FlashAttention's rule) or
    ``i`` (``"top_left"``); ``alibi_slopes`` [Hq] or [B, Hq]; ``window``, ``softcap``,
    ``sinks`` as in ``attention``. ``rope=dict(cos=, sin=, interleaved=False,
    q_positions=None, k_positions=None)`` rotates q and k inside the call; positions default to
    each token's index in its sequence (queries: their aligned position), or are int arrays
    [total_q] / [total_k] (transformers' packed ``position_ids``). ``max_seqlen_*`` are
    optional; given, they must be at least the longest sequence.

    Returns out [total_q, Hq, Dv] in q's dtype; with ``return_lse=True`` also lse
    [Hq, total_q] float32 (FlashAttention's varlen layout). No compute or memory is spent on
    padding: there is none.

    ``plan``: ``plan_varlen(cu_seqlens_q, cu_seqlens_k, ...)``, made once per step, in place of
    ``cu_seqlens_*`` and ``max_seqlen_*``: every layer's call then reads nothing back from the
    device and uploads nothing. Without one, ``cu_seqlens`` are checked on the host each call
    (one device read and one upload on a GPU).
    """
    tables = [rope.get(key) for key in ("cos", "sin")] if isinstance(rope, dict) else []
    if plan is None and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise TypeError(
            "attention_varlen needs cu_seqlens_q and cu_seqlens_k (int [B + 1] sequence "
            "boundaries), or a plan from fastpe.plan_varlen"
        )
    if plan is not None and _torch_graph(q, k, v, *tables, sinks, alibi_slopes):
        # the custom op takes tensors, not a plan: the plan's boundaries, which it checks again
        given = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
        check_plan(
            plan, VarlenPlan, {**given, "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}
        )
        device = getattr(q, "device", None)
        cu_seqlens_q, cu_seqlens_k = (
            plan.on_device(plan.cu_q, device),
            plan.on_device(plan.cu_k, device),
        )
        max_seqlen_q, max_seqlen_k, plan = plan.max_seqlen_q, plan.max_seqlen_k, None
    options = dict(
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        causal_alignment=causal_alignment,
        scale=scale,
        rope=rope,
        alibi_slopes=alibi_slopes,
        window=window,
        softcap=softcap,
        sinks=sinks,
        return_lse=return_lse,
    )
    if plan is not None:
        options["plan"] = plan
    arrays = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _route(AttentionVarlenInputs, arrays, options, backend, nested=tables)


def plan_varlen(cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, device=None):
    """One step's packed-batch metadata, checked once, for every layer's
    ``attention_varlen(q, k, v, plan=plan, ...)`` (docs/integrations.md#one-plan-per-step).

    Takes ``attention_varlen``'s ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q`` and
    ``max_seqlen_k`` and checks them as a call would; they are read once here (host arrays or
    lists cost nothing; device tensors one read). The plan keeps private host copies and, on a
    GPU, uploads the tables the kernels index with in one copy: to ``device`` (default: the
    device of ``cu_seqlens_q`` when it is a tensor), else at the first call that needs them.
    Calls given the plan read nothing back and upload nothing. Changing ``cu_seqlens`` after
    planning does not change the plan: make a new one for the next step.
    """
    device = plan_device(device, cu_seqlens_q, cu_seqlens_k)
    return VarlenPlan(
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        device=device,
    )


def attention_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens=None,
    block_table=None,
    cache_batch_idx=None,
    plan=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
    causal=False,
    scale=None,
    alibi_slopes=None,
    window=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    k_scale=None,
    v_scale=None,
    backend=None,
):
    """Attention of new queries against a KV cache, optionally appending new keys/values first
    (FlashAttention's ``flash_attn_with_kvcache``; docs/math.md#kv-cache-attention).

    ``q`` [B, Sq, Hq, D]. The cache is paged — ``k_cache``/``v_cache`` [num_blocks,
    block_size, Hkv, D/Dv] with ``block_table`` int [B, max_blocks] (key j of sequence b is
    ``k_cache[block_table[b, j // block_size], j % block_size]``) — or contiguous —
    [B_cache, S_cache, Hkv, D/Dv], sequence b reading row ``cache_batch_idx[b]`` (default b).
    ``cache_seqlens`` (int or int [B]) keys are already in the cache.

    ``k``, ``v`` [B, S_new, Hkv, D/Dv], if given, are written into the caches at positions
    ``cache_seqlens[b] … cache_seqlens[b] + S_new - 1`` **in place** — the only input this
    function modifies, and only at those positions — and then attended to: each sequence sees
    ``L_b = cache_seqlens[b] + S_new`` keys. ``rotary_cos``/``rotary_sin`` [P, R/2] (only with
    k) rotate the new keys at their cache positions before they are stored, and q at positions
    ``cache_seqlens[b] + i`` when ``causal`` or ``window`` is set, else all at
    ``cache_seqlens[b]`` (FlashAttention's rule; a window whose sides all reach Sq + the cache
    size or more restricts nothing and counts as none); ``rotary_interleaved`` pairs (2i, 2i+1).

    Query i sits at key position ``i + L_b - Sq`` (bottom-right, as FlashAttention) for
    ``causal``, ``window``, ALiBi. Returns out [B, Sq, Hq, Dv]; with ``return_lse=True`` also
    lse [B, Hq, Sq] float32. Unused block-table entries (past a sequence's last page) are never
    read; read ones must lie in [0, num_blocks); a page receiving new tokens must not be used by
    another sequence. Arguments that share memory with the caches mean their values as passed
    (read before the append); caches sharing an element are refused when appending
    (docs/README.md#arguments-that-share-memory).

    The caches are read in place, never copied: contiguous, the halves ``kv[:, 0]``/``kv[:, 1]``
    of one buffer, sliced or transposed views; layouts no page table can address are refused
    before anything is written (docs/README.md#kv-caches-and-their-memory-layout). Empty work
    (B, Sq or Hq = 0) returns empty results; new k/v are appended even when Sq = 0.

    Quantized caches (docs/math.md#quantized-kv-caches), value = stored × scale: torch
    ``float8_e4m3fn`` caches with ``k_scale``/``v_scale`` a float or float32 [Hkv] (or [B, Hkv]),
    new k/v stored as ``clamp(x / scale, ±448)``; int8 caches (NumPy or torch) with float32
    scales shaped like the cache without its last dim, one per token and kv head, which an
    append fills in place (``max|x| / 127``). q and out keep q's dtype (float32, bfloat16 or
    float16); the cache is widened as it is read, never copied.

    ``plan``: ``plan_kvcache(q, k_cache, k, cache_seqlens=..., block_table=...)``, made once per
    step, in place of ``cache_seqlens``, ``block_table`` and ``cache_batch_idx``: every layer's
    call then reads nothing back from the device and uploads nothing. Without one,
    ``cache_seqlens`` is required and the metadata is checked on the host each call (one device
    read and one upload on a GPU).
    """
    if plan is None and cache_seqlens is None:
        raise TypeError(
            "attention_kvcache needs cache_seqlens (an int or an int [B] of the tokens already "
            "in each cache row), or a plan from fastpe.plan_kvcache"
        )
    options = dict(
        k=k,
        v=v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved,
        causal=causal,
        scale=scale,
        alibi_slopes=alibi_slopes,
        window=window,
        softcap=softcap,
        sinks=sinks,
        return_lse=return_lse,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if plan is not None:
        options["plan"] = plan
    arrays = (q, k_cache, v_cache)
    graph = _torch_graph(*arrays, *options.values())
    # autograd would record an op that writes its caches: torch's graph only under compile
    if graph and not sys.modules["torch"].compiler.is_compiling():
        raise NotImplementedError(
            "attention_kvcache has no autograd support (an inference op that writes its "
            "caches); call it under torch.no_grad() or with inputs that do not require grad"
        )
    if graph and plan is not None:
        raise NotImplementedError(
            "attention_kvcache(plan=...) runs eagerly; under torch.compile pass cache_seqlens "
            "and block_table (or cache_batch_idx) instead of a plan"
        )
    return _route(AttentionKVCacheInputs, arrays, options, backend, graph=graph)


def plan_kvcache(q, k_cache, k=None, *, cache_seqlens, block_table=None, cache_batch_idx=None):
    """One step's KV-cache metadata, checked once, for every layer's
    ``attention_kvcache(q, k_cache, v_cache, k, v, plan=plan, ...)``
    (docs/integrations.md#one-plan-per-step).

    ``q``, ``k_cache`` and ``k`` are one layer's (only their shapes, strides and device are
    read: every layer that uses the plan must have the same shapes); ``cache_seqlens``,
    ``block_table`` and ``cache_batch_idx`` are ``attention_kvcache``'s and are checked as a call
    would check them, read once here (host arrays or lists cost nothing; device tensors one
    read). The plan keeps private host copies and uploads the tables the kernels index with
    (sequence lengths, page starts, where the new tokens go, fused RoPE's positions) to
    ``k_cache``'s device in one copy. Calls given the plan read nothing back and upload
    nothing. Changing the caller's arrays after planning does not change the plan: make a new
    one for the next step (a decode step's lengths grow by the appended tokens).
    """
    q = check_float_array("q", q, ndim=4)
    k_cache = _kv_quant.check_cache("k_cache", k_cache)  # float or quantized, as in the call
    new = 0
    if k is not None:
        new = check_float_array("k", k, ndim=4).shape[1]
    check_same_placement(
        {
            "q": q,
            "k_cache": k_cache,
            **{
                name: None if x is None or is_int_scalar(x) else _arrays.as_array(x)
                for name, x in (
                    ("cache_seqlens", cache_seqlens),
                    ("block_table", block_table),
                    ("cache_batch_idx", cache_batch_idx),
                )
            },
        }
    )
    return KVCachePlan(
        cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        batch=q.shape[0],
        seqlen_q=q.shape[1],
        new_tokens=new,
        num_blocks=k_cache.shape[0],
        block_size=k_cache.shape[1],
        rows_per_block=rows_per_block("k_cache", k_cache),
        device=plan_device(None, k_cache),
    )


OPS = (
    "sinusoidal_table",
    "rope_table",
    "apply_rope",
    "embed",
    "attention",
    "merge_attention",
    "attention_varlen",
    "attention_kvcache",
)


def explain(op, *args, **kwargs) -> dispatch.Explanation:
    """Which backend ``fastpe.<op>(*args, **kwargs)`` would run on and why the others would not.

    Validates the arguments exactly as the call would (bad input raises the same error) but runs
    no kernel. ``op`` is a name such as ``"attention"`` or the function itself.
    """
    name = op if isinstance(op, str) else getattr(op, "__name__", repr(op))
    if name not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    with dispatch.explaining():
        return globals()[name](*args, **kwargs)
