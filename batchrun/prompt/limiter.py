"""A worker's share of the run-wide request limits, and the run-wide back-off on 429.

Every worker process holds one :class:`Limiter`. The parent splits the run's limits evenly
(``--max_rpm`` and ``--max_concurrent_requests`` divided by the number of workers), so all workers
together never exceed them, with no round trip per request. When any worker is told to slow down
(HTTP 429), it pauses itself and reports it to the parent, which relays the pause to every worker:
the whole run slows down, instead of each worker retrying on its own and stampeding the provider.

Waiting for a request slot is not a prompt's own time either: the slots are the run's own queue, in
front of an endpoint that can serve only so many (llama-server's ``--parallel`` slots), handed out in
the order they were asked for. Each holder's request is bounded by ``--request_timeout`` and its own
prompt's deadline, so the wait is bounded by the requests ahead of it. A prompt's wait for its first
request slot is no part of its time (it holds no sandbox and has spent nothing yet: its time starts when
that request is granted), credited up to :data:`MAX_QUEUE_WAIT_S`; from then on its slot waits and its
waits out of other prompts' 429 pauses are credited :data:`MAX_SLOT_WAIT_S` at most in all
(:meth:`Limiter.begin_prompt`), so it ends that long past its deadline at the latest, whatever an
endpoint does or says of its slots.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable

MAX_PAUSE_S = 120.0  # cap on one back-off, whatever Retry-After says (a frozen run helps no one)
# A prompt's credited waits once its time started (for a request slot, out of other prompts' 429 pauses,
# for the budget) at most this long in all: past it, they count against its deadline. It was an hour for
# every wait: an endpoint posing as a one-slot llama-server that held each request to its deadline kept
# prompts under way, sandboxes up, an hour past their deadlines.
MAX_SLOT_WAIT_S = 300.0
# A prompt's wait for its first request slot (a llama-server's slots, --max_concurrent_requests), before
# its time starts, at most this long: then it fails (class timeout) without having spent anything.
MAX_QUEUE_WAIT_S = 3600.0


class LimitTimeout(TimeoutError):
    """The deadline passed while waiting for the limiter."""


class _Allowance:
    """A prompt's credited waits left, and when the run's pause its own 429 caused ends: one for the
    prompt, whichever thread its model calls run on (a tool's, such as mixture_of_agents's reference
    models, on threads of their own that carry the prompt's context). Two allowances: ``queue_left``
    (:data:`MAX_QUEUE_WAIT_S`) until the prompt's time starts (:meth:`start`: its first request granted),
    then ``left`` (``grace_s``)."""

    def __init__(self, grace_s: float | None = None, started: bool = True) -> None:
        self.left = MAX_SLOT_WAIT_S if grace_s is None else grace_s
        self.queue_left = MAX_QUEUE_WAIT_S
        self.started = started
        self.own_until = 0.0
        self._lock = threading.Lock()
        self._waiting = 0  # the prompt's slot waits under way (its threads', at once)
        self._since = 0.0  # when the stretch of them began (monotonic)
        self._stretch_started = started  # which allowance the stretch of waits takes from

    def start(self) -> None:
        """The prompt's time starts (its first request was granted): its waits come from ``left`` now."""
        with self._lock:
            self.started = True

    def _get(self, started: bool) -> float:
        return self.left if started else self.queue_left

    def _set(self, started: bool, value: float) -> None:
        if started:
            self.left = value
        else:
            self.queue_left = value

    def take(self, seconds: float) -> float:
        """Up to ``seconds`` of what is left, taken now (parallel threads never take the same seconds)."""
        with self._lock:
            got = max(0.0, min(seconds, self._get(self.started)))
            self._set(self.started, self._get(self.started) - got)
            return got

    def wait_begins(self) -> float:
        """A slot wait of one of the prompt's threads begins: how long of it may be credited (what is left,
        less what the waits under way beside it have run so far). Waits that overlap are one stretch of
        the prompt's time and use the allowance once (:meth:`wait_ends`), not once each."""
        with self._lock:
            now = time.monotonic()
            if self._waiting == 0:
                self._since = now
                self._stretch_started = self.started
            self._waiting += 1
            return max(0.0, self._get(self._stretch_started) - (now - self._since))

    def wait_ends(self) -> None:
        """The slot wait :meth:`wait_begins` began is over: the stretch of overlapping waits, once the
        last of them ends, is taken from what is left."""
        with self._lock:
            self._waiting -= 1
            if self._waiting == 0:
                spent = time.monotonic() - self._since
                self._set(self._stretch_started, max(0.0, self._get(self._stretch_started) - spent))


class FairSlots:
    """A counting semaphore that hands a freed slot to the waiter of the prompt furthest under way
    (``priority``: the calls its prompt has made), then to the longest waiter. threading's lets a
    newcomer take a slot that frees before the waiter it woke runs again, and that waiter queues anew at
    the end: with the wait credited to the prompt, it could be passed over again and again. Prompts under
    way first, so that they finish one after another instead of all at the end of the run: their
    sandboxes close and their records are written as they go (20 prompts, one slot: the first was
    written after 13 of the run's 16 s when the slots went in order of asking). A first call waits at
    most for the prompts under way, which are the ones in flight, each bounded by its deadline."""

    def __init__(self, size: int):
        self._size = self._free = size
        self._lock = threading.Lock()
        self._queue: list[tuple[int, int, threading.Event]] = []  # a heap: (-priority, arrival, turn)
        self._arrivals = itertools.count()

    def acquire(self, timeout: float, priority: int = 0) -> bool:
        with self._lock:
            if self._free and not self._queue:
                self._free -= 1
                return True
            entry = (-priority, next(self._arrivals), threading.Event())
            heapq.heappush(self._queue, entry)
        if entry[2].wait(max(0.0, timeout)):
            return True
        with self._lock:
            if entry[2].is_set():  # handed a slot just as the wait ended: it is this one's
                return True
            self._queue.remove(entry)
            heapq.heapify(self._queue)
            return False

    def release(self) -> None:
        with self._lock:
            if self._queue:
                heapq.heappop(self._queue)[2].set()  # the slot passes straight to the first waiter
                return
            if self._free >= self._size:
                raise ValueError("FairSlots released too many times")
            self._free += 1


class Limiter:
    def __init__(
        self,
        rpm: float | None = None,
        max_concurrent: int | None = None,
        on_pause: Callable[[float], None] | None = None,
    ):
        """``rpm``: this worker's requests per minute (None: unlimited); ``max_concurrent``: requests at once."""
        self.rpm = rpm
        self._slots = FairSlots(max_concurrent) if max_concurrent else None
        self._lock = threading.Lock()
        self._next_free = 0.0  # monotonic time at which the next request may start (token spacing)
        self._paused_until = 0.0  # wall-clock time (shared across processes through the parent)
        self._on_pause = on_pause
        self.waited_s = 0.0
        self._local = threading.local()  # per thread: the pause time credited to its calls' deadlines
        # The calling prompt's _Allowance (begin_prompt), in its context: a tool's threads copy it.
        self._prompt: contextvars.ContextVar[_Allowance | None] = contextvars.ContextVar(
            f"limiter_allowance_{id(self)}", default=None
        )

    def acquire(self, deadline: float, priority: int = 0, slotted: bool = True) -> float:
        """Wait for the run-wide pause, a request slot and this worker's rate; ``deadline`` is monotonic,
        ``priority`` the calls the prompt has made (a prompt further under way gets a slot first).
        ``slotted``: False for a request that takes no slot (another endpoint than the llama-server whose
        slots they are); :meth:`release` it the same way.

        Returns the seconds this thread waited for a pause that another prompt's 429 caused, or for a
        request slot: that time does not count against this prompt's deadline (the caller moves its
        deadline by it; see also :meth:`credited_s`). Waiting out a pause its own 429 caused does count.
        """
        start = time.monotonic()
        credited = 0.0
        while True:
            pause = self._paused_until - time.time()
            if pause <= 0:
                break
            step = min(pause, 1.0)
            allowance = self._allowance()
            # Credited from the same allowance as the slot waits: each pause is at most MAX_PAUSE_S,
            # but a 429 storm paused every call and retry again, and a prompt credited them all
            # outlived its deadline (and its Docker container's lifetime) without bound. Threads of one
            # prompt held at once use it once for the stretch they overlap, as slot waits do: each took
            # its own seconds, and 2 of 3 reference models held by a 1 s pause found a 1.5 s allowance
            # spent and failed at their deadline.
            got = 0.0
            if allowance.own_until < self._paused_until:
                got = min(step, allowance.wait_begins())
                try:
                    if got > 0:
                        time.sleep(got)
                finally:
                    allowance.wait_ends()
            if got <= 0:
                self._sleep(step, deadline)
            else:
                credited += self._credit_thread(got)
                deadline += got
        # The request slot first, then the turn under --max_rpm: a turn taken while still waiting for a
        # slot would be spent by the time the slot frees, and the requests behind it would go in a burst.
        if self._slots is not None and slotted:
            asked = time.monotonic()
            remaining = deadline - asked
            # The wait for a slot is credited: with more prompts in flight than the endpoint serves at
            # once, their requests queue (here, or in the server's own queue without a limit), and
            # charged to their deadlines every prompt of 20 timed out against a one-slot llama-server.
            # Up to MAX_SLOT_WAIT_S for the whole prompt (begin_prompt): bounded per wait only, each
            # credited wait moved the deadline the next was bounded from (6 calls, a 0.2 s timeout, a
            # 0.3 s bound: the prompt lived 2.7 s; an hour a call in a real run).
            # Threads of one prompt waiting at once (a tool's parallel model calls) use the allowance
            # once for the stretch they overlap (_Allowance.wait_begins), each credited its own wait:
            # one holding all that was left for its wait left none to the others, and 2 of 3 reference
            # models queued 0.6 s behind another prompt's request failed at their 0.3 s deadline.
            got = False
            if remaining > 0:
                allowance = self._allowance()
                left = allowance.wait_begins()
                try:
                    got = self._slots.acquire(remaining + left, priority)
                finally:
                    allowance.wait_ends()
            if not got:
                raise LimitTimeout("no request slot before the prompt's deadline")
            queued = min(time.monotonic() - asked, left)
            credited += self._credit_thread(queued)
            deadline += queued
        try:
            self._take_turn(deadline)
        except BaseException:
            self.release(slotted)
            raise
        self._allowance().start()  # its first request granted: the prompt's own time has begun
        self.waited_s += time.monotonic() - start
        return credited

    def granted(self) -> None:
        """The calling prompt's request, past :meth:`acquire`, goes out now (the client calls it once it
        knows the run was not stopped meanwhile): run what :meth:`when_granted` left for it, once."""
        begin = getattr(self._local, "on_grant", None)
        if begin is not None:
            self._local.on_grant = None
            begin()

    def _take_turn(self, deadline: float) -> None:
        """Wait for this worker's next turn under ``rpm`` (requests spaced evenly)."""
        if not self.rpm:
            return
        with self._lock:
            now = time.monotonic()
            slot = max(now, self._next_free)
            if slot > deadline:  # a turn it cannot wait for is not taken from the requests after it
                raise LimitTimeout("the prompt's deadline comes before its turn under --max_rpm")
            self._next_free = slot + 60.0 / self.rpm
        if slot > now:
            self._sleep(slot - now, deadline)

    def begin_prompt(self) -> None:
        """A prompt starts on the calling thread. Until its first request is granted (when requests take
        slots here), its waits are credited up to :data:`MAX_QUEUE_WAIT_S`; from then on its waits for a
        request slot and out of other prompts' 429 pauses, the judge's included, up to
        :data:`MAX_SLOT_WAIT_S` in all; past that they count against its deadline."""
        # Without request slots its sandbox starts beside its first call: its time starts now.
        self._prompt.set(_Allowance(started=self._slots is None))
        self._local.on_grant = None  # a previous prompt's, on this thread, never runs for this one

    def when_granted(self, begin: Callable[[], None] | None) -> bool:
        """Have ``begin`` run once, when the calling prompt's next request is granted its slot (and its
        turn under ``rpm``), just before it is sent (:meth:`granted`); None: forget the one left. False,
        and nothing left, when requests take no slot here (no ``max_concurrent``): the caller begins now,
        as a grant would.

        A prompt's sandbox starts so (attempt.run_prompt): with 1,000 prompts in flight on a
        llama-server's 4 slots, started beside the prompt, ~995 sandboxes sat idle for minutes while their
        prompts' first requests waited for a slot, holding memory, processes and containers, and their
        starts took CPU from the requests being served."""
        if begin is not None and self._slots is None:
            return False
        self._local.on_grant = begin
        return begin is not None

    def _allowance(self) -> _Allowance:
        """The calling prompt's allowance (:meth:`begin_prompt`): its threads share it. A thread no prompt
        began on (and whose context no prompt's thread passed on) has one of its own."""
        allowance = self._prompt.get()
        if allowance is None:
            allowance = getattr(self._local, "allowance", None)
            if allowance is None:
                allowance = self._local.allowance = _Allowance()
        return allowance

    def credit(self, seconds: float) -> float:
        """Credit a wait the limiter did not see (for the run's budget) to the calling prompt's deadline,
        from its one allowance (:meth:`begin_prompt`); returns the seconds credited (what is left of the
        allowance at most: past it, the wait counts against the prompt's deadline)."""
        return self._credit_thread(self._allowance().take(seconds) if seconds > 0 else 0.0)

    def credit_left(self) -> float:
        """What is left of the calling prompt's allowance of credited waits (:meth:`begin_prompt`)."""
        return self._allowance().left

    def _credit_thread(self, seconds: float) -> float:
        """Add ``seconds`` to the calling thread's credited time (:meth:`credited_s`) as soon as they are
        credited, whatever ends the wait after; returns them."""
        self._local.credited = self.credited_s() + seconds
        return seconds

    def credited_s(self) -> float:
        """All pause time credited to the calling thread so far (a prompt compares it before and after)."""
        return getattr(self._local, "credited", 0.0)

    def release(self, slotted: bool = True) -> None:
        if self._slots is not None and slotted:
            self._slots.release()

    def pause(self, seconds: float, *, broadcast: bool = True) -> float:
        """Hold every request of this worker (and, through the parent, of the run) for ``seconds``."""
        seconds = max(0.0, min(seconds, MAX_PAUSE_S))
        until = time.time() + seconds
        # The prompt's own wait for it counts against its deadline, on whichever of its threads it waits
        # (a tool's reference model got the 429: the agent's next call waits it out uncredited).
        self._allowance().own_until = until
        with self._lock:
            if until <= self._paused_until:
                return seconds
            self._paused_until = until
        if broadcast and self._on_pause:
            self._on_pause(until)
        return seconds

    def pause_until(self, until: float) -> None:
        """Apply a pause relayed by the parent (wall-clock time)."""
        with self._lock:
            self._paused_until = max(self._paused_until, min(until, time.time() + MAX_PAUSE_S))

    def lift(self, until: float) -> None:
        """End now a pause relayed up to ``until``, unless a longer one (a later 429's) came since."""
        with self._lock:
            if self._paused_until <= min(until, time.time() + MAX_PAUSE_S):
                self._paused_until = min(self._paused_until, time.time())

    @staticmethod
    def _sleep(seconds: float, deadline: float) -> None:
        if time.monotonic() + seconds > deadline:
            raise LimitTimeout("the prompt's deadline passed while the run was held back")
        time.sleep(seconds)


def backoff_s(
    attempt: int, retry_after_s: float | None = None, base_s: float = 0.5, cap_s: float = MAX_PAUSE_S
) -> float:
    """How long to wait before retry ``attempt`` (1-based): Retry-After when given, else exponential; jittered.

    A Retry-After is a least wait: the first retry goes when asked, and from the second on the wait is at
    least the exponential back-off of the retry before (``attempt`` - 1). Honoured as it stood, a
    ``Retry-After: 0`` (or ``retry-after-ms: 1``) said at every 429 had a call asked 31 times in 0.2 s, then
    failed, while the limit lasted 2 s: each 429 also a run-wide pause relayed to every worker."""
    if retry_after_s is not None and retry_after_s >= 0:
        if retry_after_s >= cap_s:  # asked to wait longer than we ever do: the cap, jittered below it
            return cap_s * random.uniform(0.9, 1.0)
        # Jittered upwards (never earlier than asked), but never past the cap either.
        asked = retry_after_s * random.uniform(1.0, 1.2) + random.uniform(0, 0.01)
        floor = 0.0 if attempt <= 1 else min(cap_s, base_s * 2 ** (attempt - 2)) * random.uniform(0.5, 1.0)
        return min(cap_s, max(asked, floor))
    return min(cap_s, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
