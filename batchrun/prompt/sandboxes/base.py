"""The sandbox interface every backend implements, and the small helpers they share.

A sandbox is one isolated place where one prompt's tools run. Its whole surface is
``start`` / ``run`` / ``stop``: the file tools are built on ``run`` (with stdin), so every
backend supports every tool without backend-specific file code.
"""

from __future__ import annotations

import functools
import math
import os
import re
import select
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import (
    Any,
    ClassVar,
    Protocol,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    runtime_checkable,
)

import batchrun.prompt.limiter as limiter

DEFAULT_OUTPUT_CAP_BYTES = 64 * 1024
DEFAULT_IMAGE = "python:3.11-slim"  # container backends: the image of rows that name none (--default_image)
TRUNCATION_NOTE = "\n[output truncated: {dropped} of {total} bytes not shown]"
# Processes the ``process`` tool starts carry BACKGROUND_ENV in their environment, and their state
# lives in BACKGROUND_DIR under $TMPDIR (else /tmp) inside the sandbox. A backend that ends each
# command's leftovers (local with bubblewrap) spares processes marked so while that directory exists:
# they run on until the process tool kills them or the sandbox stops.
BACKGROUND_ENV = ("BATCH_RUNNER_BACKGROUND", "1")
BACKGROUND_DIR = ".batch-runner-processes"


# Before a sample is judged, once nothing of the agent runs: /dev's standard links and devices as they
# were, where the judging user may write /dev (root in a Docker or Modal container, whose /dev is a
# writable tmpfs; a local sandbox's is read-only, and another user may not write a container's either,
# so the agent, running as that user, could not have changed it). Otherwise the agent could replace
# /dev/fd (rm, then ln -s to a directory of files of its own): a hidden test's `diff <(...) <(...)`
# (bash hands diff /dev/fd/63) or `cmp /dev/fd/3 /dev/fd/4` then compared two files it planted and
# passed whatever the work. Each link is checked with builtins (a link that resolves where the standard
# one does for this shell) and made again only when it is wrong; a device that is there but no
# character device of its own (a file, a link) is made again (mknod; its numbers are not checked).
# Exit status 1, saying what, when one cannot be put back: no verdict rather than a forged one.
RESTORE_DEV = r"""restore_dev() {
    [ -w /dev ] || return 0
    for l in fd:/proc/self/fd stdin:/proc/self/fd/0 stdout:/proc/self/fd/1 stderr:/proc/self/fd/2; do
        d=/dev/${l%%:*} t=${l#*:}
        [ -L "$d" ] && [ "$d" -ef "$t" ] && continue
        rm -rf "$d" && ln -s "$t" "$d" || { echo "batch-runner: could not restore $d"; return 1; }
    done
    for c in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
        d=/dev/${c%%:*} m=${c#*:}
        { [ -e "$d" ] || [ -L "$d" ]; } || continue
        [ -c "$d" ] && ! [ -L "$d" ] && continue
        rm -rf "$d" && mknod -m 666 "$d" c "${m%:*}" "${m#*:}" || { echo "batch-runner: could not restore $d"; return 1; }
    done
}
"""


