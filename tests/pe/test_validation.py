"""Bad input to the tables, apply_rope and embed gets a clear error naming the argument — never a
crash or a silent wrong answer."""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import needs_torch, raises, to_fw, torch

import fastpe

O = {"backend": "numpy"}
f32 = np.float32


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"num_positions": -1, "dim": 8}, ValueError, "num_positions must be >= 0"),
        ({"num_positions": 4, "dim": 7}, ValueError, "dim must be even"),
        ({"num_positions": 4, "dim": 2.0}, TypeError, "dim must be an integer"),
        ({"num_positions": 4, "dim": 2, "freq": "tensor2tensor"}, ValueError, "dim must be >= 4"),
        ({"num_positions": 4, "dim": 8, "layout": "split"}, ValueError, "layout must be one of"),
        ({"num_positions": 4, "dim": 8, "freq": "fairseq"}, ValueError, "freq must be one of"),
        ({"num_positions": 4, "dim": 8, "base": 0}, ValueError, "base must be > 0"),
        ({"num_positions": 4, "dim": 8, "base": float("nan")}, ValueError, "base must be finite"),
        ({"num_positions": 4, "dim": 8, "offset": -2}, ValueError, "offset must be >= 0"),
        ({"num_positions": 4, "dim": 8, "dtype": "int32"}, TypeError, "dtype must be one of"),
        ({"num_positions": 4, "dim": 8, "dtype": "bfloat16"}, TypeError, "need a torch device"),
        ({"num_positions": 4, "dim": 8, "backend": "cuda"}, ValueError, "backend must be one of"),
    ],
)
def test_sinusoidal_table_errors(kwargs, exc, match):
    raises(exc, match, fastpe.sinusoidal_table, **kwargs)


def test_sinusoidal_table_bad_device():
    pytest.importorskip("torch")
    raises(ValueError, "device must be None", fastpe.sinusoidal_table, 4, 8, device="tpu")


def test_relative_transform_errors():
    raises(TypeError, "k must be an integer", fastpe.relative_transform, 1.5, 8)
    raises(ValueError, "dim must be even", fastpe.relative_transform, 1, 9)
    raises(ValueError, "layout must be one of", fastpe.relative_transform, 1, 8, layout="x")


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((7,), {}, ValueError, "rotary_dim must be even"),
        ((0,), {}, ValueError, "rotary_dim must be >= 2"),
        ((8,), {"scaling": {"rope_type": "ntk"}}, ValueError, "rope_type'\\] must be one of"),
        ((8,), {"scaling": {"rope_type": "linear"}}, ValueError, "'factor'\\] is required"),
        (
            (8,),
            {"scaling": {"rope_type": "linear", "factor": 2, "fator": 3}},
            ValueError,
            "unknown keys",
        ),
        (
            (8,),
            {
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8,
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                }
            },
            ValueError,
            "original_max_position_embeddings",
        ),
        (
            (8,),
            {"scaling": {"rope_type": "dynamic", "factor": 2}},
            ValueError,
            "max_position_embeddings",
        ),
        (
            (8,),
            {
                "scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1, 1],
                    "long_factor": [1, 1, 1, 1],
                    "original_max_position_embeddings": 8,
                    "factor": 2,
                }
            },
            ValueError,
            "4 entries",
        ),
        ((8,), {"scaling": "linear"}, TypeError, "scaling must be None or a dict"),
        ((8,), {"scaling": {"rope_theta": 500.0}, "base": 100.0}, ValueError, "conflicts"),
        ((8,), {"seq_len": -1}, ValueError, "seq_len must be >= 0"),
    ],
)
def test_rope_inv_freq_errors(args, kwargs, exc, match):
    raises(exc, match, fastpe.rope_inv_freq, *args, **kwargs)
    if "seq_len" not in kwargs:  # rope_table takes the length from num_positions
        raises(exc, match, fastpe.rope_table, 4, *args, **kwargs)


def test_apply_rope_errors(fw):
    x = to_fw(np.zeros((1, 2, 4, 8), f32), fw)
    cos, sin = (to_fw(t, fw) for t in fastpe.rope_table(6, 8, **O))
    ap = fastpe.apply_rope
    raises(ValueError, "x must have 4 dimensions", ap, x[0], cos, sin, **O)
    raises(
        TypeError,
        "x must have a float dtype",
        ap,
        to_fw(np.zeros((1, 2, 4, 8), np.int32), fw),
        cos,
        sin,
        **O,
    )
    raises(ValueError, "same shape", ap, x, cos, sin[:, :2], **O)
    raises(
        ValueError,
        "rotary dim R = 10",
        ap,
        x,
        to_fw(np.zeros((6, 5), f32), fw),
        to_fw(np.zeros((6, 5), f32), fw),
        **O,
    )
    raises(
        IndexError,
        "positions 3 … 6 are needed but cos/sin has only 6 rows",
        ap,
        x,
        cos,
        sin,
        positions=3,
        **O,
    )
    raises(
        IndexError,
        "positions contains 6 at index \\[2\\]",
        ap,
        x,
        cos,
        sin,
        positions=to_fw(np.array([0, 1, 6, 2]), fw),
        **O,
    )
    raises(
        IndexError,
        "contains -1",
        ap,
        x,
        cos,
        sin,
        positions=to_fw(np.array([[0, 1, -1, 2]]), fw),
        **O,
    )
    raises(
        ValueError, "shape \\[S\\]", ap, x, cos, sin, positions=to_fw(np.array([0, 1, 2]), fw), **O
    )
    raises(
        TypeError,
        "positions must have an integer dtype",
        ap,
        x,
        cos,
        sin,
        positions=to_fw(np.zeros(4), fw),
        **O,
    )
    raises(ValueError, "positions must be >= 0", ap, x, cos, sin, positions=-1, **O)
    raises(ValueError, "layout must be one of", ap, x, cos, sin, layout="sbhd", **O)
    raises(TypeError, "inplace must be True or False", ap, x, cos, sin, inplace="yes", **O)


