"""Local backend: each prompt gets a fresh private directory on this machine, removed at stop."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading

from agent.sandboxes.base import DEFAULT_OUTPUT_CAP_BYTES, CappedBuffer, ExecResult, SandboxError, SandboxSpec


class LocalSandbox:
    """Commands run in ``bash -c`` in their own process group, so a timeout kills everything they spawned."""

    def __init__(self, spec: SandboxSpec, *, output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES, base_dir: str | None = None):
        self.spec = spec
        self.output_cap_bytes = output_cap_bytes
        self.base_dir = base_dir
        self.isolation = "none"
        self.workdir = ""
        self._root: str | None = None
        self._owns_workdir = False

    def start(self) -> None:
        self._root = tempfile.mkdtemp(prefix=f"br-{self.spec.run_name}-{self.spec.prompt_index}-", dir=self.base_dir)
        if self.spec.cwd:
            self.workdir = os.path.abspath(self.spec.cwd)
            try:
                os.makedirs(self.workdir, exist_ok=True)
            except OSError as exc:
                raise SandboxError(f"cannot create cwd {self.spec.cwd!r}: {exc}") from exc
        else:
            self.workdir = os.path.join(self._root, "work")
            os.makedirs(self.workdir)
            self._owns_workdir = True

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        if self._root is None:
            raise SandboxError("sandbox is not started")
        env = {**os.environ, "HOME": self.workdir, "TMPDIR": self._root, **self.spec.env}
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.workdir,
            env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        buf = CappedBuffer(self.output_cap_bytes)
        reader = threading.Thread(target=_drain, args=(proc.stdout, buf), daemon=True)
        reader.start()
        if stdin is not None:
            try:
                proc.stdin.write(stdin)
                proc.stdin.close()
            except BrokenPipeError:
                pass
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        reader.join(timeout=5)
        output, truncated = buf.result()
        return ExecResult(output=output, exit_code=-1 if timed_out else proc.returncode, timed_out=timed_out, truncated=truncated)

    def stop(self) -> None:
        root, self._root = self._root, None
        if root:
            shutil.rmtree(root, ignore_errors=True)


def _drain(stream, buf: CappedBuffer) -> None:
    for chunk in iter(lambda: stream.read(65536), b""):
        buf.feed(chunk)
    stream.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
