"""The one write of ``attention_kvcache``, shared by every backend: new keys/values (already
rotated, in the cache's dtype and framework) stored at each sequence's cache positions."""

from __future__ import annotations

import sys

from fastpe import _arrays


def write_new_tokens(inp, k_cache, v_cache, k_new, v_new) -> None:
    """k_cache[block, offset] = k_new (and v), for the (block, offset) of every new token.
    The caches are the caller's or views of their memory (CPU kernels write host views)."""
    block, offset = inp.written_rows()
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        if _arrays.is_tensor(cache):
            torch = sys.modules["torch"]
            index = (
                torch.from_numpy(block).to(cache.device),
                torch.from_numpy(offset).to(cache.device),
            )
            cache[index] = new.to(cache.dtype)
        else:
            cache[block, offset] = new
