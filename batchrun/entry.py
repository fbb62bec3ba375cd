"""The installed ``batch-runner`` command: a run's worker forkserver starts first, then the CLI's imports
(as ``batch_runner.py`` does; see batchrun/run/forkserver.py)."""

import sys


def cli() -> None:
    from batchrun.run.forkserver import start_for_argv

    start_for_argv(sys.argv[1:])
    from batchrun.cli import cli as command_line

    command_line()
