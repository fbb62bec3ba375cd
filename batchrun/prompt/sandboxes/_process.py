"""Host processes: run one with stdin, a deadline and an output cap (the local and singularity backends), run a
short probe so that nothing it starts outlives this process, and read the processes of a cgroup (the local and
Docker backends, to end what is left in one)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from batchrun.prompt.sandboxes.base import CappedBuffer, ExecResult

POLL_INTERVAL_S = 0.05  # how often a running command is checked for having exited
EXIT_GRACE_S = 0.1  # after the command exits, how long output from children that hold its pipe is still read
KILL_DRAIN_S = 1.0  # after a timeout kill, how long to collect what is left in the pipe


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group the command leads (it was started in a new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# The watcher of ``watched``: the only parent its command ever has. It becomes a subreaper (whatever the
# command leaves orphaned is reparented to it, not to init) and takes SIGTERM when this process dies
# (PR_SET_PDEATHSIG; a runner already gone by then is seen through getppid). On that signal it passes
# SIGTERM on to the command and gives it the grace period (argv[2] seconds; 0 for none) to exit; then, or
# once the command exits, it kills every process it still has and reaps them, and exits as the command did.
# Standard library only, run with -I -S: about 20 ms of CPU more than the command alone (bubblewrap's
# probe: 27-31 ms against 8-9 here), once per probe and process, never at a prompt's sandbox start.
_WATCHER = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
ends = {signal.SIGTERM, signal.SIGCHLD}
signal.pthread_sigmask(signal.SIG_BLOCK, ends)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
grace = float(sys.argv[2])
status = None
def reap(pid, code):
    global status
    if pid == child:
        status = os.waitstatus_to_exitcode(code)
def end_all():
    me = str(os.getpid())
    while True:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/children") as f:
                    kids = f.read().split()
            except OSError:
                kids = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == me]
            for kid in kids:
                try:
                    os.kill(int(kid), signal.SIGKILL)
                except OSError:
                    pass
        try:
            reap(*os.waitpid(-1, 0))
        except ChildProcessError:
            return
def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None
try:
    child = os.posix_spawnp(
        sys.argv[3], sys.argv[3:], os.environ, setsigmask=(), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ)
    )
except OSError as exc:
    sys.stderr.write(f"{sys.argv[3]}: {exc}\n")
    os._exit(127)
deadline = None
while status is None:
    if deadline is None:
        got = signal.sigwait(ends)
    else:
        info = signal.sigtimedwait(ends, max(deadline - time.monotonic(), 0))
        if info is None:
            break
        got = info.si_signo
    if got == signal.SIGTERM and deadline is None:
        if grace <= 0:
            break
        os.kill(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        reap(pid, code)
end_all()
os._exit(status if status >= 0 else 128 - status)
"""


def watched(argv: list[str], *, grace_s: float = 0.0) -> list[str]:
    """``argv`` run through the watcher, so that nothing it starts outlives this process: not when this
    process is killed (SIGKILL included) at any instant, nor after ``argv`` itself exits. A SIGTERM to
    the watcher reaches the command, which has ``grace_s`` to exit before all is killed. The command
    inherits the watcher's stdin, stdout, stderr, environment and directory; its exit status is the
    watcher's (killed by signal N: 128+N, as in a shell). Start it from a thread that lives as long as
    the command should: the parent-death signal follows the thread that started it."""
    return [sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid()), f"{grace_s:g}", *argv]


def run_reaped(argv: list[str], *, timeout_s: float, text: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, timeout=timeout_s, text=text)`` through a watcher, so
    that nothing ``argv`` starts outlives this process: not when this process is killed (SIGKILL included) at any instant,
    nor at the timeout. bubblewrap's ``--die-with-parent`` alone left its inner child behind when the
    runner died in the instant between bwrap setting its own parent-death signal and waking that child,
    blocked forever on an eventfd that no process would ever write. A command killed by a signal exits
    128+N, as in a shell. For short probes, run once per process: not for a prompt's sandbox start."""
    pipe = subprocess.PIPE
    with subprocess.Popen(
        watched(argv), stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, text=text
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the watcher kills and reaps all it has, then exits
            proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout_s) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def cgroup_procs(path: str | os.PathLike[str]) -> set[int]:
    """The processes in the cgroup at ``path`` (none when it is gone or unreadable). A 0 (a process of a PID
    namespace this one cannot see) is left out: signalled, pid 0 is this process's own group."""
    try:
        with open(os.path.join(path, "cgroup.procs"), "rb") as f:
            return {int(pid) for pid in f.read().split()} - {0}
    except (OSError, ValueError):
        return set()


