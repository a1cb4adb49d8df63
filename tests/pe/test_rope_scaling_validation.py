"""Every key of a RoPE scaling dict is checked by name (issue 11, item 12): a bad value gets a
TypeError/ValueError naming scaling['key'], the value and what is accepted — never a NaN table,
a ZeroDivisionError, a "math domain error" or a key silently ignored."""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import torch

import fastpe

NAN = float("nan")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0],
    "original_max_position_embeddings": 64,
    "factor": 2.0,
}
LINEAR = {"rope_type": "linear", "factor": 2.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}

# (scaling dict, exception, message fragment); the rotary dim is 8, so factor lists have 4 entries
BAD = [
    (
        {**YARN, "attention_factor": NAN},
        ValueError,
        r"scaling\['attention_factor'\] must be finite and > 0; got nan",
    ),
    (
        {**YARN, "attention_factor": 0.0},
        ValueError,
        r"scaling\['attention_factor'\] must be > 0; got 0.0",
    ),
    ({**YARN, "beta_fast": -1}, ValueError, r"scaling\['beta_fast'\] must be > 0; got -1"),
    ({**YARN, "beta_slow": 0}, ValueError, r"scaling\['beta_slow'\] must be > 0; got 0"),
    (
        {**YARN, "beta_fast": 2, "beta_slow": 4},
        ValueError,
        r"scaling\['beta_fast'\] must be >= scaling\['beta_slow'\]",
    ),
    (
        {**YARN, "mscale": -1.0, "mscale_all_dim": 1.0},
        ValueError,
        r"scaling\['mscale'\] must be >= 0; got -1",
    ),
    (
        {**YARN, "mscale_all_dim": "1"},
        TypeError,
        r"scaling\['mscale_all_dim'\] must be a real number; got '1'",
    ),
    (
        {**YARN, "truncate": "no"},
        TypeError,
        r"scaling\['truncate'\] must be True or False; got 'no'",
    ),
    ({**YARN, "factor": -4.0}, ValueError, r"scaling\['factor'\] must be > 0; got -4"),
    (
        {**YARN, "original_max_position_embeddings": 64.5},
        TypeError,
        r"scaling\['original_max_position_embeddings'\] must be an integer; got 64.5",
    ),
    (
        {**YARN, "original_max_position_embeddings": 0},
        ValueError,
        r"scaling\['original_max_position_embeddings'\] must be >= 1; got 0",
    ),
    (
        {**YARN, "low_freq_factor": 1.0},
        ValueError,
        r"unknown keys \['low_freq_factor'\] for rope_type='yarn'",
    ),
    (
        {**LONGROPE, "short_factor": [0.0, 1.0, 1.0, 1.0]},
        ValueError,
        r"scaling\['short_factor'\]\[0\] must be > 0; got 0",
    ),
    (
        {**LONGROPE, "short_factor": [1.0, NAN, 1.0, 1.0]},
        ValueError,
        r"scaling\['short_factor'\]\[1\] must be finite and > 0; got nan",
    ),
    (
        {**LONGROPE, "long_factor": [1.0, -2.0, 1.0, 1.0]},
        ValueError,
        r"scaling\['long_factor'\]\[1\] must be > 0; got -2",
    ),
    ({**LONGROPE, "short_factor": "1111"}, TypeError, r"scaling\['short_factor'\] must be a list"),
    (
        {**LONGROPE, "long_factor": [1.0, 1.0]},
        ValueError,
        r"scaling\['long_factor'\] must have rotary_dim/2 = 4 entries; got 2",
    ),
    (
        {**LONGROPE, "attention_factor": -1.0},
        ValueError,
        r"scaling\['attention_factor'\] must be > 0; got -1",
    ),
    (
        {**LLAMA3, "low_freq_factor": NAN},
        ValueError,
        r"scaling\['low_freq_factor'\] must be finite and > 0; got nan",
    ),
    (
        {**LLAMA3, "low_freq_factor": 0},
        ValueError,
        r"scaling\['low_freq_factor'\] must be > 0; got 0",
    ),
    (
        {**LLAMA3, "low_freq_factor": "1"},
        TypeError,
        r"scaling\['low_freq_factor'\] must be a real number; got '1'",
    ),
    (
        {**LLAMA3, "high_freq_factor": 1.0},
        ValueError,
        r"scaling\['high_freq_factor'\] must be > scaling\['low_freq_factor'\]",
    ),
    ({**LLAMA3, "factor": "8"}, TypeError, r"scaling\['factor'\] must be a real number; got '8'"),
    ({**LLAMA3, "factor": True}, TypeError, r"scaling\['factor'\] must be a real number; got True"),
    ({**LINEAR, "factor": -2.0}, ValueError, r"scaling\['factor'\] must be > 0; got -2"),
    (
        {**LINEAR, "factor": float("inf")},
        ValueError,
        r"scaling\['factor'\] must be finite and > 0; got inf",
    ),
    (
        {**LINEAR, "partial_rotary_factor": 0.5},
        ValueError,
        r"scaling\['partial_rotary_factor'\] must be 1.0 \(or absent\); got 0.5: pass rotary_dim",
    ),
    (
        {**LINEAR, "beta_fast": 32},
        ValueError,
        r"unknown keys \['beta_fast'\] for rope_type='linear'; accepted keys",
    ),
    (
        {**LINEAR, "original_max_position_embeddings": 64},
        ValueError,
        r"unknown keys \['original_max_position_embeddings'\] for rope_type='linear'",
    ),
    (
        {**DYNAMIC, "max_position_embeddings": -5},
        ValueError,
        r"scaling\['max_position_embeddings'\] must be >= 1; got -5",
    ),
    ({**DYNAMIC, "rope_theta": -1.0}, ValueError, r"scaling\['rope_theta'\] must be > 0; got -1"),
    (
        {"rope_type": "linear", "type": "yarn", "factor": 2.0},
        ValueError,
        r"scaling\['rope_type'\]='linear' and scaling\['type'\]='yarn' disagree",
    ),
    (
        {"rope_type": ["linear"], "factor": 2.0},
        ValueError,
        r"scaling\['rope_type'\] must be one of",
    ),
    (
        {"rope_type": "proportional", "rope_theta": 100.0},
        ValueError,
        r"scaling\['rope_type'\] must be one of",
    ),
]


