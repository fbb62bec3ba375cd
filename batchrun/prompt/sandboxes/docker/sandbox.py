"""Docker backend: one labelled container per prompt, its commands run by a server inside, removed at stop.

The container's main process is a small ``sh`` command server (``container_server``) that reads
requests on its stdin and answers on its stdout, both held by this process through one attach
stream: a command costs no API call and no ``docker exec`` (only a timeout's kill does). When the
process holding the stream dies (even by SIGKILL) the kernel closes it, the engine closes stdin,
and the container ends and removes itself, even in the middle of a command. ``lifetime_s`` bounds
it anyway. With the network on, where the runner may, the container is on no network of the
engine's but on a link of its own into its worker's slirp4netns (the local backend's ``network_hub``):
not Docker's bridge, through which it reached the host's services and the other containers.

The run-level helpers live in ``engine``: ``check_engine``,
``ensure_images`` and ``storage_size_supported`` (preflight), ``sweep_containers`` and
``remove_owned_containers`` (cleanup).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import posixpath
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from docker.errors import APIError, ImageNotFound, NotFound
from docker.types import LogConfig, Mount

import batchrun.prompt.sandboxes.docker.container_server as server
from batchrun.prompt.sandboxes._shell import (
    EXEC_TAG_VAR,
    MarkerScanner,
    exec_tag,
    kill_argv,
    new_exec_token,
    sh_c,
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
    end_problem,
    kernel_pids,
    parse_options,
    readable,
    run_share,
    safe_run_name,
)
from batchrun.prompt.sandboxes.docker import frozen_guard
from batchrun.prompt.sandboxes.docker.disk_watch import disk_watch
from batchrun.prompt.sandboxes.docker.engine import (
    ENGINE_ERRORS,
    LABEL_INDEX,
    LABEL_OWNER,
    LABEL_RUN,
    NO_SH,
    NOT_PULLED,
    PULL_BUDGET_S,
    PULL_TIMEOUT_S,
    _read_runnable,
    check_engine,
    default_owner,
    docker_client,
    engine_processes_problem,
    ensure_images,
    is_run_cgroup,
    kill_cgroup_processes,
    layer_paths,
    layer_watch_problem,
    make_run_cgroup,
    remove_owned_containers,
    remove_run_cgroup,
    run_cgroup_problem,
    sh_not_found,
    sh_words,
    storage_size_supported,
    sweep_containers,
    sweep_run_cgroups,
    wait_removed,
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
    "storage_size_supported",
    "sweep_containers",
    "tmpfs_size_mb",
]

log = logging.getLogger(__name__)

DEFAULT_WORKDIR = "/workspace"
LIFETIME_MARGIN_S = 600.0  # a container ends itself after 2 x --prompt_timeout + MAX_SLOT_WAIT_S + this
READY_TIMEOUT_S = 60.0  # from the container's start to its command server's first answer
KILL_WAIT_S = 10.0  # after a timed-out command was killed, how long its server has to report it
KILLED_SHELL_WAIT_S = (
    1.0  # an exec whose shell was killed (no end marker): how long the engine has to say how it ended
)
# At stop, how long a container may take to end and go once its stream is closed (~0.1-0.2 s here,
# 8 at once) before the engine removes it by force: a command that stopped its cat (SIGSTOP) left it
# running, and each such stop took this long (10 s before).
SELF_END_WAIT_S = 1.0
NUL_IN_COMMAND = "batch-runner: the command contains a NUL byte, which no shell can run"
DISK_CAPS = ("auto", "storage-opt", "tmpfs")
# slirp4netns's DNS server, network_hub.DNS (that module is imported only when a container uses the hub)
HUB_DNS = "10.0.2.3"
START_ATTEMPTS = 5  # containers tried per start before the prompt fails
START_RETRY_PAUSE_S = 0.1  # times the attempt number, between attempts
ENDED_RECORD_WAIT_S = 1.0  # at most, for the engine to record the end of a container whose process is gone
_served_images: set[str] = set()  # images a container of which served commands in this process
FREEZE_ATTEMPTS = (
    5  # end_processes: PID 1 stopped from the host, then the rest, while a process of the agent continues it
)
REAP_ROUNDS = 500  # end_processes: how often REAPED_SCRIPT looks whether PID 1 reaped what was killed
REAP_WAIT_S = 5.0  # and how long it may take at most


@dataclass(frozen=True)
class DockerOptions:
    default_image: str = DEFAULT_IMAGE  # image for prompts whose record names none
    cpus: float = 1.0  # CPU cores one container may use
    memory_mb: int = 2048  # memory limit of one container (MiB), swap included
    pids_limit: int = 512  # most processes alive in one container
    network_mode: str = "bridge"  # Docker network mode; "none" whenever the spec asks for no network
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # most bytes of one command's output kept
    run_owner: str = ""  # "pid:start@host" of the run's parent process (see default_owner); "" = this process
    init: bool = True  # run docker-init as PID 1 so orphaned processes are reaped
    disk_mb: int = 4096  # most disk one container may fill (MiB), the way disk_cap says
    # "storage-opt": the engine caps the whole writable layer; "tmpfs": a tmpfs at the working
    # directory, of disk_mb but at most half of memory_mb (see tmpfs_mb); "auto": ask the engine, once
    disk_cap: str = "auto"
    # With the tmpfs cap: whether the rest of the container's files (its writable layer, its anonymous
    # volumes) are watched, and the container stopped once they pass disk_mb (see disk_watch). True: a
    # container whose layer this process cannot read fails to start; None: watched where it can be.
    disk_watch: bool | None = None
    lifetime_s: float = 4200.0  # a container ends itself after this long, whatever the runner does
    cgroup_parent: str = ""  # the run's cgroup holding its containers together (engine.make_run_cgroup)
    # Keep Docker's CAP_NET_RAW: raw and packet sockets, with which root in a container forges ARP
    # replies on the bridge and takes other prompts' traffic. ICMP needs none (the engine opens
    # ping sockets to every group: iputils ping works); busybox's ping (Alpine's) does.
    net_raw: bool = False
    # With the network on and network_mode "bridge": the container is made with network_mode "none"
    # and gets a link of its own into its worker's one slirp4netns (the local backend's network_hub)
    # before its first command: the outside world, not the host's own addresses, not another prompt.
    # Where this process cannot do that (network_hub_problem), Docker's bridge as asked.
    network_hub: bool = True
    # A missing image's pull, at most (--prompt_timeout), and all of a run's pulls together, at most:
    # past either, the rows of the image fail without a model call (--resume pulls again).
    pull_timeout_s: float = PULL_TIMEOUT_S
    pull_budget_s: float = PULL_BUDGET_S
    # This machine's static busybox and the engine's docker-init (paths here), bind-mounted read-only
    # into each container at container_server.TRUSTED_BUSYBOX and TRUSTED_INIT: what judging runs of
    # the runner's own comes from them, not from the image's files (see trusted_tools); "": not mounted,
    # the image's sh and /sbin/docker-init as found. Set by prepare_run where the engine is this machine's.
    trusted_busybox: str = ""
    trusted_init: str = ""

    def __post_init__(self) -> None:
        positive = ("cpus", "memory_mb", "pids_limit", "output_cap_bytes", "pull_timeout_s", "pull_budget_s")
        check_option_types(self, "docker", positive=(*positive, "disk_mb", "lifetime_s"))
        if self.disk_cap not in DISK_CAPS:
            raise ValueError(
                f"docker sandbox option disk_cap must be one of {', '.join(DISK_CAPS)}, got {self.disk_cap!r}"
            )


def docker_run_share(info: dict[str, Any]) -> tuple[int, int]:
    """(memory bytes, processes) the run's containers may hold together: the engine's machine's
    memory (``info``: its ``docker info``) and this kernel's processes, less what is kept for the host."""
    try:
        memory = int(info.get("MemTotal") or 0)
    except (ValueError, TypeError):
        memory = 0
    memory = memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return run_share(memory, kernel_pids())


