"""What every local sandbox sees of the system: its namespaces, the read-only system directories and
the view of /etc with its secrets masked (made once per machine and reused while /etc is unchanged)."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time

from batchrun.prompt.sandboxes._process import run_reaped
from batchrun.prompt.sandboxes.local.options import CTL_DIR

# capability, which would let a command remount anything read-write: drop them all.
NAMESPACES = (
    "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
    "--die-with-parent", "--new-session", "--as-pid-1", *(("--cap-drop", "ALL") if os.geteuid() == 0 else ()),
)  # fmt: skip


def root_without_ptrace() -> bool:
    """Whether this process is root without ``CAP_SYS_PTRACE`` in its effective set (a container's default)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return not int(caps.split()[1], 16) >> 19 & 1
    except (OSError, StopIteration, ValueError):
        return False


@functools.cache
def user_namespace_args() -> tuple[str, ...]:
    """bwrap's options for a user namespace of the sandbox's own (root mapped to root), for root
    without CAP_SYS_PTRACE; else none. Such a runner cannot reach a non-dumpable command server
    (command_server.server_shells) in its own user namespace, so the server ran from readable shells
    there: any command could reopen its stdin pipe (/proc/1/fd/0), write its memory or ptrace it, and
    every later command, the verify included, answered exit 0 without running. As the owner of the
    sandbox's user namespace the runner holds every capability in it, CAP_SYS_PTRACE included; the
    commands hold none. Probed once: none where bwrap cannot make one (the server as before)."""
    if not root_without_ptrace() or shutil.which("bwrap") is None:
        return ()
    args = ("--unshare-user", "--uid", "0", "--gid", "0")
    try:
        done = run_reaped(["bwrap", *args, "--ro-bind", "/", "/", "true"], timeout_s=20)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return args if done.returncode == 0 else ()


# The system, read-only: what commands need to run. Nothing else of the host is mounted.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Empty and read-only inside: plain directories of the sandbox's own root (bwrap's root is a fresh
# tmpfs, made read-only last), so the host's homes, daemons' state and sockets stay out. Not a
# tmpfs each: 16 mount operations fewer per start (~2 ms of CPU), with the same view inside.
HIDDEN_DIRS = ("/home", "/root", "/run", "/var", "/opt", "/srv", "/mnt", "/media")
# A cwd may not replace these (or lie inside the read-only system directories).
NO_CWD = ("/", "/dev", "/proc", "/sys", CTL_DIR)


@functools.cache
def system_mounts(etc_view: str | None = None, shm_bytes: int | None = None) -> tuple[str, ...]:
    """bwrap arguments for the read-only system, /dev, /proc and the masks of /etc's secrets.

    ``etc_view``: the run's copy of /etc made by :func:`make_etc_view`, bound as /etc in one mount,
    instead of the host's /etc and one mask per secret (a mount each, ~2 ms of a start's CPU).
    ``shm_bytes``: the size cap of /dev/shm's tmpfs (None: none, the kernel's default of half the RAM)."""
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", etc_view if d == "/etc" and etc_view else d, d]
    # /dev read-only (the remount is not recursive: its devices, /dev/pts and /dev/shm stay as they
    # are). Writable, it let a command replace /dev/fd (rm, ln -s to files of its own): a hidden test's
    # `diff <(...) <(...)` then compared those files and passed whatever the work; and it was storage
    # outside the disk cap. /dev/shm (POSIX shared memory, Python's multiprocessing locks) stays
    # writable: a tmpfs of its own, capped as /tmp and the working directory are.
    args += ["--dev", "/dev", *(("--size", str(shm_bytes)) if shm_bytes else ()), "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/dev", "--proc", "/proc"]
    # Root may write sysctls by file permission alone: keep them read-only.
    args += [
        "--ro-bind-try",
        "/proc/sys",
        "/proc/sys",
        "--ro-bind-try",
        "/proc/sysrq-trigger",
        "/proc/sysrq-trigger",
    ]
    for path, is_dir in () if etc_view else etc_secrets():
        args += ["--tmpfs", path, "--remount-ro", path] if is_dir else ["--ro-bind", "/dev/null", path]
    return tuple(args)


_etc_views: dict[str, str | None] = {}
run_files_lock = threading.Lock()  # this worker's files in the run's directory: the /etc view, resolv.conf
# A machine-wide /etc view that no process holds (:func:`_hold`) and none has asked for this long is removed.
# It was two days whatever held it, and each view is a copy (hard links cannot cross into tmpfs): on a
# machine whose /etc changed every half hour (users added, a resolv.conf rewritten), 122 views of 3 MB
# each, 351 MB of memory in /dev/shm.
VIEW_KEEP_S = 600.0
_held_views: dict[str, int] = {}  # view -> this process's shared lock on it, held while the process lives
UNLOCKED_VIEW_KEEP_S = 2 * 86400.0  # a view without a lock file: made by a version that held none (as before)


def runtime_dir() -> str:
    """Where the sandboxes' host-side files go (the run's directory, each prompt's control files).

    ``TMPDIR`` when the user set it; else a memory-backed runtime directory (``$XDG_RUNTIME_DIR``,
    else ``/dev/shm``): on a disk filesystem each prompt's few files cost ~3 ms of the worker's CPU
    per start and stop (ext4 allocating inodes right after a burst of deletions), against ~0.3 ms
    on tmpfs. The system temp dir when neither can be written."""
    if os.environ.get("TMPDIR"):
        return tempfile.gettempdir()
    return _memory_dir() or tempfile.gettempdir()


def _memory_dir() -> str | None:
    for where in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm"):
        if where and os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
            return where
    return None


def private_cache_dir() -> str | None:
    """This user's private directory in the runtime directory, kept across runs (the /etc views,
    ``launcher``'s br-launch builds), or None.

    Made 0700; refused when someone else made it (another user could otherwise plant a view or a
    binary)."""
    where = _memory_dir()
    if where is None:
        return None
    path = os.path.join(where, f"batch-runner-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def run_etc_view(base_dir: str) -> str | None:
    """The view of /etc a run's sandboxes bind (one mount, where the masks cost ~2 ms in every
    start): the machine's, shared by every run while /etc is unchanged (:func:`shared_etc_view`),
    else this worker's in the run's directory; None if neither can be made (then: masks)."""
    with run_files_lock:
        if base_dir not in _etc_views:
            _etc_views[base_dir] = shared_etc_view() or _own_etc_view(base_dir)
        return _etc_views[base_dir]


def _own_etc_view(base_dir: str) -> str | None:
    target = os.path.join(base_dir, f"etc-{os.getpid()}")
    try:
        make_etc_view(target)
        return target
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        return None


def shared_etc_view() -> str | None:
    """The view of /etc as it is now, in this user's runtime directory: made by the first worker that
    needs it (a walk and a link per entry of /etc: too costly to repeat per worker and run), then reused by every worker of every run until something in /etc changes (its name is a
    digest of every entry's metadata, see :func:`_etc_scan`). Made under a temporary name and
    renamed, so no sandbox binds a half-made view; None if there is no runtime directory."""
    cache = private_cache_dir()
    if cache is None:
        return None
    view = os.path.join(cache, f"etc-{_etc_scan()[1]}")
    for _ in range(3):  # a view another process pruned between our look and our hold is made again
        if os.path.isdir(view):
            os.utime(view)  # asked for: not pruned (below) before this process holds it
            if _hold(view):
                return view
            continue
        try:
            part = tempfile.mkdtemp(prefix=".etc-", dir=cache)
        except OSError:
            return None
        try:
            make_etc_view(os.path.join(part, "etc"))
            os.rename(os.path.join(part, "etc"), view)
        except OSError:
            if not os.path.isdir(view):  # not another worker's rename that came first
                return None
        finally:
            shutil.rmtree(part, ignore_errors=True)
        if _hold(view):
            _prune_views(cache, keep=view)
            return view
    return None


def _hold(view: str) -> bool:
    """Hold ``view`` for this process's life (a shared lock on ``<view>.lock``, beside it: a sandbox binds
    the view itself as /etc, where a lock file would show): :func:`_prune_views` removes only views no
    process holds. False when the view went meanwhile (pruned between the caller's look and the lock)."""
    if view in _held_views:
        return True
    lock = f"{view}.lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        # Held, and still the view's: a pruner that came first removed the view and unlinked this lock.
        if os.path.isdir(view) and os.fstat(fd).st_ino == os.stat(lock).st_ino:
            _held_views[view] = fd
            return True
    except OSError:
        pass
    os.close(fd)
    return False


def _prune_views(cache: str, keep: str) -> None:
    """Views of an /etc that has since changed go, once no process holds them (:func:`_hold`) and none
    asked for them for VIEW_KEEP_S; so do half-made ones that old (their maker died) and stray locks."""
    for entry in os.scandir(cache):
        name = entry.name
        if entry.path in (keep, f"{keep}.lock") or not name.startswith(("etc-", ".etc-")):
            continue
        try:
            age = time.time() - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if age <= VIEW_KEEP_S:
            continue
        if (
            name.startswith("etc-")
            and not name.endswith(".lock")
            and not os.path.lexists(f"{entry.path}.lock")
        ):
            if age <= UNLOCKED_VIEW_KEEP_S:  # an earlier version's runner may use it without a lock
                continue
        if name.startswith(".etc-"):
            shutil.rmtree(entry.path, ignore_errors=True)
            continue
        view = entry.path.removesuffix(".lock")
        if name.endswith(".lock") and os.path.lexists(view):
            continue  # its view's own turn decides
        _remove_unheld(view)


def _remove_unheld(view: str) -> None:
    """Remove ``view`` and its lock if no process holds it (a shared lock would refuse our exclusive one)."""
    lock = f"{view}.lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: in use by a running worker
        os.close(fd)
        return
    try:
        shutil.rmtree(view, ignore_errors=True)
        os.unlink(lock)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_etc_view(target: str) -> None:
    """Make ``target`` a view of /etc for the sandboxes: the same tree, with every secret that
    :func:`etc_secrets` masks empty (a file) or emptied (a directory), and without sockets, FIFOs
    and devices. Files are hard links where the kernel allows (no data copied), else copies;
    symbolic links are kept as they are (they resolve inside the sandbox, as the host's would)."""
    secrets = dict(etc_secrets())
    modes: list[tuple[str, int]] = []  # set last: a directory without write permission gets its entries first
    for top, dirs, files in os.walk("/etc"):
        here = os.path.join(target, os.path.relpath(top, "/etc"))
        os.makedirs(here, exist_ok=True)
        modes.append((here, stat.S_IMODE(os.lstat(top).st_mode)))
        for name in list(dirs):
            src = os.path.join(top, name)
            if os.path.islink(src):
                os.symlink(os.readlink(src), os.path.join(here, name))
                dirs.remove(name)
            elif secrets.get(src) is True:
                os.mkdir(os.path.join(here, name), 0o755)
                dirs.remove(name)
        for name in files:
            src, dst = os.path.join(top, name), os.path.join(here, name)
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            elif not stat.S_ISREG(st.st_mode):
                continue
            elif src in secrets:
                open(dst, "wb").close()
            else:
                try:
                    os.link(src, dst)
                except OSError:  # another filesystem, or protected_hardlinks for a file not ours
                    shutil.copy2(src, dst)
    for path, mode in reversed(modes):
        os.chmod(path, mode)


def etc_secrets() -> tuple[tuple[str, bool], ...]:
    """What in /etc other users may not read (shadow, SSH host keys, TLS private keys): (path, is_dir).

    The sandbox runs as this user without capabilities; as root it could read root-only files, so
    whatever an unprivileged user could not read is hidden from it too.
    """
    return _etc_scan()[0]


@functools.cache
def _etc_scan() -> tuple[tuple[tuple[str, bool], ...], str]:
    """One walk of /etc (once per process): its secrets (:func:`etc_secrets`) and a digest of every
    entry it sees (path, type and mode, owner, size, modification time, inode), which names the
    machine-wide view (:func:`shared_etc_view`): a view is reused only for the same /etc. Not the
    change time: a hard link to the file (the per-worker views made one each) changes it."""
    found: list[tuple[str, bool]] = []
    digest = hashlib.blake2b(digest_size=12)

    def seen(path: str) -> int | None:
        try:
            st = os.lstat(path)
        except OSError:
            return None
        digest.update(
            f"{path}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode(
                errors="surrogateescape"
            )
        )
        return st.st_mode

    seen("/etc")
    for top, dirs, files in os.walk("/etc"):
        for name in list(dirs):
            path = os.path.join(top, name)
            mode = seen(path)
            if mode is None:
                continue
            if stat.S_ISDIR(mode) and (mode & 0o005) != 0o005:
                found.append((path, True))
                dirs.remove(name)
        for name in files:
            path = os.path.join(top, name)
            mode = seen(path)
            if mode is not None and stat.S_ISREG(mode) and not mode & stat.S_IROTH:
                found.append((path, False))
    return tuple(sorted(found)), digest.hexdigest()
