"""apply_rope and embed in bfloat16, float16 and float32 on the CPU, against this machine's copy
bandwidth and against other implementations, in one run (interleaved rounds, median [min, max]).

    python bench/half_bandwidth.py [--rounds 7] [--threads 1] [--dtypes bfloat16 float16 float32]

(IPEX's rotary is timed where intel_extension_for_pytorch imports: it needs its own torch, so
run the same command from a venv that has it, with fastpe installed there too.)

Cases (layout "bshd", D 128, B 1 unless said):
- rope q: ``apply_rope(q)`` to a new tensor, q [1, S, 32, 128], S 1024 and 4096 — against the
  transformers eager formula in torch (``q * cos + rotate_half(q) * sin``, cos/sin [S, D]) and
  ``q.clone()``, the floor of any op that returns a new tensor (the copy writes a warm buffer);
- rope qk inplace: ``apply_rope((q, k), inplace=True)``, k with 8 heads — against IPEX's
  ``ipex.llm.functional.rotary_embedding(q, k, sin, cos, 128, True, positions)`` (in place,
  cos/sin [P, 64] tables) and the IPEX operator alone (``torch_ipex.rotary_position_embedding``
  on q and k, float32 sin/cos prepared once);
- rope one token: the same in place on one token at position 1000 (a decode step);
- embed: ``embed(ids, weight, scale=32)`` with sinusoidal PE, B 8, S 512, vocab 32000, D 1024 —
  against torch eager ``weight[ids] * 32 + pe_table[positions]``.

Copy bandwidth: ``dst.copy_(src)`` (torch) of the bytes the op reads and writes once (q, or q
and k), and for embed the gather alone, ``torch.index_select(weight, 0, ids, out=...)`` (the
same rows from the same places), in the same round: "% copy" is
copy time / op time, the op's bytes per second as a fraction of the copy's. Each round times
every implementation once (best of --calls), so machine noise hits them alike; ratios are per
round (other / fastpe: above 1 means fastpe is faster).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import numba
import torch
from _interleaved import rounds
from fastpe.kernels.numba._runtime import threading_layer

import fastpe


def spread(values, fmt):
    return f"{fmt(statistics.median(values))} [{fmt(min(values))}, {fmt(max(values))}]"


def report(title, table, copy):
    print(f"  {title}")
    for name, times in table.items():
        if name == copy:
            continue
        line = f"    {name:<26} {spread([t * 1e3 for t in times], '{:7.3f} ms'.format)}"
        if copy is not None:
            pct = [c / t for c, t in zip(table[copy], times, strict=True)]
            line += f"   {spread(pct, '{:4.0%}'.format)} of copy"
        if name != "fastpe":
            ratio = [t / f for t, f in zip(times, table["fastpe"], strict=True)]
            line += f"   {spread(ratio, '{:.2f}x'.format)} vs fastpe"
        print(line)
    if copy is not None:
        print(
            f"    {'(copy of the same bytes)':<26} {spread([t * 1e3 for t in table[copy]], '{:7.3f} ms'.format)}"
        )


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cases(args, ipex, dtype, seq, cos, sin):
    d, hq, hk = 128, 32, 8
    q = torch.randn(1, seq, hq, d).to(dtype)
    k = torch.randn(1, seq, hk, d).to(dtype)
    src, dst = torch.empty_like(q).copy_(q), torch.empty_like(q)
    c, s = torch.cat((cos, cos), -1)[:seq, None], torch.cat((sin, sin), -1)[:seq, None]
    named = {
        "copy": lambda: dst.copy_(src),
        "fastpe": lambda: fastpe.apply_rope(q, cos, sin, layout="bshd"),
        "transformers formula": lambda: q * c + rotate_half(q) * s,
        "torch clone": lambda: q.clone(),  # a new tensor's allocation and first touch, copied
    }
    report(f"rope q, S {seq}", rounds(named, args.rounds, args.calls), "copy")
    qk = torch.cat((q, k), 2)
    src2, dst2 = torch.empty_like(qk).copy_(qk), torch.empty_like(qk)
    pos = torch.arange(seq)[None]
    sin_cos32 = torch.cat((sin, cos), -1).float().contiguous()  # IPEX's operator format
    named = {
        "copy": lambda: dst2.copy_(src2),
        "fastpe": lambda: fastpe.apply_rope((q, k), cos, sin, layout="bshd", inplace=True),
    }
    if ipex is not None:
        named["ipex rotary_embedding"] = lambda: ipex.llm.functional.rotary_embedding(
            q, k, sin, cos, d, True, pos
        )
        named["ipex operator (q, k)"] = lambda: [
            torch.ops.torch_ipex.rotary_position_embedding(
                x, sin_cos32, pos, x.shape[2], d, d // 2, d
            )
            for x in (q, k)
        ]
    report(f"rope (q, k) inplace, S {seq}", rounds(named, args.rounds, args.calls), "copy")


def one_token_case(args, ipex, dtype, cos, sin):
    d = 128
    q, k = torch.randn(1, 1, 32, d).to(dtype), torch.randn(1, 1, 8, d).to(dtype)
    pos = torch.tensor([[1000]])
    named = {
        "fastpe": lambda: fastpe.apply_rope(
            (q, k), cos, sin, positions=pos, layout="bshd", inplace=True
        )
    }
    if ipex is not None:
        named["ipex rotary_embedding"] = lambda: ipex.llm.functional.rotary_embedding(
            q, k, sin, cos, d, True, pos
        )
    report("rope (q, k) inplace, one token", rounds(named, args.rounds, 50), None)


def embed_case(args, dtype):
    b, seq, vocab, dim = 8, 512, 32000, 1024
    weight = torch.randn(vocab, dim).to(dtype)
    ids = torch.randint(0, vocab, (b, seq))
    positions = torch.arange(seq).expand(b, seq)
    table = fastpe.sinusoidal_table(seq, dim, dtype=dtype, device="cpu")
    gathered = torch.empty(b * seq, dim, dtype=dtype)
    flat_ids = ids.reshape(-1)
    named = {
        "copy": lambda: torch.index_select(weight, 0, flat_ids, out=gathered),
        "fastpe": lambda: fastpe.embed(ids, weight, scale=32.0),
        "torch eager": lambda: weight[ids] * 32.0 + table[positions],
    }
    title = f"embed B{b} S{seq} vocab {vocab} D{dim}, sinusoidal"
    report(title, rounds(named, args.rounds, args.calls), "copy")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="calls per round (best is kept)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch and Numba threads (0: default)"
    )
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[1024, 4096])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError:
        ipex = None
    print(f"load average {os.getloadavg()}, {platform.processor() or platform.machine()}")
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numba {numba.__version__}"
        f" ({numba.get_num_threads()} threads, layer {threading_layer()}), "
        f"ipex {ipex.__version__ if ipex else 'not installed'}"
    )
    torch.manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        print(f"\n== {name}")
        cos, sin = fastpe.rope_table(4096, 128, dtype=dtype, device="cpu")
        for seq in args.seqs:
            rope_cases(args, ipex, dtype, seq, cos, sin)
        one_token_case(args, ipex, dtype, cos, sin)
        embed_case(args, dtype)
    print(f"\nload average {os.getloadavg()}")


if __name__ == "__main__":
    main()
