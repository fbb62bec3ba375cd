"""A sandbox backend that lives outside batch-runner: each prompt in a directory of its own, no isolation.

It shows what an outside backend needs: one class that subclasses ``SandboxBackend``, implements
``start`` / ``run`` / ``stop``, declares its capabilities, owns its options (set with
``--sandbox_settings``), and is found through the ``batch_runner.sandboxes`` entry point.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass

from batchrun.prompt.sandboxes.base import (
    DEFAULT_OUTPUT_CAP_BYTES,
    ExecResult,
    Preflight,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    cap_output,
    parse_options,
)


@dataclass(frozen=True)
class DirectoryOptions:
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # bytes of a command's output kept
    base_dir: str | None = None  # where the prompts' directories are made (default: the temp dir)
    greeting: str = "hello"  # a setting of this backend's own, exported to commands as GREETING_OF_BACKEND


class DirectorySandbox(SandboxBackend):
    synchronous_start = True  # making a directory is quick

    @classmethod
    def preflight(cls, jobs, options, *, real_model, network, dataset="the dataset") -> Preflight:
        return Preflight(isolation="directory", facts={"greeting": options.get("greeting", "hello")})

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(DirectoryOptions, "outside", options)
        self.isolation = "directory"
        self.root: str | None = None
        self.workdir = ""
        self._stopped = False
        self._groups: list[int] = []  # each command's process group, ended at stop

    def start(self) -> None:
        if self.spec.cwd and self.spec.cwd.startswith("/proc"):
            raise SandboxError(f"cannot make cwd {self.spec.cwd!r}")
        self.root = tempfile.mkdtemp(prefix="br-outside-", dir=self.options.base_dir)
        cwd = self.spec.cwd or "work"
        # An absolute cwd is a host path (this backend isolates nothing), allowed inside base_dir only.
        base = self.options.base_dir
        inside = posixpath.isabs(cwd) and bool(base) and os.path.commonpath([base, cwd]) == base
        self.workdir = cwd if inside else posixpath.join(self.root, cwd.lstrip("/"))
        os.makedirs(self.workdir, exist_ok=True)
        os.makedirs(os.path.join(self.root, "tmp"), exist_ok=True)

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        if self.root is None or self._stopped:
            raise SandboxError("the sandbox is not running")
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir,
            "TMPDIR": os.path.join(self.root, "tmp"),
            "GREETING_OF_BACKEND": self.options.greeting,
            **self.spec.env,
        }
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(
                ["bash", "-c", command], cwd=self.workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
            self._groups.append(proc.pid)
            try:
                proc.communicate(stdin or b"", timeout=timeout_s)
                exit_code, timed_out = proc.returncode, False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                exit_code, timed_out = -1, True
            out.seek(0)
            text, truncated = cap_output(out.read(), self.options.output_cap_bytes)
        return ExecResult(output=text, exit_code=exit_code, timed_out=timed_out, truncated=truncated)

    def stop(self) -> None:
        self._stopped = True
        for group in self._groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except OSError:  # already gone
                pass
        self._groups.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
