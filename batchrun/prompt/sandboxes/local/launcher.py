"""br-launch: the sandbox's bubblewrap command line run by a small program of ours, as root.

``launcher.c`` takes exactly the bwrap options the local sandbox's line uses (``sandbox.py``,
``_launch_argv``) with bubblewrap's meaning and makes the same sandbox at about half bubblewrap's
CPU (``benchmarks/template_floor.py``, figures in ``benchmarks/README.md``): no
``/proc/self/mountinfo`` parsed at every mount, no ``pivot_root`` walking every task on the
machine. Compiled once per machine with the system's C compiler into this user's runtime directory
(0700, see ``system_view``), checked against a real sandbox, then used for every start. Root only:
without root, bubblewrap's user namespace is what makes the sandbox possible at all. Where there is
no compiler, the build or its check fails, or ``BATCH_RUNNER_LAUNCHER=0``, the sandbox runs bwrap
itself, as before.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from batchrun.prompt.sandboxes.local.system_view import (
    NAMESPACES,
    private_cache_dir,
    shared_etc_view,
    system_mounts,
    user_namespace_args,
)

SOURCE = Path(__file__).with_name("launcher.c")
ENABLED = os.environ.get("BATCH_RUNNER_LAUNCHER", "1") != "0"
problem: str | None = None  # why the launcher is not used (None: used, or not asked for)


@functools.cache
def launcher_path() -> str | None:
    """The compiled launcher, or None: then bwrap itself makes each sandbox (see the module)."""
    global problem
    problem = None
    if not ENABLED or os.geteuid() != 0:
        return None
    if user_namespace_args():
        problem = (
            "root without CAP_SYS_PTRACE: the sandbox gets a user namespace, which br-launch does not make"
        )
        return None
    try:
        return _build()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
        return None


_held: dict[str, int] = {}  # the build this process uses -> its descriptor, under a shared lock


def _hold(path: str) -> bool:
    """Take a shared lock on the build at ``path`` for this process's life (its workers, forked, share it),
    so that another version's build, which removes the builds no process holds, leaves it. False when it
    is gone, or is being removed (then it is built again)."""
    if path in _held:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink == 0:  # removed between the open and the lock
            raise OSError(errno.ENOENT, "removed")
    except OSError:
        os.close(fd)
        return False
    _held[path] = fd
    return True


def _remove_unheld(cache: str, keep: str) -> None:
    """Remove the builds of other sources that no process holds (:func:`_hold`). Each was removed
    whatever used it: a run of another checkout or version on the machine (two installs, an upgrade
    during a run) then failed every sandbox start with FileNotFoundError, as the two checkouts' tests
    run side by side did."""
    for entry in os.scandir(cache):
        if not entry.name.startswith("br-launch-") or entry.path == keep:
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(entry.path)
        except OSError:
            pass  # held: in use
        finally:
            os.close(fd)


def _build() -> str:
    for _ in range(3):
        path, cache = _built()
        if _hold(path):
            _remove_unheld(cache, path)
            return path
    raise RuntimeError("its build was removed as it was made, three times")


def _built() -> tuple[str, str]:
    """The build of this source (made now if there is none): its path, and the cache directory."""
    source = SOURCE.read_bytes()
    cache = private_cache_dir()
    if cache is None:
        raise RuntimeError("no private runtime directory for it")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc)")
    digest = hashlib.sha256(source + cc.encode()).hexdigest()[:16]
    path = os.path.join(cache, f"br-launch-{digest}")
    if os.access(path, os.X_OK):
        return path, cache
    fd, tmp = tempfile.mkstemp(prefix=".br-launch-", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, "-O2", "-o", tmp, "-x", "c", str(SOURCE)], capture_output=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.decode(errors='replace').strip()[-300:]}")
        _check(tmp, cache)
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)  # whole or not at all: workers building at once each check their own
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path, cache


def _check(binary: str, cache: str) -> None:
    """A real sandbox from it, with the sandbox's own namespaces and system mounts: read-only root,
    no capabilities, PID 1 of its own PID namespace; or no launcher."""
    with tempfile.TemporaryDirectory(dir=cache) as where:
        root = os.path.join(where, "root")
        os.mkdir(root)
        script = (
            "touch /x 2>/dev/null && exit 3; [ $$ = 1 ] || exit 4; "
            "grep -q '^CapEff:[[:space:]]*0*$' /proc/self/status || exit 5; echo ok"
        )
        argv = [binary, "--newroot", root, *NAMESPACES, *system_mounts(shared_etc_view()),
                "--remount-ro", "/", "--", "/bin/sh", "-c", script]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, timeout=30)
        if done.returncode != 0 or done.stdout != b"ok\n":
            said = (done.stderr or done.stdout).decode(errors="replace").strip()[-300:]
            raise RuntimeError(f"its check failed (exit {done.returncode}): {said}")
