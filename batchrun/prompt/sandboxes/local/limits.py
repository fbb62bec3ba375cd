"""Per-prompt resource limits for the local sandbox: a cgroup per prompt where the machine lets us
make one (v2, or v1's pids/memory/cpu hierarchies), else rlimits set before bubblewrap starts.

A prompt's cgroup lives under a run-level parent (``batch-runner-<tag>``) inside this process's own
cgroup, so the limits of whatever runs the runner still apply on top. The bubblewrap process is
moved into it by a small ``sh`` wrapper before it forks, so nothing of the sandbox escapes it.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batchrun.prompt.sandboxes._process import cgroup_procs
from batchrun.prompt.sandboxes.base import (
    cgroup_dir_in,
    cgroup_mounts,
    number_in,
    own_cgroup_limit,
    own_cgroup_paths,
    run_share,
)

CONTROLLERS = ("pids", "memory", "cpu")
CPU_PERIOD_US = 100_000
PARENT_PREFIX = "batch-runner-"
# An emptied prompt cgroup serves this many prompts in all before it is removed (see CgroupPool):
# what a prompt leaves charged to it (page cache it read, which the kernel reclaims under the limit)
# is not carried further than that.
CGROUP_USES = 32
# Emptied cgroups kept per run and limits in one process. A worker's next prompt starts when one of
# its prompts has ended, so a few cover it; what is kept when the run ends, the run's sweep removes
# on the way out (1,000 took 0.3 s there, against 20 ms for 64).
CGROUP_POOL_SIZE = 16


@dataclass(frozen=True)
class Limits:
    cpus: float  # CPU time per wall second, in cores
    memory_mb: int  # the prompt's processes
    pids_limit: int  # processes and threads at once
    disk_mb: int  # each of the working directory and /tmp (tmpfs; their files are RAM too)

    @property
    def memory_bytes(self) -> int:
        """What the cgroup allows: the processes' memory plus the files, which live in tmpfs (RAM)."""
        return (self.memory_mb + self.disk_mb) << 20


@dataclass(frozen=True)
class CgroupLayout:
    version: int  # 1 or 2
    bases: dict[str, Path]  # controller -> this process's own cgroup directory in its hierarchy


def _writable(base: Path) -> bool:
    # Per thread: a worker's first starts run at once, each computing the cached layout below, and
    # with one name per process the thread whose mkdir lost found the cgroups unwritable: its
    # sandbox (or, cached, every later one of the worker) went without cgroups, on rlimits.
    probe = base / f"{PARENT_PREFIX}probe-{os.getpid()}-{threading.get_ident()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


@functools.cache
def cgroup_layout() -> CgroupLayout | str:
    """Where this process may make cgroups with every controller we need, or why it may not."""
    try:
        own, mounts = own_cgroup_paths(), cgroup_mounts()
    except (OSError, ValueError) as exc:
        return f"cannot read this process's cgroups: {exc}"
    v1: dict[str, Path] = {}
    for root, point, fstype, opts in mounts:
        for controller in CONTROLLERS:
            if fstype == "cgroup" and controller in opts and controller in own:
                v1.setdefault(controller, cgroup_dir_in(root, point, own[controller]))
    if len(v1) == len(CONTROLLERS):
        if all(_writable(b) for b in v1.values()):
            return CgroupLayout(1, v1)
        return "the cgroup v1 hierarchies are not writable (not root, or no delegation)"
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            base = _v2_base(cgroup_dir_in(root, point, own[""]), Path(point))
            if isinstance(base, Path):
                return CgroupLayout(2, dict.fromkeys(CONTROLLERS, base))
            return base
    return "no cgroup hierarchy offers the pids, memory and cpu controllers here"


def _v2_base(own: Path, root: Path) -> Path | str:
    """A v2 cgroup whose children get pids, memory and cpu: our own, else the hierarchy's root.

    A v2 cgroup that holds processes may not hand controllers to children (the "no internal
    processes" rule), so our own cgroup works only when delegated; the root is exempt.
    """
    want = " ".join(f"+{c}" for c in CONTROLLERS)
    for base in dict.fromkeys((own, root)):
        try:
            if not set(CONTROLLERS) <= set((base / "cgroup.controllers").read_text().split()):
                continue
            (base / "cgroup.subtree_control").write_text(want)
            if _writable(base):
                return base
        except OSError:
            continue
    return "cgroup v2 does not let this process delegate pids, memory and cpu (not root, or no delegation)"


