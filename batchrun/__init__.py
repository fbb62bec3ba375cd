"""batch-runner: run a tool-using LLM agent over a dataset, one sandbox per prompt.

The package is split along the process boundary:

* :mod:`batchrun.prompt` — ONE PROMPT, what a worker thread runs: the loop, the model client, the
  limiter, trajectories, tools and sandboxes.
* :mod:`batchrun.run` — ONE RUN, the parent process and the worker processes.
* :mod:`batchrun.views` — read a run directory: the HTML report, the live status.
* :mod:`batchrun.fakes` — the in-package fake model and fake web services, for tests and dry runs.
"""
