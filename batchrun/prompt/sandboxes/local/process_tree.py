"""Process-tree helpers for the local backend: the spawning thread bwrap needs, the members of a PID
namespace, the processes one sandbox tagged."""

from __future__ import annotations

import functools
import os
import queue
import select
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_spawner: tuple[int, ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()


def wait_exited(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until ``proc`` has ended (and reap it), at most ``timeout_s``; whether it has.

    Woken once, when it ends (a pidfd): ``Popen.wait(timeout=...)`` polls with sleeps that double up
    to 50 ms, so a process that ends in 10 ms was seen ended at ~16 ms, one in 40 ms at ~64 ms,
    after a wake-up for every sleep (a sandbox's stop waits for two processes)."""
    if proc.poll() is not None:
        return True
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # a kernel before 5.3: Popen's own polling
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)
        waiter.poll(max(0, int(timeout_s * 1000)))
    finally:
        os.close(fd)
    return proc.poll() is not None


_reaper: tuple[int, queue.SimpleQueue] | None = None


def reap_in_background(proc: subprocess.Popen, timeout_s: float) -> None:
    """Reap ``proc``, which has been told to end, on this process's reaper thread; SIGKILL it if it has
    not ended ``timeout_s`` after this call. For a helper whose end the caller need not wait for: a
    sandbox's slirp4netns takes ~30 ms to exit once its exit pipe closes (the kernel tears down its
    tap device), which the prompt's thread would otherwise wait out at every stop."""
    global _reaper
    with _spawner_lock:
        if _reaper is None or _reaper[0] != os.getpid():
            _reaper = (os.getpid(), queue.SimpleQueue())
            threading.Thread(target=_reap, args=(_reaper[1],), name="helper-reaper", daemon=True).start()
        _reaper[1].put((proc, time.monotonic() + timeout_s))


def _reap(todo: queue.SimpleQueue) -> None:
    while True:
        proc, deadline = todo.get()
        if not wait_exited(proc, deadline - time.monotonic()):
            proc.kill()
            proc.wait()


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen:
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
class Member:
    ns_pid: int  # its pid inside the namespace
    session: int  # its session id, as the host sees it


def namespace_members(ns: str) -> dict[int, Member]:
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
        members[int(entry.name)] = Member(ns_pid, session)
    return members


def has_env(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def kill_tagged(marker: bytes) -> None:
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


def child_of(pid: int) -> int | None:
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


def prefer_for_oom(pid: int | None) -> None:
    """Make the sandbox's server (and every command it forks after this) the OOM killer's first pick,
    for good. The server raised its own score already (command_server's script: no privilege needed),
    but without privilege a command may lower it back to 0. Written here with CAP_SYS_RESOURCE (root),
    it also sets the floor, which the sandbox's processes cannot go below: memory pressure that no
    cgroup bounds (the rlimit fallback; tmpfs files) ends prompts, never the runner first."""
    if pid is None or not _can_set_oom_floor():
        return
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:  # it ended already; its next command's start says so
        pass


@functools.cache
def _can_set_oom_floor() -> bool:
    """Whether this process has CAP_SYS_RESOURCE (root usually does; a container's root may not)."""
    try:
        with open("/proc/self/status") as f:
            effective = next(line for line in f if line.startswith("CapEff:")).split()[1]
        return bool(int(effective, 16) >> 24 & 1)  # CAP_SYS_RESOURCE = 24
    except (OSError, StopIteration, ValueError, IndexError):
        return False