def test_apply_rope_group_errors(fw):
    cos, sin = (to_fw(t, fw) for t in fastpe.rope_table(8, 4, **O))
    q = to_fw(np.zeros((1, 2, 3, 4), f32), fw)
    raises(ValueError, "non-empty tuple", fastpe.apply_rope, (), cos, sin, **O)
    raises(
        ValueError,
        "x\\[1\\] has batch and sequence \\(1, 5\\)",
        fastpe.apply_rope,
        (q, to_fw(np.zeros((1, 2, 5, 4), f32), fw)),
        cos,
        sin,
        **O,
    )
    raises(ValueError, "x must have 4 dimensions", fastpe.apply_rope, (q, q[0]), cos, sin, **O)


def test_apply_rope_read_only_inplace():
    x = np.zeros((1, 1, 2, 4), f32)
    x.setflags(write=False)
    cos, sin = fastpe.rope_table(2, 4, **O)
    raises(ValueError, "writeable", fastpe.apply_rope, x, cos, sin, inplace=True, **O)


def test_embed_errors(fw):
    w = to_fw(np.zeros((10, 8), f32), fw)
    ids = to_fw(np.array([[1, 2, 3]]), fw)
    em = fastpe.embed
    raises(
        IndexError,
        "ids contains 10 at index \\[0, 1\\], outside \\[0, 10\\)",
        em,
        to_fw(np.array([[1, 10, 3]]), fw),
        w,
        **O,
    )
    raises(IndexError, "ids contains -1", em, to_fw(np.array([[-1, 1, 3]]), fw), w, **O)
    raises(
        TypeError, "ids must have an integer dtype", em, to_fw(np.array([[1.0, 2.0]]), fw), w, **O
    )
    raises(ValueError, "ids must have 2 dimensions", em, to_fw(np.array([1, 2]), fw), w, **O)
    raises(ValueError, "weight must have 2 dimensions", em, ids, to_fw(np.zeros(8, f32), fw), **O)
    raises(
        ValueError, "embedding dim must be even", em, ids, to_fw(np.zeros((10, 7), f32), fw), **O
    )
    raises(ValueError, "pe must be one of", em, ids, w, pe="learned", **O)
    raises(ValueError, "needs pe_table", em, ids, w, pe="table", **O)
    raises(
        ValueError,
        "only read with pe='table'",
        em,
        ids,
        w,
        pe_table=to_fw(np.zeros((4, 8), f32), fw),
        **O,
    )
    raises(
        ValueError,
        "D = 8 columns",
        em,
        ids,
        w,
        pe="table",
        pe_table=to_fw(np.zeros((4, 6), f32), fw),
        **O,
    )
    raises(
        IndexError,
        "positions 2 … 4 are needed but pe_table has only 4 rows",
        em,
        ids,
        w,
        pe="table",
        pe_table=to_fw(np.zeros((4, 8), f32), fw),
        positions=2,
        **O,
    )
    raises(ValueError, "given together", em, ids, w, token_type_ids=ids, **O)
    raises(
        IndexError,
        "token_type_ids contains 3",
        em,
        ids,
        w,
        token_type_ids=to_fw(np.array([[0, 3, 1]]), fw),
        token_type_weight=to_fw(np.zeros((2, 8), f32), fw),
        **O,
    )
    raises(
        ValueError,
        "shape of ids",
        em,
        ids,
        w,
        token_type_ids=to_fw(np.array([[0, 1]]), fw),
        token_type_weight=to_fw(np.zeros((2, 8), f32), fw),
        **O,
    )
    raises(ValueError, "scale must be finite", em, ids, w, scale=float("inf"), **O)


@needs_torch
@pytest.mark.parametrize("bad", [-1, 4096])
def test_tensor_positions_out_of_range_still_name_the_value(bad):
    """The range checks now reduce tensors in torch; an offending entry is still reported."""
    x = torch.zeros(1, 2, 3, 8)
    cos, sin = fastpe.rope_table(4096, 8, device="cpu")
    positions = torch.tensor([[5, bad, 7]])
    with pytest.raises(IndexError, match=rf"positions contains {bad} at index \[0, 1\]"):
        fastpe.apply_rope(x, cos, sin, positions=positions)
