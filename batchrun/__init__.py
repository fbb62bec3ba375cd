"""batch-runner: run a tool-using LLM agent over a dataset, one sandbox per prompt.

The package is split along the process boundary:

* :mod:`batchrun.prompt` — ONE PROMPT, what a worker thread runs: the loop, the model client, the
  limiter, trajectories, tools and sandboxes.
* :mod:`batchrun.run` — ONE RUN, the parent process and the worker processes.
* :mod:`batchrun.views` — read a run directory: the HTML report, the live status.
* :mod:`batchrun.fakes` — the in-package fake model and fake web services, for tests and dry runs.
"""

import os as _os


def cache_dir() -> str:
    """The runner's own cache directory, ``$XDG_CACHE_HOME/batch-runner`` (``~/.cache``): its compiled
    bytecode (batchrun.run.forkserver), the Docker images that ran here (its engine module), the tests'
    llama-server. Here, in the one module every other imports first and that imports nothing of the
    package: the bytecode cache is found before any other module of it is compiled."""
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache")
    return _os.path.join(base, "batch-runner")
