"""End to end: ``model.generate()`` of a Llama-shaped random-weight model with fastpe's attention
against transformers' SDPA (``fastpe bench --ops generate``; not in the default grids: it takes
minutes on a CPU).

Two cases, each timed per implementation on the same model and inputs:

- prefill: ``generate(max_new_tokens=1)`` on a prompt of ``prefill`` tokens (one forward pass
  over the whole prompt, then one token);
- decode: ``generate(max_new_tokens=new_tokens)`` after a prompt of ``context`` tokens.

Implementations: "sdpa", "fastpe" (``attn_implementation`` registered by
``fastpe.integrations.transformers.register``) and "fastpe+rope" (the same, with the rotary
application patched by ``fastpe.integrations.transformers_rope.patch_rotary``). Greedy
decoding; the rows record whether each produced the same tokens as SDPA (``same_tokens``) and,
as ``max_abs_error``, the largest difference from SDPA's last logits of a 64-token forward. Random weights give flat logits, so a near tie can
legitimately flip a token; ``same_tokens`` says so rather than hiding it.
"""

from __future__ import annotations

import contextlib
import statistics
import time

# The model: hidden 1024, 4 layers, 16 query / 4 key-value heads, vocab 32000 (the
# intermediate size follows Llama's ~2.7x ratio; the issue leaves it open).
LLAMA_SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
}
SIZES = {"prefill": 4096, "context": 2048, "new_tokens": 16}
# "fastpe+rope" also routes the rotary application through fastpe (transformers_rope)
IMPLEMENTATIONS = ("sdpa", "fastpe", "fastpe+rope")


def _model(shape: dict, dtype: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()


def _iqr(times):
    if len(times) < 2:
        return None  # one timed call has no spread to report
    low, _, high = statistics.quantiles(times, n=4)
    return high - low


def run_generate(
    device: str = "cpu",
    dtype: str = "float32",
    *,
    shape: dict | None = None,
    sizes: dict | None = None,
    repeats: int = 1,
    progress=print,
) -> list[dict]:
    """Rows for a results document (``op`` "generate"); each timing is the median of
    ``repeats`` calls after one warm-up call."""
    import torch

    from fastpe.integrations.transformers import register
    from fastpe.integrations.transformers_rope import patch_rotary

    shape = {**LLAMA_SHAPE, **(shape or {})}
    sizes = {**SIZES, **(sizes or {})}
    fastpe_name = register()
    model = _model(shape, dtype).to(device)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (1, sizes["prefill"]), generator=gen)
    prompt = prompt.to(device)
    short = prompt[:, : sizes["context"]]
    cases = [
        (f"prefill {sizes['prefill']}", prompt, 1),
        (f"{sizes['new_tokens']} new after {sizes['context']}", short, sizes["new_tokens"]),
    ]
    rows, outputs, logits = [], {}, {}
    for impl in IMPLEMENTATIONS:
        model.set_attn_implementation("sdpa" if impl == "sdpa" else fastpe_name)
        rope = patch_rotary("llama") if impl == "fastpe+rope" else contextlib.nullcontext()
        with torch.inference_mode(), rope:
            logits[impl] = model(prompt[:, :64]).logits[0, -1].double().cpu()
            for label, ids, new in cases:
                progress(f"generate {label}: {impl} ...")
                kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
                times = []
                for _ in range(repeats + 1):  # the first call warms up (compiles, allocations)
                    start = time.perf_counter()
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                    times.append(time.perf_counter() - start)
                outputs[(label, impl)] = out[0, ids.shape[1] :].cpu()
                times = sorted(times[1:])
                median = times[len(times) // 2]
                rows.append(
                    {
                        "op": "generate",
                        "case": label,
                        "seq": ids.shape[1],
                        "series": "",
                        "impl": impl,
                        "median_s": median,
                        "iqr_s": _iqr(times),
                        "min_s": times[0],
                        "runs": len(times),
                        "throughput": (ids.shape[1] if new == 1 else new) / median,
                        "unit": "tok/s",
                        "fraction_of_peak": None,
                    }
                )
    for r in rows:
        base = next(b for b in rows if b["case"] == r["case"] and b["impl"] == "sdpa")
        r["speedup_vs_best_baseline"] = (
            None if r["impl"] == "sdpa" else base["median_s"] / r["median_s"]
        )
        r["max_abs_error"] = float((logits[r["impl"]] - logits["sdpa"]).abs().max())
        r["same_tokens"] = bool(
            torch.equal(outputs[(r["case"], r["impl"])], outputs[(r["case"], "sdpa")])
        )
    return rows
