"""`fastpe bench` as a user meets it: one speedup definition shared with `fastpe report
--summary`, a run without torch or matplotlib, progress with time left, dtype aliases, the plot."""

from __future__ import annotations

import json
import re

import pytest

from fastpe import benchmarking as bm
from fastpe import cli


def _row(op, case, impl, median_s, mode="forward"):
    return {"op": op, "case": case, "seq": 512, "series": "", "mode": mode, "impl": impl,
            "median_s": median_s, "iqr_s": 0.0, "min_s": median_s, "runs": 5,
            "throughput": 1.0 / median_s, "unit": "GB/s", "fraction_of_peak": None,
            "max_abs_error": 0.0, "speedup_vs_best_baseline": None}  # fmt: skip


# Known times: liger is the fastest baseline (1 ms), transformers (apply_rope's target) takes
# 30 ms, fastpe 2 ms. Against the target fastpe is 30 / 2 = 15x; against the best baseline it
# would be 1 / 2 = 0.5x, the ratio the bench table used to print beside the README's 15x.
# embed backward's target is nn.Embedding (12 ms / 4 ms = 3x), not torch eager (8 ms).
DOC = {
    "environment": {"machine": "test machine"},
    "dtype": "float32",
    "results": [
        _row("apply_rope", "q32+k8 S512 D128", "fastpe[numba]", 0.002),
        _row("apply_rope", "q32+k8 S512 D128", "transformers", 0.030),
        _row("apply_rope", "q32+k8 S512 D128", "liger", 0.001),
        _row("embed", "4x512 backward", "fastpe[numba]", 0.004, mode="backward"),
        _row("embed", "4x512 backward", "torch eager", 0.008, mode="backward"),
        _row("embed", "4x512 backward", "nn.Embedding", 0.012, mode="backward"),
    ],
}


def _cells(line):
    # markdown rows split at "|", the bench table's aligned columns at two or more spaces
    parts = line.split("|") if line.startswith("|") else re.split(r"\s{2,}", line)
    return [p.strip() for p in parts]


def _line(text, op, impl):
    """The one row of ``text`` for ``op`` and implementation ``impl``."""
    (line,) = [x for x in text.splitlines() if op in _cells(x) and impl in _cells(x)]
    return line


def test_bench_table_and_report_summary_print_the_same_speedup(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bm, "run_benchmarks", lambda *a, **k: json.loads(json.dumps(DOC)))
    out = tmp_path / "out.json"
    assert cli.main(["bench", "--quick", "--json", str(out), "--plot", ""]) == 0
    bench_out = capsys.readouterr().out
    assert cli.main(["report", "--summary", str(out)]) == 0
    summary = capsys.readouterr().out

    header = _line(bench_out, "op", "implementation")
    assert "speedup vs target baseline" in header and "best baseline" not in header
    rope = _line(bench_out, "apply_rope", "fastpe[numba]")
    assert "15.00x vs transformers" in rope and "0.50x" not in rope
    assert "(the baseline)" in _line(bench_out, "apply_rope", "transformers")
    assert "30.00x vs transformers" in _line(bench_out, "apply_rope", "liger")
    assert "3.00x vs nn.Embedding" in _line(bench_out, "embed", "fastpe[numba]")

    assert "| transformers | 15.00x |" in _line(summary, "apply_rope", "fastpe[numba]")
    assert "| nn.Embedding | 3.00x |" in _line(summary, "embed", "fastpe[numba]")


def test_speedup_when_the_target_baseline_was_not_timed():
    rows = [r for r in DOC["results"] if r["impl"] != "transformers"]
    fastpe_row = rows[0]
    assert bm.speedup_over_target(rows, fastpe_row) == ("transformers", None)
    table = bm.format_table({**DOC, "results": rows})
    assert "transformers not timed" in _line(table, "apply_rope", "fastpe[numba]")
