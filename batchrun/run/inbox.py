"""The parent's inbox: one private connection per worker, over which it sends everything it reports.

See :mod:`batchrun.protocol` for the messages. Workers connect with :func:`connect_to_inbox`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Any

from batchrun.protocol import PauseAll, Received, StopStarting, WorkerExit


class Inbox:
    """Where outcomes arrive: one private connection per worker.

    Unlike a shared multiprocessing.Queue (one lock for all writers), a worker killed mid-send
    cannot block the others, and the end of its connection tells the parent at once that it died.
    With ``host`` (workers on other machines: Ray) it listens on TCP on every interface (``port``, 0: any
    free one) and tells workers to connect to ``host``; the authkey keeps other clients out.
    """

    def __init__(self, host: str | None = None, port: int = 0, hello: Any = None) -> None:
        """``hello``: sent to each worker as the first message, right after it introduces itself (the
        settings of workers whose start-up arguments others can read: Ray's)."""
        authkey = os.urandom(16)
        self._hello = hello
        self.remote = host is not None
        if self.remote:
            family, bind = ("AF_INET6", "::") if ":" in host else ("AF_INET", "0.0.0.0")
            self._listener = Listener((bind, port), family=family, authkey=authkey)
            self.address = ((host, self._listener.address[1]), authkey)
        else:
            self._listener = Listener(family="AF_UNIX", authkey=authkey)
            self.address = (self._listener.address, authkey)
        self._ids: set[int] = set()  # remote workers' ids: pids, made unique across machines
        self._closed = False
        self.events: queue.Queue[Received | WorkerExit] = queue.Queue()
        self.open_connections = 0  # live workers; 0 for long means the pool can no longer make any
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[Any, threading.Lock]] = {}
        self._by_pid: dict[Any, tuple[Any, threading.Lock]] = {}  # a worker's id -> its connection
        self._accepting = threading.Thread(target=self._accept, name="inbox-accept", daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, mp.AuthenticationError):
                if self._closed:
                    return
                time.sleep(0.05)
                continue  # a client that failed the handshake (wrong key, hung up): not one of ours
            if self.remote:
                tcp_keepalive(conn.fileno())  # a machine that vanishes ends its connection too
            with self._lock:
                self.open_connections += 1
                if self._hello is None:  # else once the hello is sent: no other message may come first
                    self._conns[id(conn)] = (conn, threading.Lock())
            threading.Thread(target=self._read, args=(conn,), name="inbox-read", daemon=True).start()

    def _read(self, conn: Any) -> None:
        pid = None
        try:
            pid = conn.recv()  # a worker's first message is its pid
            if self.remote:  # two machines may run workers with the same pid
                pid = self._unique_id(pid)
            if self._hello is not None:
                conn.send(self._hello)
                with self._lock:
                    self._conns[id(conn)] = (conn, threading.Lock())
            with self._lock:
                self._by_pid[pid] = self._conns[id(conn)]
            while True:
                self.events.put(Received(pid, conn.recv()))
        except (EOFError, OSError):
            self.events.put(WorkerExit(pid))
        finally:
            with self._lock:
                self.open_connections -= 1
                self._conns.pop(id(conn), None)
                if pid is not None and self._by_pid.get(pid, (None,))[0] is conn:
                    del self._by_pid[pid]
                self._ids.discard(pid)
            conn.close()

    def _unique_id(self, pid: Any) -> int:
        """The worker's pid, or a number above any Linux pid when a worker elsewhere already has it."""
        with self._lock:
            if not isinstance(pid, int) or pid in self._ids:
                pid = max(self._ids | {1 << 22}) + 1
            self._ids.add(pid)
        return pid

    def broadcast(self, message: PauseAll | StopStarting) -> None:
        """Tell every live worker (a run-wide pause, or: start no new prompt)."""
        with self._lock:
            conns = list(self._conns.values())
        for conn, lock in conns:
            try:
                with lock:
                    conn.send(message)
            except (OSError, ValueError):
                pass  # that worker is gone; its exit is reported by its reader

    def send(self, pid: Any, message: Any) -> bool:
        """Send one worker a message (a prompt to run); False when that worker is gone."""
        with self._lock:
            entry = self._by_pid.get(pid)
        if entry is None:
            return False
        conn, lock = entry
        try:
            with lock:
                conn.send(message)
        except (OSError, ValueError):
            return False  # its exit is reported by its reader
        return True

    def close(self) -> None:
        """Stop accepting workers. Closing a listening socket does not wake a thread blocked in its
        accept(): shut it down first, so the accepting thread ends too (one was left per run before)."""
        self._closed = True
        sock = getattr(getattr(self._listener, "_listener", None), "_socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepting.join(5)


def connect_to_inbox(address: Any, authkey: bytes) -> Any:
    """A worker's connection to the parent's inbox, introduced by the worker's pid."""
    conn = Client(address, authkey=authkey)
    if isinstance(address, tuple):  # TCP (Ray): the runner may be on another machine
        tcp_keepalive(conn.fileno())  # a runner machine that vanishes breaks the connection too
    conn.send(os.getpid())
    return conn


def tcp_keepalive(fd: int, idle_s: int = 15, interval_s: int = 5, probes: int = 4) -> None:
    """Probe an idle TCP connection, so a peer that vanished (machine down, network cut) ends it within a minute."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", probes)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.close()
