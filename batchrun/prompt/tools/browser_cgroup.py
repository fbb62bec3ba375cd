"""The worker's Chromium in a cgroup of its own (see ``BROWSER_CPUS`` in config.py).

Chromium renders hostile pages on the host, outside any sandbox: RLIMIT_DATA bounds each of its
processes, but neither their sum (a page spreading over cross-site frames, or 16 prompts' renderers)
nor their CPU (a page spinning in Web Workers). Where this process may make cgroups (the local
sandbox's ``limits.cgroup_layout``: v1 or v2), each worker's Chromium goes into
``<its own cgroup>/<parent>/chromium-<pid>-<random>``, with a memory limit on all its processes and
a CPU quota. The launcher moves itself there before it execs Chromium, so every process of it is
born inside; the kernel's OOM killer, when a page passes the limit, picks among them (renderers
first: Chromium gives them oom_score_adj 300) and never the runner.

The parent holds the browsers of all a run's workers to :func:`browsers_bounds` together. Its name
is ``batch-runner-browser@<pid>-<random>`` ("@" is in no run's name), the pid the runner's: the run
removes it when its workers are gone (``remove_run_cgroups``), and a later run removes one whose
runner is gone (:func:`sweep_orphans`). Outside a run (or on Ray's workers) the parent is the
worker's own, ``batch-runner-browser@<worker pid>``, removed when its browser stops.
"""

from __future__ import annotations

import os
import re
import time

from batchrun.prompt.sandboxes.base import usable_cpus
from batchrun.prompt.sandboxes.local.limits import (
    PARENT_PREFIX,
    CgroupLayout,
    Limits,
    PromptCgroup,
    RunBounds,
    cgroup_layout,
    host_limits,
    remove_run_cgroups,
    run_bounds,
    run_cgroup_names,
)
from batchrun.prompt.tools.config import BrowserConfig
from batchrun.storage import pid_alive

PREFIX = f"{PARENT_PREFIX}browser@"
_PARENT = re.compile(re.escape(PREFIX) + r"(\d+)(?:-[0-9a-f]{8})?")
# Processes and threads of one worker's Chromium: ~25 threads a process, a renderer per prompt (16)
# and a few helpers made ~500 here; a page's Web Workers are threads of its renderer.
TREE_PIDS = 4096


def run_parent() -> str:
    """A new name for the parent of a run's browsers (made by the first worker that needs it)."""
    return f"{PREFIX}{os.getpid()}-{os.urandom(4).hex()}"


def browsers_bounds() -> RunBounds:
    """What the browsers of a run's workers may hold together: half this machine's memory (or its
    cgroup's, see ``host_limits``), half the CPUs this run may use (at least one); the processes of
    the local sandbox's run share."""
    memory, _ = host_limits()
    return RunBounds(memory_bytes=memory // 2, pids=run_bounds().pids, cpus=max(1.0, usable_cpus() / 2))


def describe(cfg: BrowserConfig) -> str:
    """One line for the start of a run: what bounds the workers' browsers here."""
    per_process = f"each Chromium process {cfg.memory_mb} MiB of data (RLIMIT_DATA)"
    layout = cgroup_layout()
    if not isinstance(layout, CgroupLayout):
        return (
            f"Browser limits: {per_process}; no CPU limit and no limit on its processes together ({layout})"
        )
    bounds, limits = browsers_bounds(), tree_limits(cfg)
    return (
        f"Browser limits: each worker's Chromium in a cgroup v{layout.version} of its own, {limits.cpus:g} "
        f"CPU and {limits.memory_mb} MiB for all its processes (all workers' together at most "
        f"{bounds.cpus:g} CPU and {bounds.memory_bytes >> 20} MiB); {per_process}"
    )


def tree_limits(cfg: BrowserConfig) -> Limits:
    """One worker's Chromium's limits: the settings', within what all workers' may have together (cgroup
    v1 refuses a CPU quota above its parent's: no cgroup at all was made for BROWSER_CPUS=2 on 2 cores)."""
    bounds = browsers_bounds()
    return Limits(
        cpus=min(cfg.cpus, bounds.cpus or cfg.cpus),
        memory_mb=min(cfg.tree_memory_mb, bounds.memory_bytes >> 20),
        pids_limit=min(TREE_PIDS, bounds.pids),
        disk_mb=0,
    )


def make(parent: str, cfg: BrowserConfig) -> PromptCgroup | str:
    """This worker's Chromium's cgroup under ``parent`` ("": the worker's own), or why there is none."""
    layout = cgroup_layout()
    if not isinstance(layout, CgroupLayout):
        return layout
    name = f"chromium-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        return PromptCgroup(
            layout, parent or f"{PREFIX}{os.getpid()}", name, tree_limits(cfg), browsers_bounds()
        )
    except OSError as exc:
        return f"cannot make the browser's cgroup: {exc}"


def release(cgroup: PromptCgroup) -> None:
    """End whatever is left in it (the browser has been closed, or is dead) and remove it."""
    for attempt in range(50):
        if cgroup.kill():
            break
        time.sleep(0.01 * (attempt + 1))
    cgroup.remove()


def sweep_orphans() -> int:
    """Remove the browsers' cgroups of runners (and workers) that are gone, with what is left in them."""
    removed = 0
    for name in run_cgroup_names():
        m = _PARENT.fullmatch(name)
        if m and not pid_alive(int(m.group(1))):
            remove_run_cgroups(name)
            removed += 1
    return removed
