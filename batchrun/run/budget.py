"""The run's budget as a cap: a model call is sent only when it fits (the parent's side).

Before each attempt of a model call a worker asks (:class:`~batchrun.protocol.Reserve`) for the call's
worst case: its estimated prompt tokens plus its completion limit (``--max_tokens``, or the limit a
budget run derives). The parent grants it (:class:`~batchrun.protocol.Grant`) only when what was spent,
plus what the calls in flight have reserved, plus this worst case fits ``--budget_tokens`` (and, once a
price per token has been seen, ``--budget_usd``). One that does not fit waits for calls in flight to
settle (a prompt under way goes before one that has not started, and a prompt starts only when the
budget also holds what it and the prompts under way are expected to spend: a tight budget finishes
prompts); one that does not fit even with nothing in flight is refused, and the run's budget is
reached, as it is when what is left holds no whole prompt as this run's prompts cost. So whatever the number of prompts in flight, the run spends at most its budget, as long as the
endpoint's counts stay within the worst cases (they do for a server that honours ``max_tokens``; the
prompt estimate is UTF-8 bytes / 3, above the ~4 bytes per token of English and code).

A ``--budget_usd`` needs a price: until some answer reported a cost, calls are granted one at a time, so
the first priced answer teaches the price (the most USD per token seen) before more are in flight. So
does each other model the run asks (a judge's, a tool's: it may cost far more per token than the run's):
until one of its answers reported a cost, its calls go one at a time, and calls in flight are reserved at
the most USD per token any model cost. Reserved at the run's model's price, a judge 100 times dearer
billed $0.16 on a $0.05 budget. An
endpoint whose start-check answer reports no cost stops the run before it starts (batchrun/run/
preflight.py: the budget could not be kept). An answer without a cost later (a provider that does not
price it, a judge or tool endpoint that reports none) is counted at the most USD per token seen
(``estimated_usd``), never as free; one before any price was seen cannot be counted at all: the budget
is then ``unmeasured`` and no further call is granted (the run stops as at its budget, exit code 6).

An attempt that failed after its request may have reached the endpoint (a stream cut or timed out
mid-answer, a 200 whose body broke) may still have been billed: it is counted too, as the runner's
estimate (``unanswered_tokens``, batchrun/prompt/llm.py), in the tokens spent and, at the most USD per
token seen (once one is), in ``estimated_usd``. Not counting it let an endpoint that breaks its
answers spend (max_retries + 1) times the budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Decision = tuple[Any, int, bool]  # (worker id, reservation id, granted)
DEFAULT_CALLS = 3  # calls a prompt is expected to make until a prompt of this run has finished


class Budget:
    def __init__(self, tokens: int | None, usd: float | None, spent: Callable[[], tuple[int, float]]) -> None:
        """``spent()``: the run's (tokens, USD) so far, as the recorder counts them."""
        self.tokens, self.usd, self._spent = tokens, usd, spent
        self.reserved: dict[tuple[Any, int], int] = {}  # (worker, reservation) -> tokens
        # (-priority, arrival, worker, rid, tokens, prompt, calls its prompt made, model)
        self.waiting: list[tuple[int, int, Any, int, int, Any, int, Any]] = []
        self.models: dict[tuple[Any, int], Any] = {}  # (worker, reservation) -> the model it asks
        self.priced_models: set[Any] = set()  # models an answer of which reported a cost
        self._arrivals = 0
        self.usd_per_token: float | None = None  # the most any answer cost per token; None: none priced yet
        self.answers = 0
        self.exhausted = False  # a call did not fit with nothing in flight: the budget is reached
        self.why = ""  # when no whole prompt fits any more, what one is expected to cost
        self.estimated_usd = 0.0  # answers that reported no cost, at the most USD per token seen
        self.unpriced_unanswered = 0  # failed attempts' tokens before any price: priced once one is seen
        self.unmeasured = False  # an answer with no cost before any price: --budget_usd cannot be kept
        # Prompts with a granted call and no outcome yet: key -> (worker, calls made before the last grant)
        self.under_way: dict[Any, tuple[Any, int]] = {}
        self._done = [0, 0, 0]  # finished prompts, their calls, their tokens: what a prompt costs here
        self._most_calls = 0  # the most calls a finished prompt made

    @property
    def active(self) -> bool:
        return self.tokens is not None or self.usd is not None

    def request(
        self, worker: Any, rid: int, tokens: int, priority: int = 0, prompt: Any = None, model: Any = None
    ) -> list[Decision]:
        """``model``: the model the call asks (see :meth:`_fits`). ``priority``: the calls its prompt has made already. A prompt under way goes before one that
        has not started, and a prompt starts only when the budget also holds what the prompts under way
        and it are expected to spend (see :meth:`_room_to_start`): a tight budget finishes prompts
        instead of starting many it cannot pay for."""
        self._arrivals += 1
        # A retried first call has made no call, but its prompt is under way: it goes first too.
        first = max(priority, 1) if prompt is not None and prompt in self.under_way else priority
        heapq.heappush(
            self.waiting, (-first, self._arrivals, worker, rid, max(0, tokens), prompt, priority, model)
        )
        return self._decide()

    def prompt_done(self, prompt: Any, calls: int, tokens: int) -> list[Decision]:
        """A prompt's outcome: it is no longer under way, and it teaches what a prompt costs."""
        self.under_way.pop(prompt, None)
        if calls > 0:
            self._done[0] += 1
            self._done[1] += calls
            self._done[2] += max(0, tokens)
            self._most_calls = max(self._most_calls, calls)
        return self._decide()

    def settle(
        self, worker: Any, rid: int | None, tokens: int, usd: float, priced: bool = True, unanswered: int = 0
    ) -> list[Decision]:
        """A reserved call is over (its spend is already in ``spent()``): its reservation is freed.
        ``priced``: the answer reported its cost; one that did not is estimated, or ends a USD budget.
        ``unanswered``: the estimated tokens of a failed attempt that may have been billed (in
        ``spent()``'s tokens too): in USD at the price seen, or once one is seen."""
        if unanswered > 0 and self.usd is not None:
            if self.usd_per_token is None:
                self.unpriced_unanswered += unanswered
            else:
                self.estimated_usd += unanswered * self.usd_per_token
        if tokens > 0:
            self.answers += 1
            if priced:  # the most USD per token seen (a cost of 0 is a free model's price)
                self.usd_per_token = max(self.usd_per_token or 0.0, max(0.0, usd) / tokens)
                if rid is not None and (worker, rid) in self.models:
                    self.priced_models.add(self.models[(worker, rid)])
                if self.unpriced_unanswered and self.usd is not None:
                    self.estimated_usd += self.unpriced_unanswered * self.usd_per_token
                    self.unpriced_unanswered = 0
            elif self.usd is not None and self.usd_per_token is not None:
                self.estimated_usd += tokens * self.usd_per_token
            elif self.usd is not None:
                self.unmeasured = self.exhausted = True
        if rid is not None:
            self.reserved.pop((worker, rid), None)
            self.models.pop((worker, rid), None)
        return self._decide()

    def drop(self, worker: Any) -> list[Decision]:
        """A worker is gone: its reservations and requests with it."""
        for key in [k for k in self.reserved if k[0] == worker]:
            del self.reserved[key]
            self.models.pop(key, None)
        for key in [k for k, (w, _) in self.under_way.items() if w == worker]:
            del self.under_way[key]
        self.waiting = [w for w in self.waiting if w[2] != worker]
        heapq.heapify(self.waiting)
        return self._decide()

    def refuse_all(self) -> list[Decision]:
        """The run stops (budget reached): every waiting call is refused."""
        out = [(e[2], e[3], False) for e in sorted(self.waiting, key=lambda e: e[:2])]
        self.waiting.clear()
        return out

    def _fits(self, tokens: int, model: Any = None) -> bool:
        spent_tokens, spent_usd = self._spent()
        spent_usd += self.estimated_usd
        in_flight = sum(self.reserved.values())
        if self.tokens is not None and spent_tokens + in_flight + tokens > self.tokens:
            return False
        if self.usd is not None:
            if spent_usd >= self.usd:
                return False
            if self.usd_per_token is None:
                return not self.reserved  # no answer yet: one call at a time until one shows the price
            if spent_usd + (in_flight + tokens) * self.usd_per_token > self.usd:
                return False
            if model not in self.priced_models:  # a model not priced yet: one call at a time until it is
                return all(m in self.priced_models for m in self.models.values())
        return True

    def _room_to_start(self, tokens: int, model: Any = None) -> bool | None:
        """Whether a new prompt's first call may go: the budget holds it, the rest of this prompt, and
        what the prompts under way are expected still to spend. True: it starts; False: it waits for
        prompts under way; None: it never will (the rest of the budget holds no whole prompt).

        Once prompts finished, a prompt is expected to cost what they did on average (calls per prompt,
        tokens per call), and the budget also keeps the room by which the longest of them went past that
        average, so the prompt started last can still finish. Until one finished, a prompt is guessed at
        :data:`DEFAULT_CALLS` calls of this first call's size, and a second prompt starts only while the
        budget holds twice what it and the prompts under way are guessed to spend (the guess is only a
        guess); the first one starts alone if its call fits."""
        prompts, calls, spent = self._done
        if not prompts:
            if not self.under_way and not self.reserved:
                return True
            per_prompt, per_call, slack = float(DEFAULT_CALLS), float(tokens), 2.0
        else:
            per_prompt, per_call, slack = calls / prompts, max(1.0, spent / calls), 1.0
        still = sum(max(0.0, per_prompt - made - 1) for _, made in self.under_way.values())
        need = slack * (tokens + (still + max(0.0, per_prompt - 1)) * per_call)
        if prompts:
            need += max(0.0, self._most_calls - per_prompt) * per_call
        if self._fits(int(need), model):
            return True
        if self.under_way or self.reserved:
            return False
        self.why = f"the rest holds no whole prompt (~{int(need):,} tokens each, as this run's prompts cost)"
        return None

    def _no_call_fits(self, tokens: int) -> str:
        """Why a call does not fit with nothing in flight (a budget below one call's worst case says so)."""
        spent_tokens, spent_usd = self._spent()
        if self.tokens is not None and spent_tokens + tokens > self.tokens:
            return (
                f"the next model call alone may take ~{tokens:,} tokens (its prompt, estimated, plus its "
                f"completion limit) and {max(0, self.tokens - spent_tokens):,} are left"
            )
        if self.usd is not None and self.usd_per_token is not None:
            left = max(0.0, self.usd - spent_usd - self.estimated_usd)
            return f"the next model call alone may cost ~${tokens * self.usd_per_token:.4f} and ${left:.4f} is left"
        return ""

    def _decide(self) -> list[Decision]:
        out: list[Decision] = []
        while self.waiting and not self.exhausted:
            _, _, worker, rid, tokens, prompt, made, model = self.waiting[0]
            starting = prompt is not None and prompt not in self.under_way
            fits = self._fits(tokens, model)  # once: it sums the reservations in flight (a thousand at scale)
            room = self._room_to_start(tokens, model) if starting and fits else True
            if fits and room:
                heapq.heappop(self.waiting)
                self.reserved[(worker, rid)] = tokens
                self.models[(worker, rid)] = model
                if prompt is not None:
                    self.under_way[prompt] = (worker, made)
                out.append((worker, rid, True))
            elif room is None or (not self.reserved and not fits):
                if room is not None and not self.why:
                    self.why = self._no_call_fits(tokens)
                self.exhausted = True
            else:
                break  # calls in flight, or prompts under way, may leave room when they settle
        if self.exhausted:
            out += self.refuse_all()
        return out