def exit_code_of(returncode: int) -> int:
    """Shell convention: a process killed by signal N exits with 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def run_process(
    argv: list[str],
    *,
    stdin: bytes | None,
    timeout_s: float,
    output_cap_bytes: int,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    kill: Callable[[subprocess.Popen], None] = kill_process_group,
) -> ExecResult:
    """Run ``argv`` in a new session (its own process group), feeding it ``stdin``.

    One thread multiplexes stdin, output and (through a pidfd, where the kernel has them) the
    command's exit, so it sleeps until something happens instead of polling; a command that
    writes much before reading cannot deadlock. The run ends when the command exits, even if a
    background child still holds the output pipe; at the deadline ``kill`` ends the whole
    process group.
    """
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    buf = CappedBuffer(output_cap_bytes)
    deadline = time.monotonic() + timeout_s
    with selectors.PollSelector() as sel:  # not select(2): descriptors above 1023 are common here
        out_fd = proc.stdout.fileno()
        os.set_blocking(out_fd, False)
        sel.register(out_fd, selectors.EVENT_READ)
        exit_fd = _pidfd(proc.pid)
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ)
        pending = memoryview(stdin or b"")
        if proc.stdin is not None:
            if pending:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
        timed_out = False
        exited_at: float | None = None
        try:
            while True:
                now = time.monotonic()
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                    if exit_fd is not None:
                        sel.unregister(exit_fd)
                if exited_at is not None:
                    if out_fd not in sel.get_map() or now - exited_at >= EXIT_GRACE_S:
                        break
                    wait = exited_at + EXIT_GRACE_S - now
                elif now >= deadline:
                    timed_out = True
                    kill(proc)
                    proc.wait()
                    _drain(sel, out_fd, buf, time.monotonic() + KILL_DRAIN_S)
                    break
                else:
                    # With a pidfd the exit wakes us; without one, check for it every POLL_INTERVAL_S.
                    wait = deadline - now if exit_fd is not None else min(POLL_INTERVAL_S, deadline - now)
                if not sel.get_map():  # output closed and stdin written: only the exit is left to wait for
                    _wait_quietly(proc, wait)
                    continue
                for key, _ in sel.select(max(wait, 0)):
                    if key.fd == out_fd:
                        _read_into(sel, out_fd, buf)
                    elif key.fd != exit_fd:
                        pending = _write_some(sel, proc, pending)
            _drain(sel, out_fd, buf, time.monotonic())  # whatever is already in the pipe, without waiting
        finally:
            if exit_fd is not None:
                os.close(exit_fd)
    proc.stdout.close()
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    output, truncated = buf.result()
    exit_code = -1 if timed_out else exit_code_of(proc.returncode)
    return ExecResult(output=output, exit_code=exit_code, timed_out=timed_out, truncated=truncated)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when ``pid`` exits (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _wait_quietly(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=max(min(seconds, POLL_INTERVAL_S * 4), 0))
    except subprocess.TimeoutExpired:
        pass


def _read_into(sel: selectors.BaseSelector, fd: int, buf: CappedBuffer) -> bool:
    """Read what is available; unregister at EOF. Returns whether anything was read."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return False
    if not chunk:
        sel.unregister(fd)
        return False
    buf.feed(chunk)
    return True


def _drain(sel: selectors.BaseSelector, fd: int, buf: CappedBuffer, until: float) -> None:
    """Read until EOF, a pause, or ``until`` (a child that writes without end must not keep us here)."""
    while fd in sel.get_map():
        if not sel.select(max(until - time.monotonic(), 0)):
            return
        if not _read_into(sel, fd, buf) and fd in sel.get_map():
            return
        if time.monotonic() >= until:
            return


def _write_some(sel: selectors.BaseSelector, proc: subprocess.Popen, pending: memoryview) -> memoryview:
    fd = proc.stdin.fileno()
    try:
        written = os.write(fd, pending[:65536])
    except BlockingIOError:
        return pending
    except (BrokenPipeError, OSError):
        written = len(pending)  # the command stopped reading; the rest of stdin is dropped
    pending = pending[written:]
    if not pending:
        sel.unregister(fd)
        try:
            proc.stdin.close()
        except OSError:
            pass
    return pending
