"""The command line: bad arguments and files give one-line errors (exit 2) before any benchmarking;
dtypes a baseline cannot take are skipped; timings carry their spread and noisy ones warn."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

from fastpe import benchmarking as bm
from fastpe import cli
from fastpe.benchmarking import runner

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
TINY = [c for c in bm.SMOKE_GRID if c.op in ("embed", "apply_rope") and c.mode == "forward"]


def _row(impl="fastpe[numba]", **extra):
    row = {
        "op": "embed",
        "case": "2x16",
        "seq": 16,
        "series": "",
        "impl": impl,
        "median_s": 0.010,
        "throughput": 1.0,
        "unit": "GB/s",
        "fraction_of_peak": None,
        "max_abs_error": 0.0,
        "speedup_vs_best_baseline": None,
    }
    return {**row, **extra}


@pytest.fixture
def no_run(monkeypatch):
    """Replaces the benchmark run with a recorder: errors must come before it is reached."""
    calls = []

    def run(grid, device="cpu", dtype="float32", progress=print):
        calls.append((grid, device, dtype))
        return {"environment": {"machine": "test"}, "dtype": dtype, "results": [_row()]}

    monkeypatch.setattr(bm, "run_benchmarks", run)
    return calls


@pytest.fixture
def fast_peaks(monkeypatch):
    monkeypatch.setattr(runner, "measure_peaks", lambda: {"sgemm_gflops": 1.0, "copy_gbps": 1.0})


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err
    return err


# ---------------------------------------------------------------------------------------------
# fastpe report


def test_report_reads_a_single_run_row(tmp_path, capsys):
    """`fastpe bench --ops generate` times each case once: its rows carry iqr_s = null, and the
    report must print them (it refused the file)."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": [_row(iqr_s=None, min_s=0.010, runs=1)]}))
    assert cli.main(["report", str(path)]) == 0
    assert "| embed | 2x16 | fastpe[numba] | 10.00 ms |  | 10.00 ms |" in capsys.readouterr().out


def test_report_missing_file(tmp_path, capsys):
    path = tmp_path / "absent.json"
    assert cli.main(["report", str(path)]) == 2
    _one_line_error(capsys, str(path), "No such file")


