"""The limiter on its own: request spacing (--max_rpm), request slots (--max_concurrent_requests), the
run-wide 429 pause, and the retry back-off. Pauses run on a fake clock, so they are exact and instant."""

from __future__ import annotations

import random
import threading
import time

import pytest

from batchrun.prompt import limiter as limiter_module
from batchrun.prompt.limiter import MAX_PAUSE_S, Limiter, LimitTimeout, backoff_s


class FakeClock:
    """Stands in for the limiter's ``time`` module: ``sleep`` advances wall and monotonic time together."""

    def __init__(self) -> None:
        self.wall = 1_000_000.0
        self.mono = 500.0
        self.slept: list[float] = []

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.wall += seconds
        self.mono += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(limiter_module, "time", fake)
    return fake


def waited(clock: FakeClock, lim: Limiter, deadline_in_s: float = 1000.0) -> float:
    """Seconds (fake) one acquire waited; the slot it took is released again."""
    start = clock.mono
    lim.acquire(clock.mono + deadline_in_s)
    lim.release()
    return clock.mono - start


# ----------------------------------------------------------------------------- --max_rpm


def test_requests_are_spaced_by_60_over_rpm() -> None:
    lim = Limiter(rpm=600)  # one request every 0.1 s
    started = time.monotonic()
    for _ in range(5):
        lim.acquire(time.monotonic() + 30)
        lim.release()
    assert time.monotonic() - started >= 4 * 0.1 - 0.01  # the first request goes at once
    assert lim.waited_s >= 4 * 0.1 - 0.01


def test_rpm_spacing_on_the_fake_clock_is_exact(clock: FakeClock) -> None:
    lim = Limiter(rpm=30)  # 2 s apart
    assert [waited(clock, lim) for _ in range(4)] == [0.0, 2.0, 2.0, 2.0]
    clock.sleep(10)  # idle time is not saved up into a burst
    assert [waited(clock, lim) for _ in range(2)] == [0.0, 2.0]


def test_no_rpm_no_wait(clock: FakeClock) -> None:
    lim = Limiter()
    assert [waited(clock, lim) for _ in range(50)] == [0.0] * 50
    assert clock.slept == []


def test_rpm_wait_past_the_deadline_raises_at_once(clock: FakeClock) -> None:
    lim = Limiter(rpm=6)  # 10 s apart
    lim.acquire(clock.mono + 100)
    with pytest.raises(LimitTimeout):
        lim.acquire(clock.mono + 5)
    assert clock.slept == []  # no point waiting for a slot after the deadline


def test_a_timed_out_wait_does_not_use_up_the_rate(clock: FakeClock) -> None:
    lim = Limiter(rpm=6)  # 10 s apart
    lim.acquire(clock.mono + 100)
    for _ in range(5):
        with pytest.raises(LimitTimeout):
            lim.acquire(clock.mono + 5)
    assert waited(clock, lim) <= 10.0  # the next request that can wait goes at the next free slot


# ----------------------------------------------------------------------------- --max_concurrent_requests


def test_a_third_request_waits_for_one_of_two_slots() -> None:
    lim = Limiter(max_concurrent=2)
    lim.acquire(time.monotonic() + 5)
    lim.acquire(time.monotonic() + 5)
    got_slot = threading.Event()

    def third() -> None:
        lim.acquire(time.monotonic() + 60)
        got_slot.set()

    thread = threading.Thread(target=third, daemon=True)
    thread.start()
    assert not got_slot.wait(0.3)  # both slots are taken
    lim.release()
    assert got_slot.wait(30)
    thread.join(30)
    lim.release()
    lim.release()
    lim.acquire(time.monotonic() + 5)  # every slot is back
    lim.acquire(time.monotonic() + 5)


