"""A dataset row's identity, in one place: what makes two rows the same row, and what is derived from it.

A row is its prompt text, its ``image`` and ``cwd``, and its own run settings (``toolsets``, ``tools``,
``system``, ``max_turns``: the records' ``row_*`` fields). Resume, merge, ``--stop_after_passes`` and the
views find a row's samples by the :attr:`RowIdentity.key` of these, one type built from a dataset row
or its job (:meth:`RowIdentity.of_row`, :meth:`~RowIdentity.of_job`), a saved record
(:meth:`~RowIdentity.of_record`) or a ``failed.jsonl`` / ``discarded.jsonl`` row
(:meth:`~RowIdentity.of_outcome_row`); an :class:`~batchrun.protocol.Outcome` carries its job's. A unit
of work is a sample: (row key, sample index).

The recorder writes each record's and outcome row's key (``metadata.row_key``, ``row_key``), computed
from the identity as saved (secrets redacted, as the saved text is): readers take that key when it has
a key's form, and compute it from the saved fields when it is missing (records of other tools).

Two seeds are derived from a row, each a deliberate choice kept as it was when it was made, so that
earlier runs resume with the same draws:

- the toolset draw (:func:`toolset_rng`): the run's ``--seed``, the prompt text, the row's occurrence
  among identical texts and the sample index. Not the image, cwd or options: rows that differ only in
  those draw alike, as they did before those fields existed.
- the request seed (:func:`request_seed_base`, ``--seed_per_request``): the run's seed, the whole
  identity (text, image, cwd, options), the occurrence and the sample index; the loop adds the turn.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchrun.record import identity_options, occurrence_of, optional_text, sample_index_of, valid_outcome_row
from batchrun.sharegpt import first_human
from batchrun.storage import iter_jsonl


@dataclass(frozen=True, slots=True)
class RowOptions:
    """A dataset row's own settings for its run; None: the run's (the distribution, --max_turns, no system prompt).

    They are part of the row's identity: two rows that differ only here are different work. Slotted:
    held by its row for the whole run (112 bytes with a ``__dict__``, 72 without).
    """

    toolsets: tuple[str, ...] | None = None  # offered instead of a draw from the distribution
    tools: tuple[str, ...] | None = None  # allowlist: only these tool names are offered
    system: str | None = None  # system prompt sent to the model and saved as the record's system turn
    max_turns: int | None = None  # instead of --max_turns


class DatasetRow(Protocol):
    """What identity reads of a dataset row (``batchrun.run.dataset.Row``) or a job made from one."""

    prompt: str
    image: str | None
    cwd: str | None
    options: RowOptions
    occurrence: int


class DatasetSample(DatasetRow, Protocol):
    """One sample of a row (``batchrun.protocol.PromptJob``): the row and which of its samples."""

    sample_index: int


def row_key(
    text: str, image: str | None = None, cwd: str | None = None, options: dict[str, Any] | None = None
) -> str:
    """A dataset row's identity: everything that defines how it runs, as hex.

    The prompt text, image and cwd, and the row's own settings (``options``: the ``row_*`` metadata
    fields, see ``batchrun.record.row_option_fields``). Two rows with the same text but another image,
    cwd, toolsets, tools, system prompt or max_turns are different rows for resume and merge. A field
    that is absent is ``None``: records of older versions match rows without them, and a row without
    settings of its own has the identity it had before those settings existed.
    """
    own = {k: v for k, v in (options or {}).items() if v is not None}
    payload = json.dumps(
        [text, image, cwd, own] if own else [text, image, cwd], ensure_ascii=False, sort_keys=True
    )
    return hashlib.blake2b(payload.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


KEY_CHARS = 32  # a key's length: 16 bytes of blake2b as hex


_KEY_FORM = re.compile(f"[0-9a-f]{{{KEY_CHARS}}}")


def is_key(value: Any) -> bool:
    """Whether ``value`` has the form of a :func:`row_key` (as a record's ``metadata.row_key`` holds it)."""
    return isinstance(value, str) and _KEY_FORM.fullmatch(value) is not None


@dataclass(frozen=True)
class RowIdentity:
    """What makes two dataset rows the same row: its text, image, cwd and own settings.

    The settings are held as the records' ``row_*`` fields hold them (the name lists sorted, the system
    prompt as its sha256), so the identity of a row, a job, an outcome, a saved record and a
    ``failed.jsonl`` / ``discarded.jsonl`` row is one type with one :attr:`key`. A row's identity as
    saved records give it back has its text, image and cwd redacted of secrets (:meth:`redacted`).
    """

    text: str
    image: str | None = None
    cwd: str | None = None
    toolsets: tuple[str, ...] | None = None  # the row's own toolsets, sorted
    tools: tuple[str, ...] | None = None  # the row's own tool allowlist, sorted
    system_sha256: str | None = None  # sha256 of the row's own system prompt
    max_turns: int | None = None  # the row's own max_turns
    # The key a saved record or outcome row carries (metadata.row_key / row_key): the recorder wrote it
    # from these same fields, so reading it back spares the hash and keeps it as it was written.
    saved_key: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of_job(cls, job: DatasetRow) -> RowIdentity:
        """A dataset row's (or its job's) identity, unredacted: what the worker runs (an Outcome carries it)."""
        opts = job.options
        return cls(
            job.prompt,
            job.image,
            job.cwd,
            None if opts.toolsets is None else tuple(sorted(opts.toolsets)),
            None if opts.tools is None else tuple(sorted(opts.tools)),
            None if opts.system is None else _sha256(opts.system),
            opts.max_turns,
        )

    @classmethod
    def of_row(cls, row: DatasetRow, redact: Callable[[str], str]) -> RowIdentity:
        """A row's identity as saved records give it back (secrets in its text, image and cwd redacted)."""
        return cls.of_job(row).redacted(redact)

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> RowIdentity:
        """The identity of the row a (valid, see ``valid_record``) record came from."""
        meta = record.get("metadata") or {}
        return cls._of_fields(first_human(record["conversations"]) or "", meta, meta.get("row_key"))

    @classmethod
    def of_outcome_row(cls, row: dict[str, Any]) -> RowIdentity:
        """The identity of a (valid) ``failed.jsonl`` or ``discarded.jsonl`` row."""
        return cls._of_fields(row["prompt"], row, row.get("row_key"))

    @classmethod
    def _of_fields(cls, text: str, fields: dict[str, Any], saved: Any) -> RowIdentity:
        opts = identity_options(fields)
        toolsets, tools = opts["row_toolsets"], opts["row_tools"]
        return cls(
            text,
            optional_text(fields.get("image")),
            optional_text(fields.get("cwd")),
            None if toolsets is None else tuple(toolsets),
            None if tools is None else tuple(tools),
            opts["row_system_sha256"],
            opts["row_max_turns"],
            saved_key=saved if is_key(saved) else None,
        )

    def redacted(self, redact: Callable[[str], str]) -> RowIdentity:
        """The identity as saved records hold it: its text, image and cwd redacted (``Redactor.sample``)."""
        return dataclasses.replace(
            self,
            text=redact(self.text),
            image=None if self.image is None else redact(self.image),
            cwd=None if self.cwd is None else redact(self.cwd),
            saved_key=None,
        )

    def options(self) -> dict[str, Any]:
        """The row's own settings as the ``row_*`` fields (lists or None) its key is computed from."""
        return {
            "row_toolsets": None if self.toolsets is None else list(self.toolsets),
            "row_tools": None if self.tools is None else list(self.tools),
            "row_system_sha256": self.system_sha256,
            "row_max_turns": self.max_turns,
        }

    def fields(self) -> dict[str, Any]:
        """The identity fields that records and outcome rows save beside the text: image, cwd, ``row_*``."""
        return {"image": self.image, "cwd": self.cwd, **self.options()}

    @property
    def key(self) -> str:
        """The identity as hex (:func:`row_key`); a saved record's own ``row_key`` when it holds one."""
        if self.saved_key is not None:
            return self.saved_key
        return row_key(self.text, self.image, self.cwd, self.options())


def record_sample(record: dict[str, Any]) -> tuple[str, int]:
    """(row identity, sample index) of a (valid) record: merge keeps one record per pair."""
    meta = record.get("metadata") or {}
    saved = meta.get("row_key")
    # The saved key is the identity's (RowIdentity.key): the rest of it is made only to be set aside,
    # half of what reading 100,000 records for a view cost beside their parsing.
    key = saved if is_key(saved) else RowIdentity.of_record(record).key
    return key, sample_index_of(meta)


def outcome_sample(row: dict[str, Any]) -> tuple[str, int]:
    """(row identity, sample index) of a (valid) discarded.jsonl or failed.jsonl row."""
    return RowIdentity.of_outcome_row(row).key, sample_index_of(row)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def prompt_rng(seed: int, prompt: str, occurrence: int = 0) -> random.Random:
    """A Random fixed by (seed, prompt text, occurrence), so reruns and resumes draw the same toolsets.

    `occurrence` tells apart repeated copies of the same prompt text in one dataset. sha256
    rather than hash() keeps the result independent of PYTHONHASHSEED.
    """
    digest = hashlib.sha256(f"{seed}\0{occurrence}\0{prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def toolset_rng(seed: int, row: DatasetRow, sample_index: int) -> random.Random:
    """The toolset draw's Random for one sample, fixed by (seed, row text, occurrence, sample index).

    Sample 0 draws exactly what runs before samples existed drew, so their resumes offer the same.
    """
    if sample_index == 0:
        return prompt_rng(seed, row.prompt, row.occurrence)
    digest = hashlib.sha256(f"{seed}\0{row.occurrence}\0{sample_index}\0{row.prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def request_seed_base(run_seed: int, job: DatasetSample) -> int:
    """The base of a sample's request seeds: fixed by the run's seed, the row's identity (text, image,
    cwd, own settings), its occurrence among identical rows and the sample index; the loop adds the turn."""
    payload = json.dumps(
        [
            run_seed,
            job.prompt,
            job.image,
            job.cwd,
            dataclasses.asdict(job.options),
            job.occurrence,
            job.sample_index,
        ],
        ensure_ascii=False,
        sort_keys=True,
    )
    return int.from_bytes(hashlib.sha256(payload.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def is_index(value: Any) -> bool:
    """Whether ``value`` is a dataset line's index as records and outcome rows hold it (an int, no bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


# A kept record's or a discard's line: (row identity, sample index, dataset line, the row's occurrence
# among rows of its prompt text, None when the record does not say: written before it was saved).
Line = tuple[str, int, int, int | None]


def kept_line(record: dict[str, Any]) -> Line | None:
    """The :data:`Line` of a kept record, the key :func:`superseded_discards` matches a discard of the same
    sample at the same line by; None for a record of another shape (no line to match a discard to)."""
    index = record.get("prompt_index")
    if not is_index(index):
        return None
    try:
        meta = record.get("metadata")
        return (*record_sample(record), index, occurrence_of(meta) if isinstance(meta, dict) else None)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def outcome_line(row: dict[str, Any]) -> Line:
    """The :data:`Line` of a (valid) discarded.jsonl or failed.jsonl row with a ``prompt_index``."""
    return (*outcome_sample(row), row["prompt_index"], occurrence_of(row))


MERGE_SET_ASIDE = ("unknown_tool",)  # discards the merge writes of records that stay in their batch files


def lines_matter(path: Path) -> bool:
    """Whether :func:`superseded_discards` needs the kept records' :data:`Line`\\ s to judge discarded.jsonl
    (``path``): only when it holds a row already. A discard the merge writes afterwards (``unknown_tool``,
    :data:`MERGE_SET_ASIDE`) is judged without them. Without discards none is held: ~200 bytes a record,
    20 MB at 100,000 records, for each holder (the merge's counts, the report's)."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


# A valid discarded.jsonl row as counting and superseding need it, without its record: (its position
# among the file's non-blank lines, its Line (None: no prompt_index), whether the merge set it aside
# (MERGE_SET_ASIDE), its batch_num as written, its reason).
DiscardRow = tuple[int, "Line | None", bool, Any, str]


def read_discards(path: Path) -> tuple[list[DiscardRow], int]:
    """discarded.jsonl's valid rows (:data:`DiscardRow`), and how many of its lines are not (torn, or of
    another shape): one pass for both :func:`superseded_among` and the counts (the run's end read the
    file once for each)."""
    rows: list[DiscardRow] = []
    invalid = 0
    for n, rec in enumerate(iter_jsonl(path)):
        if not valid_outcome_row(rec, "reason"):
            invalid += 1
            continue
        at = outcome_line(rec) if is_index(rec.get("prompt_index")) else None
        rows.append((n, at, rec["reason"] in MERGE_SET_ASIDE, rec.get("batch_num"), rec["reason"]))
    return rows, invalid


def superseded_discards(path: Path, finished_at: Mapping[Line, int]) -> set[int]:
    """:func:`superseded_among` discarded.jsonl (``path``)'s rows."""
    return superseded_among(read_discards(path)[0], finished_at)


def superseded_among(rows: list[DiscardRow], finished_at: Mapping[Line, int]) -> set[int]:
    """The discarded.jsonl rows (their positions among its non-blank lines) that no longer stand for their
    sample: one dataset line's sample ran again (--rerun_discarded, or a resume that raised
    --stop_after_passes) and then was kept (a batch file holds it at that line) or discarded again (a
    later row). Counted as they are, a sample discarded and then kept showed in the discards too.
    Identical rows (another occurrence) that wrote at one line after the rows moved are other samples;
    a row or record that does not say its occurrence (written before it was saved) is taken for any.
    ``rows``: :func:`read_discards`'."""
    last: dict[Line, int] = {}
    last_at_line: dict[tuple[str, int, int], int] = {}
    kept_at_line: collections.Counter[tuple[str, int, int]] = collections.Counter()
    for (key, s, line, _), n in finished_at.items():
        kept_at_line[key, s, line] += n
    for n, at, _, _, _ in rows:
        if at is not None:
            last[at] = last_at_line[at[:3]] = n

    def superseded(n: int, at: Line, set_aside: bool) -> bool:
        if at[3] is None:
            return last_at_line[at[:3]] != n or (not set_aside and kept_at_line[at[:3]] > 0)
        kept = finished_at.get(at, 0) + finished_at.get((*at[:3], None), 0)
        return last[at] != n or (not set_aside and kept > 0)

    return {n for n, at, set_aside, _, _ in rows if at is not None and superseded(n, at, set_aside)}
