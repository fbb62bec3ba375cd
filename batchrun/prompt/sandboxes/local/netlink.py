"""Netlink from this process: unreachable routes in another network namespace (rtnetlink), and the
host's bound Unix socket paths (sock_diag).

``nsenter --net=... ip -batch -`` costs two processes per sandbox start (~4 ms of CPU). When
this process may enter the namespace itself (it has CAP_SYS_ADMIN over it, as root), a short-lived
thread enters it only to open a netlink socket there (a socket belongs to the namespace it was
made in) and ends, and the routes are added over that socket. ``setns`` of a network namespace
moves only the calling thread, and that thread ends right after, whatever happens
(:func:`in_namespace`, which the network hub and the browser's namespace use too).
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

CLONE_NEWNET = 0x40000000
_T = TypeVar("_T")
_RTM_NEWROUTE = 24
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
_NLMSG_ERROR = 2
_RT_TABLE_MAIN, _RTPROT_BOOT, _RT_SCOPE_UNIVERSE, _RTN_UNREACHABLE = 254, 3, 0, 7
_RTA_DST = 1


class NetlinkError(OSError):
    """The routes could not be added this way (the caller may fall back to ``ip``)."""


@functools.cache
def _setns():
    fn = ctypes.CDLL(None, use_errno=True).setns
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    return fn


def in_namespace(netns: int | str | None, make: Callable[[], _T]) -> _T:
    """``make()`` on a short-lived thread of its own inside a network namespace: ``netns``'s (a descriptor,
    or a path such as /proc/<pid>/ns/net), or a new one the thread makes (None). What ``make`` opens there
    (a socket, the new namespace's own descriptor) belongs to that namespace; the thread ends after.
    Errors come back as OSError (:class:`NetlinkError` for anything not one)."""
    result: list[Any] = []

    def enter() -> None:
        try:
            if netns is None:
                failed, call = ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0, "unshare"
            else:
                target = netns if isinstance(netns, int) else os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    failed, call = _setns()(target, CLONE_NEWNET) != 0, "setns"
                finally:
                    if target is not netns:
                        os.close(target)
            if failed:
                err = ctypes.get_errno()
                raise NetlinkError(err, f"{call}: {os.strerror(err)}")
            result.append(make())
        except BaseException as exc:  # handed to the caller
            result.append(exc)

    thread = threading.Thread(target=enter, name="netns-enter", daemon=True)
    thread.start()
    thread.join()
    got = result[0] if result else NetlinkError("no result")
    if isinstance(got, BaseException):
        raise got if isinstance(got, OSError) else NetlinkError(str(got))
    return got


def socket_in(netns_path: str) -> socket.socket:
    """An rtnetlink socket inside the network namespace at ``netns_path`` (a /proc/<pid>/ns/net link)."""
    return in_namespace(netns_path, netlink_socket)


def netlink_socket() -> socket.socket:
    """An rtnetlink socket, in this thread's network namespace."""
    return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0)


def _message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    """A netlink message: its header (length, type, flags, sequence number, port 0), then ``body``."""
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def _error_of(reply: bytes, at: int) -> int:
    """The errno an NLMSG_ERROR message at ``at`` carries (0: an acknowledgement)."""
    return -struct.unpack_from("=i", reply, at + 16)[0]


def exchange(sock: socket.socket, messages: list[bytes], ignore: tuple[int, ...] = ()) -> list[int]:
    """Send ``messages`` (numbered 1..n, each asking for an acknowledgement) in one write and read
    every answer: the errnos in ``ignore`` are returned, any other raises :class:`NetlinkError`."""
    sock.send(b"".join(messages))
    pending = {struct.unpack_from("=I", m, 8)[0] for m in messages}
    ignored: list[int] = []
    failure: NetlinkError | None = None
    while pending:
        reply = sock.recv(65536)
        off = 0
        while off + 16 <= len(reply):
            length, kind, _, seq, _ = struct.unpack_from("=IHHII", reply, off)
            if length < 16:
                raise NetlinkError(f"a netlink message of {length} bytes")
            if kind == _NLMSG_ERROR and seq in pending:
                pending.discard(seq)
                error = _error_of(reply, off)
                if error in ignore:
                    ignored.append(error)
                elif error and failure is None:
                    failure = NetlinkError(error, f"netlink request {seq}: {os.strerror(error)}")
            off += (length + 3) & ~3
    if failure is not None:
        raise failure
    return ignored


