"""`fastpe bench` as a user meets it: one speedup definition shared with `fastpe report
--summary`, a run without torch or matplotlib, progress with time left, dtype aliases, the plot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fastpe import benchmarking as bm
from fastpe import cli


def _row(op, case, impl, median_s, mode="forward"):
    return {
        "op": op,
        "case": case,
        "seq": 512,
        "series": "",
        "mode": mode,
        "impl": impl,
        "median_s": median_s,
        "iqr_s": 0.0,
        "min_s": median_s,
        "runs": 5,
        "throughput": 1.0 / median_s,
        "unit": "GB/s",
        "fraction_of_peak": None,
        "max_abs_error": 0.0,
        "speedup_vs_best_baseline": None,
    }


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


# ---------------------------------------------------------------------------------------------
# Progress: elapsed time and an estimate of the time left, on stderr


def test_progress_estimates_time_left_per_op(monkeypatch):
    """A fake clock: each embed case takes 10 s, each apply_rope case 40 s (one implementation
    per case). The estimate counts a case at its op's mean so far, or at the mean of every case
    so far when none of its op has finished."""
    from fastpe.benchmarking import runner

    now = [0.0]
    seconds = {"embed": 10.0, "apply_rope": 40.0}

    def fake_time(fn, device):
        now[0] += seconds[fn.op]
        return runner.Timing(1.0, 0.0, 1.0, 3)

    def one_implementation(case, inputs, device, dtype):
        fn = lambda: None  # noqa: E731
        fn.op = case.op
        return {"fastpe[numba]": fn}

    monkeypatch.setattr(runner, "measure_peaks", lambda: {"sgemm_gflops": 1.0, "copy_gbps": 1.0})
    monkeypatch.setattr(runner, "make_inputs", lambda case, device, dtype: {})
    monkeypatch.setattr(runner, "reference", lambda case, inputs: None)
    monkeypatch.setattr(runner, "max_error", lambda case, result, expected: 0.0)
    monkeypatch.setattr(runner, "baselines_for", lambda op, device, dtype: ([], {}))
    monkeypatch.setattr(runner, "implementations", one_implementation)
    monkeypatch.setattr(runner, "time_callable", fake_time)
    monkeypatch.setattr(runner, "environment", lambda device, peaks: {})
    grid = [
        bm.Case("embed", "a", 1, {"batch": 1, "seq": 1, "vocab": 2, "dim": 2}),
        bm.Case("embed", "b", 1, {"batch": 1, "seq": 1, "vocab": 2, "dim": 2}),
        bm.Case("apply_rope", "c", 1, {"seq": 1, "q_heads": 1, "k_heads": 1, "dim": 2}),
        bm.Case("apply_rope", "d", 1, {"seq": 1, "q_heads": 1, "k_heads": 1, "dim": 2}),
    ]
    lines = []
    runner.run_benchmarks(grid, progress=lines.append, clock=lambda: now[0])
    assert lines == [
        "[1/4] embed a: fastpe[numba] ... 0 s elapsed",  # nothing finished: no estimate
        # embed b at embed's 10 s, c and d at the mean of every case so far (10 s)
        "[2/4] embed b: fastpe[numba] ... 10 s elapsed, ~30 s left",
        "[3/4] apply_rope c: fastpe[numba] ... 20 s elapsed, ~20 s left",
        # d at apply_rope's mean (40 s)
        "[4/4] apply_rope d: fastpe[numba] ... 1 min elapsed, ~40 s left",
    ]


def test_progress_when_a_case_runs_past_its_estimate():
    # embed took 10 s; the second embed case has run 25 s: it counts as about to end, and the
    # attention case after it keeps its estimate (10 s, the mean so far), rather than the whole
    # estimate (20 s) less 25 s, which would print "~0 s left" with a case still to run
    from fastpe.benchmarking import runner

    grid = [bm.Case("embed", "a", 1), bm.Case("embed", "b", 1), bm.Case("attention", "c", 1)]
    left = runner.time_left(grid, {"embed": [10.0]}, 2)
    assert left == (10.0, 10.0)
    assert runner._elapsed(lambda: 125.0, 0.0, 100.0, left) == "2 min elapsed, ~10 s left"
    assert runner._elapsed(lambda: 104.0, 0.0, 100.0, left) == "2 min elapsed, ~16 s left"


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.4, "0 s"),
        (35, "35 s"),
        (59.4, "59 s"),
        (60, "1 min"),
        (150, "3 min"),
        (3600, "1 h 00 min"),
        (3 * 3600 + 5 * 60 + 10, "3 h 05 min"),
    ],
)
def test_duration(seconds, text):
    from fastpe.benchmarking.runner import duration

    assert duration(seconds) == text


# ---------------------------------------------------------------------------------------------
# Without torch or matplotlib: fresh processes in which importing them fails as if they were not
# installed (a None in sys.modules makes `import` raise ModuleNotFoundError and
# importlib.util.find_spec return None, which is what an absent package does)

_BLOCKER = """
import os, sys
for name in os.environ["FASTPE_TEST_ABSENT"].split(","):
    sys.modules[name] = None
