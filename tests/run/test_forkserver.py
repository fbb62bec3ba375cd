"""The workers' forkserver: started first only for a run with local workers, preloading its backend."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("argv", "backend"),
    [
        (["--dataset_file=d.jsonl", "--batch_size=2", "--run_name=r"], "local"),
        (["--dataset_file", "d.jsonl", "--sandbox", "docker"], "docker"),
        (["--dataset_file=d.jsonl", "--sandbox=modal"], "modal"),
        (["--dataset_file=d.jsonl", "--help"], None),
        (["--list_distributions"], None),
        (["--dataset_file=d.jsonl", "--ray_address=auto"], None),
        (["export", "data/run", "--format=openai"], None),
        (["--batch_size=2"], None),
    ],
)
def test_the_forkserver_starts_first_only_for_a_run_with_local_workers(monkeypatch, argv, backend):
    from batchrun.run import forkserver

    started = []
    monkeypatch.delenv("TERMINAL_ENV", raising=False)
    monkeypatch.setattr(forkserver, "start_forkserver", lambda b=None: started.append(b))
    forkserver.start_for_argv(argv)
    assert started == ([backend] if backend else [])


def test_the_forkserver_preloads_the_module_the_backends_registry_names():
    """A built-in backend, a dotted path and an unknown name: the module preloaded is the one the
    backend really lives in (the registry's), never a name guessed from the backend's."""
    import importlib

    from batchrun.prompt.sandboxes import BACKENDS, backend_class
    from batchrun.run import forkserver

    for name, target in BACKENDS.items():
        module = forkserver._backend_module(name)
        assert module == target.partition(":")[0]
        if name in ("local", "docker"):  # importable here (modal's SDK is an extra)
            assert backend_class(name).__module__ == importlib.import_module(module).__name__
    assert forkserver._backend_module("tests_pkg.mod:Box") == "tests_pkg.mod"
    assert forkserver._backend_module("no-such-backend") == ""


def test_the_forkserver_prepares_the_backends_probes_once_for_every_worker():
    """batchrun.run.worker_warm, imported last by the forkserver, runs the loaded backend's
    prepare_process: for the local backend the bubblewrap probe and the scan of /etc are then made
    once, in the forkserver, and every forked worker finds them done. A backend not loaded is left alone."""
    import subprocess
    import sys

    from batchrun.run.forkserver import WARM_MODULE

    code = f"""
import sys, batchrun.run.worker_preload, batchrun.prompt.sandboxes.local.sandbox, {WARM_MODULE}
from batchrun.prompt.sandboxes.local import host, system_view
print(host.bwrap_problem.cache_info().currsize, system_view._etc_scan.cache_info().currsize,
      "batchrun.prompt.sandboxes.docker.sandbox" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "False"]


def _session_members(sid: int) -> list[str]:
    """The processes of session ``sid`` still there (their comm), zombies included."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
        if int(fields[3]) == sid:
            found.append(stat.split(" (", 1)[1].rsplit(")", 1)[0])
    return found


@pytest.mark.parametrize("flags", [["--container_memory_mb=16777216"], []], ids=["refused", "run"])
def test_nothing_the_runner_started_outlives_it(tmp_path, flags):
    """The forkserver (still importing its preload when a bad flag ends the run) and multiprocessing's
    resource tracker ended on their own, after the runner had exited: a job's cgroup or a container
    that waits for its last process saw them, orphaned, for up to a few tenths of a second."""
    import subprocess
    import sys

    from helpers import ROOT

    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    args = ["--dataset_file=d.jsonl", "--batch_size=1", "--run_name=r", "--model=mock", "--num_workers=1"]
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "batch_runner.py"), *args, *flags],
            cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == (2 if flags else 0), err
        assert _session_members(proc.pid) == []
        subprocess.run(["rm", "-rf", str(tmp_path / "data")], check=True)