@pytest.mark.parametrize("scaling,exc,match", BAD)
def test_bad_scaling_rejected_by_name(scaling, exc, match):
    with pytest.raises(exc, match=match):
        fastpe.rope_inv_freq(8, scaling=scaling)
    with pytest.raises(exc, match=match):
        fastpe.rope_table(4, 8, scaling=scaling, backend="numpy")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("scaling,exc,match", BAD[:3])
def test_bad_scaling_rejected_by_rotary_module(scaling, exc, match):
    import fastpe.nn

    with pytest.raises(exc, match=match):
        fastpe.nn.RotaryEmbedding(8, scaling=scaling, max_position_embeddings=16)


@pytest.mark.parametrize(
    "plain,numpy_scalars",
    [
        (DYNAMIC, {**DYNAMIC, "factor": np.float32(2.0), "max_position_embeddings": np.int64(64)}),
        (
            LLAMA3,
            {
                **LLAMA3,
                "factor": np.float32(8.0),
                "low_freq_factor": np.float64(1.0),
                "high_freq_factor": np.int32(4),
                "original_max_position_embeddings": np.int64(64),
            },
        ),
        (
            {**YARN, "truncate": False},
            {
                **YARN,
                "factor": np.float32(4.0),
                "truncate": np.bool_(False),
                "original_max_position_embeddings": np.int16(64),
            },
        ),
        (
            LONGROPE,
            {**LONGROPE, "short_factor": np.array(LONGROPE["short_factor"], dtype=np.float32)},
        ),
    ],
    ids=["dynamic", "llama3", "yarn", "longrope"],
)
def test_numpy_scalars_are_numbers(plain, numpy_scalars):
    # the values are exactly representable in float32, so both dicts describe the same scaling
    want, want_factor = fastpe.rope_inv_freq(8, scaling=plain, seq_len=32)
    got, got_factor = fastpe.rope_inv_freq(8, scaling=numpy_scalars, seq_len=32)
    np.testing.assert_array_equal(got, want)
    assert got_factor == want_factor


def test_optional_keys_set_to_none_are_absent_and_neutral_keys_accepted():
    # transformers reads optional keys with .get(): None means "use the default"
    want = fastpe.rope_inv_freq(8, scaling=YARN)
    got = fastpe.rope_inv_freq(
        8,
        scaling={**YARN, "attention_factor": None, "beta_fast": None, "partial_rotary_factor": 1.0},
    )
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


def test_yarn_beta_and_truncate_match_transformers():
    """Non-default beta_fast/beta_slow/truncate are honoured exactly as transformers does."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**YARN, "beta_fast": 8, "beta_slow": 2, "truncate": False, "attention_factor": 1.5}
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_parameters={**params, "rope_theta": 1000.0},
    )
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu", None)
    ours, our_factor = fastpe.rope_inv_freq(32, base=1000.0, scaling=params)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=2e-6)
    assert our_factor == their_factor == 1.5


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_rotary_from_config_with_config_level_original_max():
    """A config attribute original_max_position_embeddings (Phi-3 style) is passed on only to
    the types that read it: a linear config with it still builds and matches transformers."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    import fastpe.nn

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rope_parameters={**LINEAR, "rope_theta": 1000.0},
        original_max_position_embeddings=64,
    )
    ours = fastpe.nn.RotaryEmbedding.from_config(config)
    theirs = LlamaRotaryEmbedding(config)
    x = torch.randn(1, 2, 16, 32)
    position_ids = torch.arange(16)[None]
    for got, want in zip(ours(x, position_ids), theirs(x, position_ids), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
