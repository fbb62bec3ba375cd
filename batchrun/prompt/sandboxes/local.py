"""Local backend: each prompt in its own bubblewrap sandbox, or (on purpose) plain host processes.

With ``bwrap`` a prompt sees the system directories read-only and nothing of the host's data: its
working directory (the row's ``cwd``, a path inside the sandbox) and its ``/tmp`` are its own
size-capped tmpfs mounts, homes and daemons' state are empty, and it has its own PID, network,
IPC and UTS namespaces, with no capabilities. A cgroup per prompt (or rlimits where the machine
offers no cgroups, see ``_limits``) bounds its processes, memory and CPU. With the network on,
``slirp4netns`` connects its network namespace to the outside world but not to the host's services.

One command server runs per prompt (see ``_CommandServer``): setting up the namespaces costs more
CPU than the command itself, so it is paid once per prompt, not per command. Each command still
gets a fresh ``bash -c``, and after each one every process it left behind is killed, so commands
behave as if each had its own sandbox, except for the files; only what the ``process`` tool started
in the background is spared (see ``_SERVER_SCRIPT`` and ``_CommandServer.kill_commands``).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import posixpath
import re
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun.prompt.sandboxes._direct import DirectFiles
from batchrun.prompt.sandboxes._limits import (
    PARENT_PREFIX,
    CgroupLayout,
    Limits,
    PromptCgroup,
    cgroup_layout,
    limits_mechanism,
    remove_run_cgroups,
    rlimit_commands,
    run_cgroup_names,
)
from batchrun.prompt.sandboxes._netlink import add_unreachable_routes
from batchrun.prompt.sandboxes._process import kill_process_group, run_process
from batchrun.prompt.sandboxes._shell import MarkerScanner, new_exec_token
from batchrun.prompt.sandboxes.base import (
    BACKGROUND_DIR,
    BACKGROUND_ENV,
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
    parse_options,
    readable,
    safe_run_name,
)
from batchrun.protocol import PromptJob
from batchrun.storage import pid_alive

ISOLATION_MODES = ("auto", "bwrap", "none")
# Host variables a command may see; everything else (API keys above all) stays out of the sandbox.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TZ")
RUN_DIR_PREFIX = "batch-runner-"  # <tmp>/batch-runner-<run>-<pid>-<random>: one run's sandboxes
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
# capability, which would let a command remount anything read-write: drop them all.
NAMESPACES = (
    "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
    "--die-with-parent", "--new-session", "--as-pid-1", *(("--cap-drop", "ALL") if os.geteuid() == 0 else ()),
)  # fmt: skip
# The system, read-only: what commands need to run. Nothing else of the host is mounted.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Empty and read-only inside: plain directories of the sandbox's own root (bwrap's root is a fresh
# tmpfs, made read-only last), so the host's homes, daemons' state and sockets stay out. Not a
# tmpfs each: 16 mount operations fewer per start (~2 ms of CPU), with the same view inside.
HIDDEN_DIRS = ("/home", "/root", "/run", "/var", "/opt", "/srv", "/mnt", "/media")
# A cwd may not replace these (or lie inside the read-only system directories).
_NO_CWD = ("/", "/dev", "/proc", "/sys", CTL_DIR)


@functools.cache
def system_mounts(etc_view: str | None = None) -> tuple[str, ...]:
    """bwrap arguments for the read-only system, /dev, /proc and the masks of /etc's secrets.

    ``etc_view``: the run's copy of /etc made by :func:`make_etc_view`, bound as /etc in one mount,
    instead of the host's /etc and one mask per secret (a mount each, ~2 ms of a start's CPU)."""
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", etc_view if d == "/etc" and etc_view else d, d]
    args += ["--dev", "/dev", "--proc", "/proc"]
    # Root may write sysctls by file permission alone: keep them read-only.
    args += [
        "--ro-bind-try",
        "/proc/sys",
        "/proc/sys",
        "--ro-bind-try",
        "/proc/sysrq-trigger",
        "/proc/sysrq-trigger",
    ]
    for path, is_dir in () if etc_view else etc_secrets():
        args += ["--tmpfs", path, "--remount-ro", path] if is_dir else ["--ro-bind", "/dev/null", path]
    return tuple(args)


_etc_views: dict[str, str | None] = {}
_run_files_lock = threading.Lock()  # this worker's files in the run's directory: the /etc view, resolv.conf


def _etc_view(base_dir: str) -> str | None:
    """This worker's view of /etc in the run's directory, made by its first sandbox start (~70 ms,
    where the masks cost ~2 ms in every start); None if it cannot be made (then: masks)."""
    with _run_files_lock:
        if base_dir not in _etc_views:
            target = os.path.join(base_dir, f"etc-{os.getpid()}")
            try:
                make_etc_view(target)
                _etc_views[base_dir] = target
            except OSError:
                shutil.rmtree(target, ignore_errors=True)
                _etc_views[base_dir] = None
        return _etc_views[base_dir]


def make_etc_view(target: str) -> None:
    """Make ``target`` a view of /etc for the sandboxes: the same tree, with every secret that
    :func:`etc_secrets` masks empty (a file) or emptied (a directory), and without sockets, FIFOs
    and devices. Files are hard links where the kernel allows (no data copied), else copies;
    symbolic links are kept as they are (they resolve inside the sandbox, as the host's would)."""
    secrets = dict(etc_secrets())
    modes: list[tuple[str, int]] = []  # set last: a directory without write permission gets its entries first
    for top, dirs, files in os.walk("/etc"):
        here = os.path.join(target, os.path.relpath(top, "/etc"))
        os.makedirs(here, exist_ok=True)
        modes.append((here, stat.S_IMODE(os.lstat(top).st_mode)))
        for name in list(dirs):
            src = os.path.join(top, name)
            if os.path.islink(src):
                os.symlink(os.readlink(src), os.path.join(here, name))
                dirs.remove(name)
            elif secrets.get(src) is True:
                os.mkdir(os.path.join(here, name), 0o755)
                dirs.remove(name)
        for name in files:
            src, dst = os.path.join(top, name), os.path.join(here, name)
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            elif not stat.S_ISREG(st.st_mode):
                continue
            elif src in secrets:
                open(dst, "wb").close()
            else:
                try:
                    os.link(src, dst)
                except OSError:  # another filesystem, or protected_hardlinks for a file not ours
                    shutil.copy2(src, dst)
    for path, mode in reversed(modes):
        os.chmod(path, mode)


@functools.cache
def etc_secrets() -> tuple[tuple[str, bool], ...]:
    """What in /etc other users may not read (shadow, SSH host keys, TLS private keys): (path, is_dir).

    The sandbox runs as this user without capabilities; as root it could read root-only files, so
    whatever an unprivileged user could not read is hidden from it too.
    """
    found: list[tuple[str, bool]] = []
    for top, dirs, files in os.walk("/etc"):
        for name in list(dirs):
            path = os.path.join(top, name)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode) and (mode & 0o005) != 0o005:
                found.append((path, True))
                dirs.remove(name)
        for name in files:
            path = os.path.join(top, name)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if stat.S_ISREG(mode) and not mode & stat.S_IROTH:
                found.append((path, False))
    return tuple(sorted(found))


