"""batchrun/run/inbox.py: the parent's receiving side, over real sockets, with real worker processes.

A worker is played either by a :func:`~batchrun.run.inbox.connect_to_inbox` connection of this process
or by a child process running :data:`CHILD`; the Ray (TCP) inbox's own cases are in test_ray.py.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Client

import pytest
from helpers import ROOT, wait_until

from batchrun.protocol import Log, PauseAll, Ready, Received, StopStarting, WorkerExit
from batchrun.run.inbox import Inbox, connect_to_inbox, tcp_keepalive

WAIT_S = 30.0  # the longest one event may take on a loaded machine; a passing test never waits this long

# A worker in a process of its own: connects, says Ready, then sends what argv[3] says.
CHILD = """
import sys
sys.path.insert(0, {root!r})
from batchrun.protocol import Log, Ready
from batchrun.run.inbox import connect_to_inbox

conn = connect_to_inbox({address!r}, bytes.fromhex(sys.argv[1]))
conn.send(Ready(1))
if sys.argv[2] == "flood":  # large messages until it is killed
    print("sending", flush=True)
    while True:
        conn.send(Log(0, "terminal", "x" * 4_000_000, ""))
else:
    print("idle", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def inbox():
    box = Inbox()
    yield box
    box.close()


def event(box: Inbox):
    return box.events.get(timeout=WAIT_S)


def child(box: Inbox, mode: str) -> subprocess.Popen:
    """A worker process connected to ``box``; it has printed its first line once this returns."""
    address, authkey = box.address
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(root=str(ROOT), address=address), authkey.hex(), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() in ("sending", "idle")
    return proc


def test_a_worker_is_named_by_the_pid_it_introduces_itself_with_and_its_messages_keep_their_order(inbox):
    address, authkey = inbox.address
    assert isinstance(address, str)  # a local inbox: a Unix socket, no TCP port open
    conn = connect_to_inbox(address, authkey)
    try:
        for i in range(50):
            conn.send(Log(i, "terminal", "{}", str(i)))
        got = [event(inbox) for _ in range(50)]
        assert got == [Received(os.getpid(), Log(i, "terminal", "{}", str(i))) for i in range(50)]
        assert inbox.open_connections == 1
    finally:
        conn.close()
    assert event(inbox) == WorkerExit(os.getpid())
    assert wait_until(lambda: inbox.open_connections == 0, WAIT_S, 0.02)


def test_a_process_that_dies_is_reported_once_as_a_worker_exit(inbox):
    proc = child(inbox, "idle")
    try:
        assert event(inbox) == Received(proc.pid, Ready(1))
        proc.kill()
        proc.wait()
        assert event(inbox) == WorkerExit(proc.pid)
        with pytest.raises(queue.Empty):
            inbox.events.get(timeout=0.3)
        assert inbox.send(proc.pid, StopStarting()) is False  # gone: the caller fails its prompts
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_killed_mid_send_blocks_no_other(inbox):
    flooder = child(inbox, "flood")
    other = connect_to_inbox(*inbox.address)
    try:
        assert event(inbox) == Received(flooder.pid, Ready(1))
        flooder.kill()  # somewhere inside a 4 MB message
        flooder.wait()
        other.send(Ready(2))
        seen = []
        while Received(os.getpid(), Ready(2)) not in seen or WorkerExit(flooder.pid) not in seen:
            seen.append(event(inbox))
        assert all(e.pid in (flooder.pid, os.getpid()) for e in seen)
        assert seen.count(WorkerExit(flooder.pid)) == 1
    finally:
        other.close()
        flooder.kill()
        flooder.wait()


def test_send_reaches_only_the_named_worker_and_broadcast_reaches_every_live_one(inbox):
    a = Client(inbox.address[0], authkey=inbox.address[1])
    b = Client(inbox.address[0], authkey=inbox.address[1])
    gone = Client(inbox.address[0], authkey=inbox.address[1])
    try:
        for conn, pid in ((a, 101), (b, 102), (gone, 103)):
            conn.send(pid)
            conn.send(Ready(1))
        assert {event(inbox).pid for _ in range(3)} == {101, 102, 103}
        gone.close()
        assert event(inbox) == WorkerExit(103)
        assert inbox.send(101, "for a only") is True
        assert inbox.send(999, "nobody") is False  # never connected
        inbox.broadcast(PauseAll(12.5))  # to the two live workers only
        assert a.recv() == "for a only" and a.recv() == PauseAll(12.5)
        assert b.recv() == PauseAll(12.5)
        assert not a.poll(0.2) and not b.poll(0.2)
    finally:
        a.close()
        b.close()


def test_a_new_connection_with_a_reused_pid_keeps_its_route_when_the_old_one_ends(inbox):
    """Pids are reused: a replacement worker may connect before the reader of the dead one noticed its end."""
    old = Client(inbox.address[0], authkey=inbox.address[1])
    new = Client(inbox.address[0], authkey=inbox.address[1])
    try:
        old.send(77)
        old.send(Ready(1))
        assert event(inbox) == Received(77, Ready(1))
        new.send(77)
        new.send(Ready(2))
        assert event(inbox) == Received(77, Ready(2))
        old.close()
        assert event(inbox) == WorkerExit(77)
        assert inbox.send(77, "a prompt") is True
        assert new.recv() == "a prompt"
    finally:
        new.close()


def test_concurrent_sends_to_one_worker_never_interleave(inbox):
    """The dispatch loop and the budget's grants may write to one worker at once: each message whole."""
    conn = Client(inbox.address[0], authkey=inbox.address[1])
    try:
        conn.send(5)
        conn.send(Ready(1))
        assert event(inbox) == Received(5, Ready(1))
        big = [bytes([i]) * 300_000 for i in range(8)]  # far beyond what one socket write takes

        def sender(i: int) -> None:
            for _ in range(5):
                if i % 2:
                    inbox.send(5, big[i])
                else:
                    inbox.broadcast(big[i])

        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.extend(conn.recv() for _ in range(40)), daemon=True)
        reader.start()
        threads = [threading.Thread(target=sender, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        reader.join(WAIT_S)
        assert sorted(received) == sorted(b for b in big for _ in range(5))
    finally:
        conn.close()


def test_a_client_without_the_key_is_refused_and_the_inbox_keeps_accepting_workers(inbox):
    address, authkey = inbox.address
    with pytest.raises(Exception):  # noqa: B017 - AuthenticationError, or the connection closed on it
        Client(address, authkey=b"not the key").send(1)
    with socket.socket(socket.AF_UNIX) as raw:  # connects and hangs up before the handshake
        raw.connect(address)
    conn = connect_to_inbox(address, authkey)
    try:
        conn.send(Ready(3))
        assert event(inbox) == Received(os.getpid(), Ready(3))  # nothing from the two intruders
    finally:
        conn.close()


def test_a_closed_inbox_takes_no_new_worker(inbox):
    address, authkey = inbox.address
    inbox.close()
    with pytest.raises(OSError):
        connect_to_inbox(address, authkey)


def test_a_closed_inbox_ends_its_accepting_thread():
    """One inbox a run: a thread left blocked in accept() by each was one more per run of a long process."""
    before = {t for t in threading.enumerate() if t.name == "inbox-accept"}
    for box in (Inbox(), Inbox(host="127.0.0.1")):
        box.close()
    assert {t for t in threading.enumerate() if t.name == "inbox-accept"} == before


def test_remote_ids_are_unique_while_connected_and_free_again_after(tmp_path):
    box = Inbox(host="127.0.0.1")
    address, authkey = box.address
    first = connect_like(address, authkey, 4242)
    odd = connect_like(address, authkey, "not a pid")
    try:
        ids = {event(box).pid for _ in range(2)}
        assert 4242 in ids
        (other,) = ids - {4242}
        assert isinstance(other, int) and other > 1 << 22  # above any Linux pid
        first.close()
        assert event(box) == WorkerExit(4242)
        again = connect_like(address, authkey, 4242)
        assert event(box) == Received(4242, Ready(1))  # the id came free with its connection
        again.close()
    finally:
        first.close()
        odd.close()
        box.close()


def connect_like(address, authkey: bytes, pid) -> Client:
    """A worker on another machine: it introduces itself with ``pid`` and says Ready."""
    conn = Client(address, authkey=authkey)
    conn.send(pid)
    conn.send(Ready(1))
    return conn


def test_tcp_keepalive_probes_an_idle_connection_and_leaves_its_socket_open():
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as sock,
    ):
        tcp_keepalive(sock.fileno(), idle_s=15, interval_s=5, probes=4)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        sock.sendall(b"still open")  # the duplicate was closed, not the caller's socket
        peer, _ = server.accept()
        with peer:
            assert peer.recv(64) == b"still open"
