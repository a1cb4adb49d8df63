"""8-bit copies of a paged KV cache for the bench scripts (run as ``python bench/NAME.py``,
which puts this folder on the import path), quantized as vLLM and FlashAttention 3 store them:
value = stored × scale."""

from __future__ import annotations

import torch


def eight_bit_caches(k_cache, v_cache, fp8_bound):
    """{"fp8": ..., "int8": ...} of (k, v, k_scale, v_scale) for caches [blocks, block, Hkv, D]:
    float8_e4m3fn with one scale per kv head (|x| up to ``fp8_bound`` onto the fp8 range), and
    int8 with one scale per token and kv head (its largest |x| onto 127)."""
    fp8_scale = torch.full((k_cache.shape[2],), fp8_bound / 448)
    fp8 = [
        (c.float() / fp8_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        for c in (k_cache, v_cache)
    ]
    int8 = []
    for c in (k_cache, v_cache):
        scale = c.float().abs().amax(-1).clamp_min(1e-30) / 127
        int8.append((torch.round(c.float() / scale[..., None]).to(torch.int8), scale))
    return {
        "fp8": (fp8[0], fp8[1], fp8_scale, fp8_scale),
        "int8": (int8[0][0], int8[1][0], int8[0][1], int8[1][1]),
    }
