"""Open files a run's processes need, and the soft limit raised to hold them (``ulimit -n``).

A worker's prompts in flight each hold a few descriptors at once (measured: a worker with 300 local
prompts in flight peaked at 1,220; the sandbox's pipes, its shell, the model connection). Under a
soft limit of 1,024 (the usual default), 67 of 300 prompts failed mid-run with "Too many open files",
each after a paid model call, although the hard limit allowed 20,000. Each process raises its own soft
limit to what it needs (within the hard limit); a need past the hard limit is refused before the run.
This module imports nothing of the package: the parent and any worker import it.
"""

from __future__ import annotations

import resource

PER_PROMPT = 8  # descriptors a prompt in flight may hold at once: twice the measured peak (~4)
BASE = 64  # a process's own: imports, the parent's connection, logs, the run's files


def needed(prompts_in_flight: int) -> int:
    """Descriptors a process running ``prompts_in_flight`` prompts at once may need."""
    return BASE + PER_PROMPT * prompts_in_flight


def hard_limit() -> int | None:
    """The most this process may open (``ulimit -Hn``); None: unlimited."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return None if hard == resource.RLIM_INFINITY else hard


def raise_soft_limit(need: int) -> None:
    """Raise this process's soft limit on open files to ``need`` (at most the hard limit); never lower it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):  # a sandbox that forbids it: the process keeps what it has
        pass