def limits_mechanism() -> str:
    """One line for the start of a run: what enforces the per-prompt limits here."""
    layout = cgroup_layout()
    if isinstance(layout, CgroupLayout):
        return f"cgroup v{layout.version} per prompt (pids, memory, cpu)"
    proc = (
        "process count not limited (RLIMIT_NPROC does not bind root)" if os.geteuid() == 0 else "RLIMIT_NPROC"
    )
    # "2048 MiB memory" read as the prompt's: each of its processes may have that much, and its tmpfs
    # files count against nothing
    return (
        f"rlimits: RLIMIT_AS per process (not the prompt's processes together, nor its tmpfs files), {proc}, "
        f"no CPU limit ({layout})"
    )


# The run parents this process made and delegated controllers in (forgotten when it removes one).
_READY_PARENTS: set[str] = set()


@dataclass(frozen=True)
class RunBounds:
    memory_bytes: int  # the run's prompts together: processes and their tmpfs files
    pids: int  # processes and threads of all its prompts at once
    cpus: float | None = None  # CPU time per wall second of them all, in cores; None: no quota


@functools.cache
def run_bounds() -> RunBounds:
    """What the run's prompts may hold together: :func:`host_limits`, less what is kept for the host."""
    memory, pids = run_share(*host_limits())
    return RunBounds(memory_bytes=memory, pids=pids)


