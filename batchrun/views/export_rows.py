"""What every export format shares (the plain formats in ``export``, the scored ones in ``export_scored``):
the request's errors and result, one record's messages, the samples of the runs, the split.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import os
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchrun.identity import Line, is_index, kept_line, outcome_line, outcome_sample, superseded_discards
from batchrun.record import read_score, valid_outcome_row
from batchrun.sharegpt import (
    ENCRYPTED_REASONING,
    parse_gpt_value,
    parse_tool_responses,
    split_system_value,
    strict_arguments,
    tool_call_text,
)
from batchrun.storage import WriteError, discard_temp, fsync_dir, iter_jsonl, json_line, temp_path

SPLITS = ("train", "test")
CARD_NAME = "README.md"
# The files an export writes into --out (their temp files too: .<name>.<pid>.tmp).
EXPORT_FILES = frozenset({CARD_NAME, *(f"{split}.{ext}" for split in SPLITS for ext in ("jsonl", "parquet"))})


class ExportError(ValueError):
    """A bad request (missing run, non-empty output directory, missing pyarrow): exit code 2."""


class NothingToExport(ExportError):
    """Every sample was left out (or there was none): exit code 1, and no dataset that cannot load."""


@dataclass(frozen=True)
class ExportOptions:
    """What to export and how (the command line's flags)."""

    fmt: str = "openai"
    reasoning: str = "field"  # field | think | drop
    include_partial: bool = True
    include_discarded: bool = False
    stop_reasons: frozenset[str] | None = None  # only these (None: every one not excluded)
    exclude_stop_reasons: frozenset[str] | None = None  # None: DEFAULT_EXCLUDED_STOP_REASONS for kept samples
    dedup: bool = False
    only_passed: bool = False  # --only_passed: samples whose check passed
    min_score: float | None = None  # --min_score: samples scored at least this


@dataclass
class ExportResult:
    """What an export wrote and what it left out, with the reason for each sample not written."""

    out: Path
    files: dict[str, Path] = field(default_factory=dict)  # split -> file
    rows: Counter[str] = field(default_factory=Counter)  # split -> rows written
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> samples or lines not written
    unsplit: int = 0  # samples written with their assistant text unsplit (ambiguous_markup discards)
    invalid_calls: int = 0  # samples written with a call whose arguments are no JSON object ({} in templates)
    notes: list[str] = field(default_factory=list)  # one line each, for stderr: what the user did not ask for

    def summary(self) -> str:
        written = ", ".join(f"{split} {self.rows[split]}" for split in self.files) or "nothing"
        text = f"exported {sum(self.rows.values())} samples ({written}) to {self.out}"
        if self.skipped:
            text += "; not exported: " + self.skipped_text()
        return text

    def skipped_text(self) -> str:
        return ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"


# ----------------------------------------------------------------------------- one record -> messages


def to_openai_messages(conversations: list[dict[str, Any]], *, unsplit: bool = False) -> list[dict[str, Any]]:
    """A record's ShareGPT conversation as OpenAI chat messages (keys that do not apply left out).

    ``unsplit``: assistant turns keep their text whole (reasoning markup included), for samples whose
    markup was ambiguous. Raises ValueError (or KeyError, ValueError) for a conversation
    that does not parse back.
    """
    messages: list[dict[str, Any]] = []
    for turn in conversations:
        who, value = turn.get("from"), turn.get("value")
        if not isinstance(value, str):
            raise ValueError(f"a {who!r} turn has no text value")
        if who == "system":
            own = split_system_value(value)  # a row's own system prompt, before the preamble
            if own is not None:
                messages.append({"role": "system", "content": own})
            continue  # the preamble around the tool list, which is exported as its own column
        if who == "human":
            messages.append({"role": "user", "content": value})
        elif who == "gpt":
            messages.append(_unsplit_message(turn, value) if unsplit else _assistant_message(turn, value))
        elif who == "tool":
            for resp in parse_tool_responses(value):
                if not isinstance(resp["tool_call_id"], str):
                    raise ValueError("a tool result's tool_call_id is not a string")
                messages.append(
                    {"role": "tool", "tool_call_id": resp["tool_call_id"], "content": resp["content"]}
                )
        else:
            raise ValueError(f"unknown turn kind {who!r}")
    return messages


def _structured_calls(turn: dict[str, Any]) -> list[dict[str, Any]]:
    structured = turn.get("tool_calls") or []
    for c in structured:  # typed as the columns are: a bad value would fail the whole Parquet row group
        if not all(isinstance(v, str) for v in (c["id"], c["function"]["name"], c["function"]["arguments"])):
            raise ValueError("a tool call's id, name or arguments is not a string")
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        }
        for c in structured
    ]


