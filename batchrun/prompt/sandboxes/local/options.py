"""The local backend's options (``--sandbox_settings``, the local flags) and the names its parts share."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.prompt.sandboxes.base import (
    DEFAULT_OUTPUT_CAP_BYTES,
    check_option_types,
)
from batchrun.prompt.sandboxes.local.limits import (
    Limits,
)

ISOLATION_MODES = ("auto", "bwrap", "none")
# Host variables a command may see; everything else (API keys above all) stays out of the sandbox.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TZ")
RUN_DIR_PREFIX = "batch-runner-"  # <runtime dir>/batch-runner-<run>-<pid>-<random>: one run's sandboxes
TAG_VAR = "BATCH_RUNNER_SANDBOX"  # marks every process of one sandbox, so stop() can find leftovers
DEFAULT_WORKDIR = "/workspace"  # inside bubblewrap, as for the container backends
CTL_DIR = "/.batch-runner"  # inside bubblewrap: the server's request files, read-only


@dataclass(frozen=True)
class LocalOptions:
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # most bytes of one command's output kept
    isolation: str = "auto"  # "auto": bwrap when it works here; "bwrap": required; "none": plain processes
    base_dir: str | None = None  # where the host-side private directories are made; None: the temp dir
    cwd_root: str | None = None  # isolation "none" only: the host directory an absolute cwd must lie in
    cpus: float = 1.0  # bwrap: CPU time per wall second, in cores (cgroup)
    memory_mb: int = 2048  # bwrap: memory of the prompt's processes (cgroup, else RLIMIT_AS per process)
    pids_limit: int = 512  # bwrap: processes at once (cgroup)
    disk_mb: int = 4096  # bwrap: size cap of the working directory and of /tmp (each a tmpfs)
    cgroup_parent: str | None = None  # the run's parent cgroup; None: one per process

    def __post_init__(self) -> None:
        check_option_types(
            self, "local", positive=("output_cap_bytes", "cpus", "memory_mb", "pids_limit", "disk_mb")
        )
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(
                f"local sandbox option isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}"
            )

    @property
    def limits(self) -> Limits:
        return Limits(
            cpus=self.cpus, memory_mb=self.memory_mb, pids_limit=self.pids_limit, disk_mb=self.disk_mb
        )


# Own PID, network, IPC, UTS and cgroup namespaces, gone with its parent. The command server is
# PID 1 (--as-pid-1): a command can then neither kill it nor, with it, the prompt's files, which
# live in tmpfs mounts that last as long as the namespace. Run as root, bwrap keeps every
