"""Probes of the host, for the local backend: whether bubblewrap and user-mode networking work, the
host's own addresses (kept out of reach), bound Unix sockets in the system view, where a cwd may lie."""

from __future__ import annotations

import functools
import ipaddress
import os
import posixpath
import re
import shutil
import subprocess

from batchrun.prompt.sandboxes._process import run_reaped
from batchrun.prompt.sandboxes.local.netlink import bound_unix_paths
from batchrun.prompt.sandboxes.local.options import DEFAULT_WORKDIR
from batchrun.prompt.sandboxes.local.system_view import NAMESPACES, NO_CWD, SYSTEM_DIRS, system_mounts


def system_sockets() -> list[str]:
    """Bound Unix sockets inside the mounted system directories.

    A read-only bind does not stop ``connect()``. Daemons keep their sockets in /run or /var/run,
    which the sandbox does not see; one in /etc or /usr would be reachable, so it is masked.
    The kernel is asked at every sandbox start (``netlink.bound_unix_paths``: only the sockets a
    path can reach; ``/proc/net/unix`` has a line per socket of the host, and its read took 0.77 ms
    of CPU against the dump's 0.14 at a thousand prompts in flight), or the file is read where the
    kernel cannot answer; the paths are resolved only when the set of bound paths changed since the last start
    (resolving every path is a syscall or more per socket of the host).
    """
    global _diag_works
    if _diag_works:
        try:
            return list(_system_sockets_among(frozenset(bound_unix_paths())))
        except OSError:
            _diag_works = False  # no unix_diag in this kernel: the file from now on
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    # The 8th column, when it is a path: unbound and abstract (@name) sockets go with the network
    # namespace. One regular expression over the file, not a split per line.
    return list(_system_sockets_among(frozenset(_SOCKET_PATH.findall(text))))


_diag_works = True


# The path column is the last, and no column before it holds a "/": the rest of a line from its
# first " /". A search for that literal pair, not a pattern tried at every line (~15% of a busy
# worker's CPU with a line per socket of a thousand sandboxes).
_SOCKET_PATH = re.compile(r" (/[^\n]*)")


@functools.lru_cache(maxsize=4)
def _system_sockets_among(paths: frozenset[str]) -> tuple[str, ...]:
    dirs = [d for d in SYSTEM_DIRS if not os.path.islink(d)]
    found = {real for real in map(os.path.realpath, paths) if any(is_within(real, d) for d in dirs)}
    return tuple(sorted(found))


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate commands on this machine, or None when it can (probed once)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (on Debian: apt-get install bubblewrap)"
    try:
        argv = ["bwrap", *NAMESPACES, *system_mounts(), "--tmpfs", "/tmp", "--remount-ro", "/", "true"]
        done = run_reaped(argv, timeout_s=20)  # not subprocess.run: its inner child could outlive us
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not be run: {exc}"
    if done.returncode != 0:
        said = f"bubblewrap does not work here: {done.stderr.decode(errors='replace').strip()}"
        refused = userns_refused()
        return f"{said}; {refused}" if refused else said
    return None


# The settings that refuse a user who is not root user namespaces, which bubblewrap needs then: each
# file, the value that refuses, and how to allow them.
_USERNS_SETTINGS = (
    ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
     "kernel.apparmor_restrict_unprivileged_userns=1: an AppArmor profile for bwrap must allow them, or set it to 0"),
    ("/proc/sys/kernel/unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone=0: set it to 1"),
    ("/proc/sys/user/max_user_namespaces", "0", "user.max_user_namespaces=0: set it above 0"),
)  # fmt: skip


@functools.cache
def userns_refused() -> str | None:
    """Why this user, not root, may not make user namespaces (what unprivileged bubblewrap needs), or None
    when it may (or is root: bubblewrap needs none then)."""
    if os.geteuid() == 0:
        return None
    unshare = shutil.which("unshare")
    try:
        done = (
            subprocess.run([unshare, "--user", "true"], capture_output=True, timeout=20) if unshare else None
        )
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0:
        return None
    last = done.stderr.decode(errors="replace").strip().splitlines() if done is not None else []
    said = f" (unshare --user: {last[-1][:200]})" if last else ""
    for path, refusing, fix in _USERNS_SETTINGS:
        try:
            with open(path) as f:
                if f.read().strip() == refusing:
                    return f"this user may not make user namespaces{said}: {fix}"
        except OSError:
            continue
    # no unshare to try with, and no setting that refuses them: nothing to tell
    return f"this user may not make user namespaces{said}" if done is not None else None


@functools.cache
def network_problem() -> str | None:
    """Why the sandbox cannot get user-mode networking (``slirp4netns``), or None."""
    if shutil.which("slirp4netns") is None:
        return "slirp4netns is not installed (on Debian: apt-get install slirp4netns)"
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if missing:  # needed to keep the host's own addresses out of reach
        return f"{' and '.join(missing)} not found (on Debian: apt-get install iproute2 util-linux)"
    return None