def test_the_wait_for_a_request_slot_is_credited_not_charged_to_the_prompt() -> None:
    """Prompts queued for the run's own request slots (more in flight than a llama-server's slots) wait
    their turn without losing their deadline: charged to it, every prompt of 20 against a one-slot
    server timed out. The wait moves the deadline, as another prompt's 429 pause does."""
    lim = Limiter(max_concurrent=1)
    lim.acquire(time.monotonic() + 5)
    got: list[float] = []

    def queued() -> None:
        got.append(lim.acquire(time.monotonic() + 0.2))  # its deadline passes while it waits
        got.append(lim.credited_s())

    thread = threading.Thread(target=queued)
    thread.start()
    time.sleep(0.6)
    lim.release()
    thread.join(10)
    credited, total = got
    assert 0.5 <= credited < 5 and total == credited
    lim.release()
    with pytest.raises(LimitTimeout):
        lim.acquire(time.monotonic() - 1)  # a deadline already passed: no time for the call anyway
    lim.acquire(time.monotonic() + 5)  # the refused attempt took no slot


def test_a_request_slot_is_waited_for_at_most_an_hour_past_the_deadline(monkeypatch) -> None:
    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 0.3)
    lim = Limiter(max_concurrent=1)
    lim.acquire(time.monotonic() + 5)  # held and never released: a bound still ends the wait
    started = time.monotonic()
    with pytest.raises(LimitTimeout):
        lim.acquire(time.monotonic() + 0.2)
    assert 0.45 <= time.monotonic() - started < 3
    lim.release()
    lim.acquire(time.monotonic() + 5)  # the timed-out wait took no slot


def test_a_prompts_slot_waits_end_it_at_most_max_slot_wait_past_its_deadline(monkeypatch) -> None:
    """Each wait was bounded (MAX_SLOT_WAIT_S past the deadline as it stood), but each credited wait
    moved the deadline on, so the next call could wait as long again: a prompt of 6 calls, 0.2 s
    timeout, bound 0.3 s, behind a holder letting go just before each bound, lived 2.7 s (an hour per
    call of a real run). Now the prompt's slot waits are credited up to MAX_SLOT_WAIT_S in all."""
    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 0.3)
    lim = Limiter(max_concurrent=1)
    stop = threading.Event()

    def holder() -> None:  # takes every slot it can, holds it 0.45 s (< 0.2 s + 0.3 s)
        while not stop.is_set():
            lim.acquire(time.monotonic() + 60, 100)
            time.sleep(0.45)
            lim.release()

    lim.begin_prompt()
    lim.acquire(time.monotonic() + 5)  # the prompt's first request: its time (and allowance) starts
    threading.Thread(target=holder, daemon=True).start()
    time.sleep(0.05)
    lim.release()  # the holder has it
    start = time.monotonic()
    end = start + 0.2  # --prompt_timeout 0.2
    at_start = lim.credited_s()
    calls = 0
    try:
        for _ in range(6):
            lim.acquire(end + lim.credited_s() - at_start)  # the loop's deadline_now()
            calls += 1
            lim.release()
            time.sleep(0.01)  # the holder, first in line, takes it back
    except LimitTimeout:
        pass
    finally:
        stop.set()
    lived = time.monotonic() - start
    assert lived < 0.2 + 0.3 + 0.3, (calls, lived)  # its deadline, the bound, a holder's turn of slack
    assert lim.credited_s() - at_start <= 0.3 + 0.01


def test_request_slots_go_to_the_longest_waiter() -> None:
    """A freed slot passes to the request that waited longest, never to one that just came: its wait
    is credited, so a request passed over again and again would hold its prompt (and sandbox) on."""
    lim = Limiter(max_concurrent=1)
    lim.acquire(time.monotonic() + 5)
    order: list[int] = []

    def request(n: int) -> None:
        lim.acquire(time.monotonic() + 60)
        order.append(n)
        time.sleep(0.02)
        lim.release()

    threads = []
    for n in range(5):
        threads.append(threading.Thread(target=request, args=(n,)))
        threads[-1].start()
        time.sleep(0.05)  # queued in this order
    lim.release()
    late = threading.Thread(target=request, args=(5,))  # comes as the slots pass along: goes last
    late.start()
    for t in [*threads, late]:
        t.join(10)
    assert order == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        lim.release()  # more releases than slots


