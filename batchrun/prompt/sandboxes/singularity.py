"""Singularity/Apptainer backend through its CLI: one instance per prompt, commands via ``exec``.

Each instance runs with ``--containall`` (no host home, /tmp or environment inside) and a
writable overlay private to the prompt, so what one prompt writes no other prompt sees.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchrun.prompt.sandboxes._process import run_process
from batchrun.prompt.sandboxes.base import (
    DEFAULT_IMAGE,
    DEFAULT_OUTPUT_CAP_BYTES,
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
    safe_run_name,
)

log = logging.getLogger(__name__)

DEFAULT_WORKDIR = "/workspace"
OVERLAY_KINDS = ("dir", "tmpfs", "image")
PASSED_ENV = ("PATH", "LANG", "TERM", "APPTAINER_CACHEDIR", "SINGULARITY_CACHEDIR", "XDG_RUNTIME_DIR")


@dataclass(frozen=True)
class SingularityOptions:
    default_image: str = (
        DEFAULT_IMAGE  # image for prompts whose record names none; plain names mean docker://
    )
    executable: str = ""  # CLI to call; "" = apptainer, else singularity, whichever is on PATH
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # most bytes of one command's output kept
    overlay: str = "dir"  # writable layer: "dir" (a private directory), "tmpfs" (small, in memory), "image"
    overlay_size_mb: int = 1024  # size of the ext3 overlay image when overlay == "image"
    start_timeout_s: float = 900.0  # instance start, including a first pull and conversion of the image
    base_dir: str | None = None  # where per-prompt overlays are made; None: the system temp dir

    def __post_init__(self) -> None:
        check_option_types(
            self, "singularity", positive=("output_cap_bytes", "overlay_size_mb", "start_timeout_s")
        )
        if self.overlay not in OVERLAY_KINDS:
            raise ValueError(
                f"singularity sandbox option overlay must be one of {OVERLAY_KINDS}, got {self.overlay!r}"
            )


def find_executable(preferred: str = "") -> str:
    """Path of the apptainer (or singularity) CLI; ``SandboxError`` when neither is installed."""
    for name in [preferred] if preferred else ["apptainer", "singularity"]:
        path = shutil.which(name)
        if path:
            return path
    raise SandboxError(
        f"{preferred or 'apptainer/singularity'} not found on PATH: install Apptainer or choose another --sandbox"
    )


def image_ref(image: str) -> str:
    """``docker://`` for plain image names; paths (.sif, sandbox dirs) and refs with a scheme stay as they are."""
    if (
        "://" in image
        or image.startswith(("docker-daemon:", "/", "./", "../"))
        or image.endswith((".sif", ".img"))
    ):
        return image
    return image if os.path.exists(image) else f"docker://{image}"


def row_image_problem(image: str) -> str | None:
    """Why a dataset row may not name ``image`` (None: it may). A row is untrusted: a host directory
    it names would be the container's root (``"/"``: every file of the host, the runner's keys
    included, inside the prompt's sandbox). Such a sandbox directory is the user's to give, with
    --default_image; a row may name an image file (``.sif``) or a remote image."""
    ref = image_ref(image)
    if "://" in ref or ref.startswith("docker-daemon:") or not os.path.exists(ref):
        return None
    if os.path.isdir(ref):
        return (
            f"image {image!r} is a directory of this host: a row may not make one the container "
            "(a sandbox directory is given with --default_image); name an image file (.sif) or a remote image"
        )
    if not os.path.isfile(ref):
        return f"image {image!r} is no regular file (a device, a FIFO or a socket of this host)"
    return None


