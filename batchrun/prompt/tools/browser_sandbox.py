"""Chromium's own sandbox for the worker's browser (see ``BROWSER_UID`` in config.py).

Chromium renders pages the model picks, on the host. Started with ``--no-sandbox`` (Playwright's default)
every renderer ran as the worker's user, root in CI, with no seccomp filter and in the host's
namespaces: code a page got to run in one read root-only files and connected to 127.0.0.1 past the
egress proxy (shown with gdb in a real renderer). With its sandbox on, Chromium puts its renderers (and
the GPU process) in user, PID and network namespaces of their own under a seccomp-bpf filter.

Chromium refuses its sandbox as root, so a root worker starts it as ``BROWSER_UID``:``BROWSER_GID``
(nobody), without capabilities or supplementary groups and with no_new_privs (``setpriv``, in the
launcher): then even the browser process holds nothing of root's. A worker that is not root keeps its
own user.

The browser process and its network service stayed in the host's network and PID namespaces: a page
that broke out of a renderer into them connected to any service on 127.0.0.1 (and the host's other
addresses) past the egress proxy, and, as the same nobody as every other worker's Chromium with no Yama
here, attached gdb to another worker's browser and read its pages. A root worker therefore starts the
whole of Chromium (:func:`isolate_command`, in the launcher) in a network namespace it made
(:func:`make_netns`) that holds only its loopback, on which the worker listens for each prompt's egress
proxy (:func:`listen_in`): no other address, no route, no DNS (Chromium asks the proxy for names); in
a PID namespace of its own, with its own /proc, where no other process is to be seen; and in a mount
namespace of its own, on a root of its own (:func:`new_root_script`): the system's directories
read-only, a minimal /dev, and its own profile alone in the temporary directory (every worker's profile,
its pages' cache, cookies and storage, belongs to the same nobody). The browser, GPU and network processes are
outside the renderers' seccomp filter, and as nobody on the host's root one a page took over read the
dataset (its rows' expected answers), the run's directory (every prompt's trajectories) and the source
trees, all world-readable. A worker that is not root cannot make the network namespace (it could not
listen inside it), but puts its Chromium on the same root of its own all the same, in user, mount and
PID namespaces (:func:`own_root_command`): else it read every file of the runner's user, its home too.
Where that cannot be, the run's start says so.

The sandbox needs user namespaces for that user: a root-run Docker container's default seccomp profile,
a kernel or AppArmor policy, may refuse them. :func:`plan` tries one, once per process; where that is
refused (or util-linux's ``setpriv``/``unshare`` are missing) Chromium runs without its sandbox, as root
still if it cannot change user, and the run's start and the worker's log say why.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass

from batchrun.prompt.sandboxes.local.system_view import SYSTEM_DIRS
from batchrun.prompt.tools.config import BROWSER_GID, BROWSER_UID


@dataclass(frozen=True)
class SandboxPlan:
    """How this process's Chromium starts."""

    sandbox: bool  # Chromium's own sandbox on (no --no-sandbox)
    user: tuple[int, int] | None  # (uid, gid) the launcher switches to; None: the worker's own
    problem: str | None = None  # why the sandbox is off (None when it is on)
    # Chromium, all of it, in network and PID namespaces of its own (a root worker's: isolate_command;
    # another's: own_root_command in a UserNetns); ``isolation_problem`` says why not where it could not be
    isolated: bool = False
    isolation_problem: str | None = None
    # A worker that is not root: Chromium, all of it, on a root of its own all the same, in user, mount and
    # PID namespaces of its own (own_root_command); ``isolation_problem`` says why not where it could not be
    own_root: bool = False

    def describe(self) -> str:
        """One line for the start of a run."""
        who = f"uid {self.user[0]}" if self.user else f"the runner's uid {os.geteuid()}"
        if self.sandbox:
            line = (
                f"Browser sandbox: Chromium runs as {who}, its renderers in user, PID and network namespaces "
                "of their own under seccomp-bpf"
            )
            if self.isolated:
                return (
                    line
                    + "; the whole of it in network and PID namespaces where it reaches only the egress proxy"
                    + ", on a root of its own that holds only the system's directories and its profile"
                )
            if self.own_root:
                said = (
                    line + "; the whole of it in PID and mount namespaces of its own, on a root of its own "
                    "that holds only the system's directories and its profile"
                )
                if not self.isolation_problem:
                    return said
                # A page that broke out of a renderer reaches the host's 127.0.0.1 past the egress proxy.
                return f"warning: {said}; its network is the host's ({self.isolation_problem})"
            # Its browser, GPU and network processes are outside the renderers' seccomp filter.
            why = f" ({self.isolation_problem})" if self.isolation_problem else ""
            return (
                f"warning: {line}; its browser process in the host's network and PID namespaces, and reads "
                f"every file {who} may read (the dataset, the run's directory){why}"
            )
        return (
            f"warning: Browser sandbox: OFF ({self.problem}): Chromium runs as {who} with --no-sandbox, "
            "a page that exploits its renderer runs there with that user's access to this host"
        )