# Networks no sandbox reaches, beside the host's own addresses: IPv4's link-local range, where clouds
# serve their instance metadata and credentials (169.254.169.254 on AWS, GCP and Azure, 169.254.170.2
# for ECS tasks). slirp4netns makes a sandbox's connections from the host's own sockets, so without
# this a command reached them as the host does (and took the machine's cloud role, say).
NEVER_REACHED = ("169.254.0.0/16",)


def blocked_addresses() -> list[str]:
    """What a sandbox's network must not reach: the host's own addresses and ``NEVER_REACHED``
    (unreachable routes in its network namespace, and in its worker's hub)."""
    return [*host_addresses(), *NEVER_REACHED]


def host_addresses() -> list[str]:
    """The host's own addresses but loopback and link-local, looked up at each start (bridges come and
    go): read from ``/proc`` (no process per start), or from
    ``ip -o addr`` where those files cannot be read."""
    try:
        return list(_proc_addresses(*_proc_address_files()))
    except (OSError, ValueError):
        return _public(_ip_addresses())


def _public(found: list[str]) -> list[str]:
    return sorted(
        {str(a) for a in map(ipaddress.ip_address, found) if not (a.is_loopback or a.is_link_local)}
    )


def _proc_address_files() -> tuple[str, str]:
    with open("/proc/net/fib_trie", encoding="ascii") as f:
        trie = f.read()
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            inet6 = f.read()
    except FileNotFoundError:  # no IPv6 on this host
        inet6 = ""
    return trie, inet6


@functools.lru_cache(maxsize=4)
def _proc_addresses(trie: str, inet6: str) -> tuple[str, ...]:
    """IPv4: the ``/32 host LOCAL`` entries of ``/proc/net/fib_trie`` (every address of an interface,
    secondary ones included); IPv6: ``/proc/net/if_inet6``. Parsed again only when the files
    changed since the last start (the parsing is the costly part)."""
    found: list[str] = []
    last = None
    for line in trie.splitlines():
        text = line.strip()
        if text.startswith("|--"):
            last = text[3:].strip()
        elif text == "/32 host LOCAL" and last:
            found.append(last)
    found += [
        str(ipaddress.IPv6Address(int(line.split()[0], 16))) for line in inet6.splitlines() if line.strip()
    ]
    return tuple(_public(found))


def _ip_addresses() -> list[str]:
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    parts = [line.split() for line in out.splitlines()]
    return [p[3].split("/")[0] for p in parts if len(p) >= 4 and p[2] in ("inet", "inet6")]


@functools.cache
def tool_path(name: str) -> str:
    """Where a program started at every sandbox start is (bwrap, slirp4netns), looked up once: given a
    bare name, ``subprocess`` tries each ``PATH`` entry in turn at every start (with this machine's
    16 entries before /usr/bin, ~0.15 ms of CPU a start; measured in benchmarks/README.md)."""
    return shutil.which(name) or name


@functools.cache
def command_shell() -> str:
    """bash when installed, else sh; looked up once, not on every command."""
    return shutil.which("bash") or "sh"


def local_isolation_available() -> bool:
    """Whether the local backend can isolate commands with bubblewrap on this machine."""
    return bwrap_problem() is None


def is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def sandbox_workdir(cwd: str) -> str:
    """``cwd`` as the absolute, normal path inside the sandbox it names (``DEFAULT_WORKDIR`` for "").

    ``posixpath.normpath`` keeps a leading ``//`` (POSIX leaves its meaning to the system); Linux reads
    it as ``/``, so it is one ``/`` here: ``//proc`` is ``/proc``."""
    path = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, cwd))
    return "/" + path.lstrip("/")


def sandbox_cwd_problem(cwd: str) -> str | None:
    """Why ``cwd`` (a path inside the sandbox) cannot be a bubblewrap sandbox's working directory."""
    path = sandbox_workdir(cwd)
    if path in NO_CWD or any(is_within(path, d) for d in NO_CWD[1:]):
        return f"cwd {cwd!r} would replace a directory the sandbox needs (/, /dev, /proc, /sys)"
    for d in SYSTEM_DIRS:
        if is_within(path, d):
            return f"cwd {cwd!r} lies in the read-only system directory {d}"
    return None


def host_cwd_problem(cwd: str, cwd_root: str | None) -> str | None:
    """Isolation "none": why a row's absolute ``cwd`` (a host path) may not be used."""
    if not cwd.startswith("/"):
        return None  # relative: inside the prompt's private directory
    if cwd_root is None:
        return f"cwd {cwd!r} is a host directory and --local_isolation=none; name its parent with --cwd_root"
    if not is_within(os.path.realpath(cwd), os.path.realpath(cwd_root)):
        return f"cwd {cwd!r} is outside --cwd_root {cwd_root}"
    return None


# bwrap fails the set-up when a masked socket vanished since the scan: try again with a new scan.
