"""Validated inputs of the serving ops: packed variable-length attention and KV-cache attention.

Kept apart from ``_inputs.py`` (same conventions, same helpers). A step's metadata — sequence
boundaries (``cu_seqlens``), cache lengths, block tables — is checked on the host once, into a
plan (``VarlenPlan``, ``KVCachePlan``): every later index computation trusts it, so these checks
are what keeps the kernels inside their tensors. A plan holds the checked values as host int64
arrays (for the CPU backends and for sizing launches) and uploads what the GPU kernels index with
once per device, in one copy; every layer's call of that step then reuses both, with no device
read and no blocking copy (docs/integrations.md#one-plan-per-step). A call without a plan makes
its own: one read of device metadata and one upload per call on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fastpe import _arrays, _kv_quant
from fastpe._arrays import Placement
from fastpe._inputs import _AttentionGradients, _features, _Inputs
from fastpe._options import AttentionOptions, Positions, Rope, check_rope_tables
from fastpe._validate import (
    check_bool,
    check_float_array,
    check_int,
    check_int_array,
    check_range,
    check_same_placement,
    is_int_scalar,
)
from fastpe.backends._serving import rows_per_block


def _host_ints(name: str, x, *, ndim: int) -> np.ndarray:
    x = check_int_array(name, x, ndim=ndim)
    return _arrays.to_int64(x)


def check_cu_seqlens(name: str, cu, total: int | None) -> np.ndarray:
    """``cu`` int32/int64 [B + 1]: starts at 0, non-decreasing, ends at ``total`` (the packed
    length; None: a plan's, checked against each call's arrays). Returned as host int64."""
    cu_array = check_int_array(name, cu, ndim=1)
    if _arrays.dtype_name(cu_array) not in ("int32", "int64"):
        raise TypeError(f"{name} must be int32 or int64; got {_arrays.dtype_name(cu_array)}")
    values = _arrays.to_int64(cu_array)
    if values.shape[0] < 1:
        raise ValueError(f"{name} must have B + 1 >= 1 entries; got an empty array")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {int(values[0])}")
    steps = np.diff(values)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0)) + 1
        raise ValueError(
            f"{name} must be non-decreasing; got {name}[{at}] = {int(values[at])} < "
            f"{name}[{at - 1}] = {int(values[at - 1])}"
        )
    if total is not None and values[-1] != total:
        raise ValueError(
            f"{name} must end at the packed length {total}; got {name}[-1] = {int(values[-1])}"
        )
    return values


def _check_max_seqlen(name: str, value, lengths: np.ndarray) -> int:
    """The caller's bound on the sequence lengths (None: the longest). Kernels may size work
    by it (varlen key pages), so a bound above the packed total is stored as the total: it
    bounds every sequence just as well and keeps their index arithmetic small."""
    longest = int(lengths.max(initial=0))
    if value is None:
        return longest
    value = check_int(name, value, minimum=0)
    if value < longest:
        raise ValueError(
            f"{name} = {value} is smaller than the longest sequence ({longest}); pass at least "
            f"{longest} or None"
        )
    return min(value, int(lengths.sum()))


def check_plan(plan, kind, given: dict) -> None:
    """A plan replaces the metadata arguments it was made from: they must not be given too."""
    if not isinstance(plan, kind):
        raise TypeError(
            f"plan must be a {kind.__name__} (from fastpe.plan_{kind.op.removeprefix('attention_')})"
            f"; got {type(plan).__name__}"
        )
    passed = [name for name, value in given.items() if value is not None]
    if passed:
        raise ValueError(
            f"{', '.join(passed)} come from the plan; pass them to the plan, not with plan="
        )


def _default_positions(cu: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Per packed token: its index within its sequence plus that sequence's shift, clamped at 0."""
    lengths = np.diff(cu)
    index = np.arange(cu[-1]) - np.repeat(cu[:-1], lengths)
    return np.maximum(index + np.repeat(shift, lengths), 0)


def _check_dtype_and_dims(named: dict) -> str:
    dtypes = {name: _arrays.dtype_name(x) for name, x in named.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(named)} must share one dtype; got {listing}")
    return next(iter(dtypes.values()))