# Start-ups in flight are limited in one place, --max_sandbox_starts (the worker's BackgroundStart slots).
_storage_opt_ok: dict[str, bool] = {}  # "answer" -> whether the engine takes storage_opt (disk_cap="auto")
_empty_dirs: set[tuple[str, str]] = set()  # (image, dir): nothing to copy into a tmpfs at dir
# How often the image's files at a working directory are read while the engine says there are none.
# The archive API of an engine here now and then sent an archive without a single entry (not even the
# directory) of a directory the image holds, or said "not found": up to a third of the reads of a
# created container under load, about half of a running one's (where they were read before). Once
# taken for empty, the image's directory was never copied into any later container of the worker:
# 12 of 12 prompts of an image with files there saw an empty directory.
WORKDIR_READS = 5


UNTRUSTED_JUDGING = (
    "the runner's judging steps in Docker containers (ending the agent's processes, writing the hidden "
    "files, the verify's shell) run the image's own sh and /sbin/docker-init: in an image whose user is "
    "root, the agent can replace them and wrong work passes"
)
# What the trusted busybox must have as applets: the runner's scripts run these (container_server,
# _shell, base.RESTORE_DEV, scoring.write_verify_files).
TRUSTED_APPLETS = ("sh", "cat", "rm", "mkdir", "dirname", "tr", "grep", "kill", "mknod", "ln", "sha256sum")
# Where the engine's docker-init may be on its machine (as dockerd looks: its InitBinary on PATH, libexec).
INIT_PLACES = (
    "/usr/libexec/docker",
    "/usr/local/libexec/docker",
    "/usr/lib/docker",
    "/usr/bin",
    "/usr/local/bin",
)


def static_elf(path: str) -> bool:
    """Whether ``path`` is an ELF executable with no program interpreter (no PT_INTERP): run in a
    container, it loads nothing from the container's files (a dynamic one would load the image's
    ld.so and libc, which root in the container may replace)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
                return False
            end = "<" if head[5] == 1 else ">"
            if head[4] == 2:
                (phoff,) = struct.unpack_from(end + "Q", head, 32)
                phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
            else:
                (phoff,) = struct.unpack_from(end + "I", head, 28)
                phentsize, phnum = struct.unpack_from(end + "HH", head, 42)
            if not phnum or phentsize < 4:
                return False
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError:
        return False
    if len(table) < phentsize * phnum:
        return False
    types = [struct.unpack_from(end + "I", table, i * phentsize)[0] for i in range(phnum)]
    return 3 not in types  # PT_INTERP


def _engine_socket() -> str:
    """The path of the engine's Unix socket (DOCKER_HOST's, else Docker's default)."""
    host = os.environ.get("DOCKER_HOST", "")
    return host[len("unix://") :] if host.startswith("unix://") else "/var/run/docker.sock"


