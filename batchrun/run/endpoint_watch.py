"""The dead-endpoint stop: when model calls keep failing for the endpoint's reasons, pause, probe, stop.

Workers report each attempt that failed for the endpoint's reasons (refused, reset, timed out, 5xx)
and the first answer after such failures (:class:`~batchrun.protocol.EndpointHealth`). After
:data:`DEAD_AFTER` failures with no answer in between, the run holds every request (the same run-wide
pause as for a 429, renewed while it lasts) and probes the endpoint with one minimal chat call every
:data:`PROBE_EVERY_S`. An answer ends the pause; no answer within ``--endpoint_grace`` seconds stops
the run cleanly: no new prompt starts, prompts in flight stop at their next model call (or are failed
after :data:`DRAIN_S`), and the run exits with :data:`EXIT_ENDPOINT_DEAD` (5), printing the resume command,
instead of failing every remaining prompt after its retries.

The refused-key stop: when :data:`REFUSED_AFTER` model calls in a row are refused for the key's or the
account's reasons (401, 402, 403, 404: a key revoked mid-run, credits spent, an account suspended, the
model retired; OpenAI's
429 ``insufficient_quota``; a 429 whose Retry-After asks more than ``--endpoint_grace``), the run
pauses the same way and probes it, the start check's minimal call every :data:`PROBE_EVERY_S`. A probe
answered means the refusals were the prompts' own (a provider's moderation answers 403 for the prompt it
flags), or that the refusal is over (credits topped up): the run goes on. Probes still refused after
``--endpoint_grace`` mean every call will be: the run stops as above, with :data:`EXIT_ENDPOINT_REFUSED`
(8) and the endpoint's own words. Before, every remaining prompt was sent and refused, each a failure.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from batchrun.prompt.llm import (
    LLMClient,
    LLMConfig,
    LLMError,
    SpendGate,
    Usage,
    refused,
)

DEAD_AFTER = 8  # endpoint failures in a row, across the run's prompts, before the run pauses and probes
PROBE_EVERY_S = 5.0
PAUSE_STEP_S = 15.0  # the run-wide pause is renewed in steps, so it ends soon after the endpoint is back
DRAIN_S = 30.0  # after the stop: the longest wait for prompts in flight before they are failed
EXIT_ENDPOINT_DEAD = 5  # (4 is an output file that cannot be written)
REFUSED_AFTER = 8  # refused calls in a row, across the run's prompts, before the run pauses and probes
EXIT_ENDPOINT_REFUSED = 8  # (6 and 7 are batchrun.cli's)


@dataclasses.dataclass(frozen=True)
class Words:
    """How a watch's lines name the endpoint, its calls, what it pauses and the grace's setting."""

    who: str = "the endpoint"
    calls: str = "model calls"
    what: str = "the run"
    grace: str = "--endpoint_grace"


# A run's judge (--scorer=judge) is watched apart; so is views.score's, whose grace is no flag.
RUN_JUDGE = Words("the judge's endpoint", "judge calls")
RESCORING_JUDGE = Words("the judge's endpoint", "judge calls", "the re-scoring", "the re-scoring's grace")


def probe_once(cfg: LLMConfig, usage: Usage | None = None, gate: SpendGate | None = None) -> bool | LLMError:
    """One minimal chat call (the start check's): True when the endpoint answered at all, False when it
    did not (refused the connection, timed out, 5xx), the error itself when it refused the key or the
    account (:func:`~batchrun.prompt.llm.refused`: 401-404, a spent quota, a 429 asking a longer
    wait than ``cfg.rate_limit_patience_s``). An answer's usage is added to ``usage``: a probe costs
    what any call costs, and the run counts it. ``gate``: the run's budget (batchrun/run/dispatch.py's
    ProbeGate), asked first; a probe it refuses is not sent."""
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
        if refused(exc):
            return exc
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
        probe: Callable[[LLMConfig, Usage], bool | LLMError] = probe_once,
        lift: Callable[[float], None] | None = None,
        words: Words | None = None,
    ) -> None:
        """``pause(until)``: hold every request of the run until then; ``lift(until)``: that pause is over.
        ``words``: how its lines name the endpoint, its calls, the run and the grace (:class:`Words`)."""
        self.cfg, self.grace_s, self._pause, self._probe, self._lift = cfg, grace_s, pause, probe, lift
        self.words = words or Words()
        self.failures = 0  # in a row, since the last answer
        self.refusals = 0  # calls refused (llm.refused) in a row, since the last answer
        self.probing_since: float | None = None
        self.dead = False
        self.dead_at: float | None = None
        self.stood_down = False  # the run stopped on another watch's word: this one probes no more
        # Set with ``dead`` when the stop is for a refused key or account: the probe's refusal, as
        # "HTTP 402: <the endpoint's message>" (not redacted: the caller's redactor knows the key).
        self.refused: str | None = None
        self._probe_refused: LLMError | None = None  # the latest probe's refusal (None: not refused)
        self._said_refused = False  # the first refused probe of this probing was said
        self._for_refusals = False  # the probe under way was started by refusals, not failures
        self.refusal_probes = 0  # probes started by refusals so far
        self._back = threading.Event()
        self._probed = threading.Event()  # set once a probe of this probing has its word
        self._streak_sent: float | None = None  # when the earliest call of the failures in a row went out
        self.concluded = False  # stopped by conclude(): at the run's end, before the grace ran out
        self._paused_until = 0.0
        self._spent: list[Usage] = []  # the probes' answered calls, until the dispatch counts them
        self._spent_lock = threading.Lock()

    def report(
        self, error_class: str | None, refused: bool = False, sent_at: float | None = None
    ) -> str | None:
        """A worker's report (``refused``: the call refused the key or the account, llm.refused; else a
        failure for the endpoint's reasons; ``sent_at``: ``time.time()`` as the call went out); returns a
        line to show when the run starts probing. An answer to a call sent before the failures or
        refusals in a row began says nothing of the endpoint now: it neither ends them nor the probing.
        (A key rotated with long answers under way: each of those answered later began the count again,
        and the run went on starting prompts only to have them refused; one, reported as the pause began,
        ended it as if the probe had been answered.)"""
        if error_class is None:
            if sent_at is not None and self._streak_sent is not None and sent_at < self._streak_sent:
                return None
            self.failures = self.refusals = 0
            self._streak_sent = None
            self._back.set()
            return None
        if sent_at is not None and (self._streak_sent is None or sent_at < self._streak_sent):
            self._streak_sent = sent_at  # the earliest call of the failures in a row
        if refused:
            self.refusals += 1
            if self.refusals >= REFUSED_AFTER and self._start_probing(for_refusals=True):
                if self.refusal_probes > 1:  # a dataset with many flagged prompts: said once
                    return None
                w = self.words
                return (
                    f"warning: {self.refusals} {w.calls} in a row were refused (last: {error_class}); "
                    f"{w.what} is paused and {w.who} probed: an answered probe means the refusals were the "
                    f"prompts' own; one still refused after {self.grace_s:g} s ({w.grace}) stops {w.what}"
                )
            return None
        self.failures += 1
        if self.failures >= DEAD_AFTER and self._start_probing():
            w = self.words
            return (
                f"warning: {self.failures} {w.calls} in a row failed for the endpoint's reasons (last: "
                f"{error_class}); {w.what} is paused and {w.who} probed for up to {self.grace_s:g} s "
                f"({w.grace})"
            )
        return None

    def _start_probing(self, for_refusals: bool = False) -> bool:
        """Pause the run and probe, unless a probe is under way or the run stopped; True when started."""
        if self.probing_since is not None or self.dead or self.stood_down:
            return False
        self._for_refusals = for_refusals
        self.refusal_probes += for_refusals
        self.probing_since = time.monotonic()
        self._probe_refused, self._said_refused = None, False
        self._back.clear()
        self._probed.clear()
        threading.Thread(target=self._probe_loop, name="endpoint-probe", daemon=True).start()
        self._renew_pause()
        return True

    def tick(self) -> str | None:
        """Renew the pause while probing; returns a line when the endpoint is back or declared dead."""
        if self.probing_since is None:
            return None
        w = self.words
        if self._back.is_set():
            self.probing_since, self.failures, self.refusals, self._streak_sent = None, 0, 0, None
            # The pause is renewed PAUSE_STEP_S at a time: ended now, not 7.5-15 s later (a restarted
            # llama-server's run stood idle 14 s after it answered again).
            self.lift_pause()
            if not self._for_refusals:
                return f"{w.who} answers again; {w.what} continues"
            if self.refusal_probes > 1:
                return None
            return (
                f"{w.who} answered the probe: the refusals were the prompts' own, or are over; {w.what} "
                f"continues (the same pause and probe after any {REFUSED_AFTER} refusals in a row, said only "
                "this once)"
            )
        refused = self._probe_refused
        if time.monotonic() - self.probing_since > self.grace_s:
            if self._stop():  # the latest probe was refused: so will every call be
                return (
                    f"error: {w.who} still refuses {w.what}'s calls after {self.grace_s:g} s "
                    f"({w.grace}: {self.refused[:300]}); {w.what} stops: no new prompt starts and "
                    "prompts in flight end"
                )
            return (
                f"error: {w.who} did not come back within {self.grace_s:g} s ({w.grace}); "
                f"{w.what} stops: no new prompt starts and prompts in flight end"
            )
        self._renew_pause()
        if refused is not None and not self._said_refused:
            self._said_refused = True
            return (
                f"warning: {w.who} refused {w.what}'s probe too ({refusal_text(refused)[:300]}): "
                f"{refused_means('the key', 'the model', w.what, w.grace)}; it is probed every "
                f"{PROBE_EVERY_S:g} s, and {w.what} stops if it still refuses after {self.grace_s:g} s"
            )
        return None

    def awaits_probe(self) -> bool:
        """Whether this watch probes and no probe of this probing has had its word yet, within the grace:
        :meth:`conclude` decides on that word (the caller keeps answering a budget's probe meanwhile)."""
        if self.probing_since is None or self.dead or self.stood_down or self._probed.is_set():
            return False
        return time.monotonic() - self.probing_since <= self.grace_s

    def conclude(self) -> str | None:
        """The run's prompts all ended while this watch probes (its last ones failed or were refused,
        those in flight with them): nothing would run while the grace ran out, so the stop is decided on
        the probe's word now, once it has one (:meth:`awaits_probe`; a probe has a 20 s timeout).
        Answered, the run ends as it would have; refused, it stops as a refused key does (``refused``
        set); unanswered, or no word within the grace, as a dead endpoint does (``dead`` both times, and
        ``concluded``). Before, the run ended with its prompts failed, exit 3 or even 0, and nothing said
        the key was refused. Returns a line to show, or None."""
        if self.probing_since is None or self.dead or self.stood_down:
            return None
        if self._back.is_set():
            self.tick()  # ends the probing; its "answered" line says the run continues: it ends
            return None
        w, self.concluded = self.words, True
        self.lift_pause()
        if self._stop():
            return (
                f"error: {w.who} refused {w.what}'s last calls and its probe ({self.refused[:300]}), and "
                f"nothing is left to run: {w.what} stops without waiting out {w.grace}"
            )
        return (
            f"error: {w.who} {'refused' if self._for_refusals else 'failed'} {w.what}'s last calls and did "
            f"not answer its probe, and nothing is left to run: {w.what} stops without waiting out {w.grace}"
        )

    def _stop(self) -> bool:
        """The probing ends in the stop: ``dead``, and ``refused`` set when the latest probe was refused
        (so will every call be); returns whether it was."""
        self.probing_since, self.dead, self.dead_at = None, True, time.monotonic()
        if self._probe_refused is not None:
            self.refused = refusal_text(self._probe_refused)
        return self.refused is not None

    def lift_pause(self) -> None:
        """End the run-wide pause this watch holds, now (the endpoint is back, or the run stops)."""
        if self._lift is not None and self._paused_until:
            self._lift(self._paused_until)
        self._paused_until = 0.0

    def stand_down(self) -> None:
        """The run stopped on another watch's word (the judge's endpoint's, or the agent's): no more
        probes, and this watch's pause ends now, so prompts held by it stop at their next call."""
        self.stood_down = True
        self.probing_since = None
        self._back.set()  # ends the probe loop
        self.lift_pause()

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
            # Refused: so will every call be, unless that ends within the grace (credits topped up, a
            # proxy's upstream back, a key put back); at its end tick stops the run on the latest word.
            self._probe_refused = alive if isinstance(alive, LLMError) else None
            self._probed.set()
            if alive and not isinstance(alive, LLMError):
                self._back.set()
                return
            self._back.wait(PROBE_EVERY_S)


def refused_means(key: str, model: str, what: str, grace: str) -> str:
    """What calls and probes refused past the grace mean, as every line that says so puts it (the run's
    stop, its watch's warning, a re-scoring's stop): ``key`` and ``model`` as the line names them, ``what``
    is rate limited, ``grace`` names how long it waits."""
    return (
        f"{key} or the account is refused (revoked, out of credits, suspended), {model} is gone, or {what} "
        f"is rate limited for longer than {grace}"
    )


def refusal_text(refused: LLMError) -> str:
    """A refusal as "HTTP 402: <the endpoint's words>" (the client's message names the status; else it
    is added). Not redacted: the caller's redactor knows the key."""
    said = str(refused)
    return said if said.startswith(f"HTTP {refused.status}") else f"HTTP {refused.status}: {said}"
