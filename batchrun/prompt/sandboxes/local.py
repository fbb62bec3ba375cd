"""Local backend: each prompt gets a private directory on this machine, and with bubblewrap a read-only host.

With ``bwrap`` each prompt gets its own mount and PID namespace: the host filesystem is read-only,
only the prompt's working directory and its private ``/tmp`` are writable, the host's Unix sockets
(the Docker daemon's above all) are masked, and the network is cut when the spec asks for it.
Without bubblewrap there is no isolation at all: say so loudly.

With bubblewrap, one command server runs per prompt (see ``_CommandServer``): setting up the
namespaces costs more CPU than the command itself, so it is paid once per prompt, not per command.
Each command still gets a fresh ``bash -c``, and after each one every process it left behind is
killed, so commands behave as if each had its own sandbox; only what the ``process`` tool started
in the background is spared (see ``_SERVER_SCRIPT`` and ``_CommandServer._end_command``).
"""

from __future__ import annotations

import functools
import os
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
from dataclasses import dataclass
from typing import Any

from batchrun.prompt.sandboxes._process import kill_process_group, run_process
from batchrun.prompt.sandboxes._shell import MarkerScanner, new_exec_token
from batchrun.prompt.sandboxes.base import (
    BACKGROUND_DIR,
    BACKGROUND_ENV,
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
from batchrun.storage import pid_alive

ISOLATION_MODES = ("auto", "bwrap", "none")
# Host variables a command may see; everything else (API keys above all) stays out of the sandbox.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TZ")
RUN_DIR_PREFIX = "batch-runner-"  # <tmp>/batch-runner-<run>-<pid>-<random>: one run's sandboxes
TAG_VAR = "BATCH_RUNNER_SANDBOX"  # marks every process of one sandbox, so stop() can find leftovers


@dataclass(frozen=True)
class LocalOptions:
    output_cap_bytes: int = DEFAULT_OUTPUT_CAP_BYTES  # most bytes of one command's output kept
    isolation: str = "auto"  # "auto": bwrap when it works here; "bwrap": required; "none": plain processes
    base_dir: str | None = None  # where private directories are made; None: the system temp dir

    def __post_init__(self) -> None:
        check_option_types(self, "local", positive=("output_cap_bytes",))
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(
                f"local sandbox option isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}"
            )


# The host read-only, fresh /dev and /proc, its own PID namespace, gone with its parent. Run as root,
# bwrap keeps every capability, which would let a command remount / read-write: drop them all, and
# keep /proc/sys read-only (root may write sysctls by file permission alone).
BWRAP_BASE = (
    "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
    "--ro-bind-try", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
    "--unshare-pid", "--die-with-parent", "--new-session", *(("--cap-drop", "ALL") if os.geteuid() == 0 else ()),
)  # fmt: skip


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate commands on this machine, or None when it can (probed once)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (on Debian: apt-get install bubblewrap)"
    try:
        done = subprocess.run([*BWRAP_BASE, "--unshare-net", "true"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not be run: {exc}"
    if done.returncode != 0:
        return f"bubblewrap does not work here: {done.stderr.decode(errors='replace').strip()}"
    return None


@functools.cache
def _shell() -> str:
    """bash when installed, else sh; looked up once, not on every command."""
    return shutil.which("bash") or "sh"


def local_isolation_available() -> bool:
    """Whether the local backend can isolate commands with bubblewrap on this machine."""
    return bwrap_problem() is None


# Host paths a dataset's cwd may never name: the cwd is bound writable inside bubblewrap.
_SYSTEM_DIRS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/sbin",
    "/sys",
    "/usr",
)
_SYSTEM_ROOTS = ("/home", "/root", "/var", "/run", "/opt", "/srv", "/mnt", "/media", "/tmp")


def _is_within(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _protected(path: str) -> bool:
    """``/``, a system directory or anything inside one, or a top-level directory such as /home."""
    real = os.path.realpath(path)
    if real == "/" or real in _SYSTEM_ROOTS:
        return True
    return any(real == d or real.startswith(d + "/") for d in _SYSTEM_DIRS)


# bwrap copies the host's mounts; one that vanishes meanwhile (Docker's overlays come and go) fails the
# set-up before anything runs, and so does a masked socket that vanished since the scan: try again.
_BWRAP_SETUP_RACE = re.compile(
    r"\Abwrap: Can't (bind mount|remount|mount) /oldroot/|\Abwrap: Can't (create file at|mkdir) "
)
SERVER_READY_TIMEOUT_S = 20.0
SERVER_STOP_TIMEOUT_S = 2.0


SOCKET_SCAN_TTL_S = 2.0  # how long one scan of the host's sockets serves new sandboxes


@dataclass(frozen=True)
class SocketDir:
    """A host directory holding bound Unix sockets: ``names`` are those sockets. ``only_sockets``:
    the directory holds nothing else, so a tmpfs can hide it whole, new sockets included."""

    path: str
    names: tuple[str, ...]
    only_sockets: bool


_socket_scan: tuple[float, list[SocketDir]] = (float("-inf"), [])
_socket_scan_lock = threading.Lock()


def host_socket_dirs(*, fresh: bool = False) -> list[SocketDir]:
    """Where the Unix sockets bound on this host (``/proc/net/unix``) are, grouped by directory.

    A read-only bind does not stop ``connect()``: without a mask, a command could reach
    ``/run/docker.sock`` and, through the Docker daemon, the whole host. Reading the kernel's
    table costs about a millisecond on a busy host, so a scan serves the sandboxes started in the
    next ``SOCKET_SCAN_TTL_S`` seconds (long-lived daemons' sockets are what matter; a socket
    made while a prompt runs is not masked for it either way, unless its directory is hidden whole).
    """
    global _socket_scan
    with _socket_scan_lock:
        taken, _ = _socket_scan
        if fresh or time.monotonic() - taken > SOCKET_SCAN_TTL_S:
            _socket_scan = (time.monotonic(), _scan_socket_dirs())
        return _socket_scan[1]


def host_unix_sockets(*, fresh: bool = False) -> list[str]:
    """The paths of the host's bound Unix sockets (see ``host_socket_dirs``)."""
    return sorted(os.path.join(d.path, n) for d in host_socket_dirs(fresh=fresh) for n in d.names)


def _scan_socket_dirs() -> list[SocketDir]:
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    bound: dict[str, set[str]] = {}  # real directory -> names of the sockets bound in it
    for line in lines:
        parts = line.split(None, 7)
        if len(parts) < 8 or not parts[7].startswith("/"):
            continue  # unbound, or abstract (@name): those go with the network namespace
        parent, name = os.path.split(parts[7])
        bound.setdefault(parent, set()).add(name)
    by_real: dict[str, set[str]] = {}
    for parent, names in bound.items():  # /var/run and /run are one directory
        by_real.setdefault(os.path.realpath(parent), set()).update(names)
    found: dict[str, SocketDir] = {}
    for real, names in by_real.items():
        try:
            entries = list(os.scandir(real))
        except OSError:
            continue
        sockets = set()
        for entry in entries:
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    sockets.add(entry.name)
            except OSError:
                continue
        if names & sockets:
            found[real] = SocketDir(
                real, tuple(sorted(names & sockets)), only_sockets=len(sockets) == len(entries)
            )
    return sorted(found.values(), key=lambda d: d.path)


class LocalSandbox:
    """Commands run in ``bash -c``: inside the prompt's bubblewrap namespace when available."""

    synchronous_start = True  # a start takes a few ms: a start failure then costs no model call

    # -- run-level steps (see base.Sandbox)

    @classmethod
    def options_from(cls, flags: SandboxFlags) -> dict[str, Any]:
        return {"isolation": flags.local_isolation}

    @classmethod
    def preflight(cls, images: list[str | None], options: dict[str, Any], *, real_model: bool) -> Preflight:
        isolation = options.get("isolation", "auto")
        problem = bwrap_problem() if isolation != "none" else "isolation disabled (--local_isolation=none)"
        if problem:
            if isolation == "bwrap":
                raise SetupError(f"--local_isolation=bwrap: {problem}")
            print(
                f"warning: the local sandbox has NO isolation: commands run on this machine as this user ({problem})"
            )
        else:
            print(
                "Local sandbox isolation: bubblewrap (host read-only, private workdir and /tmp, own PID namespace)"
            )
        with_image = sum(1 for image in images if image)
        if with_image:
            print(
                f"warning: {with_image} prompt(s) name a container image, which the local backend ignores; "
                "use --sandbox=docker to run them in their images"
            )
        return Preflight(isolation="none" if problem else "bwrap")

    @classmethod
    def prepare_run(cls, run_name: str, options: dict[str, Any], *, workers_here: bool) -> dict[str, Any]:
        """One directory holds this run's sandboxes, so none outlives it.

        The workers' sandboxes go under ``<tmp>/batch-runner-<run>-<pid>-<random>``; :meth:`sweep`
        removes it once the pool has ended (normally, on Ctrl-C or after a worker died mid-prompt).
        One left by a runner that was killed outright is removed here, by the next run of the same
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
                removed += 1
        if removed:
            print(f"Removed {removed} sandbox director(ies) left by an earlier run named {run_name}")
        return {**options, "base_dir": tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")}

    @classmethod
    def sweep(cls, options: dict[str, Any]) -> None:
        """After the pool ended: the run's sandbox directory goes, whatever its prompts left in it."""
        base_dir = options.get("base_dir")
        if not base_dir:
            return
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
        self._root: str | None = None
        self._tag = uuid.uuid4().hex
        self._server: _CommandServer | None = None
        self._lock = threading.Lock()  # one command at a time per prompt

    def start(self) -> None:
        if self.isolation == "bwrap" and bwrap_problem():
            raise SandboxError(f"local sandbox: isolation 'bwrap' was requested but {bwrap_problem()}")
        self._root = tempfile.mkdtemp(
            prefix=f"br-{safe_run_name(self.spec.run_name)}-{self.spec.prompt_index}-",
            dir=self.options.base_dir,
        )
        os.mkdir(os.path.join(self._root, "tmp"))
        # An absolute cwd is a host path (shared by prompts that name it); a relative one lives in the private dir.
        cwd = os.path.join(self._root, "work", self.spec.cwd or "")
        self.workdir = os.path.abspath(cwd)
        if _protected(self.workdir):
            raise SandboxError(
                f"local sandbox: cwd {self.spec.cwd!r} is a system directory; it would become writable to the "
                "model. Use a project directory, or --sandbox=docker"
            )
        try:
            os.makedirs(self.workdir, exist_ok=True)
        except OSError as exc:
            raise SandboxError(f"local sandbox: cannot create cwd {self.spec.cwd!r}: {exc}") from exc
        if self.isolation == "bwrap":
            os.mkdir(os.path.join(self._root, "ctl"))
            open(os.path.join(self._root, "ctl", "empty"), "wb").close()
            self._server = self._start_server()

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
                # A timeout ended the last server with everything it ran; the next command gets a new one.
                self._server = self._start_server()
            return self._server.run(command, timeout_s=timeout_s, stdin=stdin)

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
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
            prefix = self._bwrap_prefix(fresh_sockets=attempt > 0)  # a masked socket may have gone since
            server = _CommandServer(prefix, ctl=os.path.join(self._root, "ctl"), env=self._env(),
                                    cwd=self.workdir, output_cap_bytes=self.options.output_cap_bytes,
                                    background_dir=os.path.join(self._root, "tmp", BACKGROUND_DIR))  # fmt: skip
            problem = server.wait_ready(SERVER_READY_TIMEOUT_S)
            if problem is None:
                return server
            server.close()
            if not _BWRAP_SETUP_RACE.match(problem):
                break
            time.sleep(0.05 * (attempt + 1))
        raise SandboxError(f"local sandbox: bubblewrap could not start the prompt's shell: {problem}")

    def _bwrap_prefix(self, *, fresh_sockets: bool = False) -> list[str]:
        assert self._root is not None
        prefix = [*BWRAP_BASE]
        # Masks first: a socket under /tmp is then hidden twice, and the binds below need no new mount points.
        # A directory of sockets alone (containerd's, whose sockets come and go with each container)
        # is hidden under an empty tmpfs; elsewhere each socket is covered by /dev/null.
        for d in host_socket_dirs(fresh=fresh_sockets):
            if _is_within(d.path, "/tmp"):
                continue  # the private /tmp below hides the host's
            if d.only_sockets and d.path != "/" and not _is_within(self._root, d.path):
                prefix += ["--tmpfs", d.path]
            else:
                for name in d.names:
                    prefix += ["--ro-bind", "/dev/null", os.path.join(d.path, name)]
        # Order matters: /tmp is mounted before the workdir, which may itself live under /tmp.
        ctl = os.path.join(self._root, "ctl")
        prefix += ["--bind", os.path.join(self._root, "tmp"), "/tmp"]
        prefix += ["--bind", self.workdir, self.workdir, "--ro-bind", ctl, ctl, "--chdir", self.workdir]
        if not self.spec.network:
            prefix.append("--unshare-net")
        return [*prefix, "--"]


# The server, run by bash as PID 2 of the prompt's PID namespace (bwrap is PID 1). Requests come on
# stdin, one line each: "<seq> <token> <stdin: 0|1>"; the command text is in $ctl/<seq>.cmd and its
# stdin, when given, in $ctl/<seq>.in (files: no size limit, no deadlock, any bytes), else the empty
# $ctl/empty (read-only, unlike the namespace's /dev/null, which `rm -rf /` removes). Each command
# runs in a fresh `bash -c` with stdout and stderr on the server's stdout. When it is done, every
# other process in the namespace is killed (so nothing it left behind writes after the marker or
# outlives the call, as with one sandbox per command), then the end marker with the exit code is
# printed. `kill -9 -1` on the host would be a disaster: the PID check makes sure it never runs there.
# Once the process tool has started a background process (its directory exists), the sweep spares
# the sessions it started and the processes marked with BACKGROUND_ENV (children inherit the mark)
# instead of killing everything; zombies are skipped, as they write nothing and PID 1 reaps them.
_SERVER_SCRIPT = r"""
[ "$$" = 2 ] || { echo "batch-runner: the command server is not in its own PID namespace" >&2; exit 97; }
unset SHLVL
ctl=$1 sh=$2 keep_dir=${TMPDIR:-/tmp}/$4 keep_env=$5
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
        # kill(-1) fails once nothing is left to signal: repeat until then, so that a child forked
        # during a round, or killed but not yet gone, is dead and reaped before the marker.
        n=0
        while kill -9 -1 2>/dev/null && [ "$n" -lt 100000 ]; do n=$((n + 1)); done
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

    def __init__(
        self,
        bwrap_prefix: list[str],
        *,
        ctl: str,
        env: dict[str, str],
        cwd: str,
        output_cap_bytes: int,
        background_dir: str | None = None,
    ):
        self.ctl = ctl
        self.output_cap_bytes = output_cap_bytes
        self.background_dir = background_dir  # the process tool's directory, seen from the host
        self._ready = f"[batch-runner-ready:{new_exec_token()}]"
        self._seq = 0
        self.proc = subprocess.Popen(
            [*bwrap_prefix, *self.argv(ctl, self._ready)], cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._out, selectors.EVENT_READ)
        self._eof = False

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
        return None

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
                if chunk is None:  # the deadline: end the namespace, and everything the command started
                    timed_out = True
                    if not self._end_command(scanner):
                        self.kill()
                        self._drain(scanner, time.monotonic() + 1.0)
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
        if not scanner.done:  # the server itself was killed (e.g. by `kill -9 -1` in the command)
            self.kill()
            note = "[the sandbox's shell ended during this command; the next command gets a new one]"
            return ExecResult(output=(output + "\n" + note).lstrip("\n"), exit_code=137, truncated=truncated)
        return ExecResult(output=output, exit_code=scanner.exit_code, truncated=truncated)

    def _end_command(self, scanner: MarkerScanner) -> bool:
        """After a timeout, kill the command's processes but not the process tool's, if any run.

        Ending the whole namespace would end the background processes too. From the host, every
        process of the namespace but PID 1 (bwrap), PID 2 (the server), the sessions the process
        tool started and processes carrying its mark is killed; the server then sweeps and prints
        the end marker as after any command. False (the caller ends the namespace) when no process
        tool directory exists or the marker does not come.
        """
        if not (self.background_dir and os.path.isdir(self.background_dir)):
            return False
        members = _namespace_members(self.proc.pid)
        if not members:
            return False
        keep_sessions = set()
        for entry in os.scandir(self.background_dir):
            try:
                with open(os.path.join(entry.path, "pid")) as f:
                    ns_pid = int(f.read().strip())
            except (OSError, ValueError):
                continue
            keep_sessions.update(h for h, m in members.items() if m.ns_pid == ns_pid)
        mark = "=".join(BACKGROUND_ENV).encode()
        for _ in range(3):  # again for children forked meanwhile
            for host_pid, member in _namespace_members(self.proc.pid).items():
                if member.ns_pid in (1, 2) or member.session in keep_sessions or _has_env(host_pid, mark):
                    continue
                try:
                    os.kill(host_pid, signal.SIGKILL)
                except OSError:
                    pass
        deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
        while not scanner.done:
            chunk = self._read(deadline)
            if not chunk:
                return False
            scanner.feed(chunk)
        return True

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

    def kill(self) -> None:
        kill_process_group(self.proc)  # bwrap (--die-with-parent) takes the whole PID namespace with it
        self.proc.wait()
        self._eof = True

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
        while not self._eof:
            chunk = self._read(until)
            if not chunk:
                return
            scanner.feed(chunk)


@dataclass(frozen=True)
class _Member:
    ns_pid: int  # its pid inside the namespace
    session: int  # its session id, as the host sees it


def _namespace_members(bwrap_pid: int) -> dict[int, _Member]:
    """The processes of the PID namespace that ``bwrap_pid`` (the outer bwrap) made, by host pid."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            init = int(f.read().split()[0])  # the namespace's PID 1, bwrap's only child
        target = os.readlink(f"/proc/{init}/ns/pid")
    except (OSError, ValueError, IndexError):
        return {}
    members = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") != target:
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
