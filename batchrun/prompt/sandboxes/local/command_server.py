"""The command server: one resident shell per prompt, PID 1 of the prompt's namespace, that runs each
command in a fresh shell and kills whatever the command left behind."""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import itertools
import logging
import os
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from batchrun.prompt.sandboxes._process import kill_process_group
from batchrun.prompt.sandboxes._shell import MarkerScanner, new_exec_token
from batchrun.prompt.sandboxes.base import (
    BACKGROUND_DIR,
    BACKGROUND_ENV,
    CappedBuffer,
    ExecResult,
    SandboxError,
    readable,
)
from batchrun.prompt.sandboxes.local import network_hub
from batchrun.prompt.sandboxes.local.direct_files import DirectFiles, openat2, openat2_available
from batchrun.prompt.sandboxes.local.host import blocked_addresses, command_shell, tool_path
from batchrun.prompt.sandboxes.local.netlink import add_unreachable_routes
from batchrun.prompt.sandboxes.local.options import CTL_DIR
from batchrun.prompt.sandboxes.local.process_tree import (
    child_of,
    has_env,
    namespace_members,
    reap_in_background,
    spawn,
    wait_exited,
)
from batchrun.prompt.sandboxes.local.system_view import root_without_ptrace, user_namespace_args

log = logging.getLogger(__name__)
SERVER_READY_TIMEOUT_S = 20.0
SERVER_STOP_TIMEOUT_S = 2.0
NS_GET_USERNS = 0xB701  # ioctl(2) on a namespace: the user namespace that owns it (linux/nsfs.h)
TIMEOUT_KILL_WAIT_S = 5.0  # after a timeout, how long the server gets to report the killed command

# The server, run by sh (dash: a resident shell ~1.2 ms of CPU cheaper to start than bash) as PID 1
# of the prompt's PID namespace. Requests come on stdin, one line each: "<seq> <token> <stdin: 0|1>
# <long: 0|1>"; the command text is in $ctl/<seq>.cmd, followed by one "." (so that no trailing
# newline of it is lost, whichever way it is read), and its stdin, when given, in $ctl/<seq>.in
# (files: no size limit, no deadlock, any bytes), else the empty $ctl/empty (read-only, unlike the
# namespace's /dev/null, which `rm -rf /` removes). dash's `read` takes one system call per byte, so
# a long command is read with one `cat` instead. Each command runs in a fresh `bash -c` with stdout
# and stderr on the server's stdout, in the same environment as under a bash server. When it is
# done, every other process in the namespace is killed (so nothing it left behind writes after the
# marker or outlives the call, as with one sandbox per command), then the end marker with the exit
# code is printed. As PID 1 the server gets no signal from inside the namespace it did not ask for,
# and it reaps the orphans. `kill -9 -1` on the host would be a disaster: the PID check makes sure
# it never runs there. Once the process tool has started a background process (its directory
# exists), the sweep must spare the sessions it started and the processes marked with
# BACKGROUND_ENV (children inherit the mark), reading NUL-separated environments, which only bash
# can: the sh server then becomes the bash one (`exec`, still PID 1: _BASH_SERVER_SCRIPT, handed the
# command's token and exit code in its environment) for the rest of the prompt.
_SERVER_SCRIPT = r"""
[ "$$" = 1 ] || { echo "batch-runner: the command server is not in its own PID namespace" >&2; exit 97; }
unset SHLVL
ctl=$1 sh=$2 keep_dir=${TMPDIR:-/tmp}/$4 bash_server=$6 server_bash=${7:-$2} nl='
'
exec 2>/dev/null
# The first the kernel's OOM killer picks, before the runner (raising it needs no privilege; lowering
# it again does): the commands inherit it. Machine-wide memory pressure ends a prompt, not the run.
echo 1000 > /proc/self/oom_score_adj
printf '%s\n' "$3"
while IFS=' ' read -r seq tok has_in long; do
    if [ "$long" = 1 ]; then
        cmd=$(cat "$ctl/$seq.cmd")
    else
        cmd= line=
        while IFS= read -r line; do cmd=$cmd$line$nl; done < "$ctl/$seq.cmd"
        cmd=$cmd$line
    fi
    cmd=${cmd%.}
    in=$ctl/empty
    [ "$has_in" = 1 ] && in=$ctl/$seq.in
    # In a subshell that becomes bash (no extra process): dash writes its "Killed" note for a
    # command killed at its deadline to its own stderr (/dev/null), not into the command's 2>&1.
    (exec "$sh" -c "$cmd" < "$in" 2>&1)
    rc=$?
    # The token in its environment, not its arguments: anyone may read /proc/1/cmdline (a process the
    # command left could print the marker before the sweep), no command the server's own environment.
    [ -d "$keep_dir" ] && br_tok=$tok br_rc=$rc exec "$server_bash" --noprofile --norc -c "$bash_server" br-server "$1" "$2" "" "$4" "$5"
    # Repeat until every other process is a zombie, so that a child forked during a round, or
    # killed but not yet gone, is dead before the marker. Zombies (orphans now ours) also answer
    # kill(-1) until the shell reaps them, so they do not count; builtins only: a fork would count.
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
    printf '\n[batch-runner-exit:%s]=%s\n' "$tok" "$rc"
done
"""
LONG_COMMAND_BYTES = 1024  # from here on the sh server reads a command with `cat` (~1 ms), not `read`

