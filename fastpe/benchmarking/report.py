"""Presenting a results document (``run_benchmarks``' output, or a JSON file of it)."""

from __future__ import annotations

import json

from .baselines import target_baseline


def speedup_over_target(rows: list[dict], row: dict) -> tuple[str | None, float | None]:
    """(name, ratio): ``row``'s speedup over its op's target baseline in the same case and mode
    (``target_baseline``): the baseline's median time over the row's. The ratio is None when
    that baseline has no row in ``rows`` (not installed, or it cannot run the case); the name
    is None when the op has no target baseline. The bench table, ``fastpe report --summary`` and
    the plot all take their ratios from here, so they agree."""
    name = target_baseline(row["op"], row.get("mode", "forward"))
    base = next(
        (b for b in rows if (b["op"], b["case"], b["impl"]) == (row["op"], row["case"], name)),
        None,
    )
    return name, None if base is None else base["median_s"] / row["median_s"]


def _speedup_cell(rows: list[dict], row: dict) -> str:
    name, ratio = speedup_over_target(rows, row)
    if name is None:
        return ""
    if row["impl"] == name:
        return "(the baseline)"
    return f"{ratio:.2f}x vs {name}" if ratio is not None else f"{name} not timed"


SPEEDUP_HEADER = "speedup vs target baseline"


def format_table(doc: dict, markdown: bool = False) -> str:
    """Every row: median time (with the spread of the runs when recorded), throughput, fraction
    of peak, speedup over the op's target baseline (named in each cell), error vs the oracle."""
    rows = doc["results"]
    spread = any("iqr_s" in r for r in rows)  # absent from files of older versions
    head = ["op", "case", "implementation", "median", *(["IQR", "min"] if spread else []),
            "throughput", "% peak", SPEEDUP_HEADER, "max |err|"]  # fmt: skip
    lines = []
    for r in rows:
        frac = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        times = [
            _ms(r.get(k)) for k in (["median_s", "iqr_s", "min_s"] if spread else ["median_s"])
        ]
        lines.append([r["op"], r["case"], r["impl"], *times,
                      f"{r['throughput']:.1f} {r['unit']}", frac, _speedup_cell(rows, r),
                      f"{r['max_abs_error']:.1e}"])  # fmt: skip
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in lines])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*row) for row in lines])


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f} ms"


# A row's runs disagree too much for its median to be trusted when their interquartile range
# exceeds NOISY_IQR of the median, or when the median run took SLOW_MEDIAN times the fastest: on a
# contended machine the scheduler's time slices (~4-8 ms) get added to most runs, which moves the
# median by whole slices while the IQR can stay small.
NOISY_IQR = 0.25
SLOW_MEDIAN = 1.5


def caveats(doc: dict) -> list[str]:
    """One line per row whose timed runs spread widely (a busy or throttled machine), and per
    implementation that was skipped."""
    out = []
    for r in doc["results"]:
        iqr, fastest, median = r.get("iqr_s"), r.get("min_s"), r["median_s"]
        if iqr is None or fastest is None:  # files of older versions
            continue
        if iqr > NOISY_IQR * median or median > SLOW_MEDIAN * fastest:
            out.append(
                f"warning: {r['op']} {r['case']} {r['impl']}: noisy timing, IQR {iqr / median:.0%} "
                f"of the median {_ms(median)}, which is {median / fastest:.1f}x the fastest run "
                f"({_ms(fastest)}): the machine was busy or throttling; do not trust this row's "
                "ratios, rerun on an idle machine"
            )
    # an implementation skipped for the same reason in several cases of an op (a baseline whose
    # module is not installed skips every case) gets one line, not one per case
    groups: dict[tuple[str, str, str], list[str]] = {}
    for s in doc.get("skipped", []):
        groups.setdefault((s["op"], s["impl"], s["reason"]), []).append(s["case"])
    for (op, impl, reason), cases in groups.items():
        where = f"{op} {cases[0]}" if len(cases) == 1 else f"{op} ({len(cases)} cases)"
        out.append(f"skipped: {where} {impl}: {reason}")
    return out


def format_summary(doc: dict) -> str:
    """Markdown: per case, fastpe's throughput and its speedup over the target baseline."""
    out = [
        "| op | case | fastpe | throughput | % of peak | baseline | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = doc["results"]
    for r in rows:
        if not r["impl"].startswith("fastpe"):
            continue
        name, ratio = speedup_over_target(rows, r)
        speed = "" if ratio is None else f"{ratio:.2f}x"
        frac = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        out.append(
            f"| {r['op']} | {r['case']} | {r['impl']} | {r['throughput']:.1f} {r['unit']} | {frac} | {name or ''} | {speed} |"
        )
    return "\n".join(out)


def plot(doc: dict, path: str) -> None:
    """Throughput against sequence length, one panel per op, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in doc["results"]})
    cols = min(3, len(ops))
    nrows = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(ops) :]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops, strict=False):
        rows = [r for r in doc["results"] if r["op"] == op]
        for impl, series in sorted({(r["impl"], r.get("series", "")) for r in rows}):
            pts = sorted(
                (r["seq"], r["throughput"])
                for r in rows
                if (r["impl"], r.get("series", "")) == (impl, series)
            )
            style = "-" if impl.startswith("fastpe") else "--"
            label = f"{impl} {series}".strip()
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(rows[0]["unit"])
        ax.legend(fontsize=7)
    env = doc["environment"]
    fig.suptitle(f"fastpe on {env.get('gpu', env['machine'])}, {doc['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# What every row of a results document holds; the spread fields came later, so files of older
# versions lack them
_TEXT = ("op", "case", "impl", "unit")
_NUMBER = ("median_s", "throughput", "max_abs_error")
_NUMBER_OR_NULL = ("fraction_of_peak", "speedup_vs_best_baseline")
_SPREAD = ("iqr_s", "min_s", "runs")
_SKIPPED = ("op", "case", "impl", "reason")  # each entry of the optional "skipped" list


def _valid(key: str, value) -> bool:
    if key in _TEXT:
        return isinstance(value, str)
    if value is None:  # a single timed run (`--ops generate`) has no interquartile range
        return key in (*_NUMBER_OR_NULL, "iqr_s")
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    return value > 0 if key in ("median_s", "min_s") else True  # ratios divide by them


def load_results(path: str) -> dict:
    """A results document from a JSON file; ValueError (one line) when it cannot be read or is
    not a `fastpe bench` results file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path!r} is not JSON ({exc})") from None
    what = f"{path!r} is not a `fastpe bench` results file"
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise ValueError(f"{what}: expected an object with a 'results' list")
    for i, row in enumerate(doc["results"]):
        if not isinstance(row, dict):
            raise ValueError(f"{what}: results[{i}] is not an object")
        for key in (*_TEXT, *_NUMBER, *_NUMBER_OR_NULL, *_SPREAD):
            if key not in row:
                if key in _SPREAD:
                    continue
                raise ValueError(f"{what}: results[{i}] has no {key!r}")
            if not _valid(key, row[key]):
                raise ValueError(f"{what}: results[{i}][{key!r}] is {row[key]!r}")
    skipped = doc.get("skipped", [])
    if not isinstance(skipped, list) or not all(
        isinstance(s, dict) and all(isinstance(s.get(k), str) for k in _SKIPPED) for s in skipped
    ):
        raise ValueError(f"{what}: 'skipped' must list objects with {', '.join(_SKIPPED)}")
    return doc
