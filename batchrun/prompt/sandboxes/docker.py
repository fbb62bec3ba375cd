"""Docker backend: one labelled container per prompt, commands through exec, removed at stop.

The run-level helpers live in ``docker_engine`` and are re-exported here: ``check_engine`` and
``ensure_images`` (preflight), ``sweep_containers`` and ``remove_owned_containers`` (cleanup).
"""

from __future__ import annotations

import logging
import os
import posixpath
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from docker.errors import APIError, DockerException, ImageNotFound, NotFound

from batchrun.prompt.sandboxes._shell import (
    EXEC_TAG_VAR,
    MarkerScanner,
    kill_argv,
    new_exec_token,
    wrapped_argv,
)
from batchrun.prompt.sandboxes.base import (
    DEFAULT_IMAGE,
    DEFAULT_OUTPUT_CAP_BYTES,
    CappedBuffer,
    ExecResult,
    Preflight,
    SandboxError,
    SandboxFlags,
    SandboxSpec,
    SetupError,
    check_option_types,
    parse_options,
    safe_run_name,
)
from batchrun.prompt.sandboxes.docker_engine import (
    LABEL_INDEX,
    LABEL_OWNER,
    LABEL_RUN,
    check_engine,
    default_owner,
    docker_client,
    ensure_images,
    remove_owned_containers,
    sweep_containers,
)
from batchrun.protocol import PromptJob

__all__ = [
    "DockerOptions",
    "DockerSandbox",
    "check_engine",
    "default_owner",
    "docker_client",
    "ensure_images",
    "remove_owned_containers",
    "sweep_containers",
]

log = logging.getLogger(__name__)

DEFAULT_WORKDIR = "/workspace"
KEEPALIVE = ["sh", "-c", "while :; do sleep 3600; done"]  # portable: not every sleep accepts "infinity"
START_ATTEMPTS = 3  # containers tried per start before the prompt fails
START_RETRY_PAUSE_S = 0.25  # times the attempt number, between attempts


@dataclass(frozen=True)
class DockerOptions:
    default_image: str = DEFAULT_IMAGE  # image for prompts whose record names none
    cpus: float = 1.0  # CPU cores one container may use
    memory_mb: int = 2048  # memory limit of one container (MiB), swap included
    pids_limit: int = 512  # most processes alive in one container
    network_mode: str = "bridge"  # Docker network mode; "none" whenever the spec asks for no network
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # most bytes of one command's output kept
    run_owner: str = ""  # "pid@host" of the run's parent process (see default_owner); "" = this process
    init: bool = True  # run docker-init as PID 1 so orphaned processes are reaped
    max_concurrent_starts: int = 8  # container start-ups in flight at once in one process

    def __post_init__(self) -> None:
        positive = ("cpus", "memory_mb", "pids_limit", "output_cap_bytes", "max_concurrent_starts")
        check_option_types(self, "docker", positive=positive)


# Start-ups in flight in this process, per limit (pitfall: too many at once exhaust the engine).
_start_slots: dict[int, threading.BoundedSemaphore] = {}
os.register_at_fork(after_in_child=_start_slots.clear)  # slots taken by the parent's threads are not ours