def _check_heads_and_dim(q, hq, k_name, hkv, d):
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"q heads ({hq}) must be a multiple of {k_name} heads ({hkv}) for "
            "grouped-query attention"
        )
    if d == 0:
        raise ValueError(f"head_dim must be >= 1; got q of shape {tuple(q.shape)}")


def _host_copy(values) -> np.ndarray:
    """A private, contiguous host int64 copy: a plan keeps the values it checked, whatever the
    caller later does to its own arrays."""
    return np.array(values, dtype=np.int64, copy=True, order="C")


class _Plan:
    """What both plans share: host int64 arrays, and their device copies made once per device.

    The arrays the GPU kernels index with are registered (``_register``) and uploaded together,
    in one host-to-device copy, the first time a device asks for them (at plan time when the
    plan knows its device); later calls find them in ``on_device``. Arrays derived later
    (fused RoPE's default positions, another cache layout's page starts) are uploaded once each
    when first needed."""

    def __init__(self, device):
        self.device = device  # the torch device its tables go to, or None (host only so far)
        self._registered: list[np.ndarray] = []
        self._on_device: dict = {}  # (device, id(host array)) -> tensor
        self._derived: dict = {}  # key -> host array computed on first need

    def _register(self, array: np.ndarray) -> np.ndarray:
        self._registered.append(array)
        return array

    def _derive(self, key, compute) -> np.ndarray:
        array = self._derived.get(key)
        if array is None:
            array = self._derived[key] = _host_copy(compute())
        return array

    def _upload(self) -> None:
        if self.device is not None:
            self.on_device(self._registered[0], self.device)

    def on_device(self, host: np.ndarray, device):
        """``host`` (one of this plan's arrays) as an int64 tensor on ``device``: uploaded with
        the plan's other tables at its first use on that device, then reused. An array the plan
        does not hold is uploaded now (a blocking copy; the plan-less path)."""
        import torch

        tensor = self._on_device.get((device, id(host)))
        if tensor is not None:
            return tensor
        if any(host is array for array in self._registered):
            flat = np.concatenate([array.reshape(-1) for array in self._registered])
            block = torch.from_numpy(flat).to(device)  # the plan's one upload
            start = 0
            for array in self._registered:
                view = block[start : start + array.size].view(array.shape)
                self._on_device[device, id(array)] = view
                start += array.size
            return self._on_device[device, id(host)]
        tensor = torch.from_numpy(np.ascontiguousarray(host, np.int64)).to(device)
        if any(host is array for array in self._derived.values()):
            self._on_device[device, id(host)] = tensor
        return tensor

    def _check_device(self, placement: Placement) -> None:
        if self.device is not None and placement.framework == "torch":
            if str(self.device) != placement.device:  # both as torch reports a tensor's
                raise ValueError(
                    f"the plan's tables are on {self.device}; this call's tensors are on "
                    f"{placement.device}: make the plan with tensors on that device"
                )


def plan_device(device, *arrays):
    """Where a plan's tables go: ``device`` if given, else the device of the first tensor among
    ``arrays`` (None: host data only; a GPU call then uploads them at its first use)."""
    if device is not None:
        import torch

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # as tensors report it
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    for x in arrays:
        if _arrays.is_tensor(x):
            return x.device
    return None