# The bash server the sh server becomes once the process tool has been used (see above); given a
# token and an exit code (br_tok, br_rc in its environment), it first finishes that command (the sweep,
# the marker).
_BASH_SERVER_SCRIPT = r"""
unset SHLVL
ctl=$1 sh=$2 keep_dir=${TMPDIR:-/tmp}/$4 keep_env=$5
exec 2>/dev/null  # not bash's "Killed" notes for a command killed at its deadline
[ -z "$3" ] || printf '%s\n' "$3"
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
    for f in "$keep_dir"/p*/pid; do { [ -f "$f" ] && read -r x < "$f" && sessions[$x]=1; } 2>/dev/null; done  # no FIFO
    for ((round = 0; round < 1000; round++)); do
        left=0 unsure=0
        for p in /proc/[0-9]*; do
            p=${p#/proc/}
            case $p in 1 | $$) continue ;; esac
            { IFS= read -r st < "/proc/$p/stat"; } 2>/dev/null || continue  # gone meanwhile
            set -- ${st##*) }  # state ppid pgrp session ... num_threads (${18})
            [ "$1" = Z ] && [ "${18}" -le 1 ] && continue  # Z with threads: only its first has exited
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
tok=${br_tok-} rc=${br_rc-}
unset br_tok br_rc  # not in the commands' environment
[ -z "$tok" ] || { sweep; printf '\n[batch-runner-exit:%s]=%s\n' "$tok" "$rc"; }
while IFS=' ' read -r seq tok has_in long; do
    cmd=
    IFS= read -r -d '' cmd < "$ctl/$seq.cmd"
    cmd=${cmd%.}
    in=$ctl/empty
    [ "$has_in" = 1 ] && in=$ctl/$seq.in
    "$sh" -c "$cmd" < "$in" 2>&1
    rc=$?
    sweep
    printf '\n[batch-runner-exit:%s]=%s\n' "$tok" "$rc"
done
"""


@functools.cache
def _server_shell() -> str:
    """The command server's shell: sh (the PID 1 of each namespace), bash where there is no sh."""
    return shutil.which("sh") or command_shell()


# The command server holds each command's token, the secret of its end marker: a process that could
# read the server's memory (/proc/1/mem) or reopen its pipes (/proc/1/fd) could print the marker with
# an exit code of its choosing, and a hidden test that runs the agent's code would pass. Linux lets a
# process of the same user do both unless the target is non-dumpable, which a shell cannot ask for;
# but a program that its own user may not read runs non-dumpable (execve). So the server runs from
# copies of sh and bash that no one may read, only execute (mode 0111), hard-linked into each
# prompt's control directory. The runner keeps its own access to the server (its /proc/<pid>/root and
# namespaces) as long as it holds CAP_SYS_PTRACE over the server's user namespace: as the owner of
# unprivileged bubblewrap's namespace, as root with that capability, or as root without it (in a
# container) as the owner of a user namespace made for the sandbox (system_view.user_namespace_args).
# Elsewhere (no such namespace, or a setuid bubblewrap) the server runs from the shells themselves.
SERVER_SHELL_NAMES = ("sh", "bash")  # the copies' names, in the control directory


