"""The dataset: one JSONL file read once; each good line a :class:`Row`, each bad line a message.

A row's identity is everything that defines its run (its text, image, cwd and its own toolsets,
tools, system prompt and max_turns: see ``batchrun.prompt.trajectory.row_key``); resume and the
merge count finished samples by it, duplicates included.

A row's own settings, each optional: ``toolsets`` (a list of toolset names, offered instead of a
draw from the distribution), ``tools`` (a list of tool names: only these are offered; without
``toolsets``, exactly these), ``system`` (a system prompt, saved as the record's system turn),
``max_turns`` and ``samples`` (positive integers, instead of --max_turns and --samples_per_prompt).
A name no installed toolset or tool has, or a value of the wrong type, makes the line a bad line.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from batchrun.config import MAX_TURNS, UsageError
from batchrun.protocol import RowCheck, RowOptions
from batchrun.record import ROW_RUN_FIELDS, row_fields_text, row_id_text
from batchrun.sharegpt import strict_json
from batchrun.storage import not_a_file

MAX_SAMPLES_PER_ROW = 10_000
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1 control characters
# A dataset line longer than this is skipped unread: no model's context takes a prompt of that size,
# and a line is held several times over while it is parsed, checked and sent to the workers (a 500 MB
# line took 4.6 GB of this machine's memory).
MAX_LINE_BYTES = 32 * 1024 * 1024
# Bad lines past this many are counted, not listed: a file of millions of them ("x" a line) held a message
# for each (10 MB of such lines took 700 MB of this machine's memory; 100 MB would take 7 GB).
MAX_BAD_LINES_LISTED = 1000


class BadLines(list[str]):
    """The messages of the first MAX_BAD_LINES_LISTED bad lines (``file:line: reason``); ``total`` counts them all."""

    total: int = 0

    def add(self, message: str) -> None:
        self.total += 1
        if len(self) < MAX_BAD_LINES_LISTED:
            self.append(message)


# A row without settings of its own (most rows) holds this one instance: RowOptions is frozen and
# compared by value, and an instance a row took 104 bytes (10 MB of 100,000 rows).
NO_OPTIONS = RowOptions()


class _SavedKeySlot:
    """The slot :meth:`Row.saved_key` keeps its (redactor, key) in: no field, so no part of the row's
    init, eq, hash, repr, replace or pickled state (the redactor holds the run's secrets)."""

    __slots__ = ("_saved_key",)


@dataclasses.dataclass(frozen=True, slots=True)
class Row(_SavedKeySlot):
    """One usable dataset line. Slotted: with a ``__dict__`` a row and its saved key took 280 bytes
    besides its texts, slotted 176 (100,000 rows: 28 MB, now 17.6 MB)."""

    index: int  # 0-based line number in the dataset file: stable whatever else is skipped
    prompt: str
    image: str | None
    cwd: str | None
    occurrence: int  # how many earlier rows hold the same prompt text
    row_fields: str | None = None  # the row's other fields (id, answer, ...) as JSON text; None when none
    row_id: str | None = None  # the row's ``id`` as a string, when it has one
    options: RowOptions = NO_OPTIONS  # the row's own toolsets, tools, system prompt, max_turns
    samples: int | None = None  # the row's own ``samples`` (None: --samples_per_prompt)
    check: RowCheck | None = None  # answer / verify / verify_files / rubric (batchrun.scoring); None: none

    def saved_key(self, redact: Callable[[str], str]) -> str:
        """The row's identity as saved records hold it (``RowIdentity.of_row(row, redact).key``), worked out
        once per redactor: resume, merge and statistics each ask it of every row (three to five times a
        row at a run's end, a tenth of a 20,000-row resume's CPU). Held on the row, so it goes with it."""
        held = getattr(self, "_saved_key", None)  # the slot is unset until the first call
        if held is not None and held[0] == redact:
            return held[1]
        from batchrun.identity import RowIdentity

        key = RowIdentity.of_row(self, redact).key
        # One tuple, not a slot each: set at once, a second redactor's key never pairs with the first.
        object.__setattr__(self, "_saved_key", (redact, key))
        return key

    # A pickled (or copied) row is its fields only: no redactor (its secrets) goes along. Written out
    # rather than left to dataclasses, whose own (the same, fields only) replace these on Python 3.10.
    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for f, value in zip(dataclasses.fields(self), state, strict=True):
            object.__setattr__(self, f.name, value)


def tool_catalog() -> dict[str, tuple[str, ...]]:
    """Every installed tool name -> the toolsets that can offer it, from the tool registry (so toolsets
    that plugins register are known too)."""
    from batchrun.prompt.tools.catalog import all_tools

    return {t.name: (t.toolset, *t.also_in) for t in all_tools().values()}


def known_toolsets(catalog: Mapping[str, tuple[str, ...]]) -> set[str]:
    """Toolset names a row may ask for: those of installed tools and those the distributions name."""
    from batchrun.distributions import list_distributions

    names = {ts for sets in catalog.values() for ts in sets}
    for dist in list_distributions().values():
        names.update(dist.probabilities)
    return names


def load_dataset(
    path: str,
    max_samples: int | None = None,
    catalog: Mapping[str, tuple[str, ...]] | None = None,
    scorers: tuple[str, ...] = (),
) -> tuple[list[Row], BadLines]:
    """Read the JSONL dataset. Bad lines are reported by number and skipped; no usable row is an error.

    ``catalog``: tool name -> the toolsets that offer it (default: :func:`tool_catalog`), against which
    rows' ``toolsets`` and ``tools`` are checked. ``scorers`` (--scorer): a row's ``answer`` that the
    named scorer could never pass (no valid regex, no number) is a bad line.
    """
    catalog = tool_catalog() if catalog is None else catalog
    toolsets = known_toolsets(catalog)
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"dataset file {path}: {not_a_file(p)}")
    rows: list[Row] = []
    problems = BadLines()
    seen: collections.Counter[str] = collections.Counter()
    first = True  # no line but blank ones yet
    try:
        fh = p.open("rb")
    except OSError as exc:  # a file this user may not read (chmod 000): a traceback and exit 1 before
        raise UsageError(f"--dataset_file {path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        for line_no, raw in enumerate(_read_lines(fh, path), start=1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            if raw is None:
                problems.add(f"{path}:{line_no}: longer than {MAX_LINE_BYTES >> 20} MiB (skipped unread)")
                continue
            text = raw.lstrip(b"\xef\xbb\xbf").strip()
            if first and text == b"[":
                # A JSON array written one element a line ("[", '{...},' ..., '{...}', "]"): every line but
                # the last element's was a bad line, and that one row ran as if it were the dataset.
                raise UsageError(
                    f"--dataset_file {path}: line {line_no} opens a JSON array: the file is one JSON document, not "
                    f"JSON Lines (one object a line); convert it, e.g. jq -c '.[]' {path} > rows.jsonl"
                )
            first = first and not text
            problem, row = _parse_line(raw, line_no, seen, catalog, toolsets)
            if row and not problem:
                problem = _answer_problem(row.check, scorers)
            if problem:
                problems.add(f"{path}:{line_no}: {problem}")
            elif row:
                rows.append(row)
    if not rows:
        detail = f" ({problems.total} bad line(s); first: {problems[0]})" if problems else ""
        raise UsageError(f"dataset {path} has no usable rows{detail}")
    return rows, problems


def _answer_problem(check: RowCheck | None, scorers: tuple[str, ...]) -> str | None:
    """Why the row's ``answer`` cannot be judged by a scorer --scorer names for every row: every sample
    would be a scorer error (a pattern that does not compile) or a failure (no number to compare)."""
    if check is None or check.answer is None:
        return None
    from batchrun.scoring import acceptable, parse_number, passes_any_text, read_number

    for want in acceptable(check.answer):
        if "regex" in scorers:
            try:
                re.compile(str(want))
            except re.error as exc:
                return f"field 'answer' is not a valid regex for --scorer=regex ({exc}): {str(want)[:80]!r}"
            if passes_any_text(str(want)):
                return (
                    "field 'answer' is a regex found in any text, so it passes every answer, "
                    f"for --scorer=regex: {str(want)[:80]!r}"
                )
        if "numeric" in scorers and not isinstance(want, (int, float)) and parse_number(str(want)) is None:
            return f"field 'answer' holds no number for --scorer=numeric: {str(want)[:80]!r}"
        if "numeric" in scorers and not isinstance(want, (int, float)) and (why := read_number(str(want))[1]):
            return (
                f"field 'answer' {why}, for --scorer=numeric (acceptable answers are a JSON list): "
                f"{str(want)[:80]!r}"
            )
    return None


def _read_lines(fh: BinaryIO, path: str) -> Iterator[bytes | None]:
    """:func:`_lines`, a read error (EIO, a file on a lost network mount) a UsageError naming the file."""
    read = 0
    try:
        for raw in _lines(fh):
            read += 1
            yield raw
    except OSError as exc:
        raise UsageError(
            f"--dataset_file {path}: cannot read line {read + 1}: {exc.strerror or exc}"
        ) from None


def _lines(fh: BinaryIO) -> Iterator[bytes | None]:
    """The file's lines; None for one longer than MAX_LINE_BYTES, whose bytes are read past, not kept."""
    while raw := fh.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield None


def _parse_line(
    raw: bytes,
    line_no: int,
    seen: collections.Counter[str],
    catalog: Mapping[str, tuple[str, ...]],
    toolsets: set[str],
) -> tuple[str | None, Row | None]:
    if raw.startswith(b"\xef\xbb\xbf"):
        # A UTF-8 byte order mark is harmless; accept it on any line: ``cat a.jsonl b.jsonl`` puts the mark
        # of a file written on Windows at the start of a later line, which was a bad line (invalid JSON).
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start})", None
    if not text.strip():
        return None, None
    try:
        # Strictly: a key named twice (which one the user meant is anyone's guess), NaN or Infinity
        # (strict readers of the records, which keep the row's fields, refuse them) make a bad line.
        obj = strict_json(text)
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg} at column {exc.colno}", None
    except ValueError as exc:  # an integer of more than 4300 digits, nesting too deep to read
        return f"invalid JSON: {exc}", None
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}", None
    prompt = obj.get("prompt")
    if prompt is None:
        return "field 'prompt' is missing", None
    if not isinstance(prompt, str):
        return f"field 'prompt' must be a string, got {type(prompt).__name__}", None
    if not prompt.strip():
        return "field 'prompt' is empty", None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        return (
            "field 'prompt' holds an unpaired surrogate escape (\\ud800-\\udfff), not valid Unicode text",
            None,
        )
    unencodable = _unencodable_field(obj)
    if unencodable is not None:  # UTF-8 cannot carry it: no record could hold the row (cwd: the load raised)
        return (
            f"field {unencodable!r} holds an unpaired surrogate escape (\\ud800-\\udfff), not valid Unicode text",
            None,
        )
    images = [obj[f] for f in ("image", "docker_image") if obj.get(f) is not None]
    if any(not isinstance(i, str) or not i.strip() for i in images):
        return "field 'image'/'docker_image' must be a non-empty string", None
    if len(set(images)) > 1:
        return (
            f"field 'image'/'docker_image': two different images ({images[0][:60]!r}, {images[1][:60]!r}); give one",
            None,
        )
    image = images[0] if images else None
    if image is not None and (_CONTROL.search(image) or len(image.encode("utf-8")) > 4095):
        # No image reference or path holds one; printed as it is (the Docker preflight lists the
        # images), a row's escape sequences reached the terminal, and a 100,000-character one padded
        # every line of that list to its width.
        return (
            f"field 'image'/'docker_image' must be an image name or path (no control characters, at most "
            f"4095 bytes), got {image[:60]!r}",
            None,
        )
    cwd = obj.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd):
        return "field 'cwd' must be an absolute path string", None
    if cwd is not None and (
        len(cwd.encode("utf-8")) > 4095 or any(len(p.encode("utf-8")) > 255 for p in cwd.split("/"))
    ):
        return "field 'cwd' is too long a path (at most 4095 bytes, each name at most 255)", None
    try:
        options = _row_options(obj, catalog, toolsets)
        samples = _positive_int(obj, "samples", MAX_SAMPLES_PER_ROW)
        check = _row_check(obj)
    except ValueError as exc:
        return str(exc), None
    extra = {k: v for k, v in obj.items() if k not in ROW_RUN_FIELDS}
    row = Row(
        index=line_no - 1,
        prompt=prompt,
        image=image,
        cwd=cwd,
        occurrence=seen[prompt],
        row_fields=row_fields_text(extra),
        row_id=row_id_text(extra),
        options=options,
        samples=samples,
        check=check,
    )
    seen[prompt] += 1
    return None, row