class VarlenPlan(_Plan):
    """One step's ``cu_seqlens_q``/``cu_seqlens_k`` and ``max_seqlen_*`` for every layer's
    ``attention_varlen`` call (``fastpe.plan_varlen``)."""

    op = "attention_varlen"

    def __init__(self, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, device):
        super().__init__(device)
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None)
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None)
        if cu_q.shape != cu_k.shape:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got "
                f"{cu_q.shape[0]} and {cu_k.shape[0]}"
            )
        self.cu_q, self.cu_k = _host_copy(cu_q), _host_copy(cu_k)
        # for the custom op of a call under autograd or compile, which takes the tensors
        self._derived.update(cu_q=self.cu_q, cu_k=self.cu_k)
        self.total_q, self.total_k = int(self.cu_q[-1]), int(self.cu_k[-1])
        self.batch = self.cu_q.shape[0] - 1
        self.q_len = self._register(np.diff(self.cu_q))
        self.k_len = self._register(np.diff(self.cu_k))
        self.q_start = self._register(_host_copy(self.cu_q[:-1]))
        self.page_start = self._register(_host_copy(self.cu_k[:-1, None]))
        self.max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, self.q_len)
        self.max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, self.k_len)
        self.longest_q = int(self.q_len.max(initial=0))
        self.longest_k = int(self.k_len.max(initial=0))
        self._upload()

    def default_positions(self, bottom_right: bool) -> tuple[np.ndarray, np.ndarray]:
        """Fused RoPE's default (query, key) positions: each token's index in its sequence, the
        queries' shifted to their aligned positions."""
        batch, q_len, k_len = self.batch, self.q_len, self.k_len
        shift = k_len - q_len if bottom_right else np.zeros(batch, np.int64)
        return (
            self._derive(("q", bottom_right), lambda: _default_positions(self.cu_q, shift)),
            self._derive("k", lambda: _default_positions(self.cu_k, np.zeros(batch, np.int64))),
        )

    def check_call(self, total_q: int, total_k: int, placement: Placement) -> None:
        for name, total, planned in (("q", total_q, self.total_q), ("k", total_k, self.total_k)):
            if total != planned:
                raise ValueError(
                    f"{name} has {total} packed rows; the plan's cu_seqlens_{name} end at "
                    f"{planned}: pass the plan made for this step"
                )
        self._check_device(placement)