def _run(argv: list[str]) -> str | None:
    """None if ``argv`` succeeds, else what it said (its last line of error output)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": os.defpath})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:200]


def _probe(prefix: list[str]) -> str | None:
    """None if ``prefix`` + unshare can make the user, PID and network namespaces Chromium's zygote
    makes; else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "util-linux's unshare is not installed: cannot tell whether user namespaces work"
    said = _run([*prefix, unshare, "--user", "--pid", "--net", "true"])
    return None if said is None else f"no user namespaces here ({said})"


def drop_command(user: tuple[int, int]) -> list[str]:
    """The setpriv command line the launcher execs Chromium through, as ``user``."""
    uid, gid = user
    setpriv = shutil.which("setpriv") or "setpriv"
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def make_netns() -> int:
    """A descriptor of a new network namespace with only its loopback, up (root only): Chromium's."""
    from batchrun.prompt.sandboxes.local.netlink import exchange, in_namespace, netlink_socket
    from batchrun.prompt.sandboxes.local.network_hub import _up_message

    def make() -> int:
        fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with netlink_socket() as sock:
                sock.bind((0, 0))
                sock.settimeout(10)
                exchange(sock, [_up_message(1, 1)])  # lo
        except BaseException:
            os.close(fd)
            raise
        return fd

    return in_namespace(None, make)


def listen_in(netns_fd: int) -> socket.socket:
    """A socket listening on 127.0.0.1 (a free port) inside the network namespace ``netns_fd``."""
    from batchrun.prompt.sandboxes.local.netlink import in_namespace

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    return in_namespace(netns_fd, make)


# What of the host's files Chromium's root holds, read-only (everything else is absent): the system
# directories the local sandbox shows a prompt's commands (its /usr, libraries, /etc), and fontconfig's
# cache of the system's fonts (without it every launch scans them again).
CHROMIUM_SYSTEM_DIRS = (*SYSTEM_DIRS, "/var/cache/fontconfig")
CHROMIUM_DEVICES = ("null", "zero", "random", "urandom")  # its /dev: the devices anyone may use


