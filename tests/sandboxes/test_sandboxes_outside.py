"""The open backend seam: a backend from another package, installed with pip, found by its entry point.

tests/outside_backend is such a package (one class, ``br_outside:DirectorySandbox``, entry point
``outside``). It is installed with pip into a directory of the test's own, which goes on the path:
the runner then finds the backend by name, it passes the contract suite, and a whole run uses it
with a setting of its own (``--sandbox_settings``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import build_wheel

from batchrun.prompt.sandboxes import backend_class, backend_names
from batchrun.prompt.sandboxes.conformance import CAP, Target, run_suite

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tests" / "outside_backend"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package installed by pip from a wheel built here (no package index is reached)."""
    target = tmp_path_factory.mktemp("site")
    wheel = build_wheel(PACKAGE, tmp_path_factory.mktemp("wheels"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    sys.path.insert(0, str(target))
    backend_class.cache_clear()
    yield target
    sys.path.remove(str(target))
    backend_class.cache_clear()


def test_the_installed_backend_is_found_by_its_entry_point_name(installed: Path):
    assert "outside" in backend_names()
    assert backend_class("outside").__name__ == "DirectorySandbox"
    # The built-ins keep their names whatever a package declares.
    assert backend_class("local").__module__ == "batchrun.prompt.sandboxes.local.sandbox"


def test_the_outside_backend_passes_the_contract_suite(installed: Path, tmp_path: Path):
    target = Target(
        "outside", {"output_cap_bytes": CAP, "base_dir": str(tmp_path)},
        absolute_cwd=str(tmp_path / "proj" / "sub"), failing_spec={"cwd": "/proc/cannot/create"},
        isolated=False, ends_processes=False,
    )  # fmt: skip
    results = run_suite(target)
    failed = [f"{r.name}:\n{r.detail}" for r in results if not r.passed]
    assert not failed, "\n".join(failed)
    assert sum(not r.skipped for r in results) >= 10  # the checks really ran


def test_a_whole_run_uses_the_outside_backend_with_its_own_setting(installed: Path, tmp_path: Path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": f"outside prompt {i}"}) + "\n" for i in range(3)), "utf-8"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), str(ROOT)])}
    settings = json.dumps({"greeting": "bonjour", "base_dir": str(tmp_path)})
    done = subprocess.run(
        [sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=2",
         "--run_name=outside", "--model=mock", "--distribution=terminal_only", "--num_workers=1",
         "--sandbox=outside", f"--sandbox_settings={settings}", f"--output_dir={tmp_path / 'data'}"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "data" / "outside"
    records = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text("utf-8").splitlines()]
    assert len(records) == 3
    assert {r["metadata"]["sandbox"] for r in records} == {"outside"}
    assert {r["metadata"]["isolation"] for r in records} == {"directory"}
    # The terminal ran in the backend's directories (pwd), under the base_dir its setting named.
    tool_text = "".join(t["value"] for r in records for t in r["conversations"] if t["from"] == "tool")
    assert str(tmp_path / "br-outside-") in tool_text
    assert "bonjour" in (run_dir / "statistics.json").read_text("utf-8")


def test_an_unknown_setting_of_a_backend_stops_the_run_naming_it(tmp_path: Path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"prompt": "p"}) + "\n", "utf-8")
    done = subprocess.run(
        [sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=2",
         "--run_name=r", "--model=mock", "--distribution=terminal_only", "--sandbox=local",
         '--sandbox_settings={"no_such_option": 1}', f"--output_dir={tmp_path / 'data'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 2
    assert "no_such_option" in done.stderr and "valid options" in done.stderr
    for bad in ("[1, 2]", "not json"):
        done = subprocess.run(
            [sys.executable, str(ROOT / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=2",
             "--run_name=r", "--model=mock", f"--sandbox_settings={bad}", f"--output_dir={tmp_path / 'data'}"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert done.returncode == 2 and "--sandbox_settings must be a JSON object" in done.stderr, done.stderr
