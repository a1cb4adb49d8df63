"""What every backend module builds on: the ``Implementation`` of one op with its capability
table, the one way an op writes into a caller's array (``inplace=True``), and the default
implementations a backend may replace with a kernel (``AttentionVarlenBackward``)."""

from __future__ import annotations

from typing import ClassVar

from fastpe import _arrays

ALL_FLOAT = frozenset(_arrays.FLOAT_DTYPES)


class Implementation:
    """One backend's implementation of one op, described by a capability table.

    ``not_supported_reasons(inputs)`` is the only thing the dispatcher asks before running it:
    an empty list means "can run"; each reason is a short phrase shown to the user.
    """

    backend: ClassVar[str]
    op: ClassVar[str]
    frameworks: ClassVar[frozenset[str]] = frozenset({"numpy", "torch"})
    device_types: ClassVar[frozenset[str]] = frozenset({"cpu"})
    dtypes: ClassVar[frozenset[str]] = frozenset({"float32", "float64"})
    unsupported_features: ClassVar[frozenset[str]] = frozenset()

    def unavailable_reason(self) -> str | None:
        """Why this implementation's backend cannot run at all here (set by each backend)."""
        return None

    def not_supported_reasons(self, inputs) -> list[str]:
        unavailable = self.unavailable_reason()
        if unavailable:
            return [unavailable]
        reasons = []
        where = inputs.placement
        if where.framework not in self.frameworks:
            reasons.append(f"takes {' or '.join(sorted(self.frameworks))} inputs, not {where}")
        elif where.device_type not in self.device_types:
            reasons.append(
                f"runs on {'/'.join(sorted(self.device_types))} devices, not {where.device_type}"
            )
        if inputs.dtype not in self.dtypes:
            reasons.append(f"supports dtypes {sorted(self.dtypes)}, not {inputs.dtype}")
        for feature in sorted(inputs.features & self.unsupported_features):
            reasons.append(f"does not support {feature}")
        return reasons + self.extra_reasons(inputs)

    def extra_reasons(self, inputs) -> list[str]:
        """Op-specific limits beyond the table (head dims, sizes)."""
        return []

    def run(self, inputs):
        raise NotImplementedError

    def run_group(self, group) -> tuple:
        """Several records of this op; kernels that can take them in one launch override this."""
        return tuple(self.run(inputs) for inputs in group)


def write_inplace(x, result):
    """Copy ``result`` into the caller's ``x`` (the only way fastpe modifies an input)."""
    if _arrays.is_tensor(x):
        x.copy_(result)
    else:
        x[...] = result
    return x


def host_option_grads(inp, dsinks, dtable) -> tuple:
    """attention_backward's gradients of the sinks and of the T5 bias table, computed on the
    host (float64 or float32 arrays, or None), as the caller's arrays in those inputs' dtypes."""
    fwd = inp.forward
    bias = fwd.relative_bias
    return tuple(
        None if grad is None else _arrays.from_float64(grad, inp.placement, _arrays.dtype_name(of))
        for grad, of in (
            (dsinks, fwd.options.sinks),
            (dtable, None if bias is None else bias.table),
        )
    )


