"""The dead-endpoint stop: when model calls keep failing for the endpoint's reasons, pause, probe, stop.

Workers report each attempt that failed for the endpoint's reasons (refused, reset, timed out, 5xx)
and the first answer after such failures (:class:`~batchrun.protocol.EndpointHealth`). After
:data:`DEAD_AFTER` failures with no answer in between, the run holds every request (the same run-wide
pause as for a 429, renewed while it lasts) and probes the endpoint with one minimal chat call every
:data:`PROBE_EVERY_S`. An answer ends the pause; no answer within ``--endpoint_grace`` seconds stops
the run cleanly: no new prompt starts, prompts in flight stop at their next model call (or are failed
after :data:`DRAIN_S`), and the run exits with :data:`EXIT_ENDPOINT_DEAD` (5), printing the resume command,
instead of failing every remaining prompt after its retries.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from batchrun.prompt.llm import LLMClient, LLMConfig, LLMError, SpendGate, Usage

DEAD_AFTER = 8  # endpoint failures in a row, across the run's prompts, before the run pauses and probes
PROBE_EVERY_S = 5.0
PAUSE_STEP_S = 15.0  # the run-wide pause is renewed in steps, so it ends soon after the endpoint is back
DRAIN_S = 30.0  # after the stop: the longest wait for prompts in flight before they are failed
EXIT_ENDPOINT_DEAD = 5  # (4 is an output file that cannot be written)


def probe_once(cfg: LLMConfig, usage: Usage | None = None, gate: SpendGate | None = None) -> bool:
    """One minimal chat call (the start check's); True when the endpoint answered at all. An answer's
    usage is added to ``usage``: a probe costs what any call costs, and the run counts it. ``gate``: the
    run's budget (batchrun/run/dispatch.py's ProbeGate), asked first; a probe it refuses is not sent."""
    from batchrun.run.preflight import CHECK_HEADER

    check = dataclasses.replace(
        cfg, max_tokens=16, max_retries=0, max_rate_limit_retries=0, stream=False,
        request_timeout_s=min(cfg.request_timeout_s, 20.0),
    )  # fmt: skip
    client = LLMClient(
        check, headers={CHECK_HEADER: "1"}, on_usage=lambda usage: None, gate=gate
    )  # the run warns of odd usage
    try:
        client.chat(
            [{"role": "user", "content": "Reply with OK."}], [], deadline=time.monotonic() + 25, usage=usage
        )
        return True
    except LLMError as exc:
        return exc.status is not None and exc.status < 500  # it answered: it is alive
    finally:
        client.close()


class EndpointWatch:
    """The parent's view of the endpoint's health; :meth:`tick` is called by the dispatch loop."""

    def __init__(
        self,
        cfg: LLMConfig,
        grace_s: float,
        pause: Callable[[float], None],
        probe: Callable[[LLMConfig, Usage], bool] = probe_once,
        lift: Callable[[float], None] | None = None,
    ) -> None:
        """``pause(until)``: hold every request of the run until then; ``lift(until)``: that pause is over."""
        self.cfg, self.grace_s, self._pause, self._probe, self._lift = cfg, grace_s, pause, probe, lift
        self.failures = 0  # in a row, since the last answer
        self.probing_since: float | None = None
        self.dead = False
        self.dead_at: float | None = None
        self._back = threading.Event()
        self._paused_until = 0.0
        self._spent: list[Usage] = []  # the probes' answered calls, until the dispatch counts them
        self._spent_lock = threading.Lock()

    def report(self, error_class: str | None) -> str | None:
        """A worker's report; returns a line to show when the run starts probing."""
        if error_class is None:
            self.failures = 0
            self._back.set()
            return None
        self.failures += 1
        if self.failures >= DEAD_AFTER and self.probing_since is None and not self.dead:
            self.probing_since = time.monotonic()
            self._back.clear()
            threading.Thread(target=self._probe_loop, name="endpoint-probe", daemon=True).start()
            self._renew_pause()
            return (
                f"warning: {self.failures} model calls in a row failed for the endpoint's reasons (last: "
                f"{error_class}); the run is paused and the endpoint probed for up to {self.grace_s:g} s "
                "(--endpoint_grace)"
            )
        return None

    def tick(self) -> str | None:
        """Renew the pause while probing; returns a line when the endpoint is back or declared dead."""
        if self.probing_since is None:
            return None
        if self._back.is_set():
            self.probing_since, self.failures = None, 0
            # The pause is renewed PAUSE_STEP_S at a time: ended now, not 7.5-15 s later (a restarted
            # llama-server's run stood idle 14 s after it answered again).
            self.lift_pause()
            return "the endpoint answers again; the run continues"
        if time.monotonic() - self.probing_since > self.grace_s:
            self.probing_since, self.dead, self.dead_at = None, True, time.monotonic()
            return (
                f"error: the endpoint did not come back within {self.grace_s:g} s (--endpoint_grace); "
                "the run stops: no new prompt starts and prompts in flight end"
            )
        self._renew_pause()
        return None

    def lift_pause(self) -> None:
        """End the run-wide pause this watch holds, now (the endpoint is back, or the run stops)."""
        if self._lift is not None and self._paused_until:
            self._lift(self._paused_until)
        self._paused_until = 0.0

    def take_spend(self) -> list[Usage]:
        """The probes' answered calls since the last take (the dispatch adds them to the run's spend)."""
        with self._spent_lock:
            spent, self._spent = self._spent, []
        return spent

    def _renew_pause(self) -> None:
        now = time.time()
        if self._paused_until - now < PAUSE_STEP_S / 2:
            self._paused_until = now + PAUSE_STEP_S
            self._pause(self._paused_until)

    def _probe_loop(self) -> None:
        while self.probing_since is not None and not self._back.is_set():
            usage = Usage()
            alive = self._probe(self.cfg, usage)
            if usage.calls:
                with self._spent_lock:
                    self._spent.append(usage)
            if alive:
                self._back.set()
                return
            self._back.wait(PROBE_EVERY_S)
