"""fastpe.flex_attention against fastpe.attention's built-in options and torch.compile(torch's
flex_attention), on the CPU.

    python bench/flex_attention.py [--seq 4096] [--heads 16] [--dim 64] [--dtype float32]
                                   [--rounds 5] [--calls 3] [--first-call CASE]

Patterns: sliding window (1024, causal), causal + soft-cap (30), document mask (8 documents,
causal), prefix-LM (prefix S/8). Each round times every (pattern, implementation) once, best of
``--calls`` calls, in turn (bench/_interleaved.py); the table gives, per pattern, each time's
median and the ratio of torch.compile's (or the built-in's) time to fastpe.flex_attention's,
taken per round: median [min, max]. The first call of each function (compiles) is untimed.

``--first-call CASE`` instead times, in this process, the first call of one case (``flex``:
flex_attention causal + soft-cap; ``flex-window``: flex_attention with a sliding-window mask;
``builtin``: attention(causal=True, softcap=30); ``torch`` and ``torch-window``:
torch.compile(flex_attention) on the ``flex`` and ``flex-window`` patterns) in CPU and wall
seconds: run it in a fresh process with an empty NUMBA_CACHE_DIR (``flex-window`` after ``flex``
on the same cache: a new variant once the shared steps are cached), and for ``torch`` cases
empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (``torch-window`` after ``torch``: a new
variant once inductor's own first compile is done).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings

import torch
from _interleaved import rounds

import fastpe


def _patterns(seq):
    doc_id = torch.repeat_interleave(torch.arange(8), seq // 8)
    prefix = torch.tensor([seq // 8])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)

    def document(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    return {
        "sliding window 1024": (None, window, dict(causal=True, window=(1023, 0))),
        "causal + softcap 30": (softcap, causal, dict(causal=True, softcap=30.0)),
        "document mask (8 docs)": (None, document, None),
        "prefix-LM (S/8)": (None, prefix_lm, None),
    }


def _first_call(case, q, k, v):
    def cpu():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    seq = q.shape[2]
    wall, used = time.perf_counter(), cpu()
    if case != "builtin":
        pattern = "sliding window 1024" if case.endswith("-window") else "causal + softcap 30"
        score_mod, mask_mod, _ = _patterns(seq)[pattern]
    if case.startswith("flex"):
        block_mask = fastpe.create_block_mask(mask_mod, None, None, seq, seq)
        fastpe.flex_attention(q, k, v, score_mod, block_mask)
    elif case.startswith("torch"):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cpu")
        torch.compile(flex_attention)(q, k, v, score_mod, block_mask)
    else:
        fastpe.attention(q, k, v, causal=True, softcap=30.0)
    print(
        f"first call of {case}: CPU {cpu() - used:.1f} s, wall {time.perf_counter() - wall:.1f} s"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument(
        "--first-call", choices=["flex", "flex-window", "builtin", "torch", "torch-window"]
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, args.heads, args.seq, args.dim, generator=g).to(dtype) for _ in range(3)
    )
    if args.first_call:
        _first_call(args.first_call, q, k, v)
        return
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    named, groups = {}, {}
    for pattern, (score_mod, mask_mod, builtin) in _patterns(args.seq).items():
        ours = fastpe.create_block_mask(mask_mod, None, None, args.seq, args.seq)
        theirs = create_block_mask(mask_mod, None, None, args.seq, args.seq, device="cpu")
        names = [f"{pattern}: fastpe.flex_attention", f"{pattern}: torch.compile(flex)"]
        named[names[0]] = lambda s=score_mod, m=ours: fastpe.flex_attention(q, k, v, s, m)
        named[names[1]] = lambda s=score_mod, m=theirs: compiled(q, k, v, s, m)
        if builtin is not None:
            names.append(f"{pattern}: fastpe.attention built-in")
            named[names[2]] = lambda o=builtin: fastpe.attention(q, k, v, **o)
        groups[pattern] = names
    table = rounds(named, args.rounds, args.calls)
    print(
        f"B1 H{args.heads} S{args.seq} D{args.dim} {args.dtype}, {args.rounds} interleaved "
        f"rounds, best of {args.calls} calls each; torch {torch.__version__}"
    )
    print("| pattern | implementation | median ms | time / flex_attention's: median [min, max] |")
    print("|---|---|---|---|")
    for pattern, names in groups.items():
        ours = table[names[0]]
        for name in names:
            ratios = [t / o for t, o in zip(table[name], ours, strict=True)]
            print(
                f"| {pattern} | {name.split(': ')[1]} | {1e3 * statistics.median(table[name]):.1f}"
                f" | {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] |"
            )


if __name__ == "__main__":
    main()