def host_limits(own_cgroup: bool = True) -> tuple[int, int]:
    """The machine's memory (or this process's cgroup's, or an ancestor's, when smaller) and processes (the
    kernel's pid_max and threads-max, or the pids limit of this process's cgroup or an ancestor). Reads
    only: the flag checks ask it before any cgroup is made. ``own_cgroup=False``: the machine's alone (a
    container engine's sandboxes are not under this process's cgroup)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    pids = min(
        number_in("/proc/sys/kernel/pid_max") or 32768, number_in("/proc/sys/kernel/threads-max") or 1 << 22
    )
    if not own_cgroup:
        return memory, pids
    own_memory = own_cgroup_limit("memory", "memory.limit_in_bytes", "memory.max")
    own_pids = own_cgroup_limit("pids", "pids.max", "pids.max")
    return min(memory, own_memory or memory), min(pids, own_pids or pids)


def _ready_parent(
    run_dir: str, controllers: list[str], version: int, bounds: RunBounds | None = None
) -> None:
    """The run's parent cgroup, made, its controllers delegated and the run's bounds (``bounds``, else
    :func:`run_bounds`) written: once per process, not per prompt."""
    if run_dir in _READY_PARENTS:
        return
    try:
        os.mkdir(run_dir)
    except FileExistsError:
        pass
    if version == 2:
        _write(os.path.join(run_dir, "cgroup.subtree_control"), " ".join(f"+{c}" for c in controllers))
    bounds = bounds or run_bounds()
    if "pids" in controllers:
        _write(os.path.join(run_dir, "pids.max"), str(bounds.pids))
    if "memory" in controllers:
        _limit_memory(run_dir, version, bounds.memory_bytes)
    if "cpu" in controllers and bounds.cpus is not None:
        _limit_cpu(run_dir, version, bounds.cpus)
    _READY_PARENTS.add(run_dir)


def _limit_memory(path: str, version: int, limit: int) -> None:
    """``limit`` bytes of memory for the cgroup at ``path``, swap included (no swap beyond it)."""
    if version == 1:
        _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
        _try_write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit))
    else:
        _write(os.path.join(path, "memory.max"), str(limit))
        _try_write(os.path.join(path, "memory.swap.max"), "0")


def _limit_cpu(path: str, version: int, cpus: float) -> None:
    """``cpus`` cores' worth of CPU time per wall second for the cgroup at ``path``."""
    quota = max(1000, int(cpus * CPU_PERIOD_US))
    if version == 1:
        _write(os.path.join(path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
    else:
        _write(os.path.join(path, "cpu.max"), f"{quota} {CPU_PERIOD_US}")


class PromptCgroup:
    """One prompt's cgroup in every hierarchy; ``remove`` is safe to call twice.

    Plain string paths and unbuffered writes: at a thousand prompts in flight this runs ~30 times a
    second on the workers' threads, and pathlib's objects cost more than the writes themselves.
    ``bounds``: the parent's, when it is not a run of prompts (the browsers', tools/browser_cgroup.py)."""

    def __init__(
        self, layout: CgroupLayout, parent: str, name: str, limits: Limits, bounds: RunBounds | None = None
    ):
        self.layout = layout
        self.key = _pool_key(layout, parent, limits)
        self.uses = 1  # prompts it has held (see CgroupPool)
        self.dirs: list[str] = []
        # The two counters ``hits`` reads, in the hierarchy that has each (read after every command).
        self._pids_events: str | None = None
        self._oom_events: str | None = None
        by_base: dict[Path, list[str]] = {}
        for controller, base in layout.bases.items():
            by_base.setdefault(base, []).append(controller)
        try:
            for base, controllers in by_base.items():
                run_dir = os.path.join(base, parent)
                path = os.path.join(run_dir, name)
                _ready_parent(run_dir, controllers, layout.version, bounds)
                try:
                    os.mkdir(path)
                except FileNotFoundError:  # another thread removed the parent, empty for a moment
                    _READY_PARENTS.discard(run_dir)
                    _ready_parent(run_dir, controllers, layout.version, bounds)
                    os.mkdir(path)
                self.dirs.append(path)
                for controller in controllers:
                    self._limit(path, controller, limits)
                if "pids" in controllers:
                    self._pids_events = os.path.join(path, "pids.events")
                if "memory" in controllers:
                    self._oom_events = os.path.join(
                        path, "memory.oom_control" if layout.version == 1 else "memory.events"
                    )
        except OSError:
            self.remove()
            raise

    def _limit(self, path: str, controller: str, limits: Limits) -> None:
        if controller == "pids":
            _write(os.path.join(path, "pids.max"), str(limits.pids_limit))
        elif controller == "memory":
            _limit_memory(path, self.layout.version, limits.memory_bytes)
        else:
            _limit_cpu(path, self.layout.version, limits.cpus)

    def enter(self, *pids: int) -> None:
        """Move running processes into the cgroups (OSError if the kernel refuses): their later children
        are born in them."""
        for d in self.dirs:
            for pid in pids:
                _write(os.path.join(d, "cgroup.procs"), str(pid))

    def empty(self) -> bool:
        """No process (a zombie included) in it, in any hierarchy: nothing of the last prompt is left."""
        for d in self.dirs:
            try:
                with open(os.path.join(d, "cgroup.procs"), "rb") as f:
                    if f.read().strip():
                        return False
            except OSError:
                return False
        return bool(self.dirs)

    def kill(self) -> bool:
        """SIGKILL every process in it, in any hierarchy; True once none is left (zombies included)."""
        for d in self.dirs:
            for pid in cgroup_procs(d):
                _try_kill(pid)
        return self.empty()

    def hits(self) -> tuple[int, int]:
        """(times a fork failed at pids.max, processes the OOM killer ended) so far."""
        pids = _counter(self._pids_events, "max") if self._pids_events else 0
        memory = _counter(self._oom_events, "oom_kill") if self._oom_events else 0
        return pids, memory

    def remove(self) -> None:
        """Remove the cgroups (their processes are gone or going: retry briefly), then the run's
        parent if this was its last prompt."""
        for d in self.dirs:
            for attempt in range(20):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01 * (attempt + 1))
            try:
                os.rmdir(os.path.dirname(d))
                _READY_PARENTS.discard(os.path.dirname(d))
            except OSError:
                pass  # other prompts of the run still use it
        self.dirs = []


class CgroupPool:
    """This process's emptied prompt cgroups, each made again for the next prompt of the same run and
    limits: making one (a directory and its limits in each hierarchy) and removing it cost ~0.8 ms
    of CPU per prompt here (v1's memory controller above all), moving the server into a kept one
    ~0.1 ms.

    Only a cgroup without a single process in it (``PromptCgroup.empty``) comes back; one that still
    holds a process of its last prompt is removed as before. Its limits are the run's own, written
    when it was made; its counters (fork failures at pids.max, OOM kills) are cumulative, and the
    sandbox takes their values at the start of a prompt as that prompt's zero. Only cgroups under a
    run's own parent are kept: the run's sweep removes the parent with whatever is in it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._idle: dict[tuple, list[PromptCgroup]] = {}

    def take(self, layout: CgroupLayout, parent: str, name: str, limits: Limits) -> PromptCgroup:
        key = _pool_key(layout, parent, limits)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: those are its parent's
                self._pid, self._idle = os.getpid(), {}
            idle = self._idle.get(key)
            cgroup = idle.pop() if idle else None
        if cgroup is not None and all(os.path.isdir(d) for d in cgroup.dirs):
            cgroup.uses += 1
            return cgroup
        return PromptCgroup(layout, parent, name, limits)

    def give_back(self, cgroup: PromptCgroup) -> None:
        """Keep it for the next prompt if it is empty and has uses left; else remove it."""
        if cgroup.uses < CGROUP_USES and cgroup.empty():
            with self._lock:
                if self._pid == os.getpid():
                    idle = self._idle.setdefault(cgroup.key, [])
                    if len(idle) < CGROUP_POOL_SIZE:
                        idle.append(cgroup)
                        return
        cgroup.remove()


cgroup_pool = CgroupPool()


def _pool_key(layout: CgroupLayout, parent: str, limits: Limits) -> tuple:
    return (layout.version, tuple(sorted(layout.bases.items())), parent, limits)


def remove_run_cgroups(parent: str) -> None:
    """After a run's workers are gone (or a killed run's, by the next run of its name): remove its
    cgroups, killing what still runs in them (a dead worker's sandbox may still be dying)."""
    layout = cgroup_layout()
    if not isinstance(layout, CgroupLayout):
        return
    for base in set(layout.bases.values()):
        run_dir = base / parent
        if not run_dir.is_dir():
            continue
        for child in run_dir.iterdir():
            if child.is_dir():
                for _attempt in range(50):
                    for pid in cgroup_procs(child):
                        _try_kill(pid)
                    if _try_rmdir(child):
                        break
                    time.sleep(0.02)
        _try_rmdir(run_dir)


def run_cgroup_names() -> list[str]:
    """The names of the run-level parent cgroups under this process's own (ours and earlier runs')."""
    layout = cgroup_layout()
    if not isinstance(layout, CgroupLayout):
        return []
    names = set()
    for base in set(layout.bases.values()):
        try:
            names.update(e.name for e in os.scandir(base) if e.is_dir() and e.name.startswith(PARENT_PREFIX))
        except OSError:
            continue
    return sorted(names)


def _try_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def apply_rlimits(pid: int, limits: Limits) -> None:
    """The fallback's limits, set on the sandbox's running server (``prlimit``) before its first
    command: every command is its child and inherits them, and without CAP_SYS_RESOURCE (dropped)
    none can raise them. Soft and hard alike, as ``ulimit`` sets them. No shell around bwrap: its
    ``ulimit -u`` is bash's, which ``/bin/sh`` (dash) refused, so no sandbox started for a user
    without cgroups; it also cost a process per start. OSError if the kernel refuses."""
    size = limits.memory_mb << 20
    resource.prlimit(pid, resource.RLIMIT_AS, (size, size))
    if os.geteuid() != 0:  # RLIMIT_NPROC counts all of this user's processes: leave room for them
        count = _user_processes() + limits.pids_limit
        resource.prlimit(pid, resource.RLIMIT_NPROC, (count, count))


def _user_processes() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                count += 1
        except OSError:
            continue
    return count


def _counter(path: str, key: str) -> int:
    try:
        with open(path) as f:
            text = f.read()
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _write(path: str, text: str) -> None:
    """One write(2) of ``text``: a cgroup file takes each write as one value."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _try_write(path: str, text: str) -> None:
    try:
        _write(path, text)
    except OSError:
        pass


def _try_rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