class KVCachePlan(_Plan):
    """One decode (or prefill) step's cache lengths and block table for every layer's
    ``attention_kvcache`` call (``fastpe.plan_kvcache``): the checks of ``attention_kvcache``
    on them, done once, and the tables its kernels index with."""

    op = "attention_kvcache"

    def __init__(
        self,
        cache_seqlens,
        *,
        block_table,
        cache_batch_idx,
        batch: int,
        seqlen_q: int,
        new_tokens: int,
        num_blocks: int,
        block_size: int,
        rows_per_block: int | None,
        device,
    ):
        super().__init__(device)
        rows, width, new = num_blocks, block_size, new_tokens
        self.batch, self.seqlen_q, self.new_tokens = batch, seqlen_q, new
        self.num_blocks, self.block_size = rows, width
        self.paged = paged = block_table is not None
        if paged:
            if cache_batch_idx is not None:
                raise ValueError(
                    "cache_batch_idx selects rows of a contiguous cache; "
                    "with block_table pages are chosen by the table"
                )
            table = _host_ints("block_table", block_table, ndim=2)
            if table.shape[0] != batch:
                raise ValueError(
                    f"block_table must be [B, max_blocks] with B = {batch}; got {table.shape}"
                )
            capacity = table.shape[1] * width
        else:
            if cache_batch_idx is None:
                if rows < batch:
                    raise ValueError(
                        f"k_cache has {rows} rows for a batch of {batch}; pass cache_batch_idx "
                        "or a cache with at least B rows"
                    )
                table = np.arange(batch, dtype=np.int64)[:, None]
            else:
                index = _host_ints("cache_batch_idx", cache_batch_idx, ndim=1)
                if index.shape != (batch,):
                    raise ValueError(
                        f"cache_batch_idx must have shape [B] = [{batch}]; got {index.shape}"
                    )
                check_range("cache_batch_idx", index, 0, rows, what=f"(k_cache has {rows} rows)")
                table = index[:, None]
            capacity = width
        self.capacity = capacity
        lengths = _check_cache_seqlens(cache_seqlens, batch, capacity, new)
        total = lengths + new
        pages = -(-total // width)  # pages each sequence reads
        used = np.arange(table.shape[1])[None, :] < pages[:, None]
        if paged:
            bad = used & ((table < 0) | (table >= rows))
            if bad.any():
                b, p = (int(i) for i in np.argwhere(bad)[0])
                raise IndexError(
                    f"block_table contains {int(table[b, p])} at index [{b}, {p}], outside "
                    f"[0, {rows}) (k_cache has {rows} blocks); sequence {b} reads its first "
                    f"{int(pages[b])} blocks"
                )
        if new:
            _check_no_shared_written_pages(table, used, lengths, total, width, paged)
        self.cache_seqlens = _host_copy(lengths)
        self.page_table = _host_copy(table)
        # what the kernels index with, uploaded together
        self.seqlens = self._register(_host_copy(total))  # keys each query row sees
        self.longest_k = int(total.max(initial=0))
        self.q_start = self._register(np.arange(batch, dtype=np.int64) * seqlen_q)
        self.q_len = self._register(np.full(batch, seqlen_q, np.int64))
        if rows_per_block is not None:
            self._register(self.page_start(rows_per_block))

        # where the new tokens go and fused RoPE's positions (rotary needs k, even of 0 tokens;
        # uploaded with the rest only when there are tokens to append)
        def keep(name, values):
            if new:
                return self._register(_host_copy(values))
            return self._derive(name, lambda: values)

        pos = lengths[:, None] + np.arange(new)[None, :]
        page = pos // width
        block = np.take_along_axis(self.page_table, page, axis=1)
        self.written_block = keep("written_block", block)
        self.written_offset = keep("written_offset", pos - page * width)
        self.k_positions = keep("k_positions", pos)
        # fused RoPE's query positions: FlashAttention's two rules (see attention_kvcache)
        steps = lengths[:, None] + np.arange(seqlen_q)[None, :]
        self._q_positions = {
            True: keep("q_positions_steps", steps),
            False: keep("q_positions_first", np.repeat(lengths[:, None], seqlen_q, 1)),
        }
        self._upload()

    def page_start(self, rows_per_block: int) -> np.ndarray:
        """[B, pages]: the first row of each page in the caches' row views
        (backends/_serving.py), for caches whose blocks lie ``rows_per_block`` rows apart."""
        return self._derive(
            ("page_start", rows_per_block), lambda: self.page_table * rows_per_block
        )

    def q_positions(self, steps: bool) -> np.ndarray:
        """Fused RoPE's query positions [B, Sq]: ``cache_seqlens[b] + i`` (``steps``, with causal
        or a window) or all at ``cache_seqlens[b]`` (FlashAttention's rule otherwise)."""
        return self._q_positions[steps]

    def check_call(self, *, batch, seqlen_q, new_tokens, num_blocks, block_size, placement):
        given = (batch, seqlen_q, new_tokens, num_blocks, block_size)
        planned = (self.batch, self.seqlen_q, self.new_tokens, self.num_blocks, self.block_size)
        if given != planned:
            names = "(B, Sq, S_new, k_cache.shape[0], k_cache.shape[1])"
            raise ValueError(
                f"this call has {names} = {given}; the plan was made for {planned}: pass the "
                "plan made for this step's shapes"
            )
        self._check_device(placement)


@dataclass(frozen=True, eq=False)
class AttentionVarlenInputs(_Inputs):
    op: ClassVar[str] = "attention_varlen"
    q: Any  # [Tq, Hq, D]
    k: Any  # [Tk, Hkv, D]
    v: Any  # [Tk, Hkv, Dv]
    plan: VarlenPlan  # cu_seqlens and max_seqlen, checked (host int64) and on the device
    options: AttentionOptions  # fused RoPE's positions: host int64, one per packed token
    dtype: str
    placement: Placement

    @property
    def cu_q(self) -> np.ndarray:
        return self.plan.cu_q

    @property
    def cu_k(self) -> np.ndarray:
        return self.plan.cu_k

    @property
    def max_seqlen_q(self) -> int:
        return self.plan.max_seqlen_q

    @property
    def max_seqlen_k(self) -> int:
        return self.plan.max_seqlen_k

    @property
    def batch(self) -> int:
        return self.plan.batch

    @property
    def q_lengths(self) -> np.ndarray:
        return self.plan.q_len

    @property
    def k_lengths(self) -> np.ndarray:
        return self.plan.k_len

    @property
    def features(self) -> frozenset[str]:
        return self.options.features() | _features(
            gqa=self.q.shape[1] != self.k.shape[1],
            value_dim_differs=self.q.shape[2] != self.v.shape[2],
        )

    @classmethod
    def build(
        cls,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        *,
        max_seqlen_q,
        max_seqlen_k,
        plan=None,
        **options,
    ):
        """``options``: the public keywords of ``AttentionOptions.build``; ``plan`` a
        ``VarlenPlan`` in place of cu_seqlens and max_seqlen (None: made here, from them)."""
        q = check_float_array("q", q, ndim=3)
        k = check_float_array("k", k, ndim=3)
        v = check_float_array("v", v, ndim=3)
        dtype = _check_dtype_and_dims({"q": q, "k": k, "v": v})
        total_q, hq, d = q.shape
        total_k, hkv = k.shape[0], k.shape[1]
        if k.shape[2] != d:
            raise ValueError(f"k's head dim {k.shape[2]} must equal q's head dim {d}")
        if tuple(v.shape[:2]) != (total_k, hkv):
            raise ValueError(
                f"v must be [total_k, Hkv, Dv] matching k's {tuple(k.shape[:2])}; "
                f"got {tuple(v.shape)}"
            )
        _check_heads_and_dim(q, hq, "k/v", hkv, d)
        metadata = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
        if plan is None:
            # the one read of device metadata of a plan-less call
            plan = VarlenPlan(
                check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q),
                check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k),
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                device=None,
            )
            metadata = {name: _arrays.as_array(x) for name, x in metadata.items()}
        else:
            check_plan(
                plan,
                VarlenPlan,
                {**metadata, "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k},
            )
            metadata = {}
        batch = plan.batch

        def build_rope(value, options):
            q_default, k_default = plan.default_positions(options.bottom_right)
            return Rope.build_packed(value, head_dim=d, q_default=q_default, k_default=k_default)

        options = AttentionOptions.build(
            **options,
            head_dim=d,
            heads=hq,
            batch=batch,
            # a query and a key of one sequence are less than Sq + Sk positions apart
            span=plan.longest_q + plan.longest_k,
            build_rope=build_rope,
        )
        rope = options.rope
        placement = check_same_placement(
            {
                "q": q,
                "k": k,
                "v": v,
                **metadata,
                "rope['cos']": None if rope is None else rope.cos,
                "rope['sin']": None if rope is None else rope.sin,
                **options.arrays(),
            }
        )
        plan.check_call(total_q, total_k, placement)
        return cls(q=q, k=k, v=v, plan=plan, options=options, dtype=dtype, placement=placement)


@dataclass(frozen=True, eq=False)
class AttentionKVCacheInputs(_Inputs):
    """``flash_attn_with_kvcache``: queries [B, Sq, Hq, D] against a cache that is paged
    (k_cache [num_blocks, block_size, Hkv, D] + block_table) or contiguous ([Bc, S, Hkv, D],
    rows chosen by cache_batch_idx). Both are held as pages: a contiguous cache is one page of
    S rows per cache row, its "block table" is cache_batch_idx[:, None]."""

    op: ClassVar[str] = "attention_kvcache"
    q: Any  # [B, Sq, Hq, D]
    k_cache: Any
    v_cache: Any
    k: Any  # new keys [B, Sn, Hkv, D] or None
    v: Any
    plan: KVCachePlan  # cache_seqlens and the page table, checked (host int64) and on the device
    rows_per_block: int  # block stride in rows of the caches' row views (backends/_serving.py)
    # bottom-right aligned; fused RoPE (rotary_cos/sin) positions host int64 [B, Sq] and [B, Sn]
    options: AttentionOptions
    dtype: str
    placement: Placement
    quant: _kv_quant.KVQuant | None = None  # quantized caches: their kind and scales

    @property
    def cache_seqlens(self) -> np.ndarray:
        """Host int64 [B]: keys already in the cache."""
        return self.plan.cache_seqlens

    @property
    def page_table(self) -> np.ndarray:
        """Host int64 [B, pages]."""
        return self.plan.page_table

    @property
    def page_size(self) -> int:
        return self.plan.block_size

    @property
    def paged(self) -> bool:
        return self.plan.paged

    @property
    def new_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def seqlens(self) -> np.ndarray:
        """Keys each query row sees: the cache plus the appended tokens."""
        return self.plan.seqlens

    @property
    def features(self) -> frozenset[str]:
        return self.options.features() | _features(
            paged=self.paged,
            append=self.k is not None,
            gqa=self.q.shape[2] != self.k_cache.shape[2],
            value_dim_differs=self.q.shape[3] != self.v_cache.shape[3],
        )

    @classmethod
    def build(
        cls,
        q,
        k_cache,
        v_cache,
        *,
        k,
        v,
        cache_seqlens,
        block_table,
        cache_batch_idx,
        rotary_cos,
        rotary_sin,
        rotary_interleaved,
        plan=None,
        k_scale=None,
        v_scale=None,
        **options,
    ):
        """``options``: the public keywords of ``AttentionOptions.build`` but ``rope`` (here
        ``rotary_cos``, ``rotary_sin``, ``rotary_interleaved``); always bottom-right aligned.
        ``plan``: a ``KVCachePlan`` in place of cache_seqlens, block_table and cache_batch_idx
        (None: made here, from them)."""
        q = check_float_array("q", q, ndim=4)
        k_cache = _kv_quant.check_cache("k_cache", k_cache)
        v_cache = _kv_quant.check_cache("v_cache", v_cache)
        batch, sq, hq, d = q.shape
        rows, width, hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        if k_cache.shape[3] != d:
            raise ValueError(f"k_cache's head dim {k_cache.shape[3]} must equal q's head dim {d}")
        if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
            raise ValueError(
                f"v_cache must match k_cache's first three dims {tuple(k_cache.shape[:3])}; "
                f"got {tuple(v_cache.shape)}"
            )
        _check_heads_and_dim(q, hq, "k_cache", hkv, d)
        per_block = _check_cache_layouts(k_cache, v_cache)
        quant = _kv_quant.check(
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            batch=batch,
            per_block=per_block,
            appending=k is not None,
        )
        named = {"q": q} if quant else {"q": q, "k_cache": k_cache, "v_cache": v_cache}
        if (k is None) != (v is None):
            raise ValueError("k and v (new tokens to append) must be given together")
        if k is not None:
            k = check_float_array("k", k, ndim=4)
            v = check_float_array("v", v, ndim=4)
            if tuple(k.shape) != (batch, k.shape[1], hkv, d) or tuple(v.shape) != (
                *k.shape[:3],
                v_cache.shape[3],
            ):
                raise ValueError(
                    f"k must be [B, S_new, Hkv, D] = [{batch}, S_new, {hkv}, {d}] and v "
                    f"[B, S_new, Hkv, Dv]; got k {tuple(k.shape)}, v {tuple(v.shape)}"
                )
            named.update(k=k, v=v)
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not _arrays.is_tensor(cache) and not cache.flags.writeable:
                    raise ValueError(f"appending k/v writes into {name}; got a read-only array")
                if _arrays.may_overlap(cache):
                    raise ValueError(
                        f"appending k/v writes into {name}, whose elements share memory "
                        f"(strides {_arrays.strides(cache)}); pass a cache with distinct elements"
                    )
        dtype = _check_dtype_and_dims(named)
        new = 0 if k is None else k.shape[1]
        shapes = dict(batch=batch, seqlen_q=sq, new_tokens=new, num_blocks=rows, block_size=width)
        metadata = {
            "cache_seqlens": cache_seqlens,
            "block_table": block_table,
            "cache_batch_idx": cache_batch_idx,
        }
        if plan is None:
            # the one read of device metadata of a plan-less call
            plan = KVCachePlan(
                cache_seqlens,
                block_table=block_table,
                cache_batch_idx=cache_batch_idx,
                **shapes,
                rows_per_block=per_block,
                device=None,
            )
            metadata = {
                name: None if x is None or is_int_scalar(x) else _arrays.as_array(x)
                for name, x in metadata.items()
            }
        else:
            check_plan(plan, KVCachePlan, metadata)
            metadata = {}
        capacity = plan.capacity

        def build_rope(value, options):
            if k is None:
                raise ValueError(
                    "rotary_cos/rotary_sin rotate the new k and q at their cache positions; "
                    "they need k and v (keys already in the cache are stored rotated)"
                )
            cos, sin = check_rope_tables("rotary_", *value, d)
            k_positions = plan.k_positions
            # FlashAttention: without causal or a window every query at the first new position
            q_positions = plan.q_positions(options.causal or options.window is not None)
            needed = int(max(k_positions.max(initial=0), q_positions.max(initial=0))) + 1
            if needed > cos.shape[0]:
                raise IndexError(
                    f"rotary_cos/rotary_sin have {cos.shape[0]} rows; positions up to "
                    f"{needed - 1} are needed (cache_seqlens + new tokens)"
                )
            interleaved = check_bool("rotary_interleaved", rotary_interleaved)
            return Rope(cos, sin, interleaved, Positions(q_positions), Positions(k_positions))

        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin must be given together")
        options = AttentionOptions.build(
            **{"causal_alignment": "bottom_right", **options},
            rope=None if rotary_cos is None else (rotary_cos, rotary_sin),
            head_dim=d,
            heads=hq,
            batch=batch,
            # a query and a key of one sequence are less than Sq + capacity positions apart; a
            # window wider than that restricts nothing and counts as none (for the rotary rule)
            span=sq + capacity,
            build_rope=build_rope,
        )
        if k is not None:
            q, k, v, options = _read_before_the_append(
                k_cache, v_cache, q=q, k=k, v=v, options=options
            )
        rope = options.rope
        placement = check_same_placement(
            {
                **named,
                "rotary_cos": None if rope is None else rope.cos,
                "rotary_sin": None if rope is None else rope.sin,
                **metadata,
                **options.arrays(),
                **(quant.arrays() if quant else {}),
            }
        )
        plan.check_call(**shapes, placement=placement)
        return cls(
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            k=k,
            v=v,
            plan=plan,
            rows_per_block=per_block,
            options=options,
            dtype=dtype,
            placement=placement,
            quant=quant,
        )

    def written_rows(self):
        """(block, offset) host int64 index arrays [B, Sn] where the new tokens go."""
        return self.plan.written_block, self.plan.written_offset


def _check_cache_layouts(k_cache, v_cache) -> int:
    """Rows per block of the row views both caches are read through in place (one page table
    addresses both, so they must agree)."""
    per_k = rows_per_block("k_cache", k_cache)
    per_v = rows_per_block("v_cache", v_cache)
    if per_k != per_v:
        raise ValueError(
            f"k_cache and v_cache must place their blocks the same number of positions apart "
            f"to be read in place with one block table; got block strides of {per_k} (k_cache, "
            f"strides {_arrays.strides(k_cache)}) and {per_v} (v_cache, strides "
            f"{_arrays.strides(v_cache)}) positions; pass caches of one layout, e.g. both "
            f".contiguous(), made once and kept for every step"
        )
    return per_k


def _check_cache_seqlens(cache_seqlens, batch: int, capacity: int, new: int) -> np.ndarray:
    """Host int64 [B] lengths with ``0 <= length <= capacity - new``, compared in that form so
    that lengths near 2**63 cannot wrap past the check (``length + new`` would)."""
    if is_int_scalar(cache_seqlens):
        given = check_int("cache_seqlens", cache_seqlens)
        _check_cache_length("cache_seqlens", given, capacity, new)
        return np.full(batch, given, np.int64)
    lengths = _host_ints("cache_seqlens", cache_seqlens, ndim=1)
    if lengths.shape != (batch,):
        raise ValueError(
            f"cache_seqlens must be an int or have shape [B] = [{batch}]; got {lengths.shape}"
        )
    bad = (lengths < 0) | (lengths > capacity - new)
    if bad.any():
        b = int(np.argmax(bad))
        _check_cache_length(f"cache_seqlens[{b}]", int(lengths[b]), capacity, new)
    return lengths


def _check_cache_length(name: str, length: int, capacity: int, new: int) -> None:
    accepted = f"cache_seqlens must be >= 0 and <= {capacity - new}"
    if length < 0:
        raise ValueError(f"{name} = {length}; {accepted}")
    if length > capacity - new:
        raise ValueError(
            f"{name} = {length} plus {new} new tokens needs {length + new} cache positions; "
            f"the cache holds {capacity} per sequence ({accepted})"
        )


def _check_no_shared_written_pages(table, used, lengths, total, page_size, paged) -> None:
    """A page (cache row) that receives new tokens must belong to one sequence only: another
    sequence reading or writing it would see, or race with, the write."""
    blocks, counts = np.unique(table[used], return_counts=True)
    shared = blocks[counts > 1]
    if not shared.size:
        return
    what = "block_table block" if paged else "cache row (cache_batch_idx)"
    pages = np.arange(table.shape[1])[None, :]
    written = (pages >= (lengths // page_size)[:, None]) & (
        pages <= ((total - 1) // page_size)[:, None]
    )
    written &= (total > lengths)[:, None]
    clash = written & np.isin(table, shared)
    if clash.any():
        b, p = (int(i) for i in np.argwhere(clash)[0])
        block = int(table[b, p])
        users = sorted({int(i) for i in np.argwhere(used & (table == block))[:, 0]})
        raise ValueError(
            f"{what} {block} receives new tokens of sequence {b} but is also read by "
            f"sequences {users} (or twice by one); pages that are appended to must not be shared"
        )


def _read_before_the_append(k_cache, v_cache, *, options, **read):
    """Every argument means its values as passed, read before the append writes into the
    caches (FlashAttention's order: q and the new k/v are read, then stored): one that shares
    memory with a cache is replaced by a private copy, taken here before anything is written,
    so no backend reads a value the append has changed (the plan's cache_seqlens and page table
    are private host copies already). Two caches that share an element have no meaning for an append (which of k and v
    lands there?): refused. Returns the read arguments in order, then ``options`` with its
    arrays (and fused RoPE's tables) read alike."""
    caches = [_arrays.byte_bounds(c) for c in (k_cache, v_cache)]
    if _arrays.bounds_overlap(*caches) and _arrays.shares_element(k_cache, v_cache):
        raise ValueError(
            f"k_cache and v_cache share memory (shapes {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}, strides {_arrays.strides(k_cache)} and "
            f"{_arrays.strides(v_cache)}), and appending k/v writes into both; pass separate "
            "caches (or views of one buffer that share no element), or append nothing"
        )

    def private(x):
        # the conservative address-range test: copying a small argument that shares nothing is
        # harmless, missing one that does is not
        if x is None:
            return x
        bounds = _arrays.byte_bounds(x)
        if _arrays.bounds_overlap(bounds, caches[0]) or _arrays.bounds_overlap(bounds, caches[1]):
            return _arrays.private_copy(x)
        return x

    options = options._replace(**{name: private(x) for name, x in options.arrays().items()})
    if options.rope is not None:
        rope = options.rope
        options = options._replace(rope=rope._replace(cos=private(rope.cos), sin=private(rope.sin)))
    return (*(private(x) for x in read.values()), options)


@dataclass(frozen=True, eq=False)
class AttentionVarlenBackwardInputs(_AttentionGradients):
    """The gradients of one attention_varlen call (docs/math.md#packed-variable-length-backward):
    grad_out, out [Tq, Hq, Dv]; grad_lse, lse [Hq, Tq]."""

    op: ClassVar[str] = "attention_varlen_backward"

    @classmethod
    def build(cls, forward: AttentionVarlenInputs, *, grad_out, grad_lse, out, lse):
        # shapes are checked per sequence, by the attention_backward records the backward builds
        return cls(
            forward=forward,
            grad_out=grad_out,
            grad_lse=grad_lse,
            out=out,
            lse=lse,
            dtype=forward.dtype,
            placement=forward.placement,
        )
