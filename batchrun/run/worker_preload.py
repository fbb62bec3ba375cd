"""Imported once by the workers' forkserver (batchrun/run/forkserver.py), so every forked worker starts
with it loaded: the worker and the prompt code, and the built-in tools. Not the command line's modules
(batchrun.cli: the parent's steps): the main script, which multiprocessing runs again in every worker,
does not import them there (see batch_runner.py).

The model client needs no ``openai`` SDK (batchrun/prompt/httpclient.py): its import alone took each
worker's forkserver ~0.75 s of CPU. The plugin entry points are scanned here, once for all workers
(reading the installed packages' metadata, ~25 ms; no plugin code runs here).
"""

import importlib

from batchrun.run.forkserver import _restore_pythonpath, use_bytecode_cache

_restore_pythonpath()  # the workers' environment is the parent's (see start_forkserver)
use_bytecode_cache()  # first: the forkserver's own imports below, as the parent's (see there)

import batchrun.run.worker  # noqa: E402, F401
from batchrun.prompt.tools.catalog import builtin_module  # noqa: E402
from batchrun.prompt.tools.plugins import plugin_entry_points  # noqa: E402
from batchrun.prompt.tools.registry import TOOLSETS  # noqa: E402

# The built-in tools' modules, not catalog.all_tools(): that would also load the plugins' code here.
for _toolset in TOOLSETS:
    importlib.import_module(builtin_module(_toolset))
plugin_entry_points()
