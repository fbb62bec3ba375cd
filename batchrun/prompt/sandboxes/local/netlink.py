"""Unreachable routes in another network namespace, over rtnetlink from this process.

``nsenter --net=... ip -batch -`` costs two processes per sandbox start (~4 ms of CPU). When
this process may enter the namespace itself (it has CAP_SYS_ADMIN over it, as root), a short-lived
thread enters it only to open a netlink socket there (a socket belongs to the namespace it was
made in), leaves again, and the routes are added over that socket. ``setns`` of a network
namespace moves only the calling thread, and that thread ends right after, whatever happens.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import socket
import struct
import threading

CLONE_NEWNET = 0x40000000
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


def socket_in(netns_path: str) -> socket.socket:
    """An rtnetlink socket inside the network namespace at ``netns_path`` (a /proc/<pid>/ns/net link)."""
    result: list[socket.socket | BaseException] = []

    def enter() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _setns()(target, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise NetlinkError(err, f"setns: {os.strerror(err)}")
                try:
                    result.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0))
                finally:
                    _setns()(own, CLONE_NEWNET)  # and should that fail, this thread ends now anyway
            finally:
                os.close(own)
                os.close(target)
        except BaseException as exc:  # handed to the caller
            result.append(exc)

    thread = threading.Thread(target=enter, name="netns-enter", daemon=True)
    thread.start()
    thread.join()
    got = result[0] if result else NetlinkError("no result")
    if isinstance(got, BaseException):
        raise got if isinstance(got, OSError) else NetlinkError(str(got))
    return got


def _route_message(seq: int, address: str) -> bytes:
    addr = ipaddress.ip_address(address)
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    dst = addr.packed
    rta = struct.pack("=HH", 4 + len(dst), _RTA_DST) + dst
    rta += b"\0" * (-len(rta) % 4)
    rtm = struct.pack(
        "=BBBBBBBBI",
        family,
        len(dst) * 8,
        0,
        0,
        _RT_TABLE_MAIN,
        _RTPROT_BOOT,
        _RT_SCOPE_UNIVERSE,
        _RTN_UNREACHABLE,
        0,
    )
    flags = _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE | _NLM_F_EXCL
    body = rtm + rta
    return struct.pack("=IHHII", 16 + len(body), _RTM_NEWROUTE, flags, seq, 0) + body


@functools.lru_cache(maxsize=4)
def _route_messages(addresses: tuple[str, ...]) -> tuple[bytes, ...]:
    """The messages for these addresses, numbered from 1: the same at every start on this host."""
    return tuple(_route_message(seq, address) for seq, address in enumerate(addresses, 1))


def add_unreachable_routes(netns_path: str, addresses: list[str]) -> None:
    """``ip route add unreachable <a>/32`` (or /128) for each address, in that namespace."""
    messages = _route_messages(tuple(addresses))
    sock = socket_in(netns_path)
    with sock:
        sock.bind((0, 0))
        for seq, (address, message) in enumerate(zip(addresses, messages), 1):
            sock.send(message)
            reply = sock.recv(65536)
            length, kind, _, got_seq, _ = struct.unpack_from("=IHHII", reply)
            if kind != _NLMSG_ERROR or got_seq != seq:
                raise NetlinkError(f"unexpected netlink reply {kind} for {address}")
            (error,) = struct.unpack_from("=i", reply, 16)
            if error not in (0, -17):  # 0: done; EEXIST: there already
                raise NetlinkError(-error, f"route to {address}: {os.strerror(-error)}")