"""


def _bench_without(tmp_path, absent, *args):
    blocker = tmp_path / "absent"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "FASTPE_TEST_ABSENT": ",".join(absent)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker), env.get("PYTHONPATH")]))
    probe = "import importlib.util as u, sys; print([u.find_spec(m) for m in sys.argv[1:]])"
    check = subprocess.run(
        [sys.executable, "-c", probe, *absent],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert check.stdout.strip() == str([None] * len(absent)), check  # the blocker works
    return subprocess.run(
        [sys.executable, "-m", "fastpe", "bench", "--quick", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )


def test_bench_without_torch(tmp_path):
    # embed has a NumPy baseline that still runs; rope_table's only baseline needs torch
    done = _bench_without(tmp_path, ["torch"], "--ops", "rope_table", "embed", "--plot", "")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "torch is not installed: fastpe is timed on NumPy arrays" in done.stderr
    assert "pip install torch" in done.stderr
    assert "torch eager" in done.stderr and "nn.Embedding" in done.stderr
    rows = {
        (r["op"], r["impl"])
        for r in json.loads((tmp_path / "fastpe-bench.json").read_text())["results"]
    }
    assert rows == {("rope_table", "fastpe[numba]"), ("embed", "fastpe[numba]"), ("embed", "numpy")}
    out = done.stdout
    assert _line(out, "embed", "fastpe[numba]") and _line(out, "embed", "numpy")
    assert "torch eager not timed" in _line(out, "rope_table", "fastpe[numba]")
    skipped = "torch eager: needs torch, which is not installed (pip install torch)"
    assert f"skipped: rope_table 2048 x 128 {skipped}" in out
    # progress goes to stderr: the table on stdout stays clean
    assert "elapsed" in done.stderr and "elapsed" not in out


@pytest.mark.parametrize(
    "args, error",
    [
        (
            ["--modes", "backward"],
            "--modes backward: gradients are timed through torch autograd, "
            "and torch is not installed (pip install torch)",
        ),
        (
            ["--dtype", "bf16"],
            "--dtype bfloat16 needs torch (NumPy has no bfloat16): pip install torch",
        ),
        # "torch", or "torch and transformers" where transformers is not installed either
        (
            ["--ops", "generate"],
            "--ops generate: it runs transformers' model.generate(), which needs torch",
        ),
    ],
)
def test_bench_without_torch_refuses_what_needs_it(tmp_path, args, error):
    ops = [] if "--ops" in args else ["--ops", "embed"]
    done = _bench_without(tmp_path, ["torch"], *ops, *args, "--plot", "")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"fastpe bench: error: {error}")
    assert "pip install torch" in done.stderr
    assert not (tmp_path / "fastpe-bench.json").exists()  # refused before any timing


def test_bench_without_matplotlib(tmp_path):
    done = _bench_without(tmp_path, ["matplotlib"], "--ops", "rope_table")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "skipped: the plot, as matplotlib is not installed (pip install matplotlib)" in (
        done.stderr
    )
    assert "plot:    none (matplotlib is not installed: pip install matplotlib)" in done.stdout
    assert _line(done.stdout, "rope_table", "fastpe[numba]")
    assert json.loads((tmp_path / "fastpe-bench.json").read_text())["results"]
    assert not (tmp_path / "fastpe-bench.png").exists()


# ---------------------------------------------------------------------------------------------
# --dtype: the full names and their short forms


@pytest.mark.parametrize(
    "given, meant",
    [
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("fp32", "float32"),
        ("fp64", "float64"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
    ],
)
def test_bench_dtype_short_names(monkeypatch, tmp_path, given, meant):
    calls = []

    def run(grid, device="cpu", dtype="float32", progress=print):
        calls.append(dtype)
        return {"environment": {"machine": "test"}, "dtype": dtype, "results": []}

    monkeypatch.setattr(bm, "run_benchmarks", run)
    argv = ["bench", "--quick", "--device", "cpu", "--dtype", given, "--plot", ""]
    assert cli.main([*argv, "--json", str(tmp_path / "o.json")]) == 0
    assert calls == [meant]


@pytest.mark.parametrize("given", ["bf", "half", "BF16 ", "float"])
def test_bench_unknown_dtype_names_the_accepted_ones(monkeypatch, capsys, given):
    monkeypatch.setattr(bm, "run_benchmarks", lambda *a, **k: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--dtype", given])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert f"argument --dtype: invalid choice: {given!r}" in line
    for name in ("float32 (fp32)", "float64 (fp64)", "float16 (fp16)", "bfloat16 (bf16)"):
        assert name in line


# ---------------------------------------------------------------------------------------------
# The plot


def test_plot_has_a_panel_per_op_and_a_bar_per_row(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    fig = bm.plot(DOC, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title(loc="left") for ax in panels] == ["apply_rope", "embed"]
    for ax in panels:
        op = ax.get_title(loc="left")
        rows = [r for r in DOC["results"] if r["op"] == op]
        # a bar per row, as long as its throughput; no line drawn from one case to another
        assert sorted(p.get_width() for p in ax.patches) == sorted(r["throughput"] for r in rows)
        assert all(len(line.get_xdata()) <= 1 for line in ax.get_lines())
        assert [t.get_text() for t in ax.get_yticklabels()] == [rows[0]["case"]]
        assert "GB/s" in ax.get_xlabel()
        assert {t.get_text() for t in ax.get_legend().get_texts()} == {r["impl"] for r in rows}
    texts = [t.get_text() for t in panels[0].texts]
    assert any("15.00x vs transformers" in t for t in texts), texts
