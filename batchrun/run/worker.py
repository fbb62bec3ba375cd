"""The worker process: many prompts at once on threads, each outcome sent to the parent the moment it ends.

A pool (processes forked from a ``multiprocessing`` forkserver, running :func:`serve`, or Ray actors)
calls :func:`init_worker` once per process.
The worker then connects to the parent's inbox, says how many prompts it runs at once
(:class:`~batchrun.protocol.Ready`), and runs each :class:`~batchrun.protocol.PromptJob` the parent
sends on that connection: the parent sends one per free slot, so a worker never holds a prompt it
cannot start. This module imports only the package, so a worker on any machine can import it by name.
"""

from __future__ import annotations

import contextvars
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from batchrun.prompt.attempt import WorkerSettings, install_run_tools, run_prompt
from batchrun.prompt.limiter import Limiter
from batchrun.prompt.llm import JUDGE_SLOT_PRIORITY, LLMClient
from batchrun.prompt.sandbox_lifecycle import BackgroundStopper, StartPool
from batchrun.prompt.sandboxes import create_sandbox
from batchrun.prompt.sandboxes.base import SandboxSpec
from batchrun.prompt.tools.catalog import all_tools
from batchrun.protocol import (
    EndpointHealth,
    Grant,
    Log,
    Outcome,
    Pause,
    PauseAll,
    PromptJob,
    Ready,
    Reserve,
    Skipped,
    Spend,
    StopDone,
    StopQueued,
    StopStarting,
)
from batchrun.run import open_files
from batchrun.run.forkserver import FORKSERVER_PRELOAD, start_forkserver  # noqa: F401 - re-exported
from batchrun.run.inbox import connect_to_inbox
from batchrun.storage import pid_alive


@dataclass
class WorkerState:
    """What one worker process holds for all its prompts (made once by :func:`init_worker`)."""

    settings: WorkerSettings
    conn: Any
    send_lock: threading.Lock
    sandbox_starts: StartPool
    llm: LLMClient
    stop: threading.Event  # the run's budget is spent: no new prompt, no further model call
    current: threading.local  # .job: the job a prompt thread runs (for report_spend)
    threads: ThreadPoolExecutor  # one thread per slot: the parent sends at most that many jobs at once
    stopper: BackgroundStopper
    gate: ParentGate | None = None
    judge: LLMClient | None = None  # the judge model's client (--judge_model): same limiter, budget, stop


class ParentGate:
    """The run's budget, asked of the parent before every model call's attempt (see batchrun/run/budget.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, tuple[threading.Event, list[bool]]] = {}

    def reserve(
        self, tokens: int, deadline: float, priority: int = 0, model: str | None = None
    ) -> tuple[Any, float]:
        from batchrun.prompt.llm import BudgetStop, LLMError

        with self._lock:
            self._next += 1
            rid = self._next
            event, answer = threading.Event(), []
            self._waiting[rid] = (event, answer)
        start = time.monotonic()
        self._ask(rid, tokens, priority, model)
        # Waiting for the budget is not the prompt's time; a bound still: a parent that never answers.
        if not self._wait(event, max(1.0, deadline - start) + 3600.0):
            with self._lock:
                self._waiting.pop(rid, None)
            self.settle(rid, None)
            raise LLMError("timeout", "the run's budget did not answer a reservation")
        if not answer[0]:
            raise BudgetStop()
        return rid, time.monotonic() - start

    def _ask(self, rid: int, tokens: int, priority: int, model: str | None) -> None:
        """Send the parent the :class:`Reserve` of a call of this thread's prompt."""
        job = _current_job()
        send(
            Reserve(
                rid,
                tokens,
                priority,
                (job.batch_num, job.prompt_index, job.sample_index) if job else None,
                model,
            )
        )

    def _wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(timeout=seconds)

    def granted(self, message: Grant) -> None:
        with self._lock:
            entry = self._waiting.pop(message.rid, None)
        if entry is not None:
            entry[1].append(message.ok)
            entry[0].set()

    def settle(self, ticket: Any, usage: dict[str, Any] | None) -> None:
        if ticket is not None:
            report_spend(usage or {}, reservation=ticket)