# Before a sample is judged in its sandbox (verify, a user's scorer), nothing the agent started may
# still run: a process left in the background could rewrite the hidden verify files once written, or
# the verify's own output, and fake a pass. A sandbox that can end them has ``end_processes(timeout_s)``:
# None once they are gone, else why not (SandboxError: the sandbox itself is gone). In a sandbox with a
# PID namespace of its own, this script does it: it kills every process but PID 1, itself, its ancestors
# (the sandbox's command server) and the PIDs given as its arguments (a server's other processes),
# round after round until none is left alive (a process forking in a loop is caught in the next round;
# a zombie is dead already, but not one whose other threads still run: a thread group whose first
# thread alone has exited shows state Z, its num_threads above 1). Builtins only while it looks, so that
# it never counts a child of its own; after 20 rounds it waits 20 ms between two (``sleep``, done before
# the next look): a process killed may take a while to end on a loaded machine (its sandbox's CPU quota
# spent, 8 runnable tasks a core), and 200 rounds back to back took well under a second there, so a
# test's helper, killed, read "still alive after 200 rounds" and the sample got no verdict (a scorer
# error). Once none is left, /dev is put back as it was (RESTORE_DEV). Never run it where the PID
# namespace is the host's: it would kill every process of the user it runs as.
END_PROCESSES_SCRIPT = (
    RESTORE_DEV
    + r"""
keep=" 1 $$ $* " p=$$
while [ "$p" -gt 1 ] 2>/dev/null; do
    IFS= read -r line < "/proc/$p/stat" || break
    set -- ${line##*) }
    p=$2 keep="$keep$2 "
done
n=0
while [ "$n" -lt 200 ]; do
    n=$((n + 1)) live=
    for f in /proc/[0-9]*/stat; do
        pid=${f#/proc/} pid=${pid%/stat}
        case $keep in *" $pid "*) continue ;; esac
        { IFS= read -r line < "$f"; } 2>/dev/null || continue
        set -- ${line##*) }
        [ "$1" = Z ] && [ "${18}" -le 1 ] 2>/dev/null && continue
        kill -9 "$pid" 2>/dev/null
        live=1
    done
    [ -n "$live" ] || { restore_dev; exit; }
    [ "$n" -gt 20 ] && { sleep 0.02 2>/dev/null || :; }
done
echo "batch-runner: processes left by the agent were still alive after $n rounds of kill -9"
exit 1
"""
)


def end_processes_with_script(sandbox: Any, timeout_s: float) -> str | None:
    """End what the agent left running with :data:`END_PROCESSES_SCRIPT`, run by ``sandbox.run_judged``
    where it has one, else ``sandbox.run`` (a sandbox with a PID namespace of its own): None once they
    are gone, else why not. Judged: a process of the agent, alive until the script kills it, could
    otherwise print the script's end marker itself."""
    return end_problem(trusted_run(sandbox)(END_PROCESSES_SCRIPT, timeout_s=timeout_s), timeout_s)


def judged_run(sandbox: Any) -> Any:
    """How to run a command whose exit code judges a sample: the sandbox's ``run_judged`` when it has
    one (its exit code from where no command can print it), else its ``run``."""
    return getattr(sandbox, "run_judged", None) or sandbox.run


def trusted_run(sandbox: Any) -> Any:
    """How to run a judging step of the runner's own (the hidden files' writes): the sandbox's
    ``run_trusted`` when it has one (Docker: in a static busybox the agent cannot replace, not in the
    image's sh and tools), else :func:`judged_run`."""
    return getattr(sandbox, "run_trusted", None) or judged_run(sandbox)


def end_problem(res: ExecResult, timeout_s: float) -> str | None:
    """What :data:`END_PROCESSES_SCRIPT`'s result says: None once the processes are gone, else why not."""
    if res.timed_out:
        return f"ending them took longer than {timeout_s:g} s"
    if res.exit_code != 0:
        return res.output.strip()[-200:] or f"exit code {res.exit_code}"
    return None


class SandboxError(RuntimeError):
    """Infrastructure failure: the sandbox could not start, or is gone. Fails the prompt."""


class SetupError(RuntimeError):
    """A backend cannot work here, or with these options: the run does not start (exit 2, this message)."""


@dataclass(frozen=True)
class SandboxFlags:
    """The run's sandbox flags, backend-independent; each backend's ``options_from`` takes what applies."""

    default_image: str = DEFAULT_IMAGE  # container backends: the image of rows that name none
    local_isolation: str = "auto"  # local backend: auto, bwrap or none
    cpus: float = 1.0  # CPUs of one prompt's sandbox
    memory_mb: int = 2048  # memory of one prompt's sandbox (MiB)
    pids_limit: int = 512  # most processes in one prompt's sandbox
    prompt_timeout_s: float = 1800.0  # a prompt's time limit (a container's lifetime is bounded by it)
    disk_mb: int = 4096  # the size cap of one prompt's working directory (and, local, of its /tmp)
    network: bool = True  # whether the prompt's commands may reach the network
    cwd_root: str | None = None  # local without isolation: the host directory every row's cwd must lie in

    def lifetime_s(self, margin_s: float) -> float:
        """How long a remote or container sandbox may live before it ends itself (Docker) or its service
        ends it (Modal), a backstop should the runner's death go unnoticed: it must outlive its prompt,
        which may outlive ``--prompt_timeout`` by the run-wide pauses for rate limits (hence twice it and
        the margin) and by its credited waits for a request slot once under way (its sandbox starts with
        its first request), up to ``MAX_SLOT_WAIT_S``."""
        return 2 * self.prompt_timeout_s + limiter.MAX_SLOT_WAIT_S + margin_s