class SingularitySandbox(SandboxBackend):
    """One ``apptainer instance`` per prompt; stop() stops it and removes the private overlay."""

    synchronous_start = False  # an image may need converting: it starts during the first model call

    # -- run-level steps (see base.Sandbox)

    @classmethod
    def options_from(cls, flags: SandboxFlags) -> dict[str, Any]:
        return {"default_image": flags.default_image}

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
            print(f"Singularity/Apptainer CLI: {find_executable(options.get('executable', ''))}")
        except Exception as exc:
            raise SetupError(f"--sandbox=singularity: {exc}") from None
        failed = {}
        for job in jobs:
            image = getattr(job, "image", None)
            problem = row_image_problem(image) if image else None
            if problem:
                failed[job.prompt_index] = problem
        if failed:
            print(
                f"warning: {len(failed)} prompt(s) will fail without a model call: their row's image is a "
                "host directory or no regular file"
            )
        return Preflight(isolation="singularity", failed=failed)

    # -- one prompt's sandbox

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(SingularityOptions, "singularity", options)
        self.image = image_ref(spec.image or self.options.default_image)
        self.workdir = posixpath.join(DEFAULT_WORKDIR, spec.cwd) if spec.cwd else DEFAULT_WORKDIR
        self.isolation = "singularity"
        self.instance: str | None = None
        self._root: str | None = None
        self._exe = ""

    def start(self) -> None:
        problem = row_image_problem(self.spec.image) if self.spec.image else None
        if problem:
            raise SandboxError(f"singularity sandbox: {problem}")
        self._exe = find_executable(self.options.executable)
        safe_run = safe_run_name(self.spec.run_name)
        self._root = tempfile.mkdtemp(
            prefix=f"br-{safe_run}-{self.spec.prompt_index}-", dir=self.options.base_dir
        )
        name = f"br-{safe_run}-{self.spec.prompt_index}-{uuid.uuid4().hex[:8]}"
        argv = [self._exe, "instance", "start", "--containall", *self._overlay_args()]
        if not self.spec.network:
            argv += ["--net", "--network", "none"]
        self._cli(
            argv + [self.image, name],
            self.options.start_timeout_s,
            f"instance for image {self.image!r} did not start",
        )
        self.instance = name  # from here on, stop() stops it
        self._cli(
            [self._exe, "exec", "--cleanenv", f"instance://{name}", "mkdir", "-p", self.workdir],
            60,
            "cannot create cwd",
        )

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        if self.instance is None:
            raise SandboxError("singularity sandbox is not started")
        env_args = [f"--env={key}={value}" for key, value in self.spec.env.items()]
        argv = [
            self._exe,
            "exec",
            "--cleanenv",
            "--pwd",
            self.workdir,
            *env_args,
            f"instance://{self.instance}",
        ]
        return run_process(
            [*argv, "sh", "-c", command], stdin=stdin, timeout_s=timeout_s,
            output_cap_bytes=self.options.output_cap_bytes, env=_host_env(),
        )  # fmt: skip

    def end_processes(self, timeout_s: float) -> str | None:
        """Before judging: end every process the agent left (the instance has a PID namespace of its own)."""
        return end_processes_with_script(self, timeout_s)

    def stop(self) -> None:
        instance, self.instance = self.instance, None
        root, self._root = self._root, None
        if instance is not None:
            try:
                self._cli([self._exe, "instance", "stop", "--force", instance], 60, "instance stop failed")
            except SandboxError as exc:
                log.warning("%s", exc)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def _overlay_args(self) -> list[str]:
        if self.options.overlay == "tmpfs":
            return ["--writable-tmpfs"]
        overlay = os.path.join(self._root, "overlay")
        if self.options.overlay == "dir":
            os.mkdir(overlay)
        else:
            overlay += ".img"
            size = str(self.options.overlay_size_mb)
            self._cli(
                [self._exe, "overlay", "create", "--size", size, overlay], 300, "overlay image not created"
            )
        return ["--overlay", overlay]

    def _cli(self, argv: list[str], timeout_s: float, what: str) -> None:
        try:
            done = subprocess.run(
                argv, capture_output=True, timeout=timeout_s, env=_host_env(), stdin=subprocess.DEVNULL
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxError(f"singularity: {what}: {exc}") from exc
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).decode(errors="replace").strip()[-2000:]
            raise SandboxError(f"singularity: {what} (exit {done.returncode}): {detail}")


def _host_env() -> dict[str, str]:
    """The CLI's own environment: only what it needs, so no host secret can reach a container."""
    env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
    env.setdefault("PATH", os.defpath)
    env["HOME"] = os.environ.get("HOME", "/")
    return env
