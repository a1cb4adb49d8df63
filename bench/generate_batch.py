"""transformers continuous batching (``model.generate_batch``) tokens/s: fastpe vs the built-in
implementations that run on a CPU, measured in one run (interleaved rounds, median and spread).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/generate_batch.py [--rounds 5]
        [--new-tokens 32] [--dtype float32|bfloat16]

Model: a Llama-shaped random-weight model (hidden 1024, intermediate 2816, 8 layers, 16/4
heads, head dim 64, vocab 32000); 16 requests with prompt lengths spread over 32 … 512
(geometric), greedy, a fixed number of new tokens (no end-of-sequence token). Implementations:
``paged|eager`` and ``sdpa`` (the only non-FlashAttention ones transformers 5.23 admits to
continuous batching) and fastpe through ``register_flash()``. The cache is sized explicitly
(256-token pages, the default) rather than from free memory, the same for all of them. Each round
runs every implementation once, in turn, so machine noise hits all of them alike; tokens/s is
generated tokens over the wall time of the ``generate_batch`` call, and the ratios are per
round, reported as median [min, max]; the same for the process's CPU time (less sensitive to
other processes on a shared machine). The generated tokens are compared with ``paged|eager``'s
(equal in float32; bfloat16 rounding flips near-ties of a random model), and every run with the
implementation's first. Nothing is written.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch

import fastpe
from fastpe.integrations.transformers import register_flash

N_REQUESTS = 16
PROMPTS = (32, 512)
MAX_BATCH_TOKENS = 1024


def build_model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def prompts():
    lengths = np.round(np.geomspace(*PROMPTS, N_REQUESTS)).astype(int)
    rng = np.random.default_rng(0)
    order = rng.permutation(N_REQUESTS)  # mixed lengths in the queue, not sorted
    return [rng.integers(1, 32000, int(lengths[i])).tolist() for i in order]


def run(model, implementation, inputs, new_tokens):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(implementation)
    generation = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    pages = -(-(max(PROMPTS) + new_tokens) // 256)
    batching = ContinuousBatchingConfig(
        num_blocks=N_REQUESTS * pages + 4, max_batch_tokens=MAX_BATCH_TOKENS
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate_batch(
            inputs, generation_config=generation, continuous_batching_config=batching
        )
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    ordered = [out[f"req_{i}"] for i in range(len(inputs))]
    errors = [o.error for o in ordered if o.error is not None]
    if errors:
        raise RuntimeError(f"{implementation}: {errors[0]}")
    tokens = [o.generated_tokens for o in ordered]
    assert all(len(t) == new_tokens for t in tokens), implementation
    return seconds, cpu_seconds, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds; each runs every implementation once, in turn (default 5)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=32, help="tokens generated per request (default 32)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="model and cache dtype (default float32)",
    )
    args = parser.parse_args()

    import transformers

    dtype = getattr(torch, args.dtype)
    model = build_model(dtype)
    inputs = prompts()
    implementations = ["paged|eager", "sdpa", register_flash()]
    generated = N_REQUESTS * args.new_tokens
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"fastpe {fastpe.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    )
    print(
        f"Llama hidden 1024, 8 layers, 16/4 heads, vocab 32000, {args.dtype}; {N_REQUESTS} "
        f"requests, prompt lengths {sorted(len(p) for p in inputs)} (total "
        f"{sum(map(len, inputs))}), {args.new_tokens} new tokens each, max_batch_tokens "
        f"{MAX_BATCH_TOKENS}"
    )

    first = {}
    for impl in implementations:  # warm-up: Numba compiles, first-touch allocations
        seconds, _, first[impl] = run(model, impl, inputs, args.new_tokens)
        print(f"warm-up {impl:14s} {seconds:7.2f} s")
    wall = {impl: [] for impl in implementations}
    cpu = {impl: [] for impl in implementations}
    same = {impl: True for impl in implementations}
    for r in range(args.rounds):
        for impl in implementations:
            seconds, cpu_seconds, tokens = run(model, impl, inputs, args.new_tokens)
            wall[impl].append(seconds)
            cpu[impl].append(cpu_seconds)
            same[impl] &= tokens == first[impl]
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{i} {wall[i][-1]:.2f} s ({cpu[i][-1]:.1f} CPU-s)" for i in implementations
            )
        )

    # CPU-seconds (all threads of this process) are less sensitive to other processes taking
    # the cores than wall time, which is what the issue asks for
    for label, table in (("tokens/s (wall time)", wall), ("tokens per CPU-second", cpu)):
        print(f"\n{label}, {generated} generated tokens per call, median [min, max] over rounds")
        for impl, times in table.items():
            rates = [generated / t for t in times]
            print(
                f"  {impl:14s} {statistics.median(rates):8.1f} [{min(rates):.1f}, {max(rates):.1f}]"
            )
        fast = implementations[-1]
        for impl in implementations[:-1]:
            ratios = [t / f for t, f in zip(table[impl], table[fast], strict=True)]
            print(
                f"  {fast} / {impl}: {statistics.median(ratios):.2f}x "
                f"[{min(ratios):.2f}, {max(ratios):.2f}]"
            )
    reference = first[implementations[0]]
    print(
        f"\ngenerated tokens against {implementations[0]}'s: requests with the same tokens, "
        f"mean length of the common prefix (of {args.new_tokens}); every round repeating the "
        f"implementation's own warm-up tokens"
    )
    for impl in implementations:
        prefixes = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(first[impl], reference, strict=True)
        ]
        equal = sum(p == args.new_tokens for p in prefixes)
        print(
            f"  {impl:14s} {equal}/{N_REQUESTS} requests, prefix "
            f"{statistics.mean(prefixes):.1f}; repeatable: {same[impl]}"
        )


if __name__ == "__main__":
    main()