def test_a_prompt_under_way_gets_a_request_slot_before_first_calls() -> None:
    """A freed slot goes to the call of the prompt that has made the most calls, first come first
    served among equals: prompts finish one after another, not all at the end of the run (20 prompts
    on one slot: the first record came after 1.6-2.0 s instead of 8.5-9.1 s, the mean prompt lasted
    8-10 s instead of 12-13 s, the run as long)."""
    lim = Limiter(max_concurrent=1)
    lim.acquire(time.monotonic() + 5)
    order: list[str] = []

    def request(name: str, calls_made: int) -> None:
        lim.acquire(time.monotonic() + 60, calls_made)
        order.append(name)
        time.sleep(0.02)
        lim.release()

    threads = []
    for name, calls_made in (("first-a", 0), ("first-b", 0), ("third-call", 2), ("second-call", 1)):
        threads.append(threading.Thread(target=request, args=(name, calls_made)))
        threads[-1].start()
        time.sleep(0.05)
    lim.release()
    for t in threads:
        t.join(10)
    assert order == ["third-call", "second-call", "first-a", "first-b"]


def test_what_a_prompt_leaves_for_its_first_grant_runs_once_on_its_thread() -> None:
    """when_granted (a prompt's sandbox start): run once, by the first granted() on the prompt's thread
    (the client's, once its request got its slot and the run was not stopped); never on another thread,
    nor once forgotten (None, or the next prompt's begin_prompt); refused (False) when no slot limit
    applies, so the caller begins at once, as before."""
    assert Limiter(rpm=600).when_granted(lambda: pytest.fail("no slots: run now by the caller")) is False
    lim = Limiter(max_concurrent=1)
    ran: list[str] = []
    lim.begin_prompt()
    assert lim.when_granted(lambda: ran.append("start")) is True
    other = threading.Thread(target=lim.granted)  # another prompt's request
    other.start()
    other.join(10)
    assert ran == []
    lim.granted()
    lim.granted()  # its second call: nothing left
    assert ran == ["start"]
    lim.when_granted(lambda: ran.append("again"))
    lim.when_granted(None)
    lim.granted()
    lim.when_granted(lambda: ran.append("again"))
    lim.begin_prompt()
    lim.granted()
    assert ran == ["start"]


# ----------------------------------------------------------------------------- the run-wide 429 pause


def test_pause_holds_acquire_until_it_ends(clock: FakeClock) -> None:
    lim = Limiter()
    assert lim.pause(5.0) == 5.0
    until = clock.wall + 5.0
    assert waited(clock, lim) >= 5.0
    assert clock.wall >= until
    assert waited(clock, lim) == 0.0  # over: the next request goes at once


def test_pause_until_relayed_from_the_parent_holds_acquire(clock: FakeClock) -> None:
    calls: list[float] = []
    lim = Limiter(on_pause=calls.append)
    lim.pause_until(clock.wall + 7.0)
    assert waited(clock, lim) >= 7.0
    assert calls == []  # a relayed pause is not reported back to the parent


def test_pause_is_capped_at_max_pause_s(clock: FakeClock) -> None:
    lim = Limiter()
    assert lim.pause(10 * MAX_PAUSE_S) == MAX_PAUSE_S
    assert MAX_PAUSE_S <= waited(clock, lim) <= MAX_PAUSE_S + 1.0


def test_relayed_pause_is_capped_at_max_pause_s(clock: FakeClock) -> None:
    lim = Limiter()
    lim.pause_until(clock.wall + 10 * MAX_PAUSE_S)
    assert MAX_PAUSE_S <= waited(clock, lim) <= MAX_PAUSE_S + 1.0


