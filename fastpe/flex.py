"""``fastpe.flex_attention`` and ``fastpe.create_block_mask``: torch FlexAttention's API with the
user's ``score_mod`` / ``mask_mod`` compiled into fastpe's kernels (docs/flex-attention.md).

Each call captures the modifiers (``_flex_expr.capture``: a trace on symbolic arguments, cheap),
reads the captured tensors' current values, and runs the variant's kernels: the Numba module
generated for the expressions' structure (``fastpe.kernels.numba.flex_attention``; compiled once
and cached on disk), the Triton steps generated from them (``_flex_triton``; CUDA tensors), or
the float64 oracle (``_flex_reference``) with ``backend="numpy"``.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

from fastpe import _arrays, _flex_expr, _flex_reference, dispatch
from fastpe._flex_expr import CaptureError

__all__ = ["BlockMask", "CaptureError", "create_block_mask", "flex_attention"]

_DEFAULT_BLOCK = 128
_NO_MASK_BLOCKS = (128, 256)  # tiles of a call without a block mask: the dense kernel's


def _torch():
    return sys.modules.get("torch")


def _to_numpy(x, *, wide=False):
    """A NumPy view or copy of a tensor or array (half types widened to float32; ``wide``:
    float64 for floats, int64 for integers)."""
    if _arrays.is_tensor(x):
        torch = _torch()
        x = x.detach()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        x = x.cpu().numpy()
    x = np.asarray(x)
    if wide:
        if x.dtype.kind == "f":
            x = x.astype(np.float64, copy=False)
        elif x.dtype.kind in "iu":
            x = x.astype(np.int64, copy=False)
    return x


# --------------------------------------------------------------------------- block masks


def _block_sizes(BLOCK_SIZE):
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or not all(isinstance(n, int) and n > 0 for n in sizes):
        raise ValueError(
            f"BLOCK_SIZE must be a positive int or a (query, key) pair of them; got {BLOCK_SIZE!r}"
        )
    return sizes


def _lists_from_states(state):
    """torch's layout of block states [..., n]: (num_blocks int32 [...], indices int32 [..., n])
    of the partial blocks (state 1) and of the full ones (state 2), each in ascending order."""
    result = []
    for wanted in (1, 2):
        hit = state == wanted
        order = np.argsort(~hit, axis=-1, kind="stable").astype(np.int32)
        result += [hit.sum(axis=-1).astype(np.int32), order]
    return result


def _states_from_lists(num, indices, n):
    num, indices = _to_numpy(num).astype(np.int64), _to_numpy(indices).astype(np.int64)
    dense = np.zeros((*num.shape, n), dtype=bool)
    valid = np.arange(indices.shape[-1]) < num[..., None]
    lead = np.nonzero(valid)
    dense[(*lead[:-1], indices[valid])] = True
    return dense


class BlockMask:
    """Which (query block, key block) tiles of attention are visible, as torch's BlockMask:
    ``kv_num_blocks`` / ``kv_indices`` the partial blocks of each query block (their mask_mod
    is evaluated), ``full_kv_num_blocks`` / ``full_kv_indices`` the fully visible ones, and the
    transposed ``q_*`` lists, all int32 NumPy arrays [B, H, blocks(, blocks)]; ``BLOCK_SIZE``
    (query, key), ``seq_lengths`` (Q_LEN, KV_LEN), ``mask_mod``. Made by ``create_block_mask``;
    ``from_torch`` converts torch's own."""

    def __init__(self, state, seq_lengths, BLOCK_SIZE, mask_mod):
        self._state = np.ascontiguousarray(state, dtype=np.int8)
        self.seq_lengths = tuple(seq_lengths)
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = mask_mod
        (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices) = (
            _lists_from_states(self._state)
        )
        (self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices) = (
            _lists_from_states(self._state.swapaxes(-1, -2))
        )

    @classmethod
    def from_torch(cls, block_mask):
        """fastpe's BlockMask of a ``torch.nn.attention.flex_attention.BlockMask``."""
        nk = block_mask.kv_indices.shape[-1]
        state = _states_from_lists(block_mask.kv_num_blocks, block_mask.kv_indices, nk).astype(
            np.int8
        )
        if block_mask.full_kv_num_blocks is not None:
            full = _states_from_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
            state[full] = 2
        return cls(state, block_mask.seq_lengths, block_mask.BLOCK_SIZE, block_mask.mask_mod)

    @property
    def shape(self):
        """(B, H, Q_LEN, KV_LEN) as in torch (B and H are 1 where broadcast)."""
        return (*self._state.shape[:2], *self.seq_lengths)

    def to_dense(self):
        """Visible blocks as int32 [B, H, query blocks, key blocks] (partial or full)."""
        return (self._state > 0).astype(np.int32)

    def sparsity(self) -> float:
        """Percentage of blocks skipped."""
        return 100.0 * float(np.mean(self._state == 0)) if self._state.size else 0.0

    def __repr__(self):
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
            f"sparsity={self.sparsity():.2f}%, mask_mod={getattr(self.mask_mod, '__name__', None)})"
        )