def system_sockets() -> list[str]:
    """Bound Unix sockets (``/proc/net/unix``) inside the mounted system directories.

    A read-only bind does not stop ``connect()``. Daemons keep their sockets in /run or /var/run,
    which the sandbox does not see; one in /etc or /usr would be reachable, so it is masked.
    The file is read at every sandbox start, but the paths are resolved only when the set of bound
    paths changed since the last start (resolving them all cost ~3 ms of CPU per start).
    """
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    # The 8th column, when it is a path: unbound and abstract (@name) sockets go with the network
    # namespace. One regular expression over the file, not a split per line (the file has a line
    # per socket of the host: hundreds at a thousand prompts in flight).
    return list(_system_sockets_among(frozenset(_SOCKET_PATH.findall(text))))


# The path column is the last, and no column before it holds a "/": the rest of a line from its
# first " /". A search for that literal pair, not a pattern tried at every line (~15% of a busy
# worker's CPU with a line per socket of a thousand sandboxes).
_SOCKET_PATH = re.compile(r" (/[^\n]*)")


@functools.lru_cache(maxsize=4)
def _system_sockets_among(paths: frozenset[str]) -> tuple[str, ...]:
    dirs = [d for d in SYSTEM_DIRS if not os.path.islink(d)]
    found = {real for real in map(os.path.realpath, paths) if any(_is_within(real, d) for d in dirs)}
    return tuple(sorted(found))


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate commands on this machine, or None when it can (probed once)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (on Debian: apt-get install bubblewrap)"
    try:
        argv = ["bwrap", *NAMESPACES, *system_mounts(), "--tmpfs", "/tmp", "--remount-ro", "/", "true"]
        done = subprocess.run(argv, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not be run: {exc}"
    if done.returncode != 0:
        return f"bubblewrap does not work here: {done.stderr.decode(errors='replace').strip()}"
    return None


@functools.cache
def network_problem() -> str | None:
    """Why the sandbox cannot get user-mode networking (``slirp4netns``), or None."""
    if shutil.which("slirp4netns") is None:
        return "slirp4netns is not installed (on Debian: apt-get install slirp4netns)"
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if missing:  # needed to keep the host's own addresses out of reach
        return f"{' and '.join(missing)} not found (on Debian: apt-get install iproute2 util-linux)"
    return None


def host_addresses() -> list[str]:
    """The host's own addresses but loopback and link-local, looked up at each start (bridges come and
    go): read from ``/proc`` (no process: ``ip -o addr`` cost ~1.5 ms of CPU per start), or from
    ``ip -o addr`` where those files cannot be read."""
    try:
        return list(_proc_addresses(*_proc_address_files()))
    except (OSError, ValueError):
        return _public(_ip_addresses())


def _public(found: list[str]) -> list[str]:
    return sorted(
        {str(a) for a in map(ipaddress.ip_address, found) if not (a.is_loopback or a.is_link_local)}
    )


def _proc_address_files() -> tuple[str, str]:
    with open("/proc/net/fib_trie", encoding="ascii") as f:
        trie = f.read()
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            inet6 = f.read()
    except FileNotFoundError:  # no IPv6 on this host
        inet6 = ""
    return trie, inet6


@functools.lru_cache(maxsize=4)
def _proc_addresses(trie: str, inet6: str) -> tuple[str, ...]:
    """IPv4: the ``/32 host LOCAL`` entries of ``/proc/net/fib_trie`` (every address of an interface,
    secondary ones included); IPv6: ``/proc/net/if_inet6``. Parsed again only when the files
    changed since the last start (the parsing cost ~0.7 ms of CPU per start)."""
    found: list[str] = []
    last = None
    for line in trie.splitlines():
        text = line.strip()
        if text.startswith("|--"):
            last = text[3:].strip()
        elif text == "/32 host LOCAL" and last:
            found.append(last)
    found += [
        str(ipaddress.IPv6Address(int(line.split()[0], 16))) for line in inet6.splitlines() if line.strip()
    ]
    return tuple(_public(found))


def _ip_addresses() -> list[str]:
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    parts = [line.split() for line in out.splitlines()]
    return [p[3].split("/")[0] for p in parts if len(p) >= 4 and p[2] in ("inet", "inet6")]


@functools.cache
def _shell() -> str:
    """bash when installed, else sh; looked up once, not on every command."""
    return shutil.which("bash") or "sh"


def local_isolation_available() -> bool:
    """Whether the local backend can isolate commands with bubblewrap on this machine."""
    return bwrap_problem() is None


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def sandbox_cwd_problem(cwd: str) -> str | None:
    """Why ``cwd`` (a path inside the sandbox) cannot be a bubblewrap sandbox's working directory."""
    path = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, cwd))
    if path in _NO_CWD or any(_is_within(path, d) for d in _NO_CWD[1:]):
        return f"cwd {cwd!r} would replace a directory the sandbox needs (/, /dev, /proc, /sys)"
    for d in SYSTEM_DIRS:
        if _is_within(path, d):
            return f"cwd {cwd!r} lies in the read-only system directory {d}"
    return None