def new_root_script(executable: str) -> str:
    """The script isolate_command's shell runs, as root in Chromium's new mount namespace (private: nothing
    is seen outside it), with the profile directory and then the command.

    Chromium's browser process and its GPU, network and utility processes are outside the renderers'
    seccomp sandbox: as nobody on the host's root, one a page took over read every world-readable file
    (the dataset with its rows' expected answers, the run's directory with every prompt's trajectories,
    source trees, homes), connected to Unix sockets anyone may use, wrote to /var/tmp and /dev/shm. So
    it gets a root of its own: a small tmpfs mounted over the profile's path (the shell's working
    directory keeps the profile underneath) that holds CHROMIUM_SYSTEM_DIRS read-only, the directory of
    ``executable`` (symbolic links resolved: a Chromium in /opt, or Playwright's own in a home directory)
    where none of them holds it, CHROMIUM_DEVICES in /dev, the PID namespace's /proc, and the profile
    alone, at its path (no other worker's profile beside it); pivot_root makes it the root and the
    host's is detached. One command per mount, one mkdir and one ln for all: ~20 ms a launch."""
    q = shlex.quote
    real = os.path.dirname(os.path.realpath(executable))
    wanted = CHROMIUM_SYSTEM_DIRS
    if not any(real == d or real.startswith(d + "/") for d in wanted):
        wanted = (*wanted, real)
    links = [(os.readlink(d), d) for d in wanted if os.path.islink(d)]
    dirs = [d for d in wanted if not os.path.islink(d) and os.path.isdir(d)]
    lines = [
        "set -e",
        "profile=$1; shift; root=$profile",
        'cd "$profile"',
        'mount -t tmpfs -o size=1m,mode=755,nosuid,nodev,noexec br-chromium-root "$root"',
        'mkdir -p "$root$profile" "$root/proc" "$root/dev/shm"' + "".join(f' "$root"{q(d)}' for d in dirs),
    ]
    # merged /usr: /bin -> usr/bin, ... one ln for those named as their target in /
    together = [t for t, d in links if os.path.dirname(d) == "/" and os.path.basename(t) == d[1:]]
    if together:
        lines.append("ln -s " + " ".join(map(q, together)) + ' "$root"')
    lines += [f'ln -s {q(t)} "$root"{q(d)}' for t, d in links if t not in together]
    lines.append("; ".join(f': > "$root/dev/{n}"' for n in CHROMIUM_DEVICES))
    lines += [f'mount --no-canonicalize --bind -o ro {q(d)} "$root"{q(d)}' for d in dirs]
    lines += [
        'mount --no-canonicalize --bind . "$root$profile"',
        'mount -t proc -o nosuid,nodev,noexec proc "$root/proc"',
        *(f'mount --no-canonicalize --bind /dev/{n} "$root/dev/{n}"' for n in CHROMIUM_DEVICES),
        'cd "$root"',
        "PATH=/usr/sbin:/sbin:$PATH pivot_root . .",
        "umount -l .",
        "cd /",
        'exec "$@"',
    ]
    return "\n".join(lines) + "\n"


def isolate_command(netns_path: str, executable: str) -> list[str]:
    """What the launcher execs Chromium (``executable``) through, followed by Chromium's profile directory
    and then the rest of the command: to enter the network namespace at ``netns_path``, and a PID
    namespace (with its own /proc) and a mount namespace (on a root of its own, new_root_script) of its
    own. unshare stays as the process Playwright started, Chromium its child (PID 1 there): killed with it
    (--kill-child), and ending every process of the namespace when it ends; the pipe Playwright talks on
    (fds 3 and 4) passes through."""
    nsenter = shutil.which("nsenter") or "nsenter"
    unshare = shutil.which("unshare") or "unshare"
    return [
        nsenter,
        f"--net={netns_path}",
        "--",
        unshare,
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--",
        "/bin/sh",
        "-c",
        new_root_script(executable),
        "sh",
    ]


def own_root_command(executable: str, netns: tuple[str, str] | None = None) -> tuple[list[str], list[str]]:
    """For a worker that is not root: what the launcher execs Chromium (``executable``) through, in two
    parts, Chromium's profile directory between them. unshare makes a user namespace where the worker is
    root (its own uid outside), and mount and PID namespaces it owns, where new_root_script builds the same
    root as a root worker's Chromium gets (as with isolate_command, unshare stays Chromium's parent and
    ends it); then a second user namespace maps the worker's uid back: Chromium refuses its sandbox as
    root. With ``netns`` (the paths of a UserNetns's user and network namespaces) all that starts in them
    first: Chromium's network is then that loopback alone, where the worker's UserNetns makes the egress
    proxies' sockets. Needs util-linux 2.38 (--map-user)."""
    unshare = shutil.which("unshare") or "unshare"
    outer = [unshare, "--user", "--map-root-user", "--mount", "--pid", "--fork", "--kill-child",
             "--mount-proc", "--", "/bin/sh", "-c", new_root_script(executable), "sh"]  # fmt: skip
    if netns is not None:
        # --preserve-credentials: the keeper's user namespace denies setgroups (it maps one uid), and the
        # worker's uid is root there already
        nsenter = shutil.which("nsenter") or "nsenter"
        outer = [nsenter, "--preserve-credentials", f"--user={netns[0]}", f"--net={netns[1]}", "--", *outer]
    return outer, [unshare, "--user", f"--map-user={os.geteuid()}", f"--map-group={os.getegid()}", "--"]


