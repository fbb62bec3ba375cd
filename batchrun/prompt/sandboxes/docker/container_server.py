"""The command server inside a container: a POSIX ``sh`` that runs one prompt's commands, no ``docker exec``.

Images may be minimal (busybox, no Python), so the server is ``sh`` itself, with ``cat`` and, where
the image has it, ``setsid``. The container's entrypoint (``BOOT_SCRIPT``) is, in effect::

    sleep <lifetime> &
    { cat; kill -9 <boot shell>; } | { sh -s; kill -9 <boot shell>; } &
    wait <the sleep>; kill -9 <boot shell>

``cat`` relays the container's stdin, which the runner holds through an attach stream, to a shell
that reads its script from the pipe. When the runner's stream ends (the runner stopped the
sandbox, or died, even by SIGKILL: the kernel closes its socket), ``cat`` sees EOF at once, even in
the middle of a command, and kills the boot shell, docker-init's only child: docker-init (PID 1)
exits, the kernel kills every other process of the container, and it removes itself. Should the
server shell die (the OOM killer, a command's ``kill -9``), the same happens from the other side,
and once the sleep that bounds the lifetime ends, from the boot shell itself. Outside a PID namespace of its own, nothing here signals more than
the boot shell.

The protocol is shell code on the container's stdin and a marker on its stdout (attached, no log
driver: nothing reaches the host's disk). The runner first sends ``SERVER_PRELUDE``, which defines
``__br_run`` and prints a ready line; then, per command, one line (``request``)::

    __br_run <token> <tag> '<command>' ['<stdin as a printf format>']

The server first acknowledges it, a line ``[batch-runner-run:<token>]`` (``Ack``),
before the command starts: a container that ends with no acknowledgement never ran the command,
and only then may the runner send it to a fresh container (a container that ended during its
first command, ``kill -9 -1``, would otherwise run it twice).
The command runs in ``sh -c`` with stdout and stderr on the container's stdout, in a session of its
own (``setsid``), with ``BATCH_RUNNER_EXEC=<tag>`` in its environment (a timeout kills what
carries it, through one exec; the tag is derived from the token, never the token itself, which
would let the command print the marker with a made-up exit code). Its stdin is the bytes given, through a pipe, or an empty pipe.
When its shell exits, what is left of its process group is killed (as the local sandbox ends a
command's leftovers), but for what the ``process`` tool started; then
``\\n[batch-runner-exit:<token>]=<exit code>\\n`` is printed. Between commands the server runs
shell builtins only (the sweep forks only when leftovers exist), so a command that deleted the
container's files (``rm -rf /``) still gets its answer.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from typing import Any

from batchrun.prompt.sandboxes._shell import EXEC_TAG_VAR, MarkerScanner, exec_tag, sh_c
from batchrun.prompt.sandboxes.base import BACKGROUND_ENV, RESTORE_DEV, CappedBuffer, readable

READY_LINE = "[batch-runner-ready]"

# Where the runner's own tools are bind-mounted, read-only, into every container, where this machine has
# them (DockerSandbox.prepare_run, trusted_tools): a static busybox (its basename must begin with
# "busybox" for it to take its applet from argv[1]) and the engine's docker-init. Mount points directly
# under / that no process in the container can remove, rename, write or mount over (EBUSY, EROFS; no
# CAP_SYS_ADMIN): what judging runs from them (FREEZE_SCRIPT, REAPED_SCRIPT, THAW_AT_EOF_SCRIPT, the kill
# of a timed-out command, the hidden files' writes, the end-marker wrapper) is not the image's sh or
# tools, which root in the container may have replaced (a fake /sbin/docker-init or /bin/sh that exits
# 0: the agent's processes never ended, the hidden files never written, the verify "passed").
TRUSTED_BUSYBOX = "/busybox.batch-runner"
TRUSTED_INIT = "/docker-init.batch-runner"

# $1: the lifetime in seconds. The boot shell is docker-init's only child: when it dies, docker-init
# exits, and with the namespace's PID 1 gone the kernel kills every process of the container. So
# killing the boot shell ends the container, and outside one it ends nothing but the boot shell.
# Without docker-init (the init option off) the boot shell is PID 1, which nothing inside may kill:
# it ends every other process of its own PID namespace instead, then the script ends. Without cat
# (images with sh and little else) the server reads the stream itself: the container then ends at
# EOF once the command in progress is done.
# The sleep that bounds the lifetime is the boot shell's own child, forked before the server's
# pipeline (in the background, it gets the container's stdin through fd 3: a background list's stdin
# is /dev/null), so it runs when the server lists the base processes. A subshell's sleep,
# `(sleep; kill) &`, was forked once that subshell ran: on a busy machine after the listing (3 starts
# in 100 with 0.01 CPU), and the runner killed it as the agent's before judging, and its subshell
# killed the boot shell: the prompt failed, "container ... is gone: 409 ... is not running".
BOOT_SCRIPT = """exec 2>&1
if [ "$$" = 1 ]; then end='kill -9 -1'; else end="kill -9 $$"; fi
sleep "$1" </dev/null >/dev/null 2>&1 &
sleeper=$!
exec 3<&0
if command -v cat >/dev/null 2>&1; then
    { cat; $end; } <&3 3<&- | { sh -s; $end; } 3<&- &
