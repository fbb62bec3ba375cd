"""The installed ``batch-runner`` command: a run's worker forkserver starts first, then the CLI's imports
(as ``batch_runner.py`` does; see batchrun/run/forkserver.py)."""

import sys


def cli() -> None:
    from batchrun.run.forkserver import start_for_argv

    start_for_argv(sys.argv[1:])
    from batchrun.cli import cli as command_line

    try:
        command_line()
    finally:
        skip_final_collection()


def skip_final_collection() -> None:
    """The command is about to exit (every file of the run is written and fsync'd by now): move what
    the process holds out of the garbage collector's reach, so the interpreter's shutdown does not
    walk it all again (its collections took 25-45 ms of the command's wall time here, after the last
    line was written). Objects are still freed by reference count; the exit handlers (multiprocessing's
    included) run as before. Only for the command line: a script calling ``main`` keeps its collector."""
    import gc

    gc.freeze()
