"""Packaging: kernels/ ships as fastpe.kernels, never as a top-level `kernels` (Hugging Face's name);
the license, the version and what the sdist holds."""

from __future__ import annotations

import hashlib
import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_kernels_folder_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    for init in (ROOT / "kernels").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "kernels")
        name = ".".join(("fastpe", "kernels", *rel.parts))
        assert name in listed, f"{name} is missing from [tool.setuptools] packages"
    for init in (ROOT / "fastpe").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        assert ".".join(rel.parts) in listed
    assert _pyproject()["tool"]["setuptools"]["package-dir"]["fastpe.kernels"] == "kernels"


def test_kernels_init_has_no_side_effects():
    # transformers imports a stray top-level `kernels`; ours must be inert if ever found that way
    assert (ROOT / "kernels" / "__init__.py").read_text().strip() == ""


@pytest.mark.slow
def test_wheel_has_no_top_level_kernels(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("fastpe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "kernels" not in tops, sorted(tops)
    assert "fastpe/kernels/__init__.py" in names
    assert (
        "fastpe/kernels/numba/__init__.py" in names and "fastpe/kernels/triton/__init__.py" in names
    )
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fastpe"}


def test_installed_fastpe_kernels_resolves_to_the_kernels_folder():
    import fastpe.kernels

    assert pathlib.Path(fastpe.kernels.__file__).parent.name == "kernels"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    command = next(
        line for line in readme if line.startswith("python -m pip install") and "pytest" in line
    )
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


# The Apache License 2.0 as https://www.apache.org/licenses/LICENSE-2.0.txt publishes it
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_file_is_the_full_apache_2_text():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256, "LICENSE is not the standard text"
    assert b"END OF TERMS AND CONDITIONS" in text


def test_license_is_an_spdx_expression_with_its_file():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # a string (PEP 639), not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    requires = _pyproject()["build-system"]["requires"]
    assert any(r.replace(" ", "").startswith("setuptools>=") for r in requires), requires
    (setuptools,) = [r for r in requires if r.startswith("setuptools")]
    assert int(setuptools.split(">=")[1].split(".")[0]) >= 77, "PEP 639 needs setuptools >= 77"
    assert importlib.metadata.metadata("fastpe")["License-Expression"] == "Apache-2.0"


def test_version_is_written_in_one_place():
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = _pyproject()["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "fastpe.__version__"


def test_cli_version_is_the_installed_metadata():
    """`fastpe --version` against the metadata pip recorded (not fastpe.__version__)."""
    result = subprocess.run(
        [sys.executable, "-m", "fastpe", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == f"fastpe {importlib.metadata.version('fastpe')}"


def test_changelog_has_an_unreleased_section():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in text


def test_sdist_holds_the_package_and_no_tests(tmp_path):
    """The sdist leaves out tests/ and bench/ (they need the repository: docs, bench/results,
    .ci) and holds the package, its kernels, the README and the LICENSE."""
    built = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    name = built.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
        (pkg_info,) = [
            m for m in sdist.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
        ]
        metadata = sdist.extractfile(pkg_info).read().decode()
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"tests", "bench", ".ci", "docs"}, sorted(tops)
    assert {"LICENSE", "README.md", "pyproject.toml", "PKG-INFO"} <= tops, sorted(tops)
    assert "fastpe/__init__.py" in names and "kernels/numba/__init__.py" in names
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_benchmark_outputs_are_ignored_by_git():
    """`fastpe bench` writes fastpe-bench.json/.png in the working directory: in a checkout they
    must not show up in `git status` (CI runs the README's commands there)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    from fastpe import cli

    defaults = cli._parser().parse_args(["bench"])
    names = [defaults.json, defaults.plot]
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", *names], cwd=ROOT, capture_output=True, text=True
    )
    assert result.stdout.split() == names, result.stdout + result.stderr


def test_ci_lints_before_the_tests():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    tests = next(n for n, line in enumerate(lines) if "pytest" in line and not line.startswith("#"))
    for check in ("python -m ruff check .", "python -m ruff format --check ."):
        lint = next(n for n, line in enumerate(lines) if line.strip() == check)
        assert lint < tests, check