# The keeper of a UserNetns: started by unshare in a new user and network namespace (stdlib only, run
# with -I -S), it sets the loopback up, says so, then answers each byte on its control socket with a
# socket listening on 127.0.0.1 (a free port) there, and ends when the worker closes its end.
_NETNS_KEEPER = """
import fcntl, socket, struct, sys
ctl = socket.socket(fileno=int(sys.argv[1]))
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", 0x1 | 0x8 | 0x40))  # SIOCSIFFLAGS: up, running
ctl.sendall(b"r")
while ctl.recv(1):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        socket.send_fds(ctl, [b"s"], [listener.fileno()])
"""


class UserNetns:
    """For a worker that is not root, a network namespace with only its loopback for its Chromium: the
    counterpart of make_netns + listen_in. The worker cannot enter a namespace (setns needs
    CAP_SYS_ADMIN where it is), so a small keeper process that lives in it (in a user namespace of its
    own, the worker's uid as root) makes the sockets the prompts' egress proxies listen on and passes
    them out; the worker accepts and serves them from the host's network as before, and Chromium,
    started in the keeper's namespaces (own_root_command), reaches nothing else. Close with ``close``:
    the keeper also ends when the worker does (its control socket closes)."""

    def __init__(self) -> None:
        import sys
        import threading

        unshare = shutil.which("unshare") or "unshare"
        ctl, theirs = socket.socketpair()
        self._proc: subprocess.Popen | None = None
        self._ctl = ctl
        self._lock = threading.Lock()
        self.fds: list[int] = []
        try:
            argv = [unshare, "--user", "--map-root-user", "--net", "--",
                    sys.executable or "python3", "-I", "-S", "-c", _NETNS_KEEPER, str(theirs.fileno())]  # fmt: skip
            self._proc = subprocess.Popen(
                argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, env={"PATH": os.defpath},
            )  # fmt: skip
            theirs.close()
            ctl.settimeout(10)
            if ctl.recv(1) != b"r":
                self._proc.wait(timeout=10)
                said = self._proc.stderr.read().decode(errors="replace").strip().splitlines()
                raise OSError(f"its keeper ended: {(said or ['no word'])[-1][:200]}")
            self.fds = [
                os.open(f"/proc/{self._proc.pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
                for ns in ("user", "net")
            ]
        except BaseException:
            theirs.close()
            self.close()
            raise

    @property
    def paths(self) -> tuple[str, str]:
        """Its user and network namespaces, as paths any process of this user may enter them by."""
        return (f"/proc/{os.getpid()}/fd/{self.fds[0]}", f"/proc/{os.getpid()}/fd/{self.fds[1]}")

    def listen(self) -> socket.socket:
        """A new socket listening on 127.0.0.1 (a free port) in the namespace, non-blocking."""
        with self._lock:
            try:
                self._ctl.sendall(b"l")
                _, fds, _, _ = socket.recv_fds(self._ctl, 1, 1, socket.MSG_CMSG_CLOEXEC)
            except OSError as exc:
                raise OSError(f"the browser's network namespace cannot listen: {exc}") from None
        if not fds:
            raise OSError("the browser's network namespace cannot listen: its keeper ended")
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        """End the keeper (the namespace ends with the last of Chromium's processes). Idempotent."""
        self._ctl.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stderr.close()


@functools.lru_cache(maxsize=1)
def plan() -> SandboxPlan:
    """How Chromium starts here (tried once per process; the answer does not change within a run)."""
    if os.geteuid() != 0:
        problem = _probe([])
        if problem is not None:
            return SandboxPlan(sandbox=False, user=None, problem=problem)
        outer, inner = own_root_command("/bin/sh")
        said = _root_check(outer, inner)
        if said is not None:
            return SandboxPlan(
                sandbox=True, user=None, isolation_problem=f"cannot have a root of its own: {said}"
            )
        network_problem = _user_netns_probe()
        return SandboxPlan(
            sandbox=True,
            user=None,
            own_root=True,
            isolated=network_problem is None,
            isolation_problem=network_problem,
        )
    user = (BROWSER_UID, BROWSER_GID)
    if shutil.which("setpriv") is None:
        return SandboxPlan(
            sandbox=False, user=None, problem="util-linux's setpriv is not installed: cannot leave root"
        )
    drop = drop_command(user)
    said = _run([*drop, "true"])  # a container that maps only root has no uid to switch to
    if said is not None:
        return SandboxPlan(sandbox=False, user=None, problem=f"cannot switch to uid {user[0]}: {said}")
    tmp = tempfile.gettempdir()  # Playwright makes Chromium's profile there (the launcher gives it to user)
    if _run([*drop, "test", "-x", tmp]) is not None:
        return SandboxPlan(
            sandbox=False, user=None, problem=f"uid {user[0]} cannot enter the temporary directory {tmp}"
        )
    problem = _probe(drop)
    if problem is not None:
        return SandboxPlan(sandbox=False, user=user, problem=problem)
    isolation_problem = _isolation_probe(drop, user)
    return SandboxPlan(
        sandbox=True, user=user, isolated=isolation_problem is None, isolation_problem=isolation_problem
    )


def _isolation_probe(drop: list[str], user: tuple[int, int]) -> str | None:
    """None if the launcher can start Chromium through isolate_command here, else why not."""
    try:
        fd = make_netns()
    except OSError as exc:
        return f"cannot make a network namespace: {exc}"
    try:
        said = _root_check(isolate_command(f"/proc/{os.getpid()}/fd/{fd}", "/bin/sh"), drop, user)
    finally:
        os.close(fd)
    return None if said is None else f"cannot enter namespaces of its own: {said}"


def _user_netns_probe() -> str | None:
    """None if a worker that is not root can start Chromium in a UserNetns here (on its root of its
    own), its loopback there up and a socket listening on it; else why not."""
    try:
        netns = UserNetns()
    except OSError as exc:
        return f"cannot make a network namespace: {exc}"
    try:
        netns.listen().close()
        outer, inner = own_root_command("/bin/sh", netns.paths)
        said = _root_check(outer, inner)
        if said is None:  # and there only the loopback is up
            check = ["/bin/sh", "-c", "grep -q '^ *lo:' /proc/net/dev && [ $(wc -l < /proc/net/dev) = 3 ]"]
            said = _run([*outer[: outer.index("--") + 1], *check])
    except OSError as exc:
        said = str(exc)
    finally:
        netns.close()
    return None if said is None else f"cannot have a network namespace of its own: {said}"


def _root_check(outer: list[str], inner: list[str], user: tuple[int, int] | None = None) -> str | None:
    """None if ``outer`` + a profile directory + ``inner`` starts a command as Chromium would be started, on
    its root, where its profile (given to ``user``, as the launcher does) and /dev/null are, and another
    profile beside it not; else what it said."""
    try:
        # Where Playwright makes Chromium's profile.
        profile, other = tempfile.mkdtemp(), tempfile.mkdtemp()
        try:
            if user is not None:
                os.chown(profile, *user)
            check = 'test -w "$1" && test -w /dev/null && ! test -e "$2"'
            return _run([*outer, profile, *inner, "/bin/sh", "-c", check, "sh", profile, other])
        finally:
            os.rmdir(profile)
            os.rmdir(other)
    except OSError as exc:
        return str(exc)