def test_negative_pause_holds_nothing(clock: FakeClock) -> None:
    lim = Limiter()
    assert lim.pause(-3.0) == 0.0
    assert waited(clock, lim) == 0.0


def test_a_shorter_pause_does_not_shorten_a_longer_one(clock: FakeClock) -> None:
    calls: list[float] = []
    lim = Limiter(on_pause=calls.append)
    lim.pause(30.0)
    lim.pause(2.0)
    lim.pause_until(clock.wall + 1.0)
    assert waited(clock, lim) >= 30.0


def test_on_pause_gets_the_until_time_only_when_the_pause_grows(clock: FakeClock) -> None:
    calls: list[float] = []
    lim = Limiter(on_pause=calls.append)
    t0 = clock.wall
    lim.pause(10.0)
    lim.pause(4.0)  # inside the current pause: nothing new to tell the run
    lim.pause(10.0)
    lim.pause(20.0)
    lim.pause(20.0, broadcast=False)  # not longer anyway
    lim.pause(25.0, broadcast=False)  # longer, but not to be relayed
    assert calls == [t0 + 10.0, t0 + 20.0]
    assert waited(clock, lim) >= 25.0


def test_a_deadline_inside_a_pause_raises_limit_timeout(clock: FakeClock) -> None:
    lim = Limiter()
    lim.pause(60.0)  # this thread's own 429 (another prompt's pause is credited instead: test_run_safety)
    deadline = clock.mono + 3.5
    with pytest.raises(LimitTimeout):
        lim.acquire(deadline)
    assert clock.mono <= deadline  # it gave up by the deadline, not at the end of the pause


def test_a_pause_does_not_use_up_request_slots(clock: FakeClock) -> None:
    lim = Limiter(max_concurrent=1)
    lim.pause(60.0)
    with pytest.raises(LimitTimeout):
        lim.acquire(clock.mono + 2)
    clock.sleep(60.0)
    lim.acquire(clock.mono + 1)  # the timed-out wait took no slot
    lim.release()


# ----------------------------------------------------------------------------- backoff_s


def test_backoff_honours_retry_after_jittered_upward_slightly() -> None:
    rng_state = random.getstate()
    random.seed(1234)
    try:
        for retry_after in (0.0, 0.5, 3.0, 42.0):
            waits = [backoff_s(1, retry_after) for _ in range(200)]
            assert all(retry_after <= w <= retry_after * 1.2 + 0.01 for w in waits), retry_after
            assert len(set(waits)) > 100  # jittered: workers told the same Retry-After do not retry in step
        # a later attempt waits what the provider said, or the exponential back-off when that is longer:
        # a Retry-After of 0 said at every 429 is no hot loop
        assert 3.0 <= backoff_s(2, 3.0) <= 3.0 * 1.2 + 0.01
        assert 32.0 <= backoff_s(9, 0.0) <= 64.0 and backoff_s(9, 100.0) >= 100.0
    finally:
        random.setstate(rng_state)


def test_backoff_retry_after_is_capped() -> None:
    """The cap is never passed, even by the jitter; capped waits still differ between workers."""
    capped = [backoff_s(1, 10_000.0, cap_s=30.0) for _ in range(100)]
    assert all(27.0 <= w <= 30.0 for w in capped) and len(set(capped)) > 50
    assert all(0.9 * MAX_PAUSE_S <= backoff_s(1, 10_000.0) <= MAX_PAUSE_S for _ in range(100))
    # Just under the cap: the upward jitter stops at the cap.
    assert all(backoff_s(1, 29.5, cap_s=30.0) <= 30.0 for _ in range(200))


