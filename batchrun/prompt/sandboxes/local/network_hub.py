"""One slirp4netns per worker, each prompt on a link of its own into it (root only).

A slirp4netns per prompt was ~4-6 ms of CPU at every start (its exec, its own sandbox's
``pivot_root``, a tap device made and torn down), about a fifth of a terminal prompt's whole cost
(benchmarks/README.md). Here a worker makes one *hub*: a network namespace of its own with one
slirp4netns, started once, connected to it. Each prompt's network namespace gets a veth link into
the hub, made by netlink from this process (no process per prompt), with an address of its own from
198.18.0.0/15 (reserved for benchmarking, RFC 2544: no real host has one) and the same gateway
(10.0.2.2) and DNS (10.0.2.3) as a slirp4netns of its own would give it.

What a prompt can reach is what it could reach before: the outside world, through slirp4netns
(``--disable-host-loopback``: its gateway does not lead to the host's 127.0.0.1); not the host's
other addresses, nor the link-local range of a cloud's metadata service (unreachable routes, in the
hub for all and in the prompt's own namespace); and not
another prompt of the same hub: the hub forwards nothing from one prompt's address to another's (a
routing rule that prohibits it), and it drops a packet whose source is not the address of the link
it came in on (strict reverse-path filtering; a prompt has no capability to forge one anyway). Each
link is a point-to-point pair, so no prompt sees another's frames. A prompt's link ends with its
network namespace; the hub and its slirp4netns end with the worker, however it dies (slirp4netns's
exit pipe), or are made again when slirp4netns has died.

Only where this process may make a network namespace and enter the prompt's (root, as with the
netlink routes); unprivileged bubblewrap keeps one slirp4netns per prompt (``command_server``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import subprocess
import tempfile
import threading
from typing import IO

from batchrun.prompt.sandboxes.base import readable
from batchrun.prompt.sandboxes.local.host import blocked_addresses, tool_path
from batchrun.prompt.sandboxes.local.netlink import (
    NetlinkError,
    _message,
    add_unreachable_routes_on,
    exchange,
    in_namespace,
    netlink_socket,
    socket_in,
)
from batchrun.prompt.sandboxes.local.process_tree import wait_exited

PROMPT_NET = ipaddress.ip_network("198.18.0.0/15")  # prompts' addresses: RFC 2544, never a real host's
GATEWAY, DNS = "10.0.2.2", "10.0.2.3"  # slirp4netns's, as a prompt's own slirp4netns gives them
MTU = 65520
_PROMPT_IFINDEX = 2  # the prompt's end, in a namespace that has only its loopback (1)
_FIRST_HUB_IFINDEX = 1000  # the hub's ends: lo is 1, slirp4netns's tap0 2
_READY_TIMEOUT_S = 20.0

_RTM_NEWLINK, _RTM_NEWADDR, _RTM_NEWROUTE, _RTM_NEWRULE = 16, 20, 24, 32
_F_REQUEST, _F_ACK, _F_EXCL, _F_CREATE = 0x1, 0x4, 0x200, 0x400
_NEW = _F_REQUEST | _F_ACK | _F_CREATE | _F_EXCL
_IFF_UP = 0x1
_IFLA_IFNAME, _IFLA_MTU, _IFLA_LINKINFO, _IFLA_NET_NS_FD = 3, 4, 18, 28
_IFLA_INFO_KIND, _IFLA_INFO_DATA, _VETH_INFO_PEER = 1, 2, 1
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_RTA_DST, _RTA_OIF, _RTA_GATEWAY = 1, 4, 5
_FRA_DST, _FRA_SRC, _FRA_PRIORITY = 1, 2, 6
_RT_TABLE_MAIN, _RTPROT_BOOT, _RTN_UNICAST = 254, 3, 1
_RT_SCOPE_UNIVERSE, _RT_SCOPE_LINK = 0, 253
_FR_ACT_PROHIBIT = 8
_RULE_PRIORITY = 100  # before the main table (32766): no prompt-to-prompt route is ever looked up
_EEXIST, _EBUSY = 17, 16


def _attr(kind: int, payload: bytes) -> bytes:
    """A netlink attribute, padded to 4 bytes."""
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _ifinfo(index: int = 0, up: bool = False) -> bytes:
    """An ifinfomsg; ``up``: IFF_UP set, and the only flag changed."""
    flag = _IFF_UP if up else 0
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, flag, flag)


def _veth_message(seq: int, index: int, peer_name: str, peer_index: int, peer_netns_fd: int) -> bytes:
    """``ip link add eth0 index I mtu M type veth peer name P index J mtu M netns <fd>``: both ends
    down (a veth end cannot be brought up before its peer is linked to it: ENOTCONN)."""
    peer = _ifinfo(peer_index) + _attr(_IFLA_IFNAME, peer_name.encode() + b"\0")
    peer += _attr(_IFLA_MTU, struct.pack("=I", MTU)) + _attr(
        _IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd)
    )
    info = _attr(_IFLA_INFO_KIND, b"veth\0") + _attr(_IFLA_INFO_DATA, _attr(_VETH_INFO_PEER, peer))
    body = _ifinfo(index) + _attr(_IFLA_IFNAME, b"eth0\0") + _attr(_IFLA_MTU, struct.pack("=I", MTU))
    return _message(_RTM_NEWLINK, _NEW, seq, body + _attr(_IFLA_LINKINFO, info))


def _up_message(seq: int, index: int) -> bytes:
    """``ip link set <index> up``."""
    return _message(_RTM_NEWLINK, _F_REQUEST | _F_ACK, seq, _ifinfo(index, up=True))


def _address_message(seq: int, index: int, address: str) -> bytes:
    packed = socket.inet_aton(address)
    body = struct.pack("=BBBBi", socket.AF_INET, 32, 0, _RT_SCOPE_UNIVERSE, index)
    return _message(_RTM_NEWADDR, _NEW, seq, body + _attr(_IFA_LOCAL, packed) + _attr(_IFA_ADDRESS, packed))


def _route_to(seq: int, dst: str | None, index: int, gateway: str | None = None) -> bytes:
    """A unicast route in the main table: to ``dst``/32 on the link (or the default, via ``gateway``)."""
    scope = _RT_SCOPE_LINK if gateway is None else _RT_SCOPE_UNIVERSE
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, 32 if dst else 0, 0, 0, _RT_TABLE_MAIN, _RTPROT_BOOT,
                       scope, _RTN_UNICAST, 0)  # fmt: skip
    if dst:
        body += _attr(_RTA_DST, socket.inet_aton(dst))
    if gateway:
        body += _attr(_RTA_GATEWAY, socket.inet_aton(gateway))
    return _message(_RTM_NEWROUTE, _NEW, seq, body + _attr(_RTA_OIF, struct.pack("=i", index)))


def _isolation_rule(seq: int) -> bytes:
    """``ip rule add pref 100 from 198.18.0.0/15 to 198.18.0.0/15 prohibit``: no prompt reaches another."""
    net, bits = PROMPT_NET.network_address.packed, PROMPT_NET.prefixlen
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, bits, bits, 0, 0, 0, 0, _FR_ACT_PROHIBIT, 0)
    body += _attr(_FRA_PRIORITY, struct.pack("=I", _RULE_PRIORITY))
    body += _attr(_FRA_SRC, net) + _attr(_FRA_DST, net)
    return _message(_RTM_NEWRULE, _NEW, seq, body)


class NetworkHub:
    """A worker's network namespace with one slirp4netns, and the links of its prompts into it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._blocked: set[str] = set()
        self.netns_fd, self._sock = self._make_namespace()
        self._slirp: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None  # what slirp4netns says
        self._exit_w: int | None = None
        try:
            self._start_slirp()
            self._configure()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _make_namespace() -> tuple[int, socket.socket]:
        """A new network namespace (its descriptor holds it) and an rtnetlink socket in it."""

        def make() -> tuple[int, socket.socket]:
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                sock = netlink_socket()
                try:
                    # Forwarding, with strict reverse-path filtering and proxy ARP (the prompts ask their
                    # link for 10.0.2.2; slirp4netns asks tap0 for a prompt's address) on every link; no
                    # IPv6 on the hub's side (slirp4netns is not asked for any).
                    for path, value in (
                        ("ipv4/conf/all/rp_filter", "1"), ("ipv4/conf/default/rp_filter", "1"),
                        ("ipv4/conf/default/proxy_arp", "1"), ("ipv6/conf/default/disable_ipv6", "1"),
                        ("ipv6/conf/all/disable_ipv6", "1"), ("ipv4/ip_forward", "1"),
                    ):  # fmt: skip
                        with open(f"/proc/sys/net/{path}", "w", encoding="ascii") as f:
                            f.write(value)
                except BaseException:
                    sock.close()
                    raise
            except BaseException:
                os.close(fd)
                raise
            return fd, sock

        fd, sock = in_namespace(None, make)
        sock.bind((0, 0))
        sock.settimeout(10)
        return fd, sock

    def _start_slirp(self) -> None:
        exit_r, self._exit_w = os.pipe()
        ready_r, ready_w = os.pipe()
        argv = [tool_path("slirp4netns"), "--configure", f"--mtu={MTU}", "--disable-host-loopback",
                "--enable-sandbox", f"--exit-fd={exit_r}", f"--ready-fd={ready_w}", "--netns-type=path",
                f"/proc/self/fd/{self.netns_fd}", "tap0"]  # fmt: skip
        # What it says goes to an unlinked file, not a pipe: nobody reads a pipe while the worker
        # runs, and a full one would stop slirp4netns, and every prompt's network with it.
        self._log = tempfile.TemporaryFile()
        try:
            # Nothing of the runner's environment (API keys) in a process that parses the prompts' packets.
            self._slirp = subprocess.Popen(
                argv, pass_fds=(exit_r, ready_w, self.netns_fd), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True,
                env={"PATH": os.environ.get("PATH", os.defpath)},
            )  # fmt: skip
        finally:
            os.close(exit_r)
            os.close(ready_w)
        try:
            ready = readable(ready_r, _READY_TIMEOUT_S) and os.read(ready_r, 1)
        finally:
            os.close(ready_r)
        if ready != b"1":
            raise NetlinkError(f"the worker's slirp4netns did not start: {self._slirp_said()}")

    def _slirp_said(self) -> str:
        slirp = self._slirp
        if slirp is None or self._log is None:
            return "no output"
        if slirp.poll() is None:
            slirp.kill()
            slirp.wait()
        self._log.seek(0)
        return self._log.read().decode(errors="replace").strip()[-300:] or f"exit code {slirp.returncode}"

    def _configure(self) -> None:
        exchange(self._sock, [_isolation_rule(1)])
        self._block_host_addresses(blocked_addresses())

    def _block_host_addresses(self, addresses: list[str]) -> None:
        """Unreachable routes in the hub to every address of the host and to ``host.NEVER_REACHED``
        (bridges come and go: checked at every attach, added when new; one that went away stays
        unreachable, which costs nothing). IPv4 only: the hub has no IPv6."""
        new = [a for a in addresses if a not in self._blocked and ":" not in a]
        add_unreachable_routes_on(self._sock, new)
        self._blocked.update(new)

    def alive(self) -> bool:
        return self._slirp is not None and self._slirp.poll() is None and self._exit_w is not None

    def attach(self, netns_path: str, blocked: list[str]) -> str:
        """Give the namespace at ``netns_path`` a link into the hub and its address (returned); with
        unreachable routes to ``blocked`` (the host's addresses) there and in the hub."""
        with socket_in(netns_path) as sock:
            sock.bind((0, 0))
            sock.settimeout(10)
            for _ in range(8):  # an index or a name still held by a link whose namespace is ending
                with self._lock:
                    self._block_host_addresses(blocked)
                    n = self._next
                    self._next += 1
                    peer_index = _FIRST_HUB_IFINDEX + n % 1_000_000
                    address = str(PROMPT_NET.network_address + 1 + n % (PROMPT_NET.num_addresses - 2))
                    errors = exchange(
                        sock, [_veth_message(1, _PROMPT_IFINDEX, f"brp{n:x}", peer_index, self.netns_fd)],
                        ignore=(_EEXIST, _EBUSY),
                    )  # fmt: skip
                    if errors:
                        continue
                    exchange(self._sock, [_up_message(1, peer_index), _route_to(2, address, peer_index)])
                break
            else:
                raise NetlinkError("no free link index in the worker's network hub")
            exchange(sock, [
                _up_message(1, _PROMPT_IFINDEX),
                _address_message(2, _PROMPT_IFINDEX, address),
                _route_to(3, GATEWAY, _PROMPT_IFINDEX),
                _route_to(4, None, _PROMPT_IFINDEX, gateway=GATEWAY),
            ], ignore=(_EEXIST,))  # fmt: skip
            add_unreachable_routes_on(sock, blocked)
        return address

    def close(self) -> None:
        exit_w, self._exit_w = self._exit_w, None
        if exit_w is not None:
            os.close(exit_w)  # slirp4netns ends
        slirp, self._slirp = self._slirp, None
        if slirp is not None:
            if not wait_exited(slirp, 1.0):
                slirp.kill()
                slirp.wait()
        log, self._log = self._log, None
        if log is not None:
            log.close()
        self._sock.close()
        os.close(self.netns_fd)


