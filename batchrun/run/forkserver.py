"""The workers' forkserver: one clean process that imports the worker code once; every worker forks from it.

It is started as early as a run knows it will have local workers: :func:`start_for_argv` at the top
of the command line, before the parent's own imports, so the server's imports (~0.25 s of CPU here)
overlap with them, with the flag checks, the dataset and preflight, instead of following them.
This module imports nothing of the package, so starting the server costs the parent next to nothing.
"""

from __future__ import annotations

import os

# What the forkserver imports before it forks any worker (see batchrun/run/worker_preload.py), and
# the run's sandbox backend module: a built-in "<name>" is in module batchrun.prompt.sandboxes.<name>
# (batchrun.prompt.sandboxes.BACKENDS), a dotted path "package.module:Class" in its module. The
# forkserver skips a module that does not import, so a backend found by entry point is not
# preloaded: each worker imports it at its first sandbox.
FORKSERVER_PRELOAD = ["batchrun.run.worker_preload"]
BACKEND_MODULE = "batchrun.prompt.sandboxes.{}"

# Arguments with which the command runs no local worker: help, listings, a Ray cluster.
_NO_WORKERS = ("-h", "--help", "-help", "--list_distributions", "--ray_address")


def start_forkserver(backend: str | None = None) -> None:
    """Start the worker pool's forkserver now, preloading ``backend``'s module too (a no-op when it runs).

    The pool made later uses the same server. If nothing is dispatched, the server exits with this process.
    """
    from multiprocessing import forkserver

    extra = []
    if backend and ":" in backend:
        extra = [backend.partition(":")[0]]
    elif backend and backend.isidentifier():
        extra = [BACKEND_MODULE.format(backend)]
    forkserver.set_forkserver_preload([*FORKSERVER_PRELOAD, *extra])
    forkserver.ensure_running()


def start_for_argv(argv: list[str]) -> None:
    """Start the forkserver at once when the command line is a run that will fork local workers.

    The flags are only glanced at here (``RunConfig`` checks them later): a run whose flags turn out
    wrong, or that has nothing left to do, leaves an idle server that exits with the command."""
    names = [a.split("=", 1)[0] for a in argv]
    if argv[:1] == ["export"] or "--dataset_file" not in names or any(n in _NO_WORKERS for n in names):
        return
    backend = os.environ.get("TERMINAL_ENV") or "local"  # as RunConfig.backend decides it
    for i, arg in enumerate(argv):
        if arg.startswith("--sandbox="):
            backend = arg.split("=", 1)[1]
        elif arg == "--sandbox" and i + 1 < len(argv):
            backend = argv[i + 1]
    start_forkserver(backend)
