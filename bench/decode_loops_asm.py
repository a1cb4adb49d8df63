"""The machine code of the paged decode's multiply loops, per cache dtype: is the widening
vectorised, how wide are the loads, what else runs per element.

    python bench/decode_loops_asm.py

Compiles ``_scores_rows`` and ``_add_values_rows`` (kernels/numba/attention_paged.py) for
bfloat16 (uint16 bits), float8_e4m3fn (uint8 bits) and int8 cache runs [n, H, D], C-contiguous,
with the kernels' fastmath flags, for this machine's CPU (uncached, so that Numba keeps the
assembly), and prints for each the innermost loop that holds the most vector multiply-adds: its
instruction count, how many are vector FMAs, and its instruction mix, with the elements of the
cache one pass of the loop reads.
"""

from __future__ import annotations

import collections
import re

import numba
from fastpe.kernels.numba._attention_common import _FLAGS
from fastpe.kernels.numba.attention_paged import _add_values_rows, _scores_rows
from llvmlite import binding as llvm

LABEL = re.compile(r"^(\.LBB\w+|\w+):")


def hottest_loop(asm: str) -> list[str]:
    """The basic block that branches back to itself with the most packed FMAs."""
    blocks, label, body = [], None, []
    for line in asm.splitlines():
        match = LABEL.match(line)
        if match:
            blocks.append((label, body))
            label, body = match.group(1), []
        elif re.match(r"^\s+[a-z]", line) and not line.strip().startswith("."):
            body.append(line.split("#")[0].strip())
    blocks.append((label, body))
    # a loop: a block that branches back to its own label (what follows the branch is not)
    loops = []
    for lab, body in blocks:
        back = [n for n, i in enumerate(body) if lab and i.split()[-1] == lab]
        if back:
            loops.append(body[: back[0] + 1])
    return max(loops, key=lambda b: sum(i.startswith("vfmadd") and "ps" in i for i in b))


def main() -> None:
    f32 = numba.float32
    print(f"CPU {llvm.get_host_cpu_name()}, Numba's target: {numba.config.CPU_NAME or 'host'}")
    for name, dtype, size in (
        ("bf16", numba.uint16, 2),
        ("fp8", numba.uint8, 1),
        ("int8", numba.int8, 1),
    ):
        rows = dtype[:, :, ::1]
        loops = (
            (_scores_rows, (f32[:, ::1], rows, numba.intp, f32[:, ::1], numba.intp), 2),
            (_add_values_rows, (f32[:, ::1], numba.intp, rows, numba.intp, f32[:, ::1]), 4),
        )
        for kernel, signature, keys in loops:
            fresh = numba.njit(fastmath=_FLAGS)(kernel.py_func)
            fresh.compile(signature)
            body = hottest_loop(fresh.inspect_asm(signature))
            ops = collections.Counter(i.split()[0] for i in body)
            fmas = sum(n for op, n in ops.items() if op.startswith("vfmadd") and op.endswith("ps"))
            loads = [i for i in body if i.split()[0] in ("vpmovzxwd", "vpmovsxbd", "vpmovsxbw")]
            lanes = 8  # float32 lanes of a ymm register: the loops' vector width on AVX2
            elements = keys * lanes
            print(
                f"{name:4s} {kernel.py_func.__name__:17s} {len(body):3d} instructions, "
                f"{fmas:2d} vector FMAs per {elements} cache elements "
                f"({len(body) / elements:.2f} instructions/element); "
                f"widening loads {sorted(set(i.split()[0] for i in loads))} "
                f"({size}-byte elements)"
            )
            print("     " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
