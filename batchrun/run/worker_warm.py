"""Imported last by the workers' forkserver (batchrun/run/forkserver.py), after the run's sandbox
backend: every backend loaded by then prepares what each worker would otherwise do on its own before
its first sandbox (``SandboxBackend.prepare_process``: for the local backend the bubblewrap probe and
the scan of /etc), once, so the forked workers inherit it. A failure is left for the workers to meet
(and report) themselves: multiprocessing skips a preload module that raises, silently. Then all
the forkserver holds is frozen out of the garbage collector's reach (see the end).
"""

from batchrun.prompt.sandboxes.base import SandboxBackend


def _backends(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_backends(sub)]
    return found


for _backend in dict.fromkeys(_backends(SandboxBackend)):
    try:
        _backend.prepare_process()
    except Exception:
        pass

# Last: what the forkserver holds now (modules, the probes' results) is moved out of the collector's
# reach, so a worker's collections neither walk it nor write to its pages (each write copies a page
# the fork shared).
import gc  # noqa: E402

gc.freeze()
