"""torch.nn modules over fastpe's ops (imports torch: use ``import fastpe.nn`` explicitly).

- ``SinusoidalPositionalEmbedding``: the tables of docs/math.md#sinusoidal-encoding (both layouts and frequency schemes),
  by length and offset (incremental decoding) or gathered at arbitrary position ids.
- ``RotaryEmbedding``: Hugging Face compatible ``forward(x, position_ids) -> (cos, sin)`` with
  the scaling types of transformers (``rope_type`` linear, dynamic, yarn, longrope, llama3), from
  a dict or a transformers config.
- ``FusedEmbedding``: token embedding × scale + positional encoding (+ token types) in one
  kernel, built from existing ``nn.Embedding`` modules (weights shared, not copied).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import fastpe
from fastpe._validate import MAX_POSITION, check_int


class SinusoidalPositionalEmbedding(nn.Module):
    """Sinusoidal positional encodings, computed (not learned) and accurate at any position.

    ``forward(seq_len, offset=0)`` returns [seq_len, dim] for positions offset … offset+seq_len-1
    (Marian / fairseq incremental decoding: offset = tokens already decoded);
    ``forward(position_ids)`` returns [..., dim] gathered at the given positions.
    Rows for position ids come from a table of ``max_positions`` rows, grown on demand.
    """

    def __init__(
        self,
        dim,
        *,
        base=10000.0,
        layout="interleaved",
        freq="paper",
        max_positions=2048,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        self.dim, self.base, self.layout, self.freq = dim, base, layout, freq
        # named here: the table op would report it as its own num_positions
        max_positions = check_int("max_positions", max_positions, minimum=0, maximum=MAX_POSITION)
        table = fastpe.sinusoidal_table(
            max_positions,
            dim,
            base=base,
            layout=layout,
            freq=freq,
            dtype=dtype,
            device=device or "cpu",
        )
        self.register_buffer("table", table, persistent=False)

    def forward(self, seq_len_or_positions, offset: int = 0):
        if isinstance(seq_len_or_positions, torch.Tensor):
            positions = seq_len_or_positions
            if not torch.compiler.is_compiling():
                self._grow(int(positions.max()) + 1 if positions.numel() else 0)
            return nn.functional.embedding(positions, self.table)
        return fastpe.sinusoidal_table(
            seq_len_or_positions,
            self.dim,
            base=self.base,
            layout=self.layout,
            freq=self.freq,
            offset=offset,
            dtype=self.table.dtype,
            device=self.table.device,
        )

    def _grow(self, needed: int) -> None:
        if needed > self.table.shape[0]:
            self.table = fastpe.sinusoidal_table(
                max(needed, 2 * self.table.shape[0]),
                self.dim,
                base=self.base,
                layout=self.layout,
                freq=self.freq,
                dtype=self.table.dtype,
                device=self.table.device,
            )


def _rope_parameters_from_config(config) -> tuple[int, float, dict | None, int]:
    """(rotary_dim, base, scaling dict, max_position_embeddings) from a transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    base = params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None) or getattr(
        config, "partial_rotary_factor", 1.0
    )
    rotary_dim = int(head_dim * partial)
    max_positions = config.max_position_embeddings
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rotary_dim, base, None, max_positions
    if (
        rope_type in ("yarn", "longrope", "llama3")  # the types that read it
        and hasattr(config, "original_max_position_embeddings")
        and "original_max_position_embeddings" not in params
    ):
        params["original_max_position_embeddings"] = config.original_max_position_embeddings
    params.setdefault("max_position_embeddings", max_positions)
    return rotary_dim, base, params, max_positions


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin in the Hugging Face convention: ``forward(x, position_ids)`` returns
    ``(cos, sin)``, each [B, S, rotary_dim] (both halves, as ``rotate_half`` expects) in x's
    dtype, already multiplied by the scaling type's attention factor. ``inv_freq`` and
    ``attention_scaling`` are exposed as in transformers' rotary modules.

    Tables are computed by fastpe (float64 angles, accurate at long contexts) for
    ``max_position_embeddings`` positions, grown on demand; dynamic NTK and longrope recompute
    them when the sequence crosses the model's original length, as transformers does.
    """

    def __init__(
        self, rotary_dim, *, base=10000.0, scaling=None, max_position_embeddings=2048, device=None
    ):
        super().__init__()
        self.rotary_dim, self.base, self.scaling = rotary_dim, base, scaling
        self.rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        inv_freq, self.attention_scaling = fastpe.rope_inv_freq(
            rotary_dim, base=base, scaling=scaling
        )
        self.register_buffer(
            "inv_freq", torch.tensor(inv_freq, dtype=torch.float32, device=device), persistent=False
        )
        self._device = torch.device(device or "cpu")
        self._cached_len = 0
        # named here: the table op would report it as its own num_positions
        self._build(
            check_int(
                "max_position_embeddings", max_position_embeddings, minimum=0, maximum=MAX_POSITION
            )
        )

    @classmethod
    def from_config(cls, config, device=None) -> RotaryEmbedding:
        """From a transformers config (head_dim, partial_rotary_factor, rope_theta, rope_parameters
        or rope_scaling, max_position_embeddings)."""
        rotary_dim, base, scaling, max_positions = _rope_parameters_from_config(config)
        return cls(
            rotary_dim,
            base=base,
            scaling=scaling,
            max_position_embeddings=max_positions,
            device=device,
        )

    def _build(self, length: int) -> None:
        cos, sin = fastpe.rope_table(
            length, self.rotary_dim, base=self.base, scaling=self.scaling, device=self._device
        )
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)
        self._cached_len = length

    def _regime(self, seq_len: int) -> int:
        """The table length whose scaling parameters are right for ``seq_len``."""
        if self.rope_type == "dynamic":
            return max(seq_len, self.scaling["max_position_embeddings"])
        if self.rope_type == "longrope":
            original = (
                self.scaling.get("original_max_position_embeddings")
                or self.scaling["max_position_embeddings"]
            )
            return (
                max(seq_len, self._cached_len)
                if seq_len > original
                else min(self._cached_len, original)
            )
        return max(seq_len, self._cached_len)

    @torch.no_grad()
    def forward(self, x, position_ids):
        if not torch.compiler.is_compiling():
            needed = self._regime(int(position_ids.max()) + 1 if position_ids.numel() else 1)
            if needed != self._cached_len or self.cos_cached.device != x.device:
                self._device = x.device
                self._build(needed)
        cos = nn.functional.embedding(position_ids, self.cos_cached)
        sin = nn.functional.embedding(position_ids, self.sin_cached)
        return torch.cat([cos, cos], dim=-1).to(x.dtype), torch.cat([sin, sin], dim=-1).to(x.dtype)


class FusedEmbedding(nn.Module):
    """``scale · weight[ids] + PE(positions) [+ token_type_weight[token_type_ids]]`` in one kernel.

    ``pe="sinusoidal"`` computes the encoding in the kernel (``base``, ``layout``, ``freq``);
    ``pe="table"`` adds rows of a learned ``pe_table`` (BERT, GPT-2); ``pe=None`` adds nothing.
    ``forward(input_ids, position_ids=None, token_type_ids=None, past_key_values_length=0)``:
    positions default to ``past_key_values_length + s`` (plus ``position_offset``, e.g. the
    padding offset of fairseq-style tables).

    Trains: gradients reach ``weight``, ``pe_table`` and ``token_type_weight`` when they are
    parameters that require grad (a plain tensor ``weight`` is wrapped as a frozen parameter).
    """

    def __init__(
        self,
        weight,
        *,
        pe="sinusoidal",
        pe_table=None,
        scale=1.0,
        base=10000.0,
        layout="interleaved",
        freq="paper",
        token_type_weight=None,
        position_offset=0,
    ):
        super().__init__()
        self.weight = (
            weight
            if isinstance(weight, nn.Parameter)
            else nn.Parameter(weight, requires_grad=False)
        )
        self.pe_table = pe_table
        self.token_type_weight = token_type_weight
        self.pe, self.scale, self.base, self.layout, self.freq = pe, scale, base, layout, freq
        self.position_offset = position_offset

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        *,
        position_embedding: nn.Embedding | None = None,
        token_type_embedding: nn.Embedding | None = None,
        scale: float | str = 1.0,
        **options,
    ) -> FusedEmbedding:
        """Share the weights of existing modules. ``position_embedding`` (learned) implies
        ``pe="table"``; ``scale="sqrt"`` means sqrt(embedding_dim) (the paper, Marian)."""
        if scale == "sqrt":
            scale = math.sqrt(embedding.embedding_dim)
        if position_embedding is not None:
            options.setdefault("pe", "table")
            options["pe_table"] = position_embedding.weight
        if token_type_embedding is not None:
            options["token_type_weight"] = token_type_embedding.weight
        return cls(embedding.weight, scale=scale, **options)

    def forward(
        self, input_ids, position_ids=None, token_type_ids=None, past_key_values_length: int = 0
    ):
        positions = position_ids
        if positions is None:
            positions = past_key_values_length + self.position_offset
        elif self.position_offset:
            positions = positions + self.position_offset
        types = None
        if self.token_type_weight is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        return fastpe.embed(
            input_ids,
            self.weight,
            positions=positions,
            pe=self.pe,
            pe_table=self.pe_table,
            scale=self.scale,
            base=self.base,
            layout=self.layout,
            freq=self.freq,
            token_type_ids=types,
            token_type_weight=self.token_type_weight,
        )
