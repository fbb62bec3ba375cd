"""Modal backend: one Modal Sandbox per prompt, created from the prompt's image; commands via ``exec``.

The ``modal`` package is imported only when a sandbox starts, so the rest of the runner works
without it (``pip install 'batch-runner[modal]'`` and ``modal token new`` to use it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import posixpath
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import batchrun.prompt.limiter as limiter
from batchrun.prompt.sandboxes._shell import (
    MarkerScanner,
    kill_argv,
    new_exec_token,
    token_line,
    wrapped_argv,
)
from batchrun.prompt.sandboxes.base import (
    DEFAULT_IMAGE,
    DEFAULT_OUTPUT_CAP_BYTES,
    CappedBuffer,
    ExecResult,
    Preflight,
    SandboxBackend,
    SandboxError,
    SandboxFlags,
    SandboxSpec,
    SetupError,
    check_option_types,
    end_processes_with_script,
    parse_options,
)

log = logging.getLogger(__name__)

DEFAULT_WORKDIR = "/workspace"
KEEPALIVE = ("sh", "-c", "while :; do sleep 3600; done")
STDIN_CHUNK_BYTES = 64 * 1024  # the SDK buffers stdin writes in memory until drain(); keep each batch small
PREFLIGHT_S = 60.0  # the app's lookup before the run: Modal answers it in about a second
GRACE_S = 5.0  # past the command's timeout, how long to wait for Modal to end it before killing it ourselves
MODAL_MAX_TIMEOUT_S = 24 * 3600  # the longest lifetime Modal gives a sandbox
LIFETIME_MARGIN_S = 600.0  # a sandbox's lifetime: 2 x --prompt_timeout + MAX_SLOT_WAIT_S + this (as Docker's)


@dataclass(frozen=True)
class ModalOptions:
    default_image: str = DEFAULT_IMAGE  # registry image for prompts whose record names none
    # Lifetime of one prompt's sandbox; Modal ends it after this (options_from: from --prompt_timeout).
    timeout_s: int = 3600
    cpu: float = 1.0  # CPU cores requested per sandbox
    memory_mb: int = 2048  # memory requested per sandbox (MiB)
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # most bytes of one command's output kept
    app_name: str = "batch-runner"  # Modal app the sandboxes are grouped under (created if missing)

    def __post_init__(self) -> None:
        check_option_types(self, "modal", positive=("timeout_s", "cpu", "memory_mb", "output_cap_bytes"))


class ModalSandbox(SandboxBackend):
    """A remote Modal Sandbox kept alive by a sleep loop; terminated at stop()."""

    synchronous_start = False  # a cloud sandbox takes seconds: it starts during the first model call

    # -- run-level steps (see base.Sandbox)

    @classmethod
    def options_from(cls, flags: SandboxFlags) -> dict[str, Any]:
        # Fixed at 3600 s, a sandbox ended under a prompt with --prompt_timeout=3600 or more, or under one
        # of 1800 s that had waited half an hour for a request slot, at its next command.
        lifetime = flags.lifetime_s(LIFETIME_MARGIN_S)
        if flags.prompt_timeout_s + limiter.MAX_SLOT_WAIT_S + LIFETIME_MARGIN_S > MODAL_MAX_TIMEOUT_S:
            raise ValueError(
                f"--prompt_timeout={flags.prompt_timeout_s:g} is longer than a Modal sandbox can live "
                f"({MODAL_MAX_TIMEOUT_S} s, less {limiter.MAX_SLOT_WAIT_S + LIFETIME_MARGIN_S:g} s for a "
                "prompt's waits for request slots and a margin): a prompt would lose its sandbox under it"
            )
        return {
            "default_image": flags.default_image,
            "cpu": flags.cpus,
            "memory_mb": flags.memory_mb,
            "timeout_s": min(MODAL_MAX_TIMEOUT_S, math.ceil(lifetime)),
        }

    @classmethod
    def preflight(
        cls,
        jobs: Sequence[object],
        options: dict[str, Any],
        *,
        real_model: bool,
        network: bool,
        dataset: str = "the dataset",
    ) -> Preflight:
        try:
            import modal
        except ImportError:
            raise SetupError(
                "--sandbox=modal needs the modal SDK: pip install 'batch-runner[modal]'"
            ) from None
        if jobs:
            # The app every sandbox is made in, looked up once now: without credentials (no `modal token
            # new`, no MODAL_TOKEN_ID) or without a way to Modal, every prompt made its first model call
            # and then failed at its sandbox's start.
            app_name = options.get("app_name", ModalOptions.app_name)
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="modal-preflight")
            try:
                pool.submit(modal.App.lookup, app_name, create_if_missing=True).result(PREFLIGHT_S)
            except concurrent.futures.TimeoutError:
                raise SetupError(
                    f"--sandbox=modal: Modal did not answer within {PREFLIGHT_S:g} s (looking up the app "
                    f"{app_name!r}); is this machine able to reach it?"
                ) from None
            except Exception as exc:  # the SDK's AuthError, a connection error: what Modal said
                raise SetupError(
                    f"--sandbox=modal: cannot use Modal ({type(exc).__name__}: {str(exc)[:300]}); its "
                    "credentials come from `modal token new` or MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
                ) from None
            finally:
                pool.shutdown(wait=False)
        return Preflight(isolation="modal")

    # -- one prompt's sandbox

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(ModalOptions, "modal", options)
        self.image = spec.image or self.options.default_image
        self.workdir = posixpath.join(DEFAULT_WORKDIR, spec.cwd) if spec.cwd else DEFAULT_WORKDIR
        self.isolation = "modal"
        self._sandbox: Any = None

    def start(self) -> None:
        try:
            import modal
        except ImportError as exc:
            raise SandboxError(
                "the modal backend needs the modal package: pip install 'batch-runner[modal]'"
            ) from exc
        opts, spec = self.options, self.spec
        try:
            app = modal.App.lookup(opts.app_name, create_if_missing=True)
            secrets = [modal.Secret.from_dict(dict(spec.env))] if spec.env else []
            self._sandbox = modal.Sandbox.create(
                *KEEPALIVE, app=app, image=modal.Image.from_registry(self.image), secrets=secrets,
                timeout=opts.timeout_s, cpu=opts.cpu, memory=opts.memory_mb, block_network=not spec.network,
            )  # fmt: skip
            mkdir = self._sandbox.exec("mkdir", "-p", self.workdir, timeout=60, text=False)
            exit_code = mkdir.wait()
        except Exception as exc:  # the SDK raises its own exception types; any of them fails the start
            raise SandboxError(f"modal sandbox for image {self.image!r} did not start: {exc}") from exc
        if exit_code != 0:
            raise SandboxError(f"modal sandbox: cannot create cwd {self.workdir!r} (exit {exit_code})")

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        return self._run(command, timeout_s=timeout_s, stdin=stdin)

    def run_judged(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """A command whose exit code judges the sample (verify, a scorer's): the exit code Modal reports
        for its process, not the one after the end marker (a command that reads the marker's token
        from its wrapper's memory can print it)."""
        return self._run(command, timeout_s=timeout_s, stdin=stdin, judged=True)

    def _run(
        self, command: str, *, timeout_s: float, stdin: bytes | None, judged: bool = False
    ) -> ExecResult:
        if self._sandbox is None:
            raise SandboxError("modal sandbox is not started")
        token, began = new_exec_token(), time.monotonic()
        scanner = MarkerScanner(token, CappedBuffer(self.options.output_cap_bytes))
        try:
            proc = self._sandbox.exec(
                *wrapped_argv(command, token),
                timeout=max(1, math.ceil(timeout_s)),
                workdir=self.workdir,
                text=False,
            )
        except Exception as exc:
            raise SandboxError(
                f"modal exec failed in sandbox of prompt {self.spec.prompt_index}: {exc}"
            ) from exc
        reader = threading.Thread(target=_read_until_marker, args=(proc, scanner), daemon=True)
        reader.start()
        _send_stdin(proc, token_line(token) + (stdin or b""))  # the token: in no argv the command sees
        reader.join(timeout_s + GRACE_S)
        if reader.is_alive():  # Modal did not end it: kill the command's processes ourselves
            self._kill(token)
            reader.join(GRACE_S)
        output, truncated = scanner.buf.result()
        if scanner.done and judged:
            code = _process_exit(proc, began + timeout_s)
            if code is None:  # a marker it printed itself, then ran on
                self._kill(token)
                return ExecResult(output=output, exit_code=-1, timed_out=True, truncated=truncated)
            return ExecResult(output=output, exit_code=code, truncated=truncated)
        if scanner.done:
            return ExecResult(output=output, exit_code=scanner.exit_code, truncated=truncated)
        timed_out = time.monotonic() - began >= timeout_s
        exit_code = -1 if timed_out else (proc.poll() if proc.poll() is not None else -1)
        return ExecResult(output=output, exit_code=exit_code, timed_out=timed_out, truncated=truncated)

    def end_processes(self, timeout_s: float) -> str | None:
        """Before judging: end every process the agent left (the sandbox has a PID namespace of its own)."""
        return end_processes_with_script(self, timeout_s)

    def stop(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is None:
            return
        try:
            sandbox.terminate()
        except Exception as exc:  # Modal ends it anyway after timeout_s
            log.warning("could not terminate modal sandbox of prompt %s: %s", self.spec.prompt_index, exc)

    def _kill(self, token: str) -> None:
        try:
            self._sandbox.exec(*kill_argv(token), timeout=30, text=False).wait()
        except Exception as exc:
            raise SandboxError(f"modal sandbox of prompt {self.spec.prompt_index} is gone: {exc}") from exc


def _process_exit(proc: Any, deadline: float) -> int | None:
    """The exit code Modal reports for ``proc`` once it ends; None if it still runs at ``deadline``."""
    while True:
        code = proc.poll()
        if code is not None:
            return code
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _read_until_marker(proc: Any, scanner: MarkerScanner) -> None:
    for chunk in proc.stdout:
        scanner.feed(chunk)
        if scanner.done:
            return
    scanner.finish()


def _send_stdin(proc: Any, data: bytes) -> None:
    try:
        for at in range(0, len(data), STDIN_CHUNK_BYTES):
            proc.stdin.write(data[at : at + STDIN_CHUNK_BYTES])
            proc.stdin.drain()
        proc.stdin.write_eof()
        proc.stdin.drain()
    except Exception as exc:  # the command exited without reading it all
        log.debug("stdin not fully delivered: %s", exc)