class DockerSandbox:
    """One container per prompt, kept alive by a sleep loop; each command is a separate exec."""

    synchronous_start = False  # a container takes a while: it starts during the first model call

    # -- run-level steps (see base.Sandbox)

    @classmethod
    def options_from(cls, flags: SandboxFlags) -> dict[str, Any]:
        return {
            "default_image": flags.default_image,
            "cpus": flags.cpus,
            "memory_mb": flags.memory_mb,
            "pids_limit": flags.pids_limit,
            "network_mode": "bridge" if flags.network else "none",
            "run_owner": default_owner(),
        }

    @classmethod
    def preflight(
        cls,
        jobs: Sequence[PromptJob],
        options: dict[str, Any],
        *,
        real_model: bool,
        network: bool,
        dataset: str = "the dataset",
    ) -> Preflight:
        """The engine answers; every image is present or pulled once, up front (never inside a worker)."""
        try:
            version = check_engine()
        except Exception as exc:
            raise SetupError(str(exc)) from None
        print(f"Docker engine {version}")
        default = options.get("default_image", DEFAULT_IMAGE)
        wanted = sorted({j.image or default for j in jobs})
        if not wanted:
            return Preflight(isolation="docker")
        print(f"Checking {len(wanted)} image(s); missing ones are pulled once")
        status = ensure_images(wanted, max_concurrent=4, progress=lambda m: print(f"  {m}"))
        width = max(len(i) for i in wanted)
        for image in wanted:
            state = "ready" if status[image] is None else f"NOT AVAILABLE: {status[image]}"
            print(f"  {image:<{width}}  {state}")
        failed = {
            j.prompt_index: f"image {(j.image or default)!r} not available: {status[j.image or default]}"
            for j in jobs
            if status[j.image or default] is not None
        }
        if failed:
            print(
                f"warning: {len(failed)} prompt(s) will fail without a model call because their image is "
                "missing; --resume runs them once it exists"
            )
        return Preflight(isolation="docker", failed=failed)

    @classmethod
    def prepare_run(cls, run_name: str, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """Containers of an earlier run of this name whose runner is dead go, before new ones start."""
        removed = sweep_containers(run_name)
        if removed:
            print(f"Removed {len(removed)} leftover container(s) of an earlier run named {run_name}")
        return options

    @classmethod
    def sweep(cls, options: dict[str, Any]) -> None:
        """After the pool ended: every container this run started (e.g. of prompts cut short) goes."""
        removed = remove_owned_containers(options.get("run_owner") or default_owner())
        if removed:
            print(f"Removed {len(removed)} container(s) left by interrupted prompts", file=sys.stderr)

    # -- one prompt's sandbox

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(DockerOptions, "docker", options)
        self.image = spec.image or self.options.default_image
        self.workdir = posixpath.join(DEFAULT_WORKDIR, spec.cwd) if spec.cwd else DEFAULT_WORKDIR
        self.isolation = "docker"
        self.container_id: str | None = None
        self._used = False  # whether a command ran in the current container

    def start(self) -> None:
        opts, spec = self.options, self.spec
        labels = {LABEL_RUN: spec.run_name, LABEL_INDEX: str(spec.prompt_index)}
        labels[LABEL_OWNER] = opts.run_owner or default_owner()
        safe_run = safe_run_name(spec.run_name)
        limits = {
            "nano_cpus": int(opts.cpus * 1e9),
            "mem_limit": f"{opts.memory_mb}m",
            "memswap_limit": f"{opts.memory_mb}m",
            "pids_limit": opts.pids_limit,
        }
        slots = _start_slots.setdefault(
            opts.max_concurrent_starts, threading.BoundedSemaphore(opts.max_concurrent_starts)
        )
        # An engine under heavy load sometimes fails a start it would do a moment later (runc's
        # "error reopening /dev/null inside container", an exec before the container runs). Nothing
        # of the prompt ran yet, so a fresh container is a safe retry.
        for attempt in range(1, START_ATTEMPTS + 1):
            with slots:
                try:
                    container = docker_client().containers.create(
                        self.image,
                        entrypoint=KEEPALIVE,
                        command=[],
                        name=f"br-{safe_run}-{spec.prompt_index}-{uuid.uuid4().hex[:8]}",
                        labels=labels,
                        working_dir=self.workdir,  # created by Docker when the image lacks it
                        environment=dict(spec.env),
                        init=opts.init,
                        network_mode=opts.network_mode if spec.network else "none",
                        **limits,
                    )
                    self.container_id = container.id  # from here on, stop() removes it whatever happens next
                    container.start()
                    self._used = False
                    return
                except ImageNotFound as exc:
                    raise SandboxError(
                        f"docker image {self.image!r} is not available locally: {exc.explanation}"
                    ) from exc
                except DockerException as exc:
                    self.stop()
                    if attempt == START_ATTEMPTS:
                        raise SandboxError(
                            f"docker container for prompt {spec.prompt_index} did not start "
                            f"({attempt} attempts): {exc}"
                        ) from exc
                    log.info("container start of prompt %s failed, trying again: %s", spec.prompt_index, exc)
            time.sleep(START_RETRY_PAUSE_S * attempt)

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        if self.container_id is None:
            raise SandboxError("docker sandbox is not started")
        token = new_exec_token()
        for attempt in (1, 2):
            try:
                exec_id, stream = self._exec(command, token)
                break
            except DockerException as exc:
                # A container dead before its first command (a start the engine botched under load)
                # ran nothing of the prompt yet: a new one is safe, once.
                dead_before_first = (
                    attempt == 1 and not self._used and isinstance(exc, APIError) and exc.status_code == 409
                )
                if not dead_before_first:
                    raise SandboxError(
                        f"docker exec failed in container of prompt {self.spec.prompt_index}: {exc}"
                    ) from exc
                log.info(
                    "container of prompt %s is not running before its first command: %s",
                    self.spec.prompt_index,
                    exc,
                )
                self.stop()
                self.start()
        self._used = True
        sock: socket.socket = getattr(stream, "_sock", stream)
        threading.Thread(target=_send_stdin, args=(sock, stdin or b""), daemon=True).start()
        scanner = MarkerScanner(token, CappedBuffer(self.options.output_cap_bytes))
        try:
            finished = _read_frames(sock, scanner, time.monotonic() + timeout_s)
        except OSError as exc:
            raise SandboxError(f"docker exec stream of prompt {self.spec.prompt_index} broke: {exc}") from exc
        finally:
            stream.close()
            sock.close()
        output, truncated = scanner.buf.result()
        if not finished:
            self._kill_command(token)
            return ExecResult(output=output, exit_code=-1, timed_out=True, truncated=truncated)
        exit_code = scanner.exit_code if scanner.done else self._exit_code(exec_id)
        return ExecResult(output=output, exit_code=exit_code, truncated=truncated)

    def stop(self) -> None:
        container_id, self.container_id = self.container_id, None
        if container_id is None:
            return
        try:
            docker_client().api.remove_container(container_id, force=True, v=True)
        except NotFound:
            pass
        except (DockerException, SandboxError) as exc:  # a later sweep finds it by its labels
            log.warning("could not remove container %s: %s", container_id[:12], exc)

    def _exec(self, command: str, token: str) -> tuple[str, object]:
        api = docker_client().api
        exec_id = api.exec_create(
            self.container_id, wrapped_argv(command, token), stdin=True, workdir=self.workdir,
            environment={EXEC_TAG_VAR: token},
        )["Id"]  # fmt: skip
        return exec_id, api.exec_start(exec_id, socket=True)

    def _kill_command(self, token: str) -> None:
        """SIGKILL, inside the container, every process of the command that carries ``token``."""
        try:
            api = docker_client().api
            api.exec_start(api.exec_create(self.container_id, kill_argv(token))["Id"])
        except DockerException as exc:
            raise SandboxError(f"container of prompt {self.spec.prompt_index} is gone: {exc}") from exc

    def _exit_code(self, exec_id: str) -> int:
        """Exit code from the engine, for commands that ended without printing the marker (killed shell)."""
        try:
            for _ in range(50):
                info = docker_client().api.exec_inspect(exec_id)
                if not info.get("Running"):
                    return int(info.get("ExitCode") or 0)
                time.sleep(0.02)
        except DockerException as exc:
            raise SandboxError(f"container of prompt {self.spec.prompt_index} is gone: {exc}") from exc
        return -1


def _send_stdin(sock: socket.socket, data: bytes) -> None:
    try:
        if data:
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)  # EOF for the command's stdin
    except OSError:
        pass  # the command exited without reading it all


def _read_frames(sock: socket.socket, scanner: MarkerScanner, deadline: float) -> bool:
    """Demultiplex the exec stream (8-byte headers: stream, 0, 0, 0, size) into ``scanner``.

    Returns False when the deadline passed before the command's end marker (or end of stream).
    """
    pending = bytearray()
    while not scanner.done:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if not select.select([sock], [], [], remaining)[0]:
            continue
        chunk = sock.recv(65536)
        if not chunk:
            scanner.finish()
            return True
        pending += chunk
        while len(pending) >= 8:
            size = int.from_bytes(pending[4:8], "big")
            if len(pending) < 8 + size:
                break
            scanner.feed(bytes(pending[8 : 8 + size]))
            del pending[: 8 + size]
    return True
