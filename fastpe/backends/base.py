"""What every backend module builds on: the ``Implementation`` of one op with its capability
table, and the one way an op writes into a caller's array (``inplace=True``)."""

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
