"""What a run loads before its first request: modules only some runs use stay out of the parent's
and the forkserver's start (each costs every run its import; asyncio ~40 ms of CPU per process here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = "import batchrun.cli, batchrun.api; from batchrun.prompt.tools.catalog import all_tools; all_tools()"
FORKSERVER = "import batchrun.run.worker_preload"


@pytest.mark.parametrize("code", [PARENT, FORKSERVER], ids=["parent", "forkserver"])
def test_a_run_without_mcp_or_browser_use_loads_no_asyncio_at_start(code):
    probe = f"{code}; import sys; print(sorted(m for m in ('asyncio', 'openai', 'playwright') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_forkserver_is_asked_for_before_the_sandbox_interface_is_imported():
    """start_for_argv reads the default backend and a built-in's module from the backends' table alone:
    the interface (base.py) and the entry points' metadata are left to the server and the parent's later
    imports, so the server starts that much sooner."""
    probe = (
        "import sys; import batchrun.run.forkserver as f; asked = []; "
        "f.start_forkserver = lambda backend=None: asked.append((backend, f._backend_module(backend), "
        "sorted(m for m in ('batchrun.prompt.sandboxes.base', 'importlib.metadata') if m in sys.modules))); "
        "f.start_for_argv(['--dataset_file=x.jsonl', '--sandbox=docker']); print(asked)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TERMINAL_ENV", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[('docker', 'batchrun.prompt.sandboxes.docker.sandbox', [])]"


def test_workers_run_this_copy_of_the_package_when_another_is_on_the_path(tmp_path):
    """Python 3.11's forkserver imports its preload with its own default path (the working directory,
    PYTHONPATH, site-packages), not the parent's: a checkout's batch_runner.py run from another directory,
    beside another copy of the package (an installed one, another checkout), had its workers run that
    copy's code. Here the other copy is a stub that marks its import and has no worker: every prompt failed."""
    other = tmp_path / "other" / "batchrun"
    (other / "run").mkdir(parents=True)
    (other / "__init__.py").write_text("")
    marker = tmp_path / "other_copy_imported"
    (other / "run" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "p.jsonl").write_text('{"prompt": "one [calls:0]"}\n{"prompt": "two [calls:0]"}\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "other")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "batch_runner.py"), "--dataset_file=p.jsonl", "--batch_size=2",
         "--run_name=r", "--model=mock", "--distribution=terminal_only", "--num_workers=1",
         "--local_isolation=none"],
        cwd=work, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()
    assert (work / "data" / "r" / "trajectories.jsonl").read_text().count("\n") == 2


def test_the_runners_caches_are_in_one_directory_found_before_any_module_is_compiled(tmp_path):
    """The cache directory was computed twice (the bytecode's in run/forkserver.py, the runnable Docker
    images' in the prompt side's engine.py); now once, in the package's __init__, which the forkserver's
    module loads before the bytecode prefix is set, and which imports nothing else of the package."""
    probe = (
        "import sys; import batchrun.run.forkserver as f; "
        "before = sorted(m for m in sys.modules if m.startswith('batchrun')); f.use_bytecode_cache(); "
        "from batchrun import cache_dir; from batchrun.prompt.sandboxes.docker.engine import runnable_cache_path; "
        "print([before, cache_dir(), sys.pycache_prefix, str(runnable_cache_path())])"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
        "XDG_CACHE_HOME": str(tmp_path),
    }
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    cache = str(tmp_path / "batch-runner")
    assert out.stdout.strip() == str(
        [
            ["batchrun", "batchrun.run", "batchrun.run.forkserver"],
            cache,
            f"{cache}/pycache",
            f"{cache}/docker-images-runnable.json",
        ]
    )
    assert any((tmp_path / "batch-runner" / "pycache").rglob("engine*.pyc"))


def test_a_bytecode_cache_another_user_could_write_into_is_not_used(tmp_path):
    """The interpreter runs whatever bytecode it finds in the cache whose header matches the source's
    size and time: with HOME or XDG_CACHE_HOME in a directory others may write into (HOME=/tmp in a
    CI job), another user planted a .pyc of batchrun/cli.py there and the next run executed it as the
    runner's user (reproduced with two users). Such a cache is now left unused; a private one below a
    sticky shared directory (like /tmp) is still used."""
    probe = (
        "import sys; import batchrun.run.forkserver as f; f.use_bytecode_cache(); print(sys.pycache_prefix)"
    )

    def prefix_with(cache_home: Path) -> str:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
        env["XDG_CACHE_HOME"] = str(cache_home)
        env.pop("PYTHONPYCACHEPREFIX", None)
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may rename or replace what it holds
    assert prefix_with(shared) == "None"
    (shared / "batch-runner").chmod(0o700)  # made by the runner above: its own, but its parent is not
    assert prefix_with(shared) == "None"
    planted = shared / "planted"  # the cache itself writable by others
    (planted / "batch-runner" / "pycache").mkdir(parents=True)
    (planted / "batch-runner" / "pycache").chmod(0o777)
    shared.chmod(0o1777)  # sticky, like /tmp: only an entry's owner may rename it
    assert prefix_with(planted) == "None"
    sticky = shared / "mine"  # a private cache below a sticky shared directory is used
    assert prefix_with(sticky) == f"{sticky}/batch-runner/pycache"