def can_reach_non_dumpable() -> bool:
    """Whether the runner can reach a non-dumpable command server (see above): else any command
    could take the server over, and judging in this sandbox cannot be trusted."""
    if os.geteuid() != 0:
        try:
            return not os.stat(tool_path("bwrap")).st_mode & 0o4000  # setuid bwrap owns the namespace
        except (OSError, RuntimeError):
            return False
    return not root_without_ptrace() or bool(user_namespace_args())  # the namespace's owner (see there)


_shell_copies: dict[str, str | None] = {}
_shell_copies_lock = threading.Lock()


def server_shells(directory: str) -> str | None:
    """A directory under ``directory`` with the execute-only copies of sh and bash (see above), made
    once per process and directory; None where the runner could not reach such a server, or the copy
    failed. The name matches the sandboxes' own (``br@<pid>-``), so a sweep removes it with them."""
    with _shell_copies_lock:
        if directory in _shell_copies:
            return _shell_copies[directory]
        made = None
        if can_reach_non_dumpable():
            try:
                made = tempfile.mkdtemp(prefix=f"br@{os.getpid()}-shells-", dir=directory)
                for name, source in zip(SERVER_SHELL_NAMES, (_server_shell(), command_shell()), strict=True):
                    target = os.path.join(made, name)
                    shutil.copyfile(source, target)
                    os.chmod(target, 0o111)
            except OSError as exc:
                log.warning("the command servers run from readable shells (%s): %s", directory, exc)
                if made is not None:
                    shutil.rmtree(made, ignore_errors=True)
                made = None
        _shell_copies[directory] = made
        return made


_MAX_BACKGROUND_ENTRIES = 1000  # the process tool starts no more (tools.terminal._MAX_PROCESSES)


