"""``fastpe::sinusoidal_table`` and ``fastpe::rope_table``: tables built from sizes and options
(no tensor input, so no backward)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._inputs import RopeTableInputs, SinusoidalTableInputs
from fastpe.torch_ops._common import _backend, _torch_dtype


@torch.library.custom_op("fastpe::sinusoidal_table", mutates_args=())
def sinusoidal_table_op(
    num_positions: int,
    dim: int,
    base: float,
    layout: str,
    freq: str,
    offset: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
) -> Tensor:
    inputs = SinusoidalTableInputs.build(
        num_positions,
        dim,
        base=base,
        layout=layout,
        freq=freq,
        offset=offset,
        dtype=dtype,
        device=device,
    )
    return dispatch.run(inputs, _backend(backend))


@sinusoidal_table_op.register_fake
def _(num_positions, dim, base, layout, freq, offset, dtype, device, backend):
    return torch.empty((num_positions, dim), dtype=dtype, device=device)


@torch.library.custom_op("fastpe::rope_table", mutates_args=())
def rope_table_op(
    num_positions: int,
    rotary_dim: int,
    base: float,
    scaling_layout: str,
    scaling_numbers: Tensor,
    offset: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
) -> tuple[Tensor, Tensor]:
    scaling = _scaling_from_schema(scaling_layout, scaling_numbers)
    inputs = RopeTableInputs.build(
        num_positions,
        rotary_dim,
        base=base,
        scaling=scaling,
        offset=offset,
        dtype=dtype,
        device=device,
    )
    cos, sin = dispatch.run(inputs, _backend(backend))
    return cos, sin


@rope_table_op.register_fake
def _(
    num_positions, rotary_dim, base, scaling_layout, scaling_numbers, offset, dtype, device, backend
):
    shape = (num_positions, rotary_dim // 2)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(
        shape, dtype=dtype, device=device
    )


def call_sinusoidal_table(
    num_positions, dim, *, base, layout, freq, offset, dtype, device, backend
):
    return sinusoidal_table_op(
        num_positions,
        dim,
        float(base),
        layout,
        freq,
        offset,
        _torch_dtype(dtype),
        torch.device(device),
        backend or "",
    )


def call_rope_table(num_positions, rotary_dim, *, base, scaling, offset, dtype, device, backend):
    layout, numbers = _scaling_to_schema(scaling)
    return rope_table_op(
        num_positions,
        rotary_dim,
        float(base),
        layout,
        numbers,
        offset,
        _torch_dtype(dtype),
        torch.device(device),
        backend or "",
    )


# A scaling dict travels as a constant layout string (keys, kinds, strings) and a list of its
# numbers. Under torch.compile the numbers may be symbolic after a recompile, so nothing here may
# sort, hash or print them; the keys are constant strings.


def _scaling_to_schema(scaling) -> tuple[str, Tensor]:
    if not scaling:
        return "", torch.empty(0, dtype=torch.float64)
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be None or a dict; got {type(scaling).__name__}")
    entries, numbers = [], []
    for key in sorted(scaling):
        value = scaling[key]
        if value is None or isinstance(value, (str, bool)):
            entries.append(f"{key}={type(value).__name__}:{value}")
        elif isinstance(value, (list, tuple)):
            entries.append(f"{key}=list:{len(value)}")
            numbers.extend(value)
        else:  # a number (NumPy scalars become 0-d tensors under Dynamo), or a bad value
            try:
                number = torch.as_tensor(value)  # its dtype (static when traced) keeps int-ness
            except (TypeError, RuntimeError, ValueError) as exc:
                raise TypeError(
                    f"scaling[{key!r}] must be a number, a string or a list of numbers; got "
                    f"{value!r}"
                ) from exc
            entries.append(f"{key}={'float' if number.is_floating_point() else 'int'}")
            numbers.append(number)
    # a float64 tensor carries Python floats, symbolic floats and NumPy scalars alike
    numbers = [torch.as_tensor(n, dtype=torch.float64).reshape(-1) for n in numbers]
    tensor = torch.cat(numbers) if numbers else torch.empty(0, dtype=torch.float64)
    return ";".join(entries), tensor


def _scaling_from_schema(layout: str, numbers: Tensor) -> dict | None:
    if not layout:
        return None
    numbers = numbers.tolist()
    scaling, at = {}, 0
    for entry in layout.split(";"):
        key, kind = entry.split("=", 1)
        kind, _, text = kind.partition(":")
        if kind == "list":
            scaling[key] = list(numbers[at : at + int(text)])
            at += int(text)
        elif kind in ("int", "float"):
            scaling[key] = int(numbers[at]) if kind == "int" else numbers[at]
            at += 1
        else:
            scaling[key] = {"NoneType": None, "bool": text == "True", "str": text}[kind]
    return scaling