def _engine_pid() -> int:
    """The pid of the process serving the engine's socket, in this PID namespace (0: outside it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(_engine_socket())
        return int(struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0])


def _engine_here_problem() -> str | None:
    """Why a path of this machine's may not be the same file where the engine makes its mounts, or None:
    the engine answers on a Unix socket served by a process of this PID namespace (a runner in another
    container with the host's socket sees its peer as pid 0; over tcp or ssh it is another machine)."""
    host = os.environ.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return f"the engine is reached over {host.split('://')[0]} (maybe on another machine)"
    try:
        pid = _engine_pid()
    except OSError as exc:
        return f"the engine's socket {_engine_socket()} cannot be asked who serves it ({exc})"
    if pid <= 0:
        return "the engine runs in another PID namespace (a runner in a container, say)"
    return None


def _same_file_for_engine(path: str) -> bool:
    """False where the engine's root is seen (root may read /proc/<dockerd>/root) and ``path`` is another
    file there (the engine in another mount namespace); True where it is the same or cannot be looked at."""
    try:
        return os.path.samefile(path, f"/proc/{_engine_pid()}/root{path}")
    except PermissionError:
        return True
    except OSError:
        return False


def _find_busybox() -> tuple[str, str | None]:
    """(path, None) of this machine's static busybox, fit to be the trusted one; else ("", why not)."""
    found = [
        p for p in ("/bin/busybox", "/usr/bin/busybox", shutil.which("busybox")) if p and os.path.isfile(p)
    ]
    if not found:
        return "", "no busybox on this machine (install Debian's busybox-static)"
    path = os.path.realpath(found[0])
    if not static_elf(path):
        return "", f"{path} is not a statically linked executable (install Debian's busybox-static)"
    check = "PATH=/nonexistent; echo ok | cat | tr o O | grep -qx Ok"  # its applets, not PATH's
    try:
        listed = subprocess.run([path, "--list"], capture_output=True, text=True, timeout=10).stdout.split()
        works = subprocess.run([path, "sh", "-c", check], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"{path} does not run ({exc})"
    missing = [a for a in TRUSTED_APPLETS if a not in listed]
    if missing or not works:
        why = f"lacks {', '.join(missing)}" if missing else "does not prefer its applets to PATH"
        return "", f"{path} {why}"
    return path, None


def _find_init(info: dict[str, Any]) -> tuple[str, str | None]:
    """(path, None) of the engine's docker-init (static tini) on this machine; else ("", why not)."""
    name = str(info.get("InitBinary") or "docker-init")
    places = (
        [name] if os.path.isabs(name) else [shutil.which(name), *(os.path.join(d, name) for d in INIT_PLACES)]
    )
    found = [p for p in places if p and os.path.isfile(p)]
    if not found:
        return "", f"the engine's {name} is not found on this machine"
    path = os.path.realpath(found[0])
    if not static_elf(path):
        return "", f"{path} is not a statically linked executable"
    try:
        said = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"{path} does not run ({exc})"
    if "tini" not in said:
        return "", f"{path} is not tini ({said.strip()[:60]!r})"
    return path, None


def trusted_tools(info: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The options that mount the runner's own tools into each container (``DockerOptions.trusted_busybox``,
    ``trusted_init``) and the start-up line that says what they give, or why judging falls back to the
    image's own sh and docker-init (a warning naming the risk). ``info``: the engine's ``docker info``.
    The bind sources are paths of the engine's machine: this one only where the engine is local."""
    problem = _engine_here_problem()
    busybox, why = ("", problem) if problem else _find_busybox()
    if busybox and not _same_file_for_engine(busybox):
        busybox, why = "", f"the engine sees another file at {busybox} (it runs in another mount namespace)"
    if not busybox:
        return {}, f"warning: {UNTRUSTED_JUDGING}: {why}"
    init, init_why = _find_init(info)
    if init and not _same_file_for_engine(init):
        init, init_why = "", f"the engine sees another file at {init}"
    tools = {"trusted_busybox": busybox, **({"trusted_init": init} if init else {})}
    said = (
        f"Docker judging: the runner's own steps (ending the agent's processes, the hidden files' writes) "
        f"run this machine's static busybox ({busybox}) mounted read-only at {server.TRUSTED_BUSYBOX}; "
        "verify commands run the image's /bin/sh, only while it is the file it was at the container's start"
    )
    if init:
        return tools, f"{said}; judged commands' subreaper: {init} at {server.TRUSTED_INIT}"
    return tools, (
        f"{said}\nwarning: verify commands run under the container's /sbin/docker-init (their subreaper), "
        f"which root in the container can replace (a fake one that exits 0 passes wrong work): {init_why}"
    )


def network_hub_problem() -> str | None:
    """Why containers cannot get a link into this process's network hub instead of Docker's bridge,
    or None: the hub is for root, needs slirp4netns, and the container's network namespace is
    reached through ``/proc/<State.Pid>``, so the engine's processes must be in this PID namespace."""
    from batchrun.prompt.sandboxes.local import network_hub

    if not network_hub.ENABLED:
        return "BATCH_RUNNER_NETWORK_HUB=0"
    return _hub_host_problem()


@functools.cache
def _hub_host_problem() -> str | None:
    from batchrun.prompt.sandboxes.local.host import network_problem

    if os.geteuid() != 0:
        return "the runner is not root"
    problem = network_problem()
    if problem is not None:
        return problem
    try:
        info = docker_client().info()
    except (*ENGINE_ERRORS, SandboxError) as exc:
        return f"the engine did not say what it is ({exc})"
    return engine_processes_problem(info)


class DockerSandbox(SandboxBackend):
    """One container per prompt, alive while its attach stream is held open; a server in it runs the commands."""

    synchronous_start = False  # a container takes a while: it starts during the first model call
    host_bounds = ("memory", "cpus")  # the engine runs on this machine

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
            "disk_mb": flags.disk_mb,
            # Without the credited slot waits in it, a prompt queued past the margin on a llama-server's
            # slots found its container gone at its next command, and failed.
            "lifetime_s": flags.lifetime_s(LIFETIME_MARGIN_S),
            "pull_timeout_s": flags.prompt_timeout_s,
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
        """The engine answers; every image is present, or pulled once up front (never inside a worker)
        once the endpoint's start check passed (``after_check``): a wrong key is found before the pulls."""
        try:
            version = check_engine()
        except Exception as exc:
            raise SetupError(str(exc)) from None
        print(f"Docker engine {version}")
        default = options.get("default_image", DEFAULT_IMAGE)
        wanted = sorted({j.image or default for j in jobs})
        if not wanted:  # no container to make (a --resume with nothing left): said, as sandbox_network's None
            return Preflight(isolation="docker", facts={"sandbox_disk_cap": None})
        print(
            f"Checking {len(wanted)} image(s) (a container of each new one runs sh once); missing ones are "
            "pulled once, after the endpoint's start check"
        )
        status = ensure_images(wanted, max_concurrent=4, progress=lambda m: print(f"  {m}"), pull=False)
        missing = [image for image in wanted if status[image] == NOT_PULLED]
        found = _image_states(jobs, default, status, dataset)
        if not missing:
            return _with_disk_cap(found, options, status)

        def pull() -> Preflight:
            print(f"Pulling {len(missing)} missing image(s)")
            pulled = ensure_images(
                missing, max_concurrent=4, progress=lambda m: print(f"  {m}"),
                pull_timeout_s=float(options.get("pull_timeout_s", PULL_TIMEOUT_S)),
                pull_budget_s=float(options.get("pull_budget_s", PULL_BUDGET_S)),
            )  # fmt: skip
            return _with_disk_cap(
                _image_states(jobs, default, pulled, dataset), options, {**status, **pulled}
            )

        return Preflight(isolation="docker", failed=found.failed, after_check=pull)

    @classmethod
    def prepare_run(cls, run_name: str, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """Containers of runners that are gone (of any run name) go, before new ones start."""
        _remove_dead_containers()
        options = _network_in_force(options, workers_here)
        if not workers_here:
            print(f"warning: {UNTRUSTED_JUDGING} (the workers run on other machines)", file=sys.stderr)
            return options
        try:
            info = docker_client().info()
        except ENGINE_ERRORS as exc:
            info, problem = {}, f"the engine did not say how it makes cgroups ({exc})"
        else:
            problem = run_cgroup_problem(info)
        tools, said = trusted_tools(info)
        print(said, file=sys.stderr if said.startswith("warning") else sys.stdout)
        options = {**options, **tools}
        if problem is None:
            sweep_run_cgroups()
            memory, pids = docker_run_share(info)
            try:
                name = make_run_cgroup(memory, pids)
            except OSError as exc:
                problem = f"the kernel refused it ({exc})"
            else:
                print(
                    f"Docker containers of this run together: at most {memory >> 20:,} MiB and {pids:,} "
                    "processes (the rest is the machine's)"
                )
                return {**options, "cgroup_parent": f"/{name}"}
        print(f"Docker containers of this run have their own limits only: {problem}")
        return options

    @classmethod
    def sweep_dead(cls, run_name: str) -> None:
        """Containers and run cgroups of runners that are gone (any run name), for a run that starts no
        container; an engine that does not answer leaves them to the next run's start."""
        try:
            _remove_dead_containers()
        except (*ENGINE_ERRORS, SandboxError) as exc:
            print(
                f"warning: containers of runners that are gone could not be looked for, the Docker engine "
                f"did not answer ({exc}); the next run's start removes them",
                file=sys.stderr,
            )
            return
        sweep_run_cgroups()

    @classmethod
    def run_facts(cls, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """``sandbox_network``: what the containers' network is, as ``prepare_run`` settled it."""
        return {"sandbox_network": network_kind(options, workers_here)}

    @classmethod
    def sweep(cls, options: dict[str, Any]) -> None:
        """After the pool ended: every container this run started (e.g. of prompts cut short) goes, and
        the run's cgroup with them."""
        try:
            removed = remove_owned_containers(options.get("run_owner") or default_owner())
        except (*ENGINE_ERRORS, SandboxError) as exc:  # the engine stopped: the run's end goes on
            removed = []
            print(
                f"warning: this run's containers could not be looked for, the Docker engine did not "
                f"answer ({exc}); any left are removed by the next run's start",
                file=sys.stderr,
            )
        if removed:
            print(f"Removed {len(removed)} container(s) left by interrupted prompts", file=sys.stderr)
        name = str(options.get("cgroup_parent") or "").lstrip("/")
        if is_run_cgroup(name):  # the run's own (prepare_run), never a cgroup_parent of the user's
            killed = kill_cgroup_processes(name)
            if killed:
                print(
                    f"Killed {killed} process(es) of this run's containers that the Docker engine no longer "
                    "knows (its dockerd was killed and started again?)",
                    file=sys.stderr,
                )
            remove_run_cgroup(name)

    # -- one prompt's sandbox

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(DockerOptions, "docker", options)
        self.image = spec.image or self.options.default_image
        # Normal, with one leading '/' (normpath keeps '//'): '/workspace/..', '/.' and '//' are '/', which
        # the tmpfs disk cap refuses at once, rather than the engine five times after a model call.
        workdir = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, spec.cwd or ""))
        self.workdir = "/" + workdir.lstrip("/")
        self.isolation = "docker"
        self.container_id: str | None = None
        self._used = False  # whether a command ran in the current container
        self._channel: server.Channel | None = None  # the attach stream: the server's stdin and stdout
        self._broken: str | None = None  # why the current container's server cannot take commands
        self._over_cap: str | None = None  # why the disk watch stopped the current container
        self._base_pids: list[int] = []  # the container's processes before the agent's first command
        self._server_pid = 0  # the command server's, among them
        self._sh_sum = ""  # the trusted busybox's sha256sum of the image's /bin/sh at the start ("": none)
        self._frozen = False  # base processes stopped by end_processes: the next command continues them
        self._hold: Any = None  # the exec stream whose end continues them (see end_processes)
        self._serving = False  # whether the current container's server answered (it ends at our EOF)
        self._lock = threading.Lock()  # one command at a time: they share the stream
        self.network_address: str | None = None  # the container's address on its link into the hub, if any

    @property
    def disk_cap(self) -> str:
        """The disk cap in force: "storage-opt" or "tmpfs" ("auto" asks the engine, once per process)."""
        if self.options.disk_cap != "auto":
            return self.options.disk_cap
        if "answer" not in _storage_opt_ok:
            _storage_opt_ok["answer"] = storage_size_supported(self.image)
        return "storage-opt" if _storage_opt_ok["answer"] else "tmpfs"

    @property
    def tmpfs_mb(self) -> int:
        """Size of the tmpfs cap: its pages are the container's memory, and a tmpfs that filled the
        memory limit would get every later command OOM-killed; half of it leaves room to work."""
        return tmpfs_size_mb(self.options.disk_mb, self.options.memory_mb)

    def uses_network_hub(self) -> bool:
        """Whether the container gets a link into the worker's network hub (see ``DockerOptions.network_hub``)."""
        opts = self.options
        return (
            self.spec.network
            and opts.network_hub
            and opts.network_mode == "bridge"
            and network_hub_problem() is None
        )

    def create_kwargs(self, name: str) -> dict[str, Any]:
        """The arguments of ``containers.create`` (after the image) for this prompt's container."""
        opts, spec = self.options, self.spec
        hub = self.uses_network_hub()
        labels = {LABEL_RUN: spec.run_name, LABEL_INDEX: str(spec.prompt_index)}
        labels[LABEL_OWNER] = opts.run_owner or default_owner()
        return {
            "entrypoint": ["sh", "-c", server.BOOT_SCRIPT, "br-boot", str(math.ceil(opts.lifetime_s))],
            "command": [],
            "stdin_open": True,  # docker-py adds stdin_once: stdin ends when our stream does
            "log_config": LogConfig(
                type=LogConfig.types.NONE
            ),  # commands' output never reaches the host's disk
            "auto_remove": True,  # a container that ended itself leaves nothing behind
            "name": name,
            "labels": labels,
            "working_dir": self.workdir,  # created by Docker when the image lacks it
            "environment": dict(spec.env),
            "init": opts.init,
            # On the hub: no network of the engine's (loopback only) until the link is made; the
            # engine writes the container's resolv.conf for the hub's DNS (slirp4netns's 10.0.2.3).
            "network_mode": opts.network_mode if spec.network and not hub else "none",
            **({"dns": [HUB_DNS]} if hub else {}),
            "nano_cpus": int(opts.cpus * 1e9),
            "mem_limit": f"{opts.memory_mb}m",
            "memswap_limit": f"{opts.memory_mb}m",
            "pids_limit": opts.pids_limit,
            **({} if opts.net_raw else {"cap_drop": ["NET_RAW"]}),
            # The OOM killer's first pick, before the runner or anything else of the host's: memory
            # pressure no cgroup bounds (an engine without the run's cgroup) ends prompts first.
            "oom_score_adj": 1000,
            **({"cgroup_parent": opts.cgroup_parent} if opts.cgroup_parent else {}),
            **self._disk_limit(),
            **self._trusted_mounts(),
        }

    def _trusted_mounts(self) -> dict[str, Any]:
        """The runner's own tools, read-only at paths the agent cannot replace (see ``trusted_tools``)."""
        opts = self.options
        mounts = [
            Mount(target, source, type="bind", read_only=True)
            for target, source in ((server.TRUSTED_BUSYBOX, opts.trusted_busybox), (server.TRUSTED_INIT, opts.trusted_init))
            if source
        ]  # fmt: skip
        return {"mounts": mounts} if mounts else {}

    @property
    def _busybox(self) -> str:
        """The trusted busybox's path in the container, or "" (the image's sh)."""
        return server.TRUSTED_BUSYBOX if self.options.trusted_busybox else ""

    def start(self) -> None:
        spec = self.spec
        safe_run = safe_run_name(spec.run_name)
        kwargs = self.create_kwargs("")
        hub = self._network_hub() if "dns" in kwargs else None  # set for the hub alone (create_kwargs)
        attrs: dict[str, Any] | None = None  # the started container's inspection, where one was needed
        # With the tmpfs cap: what the image holds at the working directory, read before the start
        # (an archive of the container's files then is of the image's, not hidden by the tmpfs).
        seed: WorkdirSeed | None = None if "tmpfs" in kwargs else WorkdirSeed(None)
        # An engine under heavy load sometimes fails a start it would do a moment later (runc's
        # "error reopening /dev/null inside container", an exec before the container runs). Nothing
        # of the prompt ran yet, so a fresh container is a safe retry.
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                kwargs["name"] = f"br-{safe_run}-{spec.prompt_index}-{uuid.uuid4().hex[:8]}"
                container = docker_client().containers.create(self.image, **kwargs)
                self.container_id = container.id  # from here on, stop() removes it whatever happens next
                if seed is None:
                    seed = self._read_workdir(container.id)
                # Attached before the start, so the container never runs without a holder.
                self._channel = server.Channel(_attach(container.id))
                container.start()
                if hub is not None:
                    attrs = self._connect_network(hub, container.id)
                self._start_server()
                self._serving = True
                _served_images.add(self.image)
                break
            except ImageNotFound as exc:
                self.stop()
                if seed is not None:
                    seed.close()
                raise SandboxError(
                    f"docker image {self.image!r} is not available locally: {exc.explanation}"
                ) from exc
            except (*ENGINE_ERRORS, OSError, SandboxError) as exc:
                ended, final = self._why_it_ended(exc)
                if final and self._image_ran_sh():
                    final = False  # a fault of the engine's, not the image's: tried again
                self.stop()
                if final or attempt == START_ATTEMPTS:
                    if seed is not None:
                        seed.close()
                    raise SandboxError(
                        f"docker container for prompt {spec.prompt_index} did not start "
                        f"({attempt} attempt{'s' if attempt > 1 else ''}): {ended or exc}"
                    ) from exc
                log.info("container start of prompt %s failed, trying again: %s", spec.prompt_index, exc)
            time.sleep(START_RETRY_PAUSE_S * attempt)
        self._over_cap = None
        assert seed is not None  # read at the first attempt's create, or not wanted
        with seed:
            if "tmpfs" in kwargs:
                try:
                    self._watch_layer(attrs)
                    self._fill_workdir(seed.archive)
                except BaseException:
                    self.stop()
                    raise
        self._used = False
        self._broken = None
        self._frozen = False
        self._hold = None

    def _image_ran_sh(self) -> bool:
        """Whether a container of this image ran its sh on this engine: its ID passed the start's probe
        (the runnable cache) or one served commands in this process. Under load (two runs starting
        containers at once, fresh images) the engine now and then starts one whose docker-init says
        "exec sh failed: No such file or directory" (exit code 127) although its image has sh: up to 11
        of a run's 30 prompts failed so, their start not tried again."""
        if self.image in _served_images:
            return True
        try:
            image_id = docker_client().images.get(self.image).id
        except ENGINE_ERRORS:
            return False
        return image_id in _read_runnable()

    def _why_it_ended(self, exc: Exception) -> tuple[str | None, bool]:
        """After a failed start attempt (``exc``): why, when the container ended by itself or could not
        run its ``sh`` (the engine's State, what it printed), naming the image, or None; and whether
        another attempt would end the same (its sh missing or not executable: exit code 127 or 126).
        Without this, such an image cost five attempts and said "it is not running"."""
        said = str(getattr(exc, "explanation", None) or exc)
        if isinstance(exc, APIError) and sh_not_found(said):  # runc's (no docker-init): no sh in the image
            return f"image {self.image!r} {NO_SH} ({sh_words(said)})", True
        container_id, channel = self.container_id, self._channel
        if container_id is None or channel is None:
            return None, False
        # The engine records a container's end a moment after its process is gone: a hub's link that found
        # no /proc/<pid>/ns/net inspected it still "running" and tried a no-sh image again (1 in 3 starts
        # with the hub and docker-init). Where its PID 1 is seen from here and gone, wait for the record.
        settle = time.monotonic() + ENDED_RECORD_WAIT_S
        while True:
            try:
                state = docker_client().api.inspect_container(container_id).get("State") or {}
            except NotFound:
                state = {"Status": "removed"}  # it ended, and removed itself (auto_remove)
            except ENGINE_ERRORS:
                return None, False
            pid = state.get("Pid")
            gone = (
                bool(state.get("Running"))
                and self.uses_network_hub()  # the engine is in this PID namespace (network_hub_problem)
                and isinstance(pid, int)
                and pid > 0
                and not os.path.exists(f"/proc/{pid}/ns/net")  # gone, or a zombie its shim has not reaped
            )
            if not gone or time.monotonic() >= settle:
                break
            time.sleep(0.02)
        if state.get("Running") or state.get("Status") not in ("exited", "dead", "removing", "removed"):
            return None, False  # running, or never started (the start's own error says why)
        printed = bytearray()  # what it wrote before its end: docker-init's "exec sh failed: ..."

        def feed(data: bytes) -> bool:
            printed.extend(data)
            return len(printed) > 4096

        channel.read_until(feed, time.monotonic() + 2.0)
        # Else what the start's step that found it gone had read of it ("it ended (...)").
        out = printed.decode(errors="replace").strip()[-300:] or said
        code = state.get("ExitCode")
        how = ", ".join(
            filter(None, [
                f"exit code {code}" if state["Status"] != "removed" else "",
                "OOM killed" if state.get("OOMKilled") else "",
                str(state.get("Error") or ""),
                out,
            ])
        )  # fmt: skip
        if sh_not_found(out):
            return f"image {self.image!r} {NO_SH}: its container ended at once ({how})", True
        final = code in (126, 127) and state["Status"] != "removed"
        cannot = ": its sh cannot be run" if final else ""
        return (
            f"the container of image {self.image!r} ended by itself before its command server answered"
            f"{f' ({how})' if how else ''}{cannot}",
            final,
        )

    @staticmethod
    def _network_hub() -> Any:
        """This worker's network hub (made at its first use); SandboxError where it cannot be made."""
        from batchrun.prompt.sandboxes.local import network_hub

        hub = network_hub.hub()
        if hub is None:
            raise SandboxError(
                f"docker sandbox: the worker's network hub cannot be made: {network_hub.hub_problem}"
            )
        return hub

    def _connect_network(self, hub: Any, container_id: str) -> dict[str, Any]:
        """Give the container's network namespace (its PID 1's, seen from here) a link into ``hub``,
        with the host's addresses unreachable, as a local sandbox's; before its first command. Returns
        the container's inspection (``_watch_layer`` needs no second one)."""
        from batchrun.prompt.sandboxes.local.host import blocked_addresses

        gone = f"the container of prompt {self.spec.prompt_index} cannot be connected to the worker's network"
        try:
            attrs = docker_client().api.inspect_container(container_id)
            pid = int(attrs["State"]["Pid"] or 0)
        except ENGINE_ERRORS as exc:
            raise SandboxError(f"{gone}: {exc}") from exc
        if pid <= 0:
            raise SandboxError(f"{gone}: it is not running")
        try:
            netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxError(f"{gone}: {exc}") from exc
        try:
            # The engine's PID must be one of this namespace's and still the container's: its cgroup
            # path names the container (read once the namespace was opened, so that is its namespace).
            with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
                if container_id not in f.read():
                    raise SandboxError(f"{gone}: process {pid} here is not the container's")
            self.network_address = hub.attach(f"/proc/self/fd/{netns}", blocked_addresses())
        except OSError as exc:
            raise SandboxError(f"{gone}: {exc}") from exc
        finally:
            os.close(netns)
        return attrs

    def _start_server(self) -> None:
        """Send the server its functions and wait for its ready line (the container runs, its sh works)."""
        assert self._channel is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        self._channel.send(server.SERVER_PRELUDE, deadline)
        seen = bytearray()
        want = server.READY_LINE.encode() + b"\n"

        def feed(data: bytes) -> bool:
            seen.extend(data)
            return want in seen or len(seen) > 65536

        state = self._channel.read_until(feed, deadline)
        base = server.BASE_LINE.search(seen)
        if want not in seen or base is None:
            said = seen.decode(errors="replace").strip()[-300:]
            why = "no answer in time" if state == "timeout" else f"it ended ({said or 'no output'})"
            raise SandboxError(f"the command server of prompt {self.spec.prompt_index} did not start: {why}")
        self._server_pid = int(base.group(1))
        self._base_pids = [int(pid) for pid in base.group(2).split()]
        sh_sum = server.SH_SUM_LINE.search(seen)
        self._sh_sum = sh_sum.group(1).decode(errors="replace") if sh_sum else ""

    def _disk_limit(self) -> dict[str, object]:
        if self.disk_cap == "storage-opt":
            return {"storage_opt": {"size": f"{self.options.disk_mb}m"}}
        if self.workdir == "/":
            raise SandboxError("the disk cap is a tmpfs at the working directory, which cannot be /")
        # exec: prompts build and run programs there
        return {"tmpfs": {self.workdir: f"size={self.tmpfs_mb}m,exec"}}

    def _watch_layer(self, attrs: dict[str, Any] | None = None) -> None:
        """With the tmpfs cap: watch the rest of the container's files (``disk_watch``), so that past
        ``disk_mb`` it is stopped; SandboxError where that was asked for (``disk_watch``) and cannot be.
        ``attrs``: the started container's inspection, when the start made one (else asked here)."""
        if self.options.disk_watch is False:
            return
        container_id = self.container_id
        assert container_id is not None
        cannot = f"the disk cap of the container of prompt {self.spec.prompt_index} cannot be watched"
        try:
            paths = layer_paths(attrs or docker_client().api.inspect_container(container_id))
            if not paths:
                raise OSError("the engine names no writable layer of it (its storage driver is not overlay2)")
            disk_watch().add(
                container_id, paths, self.options.disk_mb << 20, self._disk_cap_passed(container_id)
            )
        except (*ENGINE_ERRORS, OSError) as exc:
            if self.options.disk_watch:
                raise SandboxError(f"{cannot}: {exc}") from exc
            log.info("%s: %s", cannot, exc)

    def _raise_if_over_cap(self) -> None:
        """SandboxError when the disk watch stopped the container (``_disk_cap_passed``), saying so."""
        if self._over_cap is not None:
            raise SandboxError(
                f"docker container of prompt {self.spec.prompt_index} is gone: {self._over_cap}"
            )

    def _disk_cap_passed(self, container_id: str) -> Any:
        """What the disk watch calls when the container's files pass the cap: it is stopped (killed), and
        the prompt fails as a sandbox error that says so."""

        def over(size: int) -> None:
            if self.container_id != container_id:
                return  # stopped meanwhile
            self._over_cap = self._broken = (
                f"its files outside the working directory took {size / 2**20:,.0f} MiB, past the disk cap "
                f"of {self.options.disk_mb:,} MiB (--container_disk_mb): the runner stopped it"
            )
            log.warning("container of prompt %s: %s", self.spec.prompt_index, self._over_cap)
            try:
                docker_client().api.kill(container_id)
            except NotFound:
                pass
            except (*ENGINE_ERRORS, SandboxError) as exc:
                log.warning("could not stop container %s: %s", container_id[:12], exc)

        return over

    def _read_workdir(self, container_id: str) -> WorkdirSeed:
        """What the image holds at the working directory, read from its container before its start;
        None inside when nothing (see ``WORKDIR_READS``)."""
        key = (self.image, self.workdir)
        if key in _empty_dirs:
            return WorkdirSeed(None)
        nothing = False  # whether a read found no such directory, or the directory alone
        for _ in range(WORKDIR_READS):
            # The whole archive is read (to memory, or disk past 8 MiB) before the exec that unpacks it.
            archive: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=8 * 2**20)  # noqa: SIM115
            try:
                chunks, _ = docker_client().api.get_archive(container_id, self.workdir)
                for chunk in chunks:
                    archive.write(chunk)
            except NotFound:
                nothing = True
                archive.close()
                continue
            except ENGINE_ERRORS as exc:
                archive.close()
                raise SandboxError(f"cannot read {self.workdir} of image {self.image!r}: {exc}") from exc
            archive.seek(0)
            members = _members(archive)
            if members > 1:
                archive.seek(0)
                return WorkdirSeed(archive)
            archive.close()
            nothing = nothing or members == 1  # none at all: not even the directory, a failed read
        if not nothing:
            raise SandboxError(
                f"the engine sent no archive of {self.workdir} of image {self.image!r} ({WORKDIR_READS} reads)"
            )
        _empty_dirs.add(key)
        return WorkdirSeed(None)

    def _fill_workdir(self, archive: IO[bytes] | None) -> None:
        """Copy what the image holds at the working directory (``archive``) into the tmpfs that hides it there."""
        if archive is None:
            return
        result = self._run(
            f"tar -xf - -C {shlex.quote(posixpath.dirname(self.workdir))}",
            timeout_s=600.0,
            # Whatever the image's user: owners and modes as the image has them. By number: the engine
            # looked the name "root" up in the image's passwd file through the same view as the archive
            # API's, and now and then found none (exit 126: 3 of 20 starts).
            user="0:0",
            stdin=iter(lambda: archive.read(2**20), b""),
        )
        if result.exit_code != 0:
            raise SandboxError(
                f"copying {self.workdir} of image {self.image!r} into its {self.tmpfs_mb} MiB tmpfs "
                f"failed (exit {result.exit_code}): {result.output[-500:]}"
            )

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """Run ``command`` through the container's command server (see ``container_server``)."""
        with self._lock:
            if self.container_id is None or self._channel is None:
                raise SandboxError("docker sandbox is not started")
            if "\0" in command:  # a shell's command line is a C string
                return ExecResult(output=NUL_IN_COMMAND, exit_code=2)
            if self._frozen:
                self._thaw()
            result = self._serve(command, timeout_s=timeout_s, stdin=stdin)
            if result is None:
                # The container ended before its server acknowledged the first command: nothing of
                # the prompt ran yet (a start the engine botched under load), so a new one is safe, once.
                log.info("container of prompt %s ended before its first command", self.spec.prompt_index)
                self.stop()
                self.start()
                result = self._serve(command, timeout_s=timeout_s, stdin=stdin)
            if result is None:
                raise SandboxError(
                    f"docker container of prompt {self.spec.prompt_index} ended twice before its first command"
                )
            return result

    def end_processes(self, timeout_s: float) -> str | None:
        """Before judging: end every process the agent left and stop (SIGSTOP) every one it did not
        (``container_server.FREEZE_SCRIPT``), in ``run_judged`` execs: their exit code is the
        engine's, not an end marker that a process of the agent, still alive then, could print after
        reading its token from the server's memory.

        The container's own processes (docker-init, the boot shell, cat, the sleeper, the server) are
        stopped, not spared: a command running as root may have taken any of them over (``ptrace``,
        or shell code written into the server's stdin pipe), and its code, a loop with no process
        of its own, would rewrite the hidden files as they are written. PID 1 is stopped from the
        host (nothing in its namespace may). An exec holds them stopped while the sample is judged
        (``THAW_AT_EOF_SCRIPT``); a later ``run`` or ``stop``, or the runner's death, continues them."""
        with self._lock:
            if self.container_id is None or self._channel is None:
                raise SandboxError("docker sandbox is not started")
            if self._frozen:
                self._thaw()  # a second call: its hold would be killed as a process of the agent's
            spared = " ".join(str(pid) for pid in self._base_pids)
            deadline = time.monotonic() + timeout_s
            self._frozen = True  # from here on: a later run continues them first, stop ends them
            # Stopped, its cat reads no end of the stream: should this process die before the hold
            # below exists, the guard removes it.
            frozen_guard.hold(self.container_id)
            reaped = False  # PID 1 continued once to reap what was killed: a working init reaps it all
            for _ in range(FREEZE_ATTEMPTS + 1):
                self._signal_init("SIGSTOP")
                result = self._run(
                    f"set -- {spared}\n{server.FREEZE_SCRIPT}",
                    timeout_s=max(deadline - time.monotonic(), 0.001), stdin=[b""], judged=True, own=True,
                )  # fmt: skip
                if result.timed_out or result.exit_code not in (server.INIT_RUNS, server.INIT_ZOMBIES):
                    break
                if result.exit_code == server.INIT_ZOMBIES:
                    if reaped:  # an init that does not reap (taken over): its zombies stay, all else is done
                        result = ExecResult(output=result.output, exit_code=0)
                        break
                    # Before any hidden file is written, PID 1 may run as it did until now: what it
                    # starts meanwhile, the next round kills, and it is stopped again.
                    reaped = True
                    self._signal_init("SIGCONT")
                    self._run(
                        f"set -- {REAP_ROUNDS}\n{server.REAPED_SCRIPT}",
                        timeout_s=max(min(deadline - time.monotonic(), REAP_WAIT_S), 0.001),
                        stdin=[b""], judged=True, own=True,
                    )  # fmt: skip
            problem = end_problem(result, timeout_s)
            if problem is None:
                self._hold = self._hold_stopped(spared)
        return problem

    def _signal_init(self, signal: str) -> None:
        """Send ``signal`` to the container's PID 1 from the host (the engine's kill: the one way to stop it)."""
        try:
            docker_client().api.kill(self.container_id, signal)
        except ENGINE_ERRORS as exc:
            raise SandboxError(f"container of prompt {self.spec.prompt_index} is gone: {exc}") from exc

    def _hold_stopped(self, spared: str) -> Any:
        """The exec that continues the stopped base processes when its stream ends (THAW_AT_EOF_SCRIPT)."""
        try:
            api = docker_client().api
            argv = [*sh_c(server.THAW_AT_EOF_SCRIPT, self._busybox), "sh"]
            exec_id = api.exec_create(self.container_id, [*argv, *spared.split()], stdin=True)["Id"]
            return api.exec_start(exec_id, socket=True)
        except ENGINE_ERRORS as exc:
            raise SandboxError(f"container of prompt {self.spec.prompt_index} is gone: {exc}") from exc

    def _thaw(self) -> None:
        """Continue the base processes end_processes stopped: end the hold's stream, wait for its exec
        to have continued them, and continue PID 1 from the host too."""
        hold, self._hold = self._hold, None
        self._frozen = False
        if hold is not None:
            sock: socket.socket = getattr(hold, "_sock", hold)
            try:
                sock.shutdown(socket.SHUT_WR)
                deadline = time.monotonic() + KILL_WAIT_S
                while (left := deadline - time.monotonic()) > 0 and readable(sock, left) and sock.recv(65536):
                    pass
            except OSError:
                pass
            finally:
                server.close_stream(hold)
        self._signal_init("SIGCONT")
        if self.container_id is not None:
            frozen_guard.release(self.container_id)

    def _serve(self, command: str, *, timeout_s: float, stdin: bytes | None) -> ExecResult | None:
        """One request to the server; None when the container ended before its first command was
        acknowledged (``container_server.Ack``): it never ran."""
        channel = self._channel
        assert channel is not None
        gone = f"docker container of prompt {self.spec.prompt_index} is gone"
        if self._broken:
            raise SandboxError(f"{gone}: {self._broken}")
        channel.discard_stray()
        token = new_exec_token()
        ack = server.Ack(token)
        scanner = server.Scanner(token, CappedBuffer(self.options.output_cap_bytes))
        deadline = time.monotonic() + timeout_s

        def feed(data: bytes) -> bool:
            scanner.feed(ack.after(data))
            return scanner.done

        state = "eof"
        if not channel.eof:
            try:
                channel.send(server.request(token, command, stdin), deadline)
                state = channel.read_until(feed, deadline)
            except TimeoutError:
                state = "timeout"  # the request itself did not fit in the time (a huge stdin)
            except OSError:
                state = "eof"
        if state == "eof":
            # Not acknowledged: the command never ran. Else it may have done anything before the
            # container ended (its own kill -9 -1 as the prompt's first command): never sent again.
            if self._over_cap is None and not self._used and not ack.seen:
                return None
            if self._over_cap is not None:
                raise SandboxError(f"{gone}: {self._over_cap}; what the prompt had in it is lost")
            self._broken = "it ended during a command"
            raise SandboxError(
                f"{gone}: it ended during a command (killed from inside, out of memory, or removed); "
                "what the prompt had in it is lost"
            )
        self._used = True
        if state == "timeout":
            # The output is what came before the deadline (not the shell's "Killed" notes): from
            # here on only the end marker is looked for, so the stream is in step for the next command.
            output, truncated = scanner.close_output()
            if not ack.seen:
                # The server never took the request (a command stopped the cat that relays it): no
                # report of it will come, and the wait for one held the prompt KILL_WAIT_S past its time.
                self._broken = "its command server did not take a command in time (its input was stopped)"
                return ExecResult(output=output, exit_code=-1, timed_out=True, truncated=truncated)
            self._kill_command(token)
            if channel.read_until(feed, time.monotonic() + KILL_WAIT_S) != "done":
                self._broken = "its command server did not report a timed-out command after it was killed"
            return ExecResult(output=output, exit_code=-1, timed_out=True, truncated=truncated)
        output, truncated = scanner.buf.result()
        return ExecResult(output=output, exit_code=scanner.exit_code, truncated=truncated)

    def run_exec(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """Run ``command`` through one ``docker exec`` (as the runner did before the command server)."""
        return self._run(command, timeout_s=timeout_s, stdin=[stdin or b""])

    def run_judged(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """A command whose exit code judges the sample (verify, a scorer's): through one ``docker exec``,
        with the exit code the engine saw its shell end with. Not the server's end marker: a command
        that reads the marker's token from the server's memory (same user, no Yama) can print it."""
        if "\0" in command:
            return ExecResult(output=NUL_IN_COMMAND, exit_code=2)
        return self._run(command, timeout_s=timeout_s, stdin=[stdin or b""], judged=True)

    def run_trusted(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """A judging step of the runner's own (base.trusted_run: the hidden files' writes): as
        ``run_judged``, in the trusted busybox's sh with its applets where the container has it, not in
        the image's sh and tools."""
        if "\0" in command:
            return ExecResult(output=NUL_IN_COMMAND, exit_code=2)
        return self._run(command, timeout_s=timeout_s, stdin=[stdin or b""], judged=True, own=True)

    def _run(
        self, command: str, *, timeout_s: float, stdin: Iterable[bytes], user: str = "", judged: bool = False,
        own: bool = False,
    ) -> ExecResult:  # fmt: skip
        if self.container_id is None:
            raise SandboxError("docker sandbox is not started")
        self._raise_if_over_cap()
        token = new_exec_token()
        for attempt in (1, 2):
            try:
                exec_id, stream = self._exec(command, token, user, judged=judged, own=own)
                break
            except ENGINE_ERRORS as exc:
                # A container dead before its first command (a start the engine botched under load;
                # gone already, as it removes itself) ran nothing of the prompt yet: a new one is safe, once.
                dead_before_first = (
                    attempt == 1
                    and not self._used
                    and isinstance(exc, APIError)
                    and exc.status_code in (404, 409)
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
        stdin = itertools.chain([token_line(token)], stdin)  # the marker's token: in no argv, no environment
        threading.Thread(target=_send_stdin, args=(sock, stdin), daemon=True).start()
        scanner = MarkerScanner(token, CappedBuffer(self.options.output_cap_bytes))
        deadline = time.monotonic() + timeout_s
        exit_code: int | None = None
        try:
            finished = _read_frames(sock, scanner, deadline)
            exit_code = scanner.exit_code if scanner.done else None
            if finished and judged:
                # The stream stays open (what comes after the marker is read and dropped) until the
                # engine says how the command's shell ended: closed, its next write would kill it.
                exit_code = self._engine_exit_code(exec_id, deadline, sock)
        except OSError as exc:
            raise SandboxError(f"docker exec stream of prompt {self.spec.prompt_index} broke: {exc}") from exc
        finally:
            stream.close()
            sock.close()
        self._raise_if_over_cap()  # the disk watch killed it meanwhile: no verdict, what it said
        output, truncated = scanner.buf.result()
        if finished and not judged and exit_code is None:  # a killed shell printed no marker: the engine's
            code = self._engine_exit_code(exec_id, time.monotonic() + KILLED_SHELL_WAIT_S)
            exit_code = -1 if code is None else code
        if not finished or exit_code is None:  # judged: a marker it printed itself, then ran on
            self._kill_command(token)
            return ExecResult(output=output, exit_code=-1, timed_out=True, truncated=truncated)
        return ExecResult(output=output, exit_code=exit_code, truncated=truncated)

    def stop(self) -> None:
        container_id, self.container_id = self.container_id, None
        if container_id is not None:
            disk_watch().remove(container_id)
        self.network_address = None  # the link ends with the container's network namespace
        channel, self._channel = self._channel, None
        serving, self._serving = self._serving, False
        hold, self._hold = self._hold, None
        if self._frozen:
            self._frozen = False
            if hold is None:  # stopped, and nothing to continue them: its cat would never see the end
                serving = False
            else:
                # The end of its stream continues them, and cat reads the end of the next.
                server.close_stream(hold)
        if channel is not None:
            channel.close()  # EOF for the server: a container that runs ends itself now
        # One call that returns once the engine removed it (no kill from here, no 409 to poll out).
        if container_id is not None and serving and _removed_by_itself(container_id):
            frozen_guard.release(container_id)
            return
        if container_id is not None:
            try:
                docker_client().api.remove_container(container_id, force=True, v=True)
            except NotFound:
                pass
            except APIError as exc:
                if exc.status_code == 409:  # being removed already: killed by our remove, or it ended itself
                    wait_removed(container_id)
                else:
                    log.warning("could not remove container %s: %s", container_id[:12], exc)
            except (*ENGINE_ERRORS, SandboxError) as exc:  # a later sweep finds it by its labels
                log.warning("could not remove container %s: %s", container_id[:12], exc)
            frozen_guard.release(container_id)

    def _exec(
        self, command: str, token: str, user: str = "", judged: bool = False, own: bool = False
    ) -> tuple[str, object]:
        """``own``: a script of the runner's (all in the trusted busybox, where there is one); else a
        judged command runs in the image's /bin/sh under it (see ``_shell.wrapped_argv``)."""
        api = docker_client().api
        if judged:
            argv = wrapped_argv(command, token, busybox=self._busybox, image_sh=None if own else self._sh_sum)
        else:  # the agent's commands: the image's sh, as the command server's
            argv = wrapped_argv(command, token)
        init = server.TRUSTED_INIT if self.options.trusted_init else ""
        # Its orphans reaped while PID 1 is stopped (end_processes). A script of the runner's, under the
        # trusted busybox, never under a docker-init the agent may have replaced (one that exits 0).
        if judged and self.options.init and (init or not (own and self._busybox)):
            argv = server.subreaped_argv(argv, init=init, busybox=self._busybox)
        exec_id = api.exec_create(
            self.container_id, argv, stdin=True, workdir=self.workdir,
            environment={EXEC_TAG_VAR: exec_tag(token)}, user=user,
        )["Id"]  # fmt: skip
        return exec_id, api.exec_start(exec_id, socket=True)

    def _kill_command(self, token: str) -> None:
        """SIGKILL, inside the container, every process of the command that carries ``token``."""
        try:
            api = docker_client().api
            api.exec_start(api.exec_create(self.container_id, kill_argv(token, self._busybox))["Id"])
        except ENGINE_ERRORS as exc:
            raise SandboxError(f"container of prompt {self.spec.prompt_index} is gone: {exc}") from exc

    def _engine_exit_code(
        self, exec_id: str, deadline: float, sock: socket.socket | None = None
    ) -> int | None:
        """The exit code the engine saw the exec's shell end with; None if it still runs at ``deadline``.
        With ``sock`` (a judged command's stream, kept open so its next write does not kill it) what
        still comes is read and dropped meanwhile."""
        open_ = sock is not None
        try:
            while True:
                info = docker_client().api.exec_inspect(exec_id)
                if not info.get("Running"):
                    return int(info.get("ExitCode") or 0)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if open_ and sock is not None:
                    if readable(sock, min(left, 0.01)):
                        open_ = bool(sock.recv(65536))
                else:
                    time.sleep(min(left, 0.02))
        except ENGINE_ERRORS as exc:
            raise SandboxError(f"container of prompt {self.spec.prompt_index} is gone: {exc}") from exc


def network_kind(options: dict[str, Any], workers_here: bool) -> str:
    """What the network of containers made with ``options`` (as ``prepare_run`` returned them) is, in a word:
    "off" (--sandbox_network=False), "hub" (a link into the worker's slirp4netns), "bridge" (Docker's
    default bridge), "per_node" (Ray: each worker's machine decides between the two), or
    "docker:<network_mode>" (a network of the user's own)."""
    mode = options.get("network_mode", "bridge")
    if mode == "none":
        return "off"
    if mode != "bridge":
        return f"docker:{mode}"
    if not options.get("network_hub", True):
        return "bridge"
    return "hub" if workers_here else "per_node"


def _remove_dead_containers() -> None:
    removed = sweep_containers()
    if removed:
        print(f"Removed {len(removed)} leftover container(s) of runners that are gone (any run name)")


def _network_in_force(options: dict[str, Any], workers_here: bool) -> dict[str, Any]:
    """Say once how containers with the network on are connected; ``options`` without the hub where
    this machine cannot give one (Docker's bridge then, as README's Docker network paragraph says)."""
    if options.get("network_mode", "bridge") != "bridge" or not options.get("network_hub", True):
        return options  # the network off, or a Docker network of the user's own: as asked
    if not workers_here:
        print(
            "Docker network: each worker's containers get a link into its own slirp4netns where its "
            "machine allows it (root, the engine's processes visible, slirp4netns), else Docker's default "
            "bridge, which reaches the host's services on 0.0.0.0 and the other containers"
        )
        return options
    problem = network_hub_problem()
    if problem is None:
        from batchrun.prompt.sandboxes.local.network_hub import NetworkHub

        try:  # a namespace and a slirp4netns of its own can be made here (~10 ms)
            NetworkHub().close()
        except OSError as exc:
            problem = f"no network hub here: {exc}"
    if problem is None:
        print(
            "Docker network: each container on a link of its own into its worker's slirp4netns: the "
            "outside world, not the host's own addresses (services on 0.0.0.0 included), not another "
            "prompt's container"
        )
        return options
    print(
        f"warning: Docker containers with the network on sit on Docker's default bridge ({problem}): "
        "they reach every host service listening on 0.0.0.0 or on the bridge's address, and the other "
        "containers on it; for untrusted prompts bind host services to 127.0.0.1 or pass --sandbox_network=False"
    )
    return {**options, "network_hub": False}


def _image_states(
    jobs: Sequence[PromptJob], default: str, status: dict[str, str | None], dataset: str
) -> Preflight:
    """Print each image's state (``status``: ensure_images'); the jobs whose image is not available fail.
    A --default_image that is not is a SetupError (exit 2): a flag the user typed, not a row's field."""
    width = max(len(i) for i in status)
    for image, why in status.items():
        state = "ready" if why is None else "missing" if why == NOT_PULLED else f"NOT AVAILABLE: {why}"
        print(f"  {image:<{width}}  {state}")
    if status.get(default) not in (None, NOT_PULLED) and any(not j.image for j in jobs):
        raise SetupError(f"--default_image {default!r} cannot be used: {status[default]}. No prompt was run")
    failed = {
        j.prompt_index: f"image {j.image!r} not available: {status[j.image]}"
        for j in jobs
        if j.image and status.get(j.image) not in (None, NOT_PULLED)
    }
    if failed:
        # prompt_index is the row's 0-based line in the dataset: name the first lines, as bad lines are
        shown = sorted(failed.items())[:5]
        lines = "; ".join(f"{dataset}:{i + 1}: field 'image'/'docker_image': {why}" for i, why in shown)
        more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
        print(
            f"warning: {len(failed)} prompt(s) will fail without a model call because their image is "
            f"missing or cannot run here; --resume runs them once it can: {lines}{more}"
        )
    return Preflight(isolation="docker", failed=failed)


def _with_disk_cap(found: Preflight, options: dict[str, Any], status: dict[str, str | None]) -> Preflight:
    """``found`` with the disk cap in force ("auto": asked of the engine with a ready image of ``status``)."""
    cap = options.get("disk_cap", "auto")
    usable = next((i for i in sorted(status) if status[i] is None), None)
    if cap == "auto":
        cap = "storage-opt" if usable is not None and storage_size_supported(usable) else "tmpfs"
    mb = options.get("disk_mb", 4096)
    watch: dict[str, Any] = {}
    if cap == "storage-opt":
        in_force = f"storage-opt {mb} MiB (the engine caps each container's writable layer)"
    else:
        tmpfs = (
            f"tmpfs {tmpfs_size_mb(mb, options.get('memory_mb', 2048))} MiB at the working directory (the "
            "engine cannot cap a container's layer; a tmpfs lives in the container's memory: at most half "
            "of --container_memory_mb)"
        )
        if options.get("disk_watch") is False:
            problem: str | None = "the docker option disk_watch is off"
        elif usable is None:
            problem = "no image is ready to make a container of"
        else:
            problem = layer_watch_problem(usable)
        watch = {"disk_watch": problem is None}
        if problem is None:
            in_force = (
                f"{tmpfs}; the rest of its files (writable layer, volumes) watched: a container whose files "
                f"there pass {mb} MiB is stopped and its prompt fails (what it writes before the watch sees "
                "it, a few hundred MiB at a fast disk's speed, lands first)"
            )
        else:
            in_force = f"{tmpfs}; the rest of its files (/tmp, /root, /usr, volumes) NOT capped: {problem}"
    print(f"Docker disk cap per container: {in_force}")
    if not watch.get("disk_watch", True):
        print(
            "warning: what a prompt writes outside its working directory can fill the Docker engine's disk "
            "(often the host's root filesystem); run as root on the engine's machine, or give the engine an "
            "xfs data-root mounted with pquota"
        )
    return Preflight(
        isolation="docker",
        failed=found.failed,
        options={**options, "disk_cap": cap, **watch},
        facts={"sandbox_disk_cap": in_force},
    )


def tmpfs_size_mb(disk_mb: int, memory_mb: int) -> int:
    """The size of a tmpfs disk cap: ``disk_mb``, but at most half the container's memory limit."""
    return max(1, min(disk_mb, memory_mb // 2))


def _send_stdin(sock: socket.socket, chunks: Iterable[bytes]) -> None:
    try:
        for data in chunks:
            if data:
                sock.sendall(data)
    except Exception:  # the command exited without reading it all, or the source broke off
        pass
    try:
        sock.shutdown(socket.SHUT_WR)  # EOF for the command's stdin (a broken-off tar then fails)
    except OSError:
        pass


def _removed_by_itself(container_id: str) -> bool:
    """Wait for a container whose server got EOF to end and be removed; False if it was not in time."""
    try:
        docker_client().api.wait(container_id, timeout=SELF_END_WAIT_S, condition="removed")
    except NotFound:
        pass  # gone already
    except Exception as exc:  # a timeout (requests' own exception) or an engine error: remove it instead
        log.info("container %s did not end by itself: %s", container_id[:12], exc)
        return False
    return True


def _attach(container_id: str) -> object:
    """A stream to the container's stdin and from its stdout and stderr: its end (ours closed, or we
    died) ends the container."""
    return docker_client().api.attach_socket(
        container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
    )


@dataclass
class WorkdirSeed:
    """What an image holds at a container's working directory (a tar archive), or None: nothing."""

    archive: IO[bytes] | None

    def close(self) -> None:
        if self.archive is not None:
            self.archive.close()

    def __enter__(self) -> WorkdirSeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _members(archive: IO[bytes]) -> int:
    """How many entries a tar archive (as the engine sends a directory) holds, counted up to 2 (a
    directory holds itself: 0 is no directory at all); 2 when it is not a tar archive that tarfile reads
    (copied all the same: tar in the container is the judge)."""
    try:
        with tarfile.open(fileobj=archive, mode="r|") as members:
            return sum(1 for _ in itertools.islice(members, 2))
    except tarfile.ReadError:
        return 0 if archive.tell() == 0 else 2  # nothing at all: no directory
    except tarfile.TarError:
        return 2


def _read_frames(sock: socket.socket, scanner: MarkerScanner, deadline: float) -> bool:
    """Demultiplex the exec stream (8-byte headers: stream, 0, 0, 0, size) into ``scanner``.

    Returns False when the deadline passed before the command's end marker (or end of stream).
    """
    pending = bytearray()
    while not scanner.done:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if not readable(sock, remaining):
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
