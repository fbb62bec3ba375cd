"""The worker process: many prompts at once on threads, each outcome sent to the parent the moment it ends.

A pool (processes forked from a ``multiprocessing`` forkserver, running :func:`serve`, or Ray actors)
calls :func:`init_worker` once per process.
The worker then connects to the parent's inbox, says how many prompts it runs at once
(:class:`~batchrun.protocol.Ready`), and runs each :class:`~batchrun.protocol.PromptJob` the parent
sends on that connection: the parent sends one per free slot, so a worker never holds a prompt it
cannot start. This module imports only the package, so a worker on any machine can import it by name.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from batchrun.prompt.limiter import Limiter
from batchrun.prompt.llm import LLMClient
from batchrun.prompt.run import RunSettings, install_run_tools, run_prompt
from batchrun.prompt.sandbox_lifecycle import BackgroundStopper, StartPool
from batchrun.prompt.sandboxes import create_sandbox
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.tools.registry import all_tools
from batchrun.protocol import (
    Log,
    Pause,
    PauseAll,
    PromptJob,
    Ready,
    Skipped,
    Spend,
    StopDone,
    StopQueued,
    StopStarting,
)
from batchrun.run.forkserver import FORKSERVER_PRELOAD, start_forkserver  # noqa: F401 - re-exported
from batchrun.run.inbox import connect_to_inbox
from batchrun.storage import pid_alive


@dataclass
class WorkerState:
    """What one worker process holds for all its prompts (made once by :func:`init_worker`)."""

    settings: RunSettings
    conn: Any
    send_lock: threading.Lock
    sandbox_starts: StartPool
    llm: LLMClient
    stop: threading.Event  # the run's budget is spent: no new prompt, no further model call
    current: threading.local  # .job: the job a prompt thread runs (for report_spend)
    threads: ThreadPoolExecutor  # one thread per slot: the parent sends at most that many jobs at once
    stopper: BackgroundStopper
    judge: LLMClient | None = None  # the judge model's client (--judge_model): same limiter, budget, stop


_state: WorkerState | None = None  # this process's worker state; set by init_worker


def init_worker(
    settings: RunSettings, inbox: tuple[Any, bytes], slots: int, start_slots: int, parent_pid: int
) -> None:
    """Once per worker process: client, registry and thread pool, so no prompt pays for them."""
    global _state
    address, authkey = inbox
    remote = isinstance(address, tuple)  # a TCP inbox (Ray): the runner may be on another machine
    _die_with_parent(None if remote else parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    install_run_tools(settings.tools)  # MCP tools; the same known tools as the parent, or no worker
    _warm_up(settings)
    conn = connect_to_inbox(address, authkey)
    stop = threading.Event()
    _state = WorkerState(
        settings=settings,
        conn=conn,
        send_lock=threading.Lock(),
        sandbox_starts=StartPool(start_slots),
        llm=LLMClient(
            settings.llm,
            Limiter(settings.rpm_per_worker, settings.requests_per_worker, lambda until: send(Pause(until))),
            stop=stop,
            on_usage=report_spend,
        ),
        stop=stop,
        current=threading.local(),
        threads=ThreadPoolExecutor(max_workers=slots, thread_name_prefix="prompt"),
        # Sandbox stops after the prompt reported (not local: it stops in a few ms on the prompt's thread).
        # The parent counts queued and finished stops and ends the workers only once all are done.
        stopper=BackgroundStopper(
            threads=start_slots,
            max_pending=slots,
            on_queued=lambda: send(StopQueued()),
            on_done=lambda: send(StopDone()),
        ),
    )
    if settings.judge_llm is not None:
        _state.judge = LLMClient(settings.judge_llm, _state.llm.limiter, stop=stop, on_usage=report_spend)
    threading.Thread(target=_listen_to_parent, name="parent-listener", daemon=True).start()
    send(Ready(slots))  # only now: every prompt the parent sends can start at once


def _warm_up(settings: RunSettings) -> None:
    """Do now, once, what each prompt's first steps would do once per process: the tool registry (with
    its plugins) and the backend's machine checks made when a sandbox is built (local: the bubblewrap
    probe and the scan of /etc). Left to the prompts, all of a worker's threads would do them at the
    same moment (nothing there is locked), each, and the worker's first model requests would wait."""
    all_tools()
    spec = SandboxSpec(run_name=settings.run_name, prompt_index=-1, network=settings.sandbox_network)
    try:
        create_sandbox(
            settings.sandbox_backend,
            spec,
            {"output_cap_bytes": settings.output_cap_bytes, **settings.sandbox_options},
        )  # built, never started
    except Exception:  # the first prompt meets the same problem and fails with it, as before
        pass


def serve(*initargs: Any) -> None:
    """A worker process's whole life (the local pool's target): set up, then run what the parent sends
    until the parent's connection ends (the listener then exits the process) or the parent ends us."""
    init_worker(*initargs)
    threading.Event().wait()


def send(message: Any) -> None:
    state = _worker()
    with state.send_lock:
        state.conn.send(message)


def report_spend(usage: dict[str, Any]) -> None:
    """Each model call's tokens and cost, as it happens: the parent enforces the run's budget on them."""
    job = getattr(_worker().current, "job", None)
    if job is None:
        return
    cost = usage.get("cost")
    send(
        Spend(
            batch_num=job.batch_num,
            prompt_index=job.prompt_index,
            prompt_tokens=_count_of(usage.get("prompt_tokens")),
            completion_tokens=_count_of(usage.get("completion_tokens")),
            cost_usd=float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) else 0.0,
            sample_index=job.sample_index,
        )
    )


def _count_of(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _worker() -> WorkerState:
    if _state is None:
        raise RuntimeError("init_worker has not run in this process")
    return _state


def _run_one(job: PromptJob) -> None:
    state = _worker()
    state.current.job = job
    try:
        if state.stop.is_set():  # the budget is spent: leave this prompt for a later --resume
            send(Skipped(job.batch_num, job.prompt_index, job.sample_index))
            return
        log = (
            (lambda entry: send(Log(prompt_index=job.prompt_index, **entry)))
            if state.settings.verbose
            else None
        )
        outcome = run_prompt(
            job,
            state.settings,
            state.llm,
            sandbox_starts=state.sandbox_starts,
            stop_in_background=state.stopper.submit,
            log=log,
            judge=state.judge,
        )
        send(outcome)  # the parent counts this slot free and sends the next prompt
    finally:
        state.current.job = None


def _listen_to_parent() -> None:
    """Messages from the parent: a prompt to run, a run-wide pause (429 elsewhere), or stop starting prompts (budget)."""
    state = _worker()
    while True:
        try:
            message = state.conn.recv()
        except (EOFError, OSError):
            os._exit(1)  # the parent is gone: nobody would write our results
        if isinstance(message, PromptJob):
            state.threads.submit(_run_one, message)
        elif isinstance(message, PauseAll):
            state.llm.limiter.pause_until(message.until)
        elif isinstance(message, StopStarting):
            state.stop.set()


def _die_with_parent(parent_pid: int | None) -> None:
    """End this worker as soon as the runner dies, so no orphan keeps running prompts or spending.

    The kernel signal covers our direct parent (the forkserver, which exits with the runner);
    the watchdog thread covers the runner itself. ``None``: a worker that may run on another
    machine (Ray), where the runner's pid means nothing; it ends when its inbox connection
    closes or breaks (``_listen_to_parent``, with TCP keepalive for a machine that vanishes).
    """
    if parent_pid is None:
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watchdog() -> None:
        while pid_alive(parent_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()
