"""The backward of fastpe.flex_attention with a learned bias table (causal block mask,
float32): its cost over the backward of query, key and value alone, and the two race-free
layouts of the table's gradient.

    python bench/flex_captured_grads.py [--bias relative|full|slopes] [--seq 1024] [--batch 1]
                                        [--heads 16] [--dim 64] [--rounds 5] [--calls 2]

``--bias relative`` (default): ``score + table[h, q_idx - kv_idx + S]``, table [H, 2S];
``--bias full``: ``score + table[h, q_idx, kv_idx]``, table [H, S, S] (a gradient as large as
the scores of one batch); ``--bias slopes``: ALiBi, ``score - table[h] * |q_idx - kv_idx|``,
table [H] (every score of a head adds into one element).

Cases, each timing ``torch.autograd.grad`` of one forward's graph (the backward alone):
- ``q, k, v``: the table needs no grad (the variant's own backward);
- ``+ table, rows per thread``: fastpe's layout, each thread adds the table's gradient into its
  own float64 row (``kernels/numba/flex_attention.py: _gradient_rows``), summed after;
- ``+ table, rows per work item``: the alternative, one row per work item (batch × kv heads ×
  key splits), made here from the same generated module with the row chosen by the item.
Each round times every case once, in turn (bench/_interleaved.py); the table gives each case's
median time and its ratio to ``q, k, v`` per round, median [min, max]. Both layouts' gradients
are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics

import numba
import torch
from _interleaved import rounds
from fastpe.kernels.numba import flex_attention as kernels
from fastpe.kernels.numba._attention_tiles import key_splits

import fastpe
import fastpe.flex as flex

_BY_THREAD = "row = dcaps[get_thread_id()]"


def _per_item_layout(items):
    """Switch the backward to one gradient row per work item (returns the switch)."""
    layout = {"per_item": False}
    by_thread, modules = flex._variant_module, {}

    def variant_module(score, mask, reads=()):
        if not reads or not layout["per_item"]:
            return by_thread(score, mask, reads)
        key = (score, mask, reads)
        if key not in modules:
            source = kernels.module_source(*flex._variant_steps(score, mask, reads))
            assert _BY_THREAD in source
            modules[key] = kernels.load_variant(source.replace(_BY_THREAD, "row = dcaps[item]"))
        return modules[key]

    flex._variant_module = variant_module
    kernels._gradient_rows = lambda: items if layout["per_item"] else numba.get_num_threads()
    return layout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bias", choices=("relative", "full", "slopes"), default="relative")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    b, h, s, d = args.batch, args.heads, args.seq, args.dim
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(b, h, s, d, generator=g) for _ in range(4))
    shape = {"relative": (h, 2 * s), "full": (h, s, s), "slopes": (h,)}[args.bias]
    table = torch.rand(shape, generator=g)
    block_mask = fastpe.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None,
                                          None, s, s)  # fmt: skip
    threads = numba.get_num_threads()
    items = b * h * key_splits(b * h, -(-s // 128), threads)
    layout = _per_item_layout(items)

    def case(train_table, per_item):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        bias = table.clone().requires_grad_(train_table)

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + s]

        def full_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx]

        def alibi(score, b, h, q_idx, kv_idx):
            return score - bias[h] * torch.abs(q_idx - kv_idx)

        score_mod = {"relative": relative_bias, "full": full_bias, "slopes": alibi}[args.bias]
        out = fastpe.flex_attention(*leaves, score_mod, block_mask)
        inputs = [*leaves, bias] if train_table else leaves

        def backward():
            layout["per_item"] = per_item
            return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

        return backward

    named = {
        "q, k, v": case(False, False),
        "+ table, rows per thread": case(True, False),
        "+ table, rows per work item": case(True, True),
    }
    by_thread = named["+ table, rows per thread"]()[-1]
    by_item = named["+ table, rows per work item"]()[-1]
    difference = (by_thread - by_item).abs().max().item() / by_thread.abs().max().item()
    print(
        f"B{b} H{h} S{s} D{d} float32, causal, table {list(table.shape)}, {threads} threads: "
        f"rows per thread {threads}, per work item {items} (of {table.numel() * 8 / 2**20:.1f} "
        "MiB each); "
        f"layouts' gradients differ by {difference:.2g} (relative to the largest)"
    )
    table_times = rounds(named, args.rounds, args.calls)
    base = table_times["q, k, v"]
    print(f"{'case':32} {'median s':>9}  ratio to q, k, v: median [min, max]")
    for name, times in table_times.items():
        ratios = [t / t0 for t, t0 in zip(times, base, strict=True)]
        print(
            f"{name:32} {statistics.median(times):9.4f}  {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}, {max(ratios):.3f}]"
        )


if __name__ == "__main__":
    main()