def host_cwd_problem(cwd: str, cwd_root: str | None) -> str | None:
    """Isolation "none": why a row's absolute ``cwd`` (a host path) may not be used."""
    if not cwd.startswith("/"):
        return None  # relative: inside the prompt's private directory
    if cwd_root is None:
        return f"cwd {cwd!r} is a host directory and --local_isolation=none; name its parent with --cwd_root"
    if not _is_within(os.path.realpath(cwd), os.path.realpath(cwd_root)):
        return f"cwd {cwd!r} is outside --cwd_root {cwd_root}"
    return None


# bwrap fails the set-up when a masked socket vanished since the scan: try again with a new scan.
_BWRAP_SETUP_RACE = re.compile(r"\Abwrap: Can't (create file at|bind mount|mkdir) ")
SLIRP_DNS = "10.0.2.3"  # slirp4netns's DNS forwarder, in its default 10.0.2.0/24
SERVER_READY_TIMEOUT_S = 20.0
SERVER_STOP_TIMEOUT_S = 2.0
TIMEOUT_KILL_WAIT_S = 5.0  # after a timeout, how long the server gets to report the killed command


class LocalSandbox(SandboxBackend):
    """Commands run in ``bash -c``: inside the prompt's bubblewrap namespace when available."""

    # The start (mounts, a cgroup, the command server, slirp4netns) overlaps the first model call: at a
    # thousand prompts in flight, starting first put seconds of queueing before every first request.
    synchronous_start = False
    direct_files = True  # read_direct / write_direct: the file tools reach its tmpfs without a command
    starts_per_cpu = 4  # a start is mostly this machine's CPU (~15-25 ms): more at once only compete
    synchronous_stop = True  # a few ms on the prompt's thread, without messages to the parent

    # -- run-level steps (see base.Sandbox)

    @classmethod
    def options_from(cls, flags: SandboxFlags) -> dict[str, Any]:
        options: dict[str, Any] = {
            "isolation": flags.local_isolation,
            "cpus": flags.cpus,
            "memory_mb": flags.memory_mb,
            "pids_limit": flags.pids_limit,
            "disk_mb": flags.disk_mb,
        }
        if flags.cwd_root is not None:
            options["cwd_root"] = flags.cwd_root
        return options

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
        """Isolation, limits and network as they will really be; no silent run without isolation."""
        isolation = options.get("isolation", "auto")
        problem = bwrap_problem() if isolation != "none" else None
        if problem and (isolation == "bwrap" or real_model):
            raise SetupError(
                f"the local sandbox cannot isolate commands: {problem}. Install bubblewrap "
                "(Debian: apt-get install bubblewrap), use --sandbox=docker, or pass "
                "--local_isolation=none to run the model's commands on this machine without isolation, on purpose"
            )
        with_image = sum(1 for j in jobs if j.image)
        if with_image:
            print(
                f"warning: {with_image} prompt(s) name a container image, which the local backend ignores; "
                "use --sandbox=docker to run them in their images"
            )
        if problem or isolation == "none":
            print(
                f"warning: the local sandbox has NO isolation ({problem or '--local_isolation=none'}): commands "
                "run on this machine as this user, in a private directory, or in a row's cwd under --cwd_root "
                f"({options.get('cwd_root')})"
            )
            bad = [
                (j, why) for j in jobs if j.cwd and (why := host_cwd_problem(j.cwd, options.get("cwd_root")))
            ]
            if bad:
                lines = "; ".join(f"{dataset}:{j.prompt_index + 1}: {why}" for j, why in bad[:5])
                more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
                raise SetupError(
                    f"{len(bad)} dataset row(s) name a cwd the local sandbox may not use: {lines}{more}"
                )
            return Preflight(isolation="none")
        net = "off"
        if network:
            net = "outside world through slirp4netns; not the host's own services"
            if network_problem():
                net = "OFF"
                print(
                    f"warning: --sandbox_network is on, but {network_problem()}: the local sandbox has NO network"
                )
        print(
            "Local sandbox isolation: bubblewrap (system directories read-only; each prompt sees only its own "
            f"working directory and /tmp; own PID, network and IPC namespaces); network: {net}"
        )
        print(
            f"Per-prompt limits: {options.get('cpus')} CPU, {options.get('memory_mb')} MiB memory + "
            f"{options.get('disk_mb')} MiB per tmpfs (working directory, /tmp), {options.get('pids_limit')} "
            f"processes; enforced by {limits_mechanism()}"
        )
        failed = {
            j.prompt_index: f"local sandbox: {why}"
            for j in jobs
            if j.cwd and (why := sandbox_cwd_problem(j.cwd))
        }
        if failed:
            print(
                f"warning: {len(failed)} prompt(s) name a cwd the sandbox cannot have; they fail without a model call"
            )
        return Preflight(isolation="bwrap", failed=failed)

    @classmethod
    def prepare_run(cls, run_name: str, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """One directory (and one parent cgroup of the same name) holds this run's sandboxes, so none outlives it.

        The workers' sandboxes go under ``<tmp>/batch-runner-<run>-<pid>-<random>``; :meth:`sweep`
        removes it once the pool has ended (normally, on Ctrl-C or after a worker died mid-prompt).
        What a runner that was killed outright left is removed here, by the next run of the same
        name, once its pid is gone. (Workers on other machines, Ray's, keep their own temp dirs.)
        """
        if not workers_here:
            return options
        prefix = f"{RUN_DIR_PREFIX}{safe_run_name(run_name)}-"
        leftover = re.compile(re.escape(prefix) + r"(\d+)-[A-Za-z0-9_]{8}")
        removed = 0
        for entry in os.scandir(tempfile.gettempdir()):
            m = leftover.fullmatch(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not pid_alive(int(m.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                remove_run_cgroups(entry.name)
                removed += 1
        for name in run_cgroup_names():  # also those whose directory is gone (another TMPDIR, say)
            m = leftover.fullmatch(name)
            if m and not pid_alive(int(m.group(1))):
                remove_run_cgroups(name)
        if removed:
            print(f"Removed {removed} sandbox director(ies) left by an earlier run named {run_name}")
        base_dir = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
        # The run's parent cgroup is named after the directory, so a sweep finds both.
        return {**options, "base_dir": base_dir, "cgroup_parent": os.path.basename(base_dir)}

    @classmethod
    def sweep(cls, options: dict[str, Any]) -> None:
        """After the pool ended: the run's cgroups and sandbox directory go, whatever its prompts left."""
        base_dir = options.get("base_dir")
        if not base_dir:
            return
        remove_run_cgroups(os.path.basename(base_dir))
        # The workers are gone, and their bubblewrap namespaces die with them (SIGKILL, from the
        # kernel); a process still dying may write a last file: try again a few times.
        for attempt in range(5):
            shutil.rmtree(base_dir, ignore_errors=True)
            if not os.path.exists(base_dir):
                break
            time.sleep(0.1 * (attempt + 1))

    # -- one prompt's sandbox

    def __init__(self, spec: SandboxSpec, **options: object):
        self.spec = spec
        self.options = parse_options(LocalOptions, "local", options)
        wanted = self.options.isolation
        self.isolation = (
            "bwrap" if wanted == "bwrap" or (wanted == "auto" and local_isolation_available()) else "none"
        )
        self.workdir = ""
        self.network = "none"  # what the commands really get: "none", or "slirp4netns" (user-mode networking)
        self._root: str | None = None
        self._tag = uuid.uuid4().hex
        self._server: _CommandServer | None = None
        self._cgroup: PromptCgroup | None = None
        self._hits = (0, 0)  # the cgroup's (pids.max hits, OOM kills) after the last command
        self._lock = threading.Lock()  # one command at a time per prompt

    def start(self) -> None:
        if self.isolation == "bwrap" and bwrap_problem():
            raise SandboxError(f"local sandbox: isolation 'bwrap' was requested but {bwrap_problem()}")
        cwd = self.spec.cwd or ""
        if self.isolation == "bwrap":
            problem = sandbox_cwd_problem(cwd)
        else:
            problem = host_cwd_problem(cwd, self.options.cwd_root)
        if problem:
            raise SandboxError(f"local sandbox: {problem}")
        self._root = tempfile.mkdtemp(
            prefix=f"br-{safe_run_name(self.spec.run_name)}-{self.spec.prompt_index}-",
            dir=self.options.base_dir,
        )
        if self.isolation == "none":
            os.mkdir(os.path.join(self._root, "tmp"))
            self.workdir = os.path.abspath(os.path.join(self._root, "work", cwd))
            try:
                os.makedirs(self.workdir, exist_ok=True)
            except OSError as exc:
                raise SandboxError(f"local sandbox: cannot create cwd {cwd!r}: {exc}") from exc
            return
        # Inside bubblewrap the cwd is a path in the sandbox, its own size-capped tmpfs.
        self.workdir = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, cwd))
        os.mkdir(os.path.join(self._root, "ctl"))
        open(os.path.join(self._root, "ctl", "empty"), "wb").close()
        layout = cgroup_layout()
        if isinstance(layout, CgroupLayout):
            parent = self.options.cgroup_parent or f"{PARENT_PREFIX}pid{os.getpid()}"
            try:
                self._cgroup = PromptCgroup(layout, parent, os.path.basename(self._root), self.options.limits)
            except OSError as exc:
                self.stop()
                raise SandboxError(f"local sandbox: cannot make the prompt's cgroup: {exc}") from exc
        try:
            self._server = self._start_server()
        except BaseException:
            self.stop()  # no cgroup or directory of a sandbox that never ran is left behind
            raise

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        if self._root is None:
            raise SandboxError("local sandbox is not started")
        if self.isolation == "none":
            return run_process(
                [_shell(), "-c", command], stdin=stdin, timeout_s=timeout_s,
                output_cap_bytes=self.options.output_cap_bytes, cwd=self.workdir, env=self._env(),
            )  # fmt: skip
        with self._lock:
            if self._server is None or not self._server.alive():
                # The namespace ended (bwrap was killed from outside): the next command gets a new one.
                if self._server is not None:
                    self._server.close()
                self._server = self._start_server()
            result = self._server.run(command, timeout_s=timeout_s, stdin=stdin)
            notes = self._limit_notes()
        if notes:
            result = dataclasses.replace(
                result, output=(result.output + "\n" + "\n".join(notes)).lstrip("\n")
            )
        return result

    # -- the file tools' direct path (see _direct): the prompt's working directory and /tmp, from here

    def read_direct(self, path: str, max_bytes: int) -> bytes | None:
        with self._lock:
            files = self._direct_files()
            return files.read(path, max_bytes) if files is not None else None

    def write_direct(self, path: str, data: bytes, *, make_parents: bool) -> bool:
        with self._lock:
            files = self._direct_files()
            return files is not None and files.write(path, data, make_parents=make_parents)

    def _direct_files(self) -> DirectFiles | None:
        """The live server's view of the sandbox's own mounts; None without bubblewrap, or when the
        server has ended (its namespace, which the next command replaces, must not be written)."""
        server = self._server
        if server is None or not server.alive():
            return None
        return server.files

    def _limit_notes(self) -> list[str]:
        """What a limit did during the command, said plainly (the command's own errors can be cryptic).

        The counters are read once per command: the values after the previous command (zero in a new
        cgroup) are this one's starting point. Called under ``_lock``, so commands do not interleave."""
        notes = []
        opts = self.options
        if self._cgroup is not None:
            before = self._hits
            pids, oom = self._hits = self._cgroup.hits()
            if pids > before[0]:
                notes.append(
                    f"[batch-runner: the sandbox's process limit ({opts.pids_limit}) was reached; "
                    "fork() failed for some processes]"
                )
            if oom > before[1]:
                notes.append(
                    f"[batch-runner: the sandbox's memory limit ({opts.memory_mb} MiB for processes + "
                    f"{opts.disk_mb} MiB for files) was reached; the kernel killed {oom - before[1]} process(es)]"
                )
        server = self._server
        for where in dict.fromkeys((self.workdir, "/tmp")):
            free = server.free_bytes(where) if server is not None else None
            if free == 0:
                notes.append(f"[batch-runner: {where} is full: its size cap is {opts.disk_mb} MiB]")
        return notes

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None
        root, self._root = self._root, None
        if root is None:
            return
        if self.isolation == "none":  # bwrap ends each command's processes with it; here some may linger
            _kill_tagged(f"{TAG_VAR}={self._tag}".encode())
        shutil.rmtree(root, ignore_errors=True)

    def _env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.setdefault("PATH", os.defpath)
        tmp = "/tmp" if self.isolation == "bwrap" else os.path.join(self._root or "", "tmp")
        env.update(HOME=self.workdir, TMPDIR=tmp)
        env.update(self.spec.env)
        env[TAG_VAR] = self._tag
        return env

    def _start_server(self) -> _CommandServer:
        assert self._root is not None
        for attempt in range(3):
            server = _CommandServer(self._launch_argv(), ctl=os.path.join(self._root, "ctl"), env=self._env(),
                                    output_cap_bytes=self.options.output_cap_bytes)  # fmt: skip
            problem = server.wait_ready(SERVER_READY_TIMEOUT_S)
            if problem is None and self._cgroup is not None:
                # The server only waits for requests until now; every command is its child, so
                # everything the model runs starts in the cgroup. (A shell around bwrap that joined
                # it first cost a process, ~1 ms of CPU, per start.)
                try:
                    self._cgroup.enter(server.proc.pid, server.pid)
                except OSError as exc:
                    server.close()
                    raise SandboxError(
                        f"local sandbox: cannot put the prompt into its cgroup: {exc}"
                    ) from exc
            if problem is None:
                home = posixpath.join(self.workdir, self.spec.env.get("HOME", self.workdir))
                server.files = DirectFiles.open(
                    f"/proc/{server.pid}/root",
                    self.workdir,
                    home,
                    tuple(dict.fromkeys((self.workdir, "/tmp"))),
                )
                if self.spec.network and network_problem() is None:
                    try:
                        server.connect_network()
                    except SandboxError:
                        server.close()
                        raise
                    self.network = "slirp4netns"
                return server
            server.close()
            if not _BWRAP_SETUP_RACE.match(problem):
                break
            time.sleep(0.05 * (attempt + 1))
        raise SandboxError(f"local sandbox: bubblewrap could not start the prompt's shell: {problem}")

    def _resolv_conf(self) -> list[str]:
        """slirp4netns answers DNS at 10.0.2.3; the host's resolver (127.0.0.53, say) may be
        unreachable from the sandbox. Bound where /etc/resolv.conf leads (often into /run)."""
        assert self._root is not None
        target = os.path.realpath("/etc/resolv.conf")
        hidden = any(_is_within(target, d) for d in HIDDEN_DIRS)
        if not (hidden or os.path.isfile(target)):
            return []  # no file to cover in the read-only /etc
        # The same for every sandbox: written once per worker in the run's directory (a file per
        # start was ~3% of a busy worker's CPU), or in the sandbox's own when there is no run.
        where = self.options.base_dir or self._root
        ours = os.path.join(where, f"resolv-{os.getpid()}.conf")
        with _run_files_lock:
            if not os.path.exists(ours):
                with open(ours, "w", encoding="utf-8") as f:
                    f.write(f"nameserver {SLIRP_DNS}\n")
        return [*(["--dir", os.path.dirname(target)] if hidden else []), "--ro-bind", ours, target]

    def _launch_argv(self) -> list[str]:
        """The wrapper that puts bwrap under the prompt's limits, then bwrap and its mounts."""
        assert self._root is not None
        disk = str(self.options.disk_mb << 20)
        etc_view = _etc_view(self.options.base_dir) if self.options.base_dir else None
        argv = ["bwrap", *NAMESPACES, *system_mounts(etc_view)]
        for path in system_sockets():
            if not (etc_view and _is_within(path, "/etc")):  # the view has no sockets
                argv += ["--ro-bind", "/dev/null", path]
        for d in HIDDEN_DIRS:
            argv += ["--dir", d]
        argv += ["--symlink", "../tmp", "/var/tmp", "--size", disk, "--tmpfs", "/tmp"]
        argv += ["--ro-bind", os.path.join(self._root, "ctl"), CTL_DIR]
        if self.spec.network and network_problem() is None:
            argv += self._resolv_conf()
        argv += ["--size", disk, "--tmpfs", self.workdir]
        # Last: nothing but the working directory and /tmp stays writable (remounts are not recursive).
        argv += ["--remount-ro", "/"]
        argv += ["--chdir", self.workdir, "--"]
        if self._cgroup is not None:  # bwrap and the server join it before the first command (_start_server)
            return argv
        fallback = rlimit_commands(self.options.limits)
        return ["/bin/sh", "-c", f'{fallback} || exit 96; exec "$@"', "br-limits", *argv]


# The server, run by bash as PID 1 of the prompt's PID namespace. Requests come on stdin, one line
# each: "<seq> <token> <stdin: 0|1>"; the command text is in $ctl/<seq>.cmd and its stdin, when
# given, in $ctl/<seq>.in (files: no size limit, no deadlock, any bytes), else the empty $ctl/empty
# (read-only, unlike the namespace's /dev/null, which `rm -rf /` removes). Each command runs in a
# fresh `bash -c` with stdout and stderr on the server's stdout. When it is done, every other
# process in the namespace is killed (so nothing it left behind writes after the marker or
# outlives the call, as with one sandbox per command), then the end marker with the exit code is
# printed. As PID 1 the server gets no signal from inside the namespace it did not ask for, and
# it reaps the orphans. `kill -9 -1` on the host would be a disaster: the PID check makes sure it
# never runs there. Once the process tool has started a background process (its directory exists),
# the sweep spares the sessions it started and the processes marked with BACKGROUND_ENV (children
# inherit the mark) instead of killing everything; zombies are skipped, as they write nothing.
_SERVER_SCRIPT = r"""
[ "$$" = 1 ] || { echo "batch-runner: the command server is not in its own PID namespace" >&2; exit 97; }
unset SHLVL
ctl=$1 sh=$2 keep_dir=${TMPDIR:-/tmp}/$4 keep_env=$5
exec 2>/dev/null  # not bash's "Killed" notes for a command killed at its deadline
printf '%s\n' "$3"
# kept <pid> <session>: 0 spare it, 1 kill it, 2 cannot tell yet. A process of a session the process
# tool started is kept whatever it execs; otherwise the mark in its environment decides, and an
# environment that reads empty (a process in the middle of an exec) is looked at again next round.
kept() {
    local e n=0
    [ -n "${sessions[$2]}" ] && return 0
    while IFS= read -r -d '' e; do
        n=$((n + 1))
        [ "$e" = "$keep_env" ] && return 0
    done < "/proc/$1/environ"
    [ "$n" = 0 ] && return 2
    return 1
}
sweep() {
    local round p f x st left unsure
    declare -A sessions=()
    for f in "$keep_dir"/p*/pid; do { read -r x < "$f" && sessions[$x]=1; } 2>/dev/null; done
    for ((round = 0; round < 1000; round++)); do
        left=0 unsure=0
        for p in /proc/[0-9]*; do
            p=${p#/proc/}
            case $p in 1 | $$) continue ;; esac
            { IFS= read -r st < "/proc/$p/stat"; } 2>/dev/null || continue  # gone meanwhile
            set -- ${st##*) }  # state ppid pgrp session ...
            [ "$1" = Z ] && continue
            kept "$p" "$4" 2>/dev/null
            case $?:$round in
                0:*) continue ;;
                2:?) unsure=1; continue ;;  # for the first 10 rounds
            esac
            kill -9 "$p" 2>/dev/null && left=1
        done
        [ "$left$unsure" = 00 ] && return
    done
}
while IFS=' ' read -r seq tok has_in; do
    cmd=
    IFS= read -r -d '' cmd < "$ctl/$seq.cmd"
    in=$ctl/empty
    [ "$has_in" = 1 ] && in=$ctl/$seq.in
    "$sh" -c "$cmd" < "$in" 2>&1
    rc=$?
    if [ -d "$keep_dir" ]; then
        sweep
    else
        # Repeat until every other process is a zombie, so that a child forked during a round, or
        # killed but not yet gone, is dead before the marker. Zombies (orphans now ours) also answer
        # kill(-1) until bash reaps them, so they do not count; builtins only: a fork here would count.
        n=0
        while kill -9 -1 2>/dev/null && [ "$n" -lt 10000 ]; do
            n=$((n + 1)) live=
            for s in /proc/[0-9]*/stat; do
                [ "$s" = /proc/1/stat ] && continue
                IFS= read -r line < "$s" 2>/dev/null || continue
                st=${line##*) } && st=${st%% *}
                [ "$st" = Z ] || { live=1 && break; }
            done
            [ -n "$live" ] || break
        done
    fi
    printf '\n[batch-runner-exit:%s]=%s\n' "$tok" "$rc"
done
"""


class _CommandServer:
    """One prompt's bubblewrap namespace with a shell that runs its commands one by one."""

    @staticmethod
    def argv(ctl: str, ready: str) -> list[str]:
        """The server's own command line (after bwrap's): it prints ``ready`` once it reads requests."""
        keep_env = "=".join(BACKGROUND_ENV)
        return [
            _shell(), "--noprofile", "--norc", "-c", _SERVER_SCRIPT, "br-server", ctl, _shell(), ready,
            BACKGROUND_DIR, keep_env,
        ]  # fmt: skip

    def __init__(self, launch: list[str], *, ctl: str, env: dict[str, str], output_cap_bytes: int):
        self.ctl = ctl
        self.output_cap_bytes = output_cap_bytes
        self._ready = f"[batch-runner-ready:{new_exec_token()}]"
        self._seq = 0
        self._pid: int | None = None  # the server's host PID (bwrap's child)
        self.files: DirectFiles | None = None  # the namespace's own mounts seen from here, once it is ready
        self._slirp: subprocess.Popen | None = None  # the namespace's user-mode network, if any
        self._slirp_exit: int | None = None  # closing this pipe end ends slirp4netns (so does our death)
        self.proc = _spawn(
            [*launch, *self.argv(CTL_DIR, self._ready)], cwd="/", env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        self._sel = selectors.PollSelector()  # no descriptor of its own (epoll's), none limited to < 1024
        self._sel.register(self._out, selectors.EVENT_READ)
        self._eof = False

    @property
    def pid(self) -> int | None:
        return self._pid

    def alive(self) -> bool:
        return not self._eof and self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> str | None:
        """None once the server said it is ready; else what bwrap or the shell printed instead."""
        seen = b""
        deadline = time.monotonic() + timeout_s
        want = self._ready.encode() + b"\n"
        while not seen.endswith(want):
            chunk = self._read(deadline)
            if chunk is None:
                return f"no answer within {timeout_s:g} s"
            if not chunk:
                text = seen.decode(errors="replace").strip()
                return text or f"it exited with code {self.proc.wait()}"
            seen += chunk
            if len(seen) > 65536:
                break
        if seen != want:
            return seen.decode(errors="replace").replace(self._ready, "").strip() or "unexpected output"
        self._pid = _child_of(self.proc.pid)
        return None if self._pid else "bubblewrap's child process was not found"

    def connect_network(self) -> None:
        """Give the namespace the outside world through slirp4netns, but not the host's services.

        ``--disable-host-loopback``: the gateway does not lead to the host's 127.0.0.1; the host's
        other addresses are made unreachable below. slirp4netns ends when the write end of its
        exit pipe closes: at ``close``, or when this process dies, however it dies.
        """
        exit_r, self._slirp_exit = os.pipe()
        ready_r, ready_w = os.pipe()
        argv = ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback", "--enable-sandbox",
                f"--exit-fd={exit_r}", f"--ready-fd={ready_w}", str(self._pid), "tap0"]  # fmt: skip
        if os.readlink(f"/proc/{self._pid}/ns/user") != os.readlink("/proc/self/ns/user"):
            argv[-2:-2] = [f"--userns-path=/proc/{self._pid}/ns/user"]  # unprivileged bwrap's own
        log = os.path.join(os.path.dirname(self.ctl), "slirp4netns.log")  # outside the sandbox's view
        try:
            with open(log, "wb") as err:
                self._slirp = subprocess.Popen(
                    argv, pass_fds=(exit_r, ready_w), stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                    start_new_session=True,
                )  # fmt: skip
        except OSError as exc:
            raise SandboxError(f"local sandbox: slirp4netns could not be started: {exc}") from exc
        finally:
            os.close(exit_r)
            os.close(ready_w)
        try:
            ready = readable(ready_r, SERVER_READY_TIMEOUT_S) and os.read(ready_r, 1)
        finally:
            os.close(ready_r)
        if ready != b"1":
            self._end_network()
            said = Path(log).read_text(errors="replace").strip().splitlines()
            raise SandboxError(
                f"local sandbox: slirp4netns could not connect the sandbox: {said[-1:] or ready!r}"
            )
        self._block_host_addresses()

    def _block_host_addresses(self) -> None:
        """Through slirp4netns, the host's other addresses (a bridge's, say) would reach services that
        listen on all interfaces, a model server included: make them unreachable inside. The
        namespace's own copy of the host's address stays local (the local table comes first)."""
        blocked = host_addresses()
        if not blocked:
            return
        same_userns = os.readlink(f"/proc/{self._pid}/ns/user") == os.readlink("/proc/self/ns/user")
        if same_userns:  # this process may enter the namespace (as root): no nsenter and ip processes
            try:
                add_unreachable_routes(f"/proc/{self._pid}/ns/net", blocked)
                return
            except OSError:
                pass  # the usual way, below, says what is wrong if it fails too
        script = "".join(f"route add unreachable {a}/{128 if ':' in a else 32}\n" for a in blocked)
        argv = ["nsenter", f"--net=/proc/{self._pid}/ns/net", "ip", "-batch", "-"]
        if not same_userns:
            argv[1:1] = [f"--user=/proc/{self._pid}/ns/user", "--preserve-credentials"]
        try:
            done = subprocess.run(argv, input=script.encode(), capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxError(
                f"local sandbox: cannot close the host's addresses to the sandbox: {exc}"
            ) from exc
        if done.returncode != 0:
            text = done.stderr.decode(errors="replace").strip()
            raise SandboxError(f"local sandbox: cannot close the host's addresses to the sandbox: {text}")

    def free_bytes(self, path: str) -> int | None:
        """Free bytes of the filesystem at ``path`` inside the namespace (seen through /proc), or None."""
        if self._pid is None or not self.alive():
            return None
        try:
            st = os.statvfs(f"/proc/{self._pid}/root{path}")
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None) -> ExecResult:
        self._seq += 1
        seq, token = self._seq, new_exec_token()
        cmd_file, in_file = os.path.join(self.ctl, f"{seq}.cmd"), os.path.join(self.ctl, f"{seq}.in")
        with open(cmd_file, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(command)
        if stdin is not None:
            with open(in_file, "wb") as f:
                f.write(stdin)
        buf = CappedBuffer(self.output_cap_bytes)
        scanner = MarkerScanner(token, buf)
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            self.proc.stdin.write(f"{seq} {token} {int(stdin is not None)}\n".encode())
            self.proc.stdin.flush()
            while not scanner.done:
                chunk = self._read(deadline)
                if chunk is None:
                    # The deadline: kill what the command started, but keep the server and with it
                    # the namespace's files; it then reports the killed command as usual.
                    timed_out = True
                    self.kill_commands()
                    self._drain(scanner, time.monotonic() + TIMEOUT_KILL_WAIT_S)
                    if not scanner.done:
                        self.kill()
                    break
                if not chunk:
                    break
                scanner.feed(chunk)
        except (BrokenPipeError, OSError):
            pass
        finally:
            for path in (cmd_file, in_file):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if not scanner.done:
            scanner.finish()
        output, truncated = buf.result()
        if timed_out:
            return ExecResult(output=output, exit_code=-1, timed_out=True, truncated=truncated)
        if not scanner.done:  # the server itself ended (bwrap killed from outside, or the OOM killer)
            self.kill()
            note = "[the sandbox's shell ended during this command; the next command gets a new one]"
            return ExecResult(output=(output + "\n" + note).lstrip("\n"), exit_code=137, truncated=truncated)
        return ExecResult(output=output, exit_code=scanner.exit_code, truncated=truncated)

    def kill_commands(self) -> None:
        """From the host: SIGKILL every process of the namespace but the server, until none is left.

        What the ``process`` tool started in the background (the sessions in its directory, and
        processes carrying its mark) is spared, as the server's own sweep spares it.
        """
        ns = self._namespace()
        if ns is None:  # the server is gone (or its PID is no longer ours): end the namespace instead
            self.kill()
            return
        keep_sessions = self._background_sessions(ns)
        mark = "=".join(BACKGROUND_ENV).encode()
        for _ in range(50):
            found = False
            for host_pid, member in _namespace_members(ns).items():
                if host_pid == self._pid:
                    continue
                if keep_sessions is not None and (
                    member.session in keep_sessions or _has_env(host_pid, mark)
                ):
                    continue
                try:
                    os.kill(host_pid, signal.SIGKILL)
                    found = True
                except OSError:
                    continue
            if not found:
                return
            time.sleep(0.01)

    def _background_sessions(self, ns: str) -> set[int] | None:
        """Host session ids of what the process tool started, or None when it was never used here."""
        where = f"/proc/{self._pid}/root/tmp/{BACKGROUND_DIR}"  # the sandbox's own /tmp, seen from the host
        if not os.path.isdir(where):
            return None
        started = set()
        for entry in os.scandir(where):
            try:
                with open(os.path.join(entry.path, "pid")) as f:
                    started.add(int(f.read().strip()))
            except (OSError, ValueError):
                continue
        return {m.session for m in _namespace_members(ns).values() if m.ns_pid in started}

    def _namespace(self) -> str | None:
        """The server's PID namespace, checked to be its own (never this host's) and still ours."""
        if self._pid is None or not self.alive():
            return None
        try:
            ns = os.readlink(f"/proc/{self._pid}/ns/pid")
            status = Path(f"/proc/{self._pid}/status").read_text()
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        nspid = fields.get("NSpid", "").split()
        parent = fields.get("PPid", "").strip()
        if ns == os.readlink("/proc/self/ns/pid") or nspid[-1:] != ["1"] or parent != str(self.proc.pid):
            return None
        return ns

    def close(self) -> None:
        """End the server: EOF on its requests, a short wait, then SIGKILL for the whole namespace."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._sel.close()
        self.proc.stdout.close()
        self._end_network()
        if self.files is not None:
            self.files.close()

    def kill(self) -> None:
        kill_process_group(self.proc)  # bwrap (--die-with-parent) takes the whole PID namespace with it
        self.proc.wait()
        self._eof = True

    def _end_network(self) -> None:
        """Close slirp4netns's exit pipe, so it ends; SIGKILL it if it has not within a second."""
        exit_w, self._slirp_exit = self._slirp_exit, None
        if exit_w is not None:
            os.close(exit_w)
        slirp, self._slirp = self._slirp, None
        if slirp is not None:
            try:
                slirp.wait(timeout=1)
            except subprocess.TimeoutExpired:
                slirp.kill()
                slirp.wait()

    def _read(self, deadline: float) -> bytes | None:
        """The next bytes of output; b"" at EOF, None when the deadline passed first."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not self._sel.select(left):
                continue
            try:
                chunk = os.read(self._out, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self._eof = True
            return chunk

    def _drain(self, scanner: MarkerScanner, until: float) -> None:
        while not self._eof and not scanner.done:
            chunk = self._read(until)
            if not chunk:
                return
            scanner.feed(chunk)


_spawner: tuple[int, ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start bwrap from a thread that lives as long as this process.

    ``--die-with-parent`` is PR_SET_PDEATHSIG, which fires when the *thread* that started the
    process ends, not the process: a sandbox started on a thread of its own (a start alongside the
    first model call without a pool of start threads) died as soon as that thread returned, and its
    first command found the shell gone. One spawning thread per process (made again after a fork)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            _spawner = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn"))
        pool = _spawner[1]
    return pool.submit(subprocess.Popen, argv, **kwargs).result()


@dataclass(frozen=True)
class _Member:
    ns_pid: int  # its pid inside the namespace
    session: int  # its session id, as the host sees it


def _namespace_members(ns: str) -> dict[int, _Member]:
    """The processes of PID namespace ``ns`` (a /proc/<pid>/ns/pid link), by host pid."""
    members = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") != ns:
                continue
            with open(f"/proc/{entry.name}/status") as f:
                ns_pid = next(int(line.split()[-1]) for line in f if line.startswith("NSpid:"))
            with open(f"/proc/{entry.name}/stat") as f:
                session = int(f.read().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError, StopIteration):
            continue
        members[int(entry.name)] = _Member(ns_pid, session)
    return members


def _has_env(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


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


def _child_of(pid: int) -> int | None:
    """The first child of ``pid`` (bwrap has exactly one: the namespace's PID 1), or None."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
    except (OSError, ValueError):
        pass
    for entry in os.scandir("/proc"):  # kernels without the children file
        try:
            if entry.name.isdigit() and Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[
                1
            ] == str(pid):
                return int(entry.name)
        except (OSError, IndexError):
            continue
    return None