def _route_message(seq: int, address: str) -> bytes:
    """``ip route add unreachable <address>``: an address (/32 or /128) or a network (``a.b.c.d/n``)."""
    net = ipaddress.ip_network(address)
    family = socket.AF_INET6 if net.version == 6 else socket.AF_INET
    dst = net.network_address.packed
    rta = struct.pack("=HH", 4 + len(dst), _RTA_DST) + dst
    rta += b"\0" * (-len(rta) % 4)
    rtm = struct.pack(
        "=BBBBBBBBI",
        family,
        net.prefixlen,
        0,
        0,
        _RT_TABLE_MAIN,
        _RTPROT_BOOT,
        _RT_SCOPE_UNIVERSE,
        _RTN_UNREACHABLE,
        0,
    )
    return _message(_RTM_NEWROUTE, _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE | _NLM_F_EXCL, seq, rtm + rta)


@functools.lru_cache(maxsize=4)
def _route_messages(addresses: tuple[str, ...]) -> tuple[bytes, ...]:
    """The messages for these addresses, numbered from 1: the same at every start on this host."""
    return tuple(_route_message(seq, address) for seq, address in enumerate(addresses, 1))


def add_unreachable_routes(netns_path: str, addresses: list[str]) -> None:
    """``ip route add unreachable <a>/32`` (or /128, or the network's own prefix) for each address, in
    that namespace."""
    with socket_in(netns_path) as sock:
        sock.bind((0, 0))
        add_unreachable_routes_on(sock, addresses)


def add_unreachable_routes_on(sock: socket.socket, addresses: list[str]) -> None:
    """The same, over a bound rtnetlink socket of that namespace (a route there already is kept)."""
    if addresses:
        exchange(sock, list(_route_messages(tuple(addresses))), ignore=(17,))  # EEXIST: there already


# sock_diag (linux/sock_diag.h, linux/unix_diag.h): the host's Unix sockets, asked of the kernel.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_DUMP = 0x300
_NLMSG_DONE = 3
_UDIAG_SHOW_NAME = 1
_UNIX_DIAG_NAME = 0
# Every socket a path can reach: a listening one, or one bound and unconnected (a datagram socket
# such as /dev/log, or a stream socket bound but not listening yet). A connected socket (an
# accepted connection carries its listener's path, which is listed with the listener; a connected
# datagram socket takes datagrams from its peer only) is left out by the kernel before it is
# formatted: at a thousand prompts in flight nearly all of the host's sockets are connected pairs.
_TCP_CLOSE, _TCP_LISTEN = 7, 10
_REACHABLE_STATES = (1 << _TCP_CLOSE) | (1 << _TCP_LISTEN)
_MESSAGE_HEAD = struct.Struct("=IH")
_ATTRIBUTE_HEAD = struct.Struct("=HH")


def bound_unix_paths() -> list[str]:
    """The paths of the Unix sockets of this network namespace that a ``connect()`` or a datagram may
    reach (not abstract names): what ``/proc/net/unix`` lists with a path, without reading a line per
    socket of the host. :class:`OSError` where the kernel has no ``unix_diag``."""
    request = struct.pack(
        "=BBHIIIII", socket.AF_UNIX, 0, 0, _REACHABLE_STATES, 0, _UDIAG_SHOW_NAME, 0xFFFFFFFF, 0xFFFFFFFF
    )
    names: list[bytes] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(10)
        sock.send(_message(_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, request))
        while True:
            data = sock.recv(1 << 18)
            if not data:
                raise NetlinkError("sock_diag: the dump ended without its last message")
            off = 0
            while off + 16 <= len(data):
                length, kind = _MESSAGE_HEAD.unpack_from(data, off)
                if length < 16:
                    raise NetlinkError(f"sock_diag: a message of {length} bytes")
                if kind == _NLMSG_DONE:
                    # Decoded as the file system would (undecodable bytes kept as surrogates).
                    return [name.decode("utf-8", "surrogateescape") for name in names]
                if kind == _NLMSG_ERROR:
                    error = _error_of(data, off)
                    raise NetlinkError(error, f"sock_diag: {os.strerror(error)}")
                at, end = off + 16 + 16, off + length  # after the header and the unix_diag_msg
                while at + 4 <= end:
                    size, attribute = _ATTRIBUTE_HEAD.unpack_from(data, at)
                    if size < 4:
                        break
                    if attribute == _UNIX_DIAG_NAME and size > 4 and data[at + 4] != 0:  # 0: abstract
                        names.append(data[at + 4 : at + size].partition(b"\0")[0])
                    at += (size + 3) & ~3
                off += (length + 3) & ~3
