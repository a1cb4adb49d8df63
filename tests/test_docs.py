"""docs/ is the reference the docstrings point to: its numbers and its links must stay true.

The worked sinusoidal example in docs/math.md is checked digit by digit against the float64
oracle, and every link or ``docs/<page>.md#anchor`` reference (between the pages, from the
README, the measurement history and the changelog, and from the code) must name a file and a
heading that exist. The README's marked Python blocks run, every ``fastpe`` command in the
README and in bench/results/README.md parses with the CLI, and no user-facing page names an
internal issue number or a commit.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import fastpe

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# markdown pages outside docs/ whose links must resolve
PAGES = [README, ROOT / "bench" / "results" / "README.md", ROOT / "CHANGELOG.md"]
RUN_MARKER = "<!-- tests/test_docs.py runs this block -->"
MARKER = "<!-- worked-example: sinusoidal d=4 base=10000 freq=paper -->"
ROW = re.compile(r'layout="(interleaved|concat)"\s+PE\[(\d+)\] = \[([^\]]*)\]')
NUMBER = re.compile(r"-?\d+\.(\d+)")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def _without_code_blocks(text: str) -> str:
    """Markdown outside fenced code blocks (a '# comment' in a code block is not a heading)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, seen = set(), {}
    for line in _without_code_blocks(path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^ {0,3}#{1,6} +(.+?) *#* *$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _worked_example_rows() -> list[tuple[str, int, list[str]]]:
    lines = (DOCS / "math.md").read_text(encoding="utf-8").splitlines()
    starts = [n for n, line in enumerate(lines) if line.strip() == MARKER]
    assert len(starts) == 1, f"docs/math.md must hold the marker {MARKER!r} exactly once"
    start = starts[0] + 1
    assert FENCE.match(lines[start]), "the worked-example marker must be followed by a code fence"
    rows = []
    for line in lines[start + 1 :]:
        if FENCE.match(line):
            break
        if not line.strip():
            continue
        match = ROW.fullmatch(line.strip())
        assert match, f"unparseable line in the worked example: {line!r}"
        rows.append((match.group(1), int(match.group(2)), match.group(3).split(",")))
    else:
        raise AssertionError("the worked example's code fence is never closed")
    return rows


def test_worked_sinusoidal_example_matches_the_oracle():
    rows = _worked_example_rows()
    keys = [(layout, p) for layout, p, _ in rows]
    assert len(set(keys)) == len(keys), f"a row is printed twice: {keys}"
    assert {("interleaved", 0), ("interleaved", 1)} <= set(keys), keys
    for layout, p, numbers in rows:
        truth = fastpe.sinusoidal_table(2, 4, layout=layout, dtype="float64", backend="numpy")
        assert p < 2, f"the example is computed for positions 0 and 1; got PE[{p}]"
        assert len(numbers) == 4, f'layout="{layout}" PE[{p}] must have d = 4 entries'
        for column, (text, want) in enumerate(zip(numbers, truth[p], strict=True)):
            match = NUMBER.fullmatch(text.strip())
            assert match, f'layout="{layout}" PE[{p}][{column}]: {text!r} is not a decimal number'
            decimals = len(match.group(1))
            assert decimals >= 4, f"{text!r}: print at least 4 decimals"
            # correctly rounded to the printed decimals: within half a unit of the last digit
            assert abs(float(text) - want) <= 0.5 * 10.0**-decimals + 1e-12, (
                f'layout="{layout}" PE[{p}][{column}] is printed as {text.strip()}, '
                f"but the oracle gives {want:.{decimals + 3}f}"
            )


def _markdown_links(path: Path):
    """(target file, anchor or None) of every relative link in a markdown file."""
    text = _without_code_blocks(path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`]*`", "", text)  # inline code is not a link
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        yield (path if not file else (path.parent / file).resolve()), anchor or None


def _code_references():
    """(docs file, anchor or None) of every ``docs/<page>.md[#anchor]`` mentioned in the code,
    the README or the docs, so a docstring pointing at a renamed section fails here."""
    sources = [ROOT / "README.md", *DOCS.glob("*.md")]
    for package in ("fastpe", "kernels"):
        sources += sorted((ROOT / package).rglob("*.py"))
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for page, anchor in re.findall(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?", text):
            yield source, DOCS / page, anchor or None


def _check(where: str, file: Path, anchor: str | None) -> str | None:
    if not file.exists():
        return f"{where}: {file.relative_to(ROOT)} does not exist"
    if anchor is not None and file.suffix == ".md" and anchor not in _anchors(file):
        return f"{where}: {file.relative_to(ROOT)} has no heading for #{anchor}"
    return None


def test_links_between_docs_resolve():
    pages = sorted(DOCS.glob("*.md")) + PAGES
    assert DOCS / "README.md" in pages and DOCS / "math.md" in pages
    broken = [
        problem
        for page in pages
        for file, anchor in _markdown_links(page)
        if (problem := _check(str(page.relative_to(ROOT)), file, anchor))
    ]
    assert not broken, "\n".join(broken)


def test_docs_references_in_code_resolve():
    broken = [
        problem
        for source, file, anchor in _code_references()
        if (problem := _check(str(source.relative_to(ROOT)), file, anchor))
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    "heading,slug",
    [
        ("Sinusoidal encoding", "sinusoidal-encoding"),
        ("lse and merging", "lse-and-merging"),
        ("How seq_len picks parameters", "how-seq_len-picks-parameters"),
        ("`attention` (GQA, ALiBi)", "attention-gqa-alibi"),
    ],
)
def test_slug_follows_github(heading, slug):
    assert _slug(heading) == slug


def test_anchor_checker_rejects_a_missing_heading():
    assert _check("here", DOCS / "math.md", "attention") is None
    assert _check("here", DOCS / "math.md", "no-such-section") is not None
    assert _check("here", DOCS / "no-such-page.md", None) is not None


def test_links_are_checked_in_the_readme():
    links = list(_markdown_links(README))
    assert (DOCS / "README.md", None) in links  # the checker reads the README's links
    assert any(file.name == "README.md" and file.parent.name == "results" for file, _ in links)


def _fenced_blocks(path: Path):
    """(language, code, the line before the fence) of every fenced code block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    n = 0
    while n < len(lines):
        match = re.match(r"^ {0,3}```(\w*)\s*$", lines[n])
        if match:
            end = next(m for m in range(n + 1, len(lines)) if FENCE.match(lines[m]))
            before = next((lines[m] for m in range(n - 1, -1, -1) if lines[m].strip()), "")
            yield match.group(1), "\n".join(lines[n + 1 : end]), before.strip()
            n = end
        n += 1


def _marked_python_blocks():
    return [
        code
        for lang, code, before in _fenced_blocks(README)
        if lang == "python" and before == RUN_MARKER
    ]


def test_readme_quick_start_is_marked_to_run():
    blocks = _marked_python_blocks()
    assert any("fastpe.attention(q, k, v, causal=True)" in code for code in blocks)
    assert any('causal_alignment="top_left"' in code for code in blocks)
    marks = README.read_text(encoding="utf-8").count(RUN_MARKER)
    assert marks == len(blocks), "a run marker must sit right above a ```python fence"


@pytest.mark.parametrize("index", range(len(_marked_python_blocks())))
def test_readme_python_block_runs(index):
    pytest.importorskip("torch")
    code = _marked_python_blocks()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def _cli_commands(path: Path):
    """Every `fastpe ...` / `python -m fastpe ...` invocation in the page's bash blocks, as argv
    after the program name (line continuations joined, `&&` chains split, env vars dropped)."""
    for lang, code, _ in _fenced_blocks(path):
        if lang not in ("bash", "sh", "shell"):
            continue
        for line in code.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    words = words[1:]
                if words[:1] == ["fastpe"]:
                    yield words[1:]
                elif words[:3] == ["python", "-m", "fastpe"]:
                    yield words[3:]


@pytest.mark.parametrize(
    "page",
    [README, ROOT / "bench" / "results" / "README.md"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_documented_cli_commands_parse(page):
    """A renamed command or option must not leave the README showing one that fails."""
    from fastpe import cli

    commands = list(_cli_commands(page))
    assert commands, f"no fastpe command found in {page.name}"
    for argv in commands:
        if argv == ["--version"]:
            with pytest.raises(SystemExit) as exit_:
                cli._parser().parse_args(argv)
            assert exit_.value.code == 0
            continue
        try:
            cli._parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page.name}: `fastpe {shlex.join(argv)}` does not parse")


INTERNAL = re.compile(
    r"\b[Ii]ssues? \d+|(?<![\w/])#\d+\b"  # issue 12, issues 11, 13, #17
    r"|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"  # a commit hash
)


def test_user_facing_text_names_no_issue_or_commit():
    from fastpe import cli

    texts = {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for p in [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    }
    parser = cli._parser()
    texts["fastpe --help"] = parser.format_help()
    for action in parser._subparsers._group_actions:
        for name, sub in action.choices.items():
            texts[f"fastpe {name} --help"] = sub.format_help()
    found = [
        f"{where}: {m.group(0)!r}" for where, text in texts.items() for m in INTERNAL.finditer(text)
    ]
    assert not found, "\n".join(found)


def test_internal_reference_pattern():
    assert INTERNAL.search("after issue 12") and INTERNAL.search("see #17")
    assert INTERNAL.search("at commit afbca79")
    assert not INTERNAL.search("error 1.5e-07, 2^20, sm_80, deadbeef, 1234567, docs/a.md#x-2")