def test_backoff_without_retry_after_grows_exponentially(monkeypatch: pytest.MonkeyPatch) -> None:
    # The jitter at either end of its range gives the exact bounds of each wait.
    monkeypatch.setattr(limiter_module.random, "uniform", lambda low, high: high)
    longest = [backoff_s(n) for n in range(1, 6)]
    monkeypatch.setattr(limiter_module.random, "uniform", lambda low, high: low)
    shortest = [backoff_s(n) for n in range(1, 6)]
    assert longest == pytest.approx([0.5, 1.0, 2.0, 4.0, 8.0])
    assert shortest == pytest.approx([0.25, 0.5, 1.0, 2.0, 4.0])
    assert backoff_s(3, None, base_s=2.0) == pytest.approx(4.0)


def test_backoff_without_retry_after_is_capped() -> None:
    for attempt in (10, 30, 100):
        assert backoff_s(attempt) <= MAX_PAUSE_S
        assert backoff_s(attempt, cap_s=30.0) <= 30.0
        assert backoff_s(attempt, cap_s=30.0) >= 15.0  # still a real wait: half the cap at least


def test_a_negative_retry_after_falls_back_to_exponential(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limiter_module.random, "uniform", lambda low, high: high)
    assert backoff_s(4, -1.0) == pytest.approx(4.0)


def test_limiter_credits_a_pause_another_prompt_caused_but_not_its_own():
    from batchrun.prompt.limiter import Limiter, LimitTimeout

    limiter = Limiter()
    limiter.pause_until(time.time() + 0.3)  # relayed from another worker's 429
    deadline = time.monotonic() + 0.05  # passes during the pause
    credited = limiter.acquire(deadline)
    limiter.release()
    assert credited >= 0.2 and limiter.credited_s() == credited
    limiter.pause(0.3)  # this thread's own 429: its wait counts
    with pytest.raises(LimitTimeout):
        limiter.acquire(time.monotonic() + 0.05)


def test_other_prompts_pauses_are_credited_from_the_prompts_one_allowance(monkeypatch) -> None:
    """Other prompts' 429 pauses were credited without a cap (each at most MAX_PAUSE_S, but again at
    every call and retry): a 429 storm held a prompt past its deadline without bound. They now come out of
    the same allowance as the slot waits: a 0.2 s prompt under a 2 s pause, allowance 0.3 s, ends by
    its deadline plus the allowance instead of when the pause does."""
    from batchrun.prompt.limiter import Limiter, LimitTimeout

    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 0.3)
    lim = Limiter()
    lim.begin_prompt()
    lim.pause_until(time.time() + 2.0)  # relayed from another worker's 429
    start = time.monotonic()
    with pytest.raises(LimitTimeout):
        lim.acquire(start + 0.2)
    lived = time.monotonic() - start
    assert lived < 0.2 + 0.3 + 0.3, lived  # not the pause's 2 s (a sleep past the deadline is not begun)
    assert lim.credited_s() == pytest.approx(0.3, abs=0.01)
    lim.begin_prompt()  # the next prompt has its own allowance again; the rest of the pause, past it,
    assert lim.acquire(time.monotonic() + 5) == pytest.approx(0.3, abs=0.01)  # is its own time (< 5 s)
    lim.release()


def test_a_prompts_parallel_waits_out_of_another_prompts_pause_use_its_allowance_once(monkeypatch) -> None:
    """Threads of one prompt (mixture_of_agents's reference models) held at once by another prompt's 429
    pause each took their wait from the prompt's one allowance: the same second charged once a thread.
    3 calls under a 1 s pause, an allowance of 1.5 s: the third found none left and failed at its
    deadline (0.2 s) though the prompt had waited 1 s. Now overlapping waits use it once, as slot waits do."""
    import contextvars

    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 1.5)
    lim = Limiter()
    results: dict[int, str] = {}

    def call(i: int) -> None:
        try:
            lim.acquire(time.monotonic() + 0.2)
            results[i] = "ok"
        except LimitTimeout:
            results[i] = "timeout"

    def prompt() -> None:
        lim.begin_prompt()
        lim.pause_until(time.time() + 1.0)  # relayed from another prompt's 429
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(call, i)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        results[-1] = lim.credit_left()

    p = threading.Thread(target=prompt)
    p.start()
    p.join(30)
    assert [results[i] for i in range(3)] == ["ok"] * 3, results
    assert results[-1] == pytest.approx(0.5, abs=0.2), results


