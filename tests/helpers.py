"""Plain helpers shared by the tests (fixtures are in conftest.py): datasets, JSONL files, Docker, CI policy."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
IN_CI = os.environ.get("CI") == "true"
DOCKER_TEST_IMAGE = "batch-runner-test:latest"  # built from busybox by tests/docker_image/build.sh
TOOL_CAP = 64 * 1024  # the output cap the tool tests' sandboxes use


def skip_or_fail(reason: str) -> None:
    """Locally a missing facility skips the test; in CI it fails it, so nothing is silently not run."""
    if IN_CI:
        pytest.fail(f"CI must be able to run this test: {reason}")
    pytest.skip(reason)


def docker_ps(*labels: str) -> list[str]:
    """Names of all containers (running or not) with every one of ``labels``, as the docker CLI reports them."""
    filters = [arg for label in labels for arg in ("--filter", f"label={label}")]
    done = subprocess.run(
        ["docker", "ps", "-a", *filters, "--format", "{{.Names}}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.split()


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    """A dataset of one ``{"prompt": ...}`` row per prompt."""
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts), "utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
