"""The sandbox contract (batchrun/prompt/sandboxes/conformance.py) over every built-in backend.

Backends: local without isolation, local inside bubblewrap, Docker on the real engine (marker
``docker``; fails in CI when no engine answers), and Singularity and Modal through their fakes
(a fake ``apptainer`` CLI and a fake ``modal`` SDK that run commands in a local busybox root).
An outside backend runs the same checks (tests/sandboxes/test_sandboxes_outside.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrun.prompt.sandboxes.conformance import CAP, CHECKS, Skip, Target, own_processes, run_check

KINDS = [
    pytest.param("local-none", id="local-none"),
    pytest.param("local-bwrap", id="local-bwrap", marks=pytest.mark.bwrap),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
    pytest.param("singularity-fake", id="singularity-fake"),
    pytest.param("modal-fake", id="modal-fake"),
]


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """The backend of this kind with whatever it needs (engine, image, fakes) ready, and what it may promise."""
    kind = request.param
    if kind == "local-none":
        # Without isolation an absolute cwd is a host path, allowed under cwd_root only.
        options = {
            "output_cap_bytes": CAP,
            "isolation": "none",
            "base_dir": str(tmp_path),
            "cwd_root": str(tmp_path),
        }
        return Target(
            "local", options, absolute_cwd=str(tmp_path / "proj" / "sub"),
            failing_spec={"cwd": "/proc/cannot/create"}, isolated=False, ends_processes=False,
        )  # fmt: skip
    if kind == "local-bwrap":
        request.getfixturevalue("bwrap_available")
        options = {"output_cap_bytes": CAP, "isolation": "bwrap", "base_dir": str(tmp_path)}
        return Target("local", options, failing_spec={"cwd": "/usr/cannot/create"}, reaps_leftovers=True)
    if kind == "docker":
        image = request.getfixturevalue("docker_test_image")
        from batchrun.prompt.sandboxes.docker.sandbox import docker_client, trusted_tools

        # As a run's prepare_run makes them: judging in the host's busybox and docker-init, where found.
        tools, _ = trusted_tools(docker_client().info())
        options = {"output_cap_bytes": CAP, "default_image": image, "memory_mb": 256, **tools}
        return Target("docker", options, processes=own_processes)
    # The fakes run each exec in a PID namespace of its own that ends with it; a real Apptainer
    # instance or Modal sandbox keeps one for its life. Untested there: no such service here.
    if kind == "singularity-fake":
        request.getfixturevalue("fake_apptainer")
        options = {"output_cap_bytes": CAP, "default_image": "busybox:latest", "base_dir": str(tmp_path)}
        return Target("singularity", options, keeps_background=False)
    request.getfixturevalue("fake_modal")
    options = {"output_cap_bytes": CAP, "default_image": "busybox:latest", "timeout_s": 600}
    return Target("modal", options, keeps_background=False)


@pytest.mark.parametrize("check", list(CHECKS))
def test_contract(target: Target, check: str) -> None:
    try:
        run_check(target, check)
    except Skip as exc:
        pytest.skip(str(exc))