def test_report_not_json(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text("| op | case |\n")
    assert cli.main(["report", str(path)]) == 2
    _one_line_error(capsys, str(path), "not JSON")


@pytest.mark.parametrize(
    "doc, words",
    [
        ([1, 2], ["'results' list"]),
        ({"results": {"op": "embed"}}, ["'results' list"]),
        ({"results": ["embed"]}, ["results[0] is not an object"]),
        (
            {"results": [_row(), {k: v for k, v in _row().items() if k != "median_s"}]},
            ["results[1] has no 'median_s'"],
        ),
        ({"results": [_row(median_s="10 ms")]}, ["results[0]['median_s']", "'10 ms'"]),
        ({"results": [_row(median_s=0.0)]}, ["results[0]['median_s']"]),
        ({"results": [_row(throughput=None)]}, ["results[0]['throughput']"]),
        ({"results": [_row(iqr_s="1 ms", min_s=0.001)]}, ["results[0]['iqr_s']"]),
        ({"results": [_row(iqr_s=0.001, min_s=0)]}, ["results[0]['min_s']"]),
        ({"results": [_row()], "skipped": [{"impl": "numpy"}]}, ["'skipped'"]),
    ],
)
def test_report_wrong_schema(tmp_path, capsys, doc, words):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    for extra in ([], ["--summary"]):
        assert cli.main(["report", *extra, str(path)]) == 2
        _one_line_error(capsys, "not a `fastpe bench` results file", *words)


def test_report_reads_files_without_spread(capsys):
    # written before rows carried iqr_s/min_s; its .md was printed by `fastpe report` back then
    path = RESULTS / "cpu-2core-avx512.json"
    assert "iqr_s" not in path.read_text()
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == (RESULTS / "cpu-2core-avx512.md").read_text().strip()
    assert out.err == ""
    assert cli.main(["report", "--summary", str(path)]) == 0
    assert "| embed | 8x512 vocab 32000 d1024 | fastpe[numba] |" in capsys.readouterr().out


def test_report_shows_spread_and_warns_on_noisy_rows(tmp_path, capsys):
    doc = {
        "results": [
            _row("fastpe[numba]", iqr_s=0.004, min_s=0.009),  # IQR 40% of the median: noisy
            _row("numpy", iqr_s=0.001, min_s=0.009),  # IQR 10%, median 1.1x the fastest: fine
            # most runs one 8 ms time slice late: IQR 0, median twice the fastest run
            _row("torch eager", median_s=0.016, iqr_s=0.0, min_s=0.008),
        ]
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr()
    head, _, first, second, third = out.out.splitlines()
    assert "| median | IQR | min |" in head
    assert "| 10.00 ms | 4.00 ms | 9.00 ms |" in first
    assert "| 10.00 ms | 1.00 ms | 9.00 ms |" in second
    assert "| 16.00 ms | 0.00 ms | 8.00 ms |" in third
    iqr, slices = out.err.splitlines()
    assert iqr.startswith("warning: embed 2x16 fastpe[numba]: noisy timing, IQR 40% of the median")
    assert slices.startswith("warning: embed 2x16 torch eager: noisy timing, IQR 0% of the median")
    assert "2.0x the fastest run (8.00 ms)" in slices


# ---------------------------------------------------------------------------------------------
# fastpe bench: arguments checked before the run


@pytest.mark.parametrize("dtype", ["foo", "int8", "float"])
def test_bench_rejects_unknown_dtype(no_run, capsys, dtype):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--dtype", dtype])
    assert exc.value.code == 2
    assert f"invalid choice: '{dtype}'" in capsys.readouterr().err
    assert no_run == []


@pytest.mark.parametrize("device", ["foo", "cpu:1", "cuda:x", "tpu"])
def test_bench_rejects_unknown_device(no_run, capsys, device):
    assert cli.main(["bench", "--device", device, "--plot", ""]) == 2
    _one_line_error(capsys, f"--device {device!r}", "expected cpu or cuda[:N]")
    assert no_run == []


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_bench_cuda_without_gpu(no_run, capsys, monkeypatch, device):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli.main(["bench", "--device", device, "--plot", ""]) == 2
    _one_line_error(capsys, f"--device {device!r}", "no CUDA GPU")
    assert no_run == []


def test_bench_without_a_runnable_fastpe_backend(no_run, capsys, monkeypatch):
    # a run timing only baselines has nothing to report
    monkeypatch.setattr(runner, "fastpe_backends", lambda device_type=None: {"numba": "not here"})
    assert cli.main(["bench", "--device", "cpu", "--plot", ""]) == 2
    _one_line_error(capsys, "--device 'cpu'", "numba: not here")
    assert no_run == []


def test_bench_unwritable_json(no_run, capsys, tmp_path):
    path = tmp_path / "missing-dir" / "out.json"
    assert cli.main(["bench", "--json", str(path), "--plot", ""]) == 2
    _one_line_error(capsys, "--json", str(path))
    assert no_run == []
    assert cli.main(["bench", "--json", str(tmp_path), "--plot", ""]) == 2
    _one_line_error(capsys, "--json", "is a directory")
    assert no_run == []


def test_bench_unwritable_plot(no_run, capsys, tmp_path):
    out = tmp_path / "out.json"
    plot = tmp_path / "missing-dir" / "out.png"
    assert cli.main(["bench", "--json", str(out), "--plot", str(plot)]) == 2
    _one_line_error(capsys, "--plot", str(plot))
    assert no_run == []
    assert not out.exists()  # the check left nothing behind


def test_bench_plot_format_checked_first(no_run, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "out.xyz"
    assert cli.main(["bench", "--json", str(tmp_path / "o.json"), "--plot", str(plot)]) == 2
    _one_line_error(capsys, "--plot", ".xyz")
    assert no_run == []


def test_bench_keeps_an_existing_json_until_the_run_ends(no_run, tmp_path):
    out = tmp_path / "out.json"
    out.write_text("old")
    assert cli.main(["bench", "--json", str(out), "--plot", ""]) == 0
    assert len(no_run) == 1
    assert json.loads(out.read_text())["results"] == [_row()]


def test_bench_cases_picks_cases_by_name(no_run, tmp_path, capsys):
    argv = ["bench", "--json", str(tmp_path / "o.json"), "--plot", ""]
    assert cli.main([*argv, "--ops", "attention", "--cases", "Sq1 ", "one token"]) == 0
    names = [c.name for c in no_run[0][0]]
    assert names and all(c.op == "attention" and "Sq1 " in c.name for c in no_run[0][0]), names
    assert cli.main([*argv, "--cases", "no such case"]) == 2
    _one_line_error(capsys, "--cases", "no such case")
    assert len(no_run) == 1


# ---------------------------------------------------------------------------------------------
# fastpe bench: dtypes and timing spread, on tiny cases


def test_bench_bfloat16_on_cpu_skips_numpy(monkeypatch, fast_peaks, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bm, "QUICK_GRID", TINY)
    out = tmp_path / "out.json"
    argv = ["bench", "--quick", "--device", "cpu", "--dtype", "bfloat16", "--json", str(out)]
    assert cli.main([*argv, "--plot", ""]) == 0
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "bfloat16"
    rows = {(r["op"], r["impl"]): r for r in doc["results"]}
    assert ("embed", "numpy") not in rows
    assert {("embed", "fastpe[numba]"), ("apply_rope", "fastpe[numba]")} <= set(rows)
    for case in TINY:
        expected = bm.reference(case, bm.make_inputs(case, "cpu", "bfloat16"))
        parts = expected if isinstance(expected, tuple) else (expected,)
        largest = max(float(e.double().abs().max()) for e in parts)
        error = rows[(case.op, "fastpe[numba]")]["max_abs_error"]
        # fastpe rounds once to bfloat16 (8 significant bits), as does the oracle's answer
        assert math.isfinite(error) and error <= 2**-7 * largest, (case.name, error, largest)
        # memory-bound rates count the bytes a bfloat16 element really takes (they counted 4)
        row = rows[(case.op, "fastpe[numba]")]
        amount, unit = bm.work(case, itemsize=torch.bfloat16.itemsize)
        assert unit == "GB/s" and row["throughput"] == pytest.approx(amount / row["median_s"] / 1e9)
    (skip,) = doc["skipped"]
    assert skip["op"] == "embed" and skip["impl"] == "numpy" and "bfloat16" in skip["reason"]
    assert "skipped: embed 2x16 vocab 100 d32 numpy: " in capsys.readouterr().out


def test_bench_backward_and_full_modes(monkeypatch, fast_peaks, tmp_path):
    pytest.importorskip("torch")
    attention = [c for c in bm.SMOKE_GRID if c.op == "attention" and c.mode == "forward"]
    monkeypatch.setattr(bm, "QUICK_GRID", TINY + attention)
    out = tmp_path / "out.json"
    argv = [
        "bench",
        "--quick",
        "--device",
        "cpu",
        "--modes",
        "backward",
        "full",
        "--json",
        str(out),
    ]
    assert cli.main([*argv, "--plot", ""]) == 0
    doc = json.loads(out.read_text())
    modes = {(r["op"], r["mode"]) for r in doc["results"]}
    # every op with a backward, in the modes asked (and not forward: not asked)
    ops = ("apply_rope", "embed", "attention")
    assert modes == {(op, m) for op in ops for m in ("backward", "full")}
    for r in doc["results"]:
        assert r["case"].endswith(r["mode"]) and r["max_abs_error"] < 1e-4, r
    timed = {(r["case"], r["impl"]) for r in doc["results"] if r["op"] == "attention"}
    for mode in ("backward", "full"):  # SDPA under autograd is the baseline
        assert (f"B1 H4/2 Sq32 Sk32 D16 causal {mode}", "torch SDPA") in timed
        assert (f"B1 H4/2 Sq32 Sk32 D16 causal {mode}", "fastpe[numba]") in timed
    sdpa_refused = "SDPA has no softcap or sinks"
    assert {(s["impl"], s["reason"]) for s in doc["skipped"]} == {
        ("numpy", "NumPy has no autograd"),
        ("torch SDPA", sdpa_refused),
    }
    summary = bm.format_summary(doc)
    assert "| embed | 2x16 vocab 100 d32 backward | fastpe[numba] |" in summary
    assert "| nn.Embedding |" in summary and "| transformers |" in summary
    assert "| attention | B1 H4/2 Sq32 Sk32 D16 causal full | fastpe[numba] |" in summary


@pytest.mark.parametrize("causal", [False, True])
def test_bench_attention_gradient_reference_is_the_oracle_sliced(causal):
    # The bench checks attention's gradients against the oracle on batch 0 / kv head 0 only; that
    # slice must equal the slice of the whole call's gradients (independent of the timed kernels:
    # torch autograd through plain float64 softmax attention), and a wrong gradient must show.
    torch = pytest.importorskip("torch")
    case = bm.with_mode(bm.cases._attn(2, 6, 2, 5, 7, 4, causal), "backward")
    inputs = bm.make_inputs(case, dtype="float64")
    expected = bm.reference(case, inputs)
    q, k, v = (inputs[n].clone().requires_grad_() for n in ("q", "k", "v"))
    kk, vv = (t.repeat_interleave(3, dim=1) for t in (k, v))
    scores = q @ kk.transpose(-1, -2) / math.sqrt(4)
    if causal:  # bottom-right: query i sees keys up to i + Sk - Sq
        visible = torch.ones(5, 7, dtype=torch.bool).tril(7 - 5)
        scores = scores.masked_fill(~visible, -math.inf)
    out = scores.softmax(-1) @ vv
    (upstream,) = bm.cases.upstream_gradients([out.shape], out)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    assert bm.max_error(case, grads, expected) < 1e-12
    wrong = (grads[0], grads[1], grads[2] * 1.01)
    assert bm.max_error(case, wrong, expected) > 1e-4


def test_bench_skips_a_fastpe_backend_that_refuses_the_dtype(
    monkeypatch, fast_peaks, tmp_path, capsys
):
    # Triton's kernels compute in float32 and its capability table refuses float64 (it runs here
    # through TRITON_INTERPRET=1 when installed, and is refused as not installed otherwise)
    pytest.importorskip("torch")
    backends = {"numba": None, "triton": None}
    monkeypatch.setattr(runner, "fastpe_backends", lambda device_type=None: backends)
    monkeypatch.setattr(bm, "QUICK_GRID", TINY[:1])
    out = tmp_path / "out.json"
    argv = ["bench", "--quick", "--device", "cpu", "--dtype", "float64", "--json", str(out)]
    assert cli.main([*argv, "--plot", ""]) == 0
    doc = json.loads(out.read_text())
    impls = [r["impl"] for r in doc["results"]]
    assert "fastpe[numba]" in impls and "fastpe[triton]" not in impls
    (skip,) = doc["skipped"]
    assert skip["impl"] == "fastpe[triton]" and "triton" in skip["reason"]
    assert "\n" not in skip["reason"]
    assert f"skipped: {TINY[0].name} fastpe[triton]: " in capsys.readouterr().out


def test_time_callable_records_spread(monkeypatch):
    # a fake clock: calls alternate between 8 ms and 1 ms, as on a contended machine
    clock = {"now": 0.0, "calls": 0}
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock["now"])

    def fn():
        clock["now"] += 0.008 if clock["calls"] % 2 else 0.001
        clock["calls"] += 1

    timing = runner.time_callable(fn, min_time=0.05)
    times = [0.008 if i % 2 else 0.001 for i in range(1, clock["calls"])]  # after the warm-up
    assert timing.runs == len(times) >= 3
    q1, q3 = np.percentile(times, [25, 75])
    assert timing.iqr == pytest.approx(q3 - q1)
    assert timing.median == pytest.approx(np.median(times))
    assert timing.min == pytest.approx(0.001)


def test_bench_rows_carry_spread_and_noisy_rows_warn(monkeypatch, fast_peaks, tmp_path, capsys):
    pytest.importorskip("torch")
    times = [0.008, 0.008, 0.016, 0.008, 0.016, 0.024, 0.008]  # medians snapping to 8 ms steps
    monkeypatch.setattr(runner, "time_callable", lambda fn, device: runner.Timing.of(times))
    monkeypatch.setattr(bm, "QUICK_GRID", TINY[:1])
    out = tmp_path / "out.json"
    assert cli.main(["bench", "--quick", "--device", "cpu", "--json", str(out), "--plot", ""]) == 0
    doc = json.loads(out.read_text())
    q1, q3 = np.percentile(times, [25, 75])
    for r in doc["results"]:
        assert r["median_s"] == pytest.approx(0.008)
        assert r["iqr_s"] == pytest.approx(q3 - q1) and r["min_s"] == pytest.approx(0.008)
        assert r["runs"] == len(times)
    printed = capsys.readouterr().out
    (header,) = [line for line in printed.splitlines() if line.startswith("op ")]
    assert header.split()[3:6] == ["median", "IQR", "min"]
    noisy = [line for line in printed.splitlines() if line.startswith("warning:")]
    assert len(noisy) == len(doc["results"]) >= 2
    assert cli.main(["report", str(out)]) == 0  # the new fields read back
    assert len(capsys.readouterr().err.splitlines()) == len(doc["results"])


def test_help_lists_every_command_and_choice(capsys):
    texts = {}
    for command in ("", "bench", "report"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"] if command else ["--help"])
        assert exc.value.code == 0
        texts[command] = capsys.readouterr().out
    for command in ("info", "demo", "bench", "report"):
        assert f"    {command} " in texts[""]
    for word in (*cli.DTYPES, *bm.OPS):
        assert word in texts["bench"]
    for op, baseline in bm.TARGET_BASELINE.items():
        assert f"{op}: {baseline}" in " ".join(texts["report"].split())


def test_triton_report_rejects_unknown_target_kernel_and_unwritable_path(capsys, tmp_path):
    """Refused before any compilation starts (the sweep takes minutes)."""
    from fastpe import triton_report

    if triton_report.unavailable():
        pytest.skip(triton_report.unavailable())
    assert cli.main(["triton-report", "--targets", "75"]) == 2
    assert "--targets: unknown [75]; known: 80, 90, 100, 120" in capsys.readouterr().err
    assert cli.main(["triton-report", "--kernels", "attention", "flash"]) == 2
    assert "--kernels: unknown ['flash']; known: sinusoidal_table" in capsys.readouterr().err
    assert cli.main(["triton-report", "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and "is a directory" in err
