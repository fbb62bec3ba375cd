"""Chromium's own sandbox for the worker's browser (see ``BROWSER_UID`` in config.py).

Chromium renders pages the model picks, on the host. Started with ``--no-sandbox`` (Playwright's default)
every renderer ran as the worker's user, root in CI, with no seccomp filter and in the host's
namespaces: code a page got to run in one read root-only files and connected to 127.0.0.1 past the
egress proxy (shown with gdb in a real renderer). With its sandbox on, Chromium puts its renderers (and
the GPU process) in user, PID and network namespaces of their own under a seccomp-bpf filter.

Chromium refuses its sandbox as root, so a root worker starts it as ``BROWSER_UID``:``BROWSER_GID``
(nobody), without capabilities or supplementary groups and with no_new_privs (``setpriv``, in the
launcher): then even the browser process, which keeps the host's network namespace to reach the egress
proxy, holds nothing of root's. A worker that is not root keeps its own user.

The sandbox needs user namespaces for that user: a root-run Docker container's default seccomp profile,
a kernel or AppArmor policy, may refuse them. :func:`plan` tries one, once per process; where that is
refused (or util-linux's ``setpriv``/``unshare`` are missing) Chromium runs without its sandbox, as root
still if it cannot change user, and the run's start and the worker's log say why.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from batchrun.prompt.tools.config import BROWSER_GID, BROWSER_UID


@dataclass(frozen=True)
class SandboxPlan:
    """How this process's Chromium starts."""

    sandbox: bool  # Chromium's own sandbox on (no --no-sandbox)
    user: tuple[int, int] | None  # (uid, gid) the launcher switches to; None: the worker's own
    problem: str | None = None  # why the sandbox is off (None when it is on)

    def describe(self) -> str:
        """One line for the start of a run."""
        who = f"uid {self.user[0]}" if self.user else f"the runner's uid {os.geteuid()}"
        if self.sandbox:
            return (
                f"Browser sandbox: Chromium runs as {who}, its renderers in user, PID and network namespaces "
                "of their own under seccomp-bpf"
            )
        return (
            f"warning: Browser sandbox: OFF ({self.problem}): Chromium runs as {who} with --no-sandbox, "
            "a page that exploits its renderer runs there with that user's access to this host"
        )


def _run(argv: list[str]) -> str | None:
    """None if ``argv`` succeeds, else what it said (its last line of error output)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": os.defpath})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:200]


def _probe(prefix: list[str]) -> str | None:
    """None if ``prefix`` + unshare can make the user, PID and network namespaces Chromium's zygote
    makes; else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "util-linux's unshare is not installed: cannot tell whether user namespaces work"
    said = _run([*prefix, unshare, "--user", "--pid", "--net", "true"])
    return None if said is None else f"no user namespaces here ({said})"


def drop_command(user: tuple[int, int]) -> list[str]:
    """The setpriv command line the launcher execs Chromium through, as ``user``."""
    uid, gid = user
    setpriv = shutil.which("setpriv") or "setpriv"
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


@functools.lru_cache(maxsize=1)
def plan() -> SandboxPlan:
    """How Chromium starts here (tried once per process; the answer does not change within a run)."""
    if os.geteuid() != 0:
        problem = _probe([])
        return SandboxPlan(sandbox=problem is None, user=None, problem=problem)
    user = (BROWSER_UID, BROWSER_GID)
    if shutil.which("setpriv") is None:
        return SandboxPlan(
            sandbox=False, user=None, problem="util-linux's setpriv is not installed: cannot leave root"
        )
    drop = drop_command(user)
    said = _run([*drop, "true"])  # a container that maps only root has no uid to switch to
    if said is not None:
        return SandboxPlan(sandbox=False, user=None, problem=f"cannot switch to uid {user[0]}: {said}")
    tmp = tempfile.gettempdir()  # Playwright makes Chromium's profile there (the launcher gives it to user)
    if _run([*drop, "test", "-x", tmp]) is not None:
        return SandboxPlan(
            sandbox=False, user=None, problem=f"uid {user[0]} cannot enter the temporary directory {tmp}"
        )
    problem = _probe(drop)
    return SandboxPlan(sandbox=problem is None, user=user, problem=problem)
