"""The single writer: every outcome is appended the moment it arrives; state files are replaced whole.

:class:`Recorder` owns the run directory while the run works in it (an exclusive lock), the
counters of this run, and every write: ``batch_N.jsonl`` (trajectories), ``discarded.jsonl``,
``failed.jsonl``, ``checkpoint.json``, ``status.json`` and ``run_manifest.json``. Appends are
flushed and fsync'd; state files are written to a temp file and renamed. Every line goes through
the redactor first.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.config import UsageError
from batchrun.identity import (
    MERGE_SET_ASIDE,
    Line,
    RowIdentity,
    is_index,
    kept_line,
    read_discards,
    superseded_among,
)
from batchrun.protocol import DISCARDED, FAILED, TRAJECTORY, Outcome, Spend
from batchrun.record import (
    ROUND_FIELD,
    normalize_metadata,
    occurrence_of,
    sample_index_of,
    valid_outcome_row,
    valid_record,
)
from batchrun.run.journal import JOURNAL_NAME, SpendJournal
from batchrun.run.run_dir import FORMAT_FIELD, FORMAT_VERSION, LOCK_NAME
from batchrun.secrets import Redactor, terminal_safe
from batchrun.sharegpt import finite_number, parse_json
from batchrun.storage import (
    WriteError,
    append_jsonl,
    append_jsonl_bytes,
    batch_files,
    iter_jsonl,
    json_line,
    remove_stale_temp_files,
    write_json_atomic,
    write_text_in_place,
)

STATUS_EVERY_S = 2.0  # status.json refresh period during a run


def _now() -> str:
    return dt.datetime.now().isoformat(timespec="seconds")


SPEND_KEYS = ("prompt_tokens", "completion_tokens", "cost_usd")


def credible(value: Any) -> float:
    """A count of tokens or dollars as the spend adds it: a finite number of at least 0, else 0 (a NaN,
    an infinity, a negative count or a bool from an endpoint would void the budget's arithmetic)."""
    number = finite_number(value)
    if number is None or number < 0:
        return 0
    return value


def set_aside_row(rec: dict[str, Any], reason: str) -> dict[str, Any]:
    """The discarded.jsonl row of a record set aside with ``reason`` (:meth:`Recorder.set_aside`)."""
    meta = rec.get("metadata") or {}
    identity = RowIdentity.of_record(rec)
    return {
        "prompt": identity.text,
        **identity.fields(),
        "row_key": identity.key,
        # As every discard names its row (its id and fields): resume tells rows of one prompt apart by them.
        "row_id": meta.get("row_id") or None,
        "row_fields": meta.get("row_fields") if isinstance(meta.get("row_fields"), str) else None,
        "sample_index": sample_index_of(meta),
        "occurrence": occurrence_of(meta),
        "prompt_index": rec.get("prompt_index"),
        "batch_num": meta.get("batch_num"),
        "reason": reason,
        "timestamp": _now(),
        "record": rec,
    }


class Recorder:
    """Writes a run's files and keeps its counters; the only code that writes under the run directory."""

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        redact: Redactor,
        *,
        verbose: bool = False,
        budget_usd: float | None = None,
        budget_tokens: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.run_name = run_name
        self.redact = redact
        # Secrets only: for what a model or a tool said (discarded samples) and a row's identity.
        self.sample_text: Callable[[str], str] = getattr(redact, "sample", redact)
        self.verbose = verbose
        self.budget_usd, self.budget_tokens = budget_usd, budget_tokens
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        # error class -> its messages (cut), for the closing summary's most common one per class
        self.failure_messages: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.discards: collections.Counter[str] = collections.Counter()
        self.spend: collections.Counter[str] = collections.Counter()  # this run's usage, all outcomes
        # Tokens and cost of prompts still in flight, reported call by call (batch_num, prompt_index, sample_index) -> usage:
        # the budget sees spend as it happens; the outcome's usage then adds only the rest.
        self.live_spend: dict[tuple[int, int, int], collections.Counter[str]] = {}
        self.budget_hit = False
        self.budget_unfinished = 0  # prompts the budget stopped after they had made model calls
        self.budget_unfinished_spend: collections.Counter[str] = collections.Counter()  # what those spent
        self.budget_estimated_usd = 0.0  # --budget_usd: answers without a cost, at the learned price
        # What this run's earlier invocations spent (a --resume's): the budget holds them all.
        self.earlier_tokens, self.earlier_usd = 0, 0.0
        self.budget_unmeasured = False  # --budget_usd: an answer without a cost before any price
        # The runner's own model calls (the start check, the dead-endpoint probes): in the spend and the
        # budget, since they cost what any call costs, and shown apart, since no sample holds them.
        self.checks: collections.Counter[str] = collections.Counter()
        self.total = 0  # prompts handed to the workers in this run
        # The prompts a worker holds now, as the dispatch counts them (None: not counted, every prompt
        # without an outcome is). status.json said 147 in flight where 2 workers x 2 slots ran 4.
        self.in_flight: Callable[[], int] | None = None
        self.started = time.monotonic()
        self.started_at = _now()
        # Which invocation this is, in its runs entry and its status.json: started_at is to the second,
        # and two invocations started in one second were one entry in the books.
        self.invocation = os.urandom(6).hex()
        # The runs entries of earlier invocations that wrote no statistics.json (lost_runs), carried in
        # this one's status.json until an invocation writes them there: a second kill would drop them.
        self.lost_runs: list[dict[str, Any]] = []
        # Tokens the run's budget has reserved for calls in flight (the dispatch's): in status.json, so
        # that a kill -9 with calls in flight leaves them in the books (lost_runs), as perhaps billed.
        self.reserved_tokens: Callable[[], int] = lambda: 0
        # A budget run's spend journal (batchrun/run/journal.py): each grant durable before it is sent.
        self.journal: SpendJournal | None = None
        self.last_event_at: str | None = None
        self.done_indices: set[int] | None = None  # prompt_index of every trajectory in the batch files
        self.discarded_indices: set[int] | None = None  # and of every discard: finished too, never re-run
        # batch number -> outcomes of its samples, for checkpoint.json's batch_stats (scanned once, then kept)
        self.batch_outcomes: dict[int, collections.Counter[str]] | None = None
        # The dataset's rows -> their samples without an outcome yet (trajectory or discard), as resume
        # matches outcomes to rows (None: not told, then completed_prompts lists every outcome's line);
        # checkpoint.json's completed_prompts are the rows with none left.
        self.row_pending: dict[int, int] | None = None
        self.echo: Callable[[str], None] = lambda line: print(
            line, file=sys.stderr
        )  # the progress bar's, in a run
        # Told each kept trajectory's line once it is durable (finish.PreparedLines: the merge's work
        # on it, done while the dispatch waits for outcomes).
        self.on_kept_line: Callable[[bytes], None] | None = None
        # A --rerun_discarded resume: the (prompt index, sample index) of the discards it is to run again and
        # has not yet (a new trajectory or discard of one is its outcome; a failure leaves its old discard).
        self.rerun_planned: set[tuple[int, int]] | None = None
        self.rerun_total = 0
        # checkpoint.json's rerun_round ({"round": N, "finished": bool}; resume.rerun_round), carried on
        # by invocations without the flag; ``rerun_round_run``: the round this invocation runs (its discards
        # say so), ``rerun_continued``: an open one it continues.
        self.rerun_round: dict[str, Any] | None = None
        self.rerun_round_run: int | None = None
        self.rerun_continued = False
        self.rerun_counts: collections.Counter[str] = collections.Counter()  # kind -> discards run again
        self._status_written = 0.0
        self._made_dir = False  # lock() made the run directory (unlock removes it when nothing was written)
        self._lock_file: Any = None

    @property
    def locked(self) -> bool:
        return self._lock_file is not None

    # -- the run directory

    def lock(self) -> None:
        """One runner per run directory: a second one would write the same prompts twice."""
        import fcntl

        try:
            self._made_dir = not self.run_dir.exists()
            # Its owner's alone (whatever the umask): every prompt's trajectory, the rows' answers and
            # the run's settings were readable by any user of the machine (0755 under umask 022).
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_file = (self.run_dir / LOCK_NAME).open("a+")
        except OSError as exc:  # nothing has started: a usage problem, not a run that stopped
            raise UsageError(
                f"--output_dir: cannot write {exc.filename or self.run_dir}: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            owner = self._lock_file.read().strip() or "another process"
            raise UsageError(
                f"{self.run_dir} is in use by a running batch_runner ({owner}); wait for it or stop it"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._lock_file.flush()  # the lock itself dies with the process: nothing to clean up after a crash
        # But the temp files of a runner killed outright while it replaced a file are: a merge's is a whole
        # copy of trajectories.jsonl, and each crash at that moment would leave one more.
        remove_stale_temp_files(self.run_dir)

    def unlock(self) -> None:
        lock, self._lock_file = self._lock_file, None
        if lock is None:
            return
        if self.journal is not None:
            self.journal.close()
        if self._made_dir and {p.name for p in self.run_dir.iterdir()} <= {LOCK_NAME, JOURNAL_NAME}:
            # A run refused before it wrote anything (its endpoint or sandbox check failed) leaves no
            # directory behind; unlinked while still held, so no second runner holds it meanwhile.
            with contextlib.suppress(OSError):
                # The journal holds at most its start check's grant: the run was refused, and a new
                # one of this name starts afresh.
                (self.run_dir / JOURNAL_NAME).unlink(missing_ok=True)
                (self.run_dir / LOCK_NAME).unlink()
                self.run_dir.rmdir()
        lock.close()  # closing the descriptor releases the flock

    def holds_a_run(self) -> bool:
        """Whether the directory holds data; status.json (and a spend journal) alone are left by a run
        interrupted before it started."""
        return any(p.name not in (LOCK_NAME, "status.json", JOURNAL_NAME) for p in self.run_dir.iterdir())

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        write_json_atomic(self.run_dir / "run_manifest.json", manifest, self.redact)

    # -- outcomes

    def record(self, outcome: Outcome) -> None:
        """Write one outcome durably: trajectories to their batch file, discards and failures aside.

        A kept trajectory is written exactly as the model and the tools said it; one whose text holds
        a secret is a discard (``secret_in_output``) instead, redacted in discarded.jsonl, and one
        whose text UTF-8 cannot carry (a lone surrogate) too (``unencodable_text``, escaped there).
        """
        kind, reason = outcome.kind, outcome.reason
        self.last_event_at = _now()
        live = self.live_spend.pop(
            (outcome.batch_num, outcome.prompt_index, outcome.sample_index), collections.Counter()
        )
        for key, value in outcome.usage.items():  # Usage.as_dict(): every number is summed, not the providers
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.spend[key] += value - live.get(key, 0)  # what add_live_spend has not counted yet
        self.spend["total_tokens"] = self.spend["prompt_tokens"] + self.spend["completion_tokens"]
        sample_text = self.sample_text
        identity = self._add_identity(outcome)
        # Discards and failures name their dataset row too (its id and fields: answer, verify, ...).
        row_of = {"row_id": outcome.row_id, "row_fields": outcome.row_fields}
        data = b""
        if kind == TRAJECTORY:
            data, unkept = self._trajectory_line(outcome)
            if unkept is not None:
                kind, reason = DISCARDED, unkept
        self.counts[kind] += 1
        if self.row_pending is not None and kind != FAILED and self.row_pending.get(outcome.prompt_index):
            self.row_pending[outcome.prompt_index] -= 1
        if self.rerun_planned and kind != FAILED:
            sample = (outcome.prompt_index, outcome.sample_index)
            if sample in self.rerun_planned:
                self.rerun_planned.discard(sample)
                self.rerun_counts[kind] += 1
        if self.batch_outcomes is not None:
            _count_outcome(self.batch_outcomes, outcome.batch_num, kind, reason)
        if kind == TRAJECTORY:
            rec = outcome.record or {}
            self.counts["tool_calls"] += sum(s["count"] for s in rec["tool_stats"].values())
            append_jsonl_bytes(self.run_dir / f"batch_{outcome.batch_num}.jsonl", data)
            if self.done_indices is not None:
                self.done_indices.add(rec["prompt_index"])
            if self.on_kept_line is not None:
                self.on_kept_line(data)
        elif kind == DISCARDED:
            self.discards[reason or "unknown"] += 1
            if self.discarded_indices is not None:
                self.discarded_indices.add(outcome.prompt_index)
            row = {
                "prompt": outcome.prompt,
                **identity,
                **row_of,
                "prompt_index": outcome.prompt_index,
                "batch_num": outcome.batch_num,
                "reason": reason,
                "timestamp": _now(),
                "record": outcome.record,
            }
            if outcome.error is not None:  # a discard without a record says why (context_limit: the endpoint)
                row["error"] = self.redact(str(outcome.error))
            if self.rerun_round_run is not None:
                row[ROUND_FIELD] = self.rerun_round_run
            # The model's words are redacted of secrets only: never of text that resembles the scaffolding.
            append_jsonl(self.run_dir / "discarded.jsonl", row, sample_text)
        else:
            self.failures[outcome.error_class or "unknown"] += 1
            if outcome.error_class == "budget" and (outcome.usage or {}).get("calls"):
                self.budget_unfinished += 1
                for key in (*SPEND_KEYS, "unanswered_tokens"):
                    self.budget_unfinished_spend[key] += credible(outcome.usage.get(key))
            self.failure_messages[outcome.error_class or "unknown"][
                terminal_safe(self.redact(str(outcome.error))[:300])  # for the console's summary
            ] += 1
            row = {
                "prompt": outcome.prompt,
                **identity,
                **row_of,
                "prompt_index": outcome.prompt_index,
                "batch_num": outcome.batch_num,
                "error_class": outcome.error_class,
                # Redacted as a value too: an endpoint quoting the request puts JSON inside this string.
                "error": self.redact(str(outcome.error)),
                "timestamp": _now(),
                "usage": outcome.usage,
            }
            append_jsonl(self.run_dir / "failed.jsonl", row, sample_text)
            if self.verbose:
                self.echo(  # the endpoint's words: its control characters shown, not obeyed
                    terminal_safe(
                        self.redact(
                            f"[{outcome.prompt_index}] failed: {outcome.error_class}: {outcome.error}"
                        )
                    )
                )

    def keeps(self, outcome: Outcome) -> bool:
        """Whether :meth:`record` keeps this outcome as a trajectory (it is one, its text holds no secret and
        UTF-8 carries it): --stop_after_passes counts kept passes only, as a resume finds them."""
        if outcome.kind != TRAJECTORY:
            return False
        self._add_identity(outcome)
        return self._trajectory_line(outcome)[1] is None

    def _add_identity(self, outcome: Outcome) -> dict[str, Any]:
        """The fields that name the outcome's row and sample, put in its record's metadata too."""
        # The row's identity travels with every outcome, so resume and merge can tell apart rows with
        # the same text and another image, cwd or settings of its own, and which sample this is.
        # Computed from the text as saved records hold it (secrets redacted, nothing else).
        saved = outcome.identity.redacted(self.sample_text)
        identity = {
            **saved.fields(),
            "row_key": saved.key,
            "sample_index": outcome.sample_index,
            # Which of identical rows this is (its seeds derive from it): resume matches it after rows moved.
            "occurrence": outcome.occurrence,
        }
        if isinstance(outcome.record, dict) and isinstance(outcome.record.get("metadata"), dict):
            # Typed again with the identity in: no column of a record is null (batchrun.record).
            outcome.record["metadata"] = normalize_metadata({**outcome.record["metadata"], **identity})
        return identity

    def _trajectory_line(self, outcome: Outcome) -> tuple[bytes, str | None]:
        """A trajectory's line as its batch file holds it, or why it is a discard instead."""
        line = json_line(outcome.record or {})
        if self._holds_secret(line):
            return b"", "secret_in_output"
        try:
            return line.encode("utf-8"), None
        except UnicodeEncodeError:
            # A lone surrogate in what the model said: valid JSON only as an escape, which
            # Arrow-based loaders (datasets) refuse; kept exactly, as a discard.
            return b"", "unencodable_text"

    def set_aside(self, rec: dict[str, Any], reason: str) -> None:
        """A record found unfit at merge, written to discarded.jsonl with its reason (it stays in its
        batch file, finished for resume)."""
        row = set_aside_row(rec, reason)
        if self.rerun_round_run is not None:
            row[ROUND_FIELD] = self.rerun_round_run
        append_jsonl(self.run_dir / "discarded.jsonl", row, self.sample_text)

    def rerun_summary(self) -> dict[str, Any] | None:
        """A --rerun_discarded resume's discards: its round, whether it continued it, how many it was to
        run again, how many it ran again and kept or discarded again, how many did not run again
        (interrupted, failed, the budget), whether that finished the round; None without the flag."""
        if self.rerun_planned is None:
            return None
        return {
            "round": self.rerun_round_run,
            "continued": self.rerun_continued,
            "to_rerun": self.rerun_total,
            "kept": self.rerun_counts[TRAJECTORY],
            "discarded_again": self.rerun_counts[DISCARDED],
            "not_rerun": len(self.rerun_planned),
            "finished": not self.rerun_planned,
        }

    def start_round(self, number: int, continued: bool) -> None:
        """This invocation runs rerun round ``number`` (resume.rerun_round); a new one is in
        checkpoint.json, open, before any of its outcomes: a kill leaves it to be continued."""
        self.rerun_round_run, self.rerun_continued = number, continued
        self.rerun_round = {"round": number, "finished": False}
        if not continued:
            self.write_checkpoint()

    def end_round(self) -> None:
        """The invocation's last step: its round is finished when every discard it was to run again has
        an outcome from it (a failure is none: the sample runs again in the round). Written last, so
        that a kill before leaves it open, and the same command finishes it instead of starting another."""
        if self.rerun_round_run is not None and not self.rerun_planned:
            self.rerun_round = {"round": self.rerun_round_run, "finished": True}
            self.write_checkpoint()

    def _holds_secret(self, line: str) -> bool:
        finds = getattr(self.redact, "finds_secret", None)
        return finds(line) if finds is not None else self.redact(line) != line

    def add_live_spend(self, spend: Spend) -> None:
        """One model call's tokens and cost, reported while its prompt is still running."""
        live = self.live_spend.setdefault(
            (spend.batch_num, spend.prompt_index, spend.sample_index), collections.Counter()
        )
        # The cache's counts too: status.json's cached_tokens lagged its prompt_tokens by every prompt
        # in flight, and a killed run's status said none of a long prompt's.
        for key in (*SPEND_KEYS, "unanswered_tokens", "cached_tokens", "cache_write_tokens"):
            value = credible(getattr(spend, key))  # the worker sends only these; a NaN would void the budget
            live[key] += value
            self.spend[key] += value
        self.spend["total_tokens"] = self.spend["prompt_tokens"] + self.spend["completion_tokens"]

    def add_check_spend(self, prompt_tokens: int, completion_tokens: int, cost_usd: float) -> None:
        """A model call of the runner's own (start check, probe): its tokens and cost (credible counts)."""
        for key, value in zip(SPEND_KEYS, (prompt_tokens, completion_tokens, cost_usd), strict=True):
            self.spend[key] += credible(value)
            self.checks[key] += credible(value)
        self.checks["calls"] += 1
        self.spend["total_tokens"] = self.spend["prompt_tokens"] + self.spend["completion_tokens"]

    def budget_summary(self) -> dict[str, Any]:
        """The run-wide budget, what this run spent, and by how much it went past the budget (the calls
        already under way when it was reached)."""
        tokens, usd = self.spend["total_tokens"], self.spend["cost_usd"]
        unanswered = int(self.spend["unanswered_tokens"])
        all_tokens, all_usd = self.budget_spent()
        return {
            "tokens": self.budget_tokens,
            "usd": self.budget_usd,
            "spent_tokens": tokens,
            "spent_usd": round(usd, 6),
            # Failed attempts that may have been billed (a stream cut mid-answer): the runner's estimate,
            # counted against --budget_tokens beside spent_tokens, and in estimated_usd.
            "unanswered_tokens": unanswered,
            "reached": self.budget_hit,
            # What the earlier invocations of this run spent (a --resume's): the budget holds them too.
            "earlier_tokens": self.earlier_tokens,
            "earlier_usd": round(self.earlier_usd, 6),
            "overshoot_tokens": max(0, all_tokens - self.budget_tokens)
            if self.budget_tokens is not None
            else None,
            # By the budget's count: answers without a cost and failed attempts at the price seen too.
            "overshoot_usd": round(max(0.0, all_usd + self.budget_estimated_usd - self.budget_usd), 6)
            if self.budget_usd is not None
            else None,
            "stopped_in_flight": self.failures.get("budget", 0),
            # Of those, the ones stopped after model calls: what they spent gave no sample.
            "stopped_unfinished": self.budget_unfinished,
            # What those had spent: tokens and USD that gave no sample (--resume runs them again).
            "unfinished_tokens": int(
                self.budget_unfinished_spend["prompt_tokens"]
                + self.budget_unfinished_spend["completion_tokens"]
                + self.budget_unfinished_spend["unanswered_tokens"]
            ),
            "unfinished_usd": round(self.budget_unfinished_spend["cost_usd"], 6),
            # In no spent_usd: answers that reported no cost and unanswered_tokens, at the price seen.
            "estimated_usd": round(self.budget_estimated_usd, 6),
            "unmeasured": self.budget_unmeasured,
            # Of spent_tokens / spent_usd: the runner's own calls (start check, endpoint probes).
            "check_calls": self.checks["calls"],
            "check_tokens": self.checks["prompt_tokens"] + self.checks["completion_tokens"],
            "check_usd": round(self.checks["cost_usd"], 6),
        }

    def budget_spent(self) -> tuple[int, float]:
        """What the run's budget holds spent (tokens, USD): answered calls, failed attempts that may have
        been billed, and the earlier invocations' spend (a --resume's)."""
        tokens = self.spend["total_tokens"] + self.spend["unanswered_tokens"] + self.earlier_tokens
        return tokens, self.spend["cost_usd"] + self.earlier_usd

    def budget_reached(self) -> bool:
        """Whether this run has spent its --budget_usd or --budget_tokens (checked after each outcome)."""
        tokens, usd = self.budget_spent()
        return (self.budget_usd is not None and usd >= self.budget_usd) or (
            self.budget_tokens is not None and tokens >= self.budget_tokens
        )

    @property
    def settled(self) -> int:
        return (
            self.counts[TRAJECTORY]
            + self.counts[FAILED]
            + self.counts[DISCARDED]
            + self.counts["skipped_budget"]
        )

    def progress_text(self) -> str:
        minutes = max((time.monotonic() - self.started) / 60, 1e-6)
        text = (
            f"done={self.counts[TRAJECTORY]} failed={self.counts[FAILED]} discarded={self.counts[DISCARDED]} "
            f"tools={self.counts['tool_calls']} tok/min={self.spend['total_tokens'] / minutes:,.0f}"
        )
        if self.spend["cost_usd"]:
            text += f" spent=${self.spend['cost_usd']:.4f}"
        return text

    # -- state files

    def write_checkpoint(self) -> None:
        """Resume state after each batch. Informational: --resume trusts the batch files' content."""
        if self.row_pending is None and self.done_indices is None:
            self.done_indices = set()
            for _, path in batch_files(self.run_dir):
                self.done_indices.update(
                    rec["prompt_index"]
                    for rec in iter_jsonl(path)
                    if valid_record(rec) and isinstance(rec.get("prompt_index"), int)
                )
        if self.row_pending is None and self.discarded_indices is None:
            self.discarded_indices = {
                row["prompt_index"]
                for row in iter_jsonl(self.run_dir / "discarded.jsonl")
                if valid_outcome_row(row, "reason") and is_index(row.get("prompt_index"))
            }
        if self.batch_outcomes is None:
            self.batch_outcomes = scan_batch_outcomes(self.run_dir)
        state = {
            FORMAT_FIELD: FORMAT_VERSION,  # added to the reference's keys (batchrun.run.run_dir)
            "run_name": self.run_name,
            # The finished prompts, as the reference's (which lists its no-reasoning discards): a discard is
            # finished, a failure is not (--resume runs it again).
            "completed_prompts": self.completed_prompts(),
            "batches": [n for n, _ in batch_files(self.run_dir)],
            "batch_stats": batch_stats(self.batch_outcomes),
            "last_updated": _now(),
        }
        if self.rerun_round is not None:  # the latest --rerun_discarded round (resume.rerun_round)
            state[ROUND_FIELD] = self.rerun_round
        write_json_atomic(self.run_dir / "checkpoint.json", state, self.redact)

    def track_rows(self, pending: dict[int, int]) -> None:
        """The dataset's rows (their indices) -> how many of their samples have no outcome yet: those the
        run is to run (resume's matching, or every sample of a new run)."""
        self.row_pending = pending  # the caller's own (pending_samples makes it): a row each, not copied

    def completed_prompts(self) -> list[int]:
        """checkpoint.json's ``completed_prompts``: the dataset rows whose every sample has an outcome, a
        trajectory or a discard, as resume matches outcomes to rows (a failure is not one: resume runs
        it again); without the rows, the lines of every trajectory and discard in the run's files."""
        if self.row_pending is not None:
            return sorted(index for index, left in self.row_pending.items() if left <= 0)
        assert self.done_indices is not None and self.discarded_indices is not None
        return sorted(self.done_indices | self.discarded_indices)

    def write_status(
        self, state: str, force: bool = False, error: str | None = None, exit_code: int | None = None
    ) -> None:
        """status.json for a second terminal (python -m batchrun.views.status data/<run>), every few seconds;
        ``exit_code``: the invocation's, once it is known (None while it runs)."""
        now = time.monotonic()
        if not force and now - self._status_written < STATUS_EVERY_S:
            return
        self._status_written = now
        elapsed = now - self.started
        settled = self.settled
        rate = settled / elapsed * 60 if elapsed > 0 else 0.0
        left = self.total - settled
        status = {
            "run_name": self.run_name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": self.started_at,
            "invocation": self.invocation,
            "updated_at": _now(),
            "state": state,
            "total": self.total,
            "done": self.counts[TRAJECTORY],
            "failed": self.counts[FAILED],
            "discarded": self.counts[DISCARDED],
            "skipped_budget": self.counts["skipped_budget"],
            "in_flight": (self.in_flight() if self.in_flight else max(0, left)) if state == "running" else 0,
            "api_calls": self.spend["requests"],
            "tool_calls": self.counts["tool_calls"],
            "prompt_tokens": self.spend["prompt_tokens"],
            "completion_tokens": self.spend["completion_tokens"],
            "cost_usd": round(self.spend["cost_usd"], 6),
            "unanswered_tokens": int(self.spend["unanswered_tokens"]),
            "cached_tokens": int(self.spend["cached_tokens"]),  # of prompt_tokens (answered prompts')
            "cache_write_tokens": int(self.spend["cache_write_tokens"]),
            "tokens_per_min": round(self.spend["total_tokens"] / elapsed * 60, 1) if elapsed > 0 else 0.0,
            "rate_per_min": round(rate, 2),
            "eta_s": round(left / rate * 60, 1) if rate > 0 and left > 0 else None,
            "rate_limit_pauses": self.counts["rate_limit_pauses"],
            "budget": {
                "usd": self.budget_usd,
                "tokens": self.budget_tokens,
                "spent_usd": round(self.spend["cost_usd"], 6),
                "spent_tokens": self.spend["total_tokens"],
                "unanswered_tokens": int(self.spend["unanswered_tokens"]),
                "earlier_tokens": self.earlier_tokens,
                "earlier_usd": round(self.earlier_usd, 6),
                "reached": self.budget_hit,
            },
            "last_event_at": self.last_event_at,
            "error": self.redact(error) if error else None,  # why a run in state "failed" stopped
            "exit_code": exit_code,  # the invocation's (README: Exit codes); None while it runs
            "lost_runs": self.lost_runs,  # earlier invocations killed before their statistics.json
            "reserved_tokens": self.reserved_tokens() if state == "running" else 0,  # calls in flight
        }
        try:
            write_json_atomic(self.run_dir / "status.json", status, self.redact)
        except WriteError:
            if state != "failed":
                raise
            # A full disk has no room for the temp file; overwriting in place reuses the old file's blocks.
            write_text_in_place(
                self.run_dir / "status.json", self.redact(json.dumps(status, indent=2, ensure_ascii=False))
            )


def count_failure(outcomes: dict[int, collections.Counter[str]], row: dict[str, Any]) -> None:
    """A failed.jsonl row in its batch's outcomes (each failed attempt counts)."""
    _count_outcome(outcomes, row.get("batch_num"), FAILED, None)


def _count_outcome(
    outcomes: dict[int, collections.Counter[str]], batch_num: Any, kind: str, reason: str | None
) -> None:
    if not isinstance(batch_num, int) or isinstance(batch_num, bool):
        return
    counter = outcomes.setdefault(batch_num, collections.Counter())
    counter[kind] += 1
    if kind == DISCARDED and reason == "no_reasoning":
        counter["no_reasoning"] += 1


class OutcomeCounts:
    """Every outcome of every run of this run name, counted once with one rule (``valid_outcome_row``, as
    every reader takes discarded.jsonl and failed.jsonl rows): by batch for checkpoint.json's
    ``batch_stats``, and the totals statistics.json says. Counted apart, the checkpoint took any dict
    row (a hand edit, another tool's line) that statistics.json skipped, and the two disagreed."""

    def __init__(self, batches: dict[int, collections.Counter[str]], stale: set[int]):
        self.batches = batches  # batch number -> its outcomes
        self.stale = stale  # discarded.jsonl rows that no longer stand for their sample (superseded_discards)
        self.discards: collections.Counter[str] = collections.Counter()  # the standing ones, by reason
        self.failures: collections.Counter[str] = collections.Counter()  # every failed attempt, by class
        self.invalid_discards = self.invalid_failures = 0  # rows of the wrong shape (or torn), skipped


def count_outcomes(
    run_dir: Path, trajectories: collections.Counter[int], finished_at: collections.Counter[Line]
) -> OutcomeCounts:
    """:class:`OutcomeCounts` of the run's files: ``trajectories``, the valid records of each batch file,
    and ``finished_at`` their :data:`Line`\\ s, as a pass over them counted them (the merge's).

    Each sample counts once, by its latest outcome: a discard that no longer stands for its sample (run
    again by --rerun_discarded, then kept or discarded again in a later batch: ``superseded_discards``) is
    not counted in its batch, and a record the merge set aside (``unknown_tool``, which stays in its batch
    file) is its batch's discard, not also its trajectory. Failures are attempts: each counts (``skipped``)."""
    rows, invalid = read_discards(run_dir / "discarded.jsonl")  # read once, for which stand and the counts
    counted = OutcomeCounts(trajectory_outcomes(run_dir, trajectories), superseded_among(rows, finished_at))
    counted.invalid_discards = invalid
    for n, _, _, num, reason in rows:
        if n not in counted.stale:
            count_discard(counted.batches, num, reason)
            counted.discards[reason] += 1
    for row in iter_jsonl(run_dir / "failed.jsonl"):
        if not valid_outcome_row(row, "error_class"):
            counted.invalid_failures += 1
        else:
            count_failure(counted.batches, row)
            counted.failures[row["error_class"]] += 1
    return counted


def scan_batch_outcomes(run_dir: Path) -> dict[int, collections.Counter[str]]:
    """:attr:`OutcomeCounts.batches` with the batch files read for them (a recorder that has counted
    nothing yet, as a resume's is, writing its first checkpoint)."""
    trajectories: collections.Counter[int] = collections.Counter()
    finished_at: collections.Counter[Line] = collections.Counter()
    for num, path in batch_files(run_dir):
        for rec in iter_jsonl(path):
            if valid_record(rec):
                trajectories[num] += 1
                if (line := kept_line(rec)) is not None:
                    finished_at[line] += 1
    return count_outcomes(run_dir, trajectories, finished_at).batches


def trajectory_outcomes(
    run_dir: Path, trajectories: collections.Counter[int]
) -> dict[int, collections.Counter[str]]:
    """:func:`count_outcomes`' start: each batch file's valid records (``trajectories``)."""
    outcomes: dict[int, collections.Counter[str]] = {}
    for num, _ in batch_files(run_dir):
        counter = outcomes.setdefault(num, collections.Counter())
        if trajectories[num]:
            counter[TRAJECTORY] += trajectories[num]
    return outcomes


def count_discard(outcomes: dict[int, collections.Counter[str]], num: Any, reason: str) -> None:
    """A discarded.jsonl row (its ``batch_num`` as written, its ``reason``) that stands for its sample (not
    superseded), in its batch's outcomes: a record the merge set aside is its batch's discard, and no
    longer also its trajectory."""
    _count_outcome(outcomes, num, DISCARDED, reason)
    if reason in MERGE_SET_ASIDE and outcomes.get(num, {}).get(TRAJECTORY, 0) > 0:
        outcomes[num][TRAJECTORY] -= 1  # its record, still in the batch file: one outcome


def batch_stats(outcomes: dict[int, collections.Counter[str]]) -> dict[str, dict[str, int]]:
    """checkpoint.json's ``batch_stats`` under the reference's keys (``processed``: samples of the batch
    with an outcome; ``skipped``: those that failed, run again on resume; ``discarded_no_reasoning``),
    plus ours: ``trajectories`` and ``discarded`` (every reason)."""
    return {
        str(num): {
            "processed": c[TRAJECTORY] + c[DISCARDED] + c[FAILED],
            "skipped": c[FAILED],
            "discarded_no_reasoning": c["no_reasoning"],
            "trajectories": c[TRAJECTORY],
            "discarded": c[DISCARDED],
        }
        for num, c in sorted(outcomes.items())
    }


def earlier_runs(path: Path) -> list[dict[str, Any]]:
    """The ``runs`` history of the statistics.json an earlier invocation wrote (one entry per invocation).

    An unreadable one gives none (its numbers cannot be trusted to add up); one without the history was
    written in a form ``batchrun.run.run_dir`` refuses before a resume gets here.
    """
    try:
        old = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    runs = old.get("runs") if isinstance(old, dict) else None
    if not isinstance(runs, list):
        return []
    return [_finite(r) for r in runs if isinstance(r, dict) and isinstance(r.get("duration_s"), (int, float))]


def earlier_rescorings(path: Path) -> dict[str, Any]:
    """The ``scores.rescored`` entries (``python -m batchrun.views.score``) of the statistics.json an
    earlier invocation (or a re-scoring) wrote: a later invocation keeps them, as it keeps the files they
    describe. Each says what it counted (``scored``, ``samples_planned``): a resume that added samples
    leaves them describing the samples there were."""
    try:
        old = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    scores = old.get("scores") if isinstance(old, dict) else None
    rescored = scores.get("rescored") if isinstance(scores, dict) else None
    if not isinstance(rescored, dict):
        return {}
    return {
        name: entry for name, entry in rescored.items() if isinstance(name, str) and isinstance(entry, dict)
    }


def _finite(run: dict[str, Any]) -> dict[str, Any]:
    """A ``runs`` entry as statistics.json may hold it again: a number Python's reader took that no file
    may hold (``Infinity``, ``NaN``, ``1e999`` in a hand-edited one) is null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in run.items()}


def lost_runs(
    status: dict[str, Any] | None,
    earlier: list[dict[str, Any]],
    journal: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The ``runs`` entries of invocations that wrote no statistics.json (killed, or stopped by a full
    disk): what the last status.json said the one that wrote it had spent (refreshed every few seconds
    while it ran: the last seconds' calls may be missing, so ``ended`` says the figures are a lower
    bound), after the entries that status.json carries of earlier such invocations (``lost_runs``: a
    resume killed in turn overwrote the first one's status.json, and its spend left the run's books and
    budget). Without them a resume after a kill -9 left those invocations' cost out of ``run_totals``.

    ``journal`` (:func:`batchrun.run.journal.read_journal`): what a budget run's spend journal says each
    invocation spent at most. It holds every call granted, up to the instant of the kill, where status.json
    misses the last seconds (a run killed once spent 45,342 tokens on a 30,000 cap): an invocation's
    tokens are the journal's where they are more, and one killed before its first status.json is there
    only."""
    entries = _lost_by_status(status, earlier)
    if journal:
        entries = _with_journal(entries, earlier, journal)
    return entries


def _with_journal(
    entries: list[dict[str, Any]], earlier: list[dict[str, Any]], journal: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """``entries`` with each invocation's spend raised to its journal's, and the journal's invocations that
    neither statistics.json nor status.json holds added."""
    written = {_invocation(r) for r in earlier}
    index = {_invocation(r): n for n, r in enumerate(entries)}
    out = list(entries)
    # Calls in flight before any answer showed a price: at the most per token the run's answers cost.
    price = max(
        (
            credible(r.get("cost_usd")) / tokens
            for r in [*earlier, *entries, *journal.values()]
            if (tokens := credible(r.get("prompt_tokens")) + credible(r.get("completion_tokens"))) > 0
        ),
        default=0.0,
    )
    for inv, books in journal.items():
        key = ("invocation", inv)
        if key in written:
            continue  # its statistics.json entry counts it (a kill before the journal's removal)
        spent = {k: int(books[k]) for k in ("prompt_tokens", "completion_tokens", "unanswered_tokens")}
        books = {**books, "unanswered_usd": books["unanswered_usd"] + books.get("unpriced_tokens", 0) * price}
        if key not in index:
            if not isinstance(books.get("started_at"), str) or not books["requests"]:
                continue  # no call granted: an invocation refused at start spent nothing
            out.append(
                {
                    "started_at": books["started_at"],
                    "invocation": inv,
                    "completed_at": None,
                    "duration_s": 0.0,
                    "attempted": 0,
                    "trajectories": 0,
                    "requests": int(books["requests"]),
                    **spent,
                    "cost_usd": round(books["cost_usd"], 8),
                    "unanswered_usd": round(books["unanswered_usd"], 8),
                    "ended": "without statistics or status (from the spend journal); calls in flight at "
                    "their reservations",
                }
            )
            continue
        entry = out[index[key]]
        known = sum(int(credible(entry.get(k))) for k in spent)
        if sum(spent.values()) >= known:  # the journal's count (less only if it was damaged)
            out[index[key]] = {
                **entry,
                **spent,
                "cost_usd": round(max(float(credible(entry.get("cost_usd"))), books["cost_usd"]), 8),
                "unanswered_usd": round(
                    max(float(credible(entry.get("unanswered_usd"))), books["unanswered_usd"]), 8
                ),
                "requests": max(int(credible(entry.get("requests"))), int(books["requests"])),
                "ended": f"{str(entry.get('ended') or 'without statistics').split(';')[0]}; from the spend "
                "journal: calls in flight at their reservations",
            }
    return out


def _lost_by_status(status: dict[str, Any] | None, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`lost_runs` as status.json alone tells them."""
    if not status or not isinstance(status.get("started_at"), str):
        return []
    seen = {_invocation(r) for r in earlier}
    carried = []
    for run in status.get("lost_runs") if isinstance(status.get("lost_runs"), list) else []:
        if isinstance(run, dict) and isinstance(run.get("duration_s"), (int, float)):
            if _invocation(run) not in seen:  # not written to statistics.json since
                seen.add(_invocation(run))
                carried.append(_finite(run))
    if _invocation(status) in seen:
        return carried  # it wrote its statistics: counted there

    def number(key: str) -> float:
        return float(credible(status.get(key)))  # a damaged or hand-edited file counts nothing

    try:
        duration = (
            dt.datetime.fromisoformat(status["updated_at"]) - dt.datetime.fromisoformat(status["started_at"])
        ).total_seconds()
    except (KeyError, TypeError, ValueError):
        duration = 0.0
    return [
        *carried,
        {
            "started_at": status["started_at"],
            **({"invocation": status["invocation"]} if isinstance(status.get("invocation"), str) else {}),
            "completed_at": status.get("updated_at") if isinstance(status.get("updated_at"), str) else None,
            "duration_s": round(max(0.0, duration), 2),
            "attempted": int(number("done") + number("failed") + number("discarded")),
            "trajectories": int(number("done")),
            "requests": int(number("api_calls")),
            "prompt_tokens": int(number("prompt_tokens")),
            "completion_tokens": int(number("completion_tokens")),
            "cost_usd": round(number("cost_usd"), 8),
            # Its calls in flight when it last wrote status.json, at their reservations (a budget run's):
            # a kill does not stop the endpoint billing them.
            "unanswered_tokens": int(number("unanswered_tokens") + number("reserved_tokens")),
            "cached_tokens": int(number("cached_tokens")),
            "cache_write_tokens": int(number("cache_write_tokens")),
            "ended": f"without statistics (last status: {status.get('state')!s}); at least these figures",
        },
    ]


def _invocation(entry: dict[str, Any]) -> Any:
    """Which invocation a runs entry or a status.json is of: its ``invocation`` id, or, in files written
    before there was one, the second it started."""
    value = entry.get("invocation")
    return ("invocation", value) if isinstance(value, str) else ("started_at", entry.get("started_at"))


def spend_of(runs: list[dict[str, Any]]) -> tuple[int, float]:
    """What the invocations of these ``runs`` entries spent: tokens (answered, and failed attempts that
    may have been billed) and USD. A run's budget holds all its invocations."""
    tokens = sum(
        int(credible(r.get(k)))
        for r in runs
        for k in ("prompt_tokens", "completion_tokens", "unanswered_tokens")
    )
    # unanswered_usd: a killed invocation's calls in flight, at the price they were reserved at (its journal's)
    return tokens, float(
        sum(credible(r.get("cost_usd")) + credible(r.get("unanswered_usd", 0)) for r in runs)
    )


def damaged_books(run_dir: Path) -> str | None:
    """Why what the earlier invocations of this run spent cannot be read (None: it can): a statistics.json
    or status.json that is not a JSON object, a ``runs`` history that is no list, or a spend in one (an
    entry's, or that of the invocation status.json speaks of) missing, not a number, negative or infinite.
    The runner replaces both files whole, so this is a hand edit or a damaged disk; read as before, that
    spend counted as nothing (and a --resume got it back as budget)."""
    for name, history in (("statistics.json", "runs"), ("status.json", "lost_runs")):
        path = run_dir / name
        if not path.exists():
            continue
        try:
            data = parse_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"{path} cannot be read ({exc})"
        if not isinstance(data, dict):
            return f"{path} holds no JSON object"
        runs = data.get(history, [] if name == "status.json" else None)  # lost_runs: none before a kill
        if not isinstance(runs, list):
            return f"{path}: {history} is not a list"
        entries = [(f"{history}[{n}]", run, True) for n, run in enumerate(runs)]
        if name == "status.json":
            entries.append(("its invocation's spend", data, False))
        for where, entry, is_entry in entries:
            problem = _spend_problem(entry, is_entry)
            if problem:
                return f"{path}: {where}: {problem}"
    return None


def _spend_problem(entry: Any, is_entry: bool) -> str | None:
    """What is wrong with a ``runs`` entry's (or status.json's) spend, as :func:`damaged_books` says it."""
    if not isinstance(entry, dict):
        return "not an object"
    if not isinstance(entry.get("started_at"), str):
        return "started_at is not a time"
    for key in (*SPEND_KEYS, "unanswered_tokens", *(("duration_s",) if is_entry else ())):
        # unanswered_tokens: absent from files written before failed attempts were counted
        value = entry.get(key, 0) if key == "unanswered_tokens" else entry.get(key)
        if isinstance(value, bool) or credible(value) != value:
            return f"{key} is {json.dumps(value)[:40]}, not a count"
    return None
