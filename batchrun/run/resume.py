"""--resume: which samples are finished (by their row's content, duplicates counted), and whether the settings still match.

Each row runs ``samples`` times (its own field, else ``--samples_per_prompt``); a sample is
(row identity, sample index). It is finished when a batch file holds a trajectory of it, or (unless
``--rerun_discarded``) ``discarded.jsonl`` holds a discard of it. Failures are not finished: they
run again. ``--rerun_discarded`` runs in rounds (:func:`rerun_round`): an interrupted round continued
runs only the discards it has not run again yet. Records written before samples existed are sample 0.
The manifest (``run_manifest.json``) records the settings that define the data; a resume with other
values would mix two datasets and is refused unless ``--force_resume``.
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import datetime as dt
import hashlib
import os
import re
import shlex
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchrun.config import FALSE_WORDS, TRUE_WORDS, RunConfig, UsageError
from batchrun.identity import Line, RowIdentity, is_index, lines_matter, outcome_sample, record_sample
from batchrun.protocol import SKIPPED_AFTER_PASSES, RowCheck
from batchrun.record import ROUND_FIELD, occurrence_of, read_score, round_of, valid_outcome_row, valid_record
from batchrun.run.dataset import Row
from batchrun.run.run_dir import FORMAT_FIELD, FORMAT_VERSION
from batchrun.scoring import check_from_row_fields, judge_endpoint
from batchrun.secrets import Redactor
from batchrun.sharegpt import parse_json
from batchrun.storage import batch_files, iter_jsonl, iter_jsonl_at, read_json_object

# Settings that define what the data is; a resume with other values would mix two datasets.
MANIFEST_KEYS = (
    "model",
    "distribution",
    "max_turns",
    "seed",
    "reasoning_effort",
    "reasoning_disabled",
    "endpoint_dialect",  # how the reasoning controls were sent decides whether they took effect
    "sandbox",
    "keep_no_reasoning",
    "keep_invalid_tool_calls",
    "keep_empty_answers",
    "ephemeral_system_prompt_sha256",  # hashes, never the text: both are secrets (see Redactor)
    "prefill_sha256",
    "distribution_probabilities",  # a --distribution_file may give a name other numbers
    "known_tools",  # the columns of tool_stats (plugins, MCP servers): records must keep one schema
    "temperature",
    "top_p",
    "seed_per_request",
    "max_tokens",  # the flag (a budget's derived cap is not): another cap cuts other replies short
    # How samples are judged and which are kept: a resume with others would mix two kinds of scores.
    "scorer",
    "answer_pattern",
    "answer_normalize",
    "numeric_tolerance",
    "keep",
    "judge_model",
    # Which server judged (judge_endpoint: no login or query): one model name may be answered by several.
    "judge_base_url",
    "verify_timeout",  # a verify that ran out of time leaves its sample unscored
)

# What a manifest written before a key existed stands for: the value that run used. A resume with
# that value compares equal; another value is a change like any other.
MANIFEST_DEFAULTS: dict[str, Any] = {
    "temperature": None,
    "top_p": None,
    "seed_per_request": False,
    "scorer": [],
    "answer_pattern": None,
    "answer_normalize": ["case", "whitespace", "punctuation"],
    "numeric_tolerance": 1e-6,
    "keep": "all",
    "judge_model": None,
    "max_tokens": None,
    "verify_timeout": 60.0,
}


def build_manifest(config: RunConfig) -> dict[str, Any]:
    """The run's data-defining settings, as run_manifest.json records them."""
    return {
        FORMAT_FIELD: FORMAT_VERSION,  # how the directory is written (batchrun.run.run_dir)
        "model": config.model,
        "distribution": config.distribution,
        "max_turns": config.max_turns,
        "seed": config.seed,
        "reasoning_effort": config.reasoning_effort,
        "reasoning_disabled": config.reasoning_disabled,
        "endpoint_dialect": config.endpoint_dialect,
        "sandbox": config.backend,
        "keep_no_reasoning": config.keep_no_reasoning,
        "keep_invalid_tool_calls": config.keep_invalid_tool_calls,
        "keep_empty_answers": config.keep_empty_answers,
        **config.secret_hashes(),
        **config.tool_sources_manifest(),
        "temperature": config.temperature,
        "top_p": config.top_p,
        "seed_per_request": config.seed_per_request,
        "scorer": list(config.scorer),
        "answer_pattern": config.answer_pattern,
        "answer_normalize": list(config.answer_normalize),
        "numeric_tolerance": config.numeric_tolerance,
        "keep": config.keep,
        "judge_model": config.judge_model,
        "judge_base_url": judge_url(config),
        "max_tokens": config.max_tokens,
        "verify_timeout": config.verify_timeout,
        "samples_per_prompt": config.samples_per_prompt,  # informational: more samples on resume is fine
        # Informational: the image of rows that name none (each record's sandbox_image says what ran).
        "default_image": config.default_image,
        "dataset_file": config.dataset_file,
        "dataset_sha256": _file_sha256(config.dataset_file),
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
    }


def read_manifest(path: Path) -> dict[str, Any]:
    """The first run's settings; a damaged file stops the resume instead of silently skipping the check."""
    try:
        old = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        old, problem = None, str(exc)
    else:
        problem = f"a JSON {type(old).__name__}"
    if not isinstance(old, dict):
        raise UsageError(
            f"{path} is not a settings object ({problem}); the resume cannot check its settings. "
            "Restore it, or remove it to resume without the check"
        )
    return old


