"""Packaging: kernels/ ships as fastpe.kernels, never as a top-level `kernels` (Hugging Face's name)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
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
