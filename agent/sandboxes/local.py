"""Local backend: each prompt gets a private directory on this machine, and with bubblewrap a read-only host.

With ``bwrap`` every command runs in its own mount and PID namespace: the host filesystem is
read-only, only the prompt's working directory and its private ``/tmp`` are writable, and the
network is cut when the spec asks for it. Without it there is no isolation at all: say so loudly.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass

from agent.sandboxes._process import run_process
from agent.sandboxes.base import (
    DEFAULT_OUTPUT_CAP_BYTES,
    ExecResult,
    SandboxError,
    SandboxSpec,
    check_option_types,
    parse_options,
)

ISOLATION_MODES = ("auto", "bwrap", "none")
# Host variables a command may see; everything else (API keys above all) stays out of the sandbox.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TZ")
TAG_VAR = "BATCH_RUNNER_SANDBOX"  # marks every process of one sandbox, so stop() can find leftovers


@dataclass(frozen=True)
class LocalOptions:
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # most bytes of one command's output kept
    isolation: str = "auto"  # "auto": bwrap when it works here; "bwrap": required; "none": plain processes
    base_dir: str | None = None  # where private directories are made; None: the system temp dir

    def __post_init__(self) -> None:
        check_option_types(self, "local", positive=("output_cap_bytes",))
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(
                f"local sandbox option isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}"
            )


# The host read-only, fresh /dev and /proc, its own PID namespace, gone with its parent. Run as root,
# bwrap keeps every capability, which would let a command remount / read-write: drop them all, and
# keep /proc/sys read-only (root may write sysctls by file permission alone).
BWRAP_BASE = (
    "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
    "--ro-bind-try", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
    "--unshare-pid", "--die-with-parent", "--new-session", *(("--cap-drop", "ALL") if os.geteuid() == 0 else ()),
)  # fmt: skip


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate commands on this machine, or None when it can (probed once)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (on Debian: apt-get install bubblewrap)"
    try:
        done = subprocess.run([*BWRAP_BASE, "--unshare-net", "true"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not be run: {exc}"
    if done.returncode != 0:
        return f"bubblewrap does not work here: {done.stderr.decode(errors='replace').strip()}"
    return None


@functools.cache
def _shell() -> str:
    """bash when installed, else sh; looked up once, not on every command."""
    return shutil.which("bash") or "sh"


def local_isolation_available() -> bool:
    """Whether the local backend can isolate commands with bubblewrap on this machine."""
    return bwrap_problem() is None


# Host paths a dataset's cwd may never name: the cwd is bound writable inside bubblewrap.
_SYSTEM_DIRS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/sbin",
    "/sys",
    "/usr",
)
_SYSTEM_ROOTS = ("/home", "/root", "/var", "/run", "/opt", "/srv", "/mnt", "/media", "/tmp")


def _protected(path: str) -> bool:
    """``/``, a system directory or anything inside one, or a top-level directory such as /home."""
    real = os.path.realpath(path)
    if real == "/" or real in _SYSTEM_ROOTS:
        return True
    return any(real == d or real.startswith(d + "/") for d in _SYSTEM_DIRS)


_BWRAP_MOUNT_RACE = re.compile(r"\Abwrap: Can't (bind mount|remount|mount) /oldroot/")


class LocalSandbox:
    """Commands run in ``bash -c`` in their own process group, inside bubblewrap when available."""

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(LocalOptions, "local", options)
        wanted = self.options.isolation
        self.isolation = (
            "bwrap" if wanted == "bwrap" or (wanted == "auto" and local_isolation_available()) else "none"
        )
        self.workdir = ""
        self._root: str | None = None
        self._tag = uuid.uuid4().hex

    def start(self) -> None:
        if self.isolation == "bwrap" and bwrap_problem():
            raise SandboxError(f"local sandbox: isolation 'bwrap' was requested but {bwrap_problem()}")
        safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", self.spec.run_name)[:40]
        self._root = tempfile.mkdtemp(
            prefix=f"br-{safe_name}-{self.spec.prompt_index}-", dir=self.options.base_dir
        )
        os.mkdir(os.path.join(self._root, "tmp"))
        # An absolute cwd is a host path (shared by prompts that name it); a relative one lives in the private dir.
        cwd = os.path.join(self._root, "work", self.spec.cwd or "")
        self.workdir = os.path.abspath(cwd)
        if _protected(self.workdir):
            raise SandboxError(
                f"local sandbox: cwd {self.spec.cwd!r} is a system directory; it would become writable to the "
                "model. Use a project directory, or --sandbox=docker"
            )
        try:
            os.makedirs(self.workdir, exist_ok=True)
        except OSError as exc:
            raise SandboxError(f"local sandbox: cannot create cwd {self.spec.cwd!r}: {exc}") from exc

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        if self._root is None:
            raise SandboxError("local sandbox is not started")
        host_tmp = os.path.join(self._root, "tmp")
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.setdefault("PATH", os.defpath)
        env.update(HOME=self.workdir, TMPDIR="/tmp" if self.isolation == "bwrap" else host_tmp)
        env.update(self.spec.env)
        env[TAG_VAR] = self._tag
        argv = [_shell(), "-c", command]
        if self.isolation == "bwrap":
            argv = self._bwrap_prefix(host_tmp) + argv
        for attempt in range(3):
            result = run_process(
                argv, stdin=stdin, timeout_s=timeout_s, output_cap_bytes=self.options.output_cap_bytes,
                cwd=self.workdir, env=env,
            )  # fmt: skip
            # bwrap copies the host's mounts; one that vanishes meanwhile (Docker's overlays come and go)
            # fails the set-up before the command runs. Nothing ran, so trying again is safe.
            if not (
                self.isolation == "bwrap" and result.exit_code == 1 and _BWRAP_MOUNT_RACE.match(result.output)
            ):
                return result
            time.sleep(0.05 * (attempt + 1))
        return result

    def stop(self) -> None:
        root, self._root = self._root, None
        if root is None:
            return
        if self.isolation == "none":  # bwrap ends each command's processes with it; here some may linger
            _kill_tagged(f"{TAG_VAR}={self._tag}".encode())
        shutil.rmtree(root, ignore_errors=True)

    def _bwrap_prefix(self, host_tmp: str) -> list[str]:
        # Order matters: /tmp is mounted before the workdir, which may itself live under /tmp.
        prefix = [*BWRAP_BASE, "--bind", host_tmp, "/tmp"]
        prefix += ["--bind", self.workdir, self.workdir, "--chdir", self.workdir]
        if not self.spec.network:
            prefix.append("--unshare-net")
        return [*prefix, "--"]


def _kill_tagged(marker: bytes) -> None:
    """SIGKILL every process whose environment carries ``marker`` (twice, to catch late forks)."""
    for _ in range(2):
        for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue
