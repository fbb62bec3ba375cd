#!/usr/bin/env python3
"""Batch runner: drive a tool-using agent through a JSONL dataset of prompts in parallel.

    python batch_runner.py --dataset_file=data/prompts.jsonl --batch_size=10 --run_name=my_run
    python batch_runner.py --help

A thin entry point over the ``batchrun`` package (installed as the ``batch-runner`` command, too):
the command line and the story of a run are in ``batchrun/cli.py``; ``batchrun/config.py`` checks
every flag; ``batchrun/run/`` is the parent and the worker processes; ``batchrun/prompt/`` runs one
prompt. This file is not installed, so it never shadows another package's ``batch_runner`` module.

From Python, as scripts written for the reference do (``main(...)`` returns the exit code)::

    from batch_runner import BatchRunner, main
    BatchRunner(dataset_file="data/prompts.jsonl", batch_size=10, run_name="my_run").run(resume=False)
    code = main(dataset_file="data/prompts.jsonl", batch_size=10, run_name="my_run")
"""

import sys

if __name__ == "__main__":
    import signal

    def _stopped_early(signum, frame):
        """Ctrl-C or SIGTERM before the command line takes them over (batchrun/cli.py): nothing is written
        yet, and the run ends as interrupted (130), not killed by the signal."""
        raise SystemExit(130)

    signal.signal(signal.SIGTERM, _stopped_early)
    signal.signal(signal.SIGINT, _stopped_early)

# A run's worker forkserver starts before the imports below (batchrun/run/forkserver.py).
if __name__ == "__main__":
    from batchrun.run.forkserver import start_for_argv

    start_for_argv(sys.argv[1:])

# The run's workers never run this file again (batchrun/run/forkserver.py: skip_callers_main); another
# multiprocessing process would, as __mp_main__: it needs nothing of the command line's imports.
if __name__ != "__mp_main__":
    from batchrun.api import BatchRunner  # noqa: F401  (the reference's Python API)
    from batchrun.cli import cli, main, run  # noqa: F401  (main and run: for scripts that call them in-process)

if __name__ == "__main__":
    from batchrun.entry import skip_final_collection

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt again: the CLI's
    try:
        cli()
    finally:
        skip_final_collection()