@dataclass(frozen=True)
class Preflight:
    """What a backend's run-level preflight found, before any token is spent."""

    isolation: str  # the isolation really in force, for the statistics ("bwrap", "none", "docker", ...)
    failed: dict[int, str] = field(default_factory=dict)  # prompt index -> why it fails without a model call
    options: dict[str, Any] | None = None  # the options the run goes on with, when preflight settled one
    facts: dict[str, Any] = field(default_factory=dict)  # what statistics.json should say of the sandboxes
    # The slow rest (image pulls), run after the endpoint's start check, so that a wrong key or model
    # is found in seconds, not after the pulls; what it finds is laid over this one.
    after_check: Callable[[], Preflight] | None = None


@dataclass(frozen=True)
class SandboxSpec:
    """What one prompt's sandbox must look like. Backend-independent."""

    run_name: str
    prompt_index: int
    image: str | None = None  # container image (docker, modal, singularity); ignored by local
    cwd: str | None = None  # working directory of the prompt's commands; created if absent
    network: bool = True  # whether commands may reach the network
    env: dict[str, str] = field(default_factory=dict)  # extra environment for commands


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command. A non-zero exit code is an observation, not an error."""

    output: str  # stdout and stderr interleaved, decoded as UTF-8 with replacement, capped
    exit_code: int  # -1 when the command was killed by the timeout
    timed_out: bool = False
    truncated: bool = False
    # The sandbox's own notes appended to ``output`` (a limit reached: "[batch-runner: /tmp is full ...]"),
    # one line each: the model reads them, a verify's partial-credit line is read before them.
    notes: tuple[str, ...] = ()

    def command_output(self) -> str:
        """``output`` without the sandbox's notes: what the command itself printed."""
        if not self.notes:
            return self.output
        added = "\n".join(self.notes)
        return self.output[: -len(added)].removesuffix("\n") if self.output.endswith(added) else self.output


@runtime_checkable
class Sandbox(Protocol):
    """One prompt's isolated environment. ``stop`` is idempotent and safe after a failed ``start``.

    A backend's class implements this for one prompt and subclasses :class:`SandboxBackend` for the
    run: its declared capabilities and its run-level steps, so the orchestrator names no backend.
    Optional: ``end_processes(timeout_s)`` (see ``END_PROCESSES_SCRIPT``) and ``run_judged`` (``run``'s
    signature), for the commands whose exit code judges a sample (verify, a scorer's), where ``run``
    reads an exit code that a command could print itself (an end marker whose token it can read).
    """

    spec: SandboxSpec
    workdir: str  # absolute path, inside the sandbox, where commands start and relative paths resolve
    isolation: str  # short description of the isolation really in force, e.g. "bwrap", "none", "docker"

    def start(self) -> None: ...

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult: ...

    def stop(self) -> None: ...


