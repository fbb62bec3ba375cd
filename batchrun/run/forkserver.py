"""The workers' forkserver: one clean process that imports the worker code once; every worker forks from it.

It is started as early as a run knows it will have local workers: :func:`start_for_argv` at the top
of the command line, before the parent's own imports, so the server's imports (~0.25 s of CPU here)
overlap with them, with the flag checks, the dataset and preflight, instead of following them.
This module imports nothing of the package but its ``__init__``, so starting the server costs the parent next to nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from stat import S_ISDIR, S_ISVTX

from batchrun import cache_dir  # the package's own module, imported already: nothing more is compiled

# What the forkserver imports before it forks any worker (see batchrun/run/worker_preload.py), and
# the module of the run's sandbox backend, as the backends' registry names it
# (batchrun.prompt.sandboxes.backend_target: a built-in, an entry point or "package.module:Class").
# The forkserver skips a module that does not import: each worker then imports it at its first sandbox.
FORKSERVER_PRELOAD = ["batchrun.run.worker_preload"]
WARM_MODULE = "batchrun.run.worker_warm"  # last: the backend, imported by then, prepares the workers' probes

# The name of a worker process (multiprocessing's, not the OS's): such a process does not run the caller's
# main module again (see skip_callers_main).
WORKER_PROCESS_NAME = "batch-runner-worker"

# Arguments with which the command runs no local worker: help, listings, a Ray cluster.
_NO_WORKERS = ("-h", "--help", "-help", "--list_distributions", "--ray_address")


def bytecode_cache_dir() -> str:
    """The runner's own bytecode directory: ``$XDG_CACHE_HOME/batch-runner/pycache`` (``~/.cache``)."""
    return os.path.join(cache_dir(), "pycache")


def use_bytecode_cache() -> None:
    """Where the environment forbids writing bytecode next to the sources (``PYTHONDONTWRITEBYTECODE``,
    as these machines set it), compile the modules into a directory of the runner's own instead
    (``sys.pycache_prefix``), so that each run does not compile them again from source: ~0.1 s of
    CPU in the parent and as much in the forkserver, before the first request. Called by the parent
    at the top of the command line and by the forkserver before its preload (both find the same
    directory). A prefix the user chose (``PYTHONPYCACHEPREFIX``) is left alone, as is a directory
    that cannot be made or written, and so is one another user could write into: the interpreter runs
    whatever bytecode it finds there whose header matches the source's size and time, so a cache under a
    shared ``HOME`` or ``XDG_CACHE_HOME`` (``/tmp/.cache``) would run another user's code as this one."""
    if not sys.dont_write_bytecode or sys.pycache_prefix:
        return
    cache = bytecode_cache_dir()
    try:
        os.makedirs(cache, mode=0o700, exist_ok=True)
    except OSError:
        return
    if os.access(cache, os.W_OK | os.X_OK) and only_mine(cache):
        sys.pycache_prefix = cache
        sys.dont_write_bytecode = False


def only_mine(path: str) -> bool:
    """Whether no other user (root aside) can change what ``path``, a directory, holds: it and every
    directory above it belong to this user or root, and none that another may write into (group or
    other) lets them rename what it holds (only a sticky one, like ``/tmp``, does not: an entry of it
    is then renamed only by its owner, and the one below it is checked as well)."""
    me = os.geteuid()
    path = os.path.abspath(path)
    first = True
    while True:
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if not S_ISDIR(st.st_mode) or st.st_uid not in (me, 0):
            return False
        if st.st_mode & 0o022 and (first or not st.st_mode & S_ISVTX):
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path, first = parent, False


_server_environ: dict[str, str] | None = None  # the environment the running forkserver was started with


def start_forkserver(backend: str | None = None) -> None:
    """Start the worker pool's forkserver now, preloading ``backend``'s module too (a no-op when it runs).

    The pool made later uses the same server. If nothing is dispatched, the server exits with this process.
    A server started under another environment is replaced: its workers would have that one (a
    second run in one process, after ``os.environ["TZ"]`` or ``HTTPS_PROXY`` changed, ran with the
    first run's values while the parent's checks used the new ones).
    """
    from multiprocessing import forkserver

    global _server_environ
    environ = dict(os.environ)
    if _server_environ is not None and environ != _server_environ:
        stop_forkserver()
    extra = [_backend_module(backend)] if backend else []
    forkserver.set_forkserver_preload([*FORKSERVER_PRELOAD, *filter(None, extra), WARM_MODULE])
    # Python 3.11's forkserver imports its preload with its own default path (the working directory,
    # PYTHONPATH, site-packages), not this process's: a run of a checkout's batch_runner.py from another
    # directory, beside an installed copy of the package, had workers running the installed copy's code.
    # This copy goes first on its PYTHONPATH, for its start only (worker_preload puts the variable back).
    os.environ[PYTHONPATH_WAS] = os.environ.get("PYTHONPATH", UNSET)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))
    try:
        forkserver.ensure_running()
    finally:
        _restore_pythonpath()
    _server_environ = environ
    atexit.unregister(stop_forkserver)  # once, however often the run asks for the server
    atexit.register(stop_forkserver)


PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds batchrun/
PYTHONPATH_WAS = "BATCH_RUNNER_PYTHONPATH_WAS"  # PYTHONPATH before the forkserver's start
UNSET = "\x01unset"  # PYTHONPATH was not set (an empty value is a value; a variable holds no NUL)


def _restore_pythonpath() -> None:
    """PYTHONPATH as it was before :func:`start_forkserver` put this copy first (in the parent after the
    server's start, and in the server itself once its first preload module runs: its workers inherit it)."""
    was = os.environ.pop(PYTHONPATH_WAS, None)
    if was is None:
        return
    if was == UNSET:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = was


def skip_callers_main() -> None:
    """Make the worker processes start without running the caller's ``__main__`` again.

    A process from the forkserver (as from spawn) first runs the script that started the run, as
    ``__mp_main__``, before its target. A worker needs nothing of it: its target and arguments are the
    package's. A script written for the reference's Python API (which forked its workers: nothing
    ran again) has no ``if __name__ == "__main__":`` guard, so every worker started the run again and
    died of it (multiprocessing's "bootstrapping phase" error): a 6-prompt run failed every prompt as
    ``pool_broken`` after 118 worker starts and 26 s. A guarded script still cost every worker its imports.
    Only processes named :data:`WORKER_PROCESS_NAME` are changed; installed once, idempotent."""
    from multiprocessing import spawn

    if getattr(spawn.get_preparation_data, "skips_callers_main", False):
        return
    original = spawn.get_preparation_data

    def get_preparation_data(name: str) -> dict:
        data = original(name)
        if name == WORKER_PROCESS_NAME:
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data.skips_callers_main = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def stop_forkserver(wait_s: float = 5.0) -> None:
    """End the forkserver and multiprocessing's resource tracker and reap them, at the runner's exit.

    Left to themselves they end once they read the end of their "alive" pipe, and they were still there,
    orphaned, after the runner had exited: the forkserver reads it only once its preload is done (~0.3 s
    after a run that stopped at its flags). So the pipe is closed and each is waited for (at most
    ``wait_s``): the forkserver then ends its preload, the backend's probes (a bubblewrap run) reaped,
    rather than leave them orphaned as a signal would. Only one still there after that gets SIGTERM.
    Their workers have ended by then; one that has not (an interrupted run's) is not theirs to end, and
    each wait is bounded (the tracker's pipe stays open while such a worker holds it)."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver  # the modules' own instances: no public handle to their pids
    if getattr(server, "_forkserver_pid", None) is not None:
        _close_and_reap(server, "_forkserver_alive_fd", "_forkserver_pid", wait_s, then_term=True)
    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_pid", None) is not None:
        _close_and_reap(tracker, "_fd", "_pid", wait_s)


def _close_and_reap(
    owner: object, fd_name: str, pid_name: str, wait_s: float, then_term: bool = False
) -> None:
    """Close ``owner``'s alive pipe and wait (at most ``wait_s``) for its process to end; ``then_term``:
    one still running then gets SIGTERM (and a second's wait)."""
    fd, pid = getattr(owner, fd_name, None), getattr(owner, pid_name)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        setattr(owner, fd_name, None)
    if not _reaped(pid, wait_s) and then_term:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        _reaped(pid, 1.0)
    setattr(owner, pid_name, None)


def _reaped(pid: int, wait_s: float) -> bool:
    """Whether child ``pid`` ended (and is reaped now) within ``wait_s``."""
    import time

    deadline = time.monotonic() + wait_s
    try:
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
    except ChildProcessError:  # reaped already
        pass
    return True


def _backend_module(backend: str) -> str:
    """The module that holds ``backend``, or "" when the name is unknown (the run refuses it later)."""
    from batchrun.prompt.sandboxes import backend_target

    try:
        return backend_target(backend).partition(":")[0]
    except ValueError:
        return ""


def start_for_argv(argv: list[str]) -> None:
    """Start the forkserver at once when the command line is a run that will fork local workers.

    The flags are only glanced at here (``RunConfig`` checks them later): a run whose flags turn out
    wrong, or that has nothing left to do, leaves an idle server that exits with the command."""
    use_bytecode_cache()
    names = [a.split("=", 1)[0] for a in argv]
    if argv[:1] == ["export"] or "--dataset_file" not in names or any(n in _NO_WORKERS for n in names):
        return
    from batchrun.prompt.sandboxes import DEFAULT_BACKEND

    backend = os.environ.get("TERMINAL_ENV") or DEFAULT_BACKEND  # as RunConfig.backend decides it
    for i, arg in enumerate(argv):
        if arg.startswith("--sandbox="):
            backend = arg.split("=", 1)[1]
        elif arg == "--sandbox" and i + 1 < len(argv):
            backend = argv[i + 1]
    start_forkserver(backend)