def check_manifest(old: dict[str, Any], new: dict[str, Any], *, force: bool) -> dict[str, Any]:
    """The manifest to keep for a resume: refused when data-defining settings changed, unless forced.

    With ``force`` the earlier settings go into the manifest's ``history``, so the data says it holds both.
    """
    # A key that a manifest written before it existed lacks cannot be compared (it is recorded from now
    # on), except one whose value then is known (MANIFEST_DEFAULTS): that run could not have set it.
    old = {**{k: v for k, v in MANIFEST_DEFAULTS.items() if k not in old}, **old}
    changed = [k for k in MANIFEST_KEYS if k in old and old.get(k) != new.get(k)]
    history = old.get("history") if isinstance(old.get("history"), list) else []
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        if not force:
            # The probabilities follow the name (a built-in's): the flag that restores the name restores them.
            shown = [
                k for k in changed if not (k == "distribution_probabilities" and "distribution" in changed)
            ]
            original = " ".join(_flag(k, old.get(k)) for k in shown)
            raise UsageError(
                f"--resume with settings that differ from the first run ({detail}) would mix two datasets; "
                f"resume with the original settings ({original}), or add --force_resume to mix them deliberately"
            )
        print(f"warning: resuming with changed settings ({detail}), as forced", file=sys.stderr)
        history = [
            *history,
            {
                "replaced_at": dt.datetime.now().isoformat(timespec="seconds"),
                "settings": {k: old.get(k) for k in MANIFEST_KEYS if k in old},
            },
        ]
    if old.get("dataset_sha256") != new.get("dataset_sha256"):
        print(
            "note: the dataset file changed since the first run; rows are matched by their content",
            file=sys.stderr,
        )
    kept = {**new, "created": old.get("created", new.get("created"))}
    if history:
        kept["history"] = history
    return kept


Sample = tuple[Row, int]  # a dataset row and one of its sample indices: one job
# Row identity -> the ``row_fields`` texts its finished outcomes were judged with -> the lines that wrote them.
Checks = dict[str, dict[str, set[int]]]


def samples_of(row: Row, samples_per_prompt: int) -> int:
    """How many samples ``row`` wants: its own ``samples``, else the run's --samples_per_prompt."""
    return row.samples if row.samples is not None else samples_per_prompt


def wanted_samples(
    rows: list[Row], samples_per_prompt: int, redact: Redactor
) -> collections.Counter[tuple[str, int]]:
    """(row identity, sample index) -> how many dataset rows want that sample (duplicate rows each do)."""
    wanted: collections.Counter[tuple[str, int]] = collections.Counter()
    for row in rows:
        key = row.saved_key(redact)
        for s in range(samples_of(row, samples_per_prompt)):
            wanted[key, s] += 1
    return wanted


# A finished outcome's place: (identity, sample index, dataset line, digest of the ``row_fields`` it was
# written with (None when it holds none), the row's occurrence among rows of its prompt text when it ran
# (None when it does not say: written before ``occurrence`` was saved)), as :func:`match_outcomes` matches
# outcomes to rows by it.
Place = tuple[str, int, int, str | None, int | None]