class SandboxBackend:
    """The run-level side of a sandbox backend: what it declares and the steps it owns, with defaults.

    A backend is a class that subclasses this and implements :class:`Sandbox` (``__init__(spec,
    **options)``, ``start``, ``run``, ``stop``). The runner finds it by name (the built-ins, or a
    ``batch_runner.sandboxes`` entry point) or by dotted path (``package.module:Class``), and reads
    only what is declared here. ``batchrun.prompt.sandboxes.conformance`` is the contract suite a
    backend proves itself with.
    """

    # Capabilities, declared on the class (the runner never probes for them).
    synchronous_start: ClassVar[bool] = False  # start on the prompt's thread (a quick start), else
    # overlapped with the prompt's first model call
    starts_per_cpu: ClassVar[int | None] = None  # a start bound by this machine's CPU: at most this
    # many at once per core (None: bounded by --max_sandbox_starts alone)
    direct_files: ClassVar[bool] = False  # implements DirectFileAccess (the file tools skip commands)
    synchronous_stop: ClassVar[bool] = (
        False  # a stop of a few ms: on the prompt's thread, never the stopper's
    )
    # The per-prompt limits this machine itself must be able to give ("memory", "cpus"; "disk_in_memory":
    # the sandbox's files live in RAM under the same memory limit, so memory + disk must fit): a flag
    # asking for more than it has stops the run at start. A remote backend's machines are not this one.
    host_bounds: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def options_from(cls, flags: SandboxFlags) -> dict[str, Any]:
        """The backend's options from the run's sandbox flags (``--sandbox_options`` are laid over them)."""
        return {}

    @classmethod
    def preflight(
        cls, jobs: Sequence[Any], options: dict[str, Any], *, real_model: bool, network: bool,
        dataset: str = "the dataset",
    ) -> Preflight:  # fmt: skip
        """Before any token: check this machine and the jobs (raise :class:`SetupError` to stop the run)."""
        return Preflight(isolation=cls.__name__)

    @classmethod
    def prepare_run(cls, run_name: str, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """Once per run, in the parent: the options the workers get."""
        return options

    @classmethod
    def sweep_dead(cls, run_name: str) -> None:
        """Once per run, in the parent, before any sandbox: remove what runners that are gone left here (a
        runner killed outright sweeps nothing). ``prepare_run`` of a backend that leaves anything calls
        it; a run that starts no sandbox (a ``--resume`` with nothing left to run) calls it alone."""

    @classmethod
    def run_facts(cls, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """What statistics.json says of the run's sandboxes as ``prepare_run`` settled them (``options``:
        what it returned), beside what preflight found (``Preflight.facts``)."""
        return {}

    @classmethod
    def sweep(cls, options: dict[str, Any]) -> None:
        """Once the workers are gone: remove whatever the run's sandboxes left (idempotent)."""

    @classmethod
    def prepare_process(cls) -> None:
        """What every process that builds this backend's sandboxes does once, before its first (probes
        of this machine, cached): called in the workers' forkserver before it forks them, so each
        worker inherits it instead of doing it again (batchrun/run/worker_warm.py)."""


# What the prompts of a run may hold together, whatever their own limits: the rest of the machine's
# memory and processes stays the host's (the runner's own workers, the shell a user logs in with). A
# thousand prompts of 4 GiB each, or of 512 processes each on a kernel whose pid_max is 32,768, would
# otherwise take all of it: the kernel's OOM killer could pick the runner, and no process could fork.
HOST_SHARE_KEPT = 0.25  # of the machine's memory and of its processes, at least:
HOST_MEMORY_KEPT = 1 << 30
HOST_PIDS_KEPT = 2048


def kernel_pids() -> int:
    """Processes and threads this kernel can have at once: kernel.pid_max and kernel.threads-max."""
    found = []
    for name in ("pid_max", "threads-max"):
        try:
            with open(f"/proc/sys/kernel/{name}") as f:
                found.append(int(f.read()))
        except (OSError, ValueError):
            continue
    return min(found) if found else 32768


def run_share(memory_bytes: int, pids: int) -> tuple[int, int]:
    """(memory bytes, processes) a run's prompts may hold together out of the machine's ``memory_bytes``
    and ``pids``: all but a quarter of each, and at least 1 GiB and 2,048 processes, kept for the host."""
    return (
        max(64 << 20, memory_bytes - max(HOST_MEMORY_KEPT, int(memory_bytes * HOST_SHARE_KEPT))),
        max(64, pids - max(HOST_PIDS_KEPT, int(pids * HOST_SHARE_KEPT))),
    )


def usable_cpus() -> int:
    """The CPUs this process may use: those its affinity allows (``taskset``, a container's cpuset),
    and no more than its cgroup's CPU quota (``docker --cpus``, a CI runner's limit), rounded up.
    ``os.cpu_count()`` counts the machine's, which a runner confined to two of 64 cores must not plan by."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota) if quota else cpus))


def _cgroup_cpu_quota() -> float | None:
    """Cores' worth of CPU time this process's cgroup allows per period (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``), the strictest along its path; None: no quota."""
    own = own_cgroup_dir("cpu")
    if own is None:
        return None
    where, v2 = own[0], own[1] == 2
    found: list[float] = []
    for path in cgroup_ancestry(where, "cpu.max" if v2 else "cpu.cfs_quota_us"):
        try:
            if v2:
                with open(os.path.join(path, "cpu.max")) as f:
                    quota, period = f.read().split()[:2]
            else:
                with open(os.path.join(path, "cpu.cfs_quota_us")) as f:
                    quota = f.read().strip()
                with open(os.path.join(path, "cpu.cfs_period_us")) as f:
                    period = f.read().strip()
            if quota not in ("max", "-1") and int(period) > 0:
                found.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


# -- this process's own cgroups, read only (the local backend's limits make cgroups: local/limits.py)


def cgroup_mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of every cgroup mount."""
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields_, rest = left.split(), right.split()
        if len(fields_) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            found.append((fields_[3], fields_[4], rest[0], set(rest[2].split(","))))
    return found


def own_cgroup_paths() -> dict[str, str]:
    """Hierarchy key ("" for v2, else each controller name) -> this process's cgroup path."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(",") if names else [""]:
                own[name] = path
    return own


def cgroup_dir_in(mount_root: str, mount_point: str, own: str) -> Path:
    """This process's cgroup ``own`` as a directory under a mount of its hierarchy."""
    rel = own[len(mount_root) :] if own.startswith(mount_root) else ""
    path = Path(mount_point, rel.lstrip("/"))
    return path if path.is_dir() else Path(mount_point)  # a cgroup namespace shows its root only


def own_cgroup_dir(controller: str) -> tuple[str, int] | None:
    """This process's own cgroup directory for ``controller`` and its cgroup version: its v1 hierarchy's,
    else cgroup v2's; None: neither."""
    try:
        own, mounts = own_cgroup_paths(), cgroup_mounts()
    except (OSError, ValueError):
        return None
    for root, point, fstype, opts in mounts:
        if fstype == "cgroup" and controller in opts and controller in own:
            return str(cgroup_dir_in(root, point, own[controller])), 1
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            return str(cgroup_dir_in(root, point, own[""])), 2
    return None


def cgroup_ancestry(path: str, name: str) -> list[str]:
    """``path`` and its ancestors, up to the last that has the file ``name`` (a limit on a slice or pod
    above an unlimited cgroup binds all the same)."""
    out = [path]
    while True:
        parent = os.path.dirname(path)
        if parent == path or not os.path.exists(os.path.join(parent, name)):
            return out
        out.append(parent)
        path = parent


def number_in(path: str) -> int | None:
    """The integer in a one-line file; None for "max" (no limit) or a file that cannot be read."""
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None


def own_cgroup_limit(controller: str, v1_name: str, v2_name: str) -> int | None:
    """The strictest ``controller`` limit on this process's own cgroup and its ancestors; None: none."""
    own = own_cgroup_dir(controller)
    if own is None:
        return None
    where, name = own[0], v1_name if own[1] == 1 else v2_name
    found = [v for p in cgroup_ancestry(where, name) if (v := number_in(os.path.join(p, name))) is not None]
    return min(found) if found else None


def declared(sandbox: object, capability: str) -> Any:
    """What ``sandbox`` (or a backend class) declares of a :class:`SandboxBackend` capability; a
    sandbox that is no SandboxBackend (a test's stand-in, a wrapper) has the defaults."""
    return getattr(sandbox, capability, getattr(SandboxBackend, capability))


class DirectFileAccess(Protocol):
    """Optional, for a backend whose prompt files this process can reach without running a command.

    The file tools try these first; None or False means "not this way" (the file is elsewhere,
    not a plain file, not permitted...), and they then run their usual commands in the sandbox,
    which give the usual errors. Paths are the tool's: relative to ``workdir``, ``~`` for $HOME.
    """

    def read_direct(self, path: str, max_bytes: int) -> bytes | None: ...

    def write_direct(self, path: str, data: bytes, *, make_parents: bool) -> bool: ...


def safe_run_name(run_name: str) -> str:
    """The run name as it appears in container, instance and directory names: name characters, at most 40."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)[:40]


def readable(fd: Any, timeout_s: float) -> bool:
    """Whether ``fd`` (a descriptor, or an object with ``fileno()``) has input or its end within
    ``timeout_s``. poll(2), not select(2), which refuses descriptors above 1023: a worker with
    hundreds of sandboxes in flight holds thousands."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


def tail_bytes(cap_bytes: int) -> int:
    """Of an output cut to ``cap_bytes``, how much is its end (the rest its start): a quarter."""
    return cap_bytes // 4


def _cut(head: bytes, tail: bytes, total: int) -> str:
    """The start and the end of an output of ``total`` bytes, the note between them. The end starts at a
    line's start where it holds one (its first line would be a piece of one)."""
    if b"\n" in tail[:-1]:
        tail = tail[tail.index(b"\n") + 1 :]
    dropped = total - len(head) - len(tail)
    text = head.decode("utf-8", errors="ignore") + TRUNCATION_NOTE.format(dropped=dropped, total=total)
    return text + ("\n" + tail.decode("utf-8", errors="ignore") if tail else "")


def cap_output(data: bytes, cap_bytes: int) -> tuple[str, bool]:
    """Decode command output, keeping at most ``cap_bytes`` (its start and its end, as
    :class:`CappedBuffer` keeps a stream's) and saying how much was cut."""
    buf = CappedBuffer(cap_bytes)
    buf.feed(data)
    return buf.result()


class CappedBuffer:
    """Collects a stream's bytes up to a cap while counting everything, so huge output costs no memory.

    Past the cap it keeps the start (three quarters of it) and the end (the last quarter), the note of
    what was cut between them: the end is where a command says how it went (a test's summary, the
    partial-credit line a verify prints last). Only the start was kept: a verify whose checked code
    wrote 64 KiB to stderr lost its test's `{"score": 0.0}` line, and its exit 0 read as full credit."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self.head_cap = cap_bytes - tail_bytes(cap_bytes)
        self.tail_cap = tail_bytes(cap_bytes)
        self.parts: list[bytes] = []
        self.kept = 0
        self.total = 0
        self.tail = bytearray()  # the last bytes past the start's room (up to twice tail_cap, trimmed)

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - self.kept
        if room > 0:
            piece = chunk[:room]
            self.parts.append(piece)
            self.kept += len(piece)
            chunk = chunk[room:]
        if chunk and self.tail_cap:
            self.tail += chunk[-self.tail_cap :] if len(chunk) > self.tail_cap else chunk
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def result(self) -> tuple[str, bool]:
        data = b"".join(self.parts)
        if self.total <= self.cap_bytes:
            return (data + bytes(self.tail)).decode("utf-8", errors="replace"), False
        return _cut(data, bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b"", self.total), True


OptionsT = TypeVar("OptionsT")


def parse_options(options_cls: type[OptionsT], backend: str, options: dict[str, Any]) -> OptionsT:
    """Build a backend's options dataclass; an unknown key raises ``ValueError`` naming the valid ones."""
    names = [f.name for f in fields(options_cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(
            f"unknown {backend} sandbox option(s): {', '.join(unknown)}; valid options: {', '.join(names)}"
        )
    return options_cls(**options)


def check_option_types(options: Any, backend: str, *, positive: tuple[str, ...] = ()) -> None:
    """Check each field of an options dataclass against its annotation; ``positive`` fields must be > 0."""
    for name, expected, allowed in _field_types(type(options)):
        value = getattr(options, name)
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            raise ValueError(f"{backend} sandbox option {name} must be {_type_name(expected)}, got {value!r}")
        if name in positive and not value > 0:
            raise ValueError(f"{backend} sandbox option {name} must be > 0, got {value!r}")


@functools.cache
def _field_types(options_cls: type) -> tuple[tuple[str, Any, tuple[type, ...]], ...]:
    """(name, annotation, the types a value may have) of each field; resolved once per
    options class: resolving annotations costs more than the check itself, at every sandbox start."""
    hints = get_type_hints(options_cls)
    found = []
    for f in fields(options_cls):
        expected = hints[f.name]
        allowed = get_args(expected) if get_origin(expected) in (Union, types.UnionType) else (expected,)
        if float in allowed:
            allowed = (*allowed, int)
        found.append((f.name, expected, allowed))
    return tuple(found)


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)
