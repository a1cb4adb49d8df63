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
        (b for b in rows if (b["op"], b["case"], b["impl"]) == (row["op"], row["case"], name)), None
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
    head = [
        "op",
        "case",
        "implementation",
        "median",
        *(["IQR", "min"] if spread else []),
        "throughput",
        "% peak",
        SPEEDUP_HEADER,
        "max |err|",
    ]
    lines = []
    for r in rows:
        frac = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        times = [
            _ms(r.get(k)) for k in (["median_s", "iqr_s", "min_s"] if spread else ["median_s"])
        ]
        lines.append(
            [
                r["op"],
                r["case"],
                r["impl"],
                *times,
                f"{r['throughput']:.1f} {r['unit']}",
                frac,
                _speedup_cell(rows, r),
                f"{r['max_abs_error']:.1e}",
            ]
        )
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


def plot(doc: dict, path: str):
    """Throughput per case as horizontal bars, one panel per op (cases of an op share its unit;
    different ops' do not), one bar per implementation, fastpe's bars labelled with their
    speedup over the op's target baseline (``speedup_over_target``). Bars rather than lines:
    the cases of a panel differ in more than their length, and a line between two of them would
    suggest a trend that isn't there. Writes ``path`` (format from its extension) and returns the
    figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    ops = list(dict.fromkeys(r["op"] for r in rows))  # the grid's order: tables first
    # one colour per implementation across every panel
    palette = plt.get_cmap("tab10")
    colours = {
        impl: palette(i % 10) for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows))
    }
    layout = []
    for op in ops:
        op_rows = [r for r in rows if r["op"] == op]
        cases = list(dict.fromkeys(r["case"] for r in op_rows))
        impls = list(dict.fromkeys(r["impl"] for r in op_rows))
        layout.append((op, op_rows, cases, impls))
    # inches per panel: a band per case, tall enough for its bars, and room for the title and axis
    heights = [1.1 + len(cases) * (0.25 + 0.2 * len(impls)) for _, _, cases, impls in layout]
    fig, axes = plt.subplots(
        len(ops),
        1,
        figsize=(12, sum(heights)),
        squeeze=False,
        layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (op, op_rows, cases, impls) in zip(axes[:, 0], layout, strict=True):
        bar = 0.8 / len(impls)
        widest = max(r["throughput"] for r in op_rows)
        for j, impl in enumerate(impls):
            for i, case in enumerate(cases):
                r = next((r for r in op_rows if (r["case"], r["impl"]) == (case, impl)), None)
                if r is None:  # skipped in this case
                    continue
                y = i + (j - (len(impls) - 1) / 2) * bar
                # labelled once per panel, for its legend
                label = None if impl in ax.get_legend_handles_labels()[1] else impl
                ax.barh(y, r["throughput"], height=bar * 0.9, color=colours[impl], label=label)
                text = f" {r['throughput']:.3g}"
                name, ratio = speedup_over_target(rows, r)
                if r["impl"].startswith("fastpe") and name is not None:
                    text += (
                        f"  ({name} not timed)" if ratio is None else f"  ({ratio:.2f}x vs {name})"
                    )
                ax.text(r["throughput"], y, text, va="center", fontsize=7)
        ax.set_yticks(range(len(cases)), cases, fontsize=8)
        ax.set_ylim(len(cases) - 0.5, -0.5)  # first case on top, as in the table
        ax.set_xlim(0, widest * 1.45)  # room for the labels right of the longest bar
        ax.set_xlabel(f"throughput, {op_rows[0]['unit']} (longer is faster)", fontsize=8)
        ax.set_title(op, loc="left", fontsize=10, fontweight="bold")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
        ax.grid(axis="x", alpha=0.3)
    env = doc.get("environment", {})
    where = env.get("gpu", env.get("machine", ""))
    fig.suptitle(f"fastpe bench on {where}, {doc.get('dtype', '')}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


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
