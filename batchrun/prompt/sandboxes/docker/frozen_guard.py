"""A process per worker that removes the worker's stopped containers when the worker dies.

While a sample is judged, a container's own processes are stopped (``end_processes``): its ``cat``
no longer reads the attach stream, so the worker's death would not end it, and its sleeper no longer
counts down its lifetime. Once they are stopped an exec holds them (its end continues them), but
between the first SIGSTOP and that exec nothing did: a worker killed then left the container
running, its processes stopped, until the next run's sweep (forever without one). The hold cannot
start earlier: a process in the container alive with the agent's may be taken over by them.

So, before the first SIGSTOP, the container's ID is sent to this guard, a small process of its own
session (Ctrl-C or a kill of the runner's group does not reach it) that reads the IDs on a pipe only
the worker holds; when the pipe ends (the worker died, however) it removes every container still
held. One is released once it runs again or is removed. The guard starts at the worker's first
judged sample (~30 ms) and imports the Docker client only when there is something to remove.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

GUARD_SCRIPT = r"""
import sys
held = set()
for line in sys.stdin:
    op, cid = line[:1], line[1:].strip()
    if op == "+":
        held.add(cid)
    elif op == "-":
        held.discard(cid)
if held:
    import docker
    client = docker.from_env(version="auto")
    for cid in held:
        try:
            client.api.remove_container(cid, force=True, v=True)
        except Exception:
            pass
"""

_lock = threading.Lock()
_guard: subprocess.Popen | None = None
_guard_pid = 0
_held: set[str] = set()


def _environment() -> dict[str, str]:
    """What the guard needs to reach the engine; nothing else of the runner's (its API keys)."""
    keep = ("PATH", "HOME", "PYTHONPATH", "XDG_CONFIG_HOME", "SSL_CERT_FILE")
    return {k: v for k, v in os.environ.items() if k in keep or k.startswith("DOCKER_")}


def _send(line: str) -> None:
    """Send one line to this process's guard, started (again) when it is not running: a new one
    is sent every held ID first."""
    global _guard, _guard_pid
    if _guard_pid != os.getpid():  # a fork's copy: that guard and those containers are the parent's
        _guard, _guard_pid = None, os.getpid()
        _held.intersection_update({line[1:].strip()} if line.startswith("+") else set())
    for _ in range(2):
        guard, data = _guard, line
        if guard is None or guard.poll() is not None:
            guard = _guard = subprocess.Popen(
                [sys.executable, "-c", GUARD_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, env=_environment(),
            )  # fmt: skip
            data = "".join(f"+{cid}\n" for cid in _held) + line
        try:
            assert guard.stdin is not None
            guard.stdin.write(data.encode())
            guard.stdin.flush()
            return
        except OSError:  # it died meanwhile: a new one
            guard.kill()
            guard.wait()
            _guard = None


def hold(container_id: str) -> None:
    """Have ``container_id`` removed should this process die before ``release``."""
    with _lock:
        _held.add(container_id)
        _send(f"+{container_id}\n")


def release(container_id: str) -> None:
    """``container_id`` no longer needs the guard (it runs again, or is removed)."""
    with _lock:
        if container_id in _held:
            _held.discard(container_id)
            _send(f"-{container_id}\n")