class AttentionVarlenBackward(Implementation):
    """attention_varlen's backward (docs/math.md#packed-variable-length-backward), by default
    this backend's own ``attention_backward`` once per sequence, on [1, H, S_b, D] copies of the
    packed tensors (no padding), written back into packed gradients. A backend with a packed
    kernel overrides ``run`` (and its capability table) in its subclass.

    Each backend module defines its subclass, so the dispatcher chooses the backend
    as for any op; the default can run what that backend's ``attention_backward`` can run, which
    it asks about the first sequence's record (the sequences differ only in length).
    """

    op = "attention_varlen_backward"
    frameworks = frozenset({"torch"})  # gradients exist only under torch autograd

    def _per_sequence(self) -> Implementation:
        from fastpe.backends import REGISTRY  # the package imports this module

        return REGISTRY[(self.backend, "attention_backward")]

    def not_supported_reasons(self, inputs) -> list[str]:
        if type(self).run is not AttentionVarlenBackward.run:  # a kernel: its own table
            return super().not_supported_reasons(inputs)
        impl = self._per_sequence()
        for b, rows, keys in _sequences(inputs.forward):
            if keys.start != keys.stop:
                return impl.not_supported_reasons(_sequence_record(inputs, b, rows, keys))
        unavailable = impl.unavailable_reason()  # no sequence has keys: no kernel call
        return [unavailable] if unavailable else []

    def run(self, inputs):
        """(dq, dk, dv, dsinks): dsinks is None without sinks."""
        import torch

        fwd, impl = inputs.forward, self._per_sequence()
        q, k, v, sinks = fwd.q, fwd.k, fwd.v, fwd.options.sinks
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        dsinks = None if sinks is None else torch.zeros_like(sinks, dtype=torch.float32)
        for b, rows, keys in _sequences(fwd):
            if keys.start == keys.stop:
                # no key: out = 0 and lse = the sink (or -inf); only a sink sees grad_lse
                if sinks is not None:
                    dsinks += inputs.grad_lse[:, rows].sum(dim=1).float()
                continue
            record = _sequence_record(inputs, b, rows, keys)
            reasons = impl.not_supported_reasons(record)
            if reasons:  # as dispatch refuses an explicit choice
                from fastpe.dispatch import BackendNotSupportedError

                raise BackendNotSupportedError(
                    f"backend {self.backend!r} cannot run attention_backward on these inputs: "
                    f"{'; '.join(reasons)}"
                )
            dq_b, dk_b, dv_b, dsinks_b, _ = impl.run(record)
            dq[rows] = dq_b[0].transpose(0, 1)
            dk[keys] = dk_b[0].transpose(0, 1)
            dv[keys] = dv_b[0].transpose(0, 1)
            if sinks is not None:
                dsinks += dsinks_b.float()
        if sinks is not None:
            dsinks = dsinks.to(sinks.dtype)
        return dq, dk, dv, dsinks


def _sequences(fwd):
    """(b, query rows, key rows) of each packed sequence that has queries."""
    for b in range(fwd.batch):
        rows = slice(int(fwd.cu_q[b]), int(fwd.cu_q[b + 1]))
        if rows.start != rows.stop:
            yield b, rows, slice(int(fwd.cu_k[b]), int(fwd.cu_k[b + 1]))


def _sequence_record(inputs, b: int, rows: slice, keys: slice):
    """The attention_backward record of sequence b alone, its tensors [1, H, S_b, D]."""
    import torch

    from fastpe._inputs import AttentionBackwardInputs, AttentionInputs
    from fastpe._options import Positions, check_window

    fwd = inputs.forward
    device = fwd.q.device

    def heads_first(x, index):  # [T, H, D] rows -> [1, H, S_b, D]
        return x[index].transpose(0, 1).unsqueeze(0).contiguous()

    q, k, v = heads_first(fwd.q, rows), heads_first(fwd.k, keys), heads_first(fwd.v, keys)
    options = fwd.options
    rope = options.rope
    if rope is not None:
        rope = rope._replace(
            q_positions=Positions(torch.as_tensor(rope.q_positions.array[rows], device=device)),
            k_positions=Positions(torch.as_tensor(rope.k_positions.array[keys], device=device)),
        )
    alibi = options.alibi_slopes
    options = options._replace(
        # a side that reaches every key of this sequence is unbounded, as attention counts it
        window=check_window(options.window, span=q.shape[2] + k.shape[2]),
        alibi_slopes=None if alibi is None else alibi[b : b + 1],
        rope=rope,
        return_lse=True,
    )
    forward = AttentionInputs(
        q=q,
        k=k,
        v=v,
        mask=None,
        key_lengths=None,
        relative_bias=None,
        options=options,
        dtype=fwd.dtype,
        placement=fwd.placement,
    )
    return AttentionBackwardInputs.build(
        forward,
        grad_out=heads_first(inputs.grad_out, rows),
        grad_lse=inputs.grad_lse[:, rows].unsqueeze(0).contiguous(),
        out=heads_first(inputs.out, rows),
        lse=inputs.lse[:, rows].unsqueeze(0).contiguous(),
    )
