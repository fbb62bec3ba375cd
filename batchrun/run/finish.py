"""The end of a run: merge every batch file into trajectories.jsonl, statistics, the report, the summary, the exit code.

Merge and statistics stream the run's files one record at a time (memory stays flat), skip and
count torn or malformed lines, drop records that call a tool outside the known set, and keep one
record per finished sample (row identity, sample index). They cover every run of this run name; ``this_run`` covers this one.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from batchrun.config import RunConfig
from batchrun.identity import Line, lines_matter, outcome_sample, record_sample
from batchrun.prompt.tools.catalog import known_tool_names
from batchrun.protocol import DISCARDED, FAILED, SKIPPED_AFTER_PASSES, TRAJECTORY
from batchrun.record import (
    USAGE_COUNTS,
    metadata_typed,
    normalize_metadata,
    run_card,
    valid_outcome_row,
    valid_record,
)
from batchrun.run.dataset import Row
from batchrun.run.recorder import (
    OutcomeCounts,
    Recorder,
    count_outcomes,
    credible,
    earlier_rescorings,
    earlier_runs,
)
from batchrun.run.resume import (
    CheckedFiles,
    Matched,
    OwnPlaces,
    PassKey,
    Place,
    SampleBits,
    add_discards,
    kept_pass,
    match_outcomes,
    occurrence_in,
    own_place,
    pass_key,
    place_of,
    rerun_command,
    resume_command,
    row_at,
    row_fields_digest,
    row_fields_of,
    samples_of,
    still_skipped,
    wanted_samples,
)
from batchrun.scoring import RunScores, check_kind, duplicate_samples, headline, pending_judged, with_planned
from batchrun.secrets import Redactor
from batchrun.sharegpt import parse_json, reasoning_counts, used_tool_names
from batchrun.storage import (
    WriteError,
    batch_files,
    discard_temp,
    fsync_dir,
    iter_jsonl,
    iter_jsonl_at,
    json_line,
    read_line_at,
    temp_path,
    write_json_atomic,
    write_text_atomic,
)


class MergeTotals:
    """Statistics accumulated over the merged records, one record at a time."""

    def __init__(self, tool_names: list[str]):
        self.tool_stats = {n: {"count": 0, "success": 0, "failure": 0} for n in tool_names}
        self.dropped: collections.Counter[str] = collections.Counter()
        # The samples (of the dataset's rows) with a record at their own place (resume.own_place): a bit
        # each, set by the merge; nearly every record of a run is one. The counts below leave them out.
        self.own: OwnPlaces | None = None
        # (row identity, sample index) -> the other records in batch files
        self.finished: collections.Counter[tuple[str, int]] = collections.Counter()
        # the same records by (row identity, sample index, prompt index, occurrence): which of identical
        # rows wrote them (identity.Line); only beside discards (identity.lines_matter)
        self.finished_at: collections.Counter[Line] = collections.Counter()
        # ... and by the row's other fields too (resume.Place): which of rows with one prompt wrote them
        # (the other records of ``finished`` that say their line)
        self.finished_where: collections.Counter[Place] = collections.Counter()
        # a row's PassKey -> its kept passes (resume.kept_pass), for the samples --stop_after_passes skipped
        self.passes: collections.Counter[PassKey] = collections.Counter()
        # valid records of each batch file (set by the merge), for checkpoint.json's batch_stats
        self.per_batch: collections.Counter[int] = collections.Counter()
        # Every outcome counted once at the merge's end (set by it): checkpoint.json's batch_stats and
        # statistics.json's discarded and failed_attempts, from the same count.
        self.outcomes: OutcomeCounts | None = None
        self.kept = self.completed = self.partial = self.api_calls = 0
        # Kept records of samples the dataset no longer wants (a row since removed or edited, a sample
        # index past today's count, rows past --max_samples): kept as they are, and said.
        self.not_in_dataset = 0
        self.with_reasoning = self.without_reasoning = 0
        self.usage: collections.Counter[str] = collections.Counter()
        # Every valid finished record in the batch files by how it ended, the excluded partial ones included.
        self.by_stop_reason: collections.Counter[str] = collections.Counter()

    def add(self, rec: dict[str, Any]) -> tuple[int, int]:
        """Count a kept record; returns its (gpt turns with reasoning, gpt turns), for the report."""
        self.kept += 1
        for name, s in (rec.get("tool_stats") or {}).items():
            # A record lists every known tool, most of them never called: nothing to add (valid_record
            # made every count an int of at least 0).
            if name in self.tool_stats and not (s.get("count") or s.get("success") or s.get("failure")):
                continue
            t = self.tool_stats.setdefault(name, {"count": 0, "success": 0, "failure": 0})
            t["count"] += s.get("count", 0)
            t["success"] += s.get("success", 0)
            t["failure"] += s.get("failure", 0)
        w, n = reasoning_counts(rec.get("conversations", []))
        self.with_reasoning += w
        self.without_reasoning += n - w
        self.completed += bool(rec.get("completed"))
        self.partial += bool(rec.get("partial"))
        self.api_calls += rec.get("api_calls", 0) or 0
        usage = (rec.get("metadata") or {}).get("usage") or {}
        for key in USAGE_COUNTS:  # records from before a count existed lack it: they add nothing
            self.usage[key] += credible(usage.get(key))
        return w, n

    def summary(self) -> dict[str, Any]:
        tools = {
            name: {**t, "success_rate": round(t["success"] / t["count"], 4) if t["count"] else None}
            for name, t in self.tool_stats.items()
        }
        turns = self.with_reasoning + self.without_reasoning
        return {
            "trajectories": self.kept,
            "completed": self.completed,
            "partial": self.partial,
            "api_calls_in_trajectories": self.api_calls,
            "usage_in_trajectories": {
                "prompt_tokens": self.usage["prompt_tokens"],
                "completion_tokens": self.usage["completion_tokens"],
                "reasoning_tokens": self.usage["reasoning_tokens"],
                "cached_tokens": self.usage["cached_tokens"],
                "cache_write_tokens": self.usage["cache_write_tokens"],
                "cost_usd": round(self.usage["cost_usd"], 6),
            },
            "dropped_at_merge": {
                k: self.dropped.get(k, 0)
                for k in ("invalid_lines", "unknown_tool", "duplicate", "partial_excluded")
            },
            "trajectories_by_stop_reason": dict(self.by_stop_reason),
            "trajectories_not_in_dataset": self.not_in_dataset,
            "tool_stats": tools,
            "reasoning": {
                "turns_with_reasoning": self.with_reasoning,
                "turns_without_reasoning": self.without_reasoning,
                "coverage": round(self.with_reasoning / turns, 4) if turns else None,
            },
        }


class RowPlaces:
    """Where the dataset's rows are now, for the merge: which record of a sample it wants to keep first.

    Held as little as the rows allow, since it lives through the whole merge: the rows' positions by
    line (a record's line finds its row) and a bit a sample for the places kept already. A tuple and a
    table entry a sample held 50 MB at 100,000 samples. What only a record of a row since moved or edited
    asks (a row elsewhere with its fields) is indexed when a record first asks it."""

    def __init__(self, own: OwnPlaces):
        """``own``: the merge's own places (their rows by line, their redactor and sample count)."""
        self.by_line, self.redact, self.samples_per_prompt = own.by_line, own.redact, own.samples_per_prompt
        self.rows = own.by_line.rows
        self.kept_at = SampleBits(self.rows, self.samples_per_prompt)  # the rows' places kept already
        # the samples kept by a record that did not say its occurrence (written before it was saved)
        self.kept_unsaid: set[tuple[int, int]] = set()
        self._fields: dict[tuple[str, str | None], int] | None = None

    def _has_fields(self, key: str, s: int, fields: str | None) -> bool:
        """Whether a row anywhere in the dataset has sample ``(key, s)`` with ``fields``."""
        if self._fields is None:  # (identity, fields) -> the most samples a row of them has
            self._fields = {}
            for row in self.rows:
                at = (row.saved_key(self.redact), row_fields_digest(row, self.redact))
                self._fields[at] = max(self._fields.get(at, 0), samples_of(row, self.samples_per_prompt))
        return s < self._fields.get((key, fields), 0)

    def preference(self, place: Place | None, own: int | None = None) -> int:
        """0: a record a row wrote at its line as it is now (with its occurrence, when the record says
        one; the first of its place), kept as it comes; else how far it is from one, as resume matches
        outcomes to rows (resume.match_outcomes): 1 its row's fields at another line (or another
        occurrence: an identical row's, written before the rows moved), 2 its row's line with other
        fields, 3 neither, 4 its place taken already. ``own``: the position of the row whose own place
        ``place`` is (``OwnPlaces.add``), when the caller has it."""
        if place is None:
            return 3
        key, s, _, fields, occurrence = place
        p = own if own is not None else row_at(place, self.by_line, self.redact, self.samples_per_prompt)
        if p is not None and occurrence in (None, self.rows[p].occurrence):
            if self.kept_at[p, s]:
                return 4
            self.kept_at.set(p, s)
            if occurrence is None:
                self.kept_unsaid.add((p, s))
            return 0
        if p is not None or self._has_fields(key, s, fields):
            return 1
        at_line = row_at(place, self.by_line, self.redact, self.samples_per_prompt, fields=False)
        return 2 if at_line is not None else 3

    def taken(self) -> collections.Counter[Place]:
        """The places of the records kept as they came (preference 0), each once (worked out when the
        merge holds records back: only then does it need them)."""
        taken: collections.Counter[Place] = collections.Counter()
        for p, row in enumerate(self.rows):
            for s in range(samples_of(row, self.samples_per_prompt)):
                if self.kept_at[p, s]:
                    place = own_place(row, s, self.redact)
                    taken[place if (p, s) not in self.kept_unsaid else (*place[:4], None)] += 1
        return taken


# A record held back by the merge: (preference, file, byte offset, its prepared work, its place).
Held = tuple[int, int, int, "Prepared | None", Place | None]


def merge(
    run_dir: Path,
    rows: list[Row],
    recorder: Recorder,
    *,
    exclude_partial: bool = False,
    samples_per_prompt: int = 1,
    written: Callable[[dict[str, Any], dict[str, Any] | None, tuple[int, int]], None] | None = None,
    prepared: PreparedLines | None = None,
    wanted: collections.Counter[tuple[str, int]] | None = None,
    excluded: Callable[[dict[str, Any]], None] | None = None,
    checked: CheckedFiles | None = None,
) -> MergeTotals:
    """Stream every batch file into trajectories.jsonl: skip torn lines, unknown tools and extras,
    and (``exclude_partial``) partial trajectories, which stay in their batch files, finished for resume.

    One pass: each kept line is copied as written (already redacted) and counted for the
    statistics, so memory stays flat and each record is parsed once. One record is kept per sample
    the dataset wants (duplicate rows each want theirs): first the records each row wrote at its line
    with its fields as they are now, then the others (the rows moved or were edited since; held back,
    read again at the end): those resume matched to a row first (:func:`resume_order`), then as
    :class:`RowPlaces` prefers them; records of samples the dataset does not
    want (rows since removed, sample indices beyond today's count) are all kept. ``written`` gets
    each record as trajectories.jsonl holds it (:class:`KeptFeed`: the scores and the report, which
    would otherwise read that file again), with the report's entry for it when ``prepared``
    (:class:`PreparedLines`) made it from the same line during the dispatch. ``wanted``: the dataset's
    :func:`wanted_samples`, when the caller has them already (:class:`KeptFeed`). ``excluded`` gets
    each partial record ``exclude_partial`` leaves out (:meth:`KeptFeed.excluded`: a sample left out of
    the training file is still a judged sample of the evaluation). ``checked``: the batch files a resume's
    scan read (:class:`CheckedFiles`): a line of one still as the scan read it is valid unless the scan
    found it not, and is not checked again.
    """
    if wanted is None:
        wanted = wanted_samples(rows, samples_per_prompt, recorder.sample_text)
    own = OwnPlaces(rows, samples_per_prompt, recorder.sample_text)  # a bit a record at its row's own place
    places = RowPlaces(own)
    # The records' Lines, for the checkpoint's counts (superseded_discards): only beside discards.
    lines = lines_matter(run_dir / "discarded.jsonl")
    # The lines of every record, for checkpoint.json's completed prompts, only when the recorder does not
    # track the rows (a run does from its start: then they would be 100,000 ints held for nothing).
    done_indices: set[int] | None = set() if recorder.row_pending is None else None
    per_batch: collections.Counter[int] = collections.Counter()  # valid records of each batch file
    kept: collections.Counter[tuple[str, int]] = collections.Counter()
    known = set(known_tool_names())
    totals = MergeTotals(known_tool_names())
    totals.own = own
    unknown: list[dict[str, Any]] = []  # records that call a tool outside the known set
    # Records of a sample the dataset wants that no row's own line and fields wrote (the rows moved or were
    # edited since; a sample redone), held back until every record written by a row as it is now has its
    # place: (preference, file, byte offset, the line's prepared work). Kept first in file order, one of a
    # removed twin took the place of the row that is still there (the removed one's id, answer and score).
    held: list[Held] = []
    out = run_dir / "trajectories.jsonl"
    tmp = temp_path(out)

    def keep(
        fh: BinaryIO, raw: bytes, rec: dict[str, Any], key: tuple[str, int], ready: Prepared | None
    ) -> None:
        kept[key] += 1
        totals.by_stop_reason[_stop_reason(rec)] += 1
        if exclude_partial and rec.get("partial"):
            totals.dropped["partial_excluded"] += 1
            if excluded is not None:
                excluded(typed_record(rec) or rec)
            return
        reasoning = totals.add(rec)
        typed = None if ready is not None else typed_record(rec)
        fh.write(typed_line(raw, typed))
        if written is not None:
            written(rec if typed is None else typed, ready.item if ready is not None else None, reasoning)

    try:
        with tmp.open("wb") as fh:
            files = batch_files(run_dir)
            for n, (_, path) in enumerate(files):
                invalid = checked.invalid_lines(path) if checked is not None else None
                for offset, raw, rec in iter_jsonl_at(path):
                    ready = prepared.take(raw) if prepared is not None else None
                    if invalid is not None:  # read by the scan, not changed since
                        if offset in invalid:
                            totals.dropped["invalid_lines"] += 1
                            continue
                    elif ready is None and not valid_record(rec):  # torn, or valid JSON of the wrong shape
                        totals.dropped["invalid_lines"] += 1
                        continue
                    per_batch[files[n][0]] += 1
                    key = record_sample(rec)
                    if kept_pass(rec, exclude_partial):
                        totals.passes[pass_key(key[0], row_fields_of(rec.get("metadata")))] += 1
                    place = p = None
                    if isinstance(rec.get("prompt_index"), int):
                        if done_indices is not None:
                            done_indices.add(rec["prompt_index"])
                        meta = rec.get("metadata")
                        occurrence = occurrence_in(meta)
                        if lines:
                            totals.finished_at[(*key, rec["prompt_index"], occurrence)] += 1
                        place = place_of(key, rec["prompt_index"], row_fields_of(meta), occurrence)
                        p = own.add(place)
                        if p is None:
                            totals.finished_where[place] += 1
                    if p is None:
                        totals.finished[key] += 1
                    if used_tool_names(rec) - known:
                        totals.dropped["unknown_tool"] += 1
                        unknown.append(rec)
                        continue
                    if key in wanted:
                        preference = places.preference(place, p)
                        if preference:
                            held.append((preference, n, offset, ready, place))
                            continue
                    elif not (exclude_partial and rec.get("partial")):
                        totals.not_in_dataset += 1
                    keep(fh, raw, rec, key, ready)
            taken: collections.Counter[Place] = collections.Counter()
            if held:  # the places a resume matched to rows, less those kept already (preference 0)
                taken = taken_places(run_dir, rows, totals, recorder, samples_per_prompt)
                taken.subtract(places.taken())
            for _, n, offset, ready, _ in resume_order(held, taken):
                raw, rec = read_line_at(files[n][1], offset)
                if rec is None:  # changed under us: not this merge's to judge
                    totals.dropped["invalid_lines"] += 1
                    continue
                key = record_sample(rec)
                if kept[key] >= wanted[key]:
                    totals.dropped["duplicate"] += 1
                    continue
                keep(fh, raw, rec, key, ready)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
        fsync_dir(run_dir)
    except OSError as exc:  # disk full, read-only: the run's clear stop (exit 4), not a traceback (exit 1)
        discard_temp(tmp)
        if isinstance(exc, WriteError) or exc.filename not in (None, str(tmp), str(run_dir)):
            raise  # a batch file that cannot be opened: no write failed
        raise WriteError(out, exc) from exc
    except BaseException:  # a failed or interrupted merge (Ctrl-C, SIGTERM) leaves no copy of the data behind
        discard_temp(tmp)
        raise
    set_aside_unknown_tools(run_dir, unknown, recorder)
    # The dataset card: load_dataset(run_dir) reads trajectories.jsonl with the record schema, typed
    # even where a column is null throughout this run (no row had an id, no reasoning tokens reported).
    write_text_atomic(run_dir / "README.md", run_card(run_dir.name, known_tool_names()))
    if done_indices is not None:
        recorder.done_indices = done_indices  # counted in this pass: no second parse of the batch files
    totals.per_batch = per_batch
    # Nor for the outcomes: counted once here, for this checkpoint and for statistics.json (the counts
    # kept during the run count a discard run again in its old batch too, and a record set aside above
    # as a trajectory as well as a discard).
    totals.outcomes = count_outcomes(run_dir, per_batch, totals.finished_at)
    recorder.batch_outcomes = totals.outcomes.batches
    recorder.write_checkpoint()
    return totals


def taken_places(
    run_dir: Path, rows: list[Row], totals: MergeTotals, recorder: Recorder, samples_per_prompt: int
) -> collections.Counter[Place]:
    """The places of the outcomes a resume matches to the dataset's rows (resume.match_outcomes, over
    the batch files' records and the discards), each as often as rows took it."""
    matched = matched_outcomes(run_dir, rows, totals, recorder, samples_per_prompt)
    return collections.Counter(place for place in matched.taken.values() if place is not None)


def matched_outcomes(
    run_dir: Path,
    rows: list[Row],
    totals: MergeTotals,
    recorder: Recorder,
    samples_per_prompt: int,
    counts: Callable[[dict[str, Any]], bool] | None = None,
    *,
    with_places: bool = True,
) -> Matched:
    """resume.match_outcomes over what the merge counted in the batch files and the discards beside them
    (``counts``: which discarded.jsonl rows finish their sample, as add_discards takes it; ``with_places``:
    whether the places each sample took are wanted, as match_outcomes takes it)."""
    done = collections.Counter(totals.finished)
    at = collections.Counter(totals.finished_where)
    add_discards(run_dir, done, rerun_discarded=False, at=at, counts=counts)
    return match_outcomes(
        rows,
        done,
        recorder.sample_text,
        samples_per_prompt,
        at,
        consume=True,
        with_places=with_places,
        own=totals.own,
    )


def resume_order(held: list[Held], taken: collections.Counter[Place]) -> list[Held]:
    """The held-back records in the order the merge keeps them: those a resume matched to a row first,
    then by preference and file order. By preference alone, a row's record at its line with an id since
    edited came after its removed twin's (the row's fields elsewhere): the merge kept the twin's sample,
    judged against the twin's answer, while the resume compared the row's check with its own."""
    first, rest = [], []
    for h in sorted(held, key=lambda h: h[:3]):
        place = h[4]
        if place is not None and taken[place] > 0:
            taken[place] -= 1
            first.append(h)
        else:
            rest.append(h)
    return [*first, *rest]


def typed_record(rec: dict[str, Any]) -> dict[str, Any] | None:
    """For a record whose metadata is not in the schema's types (nulls, row name lists: another tool's
    record, or one from before format 1), the record with its metadata typed, so trajectories.jsonl
    never mixes two types in a column; None when it is in them already (its line is copied as
    written). Only metadata is retyped: what the model and the tools said is never touched."""
    meta = rec.get("metadata")
    if isinstance(meta, dict) and not metadata_typed(meta):
        typed = normalize_metadata(meta)
        if typed != meta:
            return {**rec, "metadata": typed}
    return None


def typed_line(raw: bytes, typed: dict[str, Any] | None) -> bytes:
    """The line trajectories.jsonl holds for a batch file's line ``raw`` (see :func:`typed_record`)."""
    if typed is not None:
        return (json_line(typed) + "\n").encode("utf-8")
    return raw if raw.endswith(b"\n") else raw + b"\n"


class Prepared:
    """What :class:`PreparedLines` worked out from one line: it is a valid record, already in the
    schema's types (its line is copied as written), and ``item``, its report entry (None past the
    report's limit: the merge's report makes one itself if its list still has room)."""

    __slots__ = ("item",)

    def __init__(self, item: dict[str, Any] | None):
        self.item = item


class PreparedLines:
    """The merge's work on a kept trajectory's line, done when the line is written (the parent waits
    for outcomes most of a dispatch) instead of after the last one: the record's checks, and its
    entry in the report's list, which was half of the merge's time. The first ``limit`` lines get
    both, held by the line's bytes (the report lists no more); later lines get the checks, held by
    a digest of their bytes (up to ``MAX_CHECKED``), so memory stays bounded. The merge uses either
    only for a line exactly as it was written: a line it meets changed, or torn, or never told of,
    is worked out there as before."""

    MAX_CHECKED = 1_000_000  # ~80 MB of digests; lines beyond are checked by the merge

    def __init__(self, limit: int):
        self.limit = limit
        self._lines: dict[bytes, Prepared] = {}
        self._checked: set[bytes] = set()

    def __call__(self, data: bytes) -> None:
        listed = len(self._lines) < self.limit
        if not listed and len(self._checked) >= self.MAX_CHECKED:
            return
        from batchrun.views.report import prepare_trajectory

        line = data.rstrip(b"\n")
        try:
            rec = parse_json(line.decode("utf-8"))  # as the merge parses the line (iter_jsonl_raw)
            if not isinstance(rec, dict) or not valid_record(rec) or typed_record(rec) is not None:
                return
            item = prepare_trajectory(rec) if listed else None
        except Exception:  # nothing is lost: the merge works the line out itself (and says what failed)
            return
        if listed:
            self._lines[line] = Prepared(item)
        else:
            self._checked.add(_digest(line))

    def take(self, raw: bytes) -> Prepared | None:
        """The line's prepared work, once (a second line of the same bytes is worked out anew)."""
        line = raw.rstrip(b"\n")
        ready = self._lines.pop(line, None) if self._lines else None
        if ready is None and self._checked:
            digest = _digest(line)
            if digest in self._checked:
                self._checked.discard(digest)
                return _CHECKED
        return ready


_CHECKED = Prepared(None)  # a line checked when written, with no report entry made for it


def _digest(line: bytes) -> bytes:
    """A line's identity for :class:`PreparedLines` (128 bits of blake2b: no two lines share one in practice)."""
    return hashlib.blake2b(line, digest_size=16).digest()


class KeptFeed:
    """What the end of a run derives from each merged record, fed by :func:`merge` as it writes it, so
    trajectories.jsonl is not read back for it: the scores section (kept samples first, the discarded
    ones added by :func:`statistics`) and the report's trajectories. A record the report cannot take
    only sends the report back to reading the files (where it says what failed): the merge goes on."""

    def __init__(self, config: RunConfig, rows: list[Row], recorder: Recorder):
        # Keyed as the records are (a row's identity redacts secrets only, not the scaffolding), and
        # worked out once for the merge too.
        self.wanted = wanted_samples(rows, config.samples_per_prompt, recorder.sample_text)
        self.scores = RunScores(config.distribution, self.wanted)
        from batchrun.views.report import RunData, add_trajectory

        # No Lines of the kept records (note_lines): which discards stand is statistics' verdict, handed
        # in with the rows (discard), as the scores take them: discarded.jsonl read once for both, and the
        # report counting by statistics.json's own rule.
        self.report: Any = RunData(
            run_dir=config.run_dir,
            max_items=config.report_max_trajectories,
            wanted=self.wanted,
            note_lines=False,
        )
        self._add_trajectory = add_trajectory

    def __call__(
        self,
        rec: dict[str, Any],
        item: dict[str, Any] | None = None,
        reasoning: tuple[int, int] | None = None,
    ) -> None:
        self.scores.add(rec, *record_sample(rec))
        if self.report is not None:
            try:
                self._add_trajectory(self.report, rec, item, reasoning)
            except Exception:
                self.report = None

    def discard(self, row: Any, valid: bool, stale: bool) -> None:
        """A discarded.jsonl row as statistics reads it (``valid``: its shape; ``stale``: superseded)."""
        if self.report is not None:
            from batchrun.views.report import add_discard

            try:
                add_discard(self.report, row, valid, stale)
            except Exception:
                self.report = None

    def discards_read(self) -> None:
        """Every discarded.jsonl row was handed in: the report does not read the file."""
        if self.report is not None:
            self.report.discards_fed = True

    def excluded(self, rec: dict[str, Any]) -> None:
        """A partial sample --exclude_partial leaves out of trajectories.jsonl (and so out of the report's
        trajectories): its score still counts, or the pass rate would leave out the samples that ran
        out of turns, tokens or context, most of them failures), in the report's scores too."""
        self.scores.add(rec, *record_sample(rec))
        if self.report is not None:
            from batchrun.views.report import add_excluded

            try:
                add_excluded(self.report, rec)
            except Exception:
                self.report = None


def set_aside_unknown_tools(run_dir: Path, records: list[dict[str, Any]], recorder: Recorder) -> None:
    """Records dropped at merge for a tool outside the known set go to discarded.jsonl (reason
    ``unknown_tool``) like every other discard, once: a later merge finds them there already."""
    if not records:
        return
    there: collections.Counter[tuple[str, int]] = collections.Counter()
    for row in iter_jsonl(run_dir / "discarded.jsonl"):
        if valid_outcome_row(row, "reason") and row["reason"] == "unknown_tool":
            there[outcome_sample(row)] += 1
    for rec in records:
        key = record_sample(rec)
        if there[key] > 0:
            there[key] -= 1
            continue
        recorder.set_aside(rec, "unknown_tool")


def _stop_reason(rec: dict[str, Any]) -> str:
    reason = (rec.get("metadata") or {}).get("stop_reason")
    return reason if isinstance(reason, str) else "unknown"


def statistics(
    config: RunConfig,
    rows: list[Row],
    totals: MergeTotals,
    recorder: Recorder,
    isolation: str,
    sandbox_facts: dict[str, Any] | None = None,
    scores: RunScores | None = None,
    request_limit: dict[str, Any] | None = None,
    kept: KeptFeed | None = None,
) -> dict[str, Any]:
    """Statistics over the merged output of every run of this run name, plus this run's counters.
    ``request_limit``: this run's limit on model requests in flight and what set it (None: none).

    ``scores``: the kept samples' scores as the merge fed them (:class:`KeptFeed`); without it they
    are read back from trajectories.jsonl. The discarded samples' are added here. ``kept``: the feed
    whose report gets each discarded.jsonl row as this reads it (the report reads it itself otherwise)."""
    run_dir = config.run_dir
    if scores is None:
        scores = kept_scores(
            run_dir,
            config.distribution,
            wanted_samples(rows, config.samples_per_prompt, recorder.sample_text),
        )
    with_r, without_r = totals.with_reasoning, totals.without_reasoning
    # The outcomes as the merge counted them for checkpoint.json's batch_stats: one count, one rule.
    counted = totals.outcomes or count_outcomes(run_dir, totals.per_batch, totals.finished_at)
    discards_all = counted.discards
    for n, rec in enumerate(iter_jsonl(run_dir / "discarded.jsonl")):
        valid, stale = valid_outcome_row(rec, "reason"), n in counted.stale
        if kept is not None:
            kept.discard(rec, valid, stale)
        if stale or not valid:
            continue
        w, n = reasoning_counts((rec.get("record") or {}).get("conversations", []))
        with_r, without_r = with_r + w, without_r + n - w
        if isinstance(rec.get("record"), dict):  # kept samples first: a sample re-run counts once
            scores.add(rec["record"], *record_sample(rec["record"]))
    if kept is not None:
        kept.discards_read()
    failures_all = dict(counted.failures)
    recorder.batch_outcomes = counted.batches
    this_run = this_run_totals(recorder)
    earlier = earlier_runs(run_dir / "statistics.json")
    # The re-scorings views.score added: rewritten without them, a --resume (even one that ran nothing)
    # wiped every one from statistics.json, their scores files left behind.
    rescored = earlier_rescorings(run_dir / "statistics.json")
    runs = [*earlier, *recorder.lost_runs, this_run]  # lost_runs: read at the start, from the same files
    summary = totals.summary()
    # Lines skipped for their shape (or torn) in discarded.jsonl and failed.jsonl, beside the batch files'.
    summary["invalid_lines_skipped"] = {
        "batch_files": totals.dropped.get("invalid_lines", 0),
        "discarded.jsonl": counted.invalid_discards,
        "failed.jsonl": counted.invalid_failures,
    }
    # Coverage over every sample the model produced, the discarded ones included (SPEC: "over the run").
    summary["reasoning"] = {
        "turns_with_reasoning": with_r,
        "turns_without_reasoning": without_r,
        "coverage": round(with_r / (with_r + without_r), 4) if with_r + without_r else None,
        "coverage_of_kept_trajectories": summary["reasoning"]["coverage"],
    }
    matched = matched_outcomes(
        run_dir,
        rows,
        totals,
        recorder,
        config.samples_per_prompt,
        still_skipped(totals.passes, config.stop_after_passes),
        with_places=False,
    )
    # Samples (a row of N samples counts N) a --resume would run: no trajectory and no discard yet; a
    # sample skipped after its row's passes only while the row has --stop_after_passes of them (a resume
    # that raised it and stopped before running them left them to run). Whether this invocation re-ran discards (--rerun_discarded) does not
    # matter: what they gave is their outcome (counted as pending, the closing summary offered a command
    # that ran them all once more).
    remaining = len(matched.left)
    # The same samples by their rows' check fields: those the scorers have nothing to judge by (a row with
    # no answer, verify or rubric) are no sample the evaluation failed to judge, as the unscored are not.
    pending_by_check = dict(
        sorted(collections.Counter(check_kind(row.check) for row, _ in matched.left).items())
    )
    # checkpoint.json's completed prompts as resume sees them now: the rows whose every sample has an
    # outcome (a line an edit gave another row lists that row's outcomes, not the old one's).
    recorder.track_rows(pending_samples(rows, matched.left))
    recorder.write_checkpoint()
    stats = {
        "run_name": config.run_name,
        "model": config.model,
        "distribution": config.distribution,
        "sandbox": config.backend,
        "default_image": config.default_image,  # for rows that name no image (container backends)
        "isolation": isolation,
        # How the prompts' commands reach the network, as the backend said (None: it did not say, or
        # nothing ran): "off", "hub", "bridge", "slirp4netns", "host", ... (README, Sandboxes).
        "sandbox_network": None,
        **(sandbox_facts or {}),
        "dataset_prompts": len(rows),
        "samples_per_prompt": config.samples_per_prompt,
        "dataset_samples": sum(
            samples_of(r, config.samples_per_prompt) for r in rows
        ),  # rows' own counts too
        **summary,
        "discarded": {"total": sum(discards_all.values()), "by_reason": dict(discards_all)},
        "failed_attempts": {"total": sum(failures_all.values()), "by_class": failures_all},
        "remaining_for_resume": remaining,
        # The reference runner's names and shapes, beside ours, so scripts written for it read this file.
        "total_prompts": len(rows),
        "total_batches": len(batch_files(run_dir)),  # batch files of every run of this run name
        "batch_size": config.batch_size,
        "completed_at": dt.datetime.now().isoformat(timespec="seconds"),
        # every run of this run name (credible: a hand-edited Infinity would make it one)
        "duration_seconds": round(sum(credible(r["duration_s"]) for r in runs), 2),
        "tool_statistics": reference_tool_statistics(summary["tool_stats"]),
        "reasoning_statistics": {
            "total_assistant_turns": with_r + without_r,
            "turns_with_reasoning": with_r,
            "turns_without_reasoning": without_r,
            "coverage": summary["reasoning"]["coverage"],
            "samples_discarded_no_reasoning": discards_all.get("no_reasoning", 0),
        },
        # Totals over every invocation of this run name: a --resume adds to them, never resets them.
        "run_totals": run_totals(runs),
        "runs": runs,
        "scores": with_planned(
            {
                **scores.summary(discards_all.get(SKIPPED_AFTER_PASSES, 0)),
                # Samples with no outcome yet (failed attempts, samples not run: a prompt that timed out
                # every time) are in no figure above: the pass rate is over the samples judged. Those of
                # rows the scorers have nothing to judge by are not among them (samples_planned counted
                # them as not passed); remaining_for_resume counts every one.
                "samples_pending": pending_judged(pending_by_check, config.scorer),
                "samples_pending_by_check": pending_by_check,
                "duplicate_samples": duplicate_samples(scores.wanted),
                **({"rescored": rescored} if rescored else {}),
            }
        ),
        "this_run": {
            "attempted": recorder.counts[TRAJECTORY] + recorder.counts[DISCARDED] + recorder.counts[FAILED],
            "trajectories": recorder.counts[TRAJECTORY],
            "discarded": dict(recorder.discards),
            "failed": dict(recorder.failures),
            "api_calls": recorder.spend["requests"],
            "usage": this_run_usage(recorder),
            "skipped_for_budget": recorder.counts["skipped_budget"],
            # --rerun_discarded: the discards it was to run again, kept, discarded again, not run again.
            "rerun_discarded": recorder.rerun_summary(),
            "budget": recorder.budget_summary(),
            "rate_limit_pauses": recorder.counts["rate_limit_pauses"],
            # Model requests in flight at most: {requests, per_worker, set_by, endpoint_slots}, or None.
            "requests_in_flight_limit": request_limit,
            "bad_dataset_lines": recorder.counts["bad_lines"],
            "toolsets_offered": {
                k.split(":", 1)[1]: v for k, v in recorder.counts.items() if k.startswith("toolset:")
            },
            "toolsets_not_available": {
                k.split(":", 1)[1]: v for k, v in recorder.counts.items() if k.startswith("toolset_missing:")
            },
            "duration_s": this_run["duration_s"],
        },
    }
    write_json_atomic(run_dir / "statistics.json", stats, recorder.redact)
    return stats


def kept_scores(
    run_dir: Path, distribution: str, wanted: dict[tuple[str, int], int] | None = None
) -> RunScores:
    """The ``scores`` section's kept samples, read back from trajectories.jsonl: every judged sample the
    model finished and the merge kept, each (row, sample) as often as the dataset wants it (``wanted``;
    a sample the dataset no longer wants: once). :func:`statistics` adds the discarded ones."""
    scores = RunScores(distribution, wanted)
    for rec in iter_jsonl(run_dir / "trajectories.jsonl"):
        if valid_record(rec):
            scores.add(rec, *record_sample(rec))
    return scores


# unanswered_tokens: failed attempts that may have been billed, the runner's estimate (in no total_tokens).
# cached_tokens, cache_write_tokens: of prompt_tokens (absent from entries written before they were counted).
RUN_TOTAL_KEYS = (
    "attempted", "trajectories", "requests", "prompt_tokens", "completion_tokens", "cost_usd", "unanswered_tokens",
    "cached_tokens", "cache_write_tokens",
)  # fmt: skip


def this_run_totals(recorder: Recorder) -> dict[str, Any]:
    """This invocation's entry in ``runs``: when, how long, what it spent."""
    spend = recorder.spend
    return {
        "started_at": recorder.started_at,
        "invocation": recorder.invocation,
        "completed_at": dt.datetime.now().isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - recorder.started, 2),
        "attempted": recorder.counts[TRAJECTORY] + recorder.counts[DISCARDED] + recorder.counts[FAILED],
        "trajectories": recorder.counts[TRAJECTORY],
        "requests": int(spend["requests"]),
        "prompt_tokens": int(spend["prompt_tokens"]),
        "completion_tokens": int(spend["completion_tokens"]),
        "cost_usd": round(float(spend["cost_usd"]), 8),
        "unanswered_tokens": int(spend["unanswered_tokens"]),
        "cached_tokens": int(spend["cached_tokens"]),
        "cache_write_tokens": int(spend["cache_write_tokens"]),
    }