def test_rpm_spacing_holds_behind_the_concurrency_limit() -> None:
    """Requests queued for a request slot take their --max_rpm turn only once they hold a slot, so when
    slots free at the same moment the requests behind them still go out spaced, not in a burst."""
    limiter = Limiter(rpm=300, max_concurrent=2)  # one request every 0.2 s, two at once
    deadline = time.monotonic() + 60
    limiter.acquire(deadline), limiter.acquire(deadline)  # both slots held
    started: list[float] = []

    def request() -> None:
        limiter.acquire(deadline)
        started.append(time.monotonic())

    waiting = [threading.Thread(target=request) for _ in range(2)]
    for t in waiting:
        t.start()
    time.sleep(1.0)  # long past every turn the waiting requests could have taken
    limiter.release(), limiter.release()  # both slots free at once
    for t in waiting:
        t.join(10)
    first, second = sorted(started)
    assert second - first >= 0.1  # spaced by the rate (0.2 s), not both at the moment the slots freed


def _parallel_waits(lim: Limiter, n: int, timeout_s: float, hold_s: float) -> dict[int, tuple]:
    """``n`` threads of one prompt (a tool's parallel model calls: copies of its context) each ask for a
    slot with ``timeout_s`` to their deadline, while another prompt's request holds the one slot ``hold_s``."""
    import contextvars

    lim.acquire(time.monotonic() + 60)  # another prompt's request
    results: dict[int, tuple] = {}

    def call(i: int) -> None:
        t0 = time.monotonic()
        try:
            credited = lim.acquire(time.monotonic() + timeout_s)
        except LimitTimeout:
            results[i] = ("timeout", time.monotonic() - t0)
            return
        time.sleep(0.05)
        lim.release()
        results[i] = ("ok", credited)

    def prompt() -> None:
        lim.begin_prompt()
        lim._allowance().start()  # its first request was granted before (a tool's calls come after it)
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(call, i)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        results[-1] = ("left", lim.credit_left())

    p = threading.Thread(target=prompt)
    p.start()
    time.sleep(hold_s)
    lim.release()
    p.join(30)
    return results


def test_a_prompts_parallel_slot_waits_are_each_credited() -> None:
    """Threads of one prompt waiting for a slot at once (mixture_of_agents's reference models): the first
    held all that was left of the allowance for its wait, the others got none and were charged theirs:
    3 references queued 0.6 s behind another prompt's request, 0.3 s to their deadline, an hour's
    allowance: 2 of 3 failed at 0.3 s. Now each is credited its wait."""
    out = _parallel_waits(Limiter(max_concurrent=1), 3, timeout_s=0.3, hold_s=0.6)
    assert sorted(out[i][0] for i in range(3)) == ["ok"] * 3, out
    assert all(out[i][1] >= 0.5 for i in range(3)), out
    # The waits overlapped: the allowance is used once for the stretch (~0.7 s), not once each (~2 s).
    assert limiter_module.MAX_SLOT_WAIT_S - out[-1][1] < 1.0, out


def test_a_prompts_parallel_slot_waits_use_one_allowance_once(monkeypatch) -> None:
    """Waits at once share the one allowance: none is credited past what is left of it when the
    stretch of waits began (allowance 0.2 s, 0.1 s to the deadline: none waits past 0.3 s, the slot held
    1 s), and the stretch used it up."""
    monkeypatch.setattr(limiter_module, "MAX_SLOT_WAIT_S", 0.2)
    out = _parallel_waits(Limiter(max_concurrent=1), 3, timeout_s=0.1, hold_s=1.0)
    assert [out[i][0] for i in range(3)] == ["timeout"] * 3, out
    assert all(out[i][1] < 0.3 + 0.1 for i in range(3)), out
    assert out[-1][1] == 0.0
