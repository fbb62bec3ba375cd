"""The run's budget as a cap: a model call is sent only when it fits (the parent's side).

Before each attempt of a model call a worker asks (:class:`~batchrun.protocol.Reserve`) for the call's
worst case: its estimated prompt tokens plus its completion limit (``--max_tokens``, or the limit a
budget run derives). The parent grants it (:class:`~batchrun.protocol.Grant`) only when what was spent,
plus what the calls in flight have reserved, plus this worst case fits ``--budget_tokens`` (and, once a
price per token has been seen, ``--budget_usd``). One that does not fit waits for calls in flight to
settle (a prompt under way goes before one that has not started: a tight budget finishes prompts); one that does not fit even with nothing in flight is refused, and the run's budget is
reached. So whatever the number of prompts in flight, the run spends at most its budget, as long as the
endpoint's counts stay within the worst cases (they do for a server that honours ``max_tokens``; the
prompt estimate is UTF-8 bytes / 3, above the ~4 bytes per token of English and code).

A ``--budget_usd`` needs a price: until some answer reported a cost, calls are granted one at a time, so
the first priced answer teaches the price (the most USD per token seen) before more are in flight; an
endpoint that reports no cost after its first answer costs nothing by its own account.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Decision = tuple[Any, int, bool]  # (worker id, reservation id, granted)


class Budget:
    def __init__(self, tokens: int | None, usd: float | None, spent: Callable[[], tuple[int, float]]) -> None:
        """``spent()``: the run's (tokens, USD) so far, as the recorder counts them."""
        self.tokens, self.usd, self._spent = tokens, usd, spent
        self.reserved: dict[tuple[Any, int], int] = {}  # (worker, reservation) -> tokens
        self.waiting: list[tuple[int, int, Any, int, int]] = []  # (-priority, arrival, worker, rid, tokens)
        self._arrivals = 0
        self.usd_per_token: float | None = None  # the most any answer cost per token; None: none priced yet
        self.answers = 0
        self.exhausted = False  # a call did not fit with nothing in flight: the budget is reached

    @property
    def active(self) -> bool:
        return self.tokens is not None or self.usd is not None

    def request(self, worker: Any, rid: int, tokens: int, priority: int = 0) -> list[Decision]:
        """``priority``: the calls its prompt has made already. A prompt under way goes before one that
        has not started, so a tight budget finishes prompts instead of starting many it cannot pay for."""
        self._arrivals += 1
        heapq.heappush(self.waiting, (-priority, self._arrivals, worker, rid, max(0, tokens)))
        return self._decide()

    def settle(self, worker: Any, rid: int | None, tokens: int, usd: float) -> list[Decision]:
        """A reserved call is over (its spend is already in ``spent()``): its reservation is freed."""
        if tokens > 0:
            self.answers += 1
            # The most USD per token seen; an answer with no cost sets 0 (free by its own account).
            self.usd_per_token = max(self.usd_per_token or 0.0, max(0.0, usd) / tokens)
        if rid is not None:
            self.reserved.pop((worker, rid), None)
        return self._decide()

    def drop(self, worker: Any) -> list[Decision]:
        """A worker is gone: its reservations and requests with it."""
        for key in [k for k in self.reserved if k[0] == worker]:
            del self.reserved[key]
        self.waiting = [w for w in self.waiting if w[2] != worker]
        heapq.heapify(self.waiting)
        return self._decide()

    def refuse_all(self) -> list[Decision]:
        """The run stops (budget reached): every waiting call is refused."""
        out = [(w, rid, False) for _, _, w, rid, _ in sorted(self.waiting)]
        self.waiting.clear()
        return out

    def _fits(self, tokens: int) -> bool:
        spent_tokens, spent_usd = self._spent()
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
        return True

    def _decide(self) -> list[Decision]:
        out: list[Decision] = []
        while self.waiting and not self.exhausted:
            _, _, worker, rid, tokens = self.waiting[0]
            if self._fits(tokens):
                heapq.heappop(self.waiting)
                self.reserved[(worker, rid)] = tokens
                out.append((worker, rid, True))
            elif not self.reserved:
                self.exhausted = True
            else:
                break  # calls in flight may leave room when they settle
        if self.exhausted:
            out += self.refuse_all()
        return out
