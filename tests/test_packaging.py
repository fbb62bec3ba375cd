"""What ``pip install batch-runner`` installs: every module of the ``batchrun`` package and nothing else.

The package list was once written by hand in pyproject.toml; a new folder (``sandboxes/local/``)
then installed without its modules, and every non-editable install failed at its first import.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_package_and_no_root_script(tmp_path):
    # From a clean copy: setuptools reuses a build/ directory, which would hide a module left out.
    src = tmp_path / "src"
    shutil.copytree(REPO / "batchrun", src / "batchrun", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "batch_runner.py", "toolset_distributions.py"):
        shutil.copy2(REPO / name, src / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet", str(src),
         "--wheel-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("batch_runner-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "batchrun").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sources - names == set()  # every module, in every folder
    assert "batchrun/prompt/sandboxes/local/launcher.c" in names  # br-launch, compiled where it runs
    modules = {n for n in names if n.endswith(".py")}
    assert modules == sources  # and no other Python file: not batch_runner.py, not the tests
