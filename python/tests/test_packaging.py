"""`pip install ./python` gives the package `crab-sandbox` (import `crab_sandbox`), typed,
with httpx as its only dependency. Built offline from the test venv's setuptools."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_pip_install_of_python_dir(tmp_path: Path) -> None:
    # Build from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "python"
    shutil.copytree(
        ROOT / "python",
        src,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache", "tests"),
    )
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        cwd=tmp_path,
    )
    pkg = target / "crab_sandbox"
    assert (pkg / "py.typed").exists(), "py.typed is not shipped: type checkers would ignore the hints"
    metas = list(target.glob("crab_sandbox-*.dist-info/METADATA"))
    assert len(metas) == 1, metas
    meta = metas[0].read_text()
    assert "Name: crab-sandbox" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert requires == ["Requires-Dist: httpx>=0.25"], requires
    out = subprocess.run(
        [sys.executable, "-c", "import crab_sandbox, sys; print(crab_sandbox.__file__)"],
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert out.stdout.strip().startswith(str(target))