def _mask_states(mask_node, arrays, batch, heads, q_len, kv_len, blocks):
    """Block states [batch, heads, nq, nk] of a captured mask: 2 where every element of the
    block holds, 1 where some does, 0 where none does (as torch, a block cut short by the end
    of the sequence is never full); evaluated a band of query blocks at a
    time (the oracle's evaluation), so memory stays near 16M elements."""
    qb, kb = blocks
    nq, nk = -(-q_len // qb), -(-kv_len // kb)
    state = np.zeros((batch, heads, nq, nk), dtype=np.int8)
    band = max(1, (1 << 24) // max(1, batch * heads * qb * kv_len))
    grid = _flex_reference._grid(batch, heads, q_len, kv_len)
    for first in range(0, nq, band):
        rows = np.arange(first * qb, min((first + band) * qb, q_len))
        env = dict(grid, q_idx=rows.reshape(1, 1, -1, 1))
        keep = _flex_expr.evaluate(mask_node, env, arrays)
        keep = np.broadcast_to(keep, (batch, heads, len(rows), kv_len))
        pad_q, pad_k = -len(rows) % qb, -kv_len % kb
        seen = np.pad(keep, ((0, 0), (0, 0), (0, pad_q), (0, pad_k)), constant_values=False)
        shape = (batch, heads, seen.shape[2] // qb, qb, nk, kb)
        any_seen = seen.reshape(shape).any(axis=(3, 5))
        all_full = seen.reshape(shape).all(axis=(3, 5))
        state[:, :, first : first + any_seen.shape[2]] = np.where(
            all_full, 2, np.where(any_seen, 1, 0)
        )
    return state


def _uses(node, leaf) -> bool:
    return any(n.op == leaf for n in _flex_expr.nodes_in_order(node))


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=_DEFAULT_BLOCK):
    """The ``BlockMask`` of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for B batches and H heads
    (None: the mask does not depend on it; broadcast), Q_LEN queries and KV_LEN keys, in blocks
    of BLOCK_SIZE (an int, or (query, key)). Computed once; pass it to every call (and layer)
    that uses this mask. ``device`` is accepted for torch's signature: fastpe's masks are CPU
    data, uploaded to a call's device when it first uses them."""
    for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int; got {value!r}")
    for name, value in (("B", B), ("H", H)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name} must be a positive int or None (broadcast); got {value!r}")
    blocks = _block_sizes(BLOCK_SIZE)
    captured = _flex_expr.capture(mask_mod, "mask_mod")
    arrays = [_to_numpy(a, wide=True) for a in captured.arrays]
    state = _mask_states(captured.node, arrays, B or 1, H or 1, int(Q_LEN), int(KV_LEN), blocks)
    return BlockMask(state, (int(Q_LEN), int(KV_LEN)), blocks, mask_mod)


# --------------------------------------------------------------------------- the call


def _backend_for(query, backend):
    """The backend of a call: "numba" (CPU default), "numpy" or "triton" (CUDA default; CPU
    tensors under TRITON_INTERPRET=1), with a clear error where it cannot take the inputs."""
    on_device = _arrays.is_tensor(query) and query.device.type != "cpu"
    name = dispatch.requested_backend(backend) or ("triton" if on_device else "numba")
    if name not in ("numba", "numpy", "triton"):
        raise dispatch.BackendNotSupportedError(
            f"backend {name!r} cannot run flex_attention: it runs on 'numba' (CPU kernels), "
            "'triton' (GPU kernels) or 'numpy' (the float64 oracle)"
        )
    if name != "triton":
        if on_device:
            raise dispatch.BackendNotSupportedError(
                f"backend {name!r} runs flex_attention on CPU tensors; these are on "
                f"{query.device}: use backend='triton' (the default there) or move them to the CPU"
            )
        return name
    from fastpe.backends import triton as triton_backend

    why = triton_backend.unavailable_reason()
    if why is None and not _arrays.is_tensor(query):
        why = "it takes torch tensors, not NumPy arrays"
    if why is None and query.device.type not in ("cuda", "cpu"):
        why = f"it runs on CUDA tensors; these are on {query.device}"
    if why is None and query.device.type == "cpu" and not triton_backend.interpreted():
        why = "CPU tensors run under TRITON_INTERPRET=1 only: move the tensors to a GPU"
    if why is None and query.dtype == _torch().float64:
        why = "its kernels compute in float32: use backend='numba' or 'numpy' for float64"
    if why is not None:
        raise dispatch.BackendNotSupportedError(
            f"backend 'triton' cannot run flex_attention here: {why}"
        )
    return name


class _Call:
    """One flex_attention call's captured variant, captured values and tile plan.
    ``grad_caps``: the numbers of the captured arrays whose gradient the backward gives."""

    def __init__(self, score, mask, arrays, state, blocks, scale, backend, grad_caps=()):
        self.score, self.mask, self.arrays = score, mask, arrays
        self.state, self.blocks, self.scale, self.backend = state, blocks, scale, backend
        self.grad_caps = tuple(grad_caps)

    def forward_triton(self, q, k, v):
        """(out in q's dtype, lse fp32) on the Triton kernels (torch tensors)."""
        from fastpe import _flex_triton

        return _flex_triton.forward(self, q, k, v)

    def backward_triton(self, q, k, v, out, lse, grad_out, grad_lse):
        from fastpe import _flex_triton

        return _flex_triton.backward(self, q, k, v, out, lse, grad_out, grad_lse)

    def _oracle_args(self):
        return self.scale, self.score, self.mask, self.state, self.blocks, self.arrays

    def _kernel(self, hkv, reads=()):
        from fastpe.kernels.numba import flex_attention as kernels

        module = _variant_module(self.score, self.mask, reads)
        forward, backward = kernels.plan_tiles(self.state, hkv)
        caps = tuple(np.ascontiguousarray(a if a.ndim else a.reshape(1)) for a in self.arrays)
        return kernels, module, forward, backward, caps

    def forward(self, q, k, v):
        """(out, lse) as NumPy in the compute dtype (float64 for float64 inputs, else float32)."""
        dtype = np.float64 if q.dtype == np.float64 else np.float32
        if self.backend == "numpy":
            out, lse = _flex_reference.flex_attention(q, k, v, *self._oracle_args())
            return out.astype(dtype), lse.astype(dtype)
        kernels, module, plan, _, caps = self._kernel(k.shape[1])
        if q.dtype.kind == "f":  # half-precision bits go as they are: widened tile by tile
            q, k, v = (a.astype(dtype, copy=False) for a in (q, k, v))
        out, lse = kernels.flex_forward_numba(module, q, k, v, caps, plan, self.blocks, self.scale)
        return out, lse.astype(dtype, copy=False)

    def backward(self, q, k, v, out, lse, grad_out, grad_lse):
        """(dq, dk, dv) in the compute dtype, and the float64 gradient of each captured array
        numbered in ``grad_caps`` (its shape)."""
        dtype = np.float64 if q.dtype == np.float64 else np.float32
        if self.backend == "numpy":
            dq, dk, dv, *captured = _flex_reference.flex_attention_backward(
                q, k, v, grad_out, grad_lse, *self._oracle_args(), self.grad_caps
            )
            return (dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)), captured
        reads = _flex_expr.trained_reads(self.score, self.grad_caps) if self.grad_caps else ()
        kernels, module, _, plan, caps = self._kernel(k.shape[1], reads)
        q, k, v = (a.astype(dtype, copy=False) for a in (q, k, v))
        sizes = [caps[number].size for number in self.grad_caps]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        read_offsets = np.array(
            [starts[self.grad_caps.index(read.args[0].args[0])] for read in reads], np.int64
        )
        dq, dk, dv, flat = kernels.flex_backward_numba(
            module, q, k, v, out, lse, grad_out, grad_lse, caps, plan, self.blocks, self.scale,
            read_offsets if reads else None, int(starts[-1]),
        )  # fmt: skip
        captured = [
            (np.zeros(int(starts[-1])) if flat is None else flat)[start : start + size].reshape(
                self.arrays[number].shape
            )
            for number, start, size in zip(self.grad_caps, starts[:-1], sizes, strict=True)
        ]
        return (dq, dk, dv), captured


_variants: dict = {}
_variants_lock = threading.Lock()


def _variant_module(score, mask, reads=()):
    """The Numba module of an expression pair (generated and loaded once per process), whose
    backward also differentiates the captured-array ``reads`` (index nodes of ``score``): a
    module of its own, used for the backward only, so a call without captured gradients
    compiles nothing more."""
    key = (score, mask, reads)
    module = _variants.get(key)
    if module is not None:
        return module
    from fastpe.kernels.numba import flex_attention as kernels

    source = kernels.module_source(*_variant_steps(score, mask, reads))
    with _variants_lock:
        module = _variants.setdefault(key, kernels.load_variant(source))
    return module


def _variant_steps(score, mask, reads=()):
    """The generated steps of ``kernels.module_source`` for the expressions (the backward
    steps also give ∂score/∂read and the position of each of ``reads``)."""
    derivative = None
    if score is not None:
        derivative = _flex_expr.derivative(score) or _flex_expr.const(0.0)
    has_derivative = derivative is not None and derivative != _flex_expr.ONE
    read_roots = _flex_expr.read_gradient_roots(score, reads)
    steps = {}
    for prefix, grad in (("", None), ("backward_", derivative if has_derivative else None)):
        for kind, keep in (("full", None), ("partial", mask)):
            roots = {}
            if score is not None:
                roots["value"] = score
            if keep is not None:
                roots["keep"] = keep
            if grad is not None:
                roots["grad"] = grad
            if prefix:
                roots.update(read_roots)
            statements = _flex_expr.numba_statements(roots)
            name = f"_{kind}_{prefix}step"
            steps[name] = (
                statements, score is not None, keep is not None, grad is not None,
                len(reads) if prefix else 0,
            )  # fmt: skip
    per_row = [
        not any(n.op in ("kv_idx", "score") for n in _flex_expr.nodes_in_order(read))
        for read in reads
    ]
    return steps, score is not None, has_derivative, per_row


def _check_qkv(query, key, value, enable_gqa):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D]; got shape {tuple(x.shape)}")
    (batch, hq, _, d), (bk, hkv, sk, dk), (bv, hv, sv, _) = query.shape, key.shape, value.shape
    if not batch == bk == bv:
        raise ValueError(
            f"query, key and value must have one batch size; got {batch}, {bk} and {bv}"
        )
    if (hkv, sk) != (hv, sv):
        raise ValueError(
            f"key [B, Hkv, Sk, D] and value [B, Hkv, Sk, Dv] must agree on Hkv and Sk; got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if d != dk:
        raise ValueError(f"query and key must have one head dim; got {d} and {dk}")
    if hq != hkv and not enable_gqa:
        raise ValueError(
            f"query has {hq} heads and key/value {hkv}: set enable_gqa=True for grouped-query "
            "attention"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")


def _plan_state(block_mask, mask_node, arrays, batch, hq, sq, sk):
    """(block states [Bm, Hm, nq, nk], (query block, key block)) for the call."""
    if block_mask is None:
        if mask_node is None:
            blocks = _NO_MASK_BLOCKS
            return np.full((1, 1, -(-sq // blocks[0]), -(-sk // blocks[1])), 2, np.int8), blocks
        blocks = (_DEFAULT_BLOCK, _DEFAULT_BLOCK)
        batches = batch if _uses(mask_node, "b") else 1
        heads = hq if _uses(mask_node, "h") else 1
        return _mask_states(mask_node, arrays, batches, heads, sq, sk, blocks), blocks
    state, blocks = block_mask._state, block_mask.BLOCK_SIZE
    nq, nk = -(-sq // blocks[0]), -(-sk // blocks[1])
    bm, hm = state.shape[:2]
    if bm not in (1, batch) or hm not in (1, hq):
        raise ValueError(
            f"block_mask was made for B={bm}, H={hm}; this call has B={batch}, H={hq} (a mask "
            "made with B or H None broadcasts)"
        )
    if state.shape[2] < nq or state.shape[3] < nk:
        raise ValueError(
            f"block_mask covers {block_mask.seq_lengths[0]} queries and "
            f"{block_mask.seq_lengths[1]} keys; this call has {sq} and {sk}: make it with "
            "create_block_mask(..., Q_LEN, KV_LEN) of at least these lengths"
        )
    return np.ascontiguousarray(state[:, :, :nq, :nk]), blocks


def flex_attention(
    query,
    key,
    value,
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    *,
    mask_mod=None,
    backend=None,
):
    """Attention with a user-defined ``score_mod(score, b, h, q_idx, kv_idx)`` and a block mask
    (``create_block_mask``): torch's ``flex_attention`` on fastpe's kernels.

    query [B, Hq, Sq, D], key [B, Hkv, Sk, D], value [B, Hkv, Sk, Dv] (torch tensors or NumPy
    arrays; Hq ≠ Hkv needs ``enable_gqa=True``) -> out [B, Hq, Sq, Dv], and with
    ``return_lse=True`` (out, lse [B, Hq, Sq], natural log). ``scale`` defaults to 1/√D. A
    query that sees no key gives 0 and lse -inf. ``mask_mod=`` (fastpe's addition) takes a
    mask function directly, its block mask computed at every call; ``backend`` "numba"
    (the default on the CPU), "triton" (the default for CUDA tensors) or "numpy" (the float64
    oracle). docs/flex-attention.md lists what the
    modifiers may use.
    """
    torch = _torch()
    if torch is not None and torch.compiler.is_compiling():
        # Dynamo cannot trace the capture or the NumPy kernels: one graph break, run eagerly
        return _eager_flex_attention()(
            query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
            mask_mod=mask_mod, backend=backend,
        )  # fmt: skip
    name = _backend_for(query, backend)
    _check_qkv(query, key, value, enable_gqa)
    batch, hq, sq, d = query.shape
    sk = key.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    scale = float(scale)
    if block_mask is not None and mask_mod is not None:
        raise ValueError("pass block_mask or mask_mod, not both (a block mask holds its mask_mod)")
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        if type(block_mask).__name__ != "BlockMask":
            raise TypeError(
                f"block_mask must be a BlockMask from create_block_mask; got "
                f"{type(block_mask).__name__}"
            )
        block_mask = BlockMask.from_torch(block_mask)
    arrays = []
    score = mask = None
    if score_mod is not None:
        captured = _flex_expr.capture(score_mod, "score_mod")
        score, arrays = captured.node, list(captured.arrays)
    grad_caps = _captured_grads(arrays)
    mask_func = block_mask.mask_mod if block_mask is not None else mask_mod
    if mask_func is not None and not _is_noop(mask_func):
        captured = _flex_expr.capture(mask_func, "mask_mod")
        mask = _flex_expr.renumber(captured, len(arrays))
        arrays += captured.arrays
    # (the Triton path reads the captured tensors on the device; on the host only to make a
    # block mask from mask_mod=)
    host = name != "triton" or (block_mask is None and mask is not None)
    arrays_np = [_to_numpy(a, wide=name == "numpy") for a in arrays] if host else []
    state, blocks = _plan_state(block_mask, mask, arrays_np, batch, hq, sq, key.shape[2])
    if name == "triton":
        from fastpe import _flex_triton

        arrays_np = _flex_triton.device_arrays(arrays, query.device)
    call = _Call(score, mask, arrays_np, state, blocks, scale, name, grad_caps)
    del sk
    if _arrays.is_tensor(query):
        out, lse = _torch_call(call, query, key, value, [arrays[n] for n in grad_caps])
    else:
        out, lse = call.forward(*(_to_numpy(x) for x in (query, key, value)))
        out = out.astype(np.result_type(query.dtype, np.float32), copy=False)
    return (out, lse) if return_lse else out


_eager = None


def _eager_flex_attention():
    """flex_attention behind ``torch.compiler.disable``: what a compiled graph calls."""
    global _eager
    if _eager is None:
        _eager = _torch().compiler.disable(flex_attention, recursive=True)
    return _eager


def _is_noop(func) -> bool:
    """torch's default mask (every key visible)."""
    return getattr(func, "__name__", "") == "noop_mask"


def _captured_grads(arrays) -> tuple:
    """The numbers of the tensors captured by score_mod that require grad (when autograd
    records): the backward gives their gradients."""
    torch = _torch()
    if torch is None or not torch.is_grad_enabled():
        return ()
    return tuple(i for i, a in enumerate(arrays) if isinstance(a, torch.Tensor) and a.requires_grad)


def _torch_call(call, query, key, value, captured):
    """``captured``: the tensors numbered ``call.grad_caps`` (autograd inputs)."""
    torch = _torch()
    needs_grad = torch.is_grad_enabled() and (
        any(x.requires_grad for x in (query, key, value)) or captured
    )
    if needs_grad:
        return _flex_function().apply(query, key, value, call, *captured)
    return _torch_forward(call, query, key, value)


def _torch_forward(call, query, key, value):
    torch = _torch()
    if call.backend == "triton":
        return call.forward_triton(query, key, value)
    if call.backend == "numba" and query.dtype in (torch.bfloat16, torch.float16):
        # the kernels widen half-precision bits tile by tile: no float32 copies of q, k, v
        inputs = (_arrays.to_host_bits(x, np.float32) for x in (query, key, value))
    else:
        inputs = (_to_numpy(x) for x in (query, key, value))
    out, lse = call.forward(*inputs)
    out = torch.from_numpy(out).to(query.dtype)
    lse = torch.from_numpy(lse)
    if query.dtype in (torch.bfloat16, torch.float16):
        lse = lse.float()
    return out, lse


_function = None


def _flex_function():
    """The autograd Function (defined on first use: ``import fastpe`` does not import torch)."""
    global _function
    if _function is not None:
        return _function
    torch = _torch()

    class FlexAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value, call, *captured):
            out, lse = _torch_forward(call, query, key, value)
            ctx.captured = [(c.dtype, c.requires_grad) for c in captured]
            ctx.call = call
            ctx.save_for_backward(query, key, value, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            query, key, value, out, lse = ctx.saved_tensors
            call = ctx.call
            if call.backend == "triton":
                grads, captured = call.backward_triton(
                    query, key, value, out, lse, grad_out, grad_lse
                )
            else:
                dtype = np.float64 if query.dtype == torch.float64 else np.float32
                grads, captured = call.backward(
                    *(_to_numpy(x) for x in (query, key, value)),
                    _to_numpy(out).astype(dtype),
                    _to_numpy(lse).astype(dtype),
                    np.zeros(out.shape, dtype) if grad_out is None else _to_numpy(grad_out),
                    None if grad_lse is None else _to_numpy(grad_lse).astype(dtype),
                )
                grads = [torch.from_numpy(np.ascontiguousarray(g)) for g in grads]
                captured = [torch.from_numpy(np.ascontiguousarray(g)) for g in captured]
            results = [g.to(x.dtype) if x.requires_grad else None
                       for g, x in zip(grads, (query, key, value), strict=True)]  # fmt: skip
            results += [g.to(kind) if needed else None
                        for g, (kind, needed) in zip(captured, ctx.captured, strict=True)]  # fmt: skip
            return (*results[:3], None, *results[3:])

    _function = FlexAttentionFunction
    return _function
