"""Sandbox start and stop off a prompt's path (every backend's start; the stop of those whose stop takes a while).

:class:`BackgroundStart` wraps one prompt's sandbox. Its ``start()`` returns at once; the real start
runs on a start-up slot (a thread of the worker's :class:`StartPool`, or a thread of its own behind a
semaphore) while the prompt's first model call is in flight (when requests wait for a slot, it is
begun once the first one is granted its slot, :meth:`BackgroundStart.defer`). What needs
the sandbox itself (``run``, ``workdir``, ``isolation``) waits for that start and raises its error if it
failed. ``stop()`` waits for a start in progress, then stops; a start still queued for its slot is
skipped, so a prompt that never called a tool may never create a container at all.

:class:`BackgroundStopper` is a worker process's few threads that stop sandboxes after their prompts
have reported, so removing a container does not hold a prompt's thread slot.

:class:`PromptSandbox` is one prompt's sandbox from start to stop, as a context manager: the start
on a slot (in the background unless the backend declares ``synchronous_start``), the stop on leaving
(handed to the background stopper unless the backend's stop is quick), and the timings of both.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchrun.prompt.sandboxes.base import (
    ExecResult,
    Sandbox,
    SandboxError,
    declared,
    judged_run,
    trusted_run,
    usable_cpus,
)

log = logging.getLogger(__name__)

_PENDING, _STARTING, _SKIPPED = "pending", "starting", "skipped"


class BackgroundStart:
    """A sandbox (same ``spec``/``workdir``/``isolation``/``start``/``run``/``stop`` surface) started on a thread.

    Timings, in seconds, filled in as they become known: ``start_wait_s`` (waiting for a start-up
    slot), ``start_s`` (the backend's start) and ``blocked_s`` (how long callers waited for the start
    to finish: 0 when it was done before the first tool call needed it).
    """

    def __init__(self, sandbox: Sandbox, slots: Any = None):
        self.inner = sandbox
        self.spec = sandbox.spec
        # A StartPool (its threads are the start-up slots: no thread per waiting start), or a semaphore
        # (context manager) bounding start-ups, each on a thread of its own; or None: no bound.
        self._slots = slots
        self._lock = threading.Lock()
        self._state = _PENDING
        self._thread: Any = None  # the start's thread, or its future in a StartPool
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._deferred = False  # begun by whoever was handed defer()'s start, or by the first need
        self.start_wait_s = 0.0
        self.start_s = 0.0
        self._blocked_s = 0.0

    @property
    def blocked_s(self) -> float:
        return round(self._blocked_s, 3)

    def start(self) -> None:
        """Begin the start on a thread and return at once; never raises: a start that cannot be begun (no
        thread to be had, the StartPool shut down) is a failed start, raised to whoever needs the sandbox.
        Begun by the prompt's first request once granted its slot (:meth:`defer`), it raised from inside
        the model call, which was never sent, and failed the prompt as ``internal``, a tool-less prompt
        included; a thread that never ran left ``wait_started`` waiting for ever."""
        try:
            with self._lock:
                if self._thread is not None or self._state == _SKIPPED:
                    return
                if isinstance(self._slots, StartPool):
                    self._thread = self._slots.submit(self._start, time.monotonic())
                    return
                self._thread = threading.Thread(
                    target=self._start, name=f"sandbox-start-{self.spec.prompt_index}", daemon=True
                )
            self._thread.start()
        except Exception as exc:
            with self._lock:
                self._thread = self._thread or exc  # begun, as far as the waits for it go: it failed
                self._state = _SKIPPED  # nothing was created: nothing to stop
                self._error = exc
            self._done.set()

    def defer(self) -> Callable[[], None]:
        """Leave the start to the caller of the returned function (the prompt's first request, once granted
        its slot), or to the first use that needs the sandbox, whichever comes first."""
        self._deferred = True
        return self.start

    def _start(self, queued_at: float | None = None) -> None:
        t0 = time.monotonic() if queued_at is None else queued_at
        slots = self._slots if self._slots is not None and not isinstance(self._slots, StartPool) else None
        try:
            with slots if slots is not None else contextlib.nullcontext():
                t1 = time.monotonic()
                self.start_wait_s = round(t1 - t0, 3)
                with self._lock:
                    if self._state == _SKIPPED:  # stopped before it got a slot: nothing to start
                        return
                    self._state = _STARTING
                try:
                    self.inner.start()
                finally:
                    self.start_s = round(time.monotonic() - t1, 3)
        except BaseException as exc:  # kept for whoever needs the sandbox; stop() still cleans up
            self._error = exc
        finally:
            self._done.set()

    def wait_started(self) -> None:
        """Block until the start has finished; raise :class:`SandboxError` if it failed."""
        if self._deferred:
            self.start()  # needed before its prompt's first request was granted a slot (judging): now
        if self._thread is None:
            if self._state == _SKIPPED:
                raise SandboxError(
                    f"sandbox of prompt {self.spec.prompt_index} was stopped before it started"
                )
            raise SandboxError(f"sandbox of prompt {self.spec.prompt_index} is not started")
        if not self._done.is_set():
            t0 = time.monotonic()
            self._done.wait()
            self._blocked_s += time.monotonic() - t0
        error = self._error
        if isinstance(error, SandboxError):
            raise error
        if error is not None:  # a start that failed is an infrastructure failure, whatever raised it
            raise SandboxError(
                f"sandbox of prompt {self.spec.prompt_index} did not start: {type(error).__name__}: {error}"
            ) from error
        if self._state == _SKIPPED:
            raise SandboxError(f"sandbox of prompt {self.spec.prompt_index} was stopped before it started")

    @property
    def workdir(self) -> str:
        self.wait_started()
        return self.inner.workdir

    @property
    def isolation(self) -> str:
        self.wait_started()
        return self.inner.isolation

    def run(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        self.wait_started()
        return self.inner.run(command, timeout_s=timeout_s, stdin=stdin)

    def run_judged(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """A command whose exit code judges the sample (base.judged_run): the sandbox's own way, when
        it has one."""
        self.wait_started()
        return judged_run(self.inner)(command, timeout_s=timeout_s, stdin=stdin)

    def run_trusted(self, command: str, *, timeout_s: float, stdin: bytes | None = None) -> ExecResult:
        """A judging step of the runner's own (base.trusted_run): the sandbox's own way, when it has one."""
        self.wait_started()
        return trusted_run(self.inner)(command, timeout_s=timeout_s, stdin=stdin)

    def end_processes(self, timeout_s: float) -> str | None:
        """Before judging (scoring.end_agent_processes): the sandbox's own, when it has one."""
        self.wait_started()
        end = getattr(self.inner, "end_processes", None)
        return None if end is None else end(timeout_s)

    # The file tools' direct path (base.DirectFileAccess), when the sandbox has one; else "not this way".

    @property
    def direct_files(self) -> bool:
        return declared(self.inner, "direct_files")

    def read_direct(self, path: str, max_bytes: int) -> bytes | None:
        self.wait_started()
        return self.inner.read_direct(path, max_bytes) if self.direct_files else None

    def write_direct(self, path: str, data: bytes, *, make_parents: bool) -> bool:
        self.wait_started()
        return self.direct_files and self.inner.write_direct(path, data, make_parents=make_parents)

    def stop(self) -> None:
        """Skip a start still waiting for its slot; otherwise wait for the start, then stop. Idempotent."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _SKIPPED
            skipped = self._state == _SKIPPED
        if skipped:
            return
        self._done.wait()
        self.inner.stop()  # also after a failed start: it may have created a container first


def start_slots_per_worker(backend: Any, max_sandbox_starts: int, num_workers: int) -> int:
    """How many sandbox starts one worker runs at once.

    A backend whose start is bound by this machine's CPU (``starts_per_cpu``: local, a few processes
    and mounts, ~15-25 ms of CPU each) gets that many per core at most: more only makes the starts
    compete with each other and with the prompts. Any other backend's start waits on something
    else (a container engine, a cloud API): ``--max_sandbox_starts`` bounds it, for the whole run.
    """
    total = max_sandbox_starts
    per_cpu = declared(backend, "starts_per_cpu")
    if per_cpu:
        total = min(total, per_cpu * usable_cpus())
    return max(1, total // num_workers)


class StartPool:
    """A worker's start-up slots: ``size`` threads that run the sandbox starts queued with :meth:`submit`,
    in order. A start waiting for a slot holds no thread (a thousand prompts in flight would otherwise
    hold a thousand threads, each with its stack, to wait on a semaphore)."""

    def __init__(self, size: int):
        self.size = max(1, size)
        self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="sandbox-start")

    def submit(self, start: Callable[[float], None], queued_at: float) -> Any:
        return self._pool.submit(start, queued_at)


class BackgroundStopper:
    """Runs sandbox stops on ``threads`` threads, at most ``max_pending`` queued or running at once.

    ``submit`` returns at once unless ``max_pending`` stops are already pending, in which case it
    waits for room (so containers waiting for removal cannot pile up). ``on_queued`` and ``on_done``
    are called once per stop, in that order (the worker tells the parent, which waits for every
    stop before ending the workers).
    """

    def __init__(
        self,
        threads: int,
        max_pending: int,
        on_queued: Callable[[], None] | None = None,
        on_done: Callable[[], None] | None = None,
    ):
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="sandbox-stop")
        self._room = threading.BoundedSemaphore(max(1, max_pending))
        self._cond = threading.Condition()
        self._pending = 0
        self._on_queued = on_queued
        self._on_done = on_done

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def submit(self, stop: Callable[[], None]) -> None:
        self._room.acquire()
        with self._cond:
            self._pending += 1
        _notify(self._on_queued)
        try:
            self._pool.submit(self._run, stop)
        except RuntimeError:  # the executor is shut down (process exiting): stop here
            self._run(stop)

    def _run(self, stop: Callable[[], None]) -> None:
        try:
            stop()
        except Exception as exc:  # a stop that fails must not stop the others
            log.warning("sandbox stop failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._room.release()
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
            _notify(self._on_done)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until no stop is pending; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout_s)


class PromptSandbox:
    """One prompt's sandbox, started on entering and stopped on leaving; ``timings`` says how long each took.

    ``starts`` is a :class:`StartPool` or a semaphore bounding start-ups (None: no bound);
    ``stop_in_background`` (e.g. ``BackgroundStopper.submit``), when given, takes the stop off the
    prompt's path; ``start_when`` (e.g. ``Limiter.when_granted``), when given, is handed the background
    start and may run it later (True) rather than on entering (False). A backend with
    ``synchronous_start`` starts on entering, before any model call; one with ``synchronous_stop``
    (local: a few ms) always stops here, so its stop costs no messages.
    """

    def __init__(
        self,
        box: Sandbox,
        starts: Any = None,
        stop_in_background: Callable[[Callable[[], None]], None] | None = None,
        start_when: Callable[[Callable[[], None]], bool] | None = None,
    ):
        self.box = box
        self.image = getattr(box, "image", None) or ""  # the row's or the backend's default
        self.background = not declared(box, "synchronous_start")
        self.sandbox: Any = None  # what the tools use: the box itself, or its BackgroundStart
        self._starts = starts
        self._stop_in_background = stop_in_background
        self._start_when = start_when
        self.timings: dict[str, Any] = {
            "sandbox_start_wait_s": 0.0,  # waiting for a start-up slot
            "sandbox_start_s": 0.0,  # the backend's start
            "sandbox_start_blocked_s": 0.0,  # what this prompt's own thread waited for the start
            "sandbox_stop_s": 0.0,  # what this prompt's own thread waited for the stop
            "sandbox_stop_background": False,  # whether the stop was left to the background stopper
        }

    @property
    def isolation(self) -> str:
        """The backend's own value, without waiting for a start the prompt never needed."""
        return self.sandbox.inner.isolation if self.background else self.sandbox.isolation

    def __enter__(self) -> Any:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)  # a failed start may have created a container first
            raise
        return self.sandbox

    def __exit__(self, *exc_info: Any) -> None:
        if self.sandbox is not None:
            self._stop()

    def _start(self) -> None:
        if self.background:
            # The start runs on a start-up slot while the prompt's first model call is in flight: the
            # prompt pays for it only when its first tool call comes before the start is done.
            # With ``start_when`` (Limiter.when_granted) the start waits for the prompt's first request to
            # be granted its slot, when requests are limited: a prompt queued behind the slots holds no
            # idle sandbox meanwhile, and one that ends before its turn creates none.
            self.sandbox = BackgroundStart(self.box, self._starts)
            if self._start_when is None or not self._start_when(self.sandbox.defer()):
                self.sandbox.start()  # returns at once; the first tool call waits for it
            return
        self.sandbox = self.box
        t0 = time.monotonic()
        if isinstance(self._starts, StartPool):  # on a start-up slot's thread; this one waits
            began = self._starts.submit(_timed_start(self.box), t0).result()
            self.timings["sandbox_start_wait_s"] = round(began - t0, 3)
            self.timings["sandbox_start_s"] = round(time.monotonic() - began, 3)
        else:
            with self._starts if self._starts is not None else contextlib.nullcontext():
                t1 = time.monotonic()
                self.box.start()
            self.timings["sandbox_start_wait_s"] = round(t1 - t0, 3)
            self.timings["sandbox_start_s"] = round(time.monotonic() - t1, 3)
        self.timings["sandbox_start_blocked_s"] = round(time.monotonic() - t0, 3)

    def _stop(self) -> None:
        t0 = time.monotonic()
        later = self.background and not declared(self.box, "synchronous_stop")
        if (
            later
            and self._stop_in_background is not None
            and _hand_off(self._stop_in_background, self.sandbox.stop)
        ):
            self.timings["sandbox_stop_background"] = True
        else:
            try:
                self.sandbox.stop()
            except Exception:
                pass
        self.timings["sandbox_stop_s"] = round(time.monotonic() - t0, 3)
        if self.background:  # as known now: a start the prompt never needed may still be going on
            self.timings["sandbox_start_wait_s"] = self.sandbox.start_wait_s
            self.timings["sandbox_start_s"] = self.sandbox.start_s
            self.timings["sandbox_start_blocked_s"] = self.sandbox.blocked_s


def _timed_start(sandbox: Any) -> Callable[[float], float]:
    """A start for a StartPool slot that returns when it began (the time after the queue)."""

    def start(queued_at: float) -> float:
        began = time.monotonic()
        sandbox.start()
        return began

    return start


def _hand_off(stop_in_background: Callable[[Callable[[], None]], None], stop: Callable[[], None]) -> bool:
    """Give ``stop`` to the background stopper (waits only while too many stops are queued); False if it refused."""
    try:
        stop_in_background(stop)
    except Exception:
        return False
    return True


def _notify(callback: Callable[[], None] | None) -> None:
    if callback is None:
        return
    try:
        callback()
    except Exception:  # e.g. the parent's connection is gone: the worker is ending anyway
        pass