# BATCH_RUNNER_NETWORK_HUB=0: a slirp4netns per prompt everywhere (the tests and benchmarks compare both).
ENABLED = os.environ.get("BATCH_RUNNER_NETWORK_HUB", "1") != "0"
_hub: NetworkHub | None = None
_hub_pid = 0
_hub_lock = threading.Lock()
hub_problem: str | None = None  # why this worker has no hub (it keeps a slirp4netns per prompt), once tried


def hub() -> NetworkHub | None:
    """This process's hub, made at its first use (again if its slirp4netns has died); None where one
    cannot be made here (not root, say): the caller starts a slirp4netns of the prompt's own."""
    global _hub, _hub_pid, hub_problem
    with _hub_lock:
        if _hub_pid != os.getpid():  # a fork's copy is not this process's: its slirp4netns is the parent's
            _hub, _hub_pid, hub_problem = None, os.getpid(), None
        if _hub is not None and _hub.alive():
            return _hub
        if hub_problem is not None:
            return None
        old, _hub = _hub, None
        if old is not None:
            old.close()
        try:
            _hub = NetworkHub()
        except OSError as exc:
            hub_problem = str(exc) or type(exc).__name__
            return None
        return _hub


def close_hub() -> None:
    """End this process's hub and its slirp4netns now (a benchmark's figures, a test); the next
    networked start makes a new one."""
    global _hub
    with _hub_lock:
        old, _hub = _hub, None
        if old is not None and _hub_pid == os.getpid():
            old.close()