def this_run_usage(recorder: Recorder) -> dict[str, Any]:
    """``this_run.usage``: every count this invocation's outcomes and calls added (the cache's 0 when no
    endpoint said them, so the key is there in every run)."""
    usage = {k: round(v, 8) if isinstance(v, float) else v for k, v in recorder.spend.items()}
    for key in ("cached_tokens", "cache_write_tokens"):
        usage.setdefault(key, 0)
    return usage


def run_totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> float:
        return sum(credible(r.get(key)) for r in runs)  # a damaged file's entry: no NaN, no infinity

    totals: dict[str, Any] = {"runs": len(runs), "duration_s": round(total("duration_s"), 2)}
    for key in RUN_TOTAL_KEYS:
        totals[key] = round(total(key), 8) if key == "cost_usd" else int(total(key))
    totals["total_tokens"] = totals["prompt_tokens"] + totals["completion_tokens"]
    # Killed invocations' calls in flight, in USD (their spend journal's): the USD books beside cost_usd.
    totals["unanswered_usd"] = round(total("unanswered_usd"), 8)
    return totals


def reference_tool_statistics(tool_stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tool as the reference runner writes it: only the tools that were called (a tool never called
    has no rate), rates in percent of its calls. Everywhere else in statistics.json rates are fractions."""
    out = {}
    for name, s in tool_stats.items():
        if not s["count"]:
            continue
        out[name] = {
            "count": s["count"],
            "success": s["success"],
            "failure": s["failure"],
            "success_rate": round(s["success"] / s["count"] * 100, 2),
            "failure_rate": round(s["failure"] / s["count"] * 100, 2),
        }
    return out


def pending_samples(rows: list[Row], left: list[Any]) -> dict[int, int]:
    """Each row's index -> how many of its samples have no outcome yet (``left``: resume's ``Sample``\\ s)."""
    pending = dict.fromkeys((row.index for row in rows), 0)
    for row, _ in left:
        pending[row.index] += 1
    return pending


def write_report(run_dir: Path, max_trajectories: int, redact: Redactor, kept: Any = None) -> None:
    """report.html beside the data; a report must never fail a finished run. ``kept``: the merged
    trajectories already gathered (:class:`KeptFeed`'s ``report``), or None to read them."""
    from batchrun.views.report import write_report

    try:
        path = write_report(run_dir, max_trajectories=max_trajectories, redact=redact, kept=kept)
        print(f"Report: {path}  (again any time: python -m batchrun.views.report {run_dir})")
    except Exception as exc:
        print(redact(f"warning: report.html not written: {exc}"), file=sys.stderr)


def print_summary(
    run_dir: Path,
    stats: dict[str, Any],
    recorder: Recorder,
    *,
    endpoint_dead: bool = False,
    endpoint_refused: bool = False,
    judge: bool = False,
) -> None:
    """The closing summary on the console. ``endpoint_dead``: the run stopped because its endpoint died,
    or (``endpoint_refused`` too) refused its key or account (the prompts it stopped in flight are
    failed with class ``budget``, as a budget's are); ``judge``: that endpoint was the judge's."""
    print("\n" + "=" * 72)
    print(
        f"Run {stats['run_name']}: {stats['trajectories']} trajectories in {run_dir / 'trajectories.jsonl'}"
    )
    tr = stats["this_run"]
    print(
        f"This run: {tr['attempted']} attempted, {tr['trajectories']} trajectories, discarded {tr['discarded'] or 0}, failed {tr['failed'] or 0}, {tr['api_calls']} model calls, {tr['duration_s']} s"
    )
    used = {n: s for n, s in stats["tool_stats"].items() if s["count"]}
    if used:
        print(f"{'tool':<20}{'calls':>8}{'ok':>8}{'failed':>8}{'success':>10}")
        for name, s in sorted(used.items(), key=lambda kv: -kv[1]["count"]):
            print(f"{name:<20}{s['count']:>8}{s['success']:>8}{s['failure']:>8}{s['success_rate']:>10.1%}")
    r = stats["reasoning"]
    if r["coverage"] is not None:
        print(
            f"Reasoning coverage: {r['coverage']:.1%} of {r['turns_with_reasoning'] + r['turns_without_reasoning']} assistant turns"
        )
    by_reason = stats["discarded"]["by_reason"]
    print(f"Discarded (all runs): {stats['discarded']['total']}" + (f" {by_reason}" if by_reason else ""))
    line = headline(stats.get("scores") or {})
    if line:
        print(line)
    errors = (stats.get("scores") or {}).get("scorer_errors")
    if errors:
        from batchrun.views.score import rejudge_command

        command = rejudge_command(run_dir)
        if command:  # a judge refused or down mid-run: its samples kept their error, not a verdict
            print(
                f"{errors} scorer error(s): this judges them again, every other sample keeping its verdict "
                f"(the judge's key in JUDGE_API_KEY):\n  {recorder.redact(command)}"
            )
    print_failures(run_dir, recorder)
    budget = tr["budget"]
    if budget["stopped_unfinished"]:
        spent = budget["spent_tokens"] or 0
        lost = budget["unfinished_tokens"]
        share = f" ({lost / spent:.0%} of this run's {spent:,})" if spent else ""
        # A dead endpoint stops prompts in flight the same way (class budget): said as what it is.
        stopped_for = ("judge's " if judge else "") + ("refused key" if endpoint_refused else "dead endpoint")
        why = (
            ("The budget stopped", " (a tight budget with prompts longer than the first ones to finish)")
            if budget["reached"] or not endpoint_dead
            else (
                f"The run's stop for its {stopped_for} ended",
                "",
            )
        )
        print(
            f"{why[0]} {budget['stopped_unfinished']} prompt(s) after they had made model calls: "
            f"{lost:,} tokens{share}"
            + (f", ${budget['unfinished_usd']:.4f}" if budget["unfinished_usd"] else "")
            + f" gave no sample{why[1]}; --resume runs them again"
        )
    d = stats["dropped_at_merge"]
    if any(d.values()):
        print(f"Dropped at merge: {d}")
    if stats.get("trajectories_not_in_dataset"):
        print(
            f"Kept as they are: {stats['trajectories_not_in_dataset']} of the trajectories are of rows or sample "
            "indices the dataset no longer has (rows removed or edited since they ran, fewer samples, "
            "--max_samples); statistics.json: trajectories_not_in_dataset"
        )
    print_rerun(stats["this_run"].get("rerun_discarded"), recorder)
    if stats["remaining_for_resume"]:
        print(
            f"{stats['remaining_for_resume']} {'prompt' if stats['dataset_samples'] == stats['dataset_prompts'] else 'sample'}(s) remain; continue with:\n  {recorder.redact(resume_command())}"
        )
    print("=" * 72)


def print_rerun(rerun: dict[str, Any] | None, recorder: Recorder) -> None:
    """What each command does with the discards a --rerun_discarded resume did not run again (stopped
    before it reached them, or they failed): the resume command leaves them discarded, and the flag
    continues the round, which stays open: it runs them, not again those the round ran again already."""
    if not rerun or not rerun["not_rerun"]:
        return
    print(
        f"--rerun_discarded: {rerun['not_rerun']} of the {rerun['to_rerun']} discarded sample(s) this run was "
        f"to run again (round {rerun['round']}) did not run again (stopped, or failed); they keep their "
        "discards.\n"
        f"  {recorder.redact(resume_command())}\n    leaves them discarded (it runs only the samples "
        "without an outcome);\n"
        f"  {recorder.redact(rerun_command())}\n    continues round {rerun['round']}: runs only them, not "
        "again those the round ran again already"
    )


def print_failures(run_dir: Path, recorder: Recorder) -> None:
    """Each failure class of this run with its most common message; every message is in failed.jsonl."""
    if not recorder.failures:
        return
    print(
        f"Failed this run: {sum(recorder.failures.values())} prompt(s); each one in {run_dir / 'failed.jsonl'}"
    )
    for error_class, count in recorder.failures.most_common():
        message, same = recorder.failure_messages[error_class].most_common(1)[0]
        print(
            recorder.redact(
                f"  {error_class} x{count}: {message}" + (f"  ({same} of {count})" if count > 1 else "")
            )
        )


EXIT_FAILURE_RATE = 3  # more prompts of this invocation failed than --max_failure_rate allows


def exit_code(stats: dict[str, Any], interrupted: bool, max_failure_rate: float) -> int:
    """0, :data:`EXIT_FAILURE_RATE` or 130 (interrupted)."""
    if interrupted:
        return 130
    failed, attempted = _failed_of_attempted(stats)
    return EXIT_FAILURE_RATE if attempted and failed / attempted > max_failure_rate else 0


def failure_rate_message(stats: dict[str, Any], max_failure_rate: float) -> str:
    """What exit 3 says: how many of this invocation's prompts failed, against the flag's rate."""
    failed, attempted = _failed_of_attempted(stats)
    stopped = _budget_stopped(stats)
    return (
        f"error: {failed} of {attempted} prompts failed (more than --max_failure_rate={max_failure_rate})"
        + (f"; {stopped} the budget stopped are not counted" if stopped else "")
    )


def _failed_of_attempted(stats: dict[str, Any]) -> tuple[int, int]:
    """This invocation's failed prompts and the prompts it attempted, both without those the budget
    stopped: stopped on purpose, they are neither failures nor prompts that ran to their end. Counted as
    attempted, they hid the failures: 2 prompts failing (HTTP 500) beside 8 the budget stopped were 2 of 10
    (exit 0), although every prompt that ended on its own had failed."""
    tr = stats["this_run"]
    stopped = _budget_stopped(stats)
    return sum(n for cls, n in tr["failed"].items() if cls != "budget"), tr["attempted"] - stopped


def _budget_stopped(stats: dict[str, Any]) -> int:
    return stats["this_run"]["failed"].get("budget", 0)