class CheckGate:
    """The budget for the start checks, made before the dispatch (and its :class:`Budget`) exists: a check
    is sent only when the rest of the run's budget holds its worst case (its request's estimate plus the
    16 tokens it asks for), after the journal holds its grant; what it spent is counted as the runner's
    own call. Before, a check was sent whatever was left, and a kill -9 before the first status.json
    lost its spend from the books. ``recorder``: the run's :class:`~batchrun.run.recorder.Recorder`."""

    WORKER = "start-check"

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self._next = 0

    def reserve(
        self, tokens: int, deadline: float, priority: int = 0, model: str | None = None
    ) -> tuple[Any, float]:
        from batchrun.config import UsageError

        rec = self.recorder
        spent_tokens, spent_usd = rec.budget_spent()
        if rec.budget_tokens is not None and spent_tokens + tokens > rec.budget_tokens:
            raise UsageError(
                f"--budget_tokens={rec.budget_tokens}: this run's invocations spent {spent_tokens:,} tokens, and "
                f"the {max(0, rec.budget_tokens - spent_tokens):,} left cannot hold the start check's "
                f"~{tokens:,} (its request, estimated, plus its 16-token answer); no call was sent. A run's "
                "budget holds all its invocations; give a larger one to go on"
            )
        if rec.budget_usd is not None and spent_usd >= rec.budget_usd:
            raise UsageError(
                f"--budget_usd={rec.budget_usd:g}: this run's invocations spent ${spent_usd:.4f}; no call was sent"
            )
        self._next += 1
        if rec.journal is not None:
            rec.journal.grant(self.WORKER, self._next, tokens, None)
            rec.journal.sync()
        return self._next, 0.0

    def settle(self, ticket: Any, usage: dict[str, Any] | None) -> None:
        from batchrun.run.worker import spend_of_usage

        spend = spend_of_usage(usage or {}, -1, -1, 0, ticket)
        rec = self.recorder
        if spend.prompt_tokens + spend.completion_tokens:
            rec.add_check_spend(spend.prompt_tokens, spend.completion_tokens, spend.cost_usd)
        rec.spend["unanswered_tokens"] += spend.unanswered_tokens
        if rec.journal is not None:
            rec.journal.settle(
                self.WORKER,
                ticket,
                spend.prompt_tokens,
                spend.completion_tokens,
                spend.cost_usd,
                spend.unanswered_tokens,
            )