def _small_int(dir_fd: int, path: str, confined: bool) -> int | None:
    """The number in a small regular file of the sandbox's (``path`` under ``dir_fd``), or None;
    never blocks (a FIFO, a device) nor, when ``confined``, leaves the directory."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY
    try:
        fd = openat2(dir_fd, path, flags) if confined else os.open(path, flags | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return int(os.read(fd, 64).strip()) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class CommandServer:
    """One prompt's bubblewrap namespace with a shell that runs its commands one by one."""

    @staticmethod
    def argv(ctl: str, ready: str, own_shells: bool = False) -> list[str]:
        """The server's own command line (after bwrap's): it prints ``ready`` once it reads requests.
        ``own_shells``: ``ctl`` holds the execute-only shells (:func:`server_shells`) it runs from."""
        keep_env = "=".join(BACKGROUND_ENV)
        shell, bash = (
            (os.path.join(ctl, "sh"), os.path.join(ctl, "bash")) if own_shells else (_server_shell(), "")
        )
        lead: list[str] = []
        if own_shells and os.geteuid() != 0:
            # Non-dumpable, its /proc files are root's, out of its own reach: the OOM score first.
            lead = [_server_shell(), "-c", 'echo 1000 > /proc/self/oom_score_adj; exec "$@"', "br-oom"]
        return [
            *lead, shell, "-c", _SERVER_SCRIPT, "br-server", ctl, command_shell(), ready, BACKGROUND_DIR, keep_env,
            _BASH_SERVER_SCRIPT, bash,
        ]  # fmt: skip

    def __init__(
        self,
        launch: list[str],
        *,
        ctl: str,
        env: dict[str, str],
        output_cap_bytes: int,
        own_shells: bool = False,
        pass_fds: tuple[int, ...] = (),
    ):
        self.ctl = ctl
        self.output_cap_bytes = output_cap_bytes
        self._ready = f"[batch-runner-ready:{new_exec_token()}]"
        self._seq = 0
        self._pid: int | None = None  # the server's host PID (bwrap's child)
        self.files: DirectFiles | None = None  # the namespace's own mounts seen from here, once it is ready
        self._slirp: subprocess.Popen | None = None  # the namespace's user-mode network, if any
        self._slirp_exit: int | None = None  # closing this pipe end ends slirp4netns (so does our death)
        self.address: str | None = None  # the namespace's address on its link into the worker's hub, if any
        self.proc = spawn(
            [*launch, *self.argv(CTL_DIR, self._ready, own_shells)], cwd="/", env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds,
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
        self._pid = child_of(self.proc.pid)
        return None if self._pid else "bubblewrap's child process was not found"

    def connect_network(self) -> None:
        """Give the namespace the outside world through slirp4netns, but not the host's services.

        ``--disable-host-loopback``: the gateway does not lead to the host's 127.0.0.1; the host's
        other addresses are made unreachable below. slirp4netns ends when the write end of its
        exit pipe closes: at ``close``, or when this process dies, however it dies.
        """
        owner = self._network_owner()
        if owner is None and network_hub.ENABLED:  # root: a link into the worker's one slirp4netns
            hub = network_hub.hub()
            if hub is not None:
                try:
                    self.address = hub.attach(f"/proc/{self._pid}/ns/net", blocked_addresses())
                except OSError as exc:
                    raise SandboxError(
                        f"local sandbox: cannot connect the sandbox to the worker's network: {exc}"
                    ) from exc
                return
        exit_r, self._slirp_exit = os.pipe()
        ready_r, ready_w = os.pipe()
        argv = [tool_path("slirp4netns"), "--configure", "--mtu=65520", "--disable-host-loopback", "--enable-sandbox",
                f"--exit-fd={exit_r}", f"--ready-fd={ready_w}", str(self._pid), "tap0"]  # fmt: skip
        if owner is not None:
            argv[-2:-2] = [f"--userns-path=/proc/self/fd/{owner}"]  # unprivileged bwrap's own (see there)
            # Its mount-namespace sandbox needs it to be root where it starts, which an unprivileged
            # user is not (bwrap maps the user to itself): a syscall filter instead, as this user.
            argv[argv.index("--enable-sandbox")] = "--enable-seccomp"
        log = os.path.join(os.path.dirname(self.ctl), "slirp4netns.log")  # outside the sandbox's view
        passed = (exit_r, ready_w) if owner is None else (exit_r, ready_w, owner)
        try:
            with open(log, "wb") as err:
                # Nothing of the runner's environment (API keys) in a process that parses the
                # sandbox's packets.
                self._slirp = subprocess.Popen(
                    argv, pass_fds=passed, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                    start_new_session=True, env={"PATH": os.environ.get("PATH", os.defpath)},
                )  # fmt: skip
        except OSError as exc:
            if owner is not None:
                os.close(owner)
            raise SandboxError(f"local sandbox: slirp4netns could not be started: {exc}") from exc
        finally:
            os.close(exit_r)
            os.close(ready_w)
        try:
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
            self._block_host_addresses(owner)
        finally:
            if owner is not None:
                os.close(owner)

    def _network_owner(self) -> int | None:
        """A descriptor of the user namespace that owns the sandbox's network namespace, when it is not
        this process's (unprivileged bubblewrap), for slirp4netns and nsenter to enter before the
        network namespace; None when this process may enter it as it is (root). Not the command
        server's own user namespace: unprivileged bubblewrap nests a second one inside the first,
        and only the first, which made the network namespace, lets a process join it."""
        net = os.open(f"/proc/{self._pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            owner = fcntl.ioctl(net, NS_GET_USERNS)
        finally:
            os.close(net)
        theirs, ours = os.fstat(owner), os.stat("/proc/self/ns/user")
        if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
            os.close(owner)
            return None
        return owner

    def _block_host_addresses(self, owner: int | None) -> None:
        """Through slirp4netns, the host's other addresses (a bridge's, say) would reach services that
        listen on all interfaces, a model server included, and the link-local range a cloud's metadata
        service (``host.NEVER_REACHED``): make them unreachable inside. The
        namespace's own copy of the host's address stays local (the local table comes first).
        ``owner``: the descriptor :meth:`_network_owner` gave (the caller closes it)."""
        blocked = blocked_addresses()
        if owner is None:  # this process may enter the namespace (as root): no nsenter and ip processes
            try:
                add_unreachable_routes(f"/proc/{self._pid}/ns/net", blocked)
                return
            except OSError:
                pass  # the usual way, below, says what is wrong if it fails too
        script = "".join(f"route add unreachable {ipaddress.ip_network(a)}\n" for a in blocked)
        argv = [tool_path("nsenter"), f"--net=/proc/{self._pid}/ns/net", tool_path("ip"), "-batch", "-"]
        if owner is not None:
            argv[1:1] = [f"--user=/proc/self/fd/{owner}", "--preserve-credentials"]
        try:
            done = subprocess.run(
                argv,
                input=script.encode(),
                capture_output=True,
                timeout=20,
                pass_fds=() if owner is None else (owner,),
            )
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
        # What bash itself would read of it: up to the first NUL (see _SERVER_SCRIPT for the ".").
        text = command.partition("\0")[0].encode("utf-8", "surrogateescape") + b"."
        with open(cmd_file, "wb") as f:
            f.write(text)
        if stdin is not None:
            with open(in_file, "wb") as f:
                f.write(stdin)
        buf = CappedBuffer(self.output_cap_bytes)
        scanner = MarkerScanner(token, buf)
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            long = int(len(text) > LONG_COMMAND_BYTES)
            self.proc.stdin.write(f"{seq} {token} {int(stdin is not None)} {long}\n".encode())
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
            for host_pid, member in namespace_members(ns).items():
                if host_pid == self._pid:
                    continue
                if keep_sessions is not None and (member.session in keep_sessions or has_env(host_pid, mark)):
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
        """Host session ids of what the process tool started, or None when it was never used here.

        The directory is in the sandbox's /tmp, where its commands may have put anything: a FIFO
        named ``pid`` blocked this process's open() for good, a symlink led to the host's files.
        So each file is looked up inside the sandbox's root where openat2 exists, opened without
        blocking or following a last symlink, and read only when it is a small regular file."""
        where = f"/proc/{self._pid}/root/tmp/{BACKGROUND_DIR}"  # the sandbox's own /tmp, seen from the host
        confined = openat2_available()
        try:
            if confined:
                root = os.open(f"/proc/{self._pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    dir_fd = openat2(root, f"/tmp/{BACKGROUND_DIR}", os.O_RDONLY | os.O_DIRECTORY)
                finally:
                    os.close(root)
            else:
                dir_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        started = set()
        try:
            with os.scandir(dir_fd) as entries:
                for entry in itertools.islice(entries, _MAX_BACKGROUND_ENTRIES):
                    pid = _small_int(dir_fd, f"{entry.name}/pid", confined)
                    if pid is not None:
                        started.add(pid)
        except OSError:
            pass
        finally:
            os.close(dir_fd)
        return {m.session for m in namespace_members(ns).values() if m.ns_pid in started}

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
        if not wait_exited(self.proc, SERVER_STOP_TIMEOUT_S):
            self.kill()
        self._sel.close()
        self.proc.stdout.close()
        self._end_network(wait=False)  # its namespace has ended: nothing of the prompt can use it now
        if self.files is not None:
            self.files.close()

    def kill(self) -> None:
        kill_process_group(self.proc)  # bwrap (--die-with-parent) takes the whole PID namespace with it
        self.proc.wait()
        self._eof = True

    def _end_network(self, wait: bool = True) -> None:
        """Close slirp4netns's exit pipe, so it ends; SIGKILL it if it has not within a second.
        ``wait=False``: its end is waited for (and enforced) on the reaper thread, not here."""
        exit_w, self._slirp_exit = self._slirp_exit, None
        if exit_w is not None:
            os.close(exit_w)
        slirp, self._slirp = self._slirp, None
        if slirp is not None and not wait:
            reap_in_background(slirp, 1.0)
        elif slirp is not None and not wait_exited(slirp, 1.0):
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