class HealthReporter:
    """Tells the parent when model calls fail for the endpoint's reasons, and when they answer again
    (the answers after a failure until one to a call sent after it, so a healthy run sends nothing: an
    answer to a call sent before the failure, which the parent does not count, is not the one). ``judge``:
    of the judge's calls, which the parent watches apart."""

    def __init__(self, judge: bool = False) -> None:
        self._failing = False
        self._failed_sent: float | None = None  # when the latest failed call went out
        self._judge = judge

    def __call__(self, error_class: str | None, refused: bool = False, sent_at: float | None = None) -> None:
        if error_class is None and not self._failing:
            return
        if error_class is not None:
            latest = self._failed_sent if self._failing else None
            self._failing = True
            self._failed_sent = sent_at if latest is None or sent_at is None else max(latest, sent_at)
        elif sent_at is None or self._failed_sent is None or sent_at >= self._failed_sent:
            self._failing = False
        send(EndpointHealth(error_class, judge=self._judge, refused=refused, sent_at=sent_at))


_state: WorkerState | None = None  # this process's worker state; set by init_worker


def init_worker(
    settings: WorkerSettings | None, inbox: tuple[Any, bytes], slots: int, start_slots: int, parent_pid: int
) -> None:
    """Once per worker process: client, registry and thread pool, so no prompt pays for them.

    ``settings`` None (Ray): they are the first message the parent sends on the inbox connection. Ray keeps
    an actor's arguments in its cluster state (the GCS, and Redis where it is persisted), and the settings
    hold the API key and the tools' keys."""
    global _state
    open_files.raise_soft_limit(
        open_files.needed(slots)
    )  # the forkserver's soft limit, 1,024 on most systems
    address, authkey = inbox
    remote = isinstance(address, tuple)  # a TCP inbox (Ray): the runner may be on another machine
    _die_with_parent(None if remote else parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    try:  # ended by the parent: the MCP servers we started end with us (see _exit)
        signal.signal(signal.SIGTERM, lambda signum, frame: _exit(128 + signum))
    except ValueError:  # not the main thread (a Ray actor): the actor's own end applies
        pass
    conn = None
    if settings is None:
        conn = connect_to_inbox(address, authkey)
        settings = conn.recv()
    install_run_tools(settings.tools)  # MCP tools; the same known tools as the parent, or no worker
    _warm_up(settings)
    conn = conn or connect_to_inbox(address, authkey)
    stop = threading.Event()
    gate = ParentGate() if settings.budget_gate else None
    _state = WorkerState(
        settings=settings,
        conn=conn,
        send_lock=threading.Lock(),
        sandbox_starts=StartPool(start_slots),
        llm=LLMClient(
            settings.llm,
            Limiter(settings.rpm_per_worker, settings.requests_per_worker, lambda until: send(Pause(until))),
            stop=stop,
            on_usage=report_unbudgeted,
            gate=gate,
            on_failure=HealthReporter(),
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
        gate=gate,
    )
    if settings.request_slots_endpoint_only:
        _state.llm.slot_endpoint = settings.llm.base_url
    if settings.judge_llm is not None:
        # The judge shares the run's limiter, stop and budget; its endpoint's health is not the agent's:
        # the parent watches it apart (a judge whose key is refused, or whose server died, mid-run made
        # every later sample a scorer error, each after its agent's calls were paid for, and exit 0).
        _state.judge = LLMClient(
            settings.judge_llm,
            _state.llm.limiter,
            stop=stop,
            on_usage=report_unbudgeted,
            gate=gate,
            on_failure=HealthReporter(judge=True),
        )
        _state.judge.slot_endpoint = _state.llm.slot_endpoint
        _state.judge.slot_priority = JUDGE_SLOT_PRIORITY  # its prompt is done but for it: first in line
    threading.Thread(target=_listen_to_parent, name="parent-listener", daemon=True).start()
    send(Ready(slots))  # only now: every prompt the parent sends can start at once


def _warm_up(settings: WorkerSettings) -> None:
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


_fault_sent = threading.Event()


def report_unbudgeted(usage: dict[str, Any]) -> None:
    """A model call's spend in a run without a run-wide budget: nothing needs it before its prompt's
    outcome, which carries the prompt's whole usage, so no message per call. Only the first call whose
    usage cannot be trusted goes at once, so that the parent warns while the run goes on (the parent
    then counts it live and the rest of its prompt from the outcome, as for every live spend)."""
    if not usage.get("fault") or _fault_sent.is_set():
        return
    _fault_sent.set()
    report_spend(usage)


def report_spend(usage: dict[str, Any], reservation: int | None = None) -> None:
    """A model call's tokens and cost, as it happens: with a run-wide budget the parent holds the run to
    it at once and frees the call's ``reservation`` (see :class:`ParentGate`)."""
    job = _current_job()
    if job is None:
        if reservation is not None:  # a call outside a prompt (none today): still free its reservation
            send(Spend(-1, -1, 0, 0, 0.0, reservation=reservation))
        return
    send(spend_of_usage(usage, job.batch_num, job.prompt_index, job.sample_index, reservation))


def spend_of_usage(
    usage: dict[str, Any], batch_num: int, prompt_index: int, sample_index: int, reservation: int | None
) -> Spend:
    """A model call's usage (as a :class:`~batchrun.prompt.llm.SpendGate` is told it) as the parent counts it."""
    cost = usage.get("cost")
    priced = isinstance(cost, (int, float)) and not isinstance(cost, bool)  # credible_usage drops bad ones
    cache = usage.get("prompt_tokens_details")  # credible_usage's: the cache's counts, when said
    cache = cache if isinstance(cache, dict) else {}
    return Spend(
        batch_num=batch_num,
        prompt_index=prompt_index,
        prompt_tokens=_count_of(usage.get("prompt_tokens")),
        completion_tokens=_count_of(usage.get("completion_tokens")),
        cost_usd=float(cost) if priced else 0.0,
        sample_index=sample_index,
        reservation=reservation,
        fault=usage.get("fault") if isinstance(usage.get("fault"), str) else None,
        priced=priced,
        unanswered_tokens=_count_of(usage.get("unanswered_tokens")),
        cached_tokens=_count_of(cache.get("cached_tokens")),
        cache_write_tokens=_count_of(cache.get("cache_write_tokens")),
    )


def _count_of(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


_JOB: contextvars.ContextVar[PromptJob | None] = contextvars.ContextVar("prompt_job", default=None)


def _current_job() -> PromptJob | None:
    """The job of the prompt this thread works for: its own thread's, or the context a tool's thread was
    started with (so a tool's model calls count against the budget as they happen)."""
    return getattr(_worker().current, "job", None) or _JOB.get()


def _worker() -> WorkerState:
    if _state is None:
        raise RuntimeError("init_worker has not run in this process")
    return _state


def _run_one(job: PromptJob) -> None:
    state = _worker()
    state.current.job = job
    _JOB.set(job)  # also seen by the threads a tool starts with a copy of this context (moa's references)
    try:
        if state.stop.is_set():  # the budget is spent: leave this prompt for a later --resume
            send(Skipped(job.batch_num, job.prompt_index, job.sample_index))
            return
        log = (
            (lambda entry: send(Log(prompt_index=job.prompt_index, **entry)))
            if state.settings.verbose
            else None
        )
        try:
            outcome = run_prompt(
                job,
                state.settings,
                state.llm,
                sandbox_starts=state.sandbox_starts,
                stop_in_background=state.stopper.submit,
                log=log,
                judge=state.judge,
            )
        except Exception as exc:  # run_prompt never raises by contract; if it did, the parent would
            # wait for this slot forever: the prompt fails alone instead.
            outcome = Outcome.failed(job, "internal", f"{type(exc).__name__}: {exc}")
        send(outcome)  # the parent counts this slot free and sends the next prompt
    finally:
        state.current.job = None
        _JOB.set(None)


def _listen_to_parent() -> None:
    """Messages from the parent: a prompt to run, a run-wide pause (429 elsewhere), or stop starting prompts (budget)."""
    state = _worker()
    while True:
        try:
            message = state.conn.recv()
        except (EOFError, OSError):
            _exit(1)  # the parent is gone: nobody would write our results
        if isinstance(message, PromptJob):
            state.threads.submit(_run_one, message)
        elif isinstance(message, PauseAll) and message.lift:
            state.llm.limiter.lift(message.until)
        elif isinstance(message, PauseAll):
            state.llm.limiter.pause_until(message.until)
        elif isinstance(message, StopStarting):
            state.stop.set()
        elif isinstance(message, Grant) and state.gate is not None:
            state.gate.granted(message)


def _exit(code: int) -> None:
    """End this worker now, and with it every stdio MCP server it started (their whole process groups,
    SIGKILL after a grace period): a server in its own session that ignores SIGTERM and the end of its
    stdin would otherwise outlive the run."""
    from batchrun.prompt.tools.mcp import kill_server_groups

    try:
        kill_server_groups()
    finally:
        os._exit(code)


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
        _exit(1)

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()
