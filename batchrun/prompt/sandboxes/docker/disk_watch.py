"""The disk cap of containers whose writable layer the engine cannot cap (overlay2 off xfs+pquota).

Their working directory is a tmpfs (capped), but everything else they write (``/tmp``, ``/root``,
``/usr``, an image's ``VOLUME``) lands on the engine's disk, usually the host's root filesystem.
Where the engine runs on this machine and this process may read its data-root (root), one thread
per worker process looks at each container's writable layer (``GraphDriver.Data.UpperDir``) and
anonymous volumes, and calls the container's ``over`` when they hold more than its cap: the
container is then stopped. Between two looks a container may write on: the overshoot is bounded by
how fast the disk takes writes times the time between looks (a write-bandwidth limit does not
help: cgroup v1 throttles direct I/O only, not buffered writes).

A look at a layer is a walk of its files (~5 us each), so it is paced: cheap ``statvfs`` calls on
the filesystem five times a second trigger a walk as soon as the filesystem grew (blocks or inodes)
by a slice of the cap since the smallest size seen after the last walk, and a walk comes at least
every ``PERIOD_S`` (more rarely for a layer whose walk is slow, so the watch costs a bounded share
of a core).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

POLL_S = 0.05  # between two statvfs looks (~2 us each) at the filesystems of the watched layers
PERIOD_S = 10.0  # a walk at least this often, should growth escape the statvfs looks (a slow walk: rarer)
COST_SHARE = 0.01  # the share of a core the periodic walks of one layer may take
TRIGGERED_SHARE = 0.5  # the share of a core walks triggered by growth may take, per layer
MIN_ENTRY_BYTES = 4096  # each file counts at least one block: a million empty files fill the host's inodes
MAX_TRIGGER_BYTES = 64 << 20  # the filesystem's growth that triggers a walk: a 16th of the cap, at most this


def layer_bytes(paths: Sequence[str]) -> int:
    """The disk the files under ``paths`` take: their blocks, each file at least ``MIN_ENTRY_BYTES``,
    a file with several links once. A path that is gone counts nothing."""
    total, seen, stack = 0, set(), list(paths)
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:  # gone (the container was removed), or not a directory
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                is_dir = entry.is_dir(follow_symlinks=False)
                if st.st_nlink > 1 and not is_dir:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
                if is_dir:
                    stack.append(entry.path)
    return total


def _filesystem_use(path: str) -> tuple[int, int]:
    """(bytes, inodes) in use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree


@dataclass
class _Layer:
    paths: list[str]
    cap_bytes: int
    over: Callable[[int], None]  # called once, from the watch's thread, with the size found past the cap
    trigger_bytes: int = 0
    low: tuple[int, int] = (0, 0)  # the filesystem's smallest (bytes, inodes) in use since the last walk
    last_walk: float = 0.0  # when the last walk ended
    walk_s: float = 0.0  # how long it took
    size: int = 0  # what it found
    walks: int = field(default=0)

    def due(self, now: float, used: tuple[int, int]) -> bool:
        self.low = (min(self.low[0], used[0]), min(self.low[1], used[1]))
        since = now - self.last_walk
        if since >= max(PERIOD_S, self.walk_s / COST_SHARE):
            return True
        grew = used[0] - self.low[0] >= self.trigger_bytes or (
            (used[1] - self.low[1]) * MIN_ENTRY_BYTES >= self.trigger_bytes
        )
        return grew and since >= self.walk_s / TRIGGERED_SHARE

    def walk(self) -> int:
        used = _filesystem_use(self.paths[0])  # before the walk: what is written during it triggers the next
        start = time.monotonic()
        self.size = layer_bytes(self.paths)
        self.last_walk = time.monotonic()
        self.walk_s, self.low, self.walks = self.last_walk - start, used, self.walks + 1
        return self.size


class DiskWatch:
    """The watched layers of this process's containers, and the thread that looks at them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layers: dict[str, _Layer] = {}
        self._thread: threading.Thread | None = None

    def add(self, key: str, paths: Sequence[str], cap_bytes: int, over: Callable[[int], None]) -> None:
        """Watch the files under ``paths`` (the first one a directory that exists) of container ``key``;
        ``OSError`` when this process cannot read them. The first walk happens here."""
        if not os.access(paths[0], os.R_OK | os.X_OK):
            raise PermissionError(f"{paths[0]} is not readable by this process")
        layer = _Layer(
            list(paths), cap_bytes, over, trigger_bytes=min(MAX_TRIGGER_BYTES, max(cap_bytes // 16, 1))
        )
        os.scandir(paths[0]).close()  # the OSError the caller wants, rather than a walk that counts 0
        layer.walk()
        with self._lock:
            self._layers[key] = layer
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="docker-disk-watch", daemon=True)
                self._thread.start()

    def remove(self, key: str) -> None:
        with self._lock:
            self._layers.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                layers = list(self._layers.items())
                if not layers:
                    self._thread = None
                    return
            for key, layer in layers:
                try:
                    self._look(key, layer)
                except Exception:  # one layer's trouble must not end the watch of the others
                    log.exception("disk watch of container %s failed", key[:12])

    def _look(self, key: str, layer: _Layer) -> None:
        try:
            used = _filesystem_use(layer.paths[0])
        except OSError:
            return  # the layer is gone: its container was removed (its stop removes it from here)
        if not layer.due(time.monotonic(), used) or layer.walk() <= layer.cap_bytes:
            return
        with self._lock:
            if self._layers.get(key) is not layer:
                return
            del self._layers[key]
        layer.over(layer.size)


_watch = DiskWatch()


def disk_watch() -> DiskWatch:
    """This process's watch (its thread runs while it has a layer to watch)."""
    return _watch


def _after_fork_in_child() -> None:
    global _watch
    _watch = DiskWatch()  # the parent's thread is not in the child, nor are its containers


os.register_at_fork(after_in_child=_after_fork_in_child)