else
    { sh -s; $end; } <&3 3<&- &
fi
exec 3<&-
wait "$sleeper"
$end
"""

SERVER_PRELUDE = f"""__br_s=
command -v setsid >/dev/null 2>&1 && __br_s=setsid
__br_keep='{"=".join(BACKGROUND_ENV)}' __br_nl='
'
__br_run() {{
    printf '[batch-runner-run:%s]\\n' "$1"
    if [ "$#" -gt 3 ]; then
        printf "$4" | {EXEC_TAG_VAR}=$2 $__br_s sh -c "$3" &
    else
        {EXEC_TAG_VAR}=$2 $__br_s sh -c "$3" <<'__BR_EMPTY__' &
__BR_EMPTY__
    fi
    __br_p=$!
    wait "$__br_p"
    __br_rc=$?
    [ -z "$__br_s" ] || __br_sweep "$__br_p"
    printf '\\n[batch-runner-exit:%s]=%s\\n' "$1" "$__br_rc"
}}
# What is left of the command's process group, but what the process tool started (marked in its
# environment from its fork on, before it makes a session of its own); ten rounds catch forks and execs.
__br_sweep() {{
    __br_g=$1
    for __br_round in 1 2 3 4 5 6 7 8 9 10; do
        kill -0 "-$__br_g" 2>/dev/null || return 0
        for __br_f in /proc/[0-9]*/stat; do
            {{ read -r __br_l < "$__br_f"; }} 2>/dev/null || continue
            set -- ${{__br_l##*) }}
            # A zombie is dead already, but not one whose other threads run on (${{18}}: num_threads).
            [ "$3" = "$__br_g" ] && {{ [ "$1" != Z ] || [ "${{18}}" -gt 1 ]; }} || continue
            __br_f=${{__br_f%/stat}}
            # One read decides: read twice, a marked process whose exec ended between the reads
            # looked unmarked the first time and not empty the second, and was killed. The braces:
            # a process gone since its stat was read fails the redirection itself, whose message
            # (the shell's, not tr's) went into the command's output before the stderr was moved.
            __br_e=$({{ tr '\\0' '\\n' < "$__br_f/environ"; }} 2>/dev/null)
            case "$__br_nl$__br_e$__br_nl" in *"$__br_nl$__br_keep$__br_nl"*) continue ;; esac
            # An environment that reads empty is a process in the middle of an exec (the process
            # tool's setsid, say): looked at again next round, killed only in the last one.
            [ "$__br_round" -lt 10 ] && [ -z "$__br_e" ] && continue
            kill -9 "${{__br_f#/proc/}}" 2>/dev/null
        done
    done
}}
# The image's /bin/sh as it is now, before the agent's first command, where the runner's busybox is
# mounted (see TRUSTED_BUSYBOX, _shell.RUN_IN_IMAGE_SH): judged commands run in it only while it is unchanged.
__br_f=
[ -x {TRUSTED_BUSYBOX} ] && __br_f=$({TRUSTED_BUSYBOX} sha256sum /bin/sh 2>/dev/null)
printf '[batch-runner-sh]%s\\n' "$__br_f"
# What runs here now (docker-init, the boot shell, cat, the sleeper, this server) is all the
# container has before the agent's first command: the runner stops these, and kills everything else,
# before a sample is judged (DockerSandbox.end_processes, FREEZE_SCRIPT). First on the line: this server.
__br_base=
for __br_f in /proc/[0-9]*; do __br_base="$__br_base ${{__br_f#/proc/}}"; done
printf '[batch-runner-base]%s:%s\\n' "$$" "$__br_base"
printf '%s\\n' '{READY_LINE}'
""".encode()
BASE_LINE = re.compile(rb"\[batch-runner-base\]([0-9]+):((?: [0-9]+)*)\n")
SH_SUM_LINE = re.compile(rb"\[batch-runner-sh\]([^\n]*)\n")

# Before a sample is judged (DockerSandbox.end_processes), $@: the base processes above. A command
# running as root may have taken over any of them (ptrace, or /proc/<pid>/mem: same user, no Yama,
# Docker's seccomp allows both), docker-init and the boot shell as well as this server, and its code
# would then rewrite the hidden files while they are judged. So none of them may run while a sample
# is judged: every one is stopped (SIGSTOP; PID 1, which nothing inside may stop, by the runner from
# the host) and everything else is killed, round after round, until a round finds nothing alive but
# stopped base processes (each thread stopped, or dead) and this script with its ancestors: a
# process of the agent still alive may continue one, or a taken-over one may fork, before it is
# killed. A base pid the agent got reused is stopped, not killed: harmless either way. Exit 3: all is
# done but PID 1 runs (a process of the agent continued it before it died): the runner stops it
# again and runs this once more. Exit 4: all is done, but PID 1 has zombie children to reap (what
# was killed here had been orphaned to it): the runner continues PID 1 until they are reaped, then
# stops it and runs this once more. Builtins only, as END_PROCESSES_SCRIPT; once nothing else is
# alive, /dev is put back as it was (base.RESTORE_DEV: root in the container may have replaced /dev/fd).
# Whether PID 1 has zombie children (status 0): what was killed here, orphaned to it. A function of its
# own (its `set --` leaves the script's arguments alone), for FREEZE_SCRIPT and REAPED_SCRIPT.
INIT_HAS_ZOMBIES = r"""init_has_zombies() {
    for f in /proc/[0-9]*/stat; do
        { IFS= read -r line < "$f"; } 2>/dev/null || continue
        set -- ${line##*) }
        [ "$1" = Z ] && [ "$2" = 1 ] && return 0
    done
    return 1
}
"""
FREEZE_SCRIPT = (
    INIT_HAS_ZOMBIES
    + RESTORE_DEV
    + r"""
spared=" $* " mine=" $$ " p=$$
while [ "$p" -gt 1 ] 2>/dev/null; do
    IFS= read -r line < "/proc/$p/stat" || break
    set -- ${line##*) }
    p=$2 mine="$mine$2 "
done
n=0
while [ "$n" -lt 200 ]; do
    n=$((n + 1)) busy= init=
    for f in /proc/[0-9]*/stat; do
        pid=${f#/proc/} pid=${pid%/stat}
        case "$mine$spared" in *" $pid "*) continue ;; esac
        { IFS= read -r line < "$f"; } 2>/dev/null || continue
        set -- ${line##*) }
        [ "$1" = Z ] && [ "${18}" -le 1 ] 2>/dev/null && continue
        kill -9 "$pid" 2>/dev/null
        busy=1
    done
    for pid in $spared; do
        case $mine in *" $pid "*) continue ;; esac
        for f in /proc/"$pid"/task/[0-9]*/stat; do
            { IFS= read -r line < "$f"; } 2>/dev/null || continue
            set -- ${line##*) }
            case $1 in T | Z | X) continue ;; esac
            if [ "$pid" = 1 ]; then init=1; else busy=1; kill -STOP "$pid" 2>/dev/null; fi
            break
        done
    done
    [ -n "$busy$init" ] && continue
    restore_dev || exit 1
    init_has_zombies && exit 4
    exit 0
done
[ -z "$busy" ] && echo "batch-runner: PID 1 runs again" && exit 3
echo "batch-runner: processes left by the agent were still alive after $n rounds"
exit 1
"""
)

INIT_RUNS = 3  # FREEZE_SCRIPT's exit code when only PID 1 is not stopped
INIT_ZOMBIES = 4  # FREEZE_SCRIPT's exit code when all is done but PID 1 has zombie children

# While PID 1 is continued for a moment (FREEZE_SCRIPT's exit 4): wait until it has reaped its zombie
# children, at most $1 rounds (~1 ms each); builtins only (no fork while the pids limit may be full).
# The processes the agent left were killed, but their zombies, orphaned to a stopped PID 1, held
# their pids while the sample was judged: 400 left by the agent made a verify's fork fail.
REAPED_SCRIPT = (
    INIT_HAS_ZOMBIES
    + r"""n=0 rounds=$1
while [ "$n" -lt "$rounds" ]; do
    n=$((n + 1))
    init_has_zombies || exit 0
done
exit 1
"""
)

# The first process of a judged exec ($@: the command's argv), with docker-init on: the engine's own
# docker-init (tini) as a child subreaper (-s), which reaps what the command orphans. Else the orphans
# go to PID 1, which is stopped while a sample is judged: their zombies stayed until the pids limit was
# full (300 orphans of one verify command made 300 zombies: the next one could not fork), and a test
# that waits for a daemon it stopped to be gone (`kill -0`) saw it alive until it gave up. From the
# runner's read-only mount (TRUSTED_INIT) where it has one; else the engine's mount at this path, which
# root in the container can replace (/sbin a link in a merged-/usr image: removed, made a directory,
# a fake docker-init that exits 0 put in it), and without the file (another engine), the command as before.
SUBREAPER = "/sbin/docker-init"
SUBREAPED_SCRIPT = f'[ -x {SUBREAPER} ] && exec {SUBREAPER} -s -- "$@"; exec "$@"'


def subreaped_argv(argv: list[str], *, init: str = "", busybox: str = "") -> list[str]:
    """``argv`` run under the engine's docker-init as a child subreaper: ``init`` (a path the agent
    cannot replace) where given, else the container's /sbin/docker-init where it has one, looked for
    by ``busybox``'s sh where given."""
    if init:
        return [init, "-s", "--", *argv]
    return [*sh_c(SUBREAPED_SCRIPT, busybox), "sh", *argv]


# The runner's hold on stopped base processes while a sample is judged ($@: their pids), started
# once FREEZE_SCRIPT found nothing else alive (so no process of the agent ever saw it): it reads
# its stdin, the runner's exec stream, and at its end continues them all, PID 1 included (SIGCONT
# reaches a namespace's init from inside). The runner ends the stream when judging is done; the
# kernel does when the runner dies, even by SIGKILL: the container's cat then reads the end of its
# own stream and the container ends itself, as it does when nothing is stopped.
THAW_AT_EOF_SCRIPT = r"""while read -r _; do :; done
for pid in "$@"; do kill -CONT "$pid" 2>/dev/null; done
exit 0
"""


def sh_quote(data: bytes) -> bytes:
    """``data`` as one single-quoted shell word: any byte but NUL stands for itself there."""
    return b"'" + data.replace(b"'", b"'\\''") + b"'"


def printf_format(data: bytes) -> bytes:
    """A printf format that prints exactly ``data``: only backslash, percent and NUL need escaping."""
    out = data.replace(b"\\", b"\\\\").replace(b"%", b"%%").replace(b"\0", b"\\000")
    return b"\\055" + out[1:] if out.startswith(b"-") else out  # never read as an option


def request(token: str, command: str, stdin: bytes | None) -> bytes:
    """The line that runs ``command`` (no NUL in it: no shell can run one) with ``stdin``."""
    words = [
        b"__br_run",
        token.encode(),
        exec_tag(token).encode(),  # in the command's environment; the token never is (see exec_tag)
        sh_quote(command.encode("utf-8", errors="surrogateescape")),
    ]
    if stdin is not None:
        words.append(sh_quote(printf_format(stdin)))
    return b" ".join(words) + b"\n"


class Ack:
    """Finds the server's acknowledgement of a request (``[batch-runner-run:<token>]``) in its output.

    What comes before it is not the command's (output of a process an earlier command left in a
    session of its own, between commands) and is dropped, as ``Channel.discard_stray`` drops it.
    """

    def __init__(self, token: str):
        self.line = f"[batch-runner-run:{token}]\n".encode()
        self.seen = False
        self._held = b""  # the last bytes, which may begin the acknowledgement

    def after(self, data: bytes) -> bytes:
        """What of ``data`` follows the acknowledgement (all of it once that was seen)."""
        if self.seen:
            return data
        data = self._held + data
        at = data.find(self.line)
        if at < 0:
            self._held = data[-(len(self.line) - 1) :]
            return b""
        self.seen, self._held = True, b""
        return data[at + len(self.line) :]


class Channel:
    """The runner's end of a container's attach stream: requests in, demultiplexed output out.

    The engine frames what the container writes (8-byte headers: stream, 0, 0, 0, size); a frame
    may arrive in pieces, so what is left of one stays for the next read.
    """

    def __init__(self, stream: object):
        self.stream = stream  # kept: it holds the HTTP response whose collection would close the socket
        self.sock: socket.socket = getattr(stream, "_sock", stream)
        self.eof = False
        self._pending = bytearray()

    def send(self, data: bytes, deadline: float) -> None:
        """Send all of ``data`` before ``deadline``; ``OSError`` (``TimeoutError``) if it cannot."""
        self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            self.sock.sendall(data)
        finally:
            self.sock.settimeout(None)

    def discard_stray(self) -> None:
        """Drop what arrived between commands (output of a process a command left in its own session)."""
        while not self.eof and self._readable(0):
            self._recv()
        self._pending.clear()

    def read_until(self, feed: Callable[[bytes], bool], deadline: float) -> str:
        """Pass output to ``feed`` until it returns True ("done"), the stream ends ("eof") or the deadline ("timeout")."""
        while True:
            while len(self._pending) >= 8:
                size = int.from_bytes(self._pending[4:8], "big")
                if len(self._pending) < 8 + size:
                    break
                payload = bytes(self._pending[8 : 8 + size])
                del self._pending[: 8 + size]
                if feed(payload):
                    return "done"
            if self.eof:
                return "eof"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            if self._readable(remaining):
                self._recv()

    def _readable(self, timeout_s: float) -> bool:
        try:
            return readable(self.sock, timeout_s)
        except (OSError, ValueError):  # closed under us (a stop from another thread): the end
            self.eof = True
            return False

    def _recv(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except OSError:
            chunk = b""
        if chunk:
            self._pending += chunk
        else:
            self.eof = True

    def close(self) -> None:
        close_stream(self.stream)


def close_stream(stream: Any) -> None:
    """Close an exec or attach stream: its connection ends, whatever else still refers to its socket."""
    sock: socket.socket = getattr(stream, "_sock", stream)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
    stream.close()


class Scanner(MarkerScanner):
    """A marker scanner whose output can be closed before the marker comes (a timeout)."""

    def close_output(self) -> tuple[str, bool]:
        """The output so far, and from now on look for the marker only (what follows is not kept).

        Of the bytes held back, only those that may begin the marker stay held; a lone newline is
        output (the server prints the marker with one write, so it does not arrive cut after its
        first byte).
        """
        if self._after is None:
            held = self._held
            keep = next((k for k in range(min(len(held), len(self.marker)), 1, -1)
                         if held.endswith(self.marker[:k])), 0)  # fmt: skip
            self.buf.feed(held[: len(held) - keep])
            self._held = held[len(held) - keep :]
        result = self.buf.result()
        self.buf = CappedBuffer(0)
        return result