def _unencodable_field(obj: dict[str, Any]) -> str | None:
    """The first field whose name or value, at any depth, holds a lone surrogate (a ``\\ud800`` escape),
    which UTF-8 cannot carry; None when every text can be written. Walked without recursion: the line
    may be nested as deep as Python's reader goes."""
    for key, value in obj.items():
        stack: list[Any] = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return key
            elif isinstance(item, dict):
                stack += [*item.keys(), *item.values()]
            elif isinstance(item, list):
                stack += item
    return None


def _row_check(obj: dict[str, Any]) -> RowCheck | None:
    """The row's check fields (answer, verify, verify_files, rubric), checked; None when it has none.
    They also stay in ``row_fields``, where they always travelled."""
    from batchrun.scoring import check_fields

    check = check_fields(obj)
    if check.verify_files and not check.verify:
        raise ValueError("field 'verify_files' needs a 'verify' command that uses them")
    return None if check.is_empty() else check


def _row_options(obj: dict[str, Any], catalog: Mapping[str, tuple[str, ...]], known: set[str]) -> RowOptions:
    """The row's own settings, checked; ValueError names the field and what is wrong with it."""
    toolsets = _names(obj, "toolsets", known, "toolset")
    tools = _names(obj, "tools", catalog, "tool")
    if tools is not None:
        if toolsets is not None:
            # An allowlisted tool none of the row's toolsets offers could never be offered: a mistake.
            outside = [t for t in tools if not set(catalog[t]) & set(toolsets)]
            if outside:
                raise ValueError(
                    f"field 'tools' names {outside[0]!r}, which none of the row's toolsets "
                    f"({', '.join(toolsets)}) offers (it is in: {', '.join(catalog[outside[0]])})"
                )
    system = obj.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise ValueError("field 'system' must be a non-empty string")
    if isinstance(system, str):
        try:
            system.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "field 'system' holds an unpaired surrogate escape, not valid Unicode text"
            ) from None
    options = RowOptions(
        toolsets=toolsets, tools=tools, system=system, max_turns=_positive_int(obj, "max_turns", MAX_TURNS)
    )
    return NO_OPTIONS if options == NO_OPTIONS else options


def _names(
    obj: dict[str, Any], field: str, known: Mapping[str, Any] | set[str], kind: str
) -> tuple[str, ...] | None:
    """A list of ``known`` names as a sorted tuple without repeats (order means nothing); None when absent."""
    value = obj.get(field)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"field {field!r} must be a list of names (strings), got {json.dumps(value)[:60]}")
    names = tuple(sorted(set(value)))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"field {field!r} names unknown {kind} {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )
    return names


def _positive_int(obj: dict[str, Any], field: str, high: int | None = None) -> int | None:
    value = obj.get(field)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < 1
        or (high is not None and value > high)
    ):
        limit = f" (at most {high})" if high is not None else ""
        raise ValueError(f"field {field!r} must be a positive integer{limit}, got {json.dumps(value)[:60]}")
    return value