def fields_digest(fields: Any) -> str | None:
    """A row's ``row_fields`` text (id, answer, ...) as :data:`Place` holds it; None for no text."""
    if not isinstance(fields, str):
        return None
    return hashlib.blake2b(fields.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def place_of(sample: tuple[str, int], line: int, fields: Any, occurrence: int | None = None) -> Place:
    """The :data:`Place` of a finished outcome of ``sample`` written by dataset line ``line``."""
    return (*sample, line, fields_digest(fields), occurrence)


class SampleBits:
    """One bit for each sample of the dataset's rows, by (row position in ``rows``, sample index): what a
    run's end holds per sample where it can (a table entry and a tuple are ~100-200 bytes a sample,
    100,000 samples at issue 5's scale)."""

    def __init__(self, rows: list[Row], samples_per_prompt: int):
        self.first = array.array("q", bytes(8 * len(rows)))  # row position -> its sample 0's bit
        slots = 0
        for p, row in enumerate(rows):
            self.first[p] = slots
            slots += samples_of(row, samples_per_prompt)
        self.bits = bytearray((slots + 7) // 8)

    def __getitem__(self, sample: tuple[int, int]) -> bool:
        slot = self.first[sample[0]] + sample[1]
        return bool(self.bits[slot >> 3] & (1 << (slot & 7)))

    def set(self, p: int, s: int) -> None:
        slot = self.first[p] + s
        self.bits[slot >> 3] |= 1 << (slot & 7)


class RowsByLine:
    """The rows' positions in ``rows`` by their dataset line (a line's row, found by bisection: no table)."""

    def __init__(self, rows: list[Row]):
        self.rows = rows
        self.order = array.array("q", sorted(range(len(rows)), key=lambda p: rows[p].index))
        self.lines = array.array("q", (rows[p].index for p in self.order))

    def at(self, line: int) -> Iterator[int]:
        """The positions of the rows at dataset line ``line`` (one, or none)."""
        i = bisect.bisect_left(self.lines, line)
        while i < len(self.lines) and self.lines[i] == line:
            yield self.order[i]
            i += 1


# What --stop_after_passes counts a row's passes by: its identity and its fields' digest (``row_fields``:
# id, answer, verify, ...). Lines of one prompt and settings but another answer have one identity; the
# passes of one stopped the other's samples (a row judged against "8" skipped after a pass against "7").
# Identical lines (the same fields too) share their passes, as they share their samples' outcomes.
PassKey = tuple[str, str | None]


def pass_key(identity: str, fields: Any) -> PassKey:
    """A pass's :data:`PassKey` from its row identity and the ``row_fields`` text it was written with
    (a record's, an outcome row's; none: a row without fields, ``{}``)."""
    return identity, fields_digest(fields if isinstance(fields, str) else "{}")


def row_pass_key(row: Any, redact: Redactor) -> PassKey:
    """The :data:`PassKey` of a dataset row, or of a job of it, as its saved records give it."""
    return RowIdentity.of_row(row, redact).key, row_fields_digest(row, redact)


def row_fields_digest(row: Row, redact: Redactor) -> str | None:
    """The digest of ``row``'s fields as the outcomes it writes now hold it (:data:`Place`)."""
    return fields_digest(redact(row.row_fields or "{}"))


def own_place(row: Row, s: int, redact: Redactor) -> Place:
    """The :data:`Place` of the outcome ``row`` writes for its sample ``s`` as it is now."""
    return (row.saved_key(redact), s, row.index, row_fields_digest(row, redact), row.occurrence)


def row_at(
    place: Place, by_line: RowsByLine, redact: Redactor, samples_per_prompt: int, *, fields: bool = True
) -> int | None:
    """The position of the row at ``place``'s line with its identity and sample (and, with ``fields``, the
    fields it was written with), whatever its occurrence; None when the line holds no such row."""
    key, s, line, digest, _ = place
    for p in by_line.at(line):
        row = by_line.rows[p]
        if (
            row.saved_key(redact) == key
            and s < samples_of(row, samples_per_prompt)
            and (not fields or row_fields_digest(row, redact) == digest)
        ):
            return p
    return None


def own_position(place: Place, by_line: RowsByLine, redact: Redactor, samples_per_prompt: int) -> int | None:
    """The position of the row whose own place (:func:`own_place`, its occurrence said) ``place`` is."""
    if place[4] is None:
        return None
    p = row_at(place, by_line, redact, samples_per_prompt)
    return p if p is not None and by_line.rows[p].occurrence == place[4] else None


class OwnPlaces:
    """The samples of the dataset's rows with an outcome at their own place (:func:`own_place`), a bit
    each (``bits``), for a scan of the run's files that has the rows (the merge's, the resume's), and
    :func:`match_outcomes`' ``own``."""

    def __init__(self, rows: list[Row], samples_per_prompt: int, redact: Redactor):
        self.bits = SampleBits(rows, samples_per_prompt)
        self.by_line = RowsByLine(rows)
        self.redact = redact
        self.samples_per_prompt = samples_per_prompt

    def add(self, place: Place) -> int | None:
        """Sets the bit of the sample whose own place ``place`` is, and returns its row's position; None
        when it is no row's own."""
        p = own_position(place, self.by_line, self.redact, self.samples_per_prompt)
        if p is not None:
            self.bits.set(p, place[1])
        return p

    def holds(self, place: Place) -> bool:
        """Whether ``place`` is a sample's own place (or its line and fields, without an occurrence) that
        has its bit set: an outcome there is that sample's, counted already (:func:`match_outcomes`)."""
        p = row_at(place, self.by_line, self.redact, self.samples_per_prompt)
        if p is None:
            return False
        occurrence = self.by_line.rows[p].occurrence
        return occurrence is not None and place[4] in (None, occurrence) and self.bits[p, place[1]]


def _place_order(place: Place) -> tuple[int, str, int]:
    return place[2], place[3] or "", -1 if place[4] is None else place[4]


@dataclasses.dataclass
class Matched:
    """What :func:`match_outcomes` found: the samples left to run; for each (row index, sample index) an
    outcome stands for, the :data:`Place` of that outcome (None when it was taken by content alone, the
    last resort); and the places of the outcomes no row took, by (identity, sample index)."""

    left: list[Sample]
    taken: dict[tuple[int, int], Place | None]
    spare: dict[tuple[str, int], list[Place]]


def match_outcomes(
    rows: list[Row],
    done: collections.Counter[tuple[str, int]],
    redact: Redactor,
    samples_per_prompt: int = 1,
    done_at: collections.Counter[Place] | None = None,
    *,
    consume: bool = False,
    with_places: bool = True,
    own: OwnPlaces | None = None,
) -> Matched:
    """Each finished outcome takes one sample of its (identity, sample index): duplicate rows count,
    each wanting its own samples; the samples no outcome is of are left.

    ``done_at`` (:data:`Place`) -> finished outcomes of ``done`` by the dataset line that wrote them, that
    row's other fields (``row_fields``) and its occurrence: identical rows are not interchangeable (their
    occurrence seeds the toolset draw and the request seed, records carry their ``prompt_index``, and rows
    with one prompt may carry another ``id`` or ``answer``), so each row takes, in this order of
    preference, the outcome written with its own fields and its own occurrence (its own line's first):
    the one it would write again; then one of its own line written with its own fields; one written with
    its fields at another line (the rows moved: a row removed or added above, the file reordered); one of
    its own line (its fields were edited); one of its own occurrence (its fields were edited, and rows
    moved); then any left, by content in dataset order. The sample left to run is the one no outcome is
    of: matched by line alone, a row removed above made each twin take its neighbour's outcome, and the
    neighbour ran a second time while the twin whose outcome was taken never ran. Outcomes written before
    the occurrence was saved match by the other stages, as they did.

    ``consume``: ``done`` and ``done_at`` are the caller's to use up (not copied: a run's end matches
    100,000 samples, and each copy is a table of them). ``with_places``: whether ``taken`` and ``spare``
    are wanted (False: they are left empty; the samples left are the same). ``own``: the samples (of
    ``rows``) with an outcome at their own place (:func:`own_place`), counted in neither ``done`` nor
    ``done_at`` (the merge holds a bit for each, not a place: nearly every outcome of a run is one): each
    takes its own, as the first stage would take it, and is left out of ``taken`` (its place is its row's
    as it is now: nothing there to compare); outcomes of ``done_at`` at that place, or at its line and
    fields without an occurrence, are that sample's too."""
    done = done if consume else collections.Counter(done)
    # A dataset line gives each of its samples one outcome: more at one place are that sample redone
    # (discarded again under --rerun_discarded; a record the merge set aside, which stays in its batch
    # file too). Counted once, or they would stand for an identical row's sample. Outcomes of one line
    # written with other fields (or another occurrence) are other rows' (the line held another row before
    # the rows moved); one that does not say its occurrence, at a place where others do, is one of theirs
    # redone (written before the field existed).
    places: collections.Counter[Place] = (
        done_at if consume and done_at is not None else collections.Counter(done_at or ())
    )
    if own is not None and places:
        for place in [p for p in places if own.holds(p)]:
            done[place[0], place[1]] -= places.pop(place)
    for place, n in places.items():
        done[place[0], place[1]] -= n - 1
        places[place] = 1
    said = {place[:4] for place in places if place[4] is not None}
    for place in [p for p in places if p[4] is None and p[:4] in said]:
        done[place[0], place[1]] -= 1
        del places[place]
    # Nothing a sample is held per sample but a bit (whether it took an outcome), and ``taken`` when
    # wanted: a run's end matches every sample of the dataset, 100,000 of them at issue 5's scale.
    is_taken = SampleBits(rows, samples_per_prompt)
    taken: dict[tuple[int, int], Place | None] = {}  # (row index, sample index) -> the outcome it took

    def take(p: int, row: Row, s: int, place: Place | None) -> None:
        is_taken.set(p, s)
        if with_places:
            taken[row.index, s] = place

    def wants() -> Iterator[tuple[int, Row, int, str]]:
        """Each sample not matched yet whose (identity, sample index) has outcomes left, in dataset order."""
        for p, row in enumerate(rows):
            key = row.saved_key(redact)
            for s in range(samples_of(row, samples_per_prompt)):
                if not is_taken[p, s] and done[key, s] > 0:
                    yield p, row, s, key

    def stage(of_place: Callable[[Place], Any], of_want: Callable[[Row, int, str, str | None], Any]) -> None:
        """Each row not matched yet takes a place whose ``of_place`` is its ``of_want`` (None: none)."""
        index: dict[Any, list[Place]] = collections.defaultdict(list)
        for place in sorted((p for p in places if places[p] > 0), key=_place_order):
            sig = of_place(place)
            if sig is not None:
                index[sig].append(place)
        if not index:
            return
        for p, row, s, key in wants():
            held = index.get(of_want(row, s, key, row_fields_digest(row, redact)))
            while held and places[held[-1]] <= 0:
                held.pop()  # taken already
            if held:
                place = held.pop()
                places[place] -= 1
                done[key, s] -= 1
                take(p, row, s, place)

    def said_occurrence(sig: tuple[Any, ...], place: Place) -> tuple[Any, ...] | None:
        return sig if place[4] is not None else None

    # Its own fields and occurrence: the outcome it would write again (its own line's first). Looked up
    # as it is (a place is its own signature here), so no index of every place is built for it.
    for p, row in enumerate(rows):
        key = row.saved_key(redact)
        for s in range(samples_of(row, samples_per_prompt)):
            if own is not None and own.bits[p, s]:
                is_taken.set(p, s)  # in no ``taken``: its row's own place, the one it would write again
                continue
            if done[key, s] <= 0 or row.occurrence is None:
                continue
            at = own_place(row, s, redact)
            if places.get(at, 0) > 0:
                places[at] -= 1
                done[key, s] -= 1
                take(p, row, s, at)
    stage(lambda p: said_occurrence((*p[:2], *p[3:]), p), lambda r, s, k, f: (k, s, f, r.occurrence))
    stage(lambda p: p[:4], lambda r, s, k, f: (k, s, r.index, f))  # its own line and fields
    stage(lambda p: (*p[:2], p[3]), lambda r, s, k, f: (k, s, f))  # its fields, at a line it moved from
    stage(lambda p: p[:3], lambda r, s, k, f: (k, s, r.index))  # its own line, its fields since edited
    # Its own occurrence, its fields edited and the rows moved.
    stage(lambda p: said_occurrence((*p[:2], p[4]), p), lambda r, s, k, f: (k, s, r.occurrence))
    left: list[Sample] = []
    for p, row in enumerate(rows):  # the rest by content, in dataset order
        key = row.saved_key(redact)
        for s in range(samples_of(row, samples_per_prompt)):
            if is_taken[p, s]:
                continue
            if done[key, s] > 0:
                done[key, s] -= 1
                take(p, row, s, None)
            else:
                left.append((row, s))
    spare: dict[tuple[str, int], list[Place]] = collections.defaultdict(list)
    if with_places:
        for place, n in sorted(places.items(), key=lambda item: _place_order(item[0])):
            if n > 0:
                spare[place[0], place[1]].append(place)
    return Matched(left, taken, dict(spare))


def all_samples(rows: list[Row], samples_per_prompt: int) -> list[Sample]:
    """Every sample of every row (a new run)."""
    return [(row, s) for row in rows for s in range(samples_of(row, samples_per_prompt))]


class CheckedFiles:
    """The batch files the resume scan read, each with the byte offsets of its lines that are not valid
    records and the file's state as the scan found it (device, inode, size, modification and change
    times, the same before and after its read). The merge takes every other line of a file still in that
    state as valid without checking it again (``valid_record`` a second time was ~16 us a record of a
    resume's merge); a file changed since (a hand edit, or one the run appended to) is checked line by
    line, as before. What the merge keeps is the same either way.

    With them, the valid records the scan counted in each batch file (``per_batch``) and their
    :data:`~batchrun.identity.Line`\\ s (``finished_at``, only beside a discarded.jsonl that holds rows,
    which is all superseded_discards matches them to): checkpoint.json's batch_stats start from them
    (recorder.count_outcomes), so a resume's first checkpoint does not read every batch file again."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[tuple[int, ...], frozenset[int]]] = {}
        self.per_batch: collections.Counter[int] = collections.Counter()
        self.finished_at: collections.Counter[Line] = collections.Counter()

    def add(self, path: Path, before: os.stat_result, invalid: list[int]) -> None:
        """``path`` read whole, with ``invalid`` the offsets of its lines that are not valid records;
        ``before``: its state when the read began (a file changed meanwhile is not held)."""
        state = _file_state(path)
        if state is not None and state == _file_state(path, before):
            self._files[str(path)] = (state, frozenset(invalid))

    def take_counts(self) -> tuple[collections.Counter[int], collections.Counter[Line]]:
        """``per_batch`` and ``finished_at``, no longer held here (a Line a record: the merge counts its own)."""
        counts = self.per_batch, self.finished_at
        self.per_batch, self.finished_at = collections.Counter(), collections.Counter()
        return counts

    def invalid_lines(self, path: Path) -> frozenset[int] | None:
        """The offsets of ``path``'s lines that are not valid records, or None when the scan did not read
        the file as it is now (every line to be checked)."""
        held = self._files.get(str(path))
        if held is None or _file_state(path) != held[0]:
            return None
        return held[1]


def _file_state(path: Path, st: os.stat_result | None = None) -> tuple[int, ...] | None:
    try:
        st = st or os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def scan_finished(
    run_dir: Path,
    *,
    rerun_discarded: bool,
    at: collections.Counter[Place] | None = None,
    checks: Checks | None = None,
    stop_after_passes: int | None = None,
    exclude_partial: bool = False,
    passes: collections.Counter[PassKey] | None = None,
    in_round: int | None = None,
    checked: CheckedFiles | None = None,
    own: OwnPlaces | None = None,
) -> collections.Counter[tuple[str, int]]:
    """(row identity, sample index) -> number of finished outcomes (trajectories, and discards unless
    re-run; re-run in the rerun round ``in_round``, those it wrote). Lines of the wrong shape are
    skipped, as torn lines are. ``at`` is given the same outcomes by (identity, sample index, prompt
    index), for :func:`match_outcomes`; ``checks`` each row identity's ``row_fields`` texts its finished
    outcomes were judged with, and the dataset lines (prompt indices) that wrote them, for
    :func:`changed_checks`.

    With ``stop_after_passes`` (K) a sample skipped after its row's passes (``skipped_after_passes``) is
    finished only while its row has K kept passes: a resume that raises K runs it (an earlier run's
    smaller K skipped it); ``exclude_partial``: partial passes are not kept ones. ``passes`` is given
    each row's kept passes (by :data:`PassKey`); ``checked`` the files read and their lines that are not valid
    records, for the merge. ``own`` (:class:`OwnPlaces`) is given a bit for each record at its row's own
    place, which then is in none of ``done``, ``at`` and ``checks`` (:func:`match_outcomes` takes it as
    ``own``; judged with the row's fields as they are, it has no other check to compare)."""
    done: collections.Counter[tuple[str, int]] = collections.Counter()
    if passes is None:
        passes = collections.Counter()
    # The records' Lines matter to the checkpoint's counts only beside discards (superseded_discards):
    # without any, none is held (~200 bytes a record).
    lines = checked is not None and lines_matter(run_dir / "discarded.jsonl")
    for num, path in batch_files(run_dir):
        try:
            before = os.stat(path)
        except OSError:  # gone since it was listed: nothing of it is finished
            continue
        invalid: list[int] = []
        for offset, _, rec in iter_jsonl_at(path):
            if not valid_record(rec):
                invalid.append(offset)
            else:
                key = record_sample(rec)
                index = rec.get("prompt_index")
                counted = False  # at its row's own place, counted as a bit of ``own``
                if is_index(index) and (at is not None or lines):
                    meta = rec.get("metadata")
                    occurrence = occurrence_in(meta)
                    if at is not None:
                        place = place_of(key, index, row_fields_of(meta), occurrence)
                        counted = own is not None and own.add(place) is not None
                        if not counted:
                            at[place] += 1
                    if lines:
                        checked.finished_at[(*key, index, occurrence)] += 1  # identity.kept_line
                if not counted:
                    done[key] += 1
                if checked is not None:
                    checked.per_batch[num] += 1
                if checks is not None and not counted:
                    _add_check(checks, key[0], rec.get("metadata"), rec.get("prompt_index"))
                if stop_after_passes and kept_pass(rec, exclude_partial):
                    passes[pass_key(key[0], row_fields_of(rec.get("metadata")))] += 1
        if checked is not None:
            checked.add(path, before, invalid)
    counts = still_skipped(passes, stop_after_passes)
    add_discards(
        run_dir, done, rerun_discarded=rerun_discarded, at=at, checks=checks, counts=counts, in_round=in_round
    )
    return done


def kept_pass(rec: dict[str, Any], exclude_partial: bool) -> bool:
    """Whether a batch file's record is a kept pass of its row, as --stop_after_passes counts them
    (``exclude_partial``: a partial one is not kept)."""
    return read_score(rec.get("score")).get("passed") is True and not (exclude_partial and rec.get("partial"))


def still_skipped(
    passes: collections.Counter[PassKey], stop_after_passes: int | None
) -> Callable[[dict[str, Any]], bool]:
    """A discarded.jsonl row -> whether it finishes its sample: a sample skipped after its row's passes
    (``skipped_after_passes``) only while its row (``passes``: :data:`PassKey` -> kept passes) has
    ``stop_after_passes`` of them; a resume that raised it runs the sample."""

    def counts(row: dict[str, Any]) -> bool:
        if row["reason"] != SKIPPED_AFTER_PASSES or not stop_after_passes:
            return True
        return passes[pass_key(outcome_sample(row)[0], outcome_row_fields(row))] >= stop_after_passes

    return counts


def row_fields_of(fields: Any) -> Any:
    """The ``row_fields`` text a record's metadata or an outcome row holds (None: none, or another shape)."""
    return fields.get("row_fields") if isinstance(fields, dict) else None


def occurrence_in(fields: Any) -> int | None:
    """The ``occurrence`` a record's metadata or an outcome row holds (None: none, or another shape)."""
    return occurrence_of(fields) if isinstance(fields, dict) else None


def outcome_row_fields(row: dict[str, Any]) -> Any:
    """The ``row_fields`` a discarded.jsonl row was written with: its own, else its record's (a record the
    merge set aside, ``unknown_tool``, was written without them, and stays in its batch file: both are one
    outcome of one place)."""
    fields = row.get("row_fields")
    record = row.get("record")
    return (
        fields
        if isinstance(fields, str) or not isinstance(record, dict)
        else row_fields_of(record.get("metadata"))
    )


def _add_check(checks: Checks, key: str, fields: Any, prompt_index: Any) -> None:
    """Notes the ``row_fields`` an outcome was judged with, and its line; records older than the field hold none."""
    if isinstance(fields, dict) and isinstance(fields.get("row_fields"), str):
        lines = checks.setdefault(key, {}).setdefault(fields["row_fields"], set())
        if is_index(prompt_index):
            lines.add(prompt_index)


def add_discards(
    run_dir: Path,
    done: collections.Counter[tuple[str, int]],
    *,
    rerun_discarded: bool,
    at: collections.Counter[Place] | None = None,
    checks: Checks | None = None,
    counts: Callable[[dict[str, Any]], bool] | None = None,
    in_round: int | None = None,
) -> None:
    """Discarded samples count as finished unless --rerun_discarded (they cost money to redo); with it,
    those its rerun round ``in_round`` wrote do (the round ran them again: continued, it does not run
    them once more). ``counts`` may leave some out (a discard row -> whether it finishes its sample)."""
    discards = run_dir / "discarded.jsonl"
    if discards.exists() and (not rerun_discarded or in_round is not None):
        for rec in iter_jsonl(discards):
            if (
                valid_outcome_row(rec, "reason")
                and (counts is None or counts(rec))
                and (not rerun_discarded or round_of(rec) == in_round)
            ):
                key = outcome_sample(rec)
                done[key] += 1
                if at is not None and is_index(rec.get("prompt_index")):
                    at[place_of(key, rec["prompt_index"], outcome_row_fields(rec), occurrence_in(rec))] += 1
                if checks is not None:
                    _add_check(checks, key[0], rec, rec.get("prompt_index"))


_ROUND_FIELD_TEXT = re.compile(re.escape(f'"{ROUND_FIELD}"').encode())  # rows naming a round


def latest_round(run_dir: Path) -> dict[str, Any] | None:
    """checkpoint.json's ``rerun_round``: the latest round and whether it finished; None when it holds
    none (no --rerun_discarded yet, a checkpoint written before rounds, or damaged)."""
    value = (read_json_object(run_dir / "checkpoint.json") or {}).get(ROUND_FIELD)
    if not isinstance(value, dict) or not is_index(value.get("round")) or value["round"] < 1:
        return None
    return {"round": value["round"], "finished": value.get("finished") is not False}


def rerun_round(run_dir: Path, state: dict[str, Any] | None) -> tuple[int, bool]:
    """The round a --rerun_discarded invocation runs, and whether it continues it: the latest round
    checkpoint.json names, while it is open (started, and not every discard it was to run again has an
    outcome from it: stopped, killed, or some failed); else a new one, after every round there
    (checkpoint.json's, or the highest a discard row names, should the checkpoint be lost): it runs
    every discard again. Discards of no round (older runs, runs without the flag) are run by either.
    ``state``: checkpoint.json's latest round as :func:`latest_round` read it (the caller has it)."""
    tagged = iter_jsonl(run_dir / "discarded.jsonl", only=_ROUND_FIELD_TEXT)
    latest = max((n for row in tagged if isinstance(row, dict) and (n := round_of(row))), default=0)
    if state is not None and not state["finished"] and state["round"] >= latest:
        return state["round"], True
    return max(latest, state["round"] if state else 0) + 1, False


CHECK_FIELDS = ("answer", "verify", "verify_files", "rubric")


def changed_checks(
    rows: list[Row], checks: Checks, redact: Redactor, matched: Matched, samples_per_prompt: int = 1
) -> list[tuple[Row, str]]:
    """The rows whose finished samples were judged against another ``answer``, ``verify``,
    ``verify_files`` or ``rubric`` than the row holds now (the check is not part of a row's identity:
    a resume would keep those samples' scores, judged against the old values). Each with the fields
    that differ. A row's samples are the outcomes ``matched`` (:func:`match_outcomes`) gave it, as the
    merge keeps them: an outcome of its line that another row, removed or moved since, wrote with its
    own check is not the row's (the row still there takes the one it wrote). Identical rows that took
    outcomes by content alone get those no row took: if there are as many, one each (its own check's if
    one has it); if more, each row is judged against every one, since the merge keeps the first in its
    files."""
    memo: dict[str | None, RowCheck | None] = {}

    def check_of(text: str | None) -> RowCheck | None:
        text = text or "{}"
        if text not in memo:
            memo[text] = check_from_row_fields(text)
        return memo[text]

    # The row_fields text of each outcome's place; an outcome without one (older records) says nothing.
    texts = {fields_digest(t): t for by_text in checks.values() for t in by_text}
    differ: dict[int, set[str]] = collections.defaultdict(set)  # row index -> the check fields that differ

    def compare(row: Row, now: RowCheck | None, place: Place) -> None:
        then = check_of(texts[place[3]])
        differ[row.index] |= {f for f in CHECK_FIELDS if _field(then, f) != _field(now, f)}

    by_content: dict[tuple[str, int], list[tuple[Row, RowCheck | None]]] = collections.defaultdict(list)
    for row in rows:
        key = row.saved_key(redact)
        if key not in checks:
            continue
        now = check_of(redact(row.row_fields) if row.row_fields else None)
        for s in range(samples_of(row, samples_per_prompt)):
            if (row.index, s) not in matched.taken:
                continue  # not finished: it runs now, against the check it holds
            place = matched.taken[row.index, s]
            if place is None:  # taken by content: one of the outcomes no row took
                by_content[key, s].append((row, now))
            elif place[3] in texts:
                compare(row, now, place)
    for (key, s), takers in by_content.items():
        known = [p for p in matched.spare.get((key, s), []) if p[3] in texts]
        if len(known) > len(takers):
            # The merge keeps the first of them in its files, which no place tells: each row is judged
            # against every one it may get (given the one with its own check, a row kept one judged
            # against another: the first in the files, of a removed near-twin).
            for row, now in takers:
                for place in known:
                    compare(row, now, place)
            continue
        for row, now in takers:  # the merge keeps each of them: one each, its own check's if one has it
            same = [p for p in known if check_of(texts[p[3]]) == now]
            if same or known:
                place = (same or known)[0]
                known.remove(place)
                compare(row, now, place)
    return [
        (row, ", ".join(f for f in CHECK_FIELDS if f in differ[row.index]))
        for row in rows
        if differ.get(row.index)
    ]


def _field(check: RowCheck | None, name: str) -> Any:
    return getattr(check, name) if check is not None else getattr(RowCheck(), name)


def resume_filter(
    rows: list[Row],
    run_dir: Path,
    redact: Redactor,
    *,
    rerun_discarded: bool,
    samples_per_prompt: int = 1,
    force: bool = False,
    dataset_file: str = "the dataset",
    stop_after_passes: int | None = None,
    exclude_partial: bool = False,
    rerun: set[tuple[int, int]] | None = None,
    in_round: int | None = None,
    checked: CheckedFiles | None = None,
) -> list[Sample]:
    """The samples with no finished outcome yet, counting duplicates per (identity, sample index).
    ``rerun``, with ``rerun_discarded``: given the (row index, sample index) of those that run again
    because they were discarded (a resume without the flag would not run them). ``in_round``: the rerun
    round this invocation continues (:func:`rerun_round`): the discards it wrote are finished.
    ``checked``: given the batch files the scan read (:class:`CheckedFiles`), for the merge.

    A row whose finished samples were judged against another check (answer, verify, ...) stops the
    resume (UsageError) unless ``force`` (--force_resume): their scores would stand for the old check."""
    at: collections.Counter[Place] = collections.Counter()
    checks: Checks = {}
    passes: collections.Counter[PassKey] = collections.Counter()
    own = OwnPlaces(rows, samples_per_prompt, redact)  # nearly every outcome: a bit, not a place
    done = scan_finished(
        run_dir,
        rerun_discarded=rerun_discarded,
        at=at,
        checks=checks,
        stop_after_passes=stop_after_passes,
        exclude_partial=exclude_partial,
        passes=passes,
        in_round=in_round,
        checked=checked,
        own=own,
    )
    again = rerun is not None and rerun_discarded  # the counts are used again below
    matched = match_outcomes(rows, done, redact, samples_per_prompt, at, consume=not again, own=own)
    changed = changed_checks(rows, checks, redact, matched, samples_per_prompt)
    if changed:
        shown = "; ".join(f"line {row.index + 1}: {fields}" for row, fields in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        what = (
            f"{len(changed)} row(s) of {dataset_file} changed how their samples are judged since those "
            f"samples were scored ({shown}{more}): their scores judge the old values"
        )
        if not force:
            raise UsageError(
                f"--resume: {what}. Restore the old values, or start a new --run_name to score every "
                "sample against the new ones, or add --force_resume to keep the old scores (then re-score "
                f"the run's text scorers with: python -m batchrun.views.score {shlex.quote(str(run_dir))} "
                "--scorer=...)"
            )
        print(f"warning: {what}; kept as they are (--force_resume)", file=sys.stderr)
    todo = matched.left
    if again:
        # The same outcomes with the discards: the samples a resume without the flag would leave (the
        # round's own discards are in already).
        skipped = still_skipped(passes, stop_after_passes)
        add_discards(
            run_dir,
            done,
            rerun_discarded=False,
            at=at,
            counts=lambda row: skipped(row) and (in_round is None or round_of(row) != in_round),
        )
        left = match_outcomes(rows, done, redact, samples_per_prompt, at, own=own).left
        rerun |= {(row.index, s) for row, s in todo} - {(row.index, s) for row, s in left}
    total = sum(samples_of(r, samples_per_prompt) for r in rows)
    unit = "prompt(s)" if total == len(rows) else "sample(s)"  # one sample per row: as before samples existed
    print(f"Resume: {total - len(todo)} {unit} already finished, {len(todo)} to run")
    return todo


# The words of the command line that started this process's run (set by batchrun.cli.cli while it runs);
# None for a run started from Python (main(...), BatchRunner(...).run()), whose sys.argv is its caller's.
COMMAND_LINE: list[str] | None = None
FROM_PYTHON = "the same call with resume=True (BatchRunner(...).run(resume=True), or main(..., resume=True))"


def resume_command(argv: list[str] | None = None) -> str:
    """The command that continues this run: the remaining samples, as ``remaining_for_resume`` counts
    them. Without --rerun_discarded (the discards this invocation re-ran have their outcome: kept, it
    would run every discard once more and pay for them again) and without the API key (it comes from
    the environment).

    A run started from Python gets the call to make instead: its process's arguments are its script's
    (``python gen.py --shard=3`` was shown as ``python batch_runner.py --shard=3 --resume``)."""
    if argv is None and COMMAND_LINE is None:
        return FROM_PYTHON
    return _continue_command(COMMAND_LINE if argv is None else argv, ["--resume"])


EPHEMERAL_NOT_SHOWN = (
    "  # and the same --ephemeral_system_prompt (its text is not shown: give it again, or as "
    "--ephemeral_system_prompt_file or BATCH_RUNNER_EPHEMERAL_SYSTEM_PROMPT)"
)


def _continue_command(words: list[str], flags: list[str]) -> str:
    """The command line ``words`` without the API key, --resume and --rerun_discarded, with ``flags``.
    A text --ephemeral_system_prompt is left out and named in a shell comment after the command: the
    summary's redaction made it '--ephemeral_system_prompt=[REDACTED]', which the resume refused (another
    prompt), and with --force_resume sent the model "[REDACTED]" as its system prompt."""
    args = _without(without_api_key(words), ("resume", "rerun_discarded"))
    args, ephemeral = without_flag(args, "ephemeral_system_prompt")
    kept = [shlex.quote(arg) for arg in args]
    # The installed command (batch_runner.py is not installed), else the file users know.
    program = ["batch-runner"] if Path(sys.argv[0]).name == "batch-runner" else ["python", "batch_runner.py"]
    return " ".join([*program, *kept, *flags]) + (EPHEMERAL_NOT_SHOWN if ephemeral else "")


def rerun_command() -> str:
    """:func:`resume_command` with --rerun_discarded: continues the open rerun round (the discards it
    did not run again yet), else starts a new one (every discard runs again)."""
    if COMMAND_LINE is None:
        return "the same call with resume=True and rerun_discarded=True"
    return _continue_command(COMMAND_LINE, ["--resume", "--rerun_discarded"])


def _without(args: list[str], bool_flags: tuple[str, ...]) -> list[str]:
    """``args`` without the boolean flags named, in each form the command line takes them (as
    :func:`batchrun.config.parse_argv` reads them): ``--name``, ``--name=VALUE``, ``--name VALUE``
    (a true or false word), ``--noname``, dashes for underscores."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        name, eq, _ = arg.partition("=")
        name = name[2:].replace("-", "_") if name.startswith("--") else ""
        if name.startswith("no") and name[2:] in bool_flags and not eq:
            continue
        if name in bool_flags:
            if not eq and i < len(args) and args[i].strip().lower() in (*TRUE_WORDS, *FALSE_WORDS):
                i += 1  # its value, the next argument
            continue
        out.append(arg)
    return out


def without_api_key(argv: list[str] | None = None) -> list[str]:
    """The command line's arguments (``argv``, else this process's) without --api_key and its value,
    for a command shown to others: the key comes from the environment."""
    return without_flag(sys.argv[1:] if argv is None else argv, "api_key")[0]


def without_flag(args: list[str], flag: str, instead: str | None = None) -> tuple[list[str], bool]:
    """``args`` without the flag ``flag`` (its name with underscores) and its value, in each form the
    command line takes it (as parse_argv reads it: ``--flag=VALUE``, ``--flag VALUE``, dashes for
    underscores), ``instead`` in its place where given, and whether it was there."""
    kept, found, skip_next = [], False, False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        name, eq, _ = arg.partition("=")
        if name.startswith("--") and name[2:].replace("-", "_") == flag:
            found, skip_next = True, not eq  # "--flag VALUE" is two arguments
            if instead is not None:
                kept.append(instead)
            continue
        kept.append(arg)
    return kept, found


# Manifest settings that no flag gives: what restores them.
DERIVED = {
    "distribution_probabilities": "(the distribution's probabilities of the first run: its --distribution_file as it was)",
    "known_tools": "(the tools installed for the first run: the same plugins and --mcp_config)",
}


def _flag(name: str, value: Any) -> str:
    """A manifest setting as the command-line flag that reproduces it (a setting no flag gives, the words
    that say what does: a suggested --distribution_probabilities=... was refused as an unknown flag)."""
    if name in DERIVED:
        return DERIVED[name]
    if name.endswith("_sha256"):  # the text itself is a secret and is not stored
        flag = {"prefill_sha256": "prefill_messages_file"}.get(name, name.removesuffix("_sha256"))
        return f"--{flag}=<the original, sha256 {value[:12]}...>" if value else f"(no --{flag})"
    if isinstance(value, bool):
        return f"--{name}" if value else f"--{name}=False"
    if value is None:  # not given (--max_tokens=None is no value a flag takes)
        return f"(no --{name})"
    if isinstance(value, list):  # --scorer, --answer_normalize: comma-separated
        return f"--{name}={shlex.quote(','.join(map(str, value)) or ('none' if name == 'answer_normalize' else 'auto'))}"
    return f"--{name}={shlex.quote(str(value))}"


def judge_url(config: RunConfig) -> str | None:
    """The judge's endpoint as the manifest records it (:func:`batchrun.scoring.judge_endpoint`: no login,
    query or fragment), as a re-scoring's ``judge_base_url`` does: --judge_base_url, else the run's
    --base_url; None without a judge, or when the judge is the built-in fake (``--model=mock``, no
    --judge_base_url: its port is another each run)."""
    if not config.judge_model or (config.is_mock and config.judge_base_url is None):
        return None
    return judge_endpoint(config.judge_base_url or config.base_url)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