def _assistant_message(turn: dict[str, Any], value: str) -> dict[str, Any]:
    reasoning, content, parsed = parse_gpt_value(value)
    if reasoning == ENCRYPTED_REASONING:  # the runner's marker: the model's reasoning is not known
        reasoning = None
    calls = _structured_calls(turn)
    # The structured list carries the ids; the text must hold exactly the same calls, or one of the two is wrong.
    if [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls] != parsed:
        raise ValueError("the calls in a gpt turn's text differ from its tool_calls")
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _unsplit_message(turn: dict[str, Any], value: str) -> dict[str, Any]:
    """An assistant turn whose markup is ambiguous: its text as written (reasoning and words not cut
    apart), without only the call blocks the runner appended for its structured calls."""
    calls = _structured_calls(turn)
    blocks = "\n".join(tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
    text = value
    if blocks and value.endswith(blocks):
        text = value[: len(value) - len(blocks)].removesuffix("\n")
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def apply_reasoning(messages: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """``field``: reasoning in ``reasoning_content``; ``think``: folded into ``content`` as a leading
    ``<think>...</think>`` block; ``drop``: left out."""
    if mode == "field":
        return messages
    out = []
    for msg in messages:
        reasoning = msg.get("reasoning_content")
        msg = {k: v for k, v in msg.items() if k != "reasoning_content"}
        if mode == "think" and reasoning is not None:
            words = msg.get("content") or ""
            msg["content"] = (
                f"<think>\n{reasoning}\n</think>\n{words}" if words else f"<think>\n{reasoning}\n</think>"
            )
        out.append(msg)
    return out


def _raw_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls whose arguments are not a JSON object (an invalid_tool_call discard) keep them as written
    in ``raw_arguments`` too, so a reader need not guess which string is which."""
    for msg in messages:
        for call in msg.get("tool_calls") or []:
            if _arguments_object(call["function"]["arguments"]) is None:
                call["raw_arguments"] = call["function"]["arguments"]
    return messages


def _arguments_object(arguments: str) -> dict[str, Any] | None:
    try:  # strictly, as the runner read them: NaN or a lone surrogate escape would break the export's file
        value = strict_arguments(arguments)
    except (ValueError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def sample_messages(
    record: dict[str, Any], discard_reason: str | None, reasoning: str
) -> list[dict[str, Any]]:
    """A sample's messages as every message format starts from them: an ``ambiguous_markup`` discard's
    assistant text unsplit, ``reasoning`` applied, arguments that are not a JSON object kept in
    ``raw_arguments``. Raises ValueError (or KeyError, TypeError) for a conversation that does not parse
    back."""
    unsplit = discard_reason == "ambiguous_markup"
    messages = to_openai_messages(record["conversations"], unsplit=unsplit)
    return _raw_arguments(apply_reasoning(messages, reasoning))


def unsplit_warning(count: int, reasoning: str) -> str | None:
    """One line for all the exported samples whose assistant text was kept unsplit (``ambiguous_markup``
    discards), when ``--reasoning`` asked for what could not be done to them; None when nothing was
    left undone. Their reasoning stayed in ``content`` with no word of it (issue: an export asked to
    drop reasoning still held ``<think>`` blocks)."""
    if not count or reasoning == "think":  # think: reasoning in content is what was asked for
        return None
    samples = "1 exported sample" if count == 1 else f"{count} exported samples"
    return (
        f"warning: {samples} (ambiguous_markup discards) kept their assistant text unsplit, "
        f"<think> markup included: --reasoning={reasoning} was not applied to them"
    )


def holds_invalid_call(record: dict[str, Any]) -> bool:
    """Whether a call of the sample has arguments that are no JSON object (kept by --keep_invalid_tool_calls,
    or an invalid_tool_call discard): the template formats give it ``{}``, its text in ``raw_arguments``."""
    return any(
        _arguments_object(call["function"]["arguments"]) is None
        for turn in record.get("conversations") or ()
        if turn.get("from") == "gpt"
        for call in turn.get("tool_calls") or ()
    )


def invalid_calls_warning(count: int) -> str | None:
    """One line for the exported samples with such a call: a chat template renders ``{}`` for it, a call
    the model never wrote (and the tool's "invalid JSON" answer after it reads as said of ``{}``)."""
    if not count:
        return None
    samples = "1 exported sample holds" if count == 1 else f"{count} exported samples hold"
    return (
        f"warning: {samples} a call whose arguments are no JSON object (--keep_invalid_tool_calls, or "
        "invalid_tool_call discards): its arguments are {} for chat templates, which render a call the "
        "model never wrote, and its text is in raw_arguments; a run without --keep_invalid_tool_calls "
        "discards such samples"
    )


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for chat templates: each call's ``arguments`` as a JSON object (``{}`` for arguments that
    are not one; their text is in ``raw_arguments``)."""
    out = []
    for msg in messages:
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                parsed = _arguments_object(call["function"]["arguments"])
                calls.append({**call, "function": {**call["function"], "arguments": parsed or {}}})
            msg = {**msg, "tool_calls": calls}
        out.append(msg)
    return out


def split_prompt_completion(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """TRL's conversational prompt/completion: the leading system and user messages, then the rest."""
    cut = 0
    while cut < len(messages) and messages[cut]["role"] in ("system", "user"):
        cut += 1
    return messages[:cut], messages[cut:]


def _full_message(msg: dict[str, Any]) -> dict[str, Any]:
    """Every message key present (null where it does not apply): one Arrow type for all messages."""
    calls = msg.get("tool_calls")
    return {
        "role": msg["role"],
        "content": msg.get("content"),
        "reasoning_content": msg.get("reasoning_content"),
        "tool_calls": None
        if calls is None
        else [
            {
                "id": c["id"],
                "type": c["type"],
                "function": c["function"],
                "raw_arguments": c.get("raw_arguments"),
            }
            for c in calls
        ],
        "tool_call_id": msg.get("tool_call_id"),
    }


# ----------------------------------------------------------------------------- one record -> one row


def stop_reason_of(record: dict[str, Any]) -> str:
    """The sample's stop reason as the stop-reason filters compare it (``unknown`` when it has none)."""
    meta = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    return meta["stop_reason"] if isinstance(meta.get("stop_reason"), str) else "unknown"


def stop_reason_left_out(record: dict[str, Any], opts: ExportOptions, default: Collection[str]) -> str | None:
    """Why --stop_reasons or --exclude_stop_reasons leaves a sample out (a ``skipped`` reason), or None:
    named reasons are exactly those exported; else those excluded, ``default`` without the flag."""
    reason = stop_reason_of(record)
    if opts.stop_reasons is not None:  # named explicitly: exactly these, no default exclusion
        return None if reason in opts.stop_reasons else f"stop_reason {reason}"
    excluded = default if opts.exclude_stop_reasons is None else opts.exclude_stop_reasons
    return f"stop_reason {reason}" if reason in excluded else None


def stop_reasons_in(run_dirs: list[Path]) -> set[str]:
    """The stop reasons the runs' records hold, kept and discarded (as the filters read them)."""
    found: set[str] = set()
    for run_dir in run_dirs:
        for rec in iter_jsonl(run_dir / "trajectories.jsonl"):
            if isinstance(rec, dict):
                found.add(stop_reason_of(rec))
        for row in iter_jsonl(run_dir / "discarded.jsonl"):
            if isinstance(row, dict) and isinstance(row.get("record"), dict):
                found.add(stop_reason_of(row["record"]))
    return found


def sample_digest(record: dict[str, Any]) -> str:
    """What ``--dedup`` compares: the sample's conversation, byte for byte."""
    text = json.dumps(record.get("conversations"), ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def score_columns(record: dict[str, Any]) -> dict[str, Any]:
    """The sample's score as flat columns (``score_value``, ``score_passed``, ``scorer``): null when not judged."""
    score = read_score(record.get("score"))
    value, passed, scorer = score.get("value"), score.get("passed"), score.get("scorer")
    return {
        "score_value": float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else None,
        "score_passed": passed if isinstance(passed, bool) else None,
        "scorer": scorer if isinstance(scorer, str) else None,
    }


def split_of(prompt: str, seed: int, test_fraction: float) -> str:
    """``test`` for about ``test_fraction`` of prompts, decided by (seed, prompt text) alone."""
    if test_fraction <= 0:
        return "train"
    digest = hashlib.sha256(f"{seed}\0{prompt}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"


# ----------------------------------------------------------------------------- reading the run


def _samples(
    run_dir: Path, include_discarded: bool, skipped: Counter[str]
) -> Iterator[tuple[dict[str, Any], str | None]]:
    """(record, discard reason or None), streamed; what is not exported is counted in ``skipped``: malformed
    lines, the discards by reason (when they are not exported), and the samples that failed and have
    no outcome yet. A discard that no longer stands for its sample (run again and kept, or discarded
    again: ``superseded_discards``, as statistics.json counts them) is left out: with it, one sample
    was exported twice."""
    kept_at: Counter[Line] = Counter()
    for rec in iter_jsonl(run_dir / "trajectories.jsonl"):
        if rec is None:
            skipped["malformed lines"] += 1
            continue
        if (line := kept_line(rec)) is not None:
            kept_at[line] += 1
        yield rec, None
    stale = superseded_discards(run_dir / "discarded.jsonl", kept_at)
    discarded_at: set[Line] = set()
    for n, row in enumerate(iter_jsonl(run_dir / "discarded.jsonl")):
        if row is None:
            skipped["malformed lines"] += 1
            continue
        if valid_outcome_row(row, "reason") and is_index(row.get("prompt_index")):
            discarded_at.add(outcome_line(row))
        if n in stale:
            if include_discarded:
                skipped["discarded sample run again"] += 1
        elif not include_discarded:  # set aside by a quality filter: named, as the run's statistics name it
            skipped[f"discarded ({row.get('reason') or 'unknown'})"] += 1
        elif not isinstance(row.get("record"), dict):
            skipped["discarded without a record"] += 1
        else:
            yield row["record"], str(row.get("reason") or "unknown")
    # A failure is an attempt, not a sample: per (row, sample), the dataset lines whose attempts failed
    # beyond the lines that have an outcome (a resume of a reordered dataset finishes it at another line).
    failed: dict[tuple[str, int], set[int]] = {}
    for row in iter_jsonl(run_dir / "failed.jsonl"):
        if valid_outcome_row(row, "error_class") and is_index(row.get("prompt_index")):
            failed.setdefault(outcome_sample(row), set()).add(row["prompt_index"])
    finished = Counter((key, index) for key, index, *_ in {*kept_at, *discarded_at})
    unfinished = sum(max(0, len(lines) - finished[sample]) for sample, lines in failed.items())
    if unfinished:
        skipped["failed (no outcome yet; --resume runs it again)"] += unfinished


def _all_samples(
    run_dirs: list[Path], include_discarded: bool, skipped: Counter[str]
) -> Iterator[tuple[dict[str, Any], str | None, str]]:
    for run_dir in run_dirs:
        for record, reason in _samples(run_dir, include_discarded, skipped):
            yield record, reason, run_dir.resolve().name


_CALL = {"id": "string", "type": "string", "function": {"name": "string", "arguments": "string"}}
_MESSAGE = {
    "role": "string",
    "content": "string",
    "reasoning_content": "string",
    "tool_calls": [_CALL],
    "tool_call_id": "string",
}
_PARQUET_MESSAGE = {**_MESSAGE, "tool_calls": [{**_CALL, "raw_arguments": "string"}]}


# ----------------------------------------------------------------------------- writing the dataset


class RowWriter(Protocol):
    """A split file's writer: rows go to ``tmp`` (beside ``path``); ``finish`` flushes, fsyncs and closes
    it, ``abort`` closes it quietly. Both raise WriteError naming ``path``."""

    path: Path
    tmp: Path

    def write(self, row: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


class JsonlWriter:
    """One JSONL split file, written to its temp file."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, temp_path(path)
        try:
            self._fh = self.tmp.open("w", encoding="utf-8")
        except OSError as exc:
            raise WriteError(path, exc) from exc

    def write(self, row: dict[str, Any]) -> None:
        try:
            self._fh.write(json_line(row) + "\n")
        except OSError as exc:  # a full disk: the temp file is removed by the caller
            raise WriteError(self.path, exc) from exc

    def finish(self) -> None:
        sync_close(self._fh, self.path)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._fh.close()


def sync_close(fh: Any, path: Path) -> None:
    """Flush, fsync and close a split file's temp file ``fh``; WriteError naming ``path`` (a full disk)."""
    try:
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
    except OSError as exc:
        raise WriteError(path, exc) from exc


def make_out(out: Path) -> list[Path]:
    """Create ``out`` (and its missing parents); the directories it made, deepest first, for
    :func:`write_dataset` to take back when the export fails."""
    made: list[Path] = []
    path = out
    while not path.exists() and not path.is_symlink() and path != path.parent:
        made.append(path)
        path = path.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, a read-only place
        _remove_dirs(made)
        raise ExportError(f"cannot make the output directory {out}: {exc.strerror or exc}") from exc
    return made


BUSY = "another export is writing to {out} now; wait for it to end, or name another directory"


def lock_out(out: Path) -> int | None:
    """Hold ``out``'s lock (``flock`` on the directory itself: no file is left in it) for the export's
    writes, or raise ExportError if another export holds it. Two exports with --overwrite at one --out
    each renamed their files into place, and the directory ended with one's splits beside the other's
    card. None where the directory cannot be opened (it is not there yet)."""
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ExportError(BUSY.format(out=out)) from exc
        return None  # a file system without flock: as before
    return fd


def out_busy(out: Path) -> bool:
    """Whether another export holds ``out``'s lock now (checked before the runs are read)."""
    try:
        fd = lock_out(out)
    except ExportError:
        return True
    if fd is not None:
        os.close(fd)
    return False


def _remove_dirs(made: list[Path]) -> None:
    for path in made:  # deepest first; only while empty
        with contextlib.suppress(OSError):
            path.rmdir()


def write_dataset(
    out: Path,
    rows: Iterable[tuple[str, dict[str, Any]]],
    result: ExportResult,
    *,
    ext: str,
    open_writer: Callable[[Path], RowWriter],
    nothing: Callable[[], str],
    card: Callable[[], str],
) -> None:
    """Write the (split, row) pairs to ``out/<split>.<ext>`` and the dataset card, all or nothing.

    No row: NothingToExport(``nothing()``), and nothing on disk changes (no directory is made). Else every
    file goes to a temp file beside it, fsynced, and only once all are written are they renamed into
    place and an earlier export's split files that this one does not write removed; a failure (a full
    disk, a read-only directory) raises WriteError naming the file, removes the temp files and the
    directories this export made, and leaves an earlier export in ``out`` as it was. ``out`` is locked
    from its creation to the last rename (:func:`lock_out`): another export at it meanwhile is refused.
    """
    rows = iter(rows)
    first = next(rows, None)
    if first is None:  # datasets cannot load a dataset of no rows (JSONL or Parquet): no directory at all
        raise NothingToExport(nothing())
    made = make_out(out)
    try:
        lock = lock_out(out)
    except ExportError:
        _remove_dirs(made)
        raise
    writers: dict[str, RowWriter] = {}
    card_path = out / CARD_NAME
    card_tmp = temp_path(card_path)
    done = False
    try:
        for split, row in itertools.chain([first], rows):
            if split not in writers:
                writers[split] = open_writer(out / f"{split}.{ext}")
                result.files[split] = writers[split].path
            writers[split].write(row)
            result.rows[split] += 1
        for writer in writers.values():
            writer.finish()
        result.files = {s: result.files[s] for s in SPLITS if s in result.files}
        try:
            with card_tmp.open("w", encoding="utf-8") as fh:
                fh.write(card())
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise WriteError(card_path, exc) from exc
        _commit(out, [(w.tmp, w.path) for w in writers.values()] + [(card_tmp, card_path)])
        done = True
    finally:
        if not done:
            for writer in writers.values():
                writer.abort()
                discard_temp(writer.tmp)
            discard_temp(card_tmp)
            _remove_dirs(made)
        if lock is not None:
            os.close(lock)


def _commit(out: Path, moves: list[tuple[Path, Path]]) -> None:
    """Rename the written temp files into place, then remove the split files of an earlier export that
    this one did not write (a test split no longer asked for, the other format's files). Each place is
    looked at first: a directory at one failed its rename after the ones before it had replaced an
    earlier export's files, a mix of the two left."""
    for _, path in moves:
        if path.is_dir() and not path.is_symlink():
            raise WriteError(path, IsADirectoryError(errno.EISDIR, "a directory stands there"))
    path = out
    try:
        for tmp, path in moves:
            os.replace(tmp, path)
        kept = {final for _, final in moves}
        for split in SPLITS:
            for ext in ("jsonl", "parquet"):
                path = out / f"{split}.{ext}"
                if path not in kept:
                    path.unlink(missing_ok=True)
        fsync_dir(out)
    except OSError as exc:
        raise WriteError(path, exc) from exc
