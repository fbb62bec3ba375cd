"""The spend journal: every model call the budget lets go is written down, durably, before it may be sent.

A run with a budget holds its spend in memory and writes it to ``status.json`` every few seconds; a
``kill -9`` (a preempted job, a lost machine) loses what came after that write: the calls answered
since, and every call granted since and still in flight, which the endpoint bills all the same. A
resume then got that spend back as budget (a run killed once spent 45,342 tokens on a 30,000 cap, and
its books said 28,097). So the parent appends one line to ``spend_journal.jsonl`` for each grant (the
call's worst case, as the budget reserved it) and makes it durable (flush + fsync, one for all the
grants of a moment: a group commit) before the grant goes to the worker; and one line when the call is
over (what it spent), written at once, made durable with the next grants. A resume reads the journal
of every invocation that wrote no ``statistics.json``: what its settled calls spent, and each grant
with no settlement at its reservation (perhaps billed: ``unanswered_tokens``). Those figures are an
upper bound of what the endpoint may have billed, whatever the instant of the kill, as long as it
honours ``max_tokens``. The runner's own calls under a budget (the start check, the dead-endpoint
probes) are journaled the same way.

Once an invocation has written ``statistics.json`` (whose ``runs`` hold every invocation before it),
the journal is removed; a kill between the two leaves lines of invocations the ``runs`` already hold,
which a resume skips.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

from batchrun.storage import WriteError

JOURNAL_NAME = "spend_journal.jsonl"
TOKEN_KEYS = ("prompt_tokens", "completion_tokens", "unanswered_tokens")


class SpendJournal:
    """This invocation's lines of the run's spend journal (the parent's; one writer, the dispatch loop's
    thread or the start check before it)."""

    def __init__(self, run_dir: Path, invocation: str, started_at: str) -> None:
        self.path = Path(run_dir) / JOURNAL_NAME
        self.invocation = invocation
        self.started_at = started_at
        self._fd: int | None = None
        self._unsynced = False
        self._next = 0
        self._keys: dict[tuple[Any, Any], int] = {}  # (worker, its reservation id) -> grant number

    def open(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._fd = fd
            size = os.fstat(fd).st_size
            if size:  # a line torn by a kill: closed, so the next line is whole
                with self.path.open("rb") as rd:
                    rd.seek(size - 1)
                    if rd.read(1) != b"\n":
                        os.write(fd, b"\n")
        except OSError as exc:
            raise WriteError(self.path, exc) from None
        self._write({"invocation": self.invocation, "started_at": self.started_at})
        self._unsynced = True
        self.sync()

    def grant(self, worker: Any, rid: Any, tokens: int, usd: float | None) -> None:
        """A call may be sent; durable only after :meth:`sync`, which must come before the grant is sent."""
        self._next += 1
        self._keys[(worker, rid)] = self._next
        line = {"invocation": self.invocation, "grant": self._next, "tokens": int(tokens)}
        if usd is not None:
            line["usd"] = round(usd, 8)
        self._write(line)
        self._unsynced = True

    def settle(
        self,
        worker: Any,
        rid: Any,
        prompt_tokens: float = 0,
        completion_tokens: float = 0,
        cost_usd: float = 0.0,
        unanswered_tokens: float = 0,
    ) -> None:
        """A granted call is over: what it spent replaces its reservation (written now, synced with the
        next grants: lost, the call counts at its reservation, which is more)."""
        number = self._keys.pop((worker, rid), None)
        if number is None:
            return
        self._write(
            {
                "invocation": self.invocation,
                "settle": number,
                "prompt_tokens": int(prompt_tokens),
                "completion_tokens": int(completion_tokens),
                "cost_usd": round(float(cost_usd), 8),
                "unanswered_tokens": int(unanswered_tokens),
            }
        )

    def sync(self) -> None:
        """Make every line written so far durable (one fsync for all of them)."""
        if self._fd is None or not self._unsynced:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise WriteError(self.path, exc) from None
        self._unsynced = False

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def remove(self) -> None:
        """statistics.json holds every invocation's spend now: the journal's lines are in its ``runs``."""
        self.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _write(self, line: dict[str, Any]) -> None:
        if self._fd is None:
            return
        data = json.dumps(line, separators=(",", ":")).encode() + b"\n"
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as exc:
            raise WriteError(self.path, exc) from None


def remove_journal(run_dir: Path, journal: SpendJournal | None) -> None:
    """After statistics.json is written: its ``runs`` hold what the journal held (a resume of a budget run
    without a budget left one, and read it too)."""
    if journal is not None:
        journal.close()
    try:
        (Path(run_dir) / JOURNAL_NAME).unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise WriteError(Path(run_dir) / JOURNAL_NAME, exc) from None


def read_journal(run_dir: Path) -> dict[str, dict[str, Any]]:
    """What each invocation in the run's spend journal spent, at most: invocation id -> ``started_at``,
    ``prompt_tokens``, ``completion_tokens``, ``cost_usd`` (settled calls), ``unanswered_tokens``
    (settled failed attempts, and every grant never settled at its reservation), ``unanswered_usd`` (those
    grants at the price they were reserved at), ``unpriced_tokens`` (the tokens of those reserved before
    any price was seen: :func:`batchrun.run.recorder.lost_runs` prices them at the most per token the run's
    answers cost), ``requests`` (grants). A torn or unreadable line is skipped:
    a grant is sent only once its line is whole and synced, so a torn one was never sent."""
    path = Path(run_dir) / JOURNAL_NAME
    books: dict[str, dict[str, Any]] = {}
    grants: dict[str, dict[int, tuple[int, float | None]]] = collections.defaultdict(dict)
    try:
        fh = path.open("rb")
    except OSError:
        return {}
    with fh:
        for raw in fh:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(line, dict) or not isinstance(line.get("invocation"), str):
                continue
            inv = line["invocation"]
            entry = books.setdefault(
                inv,
                {"started_at": None, **dict.fromkeys(TOKEN_KEYS, 0), "cost_usd": 0.0, "unanswered_usd": 0.0, "unpriced_tokens": 0,
                 "requests": 0},
            )  # fmt: skip
            if isinstance(line.get("started_at"), str):
                entry["started_at"] = line["started_at"]
            elif _count(line.get("grant")) is not None:
                entry["requests"] += 1
                usd = _usd(line["usd"]) if "usd" in line else None  # none: no price seen when it was granted
                grants[inv][line["grant"]] = (_count(line.get("tokens")) or 0, usd)
            elif _count(line.get("settle")) is not None and line["settle"] in grants[inv]:
                del grants[inv][line["settle"]]
                for key in TOKEN_KEYS:
                    entry[key] += _count(line.get(key)) or 0
                entry["cost_usd"] += _usd(line.get("cost_usd"))
    for inv, unsettled in grants.items():  # perhaps billed: at their reservations
        books[inv]["unanswered_tokens"] += sum(t for t, _ in unsettled.values())
        books[inv]["unanswered_usd"] += sum(u for _, u in unsettled.values() if u is not None)
        books[inv]["unpriced_tokens"] += sum(t for t, u in unsettled.values() if u is None)
    return books


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _usd(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return float(value) if ok else 0.0
