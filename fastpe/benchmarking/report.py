"""Presenting a results document (``run_benchmarks``' output, or a JSON file of it)."""

from __future__ import annotations

from .baselines import TARGET_BASELINE


def format_table(doc: dict, markdown: bool = False) -> str:
    """Every row: median time, throughput, fraction of peak, speedup, error vs the oracle."""
    head = [
        "op",
        "case",
        "implementation",
        "median",
        "throughput",
        "% peak",
        "vs best baseline",
        "max |err|",
    ]
    lines = []
    for r in doc["results"]:
        frac = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        speed = (
            "" if r["speedup_vs_best_baseline"] is None else f"{r['speedup_vs_best_baseline']:.2f}x"
        )
        lines.append([r["op"], r["case"], r["impl"], f"{r['median_s'] * 1e3:.2f} ms",
                      f"{r['throughput']:.1f} {r['unit']}", frac, speed, f"{r['max_abs_error']:.1e}"])  # fmt: skip
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in lines])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*row) for row in lines])


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
        name = TARGET_BASELINE.get(r["op"])
        base = next(
            (b for b in rows if (b["op"], b["case"], b["impl"]) == (r["op"], r["case"], name)), None
        )
        speed = "" if base is None else f"{base['median_s'] / r['median_s']:.2f}x"
        frac = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        out.append(
            f"| {r['op']} | {r['case']} | {r['impl']} | {r['throughput']:.1f} {r['unit']} | {frac} | {name} | {speed} |"
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
